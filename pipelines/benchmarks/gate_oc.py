"""Operating characteristics of a gate policy: how often it promotes, by simulation through the real gate.

    python -m pipelines.benchmarks.gate_oc [--policy FILE] [--recipe NAME] [--reps 4000]   (make bench-gate)

A candidate is described by the true drop D (points of a pass/fail metric) and the discordance rate psi
(the fraction of items on which it disagrees with the baseline): right->wrong with probability
(psi + D)/2 and wrong->right with (psi - D)/2 per item. The baseline's own score is held at
`--baseline-score` (round(score x n) items right: the gate conditions on the baseline it has), so
losses are drawn among the baseline's right items and gains among its wrong ones. Each simulated set is judged by
`pipelines.gate.judge_set` with the policy's rules
for that set (memoised on the 2x2 table, which is all the binary rules read), so the figures are the
gate's own, not a model of it. KL is not simulated (its rule is checked as "not measured").

Printed: P(promote) against D for psi 0.01-0.10 at n = 20, 50, 100, 250, 1000 (the default rules); the
false-reject rate of an unchanged candidate over the policy's eval sets together (their real sizes); the
coverage of the interval; and whether the two targets of docs/gate-json.md hold.
"""

from __future__ import annotations

import argparse
import time
from functools import cache
from pathlib import Path

import numpy as np

from pipelines import stats
from pipelines.gate import PairedItem, SetComparison, judge_set
from pipelines.metrics import make_spec
from pipelines.paths import DEMO_EVAL_SETS
from pipelines.policy import DEFAULT_POLICY, Policy, SetPolicy, load_policy

SIZES = (20, 50, 100, 250, 1000)
DISCORDANCES = (0.01, 0.02, 0.04, 0.06, 0.08, 0.10)
DROPS_POINTS = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0)
TARGET_SIZE = 250
TARGET_MAX_DISCORDANCE = 0.04
TARGET_RATE = 0.05
_METRIC = make_spec("exact_match")


def cell_probabilities(drop: float, discordance: float, baseline_score: float) -> np.ndarray | None:
    """(both right, right->wrong, wrong->right, both wrong); None when the combination is impossible."""
    lose, gain = (discordance + drop) / 2.0, (discordance - drop) / 2.0
    both_right, both_wrong = baseline_score - lose, 1.0 - baseline_score - gain
    cells = np.array([both_right, lose, gain, both_wrong])
    return None if (cells < -1e-12).any() else cells.clip(0.0)


@cache
def _promotes(rules: SetPolicy, both_right: int, lose: int, gain: int, both_wrong: int) -> bool:
    pairs = [(1.0, 1.0)] * both_right + [(1.0, 0.0)] * lose + [(0.0, 1.0)] * gain + [(0.0, 0.0)] * both_wrong
    items = [PairedItem(item_id=str(i), baseline=b, candidate=c) for i, (b, c) in enumerate(pairs)]
    return judge_set(SetComparison(eval_set="simulated", metric=_METRIC, items=items), rules).passed


def simulate_tables(n: int, drop: float, discordance: float, *, baseline_score: float, reps: int, seed: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Unique 2x2 tables (both right, lost, gained, both wrong) of `reps` simulated sets, with their counts."""
    cells = cell_probabilities(drop, discordance, baseline_score)
    right = round(baseline_score * n)
    if cells is None or (cells[1] > 0 and right == 0) or (cells[2] > 0 and right == n):
        return None
    rng = np.random.default_rng(seed)
    lost = rng.binomial(right, cells[1] / baseline_score if baseline_score else 0.0, size=reps)
    gained = rng.binomial(n - right, cells[2] / (1 - baseline_score) if baseline_score < 1 else 0.0, size=reps)
    tables = np.stack([right - lost, lost, gained, n - right - gained], axis=1)
    unique, counts = np.unique(tables, axis=0, return_counts=True)
    return unique, counts


def promote_rate(rules: SetPolicy, n: int, drop: float, discordance: float, *, baseline_score: float, reps: int, seed: int = 0) -> float | None:
    """Fraction of `reps` simulated sets of n items that pass `rules`; None for an impossible candidate."""
    simulated = simulate_tables(n, drop, discordance, baseline_score=baseline_score, reps=reps, seed=seed)
    if simulated is None:
        return None
    tables, counts = simulated
    passed = sum(int(count) for table, count in zip(tables, counts, strict=True) if _promotes(rules, *map(int, table)))
    return passed / reps


def coverage(n: int, drop: float, discordance: float, *, reps: int, seed: int = 0) -> float:
    """How often the gate's pass/fail interval (Tango) contains the true delta (= -drop)."""
    cells = cell_probabilities(drop, discordance, 0.5)
    assert cells is not None
    tables, counts = np.unique(np.random.default_rng(seed).multinomial(n, cells, size=reps), axis=0, return_counts=True)
    hits = 0
    for (_, lose, gain, _), count in zip(tables, counts, strict=True):
        low, high = stats.tango_interval(int(lose), int(gain), n)
        hits += int(count) * (low - 1e-12 <= -drop <= high + 1e-12)
    return hits / reps


def _percent(value: float | None) -> str:
    return "   -" if value is None else f"{100 * value:4.0f}"


def print_promote_tables(rules: SetPolicy, *, baseline_score: float, reps: int) -> None:
    print(f"P(promote) in %, rows: discordance psi, columns: true drop in points (baseline score {baseline_score:.0%})")
    print(f"rules: {rules.model_dump()}")
    for n in SIZES:
        print(f"\nn = {n}\n  psi  " + " ".join(f"{d:4.0f}" for d in DROPS_POINTS))
        for psi in DISCORDANCES:
            rates = [promote_rate(rules, n, d / 100, psi, baseline_score=baseline_score, reps=reps) for d in DROPS_POINTS]
            print(f"  {psi:.2f} " + " ".join(_percent(rate) for rate in rates))


def set_rules(policy: Policy, recipe: str, names_and_sizes: list[tuple[str, int]]) -> list[tuple[str, int, SetPolicy]]:
    return [(name, n, policy.for_set(recipe, name)) for name, n in names_and_sizes]


def false_reject_over_sets(sets: list[tuple[str, int, SetPolicy]], discordance: float, *, baseline_score: float, reps: int) -> float:
    """P(at least one set rejects an unchanged candidate); sets are independent."""
    all_pass = 1.0
    for index, (_, n, rules) in enumerate(sets):
        rate = promote_rate(rules, n, 0.0, discordance, baseline_score=baseline_score, reps=reps, seed=index)
        all_pass *= rate if rate is not None else 1.0
    return 1.0 - all_pass


def worst_promote_at_twice_allowance(rules: SetPolicy, n: int, *, baseline_score: float, reps: int) -> tuple[float, float]:
    """(drop, max over psi of P(promote)) for a true drop of twice max_abs_drop (or ni_margin if off)."""
    allowance = rules.max_abs_drop if rules.max_abs_drop is not None else rules.ni_margin / 2
    drop = 2 * allowance / 100
    rates = [promote_rate(rules, n, drop, psi, baseline_score=baseline_score, reps=reps) for psi in (*DISCORDANCES, 0.15, 0.2)]
    return 2 * allowance, max(rate for rate in rates if rate is not None)


def _shipped_sets() -> list[tuple[str, int]]:
    """The demo model's three business sets, at their real sizes (the targets are stated for them)."""
    from pipelines.evalsets import discover_eval_sets

    return [(s.name, s.num_items) for s in discover_eval_sets() if s.name in DEMO_EVAL_SETS]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", type=Path, default=DEFAULT_POLICY)
    parser.add_argument("--recipe", default="w8a8", help="recipe whose overrides apply")
    parser.add_argument("--reps", type=int, default=4000, help="simulated sets per cell")
    parser.add_argument("--baseline-score", type=float, default=0.8, help="baseline accuracy of the simulated sets")
    args = parser.parse_args(argv)
    started = time.monotonic()
    policy = load_policy(args.policy)
    rules = policy.for_set(args.recipe, "(any other set)")
    print_promote_tables(rules, baseline_score=args.baseline_score, reps=args.reps)

    sets = set_rules(policy, args.recipe, _shipped_sets())
    print(f"\nUnchanged candidate (true drop 0) over {len(sets)} sets together: " + ", ".join(f"{name} (n={n})" for name, n, _ in sets))
    worst_false_reject = 0.0
    for psi in DISCORDANCES:
        rate = false_reject_over_sets(sets, psi, baseline_score=args.baseline_score, reps=args.reps)
        if psi <= TARGET_MAX_DISCORDANCE:
            worst_false_reject = max(worst_false_reject, rate)
        print(f"  psi {psi:.2f}: P(reject) {100 * rate:5.1f}%")

    print(f"\nTrue drop of twice the allowance, n = {TARGET_SIZE}, worst psi:")
    worst_twice = 0.0
    for name, _, set_rule in sets:
        drop, rate = worst_promote_at_twice_allowance(set_rule, TARGET_SIZE, baseline_score=args.baseline_score, reps=args.reps)
        worst_twice = max(worst_twice, rate)
        print(f"  {name}: drop {drop:.1f} points, P(promote) {100 * rate:5.1f}%")

    print("\nCoverage of the 95% pass/fail interval (Tango), true drop 0 / 2 / 5 points:")
    for n in (20, 50, 250):
        for psi in (0.01, 0.05, 0.10):
            values = [coverage(n, d / 100, psi, reps=args.reps) for d in (0.0, 2.0, 5.0) if psi >= d / 100]
            print(f"  n {n:4d}, psi {psi:.2f}: " + " / ".join(f"{100 * v:.1f}%" for v in values))

    met = worst_false_reject <= TARGET_RATE and worst_twice <= TARGET_RATE
    print(
        f"\nTargets (n = {TARGET_SIZE}): unchanged candidate with psi <= {TARGET_MAX_DISCORDANCE} rejected at most "
        f"{100 * worst_false_reject:.1f}% (target <= 5%); a drop of twice the allowance promoted at most "
        f"{100 * worst_twice:.1f}% (target <= 5%): {'MET' if met else 'NOT MET'}"
    )
    print(f"({args.reps} simulated sets per cell, {time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
