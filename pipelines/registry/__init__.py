"""The model registry: the store, the evidence bundle, signatures, promotion and the MLflow export."""
