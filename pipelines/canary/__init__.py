"""The semantic canary: a promoted version's golden set (golden.py), built and its tolerance measured at promotion
(build.py), and probed against a running server (probe.py) by `watch` and the fleet's health check (docs/watch.md)."""
