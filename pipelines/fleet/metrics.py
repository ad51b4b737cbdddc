"""The deployment's own Prometheus series, for `quantize watch`, Prometheus and the alert rules: which route is live,
whether the deployment is degraded, each breaker, and the proxy's traffic per route.

The supervisor rewrites `metrics.prom` in the run folder once a second (prometheus_client's write_to_textfile: written
aside and renamed), and nginx serves it at the endpoint's `/metrics` (no key, like vLLM's own /metrics):

    quantgate_deployment_degraded{deployment}              1 when the live route is not the primary (or none is)
    quantgate_route_live{deployment,route}                 1 for the route new requests go to
    quantgate_route_up{deployment,route}                   1 while the route's server runs
    quantgate_route_breaker_open{deployment,route}         1 while nginx keeps the route out (max_fails reached)
    quantgate_route_restarts_total{deployment,route}
    quantgate_route_answered_total{deployment,route}       requests the route answered
    quantgate_route_failed_total{deployment,route,why}     requests the route was tried for and did not answer
    quantgate_requests_total{deployment}, quantgate_requests_failed_total{deployment,why}
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pipelines.fleet.state import ServeState

METRICS_FILE = "metrics.prom"


def live_route(state: ServeState) -> str | None:
    """The first route, in chain order, whose server runs and whose breaker is closed (no probe: the supervisor's view)."""
    traffic = state.traffic
    for index, route in enumerate(state.routes):
        breaker_open = traffic is not None and index < len(traffic.routes) and traffic.routes[index].breaker_open_since is not None
        if route.status == "up" and not breaker_open:
            return route.label
    return None


class _DeploymentCollector(Collector):
    def __init__(self, state: ServeState):
        self.state = state

    def collect(self) -> Iterator[Metric]:
        state, name = self.state, self.state.name
        live = live_route(state)
        traffic = state.traffic
        degraded = GaugeMetricFamily("quantgate_deployment_degraded", "1 when the live route is not the primary", labels=["deployment"])
        degraded.add_metric([name], float(live != state.routes[0].label))
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "live": GaugeMetricFamily("quantgate_route_live", "1 for the route new requests go to", labels=["deployment", "route"]),
            "up": GaugeMetricFamily("quantgate_route_up", "1 while the route's server runs", labels=["deployment", "route"]),
            "open": GaugeMetricFamily("quantgate_route_breaker_open", "1 while the route's breaker is open", labels=["deployment", "route"]),
            "restarts": CounterMetricFamily("quantgate_route_restarts", "restarts of the route's server", labels=["deployment", "route"]),
            "answered": CounterMetricFamily("quantgate_route_answered", "requests the route answered", labels=["deployment", "route"]),
            "failed": CounterMetricFamily("quantgate_route_failed", "requests the route did not answer", labels=["deployment", "route", "why"]),
        }
        for index, route in enumerate(state.routes):
            seen = traffic.routes[index] if traffic is not None and index < len(traffic.routes) else None
            labels = [name, route.label]
            families["live"].add_metric(labels, float(route.label == live))
            families["up"].add_metric(labels, float(route.status == "up"))
            families["open"].add_metric(labels, float(seen is not None and seen.breaker_open_since is not None))
            families["restarts"].add_metric(labels, route.restarts)
            families["answered"].add_metric(labels, seen.answered if seen else 0)
            for why, count in (seen.failed.items() if seen else []):
                families["failed"].add_metric([*labels, why], count)
        requests = CounterMetricFamily("quantgate_requests", "requests through the proxy", labels=["deployment"])
        requests.add_metric([name], traffic.requests if traffic else 0)
        lost = CounterMetricFamily("quantgate_requests_failed", "requests no route answered", labels=["deployment", "why"])
        for why, count in (traffic.failed.items() if traffic else []):
            lost.add_metric([name, why[:200]], count)
        yield degraded
        yield from families.values()
        yield requests
        yield lost


def write_metrics(folder: Path, state: ServeState) -> Path:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_DeploymentCollector(state))
    path = folder / METRICS_FILE
    write_to_textfile(str(path), registry)
    return path
