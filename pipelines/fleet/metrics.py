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

and every route's own vLLM series (vllm:*, read from its /metrics every RESCRAPE_S, bounded in size and time) with the
labels `deployment` and `route` added: `quantize watch --url http://127.0.0.1:PORT/metrics` reads the deployment as a
whole (it sums the series), Prometheus can split it by route. A route that does not answer keeps its last page until it
is restarted (its counters then start again from 0, as any restarted vLLM's do).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from pipelines.errors import InputError
from pipelines.fleet.state import ServeState
from pipelines.serve.bounded_http import get_bounded
from pipelines.serve.serving import LOOPBACK
from pipelines.serve.vllm_series import VLLM_PREFIX

METRICS_FILE = "metrics.prom"
RESCRAPE_S = 5.0
MAX_ROUTE_PAGE = 4 * 2**20  # vLLM's own page is about 50 KB
ROUTE_SCRAPE_TIMEOUT_S = 1.0


def live_route(state: ServeState) -> str | None:
    """The first route, in chain order, whose server runs and whose breaker is closed (no probe: the supervisor's view)."""
    traffic = state.traffic
    for index, route in enumerate(state.routes):
        breaker_open = traffic is not None and index < len(traffic.routes) and traffic.routes[index].breaker_open_since is not None
        if route.status == "up" and not breaker_open:
            return route.label
    return None


class RouteSeries:
    """The last vLLM page read from each route's server, by route label and the port it was read from."""

    def __init__(self) -> None:
        self.pages: dict[str, tuple[int, list[Metric]]] = {}
        self.read_at = 0.0

    def refresh(self, state: ServeState) -> None:
        if time.monotonic() - self.read_at < RESCRAPE_S:
            return
        self.read_at = time.monotonic()
        with httpx.Client() as client:
            for route in state.routes:
                if route.port is None or route.status != "up":
                    continue
                try:
                    page = get_bounded(client, f"http://{LOOPBACK}:{route.port}/metrics", field="metrics", max_bytes=MAX_ROUTE_PAGE,
                                       timeout_s=ROUTE_SCRAPE_TIMEOUT_S, what="vLLM metrics page")
                    families = [family for family in text_string_to_metric_families(page.decode("utf-8", errors="replace"))
                                if family.name.startswith(VLLM_PREFIX)]
                except (InputError, ValueError, TypeError, IndexError):
                    if self.pages.get(route.label, (route.port, []))[0] != route.port:
                        self.pages.pop(route.label, None)  # restarted: its old counters are gone
                    continue
                self.pages[route.label] = (route.port, families)

    def relabeled(self, deployment: str) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for label, (_, families) in sorted(self.pages.items()):
            for family in families:
                into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
                for sample in family.samples:
                    into.add_sample(sample.name, {**sample.labels, "deployment": deployment, "route": label}, sample.value, sample.timestamp)
        yield from merged.values()


class _DeploymentCollector(Collector):
    def __init__(self, state: ServeState, routes: RouteSeries | None):
        self.state = state
        self.routes = routes

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
        if self.routes is not None:
            yield from self.routes.relabeled(name)


def write_metrics(folder: Path, state: ServeState, routes: RouteSeries | None = None) -> Path:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_DeploymentCollector(state, routes))
    path = folder / METRICS_FILE
    write_to_textfile(str(path), registry)
    return path
