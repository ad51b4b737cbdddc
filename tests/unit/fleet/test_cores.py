"""Each route's vLLM worker on its own cores (pipelines/fleet/cores.py): the split, the sharing when cores are fewer
than routes, vLLM's list syntax, and the setting reaching the server's environment."""

from __future__ import annotations

import pytest

from pipelines.fleet.cores import allowed_cores, plan_cores
from pipelines.serve import serving


@pytest.mark.parametrize(("cores", "routes", "expected"), [
    ([0, 1], 2, ["0", "1"]),
    ([0, 1, 2, 3, 4, 5, 6, 7], 2, ["0-3", "4-7"]),
    ([0, 1, 2, 3, 4], 2, ["0-2", "3-4"]),  # the primary's share first and largest
    ([0, 1, 2, 3, 4, 5, 6], 3, ["0-2", "3-4", "5-6"]),
    ([2, 3, 8, 9], 2, ["2-3", "8-9"]),  # a cpuset's cores, not 0..n-1
    ([0, 2, 4, 6], 1, ["0,2,4,6"]),
    ([5], 1, ["5"]),
])
def test_cores_split_into_one_contiguous_share_per_route(cores, routes, expected) -> None:
    plan = plan_cores(cores, routes)
    assert plan.cores == expected and not plan.shared
    flattened = [core for share in plan.cores for part in share.split(",") for core in _expand(part)]
    assert sorted(flattened) == sorted(cores) and len(flattened) == len(set(flattened))  # every core once


def _expand(part: str) -> list[int]:
    low, _, high = part.partition("-")
    return list(range(int(low), int(high or low) + 1))


def test_fewer_cores_than_routes_share_round_robin_and_say_so() -> None:
    plan = plan_cores([0, 1], 3)
    assert plan.cores == ["0", "1", "0"] and plan.shared and "share" in plan.note


def test_no_route_or_no_core_is_a_programming_error() -> None:
    with pytest.raises(ValueError):
        plan_cores([0], 0)
    with pytest.raises(ValueError):
        plan_cores([], 1)


def test_this_process_may_run_on_its_allowed_cores() -> None:
    cores = allowed_cores()
    assert cores and cores == sorted(cores)


def test_the_binding_reaches_the_server_and_only_when_set(tmp_path) -> None:
    pinned = serving._environment(serving.ServeSettings(cpu_cores="0-1,3"), tmp_path, "key", non_finite_literals=True)
    assert pinned["VLLM_CPU_OMP_THREADS_BIND"] == "0-1,3"
    assert "cpu_cores" in serving.ServeSettings(cpu_cores="2").cache_fields()
    assert "cpu_cores" not in serving.ServeSettings().cache_fields()  # every cached baseline keeps its key


@pytest.mark.parametrize("bad", ["", "a", "0-", "-1", "0;rm -rf /", "0 1", "1,,2"])
def test_a_malformed_core_list_is_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        serving.ServeSettings(cpu_cores=bad)
