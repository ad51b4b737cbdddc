import math

import numpy as np
import pytest

from pipelines.evaluation.divergence import TOP_K, Reference, coarse_kl, item_kl


def _log(probabilities: dict[str, float]) -> dict[str, float]:
    return {token: math.log(p) for token, p in probabilities.items()}


def test_identical_distributions_have_zero_kl():
    p = _log({"a": 0.6, "b": 0.3})
    assert coarse_kl(p, p) == pytest.approx(0.0, abs=1e-12)


def test_kl_on_top_k_plus_rest_matches_hand_computation():
    # p = (.5, .3, rest .2), q = (.3, .5, rest .2): KL = .5 ln(5/3) + .3 ln(3/5) + .2 ln(1)
    expected = 0.5 * math.log(5 / 3) + 0.3 * math.log(3 / 5)
    assert coarse_kl(_log({"a": 0.5, "b": 0.3}), _log({"a": 0.3, "b": 0.5})) == pytest.approx(expected)


def test_token_missing_from_candidate_top_k_uses_its_kth_probability():
    baseline = _log({"a": 0.9})
    candidate = _log({"b": 0.5, "c": 0.05})  # "a" absent: bounded by 0.05
    q_rest = 1 - 0.05
    expected = 0.9 * math.log(0.9 / 0.05) + 0.1 * math.log(0.1 / q_rest)
    assert coarse_kl(baseline, candidate) == pytest.approx(expected)


def test_vllm_extra_entries_are_not_part_of_the_top_k():
    # k = 2; each list carries vLLM's extra entry for the requested token "d".
    baseline = _log({"a": 0.6, "b": 0.3, "d": 0.05})  # partition {a, b} + rest (.1): "d" is in the rest
    candidate = _log({"c": 0.5, "b": 0.2, "d": 0.02})  # "a" unlisted: bounded by the 2nd entry, .2, not .02
    expected = 0.6 * math.log(0.6 / 0.2) + 0.3 * math.log(0.3 / 0.2) + 0.1 * math.log(0.1 / 0.6)
    assert coarse_kl(baseline, candidate, k=2) == pytest.approx(expected)


def _vllm_listing(distribution: np.ndarray, k: int, requested: int) -> dict[str, float]:
    """What vLLM returns: the k most likely tokens, plus the requested token when it is not among them."""
    listed = [int(t) for t in np.argsort(-distribution, kind="stable")[:k]]
    if requested not in listed:
        listed.append(requested)
    return {f"token_id:{t}": math.log(distribution[t]) for t in listed}


def _random_pair(rng: np.random.Generator, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """A baseline distribution and a candidate: independent, a log-space perturbation, or a mixture."""
    p = rng.dirichlet(np.full(vocab, rng.choice([0.05, 0.2, 1.0, 5.0])))
    kind = rng.integers(3)
    if kind == 0:
        q = rng.dirichlet(np.full(vocab, rng.choice([0.05, 0.2, 1.0, 5.0])))
    elif kind == 1:
        q = p * np.exp(rng.normal(0.0, rng.choice([0.05, 0.5, 2.0]), vocab))
    else:
        q = 0.5 * p + 0.5 * rng.dirichlet(np.ones(vocab))
    p, q = np.maximum(p, 1e-30), np.maximum(q, 1e-30)
    return p / p.sum(), q / q.sum()


@pytest.mark.slow
def test_coarse_kl_never_exceeds_the_full_kl_in_20000_random_cases():
    rng = np.random.default_rng(0)
    vocab, violations = 200, []
    for case in range(20_000):
        p, q = _random_pair(rng, vocab)
        k = int(rng.choice([1, 2, 5, TOP_K]))
        # The requested token: the baseline's greedy choice or any token (vLLM's k+1-th entry on either side).
        requested = int(np.argmax(p)) if rng.random() < 0.5 else int(rng.integers(vocab))
        coarse = coarse_kl(_vllm_listing(p, k, requested), _vllm_listing(q, k, requested), k=k)
        full = float(np.sum(p * np.log(p / q)))
        if coarse > full + 1e-9:
            violations.append((case, coarse, full))
    assert violations == []


def test_item_kl_averages_positions_and_an_empty_path_is_not_measured():
    p, q = _log({"a": 0.5, "b": 0.3}), _log({"a": 0.3, "b": 0.5})
    reference = Reference(doc_id=0, prompt_ids=[1], generated_ids=[2, 3], baseline_topk=[p, p])
    assert item_kl(reference, [p, q]) == pytest.approx(coarse_kl(p, q) / 2)
    empty = Reference(doc_id=1, prompt_ids=[1], generated_ids=[], baseline_topk=[])
    assert item_kl(empty, []) is None
    assert item_kl(reference, [{}, {}]) is None
    # A candidate listing NaN / -inf (a model with NaN logits): no measurement at that position, never a KL of 0.
    broken = {token: float("nan") for token in q}
    assert item_kl(reference, [broken, q]) == pytest.approx(coarse_kl(p, q))
    assert item_kl(reference, [broken, {"a": float("-inf"), "b": -0.1}]) is None


def _stand_in_server(tmp_path):
    from types import SimpleNamespace

    checked: list[str] = []
    return SimpleNamespace(base_url="http://127.0.0.1:9/v1", served_name="candidate", auth_headers={}, log_path=tmp_path / "server.log",
                           request_timeout_s=5.0, check_engine=lambda: checked.append("checked")), checked


def _post_through(handler, server):
    import asyncio

    import httpx

    from pipelines.evaluation.divergence import _post

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await _post(client, server, "/tokenize", {"prompt": "x"})

    return asyncio.run(run())


def test_a_connection_the_server_dropped_is_sent_again_and_a_server_that_keeps_dropping_is_a_serve_error(tmp_path):
    # Measured: httpx.ReadError on a pooled keep-alive connection ended a 20-minute scoring as an internal error
    import httpx

    from pipelines.errors import ServeError
    from pipelines.evaluation.divergence import TRANSPORT_ATTEMPTS

    server, checked = _stand_in_server(tmp_path)
    calls = []

    def flaky(request):
        calls.append(request.url.path)
        if len(calls) == 1:
            raise httpx.ReadError("connection reset", request=request)
        return httpx.Response(200, json={"tokens": [1, 2]})

    assert _post_through(flaky, server) == {"tokens": [1, 2]} and calls == ["/tokenize", "/tokenize"] and checked == []

    def dropping(request):
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)

    with pytest.raises(ServeError, match=f"/tokenize: the server dropped the connection {TRANSPORT_ATTEMPTS} times "
                                         r"\(RemoteProtocolError: Server disconnected"):
        _post_through(dropping, server)
    assert checked == ["checked"]

    def slow(request):
        raise httpx.ReadTimeout("timed out", request=request)

    with pytest.raises(ServeError, match=r"/tokenize did not answer within 5 s"):
        _post_through(slow, server)
