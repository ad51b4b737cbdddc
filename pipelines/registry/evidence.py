"""The promotion bundle: the artifact's files plus an `evidence/` folder, so that one signature covers both.

A gate run writes its evidence into its run folder (`write_run_evidence`): the per-item results of both
models, the policy file as written and as applied, the recipe as written, and provenance.json (hashes of the
calibration texts, of every file of every eval set, of the base model and the artifact; tool and library
versions). At promotion, `staged_bundle` assembles

    <registry folder>/promoted/<model>/v<version>/
        config.json, *.safetensors, tokenizer files, ...   copied from the candidate, each checked against
        manifest.json                                       its sha256 in the manifest as it is copied
        evidence/  gate.json  report.md (+ its load-test plots)  registry.json  provenance.json  policy.yaml
                   policy.json  recipe.yaml  items/<eval set>.jsonl  samples/{baseline,candidate}/...
                   canary.json (the golden set the runner fixed on the promoted candidate's server: pipelines.canary)
        model.sig                                           (pipelines.registry.signing)

One bundle per promoted version, never shared: candidate artifacts are content-addressed and reused by later
runs (pipelines.quantize.oneshot), and two promotions of one artifact (two gate runs) carry different evidence, so
evidence never goes into the candidate folder (whose manifest lists every file it may hold). vLLM serves the
bundle as it serves the candidate: it reads config.json, the weights and the tokenizer, and ignores the rest.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import ValidationError

from pipelines.artifact import MANIFEST_NAME, load_manifest, read_manifest
from pipelines.errors import InputError, QuantGateError
from pipelines.evaluation import baseline
from pipelines.files.atomic import hidden_sibling, storage_error
from pipelines.files.hashing import file_hashes, sha256_file, sha256_json
from pipelines.files.safepath import safe_component
from pipelines.files.yamlio import MAX_JSON_BYTES, read_user_bytes
from pipelines.gate.schema import GateReport
from pipelines.gate.verdict import SetComparison
from pipelines.registry.database import files_anchor
from pipelines.registry.signing import SIGNATURE_NAME, BundleCheck, parse_record, verify_bundle

if TYPE_CHECKING:
    from pipelines.evaluation.evalsets import EvalSet
    from pipelines.gate.policy import Policy

EVIDENCE_DIR = "evidence"
ITEMS_DIR = "items"
SAMPLES_DIR = "samples"
SERVED_ROLES = ("baseline", "candidate")  # the run folder's lm-eval output of each model (pipelines.runs.runner)
PROVENANCE = "provenance.json"
REGISTRY_RECORD = "registry.json"
POLICY_FILE = "policy.yaml"
POLICY_APPLIED = "policy.json"
RECIPE_FILE = "recipe.yaml"
GATE_JSON, REPORT_MD = "gate.json", "report.md"
BUNDLES_DIR = "promoted"
PACKAGES = ("quantgate", "model-signing", "llmcompressor", "compressed-tensors", "transformers", "torch", "lm-eval", "datasets")


class VersionLike(Protocol):
    """What the bundle needs of a registry version (pipelines.registry.store.Version; the registry calls this module,
    so it is named by its shape, not imported)."""

    @property
    def model(self) -> str: ...
    @property
    def version(self) -> int: ...
    @property
    def artifact_path(self) -> str: ...
    @property
    def artifact_hash(self) -> str: ...
    @property
    def manifest_hash(self) -> str | None: ...
    @property
    def gate_hash(self) -> str | None: ...
    @property
    def gate_path(self) -> str | None: ...
    @property
    def source_hash(self) -> str: ...
    @property
    def recipe_name(self) -> str: ...
    @property
    def recipe_hash(self) -> str: ...
    @property
    def eval_sets(self) -> Sequence[Any]: ...  # EvalSetRef: name, hash


class PromotionCheck(BundleCheck):
    """A verified promotion: the verified bundle (who signed it, its size, the time the check took), its version and
    the evidence's verdict."""

    model: str
    version: int
    evidence: str


# ------------------------------------------------------------------------------ at gate time


def write_run_evidence(
    run_dir: Path, *, artifact_dir: Path, recipe: dict[str, Any], policy_path: Path, policy: Policy, eval_sets: list[EvalSet],
    comparisons: list[SetComparison], report: GateReport,
) -> None:
    """The run's evidence beside gate.json: what a promotion bundle carries besides gate.json and report.md.
    `recipe`: its name and sha256 as the run knows them."""
    folder = run_dir / EVIDENCE_DIR
    (folder / ITEMS_DIR).mkdir(parents=True, exist_ok=True)
    for comparison in comparisons:
        lines = [item.model_dump_json() for item in comparison.items]
        (folder / ITEMS_DIR / f"{safe_component(comparison.eval_set, 'eval set')}.jsonl").write_text("\n".join(lines) + "\n")
    shutil.copyfile(policy_path, folder / POLICY_FILE)
    _write_json(folder / POLICY_APPLIED, policy.model_dump(mode="json"))
    manifest = read_manifest(artifact_dir)
    if manifest is not None:
        (folder / RECIPE_FILE).write_text(manifest.recipe_text)
    _write_json(folder / PROVENANCE, {
        "base_model": report.inputs.get("baseline"),
        "artifact": report.inputs.get("artifact"),
        "policy": report.inputs.get("policy"),
        "recipe": recipe,
        "calibration": manifest.calibration.model_dump() if manifest and manifest.calibration else None,  # sha256 of its texts
        "eval_sets": {s.name: {"sha256": s.sha256, "files": file_hashes(s.folder)} for s in eval_sets},
        "host": report.inputs.get("host"),
        "versions": {"project": _package_versions(), "quantize": manifest.versions if manifest else None, "serve": _serve_versions()},
    })


def _package_versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = package_version(name)
        except PackageNotFoundError:
            continue
    return found


def _serve_versions() -> dict[str, str]:

    try:
        return baseline.serve_versions()  # cached: the run keyed its scores by it already
    except (QuantGateError, OSError, ValueError):
        return {}


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True, default=str) + "\n")


# ------------------------------------------------------------------------------ at promotion


def bundle_path(registry_path: Path, version: VersionLike) -> Path:
    model = safe_component(version.model, "model")
    return files_anchor(registry_path).resolve().parent / BUNDLES_DIR / model / f"v{version.version}"


@contextmanager
def staged_bundle(version: VersionLike, final: Path, run_dir: Path | None) -> Iterator[Path]:
    """A complete bundle (artifact + evidence) in a hidden folder, for the caller to sign; renamed to `final`
    when the block succeeds, removed when it fails. Its folder already has the final name (the signature's
    subject names the model folder)."""
    if final.exists():
        _refuse_foreign_bundle(final, version)
    parent = hidden_sibling(final)
    try:
        folder = parent / final.name
        copy_artifact(Path(version.artifact_path), folder, version)
        copy_evidence(version, run_dir, folder / EVIDENCE_DIR)
        yield folder
        if final.exists():  # left by an attempt that died before the registry recorded it
            shutil.rmtree(final)
        os.replace(folder, final)
    except OSError as error:
        raise storage_error(error, final) from error
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def copy_artifact(artifact_dir: Path, folder: Path, version: VersionLike) -> None:
    """manifest.json and every file it lists, each copy checked against its recorded sha256."""
    document = load_manifest(artifact_dir)
    if version.manifest_hash is not None and document.sha256 != version.manifest_hash:
        raise InputError("manifest.json changed since the version was registered", file=document.path)
    if sha256_json(document.files) != version.artifact_hash:
        raise InputError("the artifact's files are not the ones the version was registered with", file=document.path)
    reserved = [name for name in document.files if name == SIGNATURE_NAME or name.split("/")[0] == EVIDENCE_DIR]
    if reserved:
        raise InputError(f"the artifact holds {reserved[0]}, a name the promotion bundle reserves", file=document.path,
                         field="artifact_files")
    for relative, digest in sorted(document.files.items()):
        target = folder / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(artifact_dir / relative, target)
        if sha256_file(target) != digest:
            raise InputError("file does not match its sha256 in the manifest (tampered or corrupt)", file=artifact_dir / relative)
    shutil.copyfile(document.path, folder / MANIFEST_NAME)


def copy_evidence(version: VersionLike, run_dir: Path | None, folder: Path) -> None:
    """gate.json (the registered one: its hash must be the version's), report.md and the run's evidence."""
    folder.mkdir(parents=True)
    gate = _registered_gate(version, run_dir)
    if gate is not None:
        shutil.copyfile(gate, folder / GATE_JSON)
        if (gate.parent / REPORT_MD).is_file():
            shutil.copyfile(gate.parent / REPORT_MD, folder / REPORT_MD)
        if (gate.parent / EVIDENCE_DIR).is_dir():
            shutil.copytree(gate.parent / EVIDENCE_DIR, folder, dirs_exist_ok=True, symlinks=False)
        for figure in sorted(gate.parent.glob("*.png")):  # the load test's plots report.md shows
            shutil.copyfile(figure, folder / figure.name)
        _copy_samples(gate.parent, folder / SAMPLES_DIR)
    _write_json(folder / REGISTRY_RECORD, registry_record(version))


def _copy_samples(run_dir: Path, folder: Path) -> None:
    """lm-eval's own per-sample files (each item's prompt, the model's answer, the metric) of the models this run
    served; a model whose scores came from the cache was served by an earlier run, and items/ has its values."""
    for role in SERVED_ROLES:
        for path in sorted((run_dir / role).rglob("samples_*.jsonl")):
            target = folder / role / path.relative_to(run_dir / role)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)


def _registered_gate(version: VersionLike, run_dir: Path | None) -> Path | None:
    """The gate.json whose content is the one registered with the version (the run's, else the registered
    path); None for a version registered without gate evidence."""
    if not version.gate_hash:
        return None
    for path in ([run_dir / GATE_JSON] if run_dir is not None else []) + ([Path(version.gate_path)] if version.gate_path else []):
        if path.is_file() and _gate_hash(path) == version.gate_hash:
            return path
    raise InputError(f"the gate evidence of version {version.version} of {version.model!r} is missing or changed since it was"
                     " registered", file=version.gate_path or run_dir, field="gate")


def _gate_hash(path: Path) -> str | None:
    try:
        return sha256_json(json.loads(path.read_bytes()))
    except (ValueError, OSError, RecursionError):
        return None


def registry_record(version: VersionLike) -> dict[str, Any]:
    """Which registry version the bundle is: what verification matches the registry against."""
    return {
        "model": version.model, "version": version.version, "artifact_hash": version.artifact_hash,
        "manifest_hash": version.manifest_hash, "gate_hash": version.gate_hash, "source_hash": version.source_hash,
        "recipe": version.recipe_name, "recipe_hash": version.recipe_hash,
        "eval_sets": {ref.name: ref.hash for ref in version.eval_sets},
    }


def check_registry_record(bundle: Path, version: VersionLike) -> None:
    """The bundle's registry record (evidence/registry.json, read bounded) names this version: another version's bundle
    in this one's place is named as such, before its signature (valid for that other version) is checked."""
    recorded = bundle / EVIDENCE_DIR / REGISTRY_RECORD
    try:
        record = json.loads(read_user_bytes(recorded, what="registry record", max_bytes=MAX_JSON_BYTES))
    except (InputError, ValueError, RecursionError):
        raise InputError("the bundle has no readable registry record", file=recorded) from None
    if record != registry_record(version):
        raise InputError(f"the bundle is not version {version.version} of {version.model!r} (its registry record differs)", file=recorded)


def _refuse_foreign_bundle(final: Path, version: VersionLike) -> None:
    """A bundle already at `final` is replaced only when it is this version's (an attempt that died before the registry
    recorded it). Another registry in the same folder numbers its versions too: its signed bundle of the same model and
    number was replaced here, and the first registry's bundle no longer verified (two registries of one CI run)."""
    try:
        check_registry_record(final, version)
    except InputError as error:
        raise InputError(f"{final} holds a bundle this version did not write ({error.message}); another registry beside "
                         f"{final.parents[2]} promotes into the same folder: give each registry its own folder", file=final) from None


def check_bundle_evidence(bundle: Path, version: VersionLike, *, override_gate: bool) -> str:
    """After the signature verified: the bundle is this version's (its artifact, its gate evidence) and the
    evidence says promoted under the policy it records. Returns the verdict line for the report."""
    manifest = bundle / MANIFEST_NAME
    check_registry_record(bundle, version)
    document = load_manifest(bundle)
    if (version.manifest_hash is not None and document.sha256 != version.manifest_hash) or sha256_json(document.files) != version.artifact_hash:
        raise InputError("the bundle holds another artifact than the version's", file=manifest)
    if not version.gate_hash:
        raise InputError("the bundle holds no gate evidence (promoted by hand without gate.json)", file=bundle / EVIDENCE_DIR, field="gate")
    gate_path = bundle / EVIDENCE_DIR / GATE_JSON
    if _gate_hash(gate_path) != version.gate_hash:
        raise InputError("the bundle's gate.json is not the evidence registered with the version", file=gate_path)
    try:
        report = GateReport.model_validate_json(gate_path.read_bytes())
    except ValidationError:
        raise InputError("the bundle's gate.json is not a gate report this quantgate reads", file=gate_path) from None
    if report.gate.verdict != "promoted" and not override_gate:
        raise InputError(f"the evidence says {report.gate.verdict}, and no gate override was recorded", file=gate_path, field="gate.verdict")
    policy = report.inputs.get("policy") if isinstance(report.inputs.get("policy"), dict) else None
    policy_file = bundle / EVIDENCE_DIR / POLICY_FILE
    if policy and policy_file.is_file() and sha256_file(policy_file) != policy.get("sha256"):
        raise InputError("the bundle's policy is not the one the gate recorded", file=policy_file, field="inputs.policy.sha256")
    under = f" under policy {policy.get('sha256', '')[:12]}" if policy else ""
    how = " (gate overridden by hand)" if report.gate.verdict != "promoted" else ""
    return f"{report.gate.verdict}{how}{under}"


def verify_promotion(promoted: dict[str, Any] | None, version: VersionLike, *, required: bool, registry: Path) -> PromotionCheck | None:
    """A promoted version's signed bundle: the signature with the key the registry recorded (which must be
    trusted), every file, and evidence that is this version's and says promoted under its policy.

    `promoted`: the evidence of the version's `promoted` event, which holds the signature record. A version
    promoted before signing existed has none: an InputError when `required`, else None (nothing to check)."""
    record = parse_record(promoted)
    if record is None:
        if required:
            raise InputError(f"version {version.version} of {version.model!r} has no signed promotion bundle (not promoted, or"
                             " promoted before signing)", file=registry, field="signature")
        return None
    check_registry_record(Path(record.bundle), version)
    check = verify_bundle(record)
    verdict = check_bundle_evidence(check.bundle, version, override_gate=bool((promoted or {}).get("override_gate")))
    return PromotionCheck(model=version.model, version=version.version, evidence=verdict, **check.model_dump())
