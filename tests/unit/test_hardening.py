"""The third hardening pass (issue 39, docs/hardening.md): each case a held-out hostile probe found, ending as the exit
contract says (0/1/2, one line naming the file and field, bounded time and memory, nothing written outside the
artifacts root). The Ray cases that need a live runtime are in tests/integration/test_ray_job.py."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_signing import MODEL, bundle_of, promoted, verify

from pipelines.cli import main
from pipelines.errors import InputError
from pipelines.registry import signing
from pipelines.registry.store import Registry

SPARSE_BYTES = 30 * 2**30  # the probe's size: hashing it takes minutes, a stat microseconds


def sparse(path: Path, size: int = SPARSE_BYTES) -> None:
    with path.open("wb") as handle:
        handle.truncate(size)


def refused_fast(code: int, started: float, capsys: pytest.CaptureFixture, named: Path | str, *, within_s: float = 5.0) -> str:
    """Exit 2 within `within_s` (imports included: the check itself takes milliseconds), one line naming `named`."""
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 2, err
    assert elapsed < within_s, f"{elapsed:.1f} s"
    assert str(named) in err and len(err.strip().splitlines()) == 1, err
    return err


def registry_args(workspace: SimpleNamespace) -> list[str]:
    return ["--registry", str(workspace.registry)]


# ------------------------------------------------------------------------------------------- registry: sizes before hashes


@pytest.fixture
def two_versions(cli, workspace: SimpleNamespace) -> tuple[int, int]:
    """Two promoted versions; `production` moved from the first to the second (a rollback returns to the first)."""
    first = promoted(cli, workspace)
    assert main(["registry", "alias", MODEL, "production", str(first.version), *registry_args(workspace)]) == 0
    second = promoted(cli, workspace)
    assert main(["registry", "alias", MODEL, "production", str(second.version), *registry_args(workspace)]) == 0
    return first.version, second.version


@pytest.mark.parametrize("command", ["verify", "alias", "rollback"])
def test_a_huge_file_added_to_the_evidence_is_refused_before_any_hash(workspace, two_versions, capsys, command: str) -> None:
    first, _ = two_versions
    added = bundle_of(workspace, Registry(workspace.registry).show(MODEL, first)) / "evidence" / "huge.bin"
    sparse(added)
    capsys.readouterr()
    started = time.monotonic()
    code = {
        "verify": lambda: verify(workspace, f"{MODEL}@{first}"),
        "alias": lambda: main(["registry", "alias", MODEL, "staging", str(first), *registry_args(workspace)]),
        "rollback": lambda: main(["registry", "rollback", MODEL, "production", *registry_args(workspace)]),
    }[command]()
    assert "not covered by the signature" in refused_fast(code, started, capsys, added)


def test_weights_swapped_for_a_huge_file_are_refused_by_their_size(workspace, two_versions, capsys) -> None:
    first, _ = two_versions
    weights = bundle_of(workspace, Registry(workspace.registry).show(MODEL, first)) / "model.safetensors"
    signed = weights.stat().st_size
    weights.unlink()
    sparse(weights)
    capsys.readouterr()
    started = time.monotonic()
    err = refused_fast(verify(workspace, f"{MODEL}@{first}"), started, capsys, weights)
    assert f"{SPARSE_BYTES:,} bytes; {signed:,} bytes were signed" in err


def test_the_candidate_folder_s_weights_swapped_are_refused_by_the_recorded_fingerprint(workspace, two_versions, capsys) -> None:
    first, _ = two_versions
    weights = workspace.artifact / "model.safetensors"
    weights.unlink()
    sparse(weights)
    capsys.readouterr()
    started = time.monotonic()
    err = refused_fast(main(["registry", "alias", MODEL, "staging", str(first), *registry_args(workspace)]), started, capsys, weights)
    assert "when last verified" in err


def test_a_record_without_per_file_sizes_is_held_to_its_totals(workspace, two_versions) -> None:
    """Promotions signed before per-file sizes were recorded: the file count and total bytes, still before any hash."""
    first, _ = two_versions
    registry = Registry(workspace.registry)
    event = [e for e in registry.history(MODEL, version=first) if e.kind == "promoted"][-1]
    assert event.evidence is not None
    record = signing.parse_record(event.evidence)
    assert record is not None and record.sizes
    legacy = record.model_copy(update={"sizes": {}})
    assert signing.verify_bundle(legacy).files == record.files
    weights = Path(record.bundle) / "model.safetensors"
    weights.unlink()
    sparse(weights)
    started = time.monotonic()
    with pytest.raises(InputError, match="were signed") as refused:
        signing.verify_bundle(legacy)
    assert time.monotonic() - started < 1.0 and refused.value.file == record.bundle


def test_hashing_stops_at_the_recorded_size(tmp_path: Path) -> None:
    from pipelines.files.hashing import sha256_file

    grown = tmp_path / "grown.bin"
    grown.write_bytes(b"x" * 10)
    assert sha256_file(grown, size=10) == sha256_file(grown)
    with pytest.raises(InputError, match="grew past its recorded 9 bytes"):
        sha256_file(grown, size=9)


# ------------------------------------------------------------------------------------------- registry: links, key files


def test_a_hard_link_in_the_bundle_is_refused_like_a_symbolic_link(workspace, two_versions, capsys, tmp_path) -> None:
    first, _ = two_versions
    bundle = bundle_of(workspace, Registry(workspace.registry).show(MODEL, first))
    weights = bundle / "model.safetensors"
    outside = tmp_path / "outside.safetensors"
    shutil.copyfile(weights, outside)  # the same bytes: the signature alone would still verify
    weights.unlink()
    os.link(outside, weights)
    capsys.readouterr()
    assert "a hard link" in refused_fast(verify(workspace, f"{MODEL}@{first}"), time.monotonic(), capsys, weights)
    weights.unlink()
    weights.symlink_to(outside)
    assert "a symbolic link" in refused_fast(verify(workspace, f"{MODEL}@{first}"), time.monotonic(), capsys, weights)


def test_a_hard_link_in_the_candidate_folder_is_refused(workspace, two_versions, capsys, tmp_path) -> None:
    first, _ = two_versions
    config = workspace.artifact / "config.json"
    os.link(config, tmp_path / "second-name.json")
    capsys.readouterr()
    code = main(["registry", "alias", MODEL, "staging", str(first), *registry_args(workspace)])
    assert "a hard link" in refused_fast(code, time.monotonic(), capsys, config)


def test_the_verifying_keys_are_never_written_to_a_disk(tmp_path: Path) -> None:
    """model-signing reads the public key from a path: an in-memory file's. A verification SIGKILLed while it holds
    them leaves nothing anywhere (the probe found quantgate-keys-* folders left in the system's temporary folder)."""
    artifacts, temporary = tmp_path / "artifacts", tmp_path / "tmp"
    artifacts.mkdir()
    temporary.mkdir()
    script = (
        "import sys, time\nfrom pipelines.registry.signing import _pem_files\n"
        "with _pem_files(['-----BEGIN PUBLIC KEY-----\\n']) as paths:\n"
        "    print(paths[0], open(paths[0]).read().strip(), flush=True)\n    time.sleep(60)\n"
    )
    env = {**os.environ, "TMPDIR": str(temporary), "QUANTGATE_ARTIFACTS": str(artifacts)}
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line.startswith("/proc/self/fd/") and "BEGIN PUBLIC KEY" in line
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=10)
    assert list(temporary.iterdir()) == [] and list(artifacts.iterdir()) == []


def test_key_folders_a_killed_verification_left_are_removed_at_the_next_start(tmp_path: Path) -> None:
    stale, fresh, other = tmp_path / "quantgate-keys-old", tmp_path / "quantgate-keys-new", tmp_path / "unrelated"
    for folder in (stale, fresh, other):
        folder.mkdir()
        (folder / "0.pem").write_text("public key")
    long_ago = time.time() - 3600
    os.utime(stale, (long_ago, long_ago))
    os.utime(other, (long_ago, long_ago))
    assert signing.reclaim_key_folders(tmp_path) == [stale]
    assert not stale.exists() and fresh.exists() and other.exists()
