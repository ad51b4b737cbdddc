"""Many candidates: the job file, run locally or on a Ray cluster (jobs.ray)."""
