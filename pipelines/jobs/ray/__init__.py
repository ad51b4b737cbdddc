"""Scale-out: the registry job on a Ray cluster (`executor: ray`; docs/scale-out.md).

driver (the only writer of ledger and registry) -> cluster (connection, shared-store probe) -> graph
(baseline tasks before the candidates that need them) -> worker (what runs in each task's process), with
resources (each task's request from its plan) and tracker (queued / running / decided, time left).
"""
