"""The MLflow side of the registry's mirror (pipelines.registry.mirror) and of `quantize registry export-mlflow`.

A promoted version becomes one MLflow run holding its signed promotion bundle (`bundle/`: the artifact, its evidence
and model.sig), the gate's report (`report.md`) and `gate.json`, and one model version of the registered model named
after the source model, whose source is that run's `bundle/`. The gate's verdict and every set's numbers (delta,
confidence bounds, flips, KL) are tags of both. Mirroring the same version twice reuses the first model version
(found by its `quantgate.version` and `quantgate.artifact_hash` tags); the registry's aliases are set on the model
versions their registry versions became. MLflow is imported inside the functions, so the rest of the package works
without it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipelines.console.urls import checked_store_uri
from pipelines.errors import InputError
from pipelines.gate.schema import GateReport
from pipelines.registry.evidence import EVIDENCE_DIR, GATE_JSON, REPORT_MD
from pipelines.registry.store import Registry, Version, verify_version
from pipelines.settings import current as current_settings

EXPERIMENT = "quantgate"
BUNDLE_SUBDIR = "bundle"
# MLflow's tag value limit on older servers.
_MAX_VALUE = 5000
# Per-set numbers of pipelines.gate.schema.SetVerdict that become tags `gate.<eval set>.<field>`.
SET_TAG_FIELDS = (
    "passed", "n", "metric", "higher_is_better", "unit", "baseline_score", "candidate_score", "delta", "worsening",
    "ci_low", "ci_high", "interval_method",
    "mcnemar_p", "flips_right_to_wrong", "flips_wrong_to_right", "flip_rate", "kl_mean", "kl_max",
)

# No usage telemetry, no progress bars on stderr; a server that is down fails in about a second instead of MLflow's
# default 7 retries with exponential back-off (minutes): the mirror records it for a retry instead (an environment
# variable the user set wins).
_CLIENT_ENV = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "60",
}


class MlflowExport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tracking_uri: str
    registered_model: str
    model_version: int
    run_id: str
    source: str
    alias: str | None
    reused: bool
    tags: dict[str, str]


def gate_tags(report: GateReport | None) -> dict[str, str]:
    """The gate's verdict and per-set numbers (delta, CI, flips, KL, ...) as flat string tags."""
    if report is None:
        return {}
    result = report.gate
    tags: dict[str, str] = {"gate.verdict": result.verdict}
    for one_set in result.sets:
        values = {field: getattr(one_set, field) for field in SET_TAG_FIELDS}
        tags.update({
            f"gate.{one_set.eval_set}.{field}": str(value)[:_MAX_VALUE] for field, value in values.items() if value is not None
        })
    if result.reasons:
        tags["gate.reasons"] = "; ".join(result.reasons)[:_MAX_VALUE]
    return tags


def version_tags(version: Version) -> dict[str, str]:
    tags = {
        "quantgate.model": version.model,
        "quantgate.version": str(version.version),
        "quantgate.status": version.status,
        "quantgate.source_hash": version.source_hash,
        "quantgate.artifact_hash": version.artifact_hash,
        "quantgate.manifest_hash": version.manifest_hash or "",
        "quantgate.recipe": version.recipe_name,
        "quantgate.recipe_hash": version.recipe_hash,
        "quantgate.gate_hash": version.gate_hash or "",
    }
    tags.update({f"quantgate.eval_set.{ref.name}": ref.hash for ref in version.eval_sets})
    tags.update(gate_tags(version.gate))
    return tags


def _artifact_location(tracking_uri: str) -> str | None:
    """Beside a SQLite store, not in ./mlruns of whatever folder the command runs in."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    db = Path(tracking_uri.removeprefix("sqlite:///"))
    db.parent.mkdir(parents=True, exist_ok=True)
    return (db.resolve().parent / "mlflow-artifacts").as_uri()


def default_tracking_uri() -> str:
    """<artifacts>/mlflow.db, as QUANTGATE_ARTIFACTS says now."""
    return f"sqlite:///{(current_settings().artifacts_dir / 'mlflow.db').as_posix()}"


class MirrorResult(BaseModel):
    """What one mirror call left in MLflow: registry version -> MLflow model version, alias -> MLflow model version."""
    model_config = ConfigDict(extra="forbid")

    registered_model: str
    versions: dict[int, int]
    aliases: dict[str, int]
    created: list[int]


class _Exporter:
    """One MLflow client and the registry the versions come from."""

    def __init__(self, tracking_uri: str, registry: Registry | None, field: str) -> None:
        for name, value in _CLIENT_ENV.items():
            os.environ.setdefault(name, value)
        try:
            from mlflow import MlflowClient  # heavy: imported when used
            from mlflow.exceptions import MlflowException  # heavy: imported when used
        except ImportError:
            raise InputError("MLflow is not installed; install the extra: pip install 'quantgate[mlflow]'",
                             field="mlflow") from None
        self.error_type: type[Exception] = MlflowException
        self.tracking_uri, self.registry, self._field = checked_store_uri(tracking_uri, field), registry, field
        self._client_type = MlflowClient
        self._client: Any = None

    @property
    def client(self) -> Any:
        """Opened at first use: a version that fails its checks touches no store (a SQLite one is not even created)."""
        if self._client is None:
            try:  # a store MLflow refuses (its file store is in maintenance mode) fails here, naming the URI
                self._client = self._client_type(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
            except self.error_type as error:
                raise InputError(f"MLflow cannot use this tracking URI: {getattr(error, 'message', error)}",
                                 file=self.tracking_uri, field=self._field) from None
        return self._client

    def export(self, version: Version) -> tuple[Any, bool, dict[str, str]]:
        """The MLflow model version of a promoted registry version (created unless it exists), whether it existed, its tags."""
        if version.status != "promoted":
            raise InputError(
                f"version {version.version} of {version.model!r} is {version.status}; only promoted versions are exported",
                field="version",
            )
        # The files about to be logged are the ones the registry vouches for (cheap when their stat is unchanged).
        verify_version(version)
        signed = self.registry.verify_signature(version) if self.registry is not None else None
        folder = Path(signed.bundle) if signed is not None else Path(version.artifact_path)
        tags = version_tags(version)
        if signed is not None:
            tags["quantgate.signature_key"] = signed.key_id
        self._ensure_registered_model(version.model)
        existing = self._existing(version)
        if existing is not None:
            return existing, True, tags
        return self._create(version, folder, tags), False, tags

    def set_alias(self, model: str, alias: str, model_version: int) -> None:
        self.client.set_registered_model_alias(model, alias, str(model_version))

    def _ensure_registered_model(self, model: str) -> None:
        try:
            self.client.create_registered_model(model, description="Quantized artifacts promoted by quantgate")
        except self.error_type as error:
            if getattr(error, "error_code", "") != "RESOURCE_ALREADY_EXISTS":
                raise

    def _existing(self, version: Version) -> Any | None:
        for existing in self.client.search_model_versions(f"name = '{version.model}'", max_results=10_000):
            if (existing.tags.get("quantgate.artifact_hash") == version.artifact_hash
                    and existing.tags.get("quantgate.version") == str(version.version)):
                return existing
        return None

    def _create(self, version: Version, folder: Path, tags: dict[str, str]) -> Any:
        client = self.client
        experiment = client.get_experiment_by_name(EXPERIMENT)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else client.create_experiment(EXPERIMENT, artifact_location=_artifact_location(self.tracking_uri)))
        run = client.create_run(experiment_id, tags=tags, run_name=f"{version.model}-v{version.version}")
        try:
            client.log_artifacts(run.info.run_id, str(folder), artifact_path=BUNDLE_SUBDIR)
            report = folder / EVIDENCE_DIR / REPORT_MD
            if report.is_file():
                client.log_artifact(run.info.run_id, str(report))
            if version.gate is not None:
                client.log_dict(run.info.run_id, version.gate.model_dump(mode="json"), GATE_JSON)
        except BaseException:
            client.set_terminated(run.info.run_id, status="FAILED")
            raise
        client.set_terminated(run.info.run_id)
        return client.create_model_version(
            version.model, f"{run.info.artifact_uri}/{BUNDLE_SUBDIR}", run_id=run.info.run_id, tags=tags,
            description=version.reason or None,
        )


def export_to_mlflow(version: Version, tracking_uri: str | None = None, alias: str | None = None, *,
                     registry: Registry | None = None) -> MlflowExport:
    """Register a promoted version as an MLflow model version; returns where it landed.

    With the `registry` the version comes from, a signed version's promotion bundle (artifact + evidence +
    model.sig) is verified and exported in place of the candidate folder; one promoted before signing
    existed is exported from its candidate folder, as before."""
    if version.status != "promoted":  # before MLflow is touched: nothing is created for a refused version
        raise InputError(
            f"version {version.version} of {version.model!r} is {version.status}; only promoted versions are exported",
            field="version",
        )
    verify_version(version)
    tracking_uri = default_tracking_uri() if tracking_uri is None else tracking_uri
    exporter = _Exporter(tracking_uri, registry, "--tracking-uri")
    try:
        model_version, reused, tags = exporter.export(version)
        if alias:
            exporter.set_alias(version.model, alias, int(model_version.version))
    except exporter.error_type as error:
        raise InputError(f"MLflow export failed: {getattr(error, 'message', error)}", file=tracking_uri) from None
    return MlflowExport(
        tracking_uri=tracking_uri, registered_model=version.model, model_version=int(model_version.version),
        run_id=model_version.run_id, source=model_version.source, alias=alias, reused=reused, tags=tags,
    )


def mirror_model(registry: Registry, model: str, numbers: list[int], tracking_uri: str) -> MirrorResult:
    """Versions `numbers` of `model` exported (each once), then every alias the registry holds for `model` set on the
    model version its target became (a target not mirrored yet is exported first). MLflow's errors propagate."""
    exporter = _Exporter(tracking_uri, registry, "--mlflow")
    versions = {version.version: version for version in registry.list(model)}
    mirrored: dict[int, int] = {}
    created: list[int] = []

    def mirror_one(number: int) -> int:
        if number not in mirrored:
            model_version, reused, _ = exporter.export(versions[number] if number in versions else registry.show(model, number))
            mirrored[number] = int(model_version.version)
            if not reused:
                created.append(number)
        return mirrored[number]

    for number in numbers:
        mirror_one(number)
    aliases = {alias: mirror_one(version.version) for version in versions.values() for alias in version.aliases}
    for alias, model_version in aliases.items():
        exporter.set_alias(model, alias, model_version)
    return MirrorResult(registered_model=model, versions=mirrored, aliases=aliases, created=created)
