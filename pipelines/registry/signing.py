"""Signed promotion: an OpenSSF Model Signing (OMS) signature over the promotion bundle, made and checked with
the `model-signing` library (a Sigstore bundle holding a DSSE envelope around an in-toto statement that lists
every file's sha256; never a format of our own).

Keys. The signer is, in this order:
- certificate signing when QUANTGATE_SIGNING_CERT names a signing certificate (PEM): its private key is
  QUANTGATE_SIGNING_KEY, the rest of the chain QUANTGATE_SIGNING_CHAIN (PEM files, separated by os.pathsep);
- the elliptic-curve private key (P-256, P-384 or P-521, PEM, unencrypted) at QUANTGATE_SIGNING_KEY;
- else the project key, `signing/private-key.pem` beside the registry database, generated on first use with
  permissions 0600 (its public key is written beside it as public-key.pem).
The public key (and the chain) that signed a promotion is recorded in the registry, in the `promoted` event's
evidence (`signature`), so old versions keep verifying after the key is rotated.

Trust. QUANTGATE_TRUSTED_KEYS (PEM public keys or CA certificates, files or folders of *.pem, separated by
os.pathsep) restricts which keys a bundle may be signed with; unset, the key the registry recorded for the
version is trusted (one machine, one registry). Verification reads every file of the bundle again.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipelines.errors import InputError
from pipelines.files.hashing import sha256_file
from pipelines.files.safepath import own_regular_file
from pipelines.files.yamlio import read_user_bytes
from pipelines.registry.database import files_anchor
from pipelines.settings import current as current_settings

SIGNATURE_NAME = "model.sig"
KEY_ENV = "QUANTGATE_SIGNING_KEY"
CERT_ENV = "QUANTGATE_SIGNING_CERT"
CHAIN_ENV = "QUANTGATE_SIGNING_CHAIN"
TRUSTED_ENV = "QUANTGATE_TRUSTED_KEYS"
PROJECT_KEY_DIR = "signing"
PROJECT_KEY_NAME = "private-key.pem"
PROJECT_PUBLIC_NAME = "public-key.pem"
MAX_PEM_BYTES = 64 * 1024
MAX_SIGNATURE_BYTES = 64 * 1024 * 1024  # the statement lists one digest per file: megabytes at most
SUPPORTED_CURVES = ("secp256r1", "secp384r1", "secp521r1")  # what model-signing accepts (Sigstore's key specs)
KEY_FOLDER_PREFIX = "quantgate-keys-"
STALE_KEY_FOLDER_S = 60.0


def require_signed_bundle(record: SignatureRecord) -> None:
    """The bundle a promotion record names holds the signature it records (the registry's one door to `promoted`)."""
    signature = Path(record.bundle) / SIGNATURE_NAME
    try:
        found = sha256_file(signature)
    except OSError:
        found = None
    if found != record.signature_sha256:
        raise InputError(f"no signed promotion bundle: {signature} is {'missing' if found is None else 'not the signature recorded'}",
                         file=signature, field="signature")


class SignatureRecord(BaseModel):
    """What the registry keeps about a signed promotion (the `promoted` event's evidence, key `signature`)."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["key", "certificate"]
    bundle: str  # the promotion bundle folder (absolute)
    signature_sha256: str
    key_id: str  # sha256 of the public key's PEM (SubjectPublicKeyInfo), as model-signing's bundle hint
    public_key: str  # PEM
    certificate_chain: list[str] = Field(default_factory=list)  # PEM, certificate signing only: leaf first
    key_source: str
    signed_at: str
    files: int
    bytes: int
    sign_s: float
    # every signed file's size: checked before any byte is hashed (absent in records made before it: then the totals)
    sizes: dict[str, int] = Field(default_factory=dict)


class Signer(BaseModel):
    """A private key (and, for certificate signing, its certificate and chain), checked once."""

    model_config = ConfigDict(extra="forbid")

    private_key: Path
    public_key: str
    key_id: str
    source: str
    certificate: Path | None = None
    chain: list[Path] = Field(default_factory=list)

    @property
    def method(self) -> Literal["key", "certificate"]:
        return "certificate" if self.certificate is not None else "key"


class BundleCheck(BaseModel):
    """A verified bundle: where, signed by which key, how large, how long the check took."""

    model_config = ConfigDict(extra="forbid")

    bundle: Path
    key_id: str
    method: Literal["key", "certificate"]
    files: int
    bytes: int
    verify_s: float


# ----------------------------------------------------------------------------------------------- keys


def key_id(public_pem: str) -> str:
    return hashlib.sha256(public_pem.encode()).hexdigest()


def _public_pem(public_key: ec.EllipticCurvePublicKey) -> str:
    return public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name, "")
    return Path(value) if value else None


def load_signer(registry_path: Path) -> Signer:
    """The signer the environment asks for (see the module docstring); every key problem is an InputError."""
    key_path, cert_path = _env_path(KEY_ENV), _env_path(CERT_ENV)
    if cert_path is not None and key_path is None:
        raise InputError(f"certificate signing needs the certificate's private key in {KEY_ENV}", field=CERT_ENV)
    if key_path is None:
        return _project_signer(registry_path)
    public = _public_pem(_read_private_key(key_path, KEY_ENV).public_key())
    if cert_path is None:
        return Signer(private_key=key_path, public_key=public, key_id=key_id(public), source=KEY_ENV)
    certificate = _read_certificate(cert_path, CERT_ENV)
    if _public_pem(certificate.public_key()) != public:  # type: ignore[arg-type]
        raise InputError(f"the certificate is not for the private key in {KEY_ENV}", file=cert_path, field=CERT_ENV)
    chain = [Path(part) for part in os.environ.get(CHAIN_ENV, "").split(os.pathsep) if part]
    for path in chain:
        _read_certificate(path, CHAIN_ENV)
    return Signer(private_key=key_path, public_key=public, key_id=key_id(public), source=CERT_ENV, certificate=cert_path, chain=chain)


def _read_private_key(path: Path, field: str) -> ec.EllipticCurvePrivateKey:
    raw = read_user_bytes(path, what="private key", field=field, max_bytes=MAX_PEM_BYTES)
    if b"-----BEGIN" in raw and b"PRIVATE KEY-----" not in raw:
        raise InputError("not a private key (a public key or a certificate has no private part)", file=path, field=field)
    try:
        key = serialization.load_pem_private_key(raw, password=None)
    except TypeError:
        raise InputError("the private key is encrypted; give an unencrypted PEM (keep it in a secret store)", file=path, field=field) from None
    except (ValueError, binascii.Error):
        raise InputError("not a readable PEM private key (malformed or truncated)", file=path, field=field) from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise InputError(f"not an elliptic-curve key ({type(key).__name__.lstrip('_')}); model signing needs P-256, P-384 or P-521",
                         file=path, field=field)
    if key.curve.name not in SUPPORTED_CURVES:
        raise InputError(f"curve {key.curve.name} is not supported; use P-256, P-384 or P-521", file=path, field=field)
    return key


def _read_certificate(path: Path, field: str) -> x509.Certificate:
    raw = read_user_bytes(path, what="certificate", field=field, max_bytes=MAX_PEM_BYTES)
    try:
        return x509.load_pem_x509_certificate(raw)
    except ValueError:
        raise InputError("not a readable PEM certificate", file=path, field=field) from None


def project_key_path(registry_path: Path) -> Path:
    return files_anchor(registry_path).parent / PROJECT_KEY_DIR / PROJECT_KEY_NAME


def _project_signer(registry_path: Path) -> Signer:
    """The project key beside the registry, generated on first use (0600; its folder 0700)."""
    path = project_key_path(registry_path)
    if not path.exists():
        _generate_project_key(path)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise InputError(f"the project signing key is readable by others (mode {mode:o}); chmod 600 it", file=path, field=KEY_ENV)
    public = _public_pem(_read_private_key(path, KEY_ENV).public_key())
    if not (path.parent / PROJECT_PUBLIC_NAME).is_file():  # for `model_signing verify key --public_key`
        (path.parent / PROJECT_PUBLIC_NAME).write_text(public)
    return Signer(private_key=path, public_key=public, key_id=key_id(public), source=f"project key {path}")


def _generate_project_key(path: Path) -> None:
    """Written whole to a private temporary file, then linked into place: two processes generating at once
    keep the first key (the second's link fails and it reads the first one), and no reader sees half a key."""
    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(prefix=".private-key-", dir=path.parent)  # mode 0600
        try:
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(pem)
                handle.flush()
                os.fsync(handle.fileno())
            os.link(temporary, path)
        finally:
            os.unlink(temporary)
    except FileExistsError:
        return
    except OSError as error:
        raise InputError(f"cannot create the project signing key ({error.strerror or error})", file=path, field=KEY_ENV) from None


def trusted_keys() -> tuple[set[str], list[str]] | None:
    """(key ids, CA certificates as PEM) from QUANTGATE_TRUSTED_KEYS, or None when it is unset."""
    value = os.environ.get(TRUSTED_ENV, "")
    if not value:
        return None
    ids: set[str] = set()
    certificates: list[str] = []
    for part in filter(None, value.split(os.pathsep)):
        entry = Path(part)
        files = sorted(entry.glob("*.pem")) if entry.is_dir() else [entry]
        for path in files:
            raw = read_user_bytes(path, what="trusted key", field=TRUSTED_ENV, max_bytes=MAX_PEM_BYTES)
            if b"CERTIFICATE-----" in raw:
                certificate = _read_certificate(path, TRUSTED_ENV)
                certificates.append(certificate.public_bytes(serialization.Encoding.PEM).decode())
                continue
            try:
                public = serialization.load_pem_public_key(raw)
            except ValueError:
                raise InputError("not a PEM public key or certificate", file=path, field=TRUSTED_ENV) from None
            ids.add(key_id(_public_pem(public)))  # type: ignore[arg-type]
    return ids, certificates


# ----------------------------------------------------------------------------------------- signing


def _hashing_config() -> Any:
    """Every file of the bundle but the signature itself; git's files are not special here (a stray .gitignore
    in a bundle is a file like any other)."""
    from model_signing import hashing  # heavy: imported when used

    return hashing.Config().set_ignored_paths(paths=[SIGNATURE_NAME], ignore_git_paths=False)


def sign_folder(folder: Path, signer: Signer) -> Path:
    """Sign every file of `folder` into folder/model.sig with the model-signing library; returns the signature."""
    from model_signing import signing  # heavy: imported when used

    config = signing.Config().set_hashing_config(_hashing_config())
    if signer.certificate is not None:
        config = config.use_certificate_signer(private_key=signer.private_key, signing_certificate=signer.certificate,
                                               certificate_chain=signer.chain)
    else:
        config = config.use_elliptic_key_signer(private_key=signer.private_key)
    signature = folder / SIGNATURE_NAME
    try:
        config.sign(folder, signature)
    except (ValueError, OSError) as error:
        raise InputError(f"signing failed: {error}", file=folder) from None
    return signature


def signature_record(bundle: Path, signer: Signer, sign_s: float) -> SignatureRecord:
    sizes = {path.relative_to(bundle).as_posix(): path.stat().st_size for path in bundle_files(bundle)}
    return SignatureRecord(
        method=signer.method, bundle=str(bundle.resolve()), signature_sha256=sha256_file(bundle / SIGNATURE_NAME),
        key_id=signer.key_id, public_key=signer.public_key,
        certificate_chain=[path.read_text() for path in ([signer.certificate] if signer.certificate else []) + signer.chain],
        key_source=signer.source, signed_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        files=len(sizes), bytes=sum(sizes.values()) + (bundle / SIGNATURE_NAME).stat().st_size, sign_s=round(sign_s, 3),
        sizes=sizes,
    )


def bundle_files(bundle: Path) -> list[Path]:
    """Every file of the bundle the signature covers (all but model.sig), sorted."""
    return sorted(p for p in bundle.rglob("*") if p.is_file() and p.relative_to(bundle).as_posix() != SIGNATURE_NAME)


# ------------------------------------------------------------------------------------ verification


def verify_bundle(record: SignatureRecord) -> BundleCheck:
    """The bundle against its signature, with the key the registry recorded, which must be trusted.

    A file that differs from what was signed is named (the first in path order: changed, missing or added);
    a signature that is truncated, altered, or made with another key is refused naming model.sig. Everything that
    reads no file's content comes first (`check_bundle_shape`: names, links, sizes against the record), so a bundle
    whose files are not the signed ones is refused in milliseconds, and hashing reads no more than the recorded bytes."""
    from model_signing import verifying  # heavy: imported when used

    started = time.monotonic()
    reclaim_key_folders()
    bundle = Path(record.bundle)
    signature = bundle / SIGNATURE_NAME
    if bundle.is_symlink() or not bundle.is_dir():
        raise InputError("the promotion bundle is missing (or is a link, not the registry's own folder)", file=bundle)
    if not signature.is_file():
        raise InputError("the promotion bundle has no signature", file=signature)
    statement = _signed_statement(signature)
    trust = trusted_keys()
    if record.method == "key" and key_id(record.public_key) != record.key_id:  # trust is decided by the key that verifies, not a label
        raise InputError("the registry's signature record is inconsistent: its key id is not the id of its public key", file=signature)
    if trust is not None and record.method == "key" and key_id(record.public_key) not in trust[0]:
        raise InputError(f"signed by key {record.key_id[:16]}..., which is not among the trusted keys", file=signature, field=TRUSTED_ENV)
    check_bundle_shape(bundle, statement, record)
    config = verifying.Config().set_hashing_config(_hashing_config())
    with _pem_files([record.public_key]) as (public,), _pem_files(_chain(record, trust)) as chain:
        if record.method == "key":
            config = config.use_elliptic_key_verifier(public_key=public)
        else:
            config = config.use_certificate_verifier(certificate_chain=chain)
        try:
            config.verify(bundle, signature)
        except ValueError as error:
            if str(error).startswith("Signature mismatch"):
                raise _first_difference(bundle, statement) from None
            raise InputError(f"the signature does not verify: {_short(error)}", file=signature) from None
        except Exception as error:  # cryptography, protobuf and OpenSSL raise their own types
            raise InputError(f"the signature does not verify ({type(error).__name__}: {_short(error)})", file=signature) from None
    files = bundle_files(bundle)
    return BundleCheck(bundle=bundle, key_id=record.key_id, method=record.method, files=len(files),
                       bytes=sum(p.stat().st_size for p in files) + signature.stat().st_size,
                       verify_s=round(time.monotonic() - started, 3))


def check_bundle_shape(bundle: Path, signed: dict[str, str], record: SignatureRecord) -> None:
    """What can be checked without reading a file's content: every entry is a regular file of its own (no symbolic or
    hard link, FIFO or device; model.sig too), the names are the signed ones, every folder holds a signed file (an empty
    or extra folder is refused), and each file's size is the recorded one (records made before per-file
    sizes: the file count and the total bytes, signature included)."""
    own_regular_file(bundle / SIGNATURE_NAME, "a promotion bundle")
    entries, folders = _bundle_entries(bundle)
    sizes = {name: own_regular_file(bundle / name, "a promotion bundle").st_size for name in entries}
    holding_signed = {parent.as_posix() for name in signed for parent in PurePosixPath(name).parents if parent.name}
    extra_folders = sorted(set(folders) - holding_signed)
    if extra_folders:
        raise InputError("folder is not in the signature's manifest (added after signing; a bundle holds only what was signed)",
                         file=bundle / extra_folders[0])
    for name in sorted(set(sizes) | set(signed)):
        if name not in sizes:
            raise InputError("file covered by the signature is missing", file=bundle / name)
        if name not in signed:
            raise InputError("file is not covered by the signature (added after signing)", file=bundle / name)
        recorded = record.sizes.get(name)
        if recorded is not None and sizes[name] != recorded:
            raise InputError(f"file is {sizes[name]:,} bytes; {recorded:,} bytes were signed (tampered or corrupt)", file=bundle / name)
    total = sum(sizes.values()) + (bundle / SIGNATURE_NAME).stat().st_size
    if not record.sizes and (len(sizes), total) != (record.files, record.bytes):
        raise InputError(f"the bundle holds {len(sizes)} files of {total:,} bytes; {record.files} files of {record.bytes:,} bytes"
                         " were signed (tampered or corrupt)", file=bundle)


def _bundle_entries(bundle: Path) -> tuple[list[str], list[str]]:
    """Every name below the bundle but model.sig that is not a folder (links, FIFOs, sockets included; links never
    followed), and every real folder below it (empty ones included), each as a relative posix path."""
    entries: list[str] = []
    folders: list[str] = []
    for folder, subfolders, files in os.walk(bundle):
        here = Path(folder)
        entries += [(here / name).relative_to(bundle).as_posix() for name in files]
        for name in subfolders:
            (entries if (here / name).is_symlink() else folders).append((here / name).relative_to(bundle).as_posix())
    return sorted(name for name in entries if name != SIGNATURE_NAME), folders


def _chain(record: SignatureRecord, trust: tuple[set[str], list[str]] | None) -> list[str]:
    """Certificate signing: the trusted CA certificates when configured, else the chain recorded at signing."""
    if record.method != "certificate":
        return []
    if trust is not None:
        if not trust[1]:
            raise InputError("certificate-signed bundle, but no CA certificate is among the trusted keys", field=TRUSTED_ENV)
        return trust[1]
    return record.certificate_chain[1:] or record.certificate_chain


@contextmanager
def _pem_files(pems: list[str]) -> Iterator[list[Path]]:
    """model-signing reads keys and chains from files: these PEMs as anonymous in-memory files (memfd, read through
    /proc/self/fd), so nothing is written to a disk and nothing is left behind, however the process ends. Where the
    system has no memfd, a private folder under the artifacts root (reclaim_key_folders removes it if the process dies)."""
    if not hasattr(os, "memfd_create"):
        with _key_folder(pems) as paths:
            yield paths
        return
    descriptors = []
    try:
        for number, pem in enumerate(pems):
            descriptors.append(os.memfd_create(f"{KEY_FOLDER_PREFIX}{number}", os.MFD_CLOEXEC))
            os.write(descriptors[-1], pem.encode())
        yield [Path(f"/proc/self/fd/{descriptor}") for descriptor in descriptors]
    finally:
        for descriptor in descriptors:
            os.close(descriptor)


@contextmanager
def _key_folder(pems: list[str]) -> Iterator[list[Path]]:
    root = current_settings().artifacts_dir / "tmp"
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"{KEY_FOLDER_PREFIX}{os.getpid()}-", dir=root) as folder:
        paths = [Path(folder) / f"{number}.pem" for number in range(len(pems))]
        for path, pem in zip(paths, pems, strict=True):
            path.write_text(pem)
        yield paths


def reclaim_key_folders(*roots: Path) -> list[Path]:
    """Remove the key folders (`quantgate-keys-*`) a killed verification left in `roots` (default: the artifacts root's
    tmp/ and the system's temporary folder, where versions before the in-memory keys wrote them): this user's, unchanged
    for a minute. They hold public keys only; removing them is tidying, never a loss."""
    removed = []
    for root in roots or (current_settings().artifacts_dir / "tmp", Path(tempfile.gettempdir())):
        try:
            entries = [entry for entry in os.scandir(root) if entry.name.startswith(KEY_FOLDER_PREFIX)]
        except OSError:
            continue
        for entry in entries:
            try:
                status = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(status.st_mode) and status.st_uid == os.getuid() and time.time() - status.st_mtime > STALE_KEY_FOLDER_S:
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(Path(entry.path))
    return removed


def _short(error: BaseException, limit: int = 300) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[:limit] + " ..."


def _signed_statement(signature: Path) -> dict[str, str]:
    """The {file: sha256} the signature's statement lists (read, not yet trusted: to name what differs).
    A signature that is not a readable bundle (truncated, not JSON, no DSSE envelope) is refused here."""
    raw = read_user_bytes(signature, what="signature", max_bytes=MAX_SIGNATURE_BYTES)
    try:
        envelope = json.loads(raw)["dsseEnvelope"]
        statement = json.loads(base64.b64decode(envelope["payload"], validate=True))
        resources = statement["predicate"]["resources"]
        return {str(item["name"]): str(item["digest"]) for item in resources}
    except (ValueError, KeyError, TypeError, binascii.Error, RecursionError):
        raise InputError("not a readable model signature (truncated or malformed Sigstore bundle)", file=signature) from None


def _first_difference(bundle: Path, signed: dict[str, str]) -> InputError:
    actual = {p.relative_to(bundle).as_posix(): p for p in bundle_files(bundle)}
    for name in sorted(set(actual) | set(signed)):
        if name not in actual:
            return InputError("file covered by the signature is missing", file=bundle / name)
        if name not in signed:
            return InputError("file is not covered by the signature (added after signing)", file=bundle / name)
        if sha256_file(actual[name]) != signed[name]:
            return InputError("file differs from what was signed (tampered or corrupt)", file=bundle / name)
    return InputError("the files do not match the signature", file=bundle / SIGNATURE_NAME)


def parse_record(evidence: dict[str, Any] | None) -> SignatureRecord | None:
    """The signature record in a `promoted` event's evidence, or None (promoted before signing existed)."""
    value = (evidence or {}).get("signature")
    if value is None:
        return None
    try:
        return SignatureRecord.model_validate(value)
    except ValidationError:
        raise InputError("the registry's signature record is malformed", field="signature") from None


