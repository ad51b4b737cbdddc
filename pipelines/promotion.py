"""Promotion with a signed bundle (pipelines.evidence assembles it, pipelines.signing signs it), used by the
runner and `quantize registry promote`; and the signature check for a consumer that knows a version only by
its number (the job ledger's cached skip)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from pipelines.errors import InputError
from pipelines.evidence import bundle_path, staged_bundle
from pipelines.registry import Registry, Version
from pipelines.signing import load_signer, sign_folder, signature_record


def promote_signed(registry: Registry, version: Version, reason: str, evidence: dict[str, Any] | None = None, *,
                   run_dir: Path | None = None, override_gate: bool = False) -> Version:
    """Promote `version` with its promotion bundle signed. The key is checked first, the bundle assembled and
    signed, and only then is the version marked promoted, with the signature record (public key included) in
    the same `promoted` event: no version is promoted unsigned, and a failed promotion leaves no bundle."""
    signer = load_signer(registry.path)
    if version.status != "candidate" or (version.verdict == "rejected" and not override_gate):
        return registry.promote(version.id, reason, evidence, override_gate=override_gate)  # unchanged, or refused, as before
    final = bundle_path(registry.path, version)
    with staged_bundle(version, final, run_dir) as folder:
        started = time.monotonic()
        sign_folder(folder, signer)
        sign_s = time.monotonic() - started
    record = signature_record(final, signer, sign_s)
    try:
        return registry.promote(version.id, reason, {**(evidence or {}), "signature": record.model_dump()}, override_gate=override_gate)
    except BaseException:
        shutil.rmtree(final, ignore_errors=True)
        raise


def verify_recorded(registry_path: Path, model: str, number: int) -> None:
    """Version `number` of `model`'s signed bundle, when the registry holds that version and it was signed
    (a ledger entry may name a registry that is gone or a version it never held: then only the artifact's own
    integrity check applies, done by the caller)."""
    if not Path(registry_path).is_file():
        return
    registry = Registry(registry_path)
    try:
        version = registry.show(model, number)
    except InputError:
        return
    registry.verify_signature(version)
