"""Deployment of a promoted, verified registry version: what to serve it with (spec), and the files a deployment
needs (the serve command, Prometheus scrape config and alert rules, a Grafana dashboard: files)."""
