"""Serving a promoted version with no single point of failure: a fallback chain of registry versions behind nginx, with
a circuit breaker and degradation rules (`quantize serve`, docs/fleet.md); the same deployment as Kubernetes manifests."""
