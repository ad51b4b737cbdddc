"""Deployment of a promoted, verified registry version: what to serve it with (spec), the envelope its load test measured
and the limits production is held to (envelope, limits: `quantize watch` reads them from here), and the files a deployment
needs (the serve command, Prometheus scrape config, SLO and alert rules, a Grafana dashboard: files, promql, slo)."""
