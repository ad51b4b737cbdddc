"""From the deployment file's names to what each route serves: every model verified before anything starts.

For each route, in order:

1. The name resolves in the registry (an unknown model, version or alias is an InputError naming the route).
2. No route serves what an earlier one serves (the same version, the same artifact bytes, the same 16-bit folder):
   a chain that comes back to a model it already tried is a cycle, refused.
3. The version is `promoted` and its signed promotion bundle verifies: the signature with the key the registry
   recorded, every file, evidence that is this version's (pipelines/registry: the `registry verify` path). A version
   route serves that bundle, the bytes the signature covers.
4. A `base_of` route serves the 16-bit folder named by the version's signed gate.json (`inputs.baseline.path`), and only
   if that folder's hash is the `source_hash` the signed registry record holds.
5. Its vLLM arguments are the version's served spec (pipelines/deploy/spec.py: the load test's measured max_num_seqs,
   the max_model_len and KV space its servers ran with, this host's dtype), with the route's own overrides; a 16-bit
   route gets the same arguments. Its timeout is the file's, or `timeout_headroom` x the load test's end-to-end p99 at
   the measured max_num_seqs (TTFT p99 + TPOT p99 x (longest answer - 1)): the version's own figures, the 16-bit
   model's (the load test's baseline) for a base route; never below `min_timeout_s`, and for the last route, which has
   nothing to fall back to, never below `last_route_timeout_s`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from pipelines.deploy.spec import ServedSpec, envelope_of, spec_of
from pipelines.errors import InputError
from pipelines.files.hashing import folder_hash
from pipelines.fleet.deployment import Deployment, Route, route_field
from pipelines.gate.schema import GateReport
from pipelines.loadtest.results import PerformanceReport
from pipelines.registry.regates import require_gated_runtime
from pipelines.registry.store import Registry, Version
from pipelines.schema import StrictModel
from pipelines.serve.serving import ServeSettings


class Latency(StrictModel):
    """The load test's figures a route's timeout is derived from (milliseconds, at one concurrency)."""

    concurrency: int
    ttft_p99_ms: float
    tpot_p99_ms: float
    longest_answer_tokens: int
    e2e_p99_ms: float = Field(description="TTFT p99 + TPOT p99 x (longest answer - 1): an answer as long as the load test's longest")


class ResolvedRoute(StrictModel):
    """One route, verified: what it serves, with which arguments, and how long it may take."""

    index: int
    field: str = Field(description="where the file names it: primary, fallbacks[i]")
    label: str = Field(description="primary, fallback-1, ...")
    kind: Literal["version", "base"]
    ref: str = Field(description="as written: demo-llama@production")
    model: str
    version: int = Field(description="the registry version (for a base route: the version whose 16-bit model it is)")
    model_dir: Path
    bundle: Path | None = Field(default=None, description="a version route's signed promotion bundle (its golden set is there); None "
                                                           "for a base route, whose 16-bit model has no golden set of its own")
    identity: str = Field(description="what the route serves, for the cycle check: the artifact hash or the 16-bit folder's hash")
    verified: str = Field(description="what was checked, in words")
    serve: ServeSettings
    timeout_s: float
    timeout_basis: str
    latency: Latency | None = None

    def describe(self) -> str:
        what = f"{self.model} v{self.version}" if self.kind == "version" else f"16-bit base of {self.model} v{self.version}"
        return f"{self.label} ({what})"


def label(index: int) -> str:
    return "primary" if index == 0 else f"fallback-{index}"


def resolve_routes(deployment: Deployment, registry: Registry, *, source: Path | str, here: bool = True) -> list[ResolvedRoute]:
    """Every route of the chain resolved and verified, in order (the module docstring's steps). Any failure is an
    InputError naming the deployment file and the route's field; nothing has started yet. `here=False` (manifests for a
    cluster): the runtime of this machine is not the one that will serve, so it is not compared."""
    found = [_lookup(route, index, registry, source) for index, route in enumerate(deployment.routes)]
    _refuse_cycles(deployment.routes, found, source)
    pairs = enumerate(zip(deployment.routes, found, strict=True))
    return [_verified(route, index, version, deployment, registry, source, here) for index, (route, version) in pairs]


def _lookup(route: Route, index: int, registry: Registry, source: Path | str) -> Version:
    field = route_field(index)
    try:
        version = registry.show(route.ref.model, route.ref.ref)
    except InputError as error:
        raise InputError(f"{route.describe()}: {error.message} (registry {registry.path})", file=source, field=field) from None
    if version.status != "promoted":
        raise InputError(f"{route.describe()} is version {version.version}, which is {version.status}; a deployment serves promoted "
                         "versions only", file=source, field=field)
    return version


def _identity(route: Route, version: Version) -> str:
    return f"artifact {version.artifact_hash}" if route.model is not None else f"16-bit {version.source_hash}"


def _refuse_cycles(routes: list[Route], versions: list[Version], source: Path | str) -> None:
    seen: dict[str, int] = {}
    for index, (route, version) in enumerate(zip(routes, versions, strict=True)):
        identity = _identity(route, version)
        if identity in seen:
            earlier = seen[identity]
            raise InputError(
                f"{route.describe()} serves what {route_field(earlier)} ({routes[earlier].describe()}) already serves (version "
                f"{version.version}); a chain that returns to a model it already tried is a cycle", file=source, field=route_field(index),
            )
        seen[identity] = index


def _verified(route: Route, index: int, version: Version, deployment: Deployment, registry: Registry, source: Path | str,
              here: bool) -> ResolvedRoute:
    field = route_field(index)
    try:
        check = registry.verify_signature(version, required=True)
        assert check is not None  # required=True raises instead
        spec = spec_of(version, reference=str(route.ref), alias=route.ref.ref if isinstance(route.ref.ref, str) else None,
                       folder=check.bundle, signed=True, served_name=deployment.model_name)
    except InputError as error:
        raise InputError(f"{route.describe()} (version {version.version}) does not verify: {error.one_line()}", file=source, field=field) from None
    verified = f"signature {check.method} {check.key_id[:12]}, {check.files} files, evidence {check.evidence}"
    if route.model is not None and here:  # a quantized route: its verdict holds only on a runtime it was gated on
        try:
            verified += "".join(f"; {note}" for note in require_gated_runtime(registry, version, check.bundle))
        except InputError as error:
            raise InputError(f"{route.describe()}: {error.message}", file=source, field=field) from None
    if route.model is not None:
        kind: Literal["version", "base"] = "version"
        model_dir = spec.folder
        latency = latency_of(version.gate, spec, "candidate")
    else:
        kind = "base"
        model_dir = _verified_base(version, source, field)
        verified += f"; 16-bit folder hash = the signed source_hash {version.source_hash[:12]}"
        latency = latency_of(version.gate, spec, "baseline")
    timeout_s, basis = route_timeout(route, latency, deployment, source=source, field=field, last=index == len(deployment.routes) - 1)
    return ResolvedRoute(
        index=index, field=field, label=label(index), kind=kind, ref=str(route.ref), model=version.model, version=version.version,
        model_dir=model_dir, bundle=check.bundle if kind == "version" else None, identity=_identity(route, version), verified=verified,
        serve=served_settings(spec, route, max_queue=deployment.rules.overload.max_queue),
        timeout_s=timeout_s, timeout_basis=basis, latency=latency,
    )


def _verified_base(version: Version, source: Path | str, field: str) -> Path:
    """The 16-bit folder the version's signed gate.json names, if its hash is the signed source_hash."""
    baseline = version.gate.inputs.get("baseline") if version.gate is not None else None
    path = baseline.get("path") if isinstance(baseline, dict) else None
    if not isinstance(path, str) or not path:
        raise InputError(f"version {version.version} of {version.model!r}: its gate evidence names no 16-bit model", file=source, field=field)
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise InputError(f"the 16-bit model of {version.model} v{version.version} is not at {folder} any more", file=source, field=field)
    if folder_hash(folder) != version.source_hash:
        raise InputError(f"the 16-bit model at {folder} changed since {version.model} v{version.version} was gated (its hash is not the "
                         "signed source_hash)", file=source, field=field)
    return folder


def served_settings(spec: ServedSpec, route: Route, *, max_queue: int) -> ServeSettings:
    """The arguments the version was measured with (pipelines/deploy/spec.py), with the route's own overrides, and the route's
    queue: vLLM answers 503 at once beyond max_num_seqs running + `max_queue` waiting (the overload rule: a busy route's
    answer, which the proxy hands down the chain without counting it against the route's breaker)."""
    update = {name: value for name, value in (("max_num_seqs", route.max_num_seqs), ("max_model_len", route.max_model_len),
                                              ("cpu_kv_cache_gib", route.kv_cache_gib)) if value is not None}
    settings = spec.args.serve_settings().model_copy(update=update)
    return settings.model_copy(update={"max_num_queued_reqs": settings.max_num_seqs + max_queue})


def latency_of(gate: GateReport | None, spec: ServedSpec, role: Literal["candidate", "baseline"]) -> Latency | None:
    """The load test's latency of the version (`candidate`) or of its 16-bit model (`baseline`) at the measured max_num_seqs,
    with the longest answer of the load test's workload; None without a load test."""
    performance = gate.performance if gate is not None else None
    if performance is None:
        return None
    own = performance if role == "candidate" else _only(performance, role)
    envelope = envelope_of(own, spec.args.max_num_seqs, spec.envelope.gate_path if spec.envelope else None) if own is not None else None
    if envelope is None:
        return None
    longest = performance.workload.get("output_tokens")
    answer = longest.get("max") if isinstance(longest, dict) else None
    tokens = int(answer) if isinstance(answer, (int, float)) and answer >= 1 else 1
    ttft, tpot = envelope.level.ttft_ms.p99, envelope.level.tpot_ms.p99
    return Latency(concurrency=envelope.concurrency, ttft_p99_ms=ttft, tpot_p99_ms=tpot, longest_answer_tokens=tokens,
                   e2e_p99_ms=ttft + tpot * (tokens - 1))


def _only(performance: PerformanceReport, role: Literal["candidate", "baseline"]) -> PerformanceReport | None:
    figures = performance.figures(role)
    return performance.model_copy(update={"models": [figures]}) if figures is not None else None


def route_timeout(route: Route, latency: Latency | None, deployment: Deployment, *, source: Path | str, field: str,
                  last: bool = False) -> tuple[float, str]:
    """The route's timeout and why: the file's, else headroom x the load test's e2e p99 (at least min_timeout_s); the last
    route has nothing to fall back to, so it waits at least last_route_timeout_s (a slow answer beats none)."""
    rules = deployment.rules
    if route.timeout_s is not None:
        return route.timeout_s, "set in the deployment file"
    if latency is None:
        raise InputError(f"{route.describe()} has no load-test envelope (gate.json performance) to derive a timeout from; set "
                         "`timeout_s` on this route", file=source, field=f"{field}.timeout_s")
    derived = rules.timeout_headroom * latency.e2e_p99_ms / 1000
    basis = (f"{rules.timeout_headroom:g} x e2e p99 {latency.e2e_p99_ms:.0f} ms (TTFT p99 {latency.ttft_p99_ms:.0f} ms + TPOT p99 "
             f"{latency.tpot_p99_ms:.1f} ms x {latency.longest_answer_tokens - 1}, load test at concurrency {latency.concurrency})")
    if last and derived < rules.last_route_timeout_s:
        return rules.last_route_timeout_s, f"last_route_timeout_s: the last route has nothing to fall back to (derived {derived:.2f} s: {basis})"
    if derived < rules.min_timeout_s:
        return rules.min_timeout_s, f"min_timeout_s (derived {derived:.2f} s: {basis})"
    return round(derived, 3), basis
