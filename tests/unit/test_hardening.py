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


# ------------------------------------------------------------------------------------------- JSON Lines: bounded by lines


TASK = {
    "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": "data.jsonl"}}, "test_split": "test",
    "output_type": "generate_until", "doc_to_text": "{{q}}", "doc_to_target": "a",
    "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8},
    "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
}


def write_set(root: Path, name: str, data: bytes, **task: object) -> Path:
    import yaml

    folder = root / name
    folder.mkdir(parents=True)
    (folder / f"{name}.yaml").write_text(yaml.safe_dump({**TASK, "task": name, **task}))
    (folder / "data.jsonl").write_bytes(data)
    return folder


BLANK_60_MIB = b'{"q": "q", "a": "x", "text": "t"}\n' + b"\n" * (60 * 2**20)


@pytest.mark.parametrize("reader", ["eval set", "calibration set", "eval-sets list"])
def test_sixty_mib_of_blank_lines_end_within_seconds(tmp_path: Path, capsys, reader: str) -> None:
    """Inside the 64 MiB and the 1 MiB-per-line limits, 63 million empty lines: refused at line 2,000,001."""
    from pipelines.evaluation.evalsets import validate_calibration_set, validate_eval_set

    folder = write_set(tmp_path, "blank", BLANK_60_MIB)
    started = time.monotonic()
    if reader == "eval-sets list":
        (folder / "set.yaml").write_text("kind: calibration\n")
        code = main(["eval-sets", "list", "--root", str(tmp_path)])
        assert "more than 2,000,000 lines" in refused_fast(code, started, capsys, folder / "data.jsonl")
        return
    if reader == "calibration set":
        (folder / "set.yaml").write_text("kind: calibration\n")
    validate = validate_eval_set if reader == "eval set" else validate_calibration_set
    with pytest.raises(InputError, match="more than 2,000,000 lines") as refused:
        validate(folder)
    assert time.monotonic() - started < 5.0
    assert refused.value.field == "line 2000001"


def test_a_calibration_file_of_blank_lines_is_refused_where_quantize_reads_it(tmp_path: Path) -> None:
    from pipelines.quantize.calibration import load_calibration_texts

    data = tmp_path / "calibration.jsonl"
    data.write_bytes(BLANK_60_MIB)
    started = time.monotonic()
    with pytest.raises(InputError, match="more than 2,000,000 lines"):
        load_calibration_texts(str(data), 1, 0)
    assert time.monotonic() - started < 5.0


@pytest.mark.parametrize(("line", "message"), [
    (b'{"q": "q1", "a": null}', "target 'a' is null"),
    (b'{"q": "q1", "a": {"x": 1}}', "target 'a' is an object"),
    (b'{"q": "q1", "a": true}', "target 'a' is a boolean"),
    (b'{"q": "q1", "a": []}', "target 'a' is an empty list"),
    (b'{"q": "q1", "a": ["x", null]}', "target 'a' is a list holding null"),
    (b'{"q": "q1", "a": "\\ud800"}', "a lone surrogate \\ud800"),
    (b'{"q": "\\udfff", "a": "x"}', "a lone surrogate \\udfff"),
])
def test_eval_set_targets_are_checked_by_type(tmp_path: Path, capsys, line: bytes, message: str) -> None:
    root = tmp_path / "sets"
    write_set(root, "targets", b'{"q": "q0", "a": "x"}\n' + line + b"\n")
    code = main(["eval-sets", "validate", "--root", str(root)])
    err = capsys.readouterr().err
    assert code == 2 and "data.jsonl: line 2:" in err and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("line", [b'{"q": "q1", "a": 7}', b'{"q": "q1", "a": ["x", "y"]}', b'{"q": "q1", "a": "\\ud83d\\ude00"}'])
def test_good_targets_still_validate(tmp_path: Path, line: bytes) -> None:
    from pipelines.evaluation.evalsets import validate_eval_set

    assert validate_eval_set(write_set(tmp_path, "targets", b'{"q": "q0", "a": "x"}\n' + line + b"\n")).num_items == 2


def test_a_template_target_reading_a_null_field_is_refused(tmp_path: Path) -> None:
    from pipelines.evaluation.evalsets import validate_eval_set

    folder = write_set(tmp_path, "templated", b'{"q": "q0", "a": null}\n', doc_to_target="{{a}}")
    with pytest.raises(InputError, match="'a', which doc_to_target renders, is null"):
        validate_eval_set(folder)


# ------------------------------------------------------------------------------------------- rendering: one budget per command

# a fraction of a second an item, inside every per-item budget
SLOW = "{% for i in range(400) %}{% for j in range(500) %}{% endfor %}{% endfor %}{{q}}"


def slow_sets(root: Path, count: int, items: int = 3) -> None:
    data = b"".join(b'{"q": "q%d", "a": "x"}\n' % i for i in range(items))
    for index in range(count):
        write_set(root, f"slow{index:02d}", data, doc_to_text=SLOW)


def test_many_sets_each_inside_its_own_budget_stop_at_the_command_s(tmp_path: Path, capsys, monkeypatch) -> None:
    from pipelines.evaluation import budget

    monkeypatch.setattr(budget, "COMMAND_SECONDS", 0.5)  # 30 s in the product: the same rule at a test's scale
    slow_sets(tmp_path, 6)
    code = main(["eval-sets", "validate", "--root", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "this command's templates took more than 0.5 s" in err, err
    spent = budget.command_budget()
    assert spent.spent < 0.5 + 0.2 and spent.renders < 6 * 3, spent  # stopped at its budget: the later sets never rendered


def test_power_fails_on_a_set_that_does_not_validate_instead_of_leaving_it_out(tmp_path: Path, capsys, monkeypatch) -> None:
    from pipelines.evaluation import budget

    monkeypatch.setattr(budget, "COMMAND_SECONDS", 0.5)
    slow_sets(tmp_path, 6)
    assert main(["eval-sets", "power", "--root", str(tmp_path), "--json"]) == 2
    assert "this command's templates took more than" in capsys.readouterr().err
    write_set(tmp_path / "other", "fine", b'{"q": "q", "a": "x"}\n')
    write_set(tmp_path / "other", "broken", b'{"q": "q", "a": null}\n')
    assert main(["eval-sets", "power", "--root", str(tmp_path / "other"), "--json"]) == 2
    assert "target 'a' is null" in capsys.readouterr().err


def test_set_budgets_grow_with_the_renderings(monkeypatch) -> None:
    """A large legitimate set is never refused for its size: 5,000 trivial renderings take longer than the fixed part
    of the set's budget here (0.05 s), and fit the 1 ms each adds (the command's budget is a total: test_command_budget.py)."""
    from pipelines.evaluation.budget import CommandBudget
    from pipelines.evaluation.templates import CommandBudgetError, RenderBudget, compile_template

    command = CommandBudget(60.0)
    budget = RenderBudget(seconds=0.05, command=command)
    template = compile_template("Q: {{ q }}")
    for index in range(5_000):
        budget.render(template, {"q": index})
    assert budget.time.spent > 0.05 and command.renders == 5_000
    spent = CommandBudget(0.0, per_render=0.0)
    with pytest.raises(CommandBudgetError, match="this command's templates took more than 0 s"):
        RenderBudget(command=spent).render(compile_template(SLOW), {"q": "x"})


# ------------------------------------------------------------------------------------------- GGUF: blocks bound by the architecture


@pytest.mark.parametrize("architecture", ["qwen3", "gemma3", "phi3"])
def test_a_gguf_deeper_than_its_family_is_refused_from_the_header(tmp_path: Path, capsys, architecture: str) -> None:
    from test_models import write_gguf

    from pipelines.models.gguf import MAX_BLOCKS

    deep = write_gguf(tmp_path / "deep.gguf", architecture=architecture, blocks=MAX_BLOCKS[architecture] + 1)
    started = time.monotonic()
    code = main(["models", "add", "deep", "--gguf", str(deep)])
    err = refused_fast(code, started, capsys, deep)
    assert f"declares {MAX_BLOCKS[architecture] + 1:,} blocks; no {architecture} model has more than" in err
    assert f"{architecture}.block_count" in err


# ------------------------------------------------------------------------------------------- arguments: bounded lists, checked names


@pytest.fixture
def one_set(tmp_path: Path) -> Path:
    root = tmp_path / "sets"
    write_set(root, "small", b"".join(b'{"q": "q%d", "a": "x"}\n' % i for i in range(300)))
    return root


def test_five_thousand_discordances_are_refused_before_any_sum(one_set: Path, capsys) -> None:
    values = ",".join(f"{0.001 + i * 1e-6:.6f}" for i in range(5000))
    started = time.monotonic()
    err = refused_fast(main(["eval-sets", "power", "--root", str(one_set), "--discordance", values]), started, capsys, "--discordance")
    assert "44,999 characters: at most 10,000" in err and len(err) < 300
    few = ",".join(["0.01"] * 17)
    assert "17 values: at most 16" in refused_fast(main(["eval-sets", "power", "--root", str(one_set), "--discordance", few]),
                                                   time.monotonic(), capsys, "--discordance")


def test_an_overlong_eval_set_list_is_refused_naming_the_option(one_set: Path, capsys) -> None:
    names = ",".join(f"set{i}" for i in range(300))
    err = refused_fast(main(["eval-sets", "power", "--root", str(one_set), "--eval-sets", names]), time.monotonic(), capsys, "--eval-sets")
    assert "300 values: at most 256" in err
    err = refused_fast(main(["eval-sets", "power", "--root", str(one_set), "--eval-sets", "x" * 20_000]), time.monotonic(), capsys,
                       "--eval-sets")
    assert "20,000 characters" in err and len(err) < 300


@pytest.mark.parametrize("recipe", ["../../etc/passwd", "r" * 100_000, "w8a8\n", "/etc/passwd"])
def test_power_refuses_a_recipe_that_is_neither_a_recipe_nor_a_name(one_set: Path, capsys, recipe: str) -> None:
    code = main(["eval-sets", "power", "--root", str(one_set), "--recipe", recipe, "--json"])
    out, err = capsys.readouterr()
    assert code == 2 and "recipe" in out, (out, err)
    assert len(out) < 1000


def test_power_reads_a_shipped_recipe_s_identity_and_accepts_a_bare_name(one_set: Path, capsys) -> None:
    import json

    assert main(["eval-sets", "power", "--root", str(one_set), "--recipe", "w8a8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recipe"] == "w8a8"
    assert main(["eval-sets", "power", "--root", str(one_set), "--recipe", "quantized-elsewhere", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recipe"] == "quantized-elsewhere"


# ------------------------------------------------------------------------------------------- numbers and flags as written


def test_a_job_s_max_retries_true_is_refused_not_read_as_one(tmp_path: Path, capsys) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("name: probe\nexecutor: ray\nmax_retries: true\ncandidates:\n  - model: models/demo-llama\n    recipes: [w8a8]\n")
    started = time.monotonic()
    err = refused_fast(main(["job", str(job)]), started, capsys, job, within_s=30.0)
    assert "max_retries: Value error, must be a number, not a boolean (true)" in err


@pytest.mark.parametrize(("rule", "value", "message"), [
    ("confidence", '"0.95"', "must be a number, not text ('0.95')"),
    ("min_items", '"50"', "must be a number, not text ('50')"),
    ("non_inferiority", '"yes"', "must be true or false, not text ('yes')"),
    ("non_inferiority", "1", "must be true or false, not the number 1"),
    ("ni_margin", "true", "must be a number, not a boolean (true)"),
])
def test_a_policy_rule_written_as_the_wrong_kind_is_refused(tmp_path: Path, capsys, one_set: Path, rule: str, value: str, message: str) -> None:
    import re

    from pipelines.gate.policy import DEFAULT_POLICY

    text = DEFAULT_POLICY.read_text()
    policy = tmp_path / "policy.yaml"
    policy.write_text(re.sub(rf"(\n  {rule}:) [^\n#]*", rf"\1 {value}", text, count=1))
    assert policy.read_text() != text
    err = refused_fast(main(["eval-sets", "power", "--root", str(one_set), "--policy", str(policy)]), time.monotonic(), capsys, policy)
    assert f"defaults.{rule}" in err and message in err, err


def test_a_recipe_count_written_as_text_is_refused(tmp_path: Path, capsys) -> None:
    from pipelines.recipe import RECIPES_DIR

    recipe = tmp_path / "r.yaml"
    recipe.write_text((RECIPES_DIR / "w8a8.yaml").read_text().replace("num_samples: 64", 'num_samples: "64"'))
    assert 'num_samples: "64"' in recipe.read_text()
    code = main(["recipe", "validate", str(recipe)])
    err = capsys.readouterr().err
    assert code == 2 and "calibration.num_samples" in err and "must be a number, not text ('64')" in err, err


def test_a_huge_wrong_value_is_shown_shortened() -> None:
    from pydantic import ValidationError

    from pipelines.errors import from_validation_error
    from pipelines.gate.policy import RuleOverrides

    with pytest.raises(ValidationError) as caught:
        RuleOverrides.model_validate({"confidence": "9" * 100_000})
    assert len(from_validation_error(caught.value, "policy.yaml").one_line()) < 400


# ------------------------------------------------------------------------------------------- Ray addresses: a real handshake


class Listener:
    """A TCP listener on loopback that accepts and then answers `reply` (None: never answers, never closes)."""

    def __init__(self, reply: bytes | None) -> None:
        import socket
        import threading

        self.reply, self.held = reply, []
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(8)
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.server.accept()
            except OSError:
                return
            self.held.append(connection)
            if self.reply is not None:
                connection.recv(64)
                connection.sendall(self.reply)

    def close(self) -> None:
        for connection in self.held:
            connection.close()
        self.server.close()


@pytest.fixture
def listener(request):
    made = Listener(request.param)
    yield made
    made.close()


SETTINGS = b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x03\x00\x00\x00\x64"  # a server's SETTINGS: max concurrent streams 100


@pytest.mark.parametrize("listener", [None], indirect=True)
def test_a_listener_that_never_answers_is_refused_within_the_timeout(listener: Listener) -> None:
    from pipelines.jobs.ray.address import CONNECT_TIMEOUT_S, check_address

    started = time.monotonic()
    with pytest.raises(InputError, match=rf"unreachable: no answer to a gRPC \(HTTP/2\) handshake within {CONNECT_TIMEOUT_S:g} s"):
        check_address(f"127.0.0.1:{listener.port}")
    assert CONNECT_TIMEOUT_S - 0.5 < time.monotonic() - started < CONNECT_TIMEOUT_S + 1.0


@pytest.mark.parametrize("listener", [b"HTTP/1.1 400 Bad Request\r\n\r\n"], indirect=True)
def test_a_listener_speaking_another_protocol_is_refused(listener: Listener) -> None:
    from pipelines.jobs.ray.address import check_address

    with pytest.raises(InputError, match=r"does not speak gRPC \(HTTP/2\)"):
        check_address(f"127.0.0.1:{listener.port}")


@pytest.mark.parametrize("listener", [SETTINGS], indirect=True)
def test_a_grpc_server_passes_the_handshake(listener: Listener) -> None:
    from pipelines.jobs.ray.address import check_address

    check_address(f"127.0.0.1:{listener.port}")


@pytest.mark.parametrize(("address", "message"), [
    ("127.0.0.1:6379\n", "whitespace or a control character"),
    (" 127.0.0.1:6379", "whitespace or a control character"),
    ("a" * 100_000 + ":6379", "100,005 characters"),
    ("a" * 64 + ".example:6379", "not a host name"),
    ("127.0.0.1:6379/path", "not a Ray address"),
])
def test_an_address_that_is_not_one_is_refused_in_one_line(address: str, message: str) -> None:
    from pipelines.jobs.ray.address import check_address

    with pytest.raises(InputError, match=message) as refused:
        check_address(address)
    assert refused.value.field == "--ray-address" and len(refused.value.one_line()) < 400


def test_a_ray_client_address_without_the_client_is_refused_in_one_line(monkeypatch) -> None:
    import importlib.util

    from pipelines.jobs.ray import address

    real = importlib.util.find_spec
    monkeypatch.setattr(address.importlib.util, "find_spec", lambda name, *a: None if name == "grpc" else real(name, *a))
    with pytest.raises(InputError, match=r"a ray:// address needs the Ray client \(ray\[client\]"):
        address.check_address("ray://127.0.0.1:10001")


@pytest.mark.parametrize("listener", [None], indirect=True)
@pytest.mark.parametrize("how", ["--ray-address", "RAY_ADDRESS", "RAY_ADDRESS with a newline"])
def test_the_job_command_refuses_a_silent_cluster(tmp_path, monkeypatch, capsys, listener: Listener, how: str) -> None:
    from pipelines.jobs.ray import address as ray_address
    from pipelines.paths import DEMO_MODEL_DIR

    monkeypatch.setattr(ray_address, "CONNECT_TIMEOUT_S", 1.0)
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path / "artifacts"))
    job = tmp_path / "job.yaml"
    job.write_text(f"name: probe\nexecutor: ray\nregistry: {tmp_path / 'registry.db'}\ncandidates:\n"
                   f"  - model: {DEMO_MODEL_DIR}\n    recipes: [w8a8]\n    eval_sets: [ticket_routing]\n")
    address = f"127.0.0.1:{listener.port}"
    args = ["job", str(job)]
    if how == "--ray-address":
        args += ["--ray-address", address]
    else:
        monkeypatch.setenv("RAY_ADDRESS", address + ("\n" if "newline" in how else ""))
    started = time.monotonic()
    err = refused_fast(main(args), started, capsys, "--ray-address" if how == "--ray-address" else "RAY_ADDRESS", within_s=30.0)
    assert ("whitespace or a control character" if "newline" in how else "no answer to a gRPC (HTTP/2) handshake within 1 s") in err


# ------------------------------------------------------------------------------------------- nothing outside the artifacts root


def test_loading_prompts_in_process_writes_no_datasets_cache_outside_the_run(tmp_path: Path) -> None:
    """lm-eval's TaskManager loads each set with `datasets`, whose cache defaults to ~/.cache/huggingface/datasets."""
    home, temporary, run = tmp_path / "home", tmp_path / "tmp", tmp_path / "artifacts" / "runs" / "r"
    for folder in (home, temporary):
        folder.mkdir(parents=True)
    script = (
        "from pathlib import Path\nfrom pipelines.evaluation.evalsets import validate_eval_set\n"
        "from pipelines.evaluation.evaluate import load_all_prompts, materialize_tasks\n"
        "from pipelines.paths import EVAL_SETS_DIR\n"
        "s = validate_eval_set(EVAL_SETS_DIR / 'ticket_routing')\n"
        f"tasks = materialize_tasks([s], Path({str(run)!r}) / 'tasks')\n"
        "print(len(load_all_prompts([s], tasks)['ticket_routing']))\n"
    )
    env = {name: value for name, value in os.environ.items() if not name.startswith(("HF_DATASETS_CACHE", "HF_HOME", "XDG_CACHE"))}
    env.update(HOME=str(home), TMPDIR=str(temporary), QUANTGATE_ARTIFACTS=str(tmp_path / "artifacts"))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "250", done.stderr[-2000:]
    assert list(home.rglob("*")) == [] and list(temporary.rglob("*")) == []
    assert sorted(p.name for p in run.iterdir()) == ["tasks"]  # the cache was inside the run folder, and is gone
