"""Signed promotion (docs/registry.md, "Signed promotion"): the bundle a gate run promotes, its OMS signature
made with the model-signing library, and every consumer's refusal of a bundle that is not what was signed.

The gate runs through the real runner with vLLM and lm-eval faked (tests/unit/conftest.py `cli`), so each
promotion here is the product's own: run folder evidence, bundle, signature, registry record."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID
from fakes import promoted

from pipelines.cli import main
from pipelines.errors import InputError
from pipelines.jobs import job as job_module
from pipelines.jobs.job import CandidateResult
from pipelines.registry.evidence import EVIDENCE_DIR
from pipelines.registry.mlflow_export import export_to_mlflow
from pipelines.registry.signing import CERT_ENV, CHAIN_ENV, KEY_ENV, SIGNATURE_NAME, TRUSTED_ENV, project_key_path
from pipelines.registry.store import Registry, Version

MODEL = "demo-llama"
# The files a flipped byte must be caught in: a weight file, the gate's evidence, the per-item outputs.
TAMPERED = ["model.safetensors", f"{EVIDENCE_DIR}/gate.json", f"{EVIDENCE_DIR}/items/tickets.jsonl"]


@pytest.fixture(autouse=True)
def no_signing_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (KEY_ENV, CERT_ENV, CHAIN_ENV, TRUSTED_ENV):
        monkeypatch.delenv(name, raising=False)


def bundle_of(workspace: SimpleNamespace, version: Version) -> Path:
    return workspace.registry.parent / "promoted" / MODEL / f"v{version.version}"


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def verify(workspace: SimpleNamespace, target: str, *extra: str) -> int:
    return main(["registry", "verify", target, "--registry", str(workspace.registry), *extra])


def ec_key(folder: Path, name: str) -> tuple[Path, Path]:
    """A P-256 private key and its public key as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = folder / f"{name}.pem", folder / f"{name}.pub.pem"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


def test_sign_and_verify_round_trip(cli, workspace, capsys) -> None:
    version = promoted(cli, workspace)
    bundle = bundle_of(workspace, version)
    capsys.readouterr()
    assert verify(workspace, f"{MODEL}@{version.version}", "--json") == 0
    check = json.loads(capsys.readouterr().out)
    assert Path(check["bundle"]) == bundle.resolve() and check["evidence"].startswith("promoted under policy")
    # One signature over the weights and the evidence, the evidence complete.
    signed = {p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file()}
    assert {"model.safetensors", "config.json", "manifest.json", SIGNATURE_NAME, *TAMPERED} <= signed
    assert {f"{EVIDENCE_DIR}/{name}" for name in ("report.md", "policy.yaml", "policy.json", "provenance.json", "registry.json")} <= signed
    provenance = json.loads((bundle / EVIDENCE_DIR / "provenance.json").read_text())
    assert provenance["eval_sets"]["tickets"]["files"] and provenance["base_model"]["sha256"]
    assert provenance["versions"]["project"]["model-signing"] == "1.1.1"
    # The project key: generated on first use, private to its owner, its public half recorded in the registry.
    key = project_key_path(workspace.registry)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    event = [e for e in Registry(workspace.registry).history(MODEL, version=version.version) if e.kind == "promoted"][-1]
    assert event.evidence is not None
    assert event.evidence["signature"]["public_key"] == (key.parent / "public-key.pem").read_text()
    # The candidate folder is untouched: its manifest still accounts for every file, so a later run reuses it.
    assert sorted(p.name for p in workspace.artifact.iterdir()) == ["config.json", "manifest.json", "model.safetensors"]
    assert verify(workspace, MODEL) == 0  # NAME alone: the newest promoted version
    assert verify(workspace, f"{MODEL}@{version.version + 1}") == 2
    assert verify(workspace, f"{MODEL}@") == 2 and verify(workspace, f"@{version.version}") == 2


def test_the_model_signing_cli_accepts_our_bundle(cli, workspace) -> None:
    """Interoperability: the library's own command line verifies a bundle with the public key alone."""
    bundle = bundle_of(workspace, promoted(cli, workspace))
    public = project_key_path(workspace.registry).parent / "public-key.pem"

    def library_verify() -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "model_signing", "verify", "key", str(bundle), "--signature", str(bundle / SIGNATURE_NAME),
             "--public_key", str(public)], capture_output=True, text=True, timeout=120,
        )

    accepted = library_verify()
    assert accepted.returncode == 0 and "Verification succeeded" in accepted.stdout, accepted.stderr
    flip_byte(bundle / "model.safetensors")
    assert library_verify().returncode == 1


@pytest.mark.parametrize("relative", TAMPERED)
def test_every_consumer_refuses_a_flipped_byte(cli, workspace, capsys, tmp_path, relative: str) -> None:
    first = promoted(cli, workspace)
    registry = Registry(workspace.registry)
    assert main(["registry", "alias", MODEL, "production", str(first.version), "--registry", str(workspace.registry)]) == 0
    second = promoted(cli, workspace)
    assert main(["registry", "alias", MODEL, "production", str(second.version), "--registry", str(workspace.registry)]) == 0
    flip_byte(bundle_of(workspace, first) / relative)
    capsys.readouterr()
    named = str(bundle_of(workspace, first) / relative)

    def refused(code: int) -> None:
        assert code == 2
        err = capsys.readouterr().err
        assert named in err and len(err.strip().splitlines()) == 1, err

    refused(verify(workspace, f"{MODEL}@{first.version}"))
    refused(main(["registry", "alias", MODEL, "staging", str(first.version), "--registry", str(workspace.registry)]))
    refused(main(["registry", "rollback", MODEL, "production", "--registry", str(workspace.registry)]))
    refused(main(["registry", "export-mlflow", MODEL, str(first.version), "--registry", str(workspace.registry),
                  "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]))
    with pytest.raises(InputError, match="differs from what was signed"):
        export_to_mlflow(registry.show(MODEL, first.version), tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", registry=registry)
    assert registry.aliases(MODEL)[0].version == second.version  # nothing moved
    # The job's cached skip of a promoted verdict: an error naming the file, not a skip.
    ledger_entry = CandidateResult(model=MODEL, recipe="w8a8", status="promoted", key="k", registry_version=first.version,
                                   artifact_dir=str(workspace.artifact), manifest_sha256=first.manifest_hash)
    refusal = job_module._verify_cached(ledger_entry, workspace.registry)
    assert isinstance(refusal, CandidateResult) and refusal.status == "error" and named in refusal.reasons[0]
    assert job_module._verify_cached(ledger_entry.model_copy(update={"registry_version": second.version}), workspace.registry) is None
    assert verify(workspace, f"{MODEL}@{second.version}") == 0  # the other version's bundle is its own


def test_an_untrusted_key_is_refused_and_rotation_keeps_old_versions(cli, workspace, monkeypatch, tmp_path, capsys) -> None:
    old_private, old_public = ec_key(tmp_path, "old")
    new_private, new_public = ec_key(tmp_path, "new")
    monkeypatch.setenv(KEY_ENV, str(old_private))
    old = promoted(cli, workspace)
    monkeypatch.setenv(KEY_ENV, str(new_private))  # rotation: the new key signs new promotions
    new = promoted(cli, workspace)
    monkeypatch.setenv(TRUSTED_ENV, os.pathsep.join([str(old_public), str(new_public)]))
    assert verify(workspace, f"{MODEL}@{old.version}") == 0 and verify(workspace, f"{MODEL}@{new.version}") == 0
    monkeypatch.setenv(TRUSTED_ENV, str(new_public))  # the old key is no longer trusted
    capsys.readouterr()
    assert verify(workspace, f"{MODEL}@{old.version}") == 2
    assert "not among the trusted keys" in capsys.readouterr().err
    assert verify(workspace, f"{MODEL}@{new.version}") == 0
    # A bundle re-signed by another key than the one the registry recorded is refused too.
    bundle = bundle_of(workspace, new)
    subprocess.run([sys.executable, "-m", "model_signing", "sign", "key", str(bundle), "--signature", str(bundle / SIGNATURE_NAME),
                    "--private_key", str(old_private)], check=True, capture_output=True, timeout=120)
    monkeypatch.delenv(TRUSTED_ENV)
    capsys.readouterr()
    assert verify(workspace, f"{MODEL}@{new.version}") == 2
    assert str(bundle / SIGNATURE_NAME) in capsys.readouterr().err


def test_a_truncated_signature_and_a_bundle_from_another_version_are_refused(cli, workspace, capsys) -> None:
    first, second = promoted(cli, workspace), promoted(cli, workspace)
    # The second version's folder replaced by the first one's (validly signed by the same key): not this version.
    shutil.rmtree(bundle_of(workspace, second))
    shutil.copytree(bundle_of(workspace, first), bundle_of(workspace, second))
    capsys.readouterr()
    assert verify(workspace, f"{MODEL}@{second.version}") == 2
    assert f"is not version {second.version}" in capsys.readouterr().err
    signature = bundle_of(workspace, first) / SIGNATURE_NAME
    signature.write_bytes(signature.read_bytes()[:100])
    assert verify(workspace, f"{MODEL}@{first.version}") == 2
    assert "truncated or malformed" in capsys.readouterr().err


@pytest.mark.parametrize(("content", "message"), [
    (None, "no such private key file"),
    (b"-----BEGIN PRIVATE KEY-----\nnot base64\n-----END PRIVATE KEY-----\n", "not a readable PEM private key"),
    ("public", "has no private part"),
    ("rsa", "not an elliptic-curve key"),
])
def test_a_bad_signing_key_fails_before_anything_is_promoted(cli, workspace, monkeypatch, tmp_path, capsys, content, message) -> None:
    key = tmp_path / "key.pem"
    if content == "public":
        key = ec_key(tmp_path, "k")[1]
    elif content == "rsa":
        rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        key.write_bytes(rsa_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    elif content is not None:
        key.write_bytes(content)
    monkeypatch.setenv(KEY_ENV, str(key))
    assert cli() == 2
    err = capsys.readouterr().err
    assert message in err and KEY_ENV in err and len(err.strip().splitlines()) == 1, err
    assert not workspace.runs.exists() or not any(workspace.runs.iterdir())  # refused before any work
    assert not (workspace.registry.parent / "promoted").exists()
    assert Registry(workspace.registry).list() == []


def test_hand_promotion_signs_and_a_failed_one_leaves_no_bundle(cli, workspace, monkeypatch, tmp_path) -> None:
    version = promoted(cli, workspace)
    registry = Registry(workspace.registry)
    assert registry.verify_signature(version) is not None
    # A candidate promoted by hand (`quantize registry promote`) gets its bundle signed the same way.
    candidate = registry.register(version_like(version, tmp_path))
    assert main(["registry", "promote", MODEL, str(candidate.version), "--reason", "by hand", "--registry", str(workspace.registry)]) == 0
    assert verify(workspace, f"{MODEL}@{candidate.version}") == 0
    # Promoting needs a usable key: a bad one leaves the version a candidate and no bundle behind.
    third = registry.register(version_like(version, tmp_path, stamp="2026-12-03T10:00:00+00:00"))
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "missing.pem"))
    assert main(["registry", "promote", MODEL, str(third.version), "--reason", "by hand", "--registry", str(workspace.registry)]) == 2
    assert registry.show(MODEL, third.version).status == "candidate"
    assert not bundle_of(workspace, third).exists()


def version_like(version: Version, tmp_path: Path, stamp: str = "2026-12-02T10:00:00+00:00"):
    """A new candidate of the same artifact with fresh gate evidence (another gate run)."""
    from pipelines.registry.store import NewVersion

    gate = json.loads(Path(version.gate_path or "").read_text())
    gate["created_at"] = stamp
    run = tmp_path / f"run-{stamp[:10]}"
    run.mkdir()
    (run / "gate.json").write_text(json.dumps(gate))
    return NewVersion(source_model=MODEL, source_hash=version.source_hash, artifact_path=Path(version.artifact_path),
                      recipe_name=version.recipe_name, recipe_hash=version.recipe_hash, eval_sets=version.eval_sets, gate_path=run / "gate.json")


def test_certificate_signing_verifies_against_the_chain(cli, workspace, monkeypatch, tmp_path) -> None:
    ca_key, leaf_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "quantgate test CA")])
    ca = _certificate(ca_name, ca_name, ca_key.public_key(), ca_key, is_ca=True)
    leaf = _certificate(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gate job")]), ca_name, leaf_key.public_key(), ca_key, is_ca=False)
    paths = {name: tmp_path / f"{name}.pem" for name in ("ca", "leaf", "key")}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["leaf"].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(leaf_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    monkeypatch.setenv(KEY_ENV, str(paths["key"]))
    monkeypatch.setenv(CERT_ENV, str(paths["leaf"]))
    monkeypatch.setenv(CHAIN_ENV, str(paths["ca"]))
    version = promoted(cli, workspace)
    monkeypatch.setenv(TRUSTED_ENV, str(paths["ca"]))
    assert verify(workspace, f"{MODEL}@{version.version}") == 0
    flip_byte(bundle_of(workspace, version) / "model.safetensors")
    assert verify(workspace, f"{MODEL}@{version.version}") == 2


def _certificate(subject: x509.Name, issuer: x509.Name, public_key, signing_key, *, is_ca: bool) -> x509.Certificate:
    import datetime

    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=not is_ca, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=is_ca, crl_sign=is_ca,
                                     encipher_only=False, decipher_only=False), critical=True)
    )
    if not is_ca:
        builder = builder.add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.CODE_SIGNING]), critical=False)
    return builder.sign(signing_key, hashes.SHA256())


def test_an_artifact_holding_a_name_the_bundle_reserves_is_not_promoted(cli, workspace, capsys) -> None:
    (workspace.artifact / SIGNATURE_NAME).write_text("not ours")
    manifest = workspace.artifact / "manifest.json"
    listed = json.loads(manifest.read_text())
    listed["artifact_files"][SIGNATURE_NAME] = hashlib.sha256(b"not ours").hexdigest()
    manifest.write_text(json.dumps(listed))
    assert cli() == 2
    assert "a name the promotion bundle reserves" in capsys.readouterr().err
    assert [v.status for v in Registry(workspace.registry).list(MODEL)] == ["candidate"]
    assert not list((workspace.registry.parent / "promoted" / MODEL).iterdir())


def test_a_second_registry_in_the_same_folder_cannot_replace_the_first_one_s_bundle(cli, workspace, tmp_path) -> None:
    """Two registries side by side number their versions alike and keep bundles in the same promoted/ folder: the second
    one's version 1 replaced the first one's signed bundle (a CI run's Ray job registries beside the session's), which then
    no longer verified. The second promotion is refused, before any copy, and the first bundle still verifies."""
    version = promoted(cli, workspace)
    other = Registry(workspace.registry.with_name("other-registry.db"))
    candidate = other.register(version_like(version, tmp_path))
    assert candidate.version == version.version
    assert main(["registry", "promote", MODEL, str(candidate.version), "--reason", "by hand", "--registry", str(other.path)]) == 2
    assert other.show(MODEL, candidate.version).status == "candidate"
    assert verify(workspace, f"{MODEL}@{version.version}") == 0


def _empty_folder(bundle: Path) -> Path:
    (bundle / "extra" / "deeper").mkdir(parents=True)
    return bundle / "extra"


def _folder_beside_signed_files(bundle: Path) -> Path:
    (bundle / EVIDENCE_DIR / "empty").mkdir()
    return bundle / EVIDENCE_DIR / "empty"


def _symlink(bundle: Path) -> Path:
    (bundle / "notes.txt").symlink_to(bundle / "model.safetensors")
    return bundle / "notes.txt"


def _fifo(bundle: Path) -> Path:
    os.mkfifo(bundle / "pipe")
    return bundle / "pipe"


@pytest.mark.parametrize("add", [_empty_folder, _folder_beside_signed_files, _symlink, _fifo])
def test_a_bundle_holding_anything_its_manifest_does_not_list_is_refused(cli, workspace, capsys, add) -> None:
    version = promoted(cli, workspace)
    added = add(bundle_of(workspace, version))
    capsys.readouterr()
    assert verify(workspace, f"{MODEL}@{version.version}") == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert str(added) in line
