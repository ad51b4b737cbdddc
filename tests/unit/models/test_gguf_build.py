"""The GGUF set's cache and check without llama.cpp: the key, what counts as a cached set, the logit comparison and
the refusals (a tokenizer or function that differs, no llama.cpp environment), and the tool runner's errors."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from pipelines.errors import InputError
from pipelines.models import gguf_build, llamacpp_env
from pipelines.models.tokenizer import VERIFY_TEXTS

DEMO = Path(__file__).resolve().parents[3] / "models" / "demo-llama"


@pytest.fixture(autouse=True)
def no_llamacpp_environment(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Unit tests never use a real .venv-llamacpp: QUANTGATE_LLAMACPP_VENV points where there is none."""
    missing = tmp_path_factory.getbasetemp() / "no-llamacpp-venv"
    monkeypatch.setenv("QUANTGATE_LLAMACPP_VENV", str(missing))
    llamacpp_env.llamacpp_version.cache_clear()
    return missing


def fake_llamacpp(venv: Path, script: str) -> Path:
    python = venv / "bin" / "python"
    python.parent.mkdir(parents=True, exist_ok=True)
    python.write_text("#!/bin/sh\n" + script)
    python.chmod(0o755)
    return python


def test_the_cache_key_changes_with_the_source_the_quantizer_and_the_converter(monkeypatch: pytest.MonkeyPatch) -> None:
    key = gguf_build.cache_key("a" * 64, "0.3.36")
    assert len(key) == 16
    assert key == gguf_build.cache_key("a" * 64, "0.3.36")
    assert key != gguf_build.cache_key("b" * 64, "0.3.36")
    assert key != gguf_build.cache_key("a" * 64, "0.3.37")
    monkeypatch.setattr(gguf_build, "EXPORT_VERSION", gguf_build.EXPORT_VERSION + 1)
    assert key != gguf_build.cache_key("a" * 64, "0.3.36")


def test_the_cache_folder_is_under_the_artifacts_root_named_by_model_and_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path / "artifacts"))
    assert gguf_build.cache_folder(DEMO, "0123456789abcdef") == tmp_path / "artifacts" / "gguf" / "demo-llama-0123456789abcdef"


def _cached_set(folder: Path, sizes: dict[str, int]) -> gguf_build.GgufSet:
    folder.mkdir(parents=True)
    checks = []
    for kind, size in sizes.items():
        (folder / f"{kind}.gguf").write_bytes(b"GGUF" + b"\0" * (size - 4))
        checks.append(gguf_build.FileCheck(kind=kind, bytes=size, positions=3, max_abs_logit_diff=0.0, top1_agreement=1.0, decided_flips=0,
                                           mean_kl_nats=0.0))
    built = gguf_build.GgufSet(model_dir=DEMO, source_hash="a" * 64, llama_cpp_python="0.3.36", folder=folder,
                               files={kind: folder / f"{kind}.gguf" for kind in sizes}, tokenizer_texts=6, checks=checks)
    (folder / gguf_build.MANIFEST).write_text(built.model_dump_json())
    return built


def test_a_whole_cached_set_is_used_and_a_damaged_one_is_not(tmp_path: Path) -> None:
    built = _cached_set(tmp_path / "set", {"f16": 64, "q8_0": 40, "q4_k_m": 24})
    assert gguf_build._cached(tmp_path / "set") == built
    (tmp_path / "set" / "q8_0.gguf").write_bytes(b"GGUF")  # truncated
    assert gguf_build._cached(tmp_path / "set") is None
    (tmp_path / "set" / gguf_build.MANIFEST).write_text("{not json")
    assert gguf_build._cached(tmp_path / "set") is None
    assert gguf_build._cached(tmp_path / "nothing") is None


def _save(path: Path, arrays: list[np.ndarray]) -> Path:
    np.savez(path, *arrays)
    return path


def test_logits_are_compared_at_every_position(tmp_path: Path) -> None:
    reference = [np.array([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]]), np.array([[0.0, 0.0, 3.0]])]
    same = gguf_build.compare_logits("f16", 10, reference, _save(tmp_path / "same.npz", reference))
    assert (same.positions, same.max_abs_logit_diff, same.top1_agreement, same.mean_kl_nats) == (3, 0.0, 1.0, 0.0)
    moved = [np.array([[0.0, 1.0, 0.0], [0.0, 2.0, 0.0]]), np.array([[0.0, 0.0, 3.0]])]
    other = gguf_build.compare_logits("q4_k_m", 10, reference, _save(tmp_path / "moved.npz", moved))
    assert other.max_abs_logit_diff == 2.0 and other.top1_agreement == pytest.approx(2 / 3) and other.mean_kl_nats > 0.1
    assert other.decided_flips == 1  # the HF model's top two were 2 apart there: no near tie


def test_a_near_tie_may_swap_and_a_clear_lead_may_not(tmp_path: Path) -> None:
    reference = [np.array([[0.0, 9.0, 0.0], [1.0, 1.2, 0.0], [0.0, 0.0, 1.0]])]
    tie = [np.array([[0.0, 9.0, 0.0], [1.2, 1.0, 0.0], [0.0, 0.0, 1.0]])]
    check = gguf_build.compare_logits("f16", 10, reference, _save(tmp_path / "tie.npz", tie))
    assert (check.top1_agreement, check.decided_flips) == (pytest.approx(2 / 3), 0)
    lead = [np.array([[0.0, 9.0, 0.0], [1.0, 1.2, 0.0], [0.0, 0.7, 0.4]])]  # 1.0 ahead, 0.6 behind: swapped
    check = gguf_build.compare_logits("f16", 10, reference, _save(tmp_path / "lead.npz", lead))
    assert (check.top1_agreement, check.decided_flips) == (pytest.approx(2 / 3), 1)


def test_logits_of_another_shape_are_refused(tmp_path: Path) -> None:
    reference = [np.zeros((2, 3))]
    with pytest.raises(InputError, match="shape"):
        gguf_build.compare_logits("f16", 10, reference, _save(tmp_path / "l.npz", [np.zeros((2, 4))]))


@pytest.mark.parametrize(("kl", "flips", "accepted"), [(3e-6, 0, True), (1e-3, 0, True), (2e-3, 0, False), (1e-5, 1, False)])
def test_an_f16_file_is_the_model_within_serving_noise(kl: float, flips: int, accepted: bool) -> None:
    check = gguf_build.FileCheck(kind="f16", bytes=1, positions=255, max_abs_logit_diff=0.14, top1_agreement=0.99, decided_flips=flips,
                                 mean_kl_nats=kl)
    if accepted:
        gguf_build.require_same_function(Path("f16.gguf"), check)
    else:
        with pytest.raises(InputError, match="not the model"):
            gguf_build.require_same_function(Path("f16.gguf"), check)


def test_a_tokenizer_that_splits_or_decodes_differently_is_refused() -> None:
    ids = [[index, index + 1] for index in range(len(VERIFY_TEXTS))]
    good = {"tokens": ids, "decoded": list(VERIFY_TEXTS)}
    gguf_build.require_same_tokenizer(Path("f16.gguf"), ids, good)
    split = {**good, "tokens": [[0, 9], *ids[1:]]}
    with pytest.raises(InputError, match="at token 1"):
        gguf_build.require_same_tokenizer(Path("f16.gguf"), ids, split)
    lossy = {**good, "decoded": ["The capital of France is?", *VERIFY_TEXTS[1:]]}
    with pytest.raises(InputError, match="decodes"):
        gguf_build.require_same_tokenizer(Path("f16.gguf"), ids, lossy)


def test_without_the_llama_cpp_environment_the_build_says_how_to_make_it(no_llamacpp_environment: Path) -> None:
    with pytest.raises(InputError, match="scripts/setup_env.sh llamacpp") as caught:
        gguf_build.build_ggufs(DEMO)
    assert caught.value.file == str(no_llamacpp_environment / "bin" / "python")


def test_a_folder_that_is_no_model_is_refused_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no config.json"):
        gguf_build.build_ggufs(tmp_path)


def test_the_command_line_prints_one_line_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gguf_build.main(["--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no config.json" in err


def test_a_failing_tool_is_reported_with_its_last_log_line(no_llamacpp_environment: Path, tmp_path: Path) -> None:
    fake_llamacpp(no_llamacpp_environment, 'echo "llama_model_quantize: failed to quantize: bad magic" >&2; exit 1\n')
    with pytest.raises(InputError, match="quantize failed .exit code 1.: llama_model_quantize: failed to quantize: bad magic"):
        llamacpp_env.run_tool(["quantize", "a", "b", "q8_0", "--threads", "1"], log_path=tmp_path / "log", timeout_s=30)


def test_the_tool_answer_is_read_after_its_marker(no_llamacpp_environment: Path, tmp_path: Path) -> None:
    fake_llamacpp(no_llamacpp_environment, 'cat >/dev/null; echo "chatter"; echo \'QUANTGATE-LLAMACPP {"vocab": 7}\'\n')
    assert llamacpp_env.run_tool(["probe", "m.gguf", "--threads", "1"], log_path=tmp_path / "log", timeout_s=30, request={}) == {"vocab": 7}


def test_llama_cpp_processes_get_a_small_environment_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    # llama-cpp-python's server reads settings from variables of any name and uvicorn's address from HOST and PORT
    for name, value in {"HOST": "0.0.0.0", "PORT": "80", "MODEL": "/other.gguf", "API_KEY": "leaked", "N_CTX": "9"}.items():
        monkeypatch.setenv(name, value)
    env = llamacpp_env.clean_environment(API_KEY="ours")
    assert env["API_KEY"] == "ours" and env["PATH"] == os.environ["PATH"]
    assert not {"HOST", "PORT", "MODEL", "N_CTX"} & env.keys()
