"""Promotion with a signed bundle (pipelines.registry.evidence assembles it, pipelines.registry.signing signs it), used by the
runner and `quantize registry promote`; and the signature check for a consumer that knows a version only by
its number (the job ledger's cached skip)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from pipelines.errors import InputError
from pipelines.files.hashing import sha256_file
from pipelines.registry.database import postgres_url
from pipelines.registry.evidence import bundle_path, staged_bundle
from pipelines.registry.signing import SIGNATURE_NAME, load_signer, sign_folder, signature_record
from pipelines.registry.store import Registry, Version, verify_version


def promote_signed(registry: Registry, version: Version, reason: str, evidence: dict[str, Any] | None = None, *,
                   run_dir: Path | None = None, override_gate: bool = False) -> Version:
    """The one door to `promoted`: promote `version` with its promotion bundle signed.

    What it checks, in order: the signing key (before any work); that the version may still be promoted (its status, and
    its own gate evidence unless `override_gate`); the artifact against the manifest and the fingerprint registered
    (once: the check is passed down to Registry.promote, which re-hashes nothing it covers); every file copied into the
    bundle against its manifest sha256; the signature it wrote being the one in the bundle when the registry records it.
    Only then is the version marked promoted, with the signature record (public key included) in the same `promoted`
    event: no version is promoted unsigned, and a failed promotion leaves no bundle.

    What its consumers still check, each at its time of use (a promoted version's files may be changed later): serving,
    deploying, set_alias and rollback verify the artifact again (Registry.resolve / verify_version) and the signed bundle
    (Registry.verify_signature: signature with a trusted key, every file, evidence saying promoted)."""
    signer = load_signer(registry.path)
    if not registry.promotable(version, override_gate=override_gate):
        return registry.get(version.id)  # promoted already: unchanged
    check = verify_version(version)  # before copying: nothing is copied from a tampered artifact
    final = bundle_path(registry.path, version)
    with staged_bundle(version, final, run_dir) as folder:
        started = time.monotonic()
        sign_folder(folder, signer)
        sign_s = time.monotonic() - started
        ours = sha256_file(folder / SIGNATURE_NAME)
    if _signature_sha(final) != ours:  # a concurrent promotion of the same version replaced the bundle: its own, not ours
        raise InputError("another promotion of this version replaced its bundle while it was signed", file=final)
    record = signature_record(final, signer, sign_s)
    try:
        return registry.promote(version.id, reason, record, evidence, override_gate=override_gate, verified=check)
    except BaseException:
        if _signature_sha(final) == ours:  # never remove a bundle another promotion's record points to
            shutil.rmtree(final, ignore_errors=True)
        raise


def _signature_sha(bundle: Path) -> str | None:
    try:
        return sha256_file(bundle / SIGNATURE_NAME)
    except OSError:
        return None


def verify_recorded(registry_path: Path | str, model: str, number: int) -> None:
    """Version `number` of `model`'s signed bundle. A ledger entry that names a registry version the registry
    cannot show (the registry gone, moved, or without that version) is not trusted: an InputError, so the job
    runs the candidate again instead of skipping it on an unverifiable promotion."""
    if postgres_url(registry_path) is None and not Path(registry_path).is_file():
        raise InputError(f"the ledger names registry version {number} of {model}, and there is no registry to verify it in",
                         file=registry_path)
    registry = Registry(registry_path)
    version = registry.show(model, number)  # an InputError naming the registry when it has no such version
    registry.verify_signature(version)
