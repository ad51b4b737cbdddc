"""Export a promoted registry version to an MLflow model registry (optional extra `mlflow`).

The artifact folder is logged as the artifacts of one MLflow run, a model version of the registered
model named after the source model is created from that run's artifact URI, the gate's numbers become
tags, and an alias can be set. Exporting the same version twice reuses the first export.
MLflow is imported inside the function, so the rest of the package works without it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipelines.errors import InputError
from pipelines.gate.schema import GateReport
from pipelines.registry.store import Registry, Version, verify_version
from pipelines.settings import current as current_settings

EXPERIMENT = "quantgate"
ARTIFACT_SUBDIR = "artifact"
# MLflow's tag value limit on older servers.
_MAX_VALUE = 5000
# Per-set numbers of pipelines.gate.schema.SetVerdict that become tags `gate.<eval set>.<field>`.
SET_TAG_FIELDS = (
    "passed", "n", "metric", "higher_is_better", "unit", "baseline_score", "candidate_score", "delta", "worsening",
    "ci_low", "ci_high", "interval_method",
    "mcnemar_p", "flips_right_to_wrong", "flips_wrong_to_right", "flip_rate", "kl_mean", "kl_max",
)

# Local export only: no usage telemetry, no progress bars on stderr.
_QUIET_ENV = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
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


def export_to_mlflow(version: Version, tracking_uri: str | None = None, alias: str | None = None, *,
                     registry: Registry | None = None) -> MlflowExport:
    """Register a promoted version's artifact as an MLflow model version; returns where it landed.

    With the `registry` the version comes from, a signed version's promotion bundle (artifact + evidence +
    model.sig) is verified and exported in place of the candidate folder; one promoted before signing
    existed is exported from its candidate folder, as before."""
    if version.status != "promoted":
        raise InputError(
            f"version {version.version} of {version.model!r} is {version.status}; only promoted versions are exported",
            field="version",
        )
    # The files about to be logged are the ones the registry vouches for (cheap when their stat is unchanged).
    verify_version(version)
    signed = registry.verify_signature(version) if registry is not None else None
    folder = str(signed.bundle) if signed is not None else version.artifact_path
    tracking_uri = default_tracking_uri() if tracking_uri is None else tracking_uri
    for name, value in _QUIET_ENV.items():
        os.environ.setdefault(name, value)
    try:
        from mlflow import MlflowClient  # heavy: imported when used
        from mlflow.exceptions import MlflowException  # heavy: imported when used
    except ImportError:
        raise InputError("MLflow is not installed; install the extra: pip install 'quantgate[mlflow]'",
                         field="mlflow") from None

    try:  # a store MLflow refuses (its file store is in maintenance mode) fails here, naming the URI
        client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    except MlflowException as error:
        raise InputError(f"MLflow cannot use this tracking URI: {error.message}", file=tracking_uri, field="--tracking-uri") from None
    tags = version_tags(version)
    if signed is not None:
        tags["quantgate.signature_key"] = signed.key_id
    try:
        model_version, reused = _find_or_create(client, version, folder, tags, tracking_uri, MlflowException)
        if alias:
            client.set_registered_model_alias(version.model, alias, model_version.version)
    except MlflowException as error:
        raise InputError(f"MLflow export failed: {error.message}", file=tracking_uri) from None
    return MlflowExport(
        tracking_uri=tracking_uri, registered_model=version.model, model_version=int(model_version.version),
        run_id=model_version.run_id, source=model_version.source, alias=alias, reused=reused, tags=tags,
    )


def _find_or_create(client: Any, version: Version, folder: str, tags: dict[str, str], tracking_uri: str,
                    mlflow_exception: type[Exception]) -> tuple[Any, bool]:
    try:
        client.create_registered_model(version.model, description="Quantized artifacts promoted by quantgate")
    except mlflow_exception as error:
        if getattr(error, "error_code", "") != "RESOURCE_ALREADY_EXISTS":
            raise
    for existing in client.search_model_versions(f"name = '{version.model}'"):
        if (existing.tags.get("quantgate.artifact_hash") == version.artifact_hash
                and existing.tags.get("quantgate.version") == str(version.version)):
            return existing, True

    experiment = client.get_experiment_by_name(EXPERIMENT)
    experiment_id = (experiment.experiment_id if experiment is not None
                     else client.create_experiment(EXPERIMENT, artifact_location=_artifact_location(tracking_uri)))
    run = client.create_run(experiment_id, tags=tags, run_name=f"{version.model}-v{version.version}")
    try:
        client.log_artifacts(run.info.run_id, folder, artifact_path=ARTIFACT_SUBDIR)
        if version.gate is not None:
            client.log_dict(run.info.run_id, version.gate.model_dump(mode="json"), "gate.json")
    except BaseException:
        client.set_terminated(run.info.run_id, status="FAILED")
        raise
    client.set_terminated(run.info.run_id)
    model_version = client.create_model_version(
        version.model, f"{run.info.artifact_uri}/{ARTIFACT_SUBDIR}", run_id=run.info.run_id, tags=tags,
        description=version.reason or None,
    )
    return model_version, False
