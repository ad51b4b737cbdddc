"""The canary: golden sets built and probed against a fake OpenAI server (fake_openai.py), the draw, the comparison rule,
and the file's reading."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from fake_openai import FakeOpenAI, ToyModel

from pipelines.canary.build import DrawnPrompt, PromptSource, build_golden, draw, tolerance_from
from pipelines.canary.compare import Answer, distance, judge
from pipelines.canary.golden import GOLDEN_FILE, GoldenPrompt, GoldenSet, SelfCheck, load_golden
from pipelines.canary.probe import probe_canary
from pipelines.errors import InputError, ServeError

SOURCES = [PromptSource(name=name, items=[(i, f"{name} ticket {i}: route it") for i in range(size)], add_special_tokens=True)
           for name, size in (("tickets", 30), ("orders", 30), ("tiny", 2))]


def drawn(count: int = 12) -> list[DrawnPrompt]:
    return draw(SOURCES, count, seed=7)


def golden_of(server: FakeOpenAI, count: int = 12, api_key: str | None = None) -> GoldenSet:
    return build_golden(server.base_url, model="demo", api_key=api_key, drawn=drawn(count), seed=7, timeout_s=10)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------------------------ the draw


def test_the_draw_is_stratified_seeded_and_fills_from_the_larger_sets() -> None:
    picked = draw(SOURCES, 12, seed=7)
    by_set = {name: sum(1 for p in picked if p.eval_set == name) for name in ("tickets", "orders", "tiny")}
    assert by_set == {"tickets": 5, "orders": 5, "tiny": 2}
    assert picked == draw(SOURCES, 12, seed=7)
    assert picked != draw(SOURCES, 12, seed=8)
    assert len({(p.eval_set, p.doc_id) for p in picked}) == 12
    assert len(draw(SOURCES, 500, seed=1)) == 62  # every item, no more


# ------------------------------------------------------------------------------ build and probe


def test_the_same_weights_agree_under_noise_and_other_weights_disagree() -> None:
    with FakeOpenAI(ToyModel(weights=0, noise=0.02), api_key="k") as server:
        golden = golden_of(server, api_key="k")
        assert [c.name for c in golden.tolerance.self_checks] == ["alone", "load"]
        assert golden.tolerance.self_checks[1].concurrency == 12 * 4
        assert golden.tolerance.kl_bound >= max(c.max_kl for c in golden.tolerance.self_checks)
        for _ in range(3):
            result = probe_canary(server.base_url + "/v1", model="demo", golden=golden, api_key="k", timeout_s=10)
            assert result.healthy, result.summary()
            assert result.answered == 12 and result.disagreeing == []
        assert result.summary() == "12 of 12 golden prompts agree within tolerance"
    with FakeOpenAI(ToyModel(weights=1, noise=0.02, perturb=2.0), api_key="k") as other:
        result = probe_canary(other.base_url, model="demo", golden=golden, api_key="k", timeout_s=10)
    assert not result.healthy and result.error is None
    assert len(result.disagreeing) >= 6, result.summary()
    assert result.summary().startswith(f"{len(result.disagreeing)} of 12 golden prompts disagree beyond tolerance: p")
    assert all(check.reason for check in result.checks if check.disagrees)


def test_a_golden_set_round_trips_through_its_file(tmp_path: Path) -> None:
    with FakeOpenAI(ToyModel()) as server:
        golden = golden_of(server, count=4)
    (tmp_path / "evidence").mkdir()
    (tmp_path / "evidence" / GOLDEN_FILE).write_text(golden.model_dump_json())
    assert load_golden(tmp_path) == golden
    assert load_golden(tmp_path / "elsewhere") is None  # a bundle that predates canaries


@pytest.mark.parametrize("trouble", ["status", "key", "model", "down", "slow"])
def test_a_server_that_does_not_answer_is_unhealthy_and_nothing_raises(trouble: str) -> None:
    with FakeOpenAI(ToyModel()) as server:
        golden = golden_of(server, count=4)
    server = FakeOpenAI(ToyModel(), api_key="k", status=500 if trouble == "status" else 200, delay_s=1.0 if trouble == "slow" else 0.0)
    with server:
        base = f"http://127.0.0.1:{free_port()}" if trouble == "down" else server.base_url
        result = probe_canary(base, model="other" if trouble == "model" else "demo", golden=golden,
                              api_key="wrong" if trouble == "key" else "k", timeout_s=0.5)
    assert not result.healthy and result.error is not None and result.answered == 0
    expected = {"status": "HTTP 500", "key": "HTTP 401", "model": "HTTP 404", "down": "unreachable", "slow": "no answer within"}[trouble]
    assert expected in result.error
    assert result.summary().startswith("canary probe failed (0 of 4 golden prompts answered)")


def test_building_against_a_failing_server_is_a_serve_error() -> None:
    with FakeOpenAI(ToyModel(), status=503) as server, pytest.raises(ServeError, match="HTTP 503"):
        golden_of(server, count=2)


# ------------------------------------------------------------------------------ the rule


def prompt(rows: list[dict[str, float]], ids: list[int]) -> GoldenPrompt:
    return GoldenPrompt(id="p00", eval_set="s", doc_id=0, text="t", prompt_ids=[1], answer_ids=ids, answer_text="", top_logprobs=rows)


def test_a_flip_at_a_near_tie_is_noise_and_a_flip_at_a_confident_token_disagrees() -> None:
    tolerance = tolerance_from([SelfCheck(name="alone", concurrency=1, max_kl=0.0, max_shift=0.0, diverged=0, max_divergence_margin=0.0, wall_s=0.1)])
    near_tie = prompt([{"token_id:5": -0.69, "token_id:6": -0.70}, {"token_id:7": -0.1, "token_id:8": -3.0}], [5, 7])
    flipped = Answer(ids=[6, 9], top_logprobs=[{"token_id:6": -0.69, "token_id:5": -0.70}, {"token_id:9": -0.1, "token_id:8": -3.0}])
    found = distance(near_tie, flipped, top_k=2)
    assert found.diverged_at == 0 and found.margin == pytest.approx(0.01)
    assert not judge(found, tolerance).disagrees  # only position 0 compared: later ones follow another path
    confident = prompt([{"token_id:5": -0.01, "token_id:6": -5.0}], [5])
    wrong = Answer(ids=[6], top_logprobs=[{"token_id:6": -0.01, "token_id:5": -5.0}])
    check = judge(distance(confident, wrong, top_k=2), tolerance)
    assert check.disagrees and "token 0 differs" in (check.reason or "") and "KL" in (check.reason or "")


def test_an_answer_that_stops_early_diverges_where_it_stopped() -> None:
    golden = prompt([{"token_id:5": -0.01, "token_id:6": -5.0}, {"token_id:2": -0.01, "token_id:6": -5.0}], [5, 2])
    found = distance(golden, Answer(ids=[5], top_logprobs=[{"token_id:5": -0.01, "token_id:6": -5.0}]), top_k=2)
    assert found.diverged_at == 1 and found.margin == pytest.approx(4.99) and found.kl == pytest.approx(0.0, abs=1e-9)


# ------------------------------------------------------------------------------ the file


@pytest.mark.parametrize(("edit", "field"), [
    (lambda d: d["tolerance"].pop("kl_bound"), "tolerance.kl_bound"),
    (lambda d: d["prompts"][0].update(answer_ids=[]), "prompts.0.answer_ids"),
    (lambda d: d["prompts"][1].update(id=d["prompts"][0]["id"]), "prompts.id"),
    (lambda d: d["prompts"][0]["top_logprobs"].pop(), "prompts.0.top_logprobs"),
    (lambda d: d["settings"].update(temperature=0.7), "settings.temperature"),
])
def test_a_malformed_golden_set_names_its_file_and_field(tmp_path: Path, edit, field: str) -> None:
    with FakeOpenAI(ToyModel()) as server:
        document = json.loads(golden_of(server, count=2).model_dump_json())
    edit(document)
    path = tmp_path / "evidence" / GOLDEN_FILE
    path.parent.mkdir()
    path.write_text(json.dumps(document))
    with pytest.raises(InputError) as raised:
        load_golden(tmp_path)
    assert raised.value.file == str(path) and raised.value.field == field


def test_a_sure_model_s_runners_up_move_where_its_kl_hardly_does() -> None:
    """The demo model's case: top-1 at ~0 nats, runners-up at -12: other weights move them by nats, the KL by 1e-6."""
    recorded = {"token_id:5": -1e-6, "token_id:6": -13.0, "token_id:7": -14.0}
    now = {"token_id:5": -4e-6, "token_id:6": -12.0, "token_id:8": -13.5}
    found = distance(prompt([recorded], [5]), Answer(ids=[5], top_logprobs=[now]), top_k=3)
    assert found.kl is not None and found.kl < 1e-4
    assert found.shift == pytest.approx(1.0)  # token 6; token 7 fell below the listed -13.5: at least 0.5, not more claimed
    tolerance = tolerance_from([SelfCheck(name="alone", concurrency=1, max_kl=0.0, max_shift=0.02, diverged=0, max_divergence_margin=0.0,
                                          wall_s=0.1)])
    assert tolerance.shift_bound == pytest.approx(0.1) and judge(found, tolerance).disagrees


@pytest.mark.parametrize("url", ["not a url", "ftp://127.0.0.1:1", "http://[::1"])
def test_a_url_that_cannot_be_asked_is_unhealthy_not_an_exception(url: str) -> None:
    with FakeOpenAI(ToyModel()) as server:
        golden = golden_of(server, count=2)
    result = probe_canary(url, model="demo", golden=golden, api_key=None, timeout_s=2)
    assert not result.healthy and result.error and result.answered == 0


def test_a_probe_from_inside_an_event_loop_still_runs() -> None:
    import asyncio

    with FakeOpenAI(ToyModel()) as server:
        golden = golden_of(server, count=2)

        async def inside() -> bool:
            return probe_canary(server.base_url, model="demo", golden=golden, api_key=None, timeout_s=10).healthy

        assert asyncio.run(inside())
