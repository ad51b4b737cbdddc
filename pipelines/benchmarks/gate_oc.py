"""Operating characteristics of a gate policy: how often it promotes, computed through the real gate's rules.

    python -m pipelines.benchmarks.gate_oc [--policy FILE] [--recipe NAME] [--eval-sets a,b | --report gate.json]
    make bench-gate [POLICY=FILE] [EVAL_SETS=a,b] [REPORT=artifacts/runs/ID/gate.json]

A candidate is described by the true drop D (points of a pass/fail metric) and the discordance rate psi
(the fraction of items on which it disagrees with the baseline): right->wrong with probability
(psi + D)/2 and wrong->right with (psi - D)/2 per item. The baseline's own score is held at its value
(round(score x n) items right: the gate conditions on the baseline it has), so losses are drawn among the
baseline's right items, Binomial(right, (psi + D) / 2 / score), and gains among its wrong ones,
Binomial(n - right, (psi - D) / 2 / (1 - score)). P(promote) is summed exactly over those two binomial
distributions (pipelines.gate.stats.table_probability), each 2x2 table judged by the gate's own rules
(pipelines.gate.verdict.table_rejects, the function judge_set's reasons come from), so the figures are the gate's,
not a model of it. KL is not counted (it has no error rate; by default it only warns).

Printed: P(promote) against D at n = 20, 50, 100, 250, 1000 (the default rules, baseline --baseline-score);
for the sets you gate (--eval-sets: their sizes, --baseline-score; --report: sizes and baselines of a run's
gate.json, and each set's observed discordance): the false-reject rate of an unchanged candidate over the sets
together, a true drop of each set's tolerance; the coverage of the pass/fail and per-item intervals; whether
the targets of docs/gate-json.md hold; with --corpus-sims, rel_margin on a simulated word-perplexity set.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from scipy.stats import binom

from pipelines.evaluation.evalsets import discover_eval_sets, select_eval_sets
from pipelines.evaluation.metrics import make_spec
from pipelines.gate import exact, identical, stats
from pipelines.gate.policy import DEFAULT_POLICY, Policy, SetPolicy, load_policy
from pipelines.gate.schema import load_report
from pipelines.gate.verdict import PairedItem, SetComparison, judge_set, table_rejects, tolerance
from pipelines.paths import DEMO_EVAL_SETS

SIZES = (20, 50, 100, 250, 1000)
DISCORDANCES = (0.01, 0.02, 0.04, 0.06, 0.08, 0.10)
DROPS_POINTS = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0)
WORST_CASE_DISCORDANCES = (*DISCORDANCES, 0.15, 0.2, 0.3)
TARGET_SIZE = 250
TARGET_MAX_DISCORDANCE = 0.04
TARGET_RATE = 0.05
DEFAULT_BASELINE = 0.8


def cell_probabilities(drop: float, discordance: float, baseline_score: float) -> np.ndarray | None:
    """(both right, right->wrong, wrong->right, both wrong); None when the combination is impossible."""
    lose, gain = (discordance + drop) / 2.0, (discordance - drop) / 2.0
    both_right, both_wrong = baseline_score - lose, 1.0 - baseline_score - gain
    cells = np.array([both_right, lose, gain, both_wrong])
    return None if (cells < -1e-12).any() else cells.clip(0.0)


def promote_rate(rules: SetPolicy, n: int, drop: float, discordance: float, *, baseline_score: float) -> float | None:
    """P(a set of n pass/fail items passes `rules`), exact over the binomial 2x2 tables; None for an impossible candidate."""
    cells = cell_probabilities(drop, discordance, baseline_score)
    right = round(baseline_score * n)
    if cells is None or (cells[1] > 0 and right == 0) or (cells[2] > 0 and right == n):
        return None
    p_lose = cells[1] / baseline_score if baseline_score > 0 else 0.0
    p_gain = cells[2] / (1 - baseline_score) if baseline_score < 1 else 0.0
    if p_lose > 1 or p_gain > 1:
        return None
    rejected = stats.table_probability(
        lambda lost, gained: table_rejects(rules, True, n, right, lost, gained), n, right, p_lose, p_gain,
    )
    return 1.0 - rejected


def coverage(n: int, drop: float, discordance: float, *, confidence: float = stats.CONFIDENCE, mass: float = 1e-10) -> float:
    """P(Tango's interval at `confidence` contains the true delta = -drop), exact over the multinomial table
    (losses ~ Binomial(n, p_lose), gains | losses ~ Binomial(n - losses, p_gain / (1 - p_lose)))."""
    cells = cell_probabilities(drop, discordance, 0.5)
    assert cells is not None
    p_lose, p_gain = cells[1], cells[2]
    covered = 0.0
    loss_pmf = binom.pmf(np.arange(n + 1), n, p_lose)
    for lost in np.flatnonzero(loss_pmf > mass):
        rest = n - int(lost)
        gain_pmf = binom.pmf(np.arange(rest + 1), rest, p_gain / (1 - p_lose) if p_lose < 1 else 0.0)
        for gained in np.flatnonzero(gain_pmf > mass):
            low, high = stats.tango_interval(int(lost), int(gained), n, confidence=confidence)
            if low - 1e-12 <= -drop <= high + 1e-12:
                covered += loss_pmf[lost] * gain_pmf[gained]
    return float(covered)


def per_item_coverage(n: int, changed: float, *, reps: int, seed: int = 0, confidence: float = stats.CONFIDENCE) -> float:
    """Simulated coverage of the averaged-metric interval (stats.mean_difference_interval, range 1): a share `changed`
    of items moves by a Uniform(0, 1) amount, down with probability 0.75 (true mean -changed / 4)."""
    rng = np.random.default_rng(seed)
    truth = -changed * 0.5 * 0.5
    hits = 0
    for _ in range(reps):
        moved = rng.random(n) < changed
        diffs = np.where(moved, np.where(rng.random(n) < 0.75, -1.0, 1.0) * rng.random(n), 0.0)
        _, low, high = stats.mean_difference_interval(np.zeros(n), diffs, value_range=1.0, confidence=confidence)
        hits += low <= truth <= high
    return hits / reps


def corpus_promote_rate(
    rules: SetPolicy, n: int, rise: float, *, sims: int, seed: int = 0, noise: float = 0.3, share: float = 1.0,
) -> float:
    """P(pass) of a word-perplexity set (lm-eval's weighted_perplexity) whose true relative rise is `rise`, simulated
    through judge_set: n items of 20-200 words, per-word loglikelihoods Gamma(4, 0.5) nats, the candidate's per-item
    mean nats/word shifted by ln(1 + rise) plus N(0, noise / sqrt(words / 20)). `share` < 1 concentrates the rise:
    each document is damaged with that probability and shifted by ln(1 + rise) / share, the others not at all (the
    same true rise, over the documents' words)."""

    spec = make_spec("word_perplexity", "weighted_perplexity", higher_is_better=False)
    rng = np.random.default_rng(seed)
    passed = 0
    for _ in range(sims):
        words = rng.integers(20, 200, n)
        base = -words * rng.gamma(4.0, 0.5, n)
        shift = np.log1p(rise) if share >= 1.0 else np.where(rng.random(n) < share, np.log1p(rise) / share, 0.0)
        cand = base - words * (shift + rng.normal(0.0, noise, n) / np.sqrt(words / 20))
        items = [PairedItem(item_id=str(i), baseline=[float(b), int(w)], candidate=[float(c), int(w)])
                 for i, (b, c, w) in enumerate(zip(base, cand, words, strict=True))]
        passed += judge_set(SetComparison(eval_set="simulated", metric=spec, items=items), rules).passed
    return passed / sims


def _percent(value: float | None) -> str:
    return "   -" if value is None else f"{100 * value:4.0f}"


def print_promote_tables(rules: SetPolicy, *, baseline_score: float) -> None:
    print(f"P(promote) in %, rows: discordance psi, columns: true drop in points (baseline score {baseline_score:.0%})")
    print(f"rules: {rules.model_dump()}")
    for n in SIZES:
        print(f"\nn = {n}\n  psi  " + " ".join(f"{d:4.0f}" for d in DROPS_POINTS))
        for psi in DISCORDANCES:
            rates = [promote_rate(rules, n, d / 100, psi, baseline_score=baseline_score) for d in DROPS_POINTS]
            print(f"  {psi:.2f} " + " ".join(_percent(rate) for rate in rates))


# (name, n, baseline score as a fraction, observed discordance or None, rules)
SetCase = tuple[str, int, float, float | None, SetPolicy]


def set_rules(policy: Policy, recipe: str, names_and_sizes: list[tuple[str, int]], baseline_score: float = DEFAULT_BASELINE) -> list[SetCase]:
    return [(name, n, baseline_score, None, policy.for_set(recipe, name)) for name, n in names_and_sizes]


def false_reject_over_sets(sets: list[SetCase], discordance: float | None, *, baseline_score: float | None = None) -> float:
    """P(at least one set rejects an unchanged candidate); sets independent. discordance None: each set's observed one.
    baseline_score None: each set's own."""
    rejected = []
    for _, n, score, observed, rules in sets:
        psi = observed if discordance is None else discordance
        right = round((score if baseline_score is None else baseline_score) * n)
        rejected.append(_unchanged_reject(rules, n, right, psi or 0.0))
    return stats.any_rejects(rejected)


def _unchanged_reject(rules: SetPolicy, n: int, right: int, discordance: float) -> float:
    p_lose, p_gain = stats.unchanged_flip_probabilities(discordance, right, n)
    return stats.table_probability(lambda lost, gained: table_rejects(rules, True, n, right, lost, gained), n, right, p_lose, p_gain)


def worst_promote_at_tolerance(rules: SetPolicy, n: int, *, baseline_score: float) -> tuple[float, float]:
    """(T in points, max over psi of P(promote)) for a true drop of the set's tolerance (ni_margin, or the relative one),
    the baseline's score held fixed."""
    allowed = tolerance(True, rules, 100 * baseline_score)
    drop = (allowed if allowed is not None else rules.max_abs_drop or 0.0) / 100
    rates = [promote_rate(rules, n, drop, psi, baseline_score=baseline_score) for psi in WORST_CASE_DISCORDANCES]
    return 100 * drop, max(rate for rate in rates if rate is not None)


def promote_at_tolerance(rules: SetPolicy, n: int, *, baseline_score: float) -> float | None:
    """P(promote) of a true drop of the set's tolerance, worst over every split of the discordance into losses and gains
    (losses only included), under the multinomial model: what `quantize eval-sets power` reports (exact.promote_at_tolerance
    through table_rejects). None when no tolerance applies."""
    right = round(baseline_score * n)
    allowed = tolerance(True, rules, 100 * baseline_score)
    if allowed is None or not 0 < allowed < 100:
        return None
    return exact.promote_at_tolerance(lambda lost, gained: not table_rejects(rules, True, n, right, lost, gained), n, allowed / 100)[0]


def _shipped_sets(names: list[str] | None = None) -> list[tuple[str, int]]:
    """The named eval sets (default: the demo's three business sets) at their real sizes, from QUANTGATE_EVAL_SETS."""

    if names is None:
        return [(s.name, s.num_items) for s in discover_eval_sets() if s.name in DEMO_EVAL_SETS]
    return [(s.name, s.num_items) for s in select_eval_sets(names)]


def _report_sets(path: Path, policy: Policy, recipe: str) -> list[SetCase]:
    """Pass/fail sets of a run's gate.json: their n, baseline and observed discordance, under `policy` for `recipe`."""
    report = load_report(path)
    return [
        (v.eval_set, v.n, v.baseline_score / 100, ((v.flips_right_to_wrong or 0) + (v.flips_wrong_to_right or 0)) / v.n,
         policy.for_set(recipe, v.eval_set))
        for v in report.gate.sets if v.binary
    ]


def print_sets(sets: list[SetCase], *, source: str) -> tuple[float, float]:
    """The sets' own figures; returns (worst false reject over the sets for psi <= 0.04, worst P(promote) at a drop of T, n = 250)."""
    print(f"\nYour sets ({source}):")
    for name, n, score, observed, rules in sets:
        seen = "" if observed is None else f", observed discordance {observed:.3f}"
        minimum = identical.identical_items_needed("binary", rules.ni_margin / 100, rules.confidence)
        print(f"  {name}: n = {n}, baseline {100 * score:.1f}{seen}, tolerance {tolerance(True, rules, 100 * score)} points "
              f"at {rules.confidence:.0%}, identical-model minimum {minimum} items")
    print(f"\nUnchanged candidate (true drop 0) over the {len(sets)} sets together, P(reject):")
    worst = 0.0
    for psi in DISCORDANCES:
        rate = false_reject_over_sets(sets, psi)
        if psi <= TARGET_MAX_DISCORDANCE:
            worst = max(worst, rate)
        print(f"  psi {psi:.2f}: {100 * rate:5.1f}%")
    if all(observed is not None for *_, observed, _ in sets):
        print(f"  at each set's observed discordance: {100 * false_reject_over_sets(sets, None):5.1f}%")
    print("\nA true drop of each set's tolerance, P(promote): baseline held fixed, worst psi, at its own n / at n = 250; "
          "multinomial, worst split (promote_at_tolerance), at its own n / at n = 250")
    worst_drop = 0.0
    for name, n, score, _, rules in sets:
        drop, own = worst_promote_at_tolerance(rules, n, baseline_score=score)
        _, at_target = worst_promote_at_tolerance(rules, TARGET_SIZE, baseline_score=score)
        multinomial = [promote_at_tolerance(rules, size, baseline_score=score) for size in (n, TARGET_SIZE)]
        worst_drop = max(worst_drop, at_target, *(rate for rate in multinomial if rate is not None))
        shown = " / ".join("   -" if rate is None else f"{100 * rate:5.1f}%" for rate in multinomial)
        print(f"  {name}: drop {drop:.2f} points: {100 * own:5.1f}% / {100 * at_target:5.1f}%; {shown}")
    return worst, worst_drop


def print_coverage(per_item_reps: int) -> None:
    print("\nCoverage of the 95% pass/fail interval (Tango), exact, true drop 0 / 2 / 5 points:")
    for n in (20, 50, 250):
        for psi in (0.01, 0.05, 0.10):
            values = [coverage(n, d / 100, psi) for d in (0.0, 2.0, 5.0) if psi >= d / 100]
            print(f"  n {n:4d}, psi {psi:.2f}: " + " / ".join(f"{100 * v:.1f}%" for v in values))
    print(f"\nCoverage of the 95% per-item (averaged metric) interval, {per_item_reps} simulated sets, share of items changed 5% / 10% / 30% / 100%:")
    for n in (50, 250):
        values = [per_item_coverage(n, changed, reps=per_item_reps, seed=n) for changed in (0.05, 0.1, 0.3, 1.0)]
        print(f"  n {n:4d}: " + " / ".join(f"{100 * v:.1f}%" for v in values))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", type=Path, default=DEFAULT_POLICY)
    parser.add_argument("--recipe", default="w8a8", help="recipe whose overrides apply")
    parser.add_argument("--eval-sets", help="comma-separated eval sets to size (default: the demo's three); their n from eval_sets/")
    parser.add_argument("--report", type=Path, help="a run's gate.json: its pass/fail sets' n, baselines and observed discordance")
    parser.add_argument("--baseline-score", type=float, default=DEFAULT_BASELINE, help="baseline accuracy of the simulated sets")
    parser.add_argument("--per-item-reps", type=int, default=1000, help="simulated sets per cell of the per-item coverage")
    parser.add_argument("--no-tables", action="store_true", help="skip the generic P(promote) tables")
    parser.add_argument("--corpus-sims", type=int, default=0,
                        help="also simulate rel_margin on word perplexity (n = 250), this many sets per true rise (minutes)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    policy = load_policy(args.policy)
    rules = policy.for_set(args.recipe, "(any other set)")
    if not args.no_tables:
        print_promote_tables(rules, baseline_score=args.baseline_score)

    names = [name.strip() for name in args.eval_sets.split(",") if name.strip()] if args.eval_sets else None
    targets = set_rules(policy, args.recipe, _shipped_sets(names), args.baseline_score)
    source = f"{'selected' if names else 'the shipped demo sets'}, baseline {args.baseline_score:.0%}"
    worst_false_reject, worst_drop = print_sets(targets, source=source)
    if args.report is not None:
        print_sets(_report_sets(args.report, policy, args.recipe), source=f"{args.report}: their own baselines")
    print_coverage(args.per_item_reps)
    if args.corpus_sims > 0:
        perplexity = policy.for_set(args.recipe, "(a perplexity set)")
        print(f"\nWord perplexity, n = 250, rel_margin {perplexity.rel_margin}, {args.corpus_sims} simulated sets per true rise, P(pass):")
        for rise in (0.0, 0.03, 0.05):
            print(f"  true rise {rise:.0%}: {100 * corpus_promote_rate(perplexity, 250, rise, sims=args.corpus_sims):5.1f}%")

    met = worst_false_reject <= TARGET_RATE and worst_drop <= TARGET_RATE
    print(
        f"\nTargets (n = {TARGET_SIZE}): unchanged candidate with psi <= {TARGET_MAX_DISCORDANCE} rejected at most "
        f"{100 * worst_false_reject:.1f}% over the sets together (target <= 5%); a true drop of the tolerance promoted at most "
        f"{100 * worst_drop:.1f}% (target <= 5%): {'MET' if met else 'NOT MET'}"
    )
    print(f"({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
