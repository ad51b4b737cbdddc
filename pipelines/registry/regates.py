"""Re-gates: a promoted version's verdict re-checked on another serving runtime, kept as signed evidence beside its
bundle, and the check that the runtime at hand is one the version was gated or re-gated on.

A promotion bundle is signed once and never changes (any file added after signing is refused), so each re-gate is
a signed folder of its own, recorded by the registry like the promotion itself:

    <registry folder>/promoted/<model>/v<N>/                  the promotion bundle (gate.json records inputs.runtime)
    <registry folder>/promoted/<model>/v<N>.regates/<stamp>/  regate.json + model.sig (one per re-gate)

and a `regated` event on the version holds the signature record (public key included) and the verdict. A re-gate
counts only when its event's signature verifies against its folder, so an edited or planted regate.json accepts
no runtime.

`require_gated_runtime` is what `serve`, `deploy` and `watch --version` call: the runtime here must equal (no
`Runtime.changes`) the one gate.json recorded or one a passing re-gate recorded; otherwise the version is refused
(one line naming what changed and the command that re-gates it), or, when the version's own policy says
`runtime_change: warn`, served with that line as a warning.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from pipelines.console.output import progress
from pipelines.errors import InputError, ServeError
from pipelines.files.atomic import hidden_sibling, storage_error, write_json_atomic
from pipelines.files.jsonio import read_json_object
from pipelines.files.yamlio import MAX_JSON_BYTES
from pipelines.hardware.runtime import Runtime, recorded_runtime, runtime_here
from pipelines.registry.evidence import EVIDENCE_DIR, GATE_JSON, POLICY_APPLIED, PROVENANCE, registry_record
from pipelines.registry.signing import load_signer, parse_record, sign_folder, signature_record, verify_bundle
from pipelines.registry.store import Registry, Version
from pipelines.schema import StrictModel
from pipelines.serve.serving import serve_versions

REGATE_JSON = "regate.json"
RuntimeChange = Literal["refuse", "warn"]


class SetOutcome(StrictModel):
    name: str
    verdict: Literal["passed", "failed", "not scored"]
    reasons: list[str] = Field(default_factory=list)
    worsening_bound: float | None = Field(default=None, description="the one-sided bound the tolerance rule read, in the set's unit")
    tolerance: float | None = None
    unchanged_reject_probability: float | None = Field(
        default=None, description="P(this set rejects an unchanged candidate) at the discordance measured on this runtime")


class RegateRecord(StrictModel):
    """One re-gate of a promoted version (regate.json, signed)."""

    model: str
    version: int
    registry_record: dict[str, Any] = Field(description="the version's identity (its bundle's evidence/registry.json)")
    at: str
    verdict: Literal["passed", "failed"]
    reasons: list[str]
    runtime: Runtime = Field(description="the runtime this re-gate measured on")
    gated_runtime: Runtime = Field(description="the runtime the promotion's gate measured on")
    changes: list[str] = Field(description="what differs between the two")
    sets: list[SetOutcome]
    stopped_early: bool = Field(description="true when a failed set ended it before every set was scored")
    divergence: dict[str, Any] | None = Field(default=None, description="the golden set's probe on this runtime (semantic canary)")
    error_rates: str
    unchanged_reject_probability: float | None = Field(
        default=None, description="P(some scored set rejects an unchanged candidate), sets independent, at this runtime's discordance")
    run_dir: str | None = None
    cost_s: float


def regates_folder(bundle: Path) -> Path:
    return bundle.parent / f"{bundle.name}.regates"


def gated_runtime(bundle: Path) -> Runtime:
    """The runtime the bundle's gate.json says its verdict was measured on."""
    evidence = bundle / EVIDENCE_DIR
    gate, _ = read_json_object(evidence / GATE_JSON, what="gate.json", max_bytes=MAX_JSON_BYTES)
    provenance_path = evidence / PROVENANCE
    provenance = read_json_object(provenance_path, what="provenance.json", max_bytes=MAX_JSON_BYTES)[0] if provenance_path.is_file() else None
    return recorded_runtime(gate, provenance, file=evidence / GATE_JSON)


def record_regate(registry: Registry, version: Version, record: RegateRecord, bundle: Path) -> Path:
    """regate.json signed into its own folder beside the bundle, then the `regated` event holding the signature
    record; the folder is removed if the event cannot be written (no unrecorded evidence is left)."""
    signer = load_signer(registry.path)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    final = regates_folder(bundle) / f"{stamp}-{record.runtime.host_class.replace(':', '-')}"
    staging = hidden_sibling(final)
    try:
        folder = staging / final.name
        folder.mkdir(parents=True)
        write_json_atomic(folder / REGATE_JSON, record.model_dump(mode="json"))
        started = time.monotonic()
        sign_folder(folder, signer)
        sign_s = time.monotonic() - started
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(folder, final)
    except OSError as error:
        raise storage_error(error, final) from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    signature = signature_record(final, signer, sign_s)
    try:
        registry.record_regate(version.model, version.version, f"re-gated on {record.runtime.host_class}: {record.verdict}", {
            "signature": signature.model_dump(mode="json"), "verdict": record.verdict, "runtime": record.runtime.model_dump(mode="json"),
            "summary": record.runtime.summary(), "changes": record.changes, "cost_s": record.cost_s,
        })
    except BaseException:
        shutil.rmtree(final, ignore_errors=True)
        raise
    return final


def regated_runtimes(registry: Registry, version: Version) -> list[tuple[Runtime, str, dict[str, Any]]]:
    """Every re-gate the registry recorded for `version`, oldest first: (runtime, verdict, the event's evidence)."""
    found = []
    for event in registry.history(version.model, version=version.version):
        if event.kind != "regated" or event.version != version.version:
            continue
        evidence = event.evidence or {}
        try:
            runtime = Runtime.model_validate(evidence.get("runtime"))
        except ValidationError:
            raise InputError(f"a regated event of {version.model} v{version.version} holds no readable runtime", file=registry.path,
                             field="events.evidence.runtime") from None
        found.append((runtime, str(evidence.get("verdict")), evidence))
    return found


Regated = list[tuple[Runtime, str, dict[str, Any]]]


def accepted_runtime(registry: Registry, version: Version, bundle: Path, here: Runtime) -> str | None:
    """Where the verdict for `here` comes from ("the gate", "a re-gate"), or None when `here` is neither the gate's runtime
    nor one re-gated with a pass. A failed re-gate of a runtime, the gate's own included, vetoes it for good: retrying
    until one passes would multiply the false-pass rate (each attempt is a `regated` event), so serving there takes a
    new gate run, i.e. a new version. Only the latest passing re-gate's signed folder is read, so a broken folder of
    another runtime's re-gate blocks nothing."""
    source = _source(gated_runtime(bundle), regated_runtimes(registry, version), here)
    if isinstance(source, dict):
        _verified_record(registry, version, bundle, source)
        return "a re-gate"
    return source


def _source(gated: Runtime, regates: Regated, here: Runtime) -> str | dict[str, Any] | None:
    """accepted_runtime's decision without reading anything: "the gate", the passing re-gate's event evidence (its signed
    folder still to verify), or None."""
    same = [(verdict, evidence) for runtime, verdict, evidence in regates if not runtime.changes(here)]
    if not same:
        return None if gated.changes(here) else "the gate"
    if any(verdict != "passed" for verdict, _ in same):
        return None
    return same[-1][1]


def _verified_record(registry: Registry, version: Version, bundle: Path, evidence: dict[str, Any]) -> RegateRecord:
    """The re-gate a `regated` event names: its signature verifies (an edited regate.json is refused like any tampered
    bundle file), its folder is this version's, and the record is this version's and passed."""
    record = parse_record(evidence)
    if record is None:
        raise InputError(f"a regated event of {version.model} v{version.version} has no signature record", file=registry.path,
                         field="events.evidence.signature")
    folder = Path(record.bundle)
    if folder.parent != regates_folder(bundle):
        raise InputError(f"the re-gate folder is not beside v{version.version}'s bundle ({regates_folder(bundle)})", file=folder)
    check = verify_bundle(record)
    regate = _read_record(check.bundle / REGATE_JSON)
    if regate.registry_record != registry_record(version) or regate.verdict != "passed":
        raise InputError(f"the re-gate record is not a passing re-gate of {version.model} v{version.version}", file=check.bundle / REGATE_JSON,
                         field="registry_record")
    return regate


def _read_record(path: Path) -> RegateRecord:
    data, _ = read_json_object(path, what="regate.json", max_bytes=MAX_JSON_BYTES)
    try:
        return RegateRecord.model_validate(data)
    except ValidationError as error:
        problem = " ".join(str(error).split())[:200]
        raise InputError(f"not a re-gate record this quantgate reads ({problem})", file=path, field="(top level)") from None


def runtime_change_action(bundle: Path) -> RuntimeChange:
    """The version's own policy (as applied at its gate) on a changed runtime: refuse unless it says warn."""
    path = bundle / EVIDENCE_DIR / POLICY_APPLIED
    if not path.is_file():
        return "refuse"
    policy, _ = read_json_object(path, what="policy.json", max_bytes=MAX_JSON_BYTES)
    return "warn" if policy.get("runtime_change") == "warn" else "refuse"


def serve_packages_here() -> dict[str, str] | None:
    """The serve environment's versions, or None when this machine has none (nothing can be served here)."""
    try:
        return serve_versions()
    except (ServeError, OSError, ValueError, subprocess.CalledProcessError):
        return None


def require_gated_runtime(registry: Registry, version: Version, bundle: Path, *, field: str = "runtime") -> list[str]:
    """Refuse (InputError) serving `version` on a runtime it was neither gated nor re-gated on, unless its policy says
    `runtime_change: warn` (then the warning is printed and returned). [] when the runtime is an accepted one; a note
    when this machine has no serve environment to compare (files written for another machine)."""
    packages = serve_packages_here()
    if packages is None:
        return ["the serving runtime was not compared with the gated one: no serve environment here (`make setup` builds it)"]
    gated, regates = gated_runtime(bundle), regated_runtimes(registry, version)
    # Without the kernels first: a changed host class or library is decided without probing this host's kernels.
    here = runtime_here(bundle, {}, packages, kernels=False)
    if _source(gated, regates, here) is not None:
        here = runtime_here(bundle, {}, packages)
        source = _source(gated, regates, here)
        if isinstance(source, dict):
            _verified_record(registry, version, bundle, source)  # once, on the decision: a signed folder is hashed
        if source is not None:
            return []
    changes = gated.changes(here) or ["the re-gate on this runtime failed"]
    line = (f"{version.model} v{version.version} was gated on another runtime ({'; '.join(changes[:4])}"
            f"{'; ...' if len(changes) > 4 else ''}): re-gate it here first with `quantize regate {version.model}@{version.version}`")
    if runtime_change_action(bundle) == "warn":
        progress(f"warning: {line} (its policy says runtime_change: warn)")
        return [line]
    raise InputError(line, file=registry.path, field=field)
