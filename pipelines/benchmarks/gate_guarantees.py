"""The gate's stated guarantees, checked: what docs/gate-json.md ("Known error rates") reports and how it was measured.

    python -m pipelines.benchmarks.gate_guarantees scan [--sizes 47:1000] [--out FILE]
    python -m pipelines.benchmarks.gate_guarantees large [--sizes 20001,...,2000000]
    python -m pipelines.benchmarks.gate_guarantees skewed [--reps 1000]
    python -m pipelines.benchmarks.gate_guarantees concentrated [--reps 1000] [--families perplexity,bleu,chrf,ter]
    make bench-guarantees   (all four at their defaults; an hour on a shared 2-core machine)

scan: for every n, the worst P(promote) of a pass/fail candidate whose true worsening is exactly the tolerance, through the
gate's own decision function (verdict.table_rejects, the shipped policy): under the multinomial model over every split of
the discordance (p_gain from 0, losses only, to (1 - T) / 2), and with the baseline's right/wrong held fixed (baselines
30% to 100%, and wrong on 1 to exact.FEW_WRONG items, the corner where that model's supremum sits; every split its
items allow). Exact sums, no simulation.

large: the same two models at sizes above 20,000 items, through Tango's test at the critical value alone (the other rules
of a pass/fail set only reject more; table_rejects one table at a time is too slow there), beside the old z(c).

skewed: averaged per-item metrics (token F1, ROUGE-like, in [0, 1]) when a few items break outright and many move
slightly: the one-sided miss P(bound < true worsening) of the bound the tolerance reads, at a true worsening of the
tolerance (= P(promote) there), simulated over seeded sets drawn from a population of 400,000 items.

concentrated: corpus metrics (word perplexity; BLEU, chrF, TER on real sacrebleu) whose true worsening is the tolerance and
whose concentration share is exactly damage_share, for each severity shape (pipelines.benchmarks.concentrated_damage):
P(pass) at the smallest size the rule admits, 250, 400 and 1,000 items, the worst per family, and the pass rate of an
unchanged candidate (noise only) at the same sizes: the price. `--judge set` runs judge_set itself (slow for BLEU).
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from pathlib import Path

import numpy as np

from pipelines.benchmarks import concentrated_damage
from pipelines.files.atomic import write_json_atomic
from pipelines.gate import concentrated, exact, stats
from pipelines.gate.policy import DEFAULT_POLICY, SetPolicy, load_policy
from pipelines.gate.verdict import table_rejects, tolerance

SCAN_BASELINES = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 1.0)
POOL = 400_000


# --- pass/fail: every n, both sampling models -----------------------------------------------------------------------

def fixed_baseline_worst(n: int, allowed: float, gains: np.ndarray) -> tuple[float, int, float]:
    """(worst P(promote), the baseline's right count, p_gain) with the baseline held fixed (exact.fixed_baseline_worst):
    SCAN_BASELINES and the baselines wrong on 1 to exact.FEW_WRONG items."""
    rights = {round(score * n) for score in SCAN_BASELINES} | {n - wrong for wrong in range(1, exact.FEW_WRONG + 1)}
    return exact.fixed_baseline_worst(n, allowed, gains, sorted(right for right in rights if allowed * n <= right <= n))


def _promotes(rules: SetPolicy, n: int, right: int, lost: int, gained: int) -> bool:
    return not table_rejects(rules, True, n, right, lost, gained)


def scan(rules: SetPolicy, sizes: list[int]) -> list[dict]:
    """Per n: the worst P(promote | true worsening = the tolerance) under both models, through table_rejects."""
    allowed = tolerance(True, rules, 80.0)
    assert allowed is not None, "the policy's pass/fail sets have no tolerance"
    fraction = allowed / 100
    rows = []
    for n in sizes:
        right = round(0.8 * n)  # the default rules do not read the baseline's score; max_rel_drop would
        gains = exact.passing_gains(partial(_promotes, rules, n, right), n)
        multinomial, split = exact.worst_split(partial(exact.region_probability, n, fraction, gains), fraction)
        fixed, right, fixed_split = fixed_baseline_worst(n, fraction, gains)
        rows.append({"n": n, "multinomial": multinomial, "multinomial_p_gain": split,
                     "fixed": fixed, "fixed_wrong": n - right, "fixed_p_gain": fixed_split})
        table_rejects.cache_clear()
    return rows


LARGE_SIZES = "20001,20187,25000,50000,100000,200000,200001,500000,1000000,2000000"


def large(rules: SetPolicy, sizes: list[int]) -> list[dict]:
    """Per n: the worst P(promote | true worsening = T) of Tango's test at the shipped critical value and at z(c), both
    models (the fixed one over exact.fixed_baseline_rights)."""
    fraction = (tolerance(True, rules, 80.0) or 0.0) / 100
    rows = []
    for n in sizes:
        row: dict = {"n": n}
        for name, z in (("shipped", exact.critical_value(n, fraction, rules.confidence)), ("z_c", stats.z_one_sided(rules.confidence))):
            gains = exact._smallest_passing_gains(n, fraction, z)
            multinomial, _ = exact.worst_split(partial(exact.region_probability, n, fraction, gains), fraction)
            fixed, right, _ = exact.fixed_baseline_worst(n, fraction, gains)
            row[name] = {"z": z, "multinomial": multinomial, "fixed": fixed, "fixed_wrong": n - right}
        rows.append(row)
        shipped, nominal = row["shipped"], row["z_c"]
        print(f"  n {n:9,d}: shipped z {shipped['z']:.5f}: {100 * shipped['multinomial']:.4f}% multinomial, {100 * shipped['fixed']:.4f}% fixed; "
              f"z(c): {100 * nominal['multinomial']:.4f}% / {100 * nominal['fixed']:.4f}%", flush=True)
    return rows


def print_scan(rows: list[dict], confidence: float) -> None:
    alpha = 1 - confidence
    for model in ("multinomial", "fixed"):
        worst = max(rows, key=lambda row: row[model])
        where = f"p_gain {worst['multinomial_p_gain']:.4f}" if model == "multinomial" else f"baseline wrong on {worst['fixed_wrong']}"
        over = [row["n"] for row in rows if row[model] > alpha + 1e-12]
        print(f"{model}: worst P(promote | worsening = T) {100 * worst[model]:.2f}% at n = {worst['n']} "
              f"({where}); "
              f"{len(over)} of {len(rows)} sizes above {100 * alpha:.0f}%" + (f": {over[:10]}{' ...' if len(over) > 10 else ''}" if over else ""))


# --- averaged metrics: a few items broken outright, many nudged ---------------------------------------------------

SKEWED_GRID = [  # (n, share broken outright, share nudged, nudge: "normal" N(mu, 0.03) or "t2" mu + 0.02 t(2))
    (100, 0.05, 0.3, "normal"), (100, 0.08, 0.9, "normal"), (100, 0.08, 0.6, "t2"),
    (250, 0.03, 0.3, "normal"), (250, 0.05, 0.9, "normal"), (250, 0.08, 0.9, "normal"), (250, 0.05, 0.6, "t2"),
    (500, 0.05, 0.6, "normal"),
]


def skewed_population(broken: float, nudged: float, nudge: str, target: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(baseline, candidate) values of POOL items whose mean worsening is exactly `target`: baseline Beta(4, 1.5); a share
    `broken` drops to 0, a share `nudged` moves by a nudge centred on mu (clipped to [0, 1]), mu found by bisection."""
    rng = np.random.default_rng(seed)
    base = rng.beta(4.0, 1.5, POOL)
    kind = rng.random(POOL)
    noise = rng.normal(0.0, 0.03, POOL) if nudge == "normal" else 0.02 * rng.standard_t(2, POOL)

    def candidate(mu: float) -> np.ndarray:
        moved = np.where(kind < nudged + broken, np.clip(base + mu + noise, 0.0, 1.0), base)
        return np.where(kind < broken, 0.0, moved)

    low, high = -0.5, 0.5
    for _ in range(60):
        middle = (low + high) / 2
        if float(np.mean(base - candidate(middle))) > target:
            low = middle
        else:
            high = middle
    return base, candidate((low + high) / 2)


def skewed_miss(n: int, broken: float, nudged: float, nudge: str, target: float, *, reps: int, confidence: float, seed: int = 0) -> float:
    """P(the one-sided bound of the worsening < the true worsening): the bound the tolerance reads (the low end of
    stats.mean_difference_interval at 2c - 1), sets of n drawn with replacement from the population."""
    base, cand = skewed_population(broken, nudged, nudge, target, seed)
    truth = float(np.mean(base - cand))
    rng = np.random.default_rng(seed + 1)
    missed = 0
    for _ in range(reps):
        picks = rng.integers(0, POOL, n)
        _, low, _ = stats.mean_difference_interval(base[picks], cand[picks], value_range=1.0, confidence=2 * confidence - 1)
        missed += -low < truth
    return missed / reps


# --- corpus: a worsening concentrated in damage_share of the items ------------------------------------------------

CONCENTRATED_SIZES = (250, 400, 1000)


def concentrated_table(rules: SetPolicy, families: list[str], *, reps: int, judge: str) -> list[dict]:
    """P(pass) per family x shape x size at a true worsening of the tolerance with concentration share damage_share, and
    an unchanged candidate's per family x size; printed as they come."""
    relative = rules.rel_margin or rules.max_rel_drop or 0.05
    sizes = (concentrated.items_needed(rules.damage_share, rules.confidence), *CONCENTRATED_SIZES)
    rows: list[dict] = []
    for family in families:
        cells: list[tuple[str, concentrated_damage.Population]] = [
            (shape, concentrated_damage.population(family, shape, rules.damage_share, relative, seed=1)) for shape in concentrated_damage.SHAPES]
        cells.append(("unchanged", concentrated_damage.unchanged_population(family, relative, seed=1)))
        for shape, found in cells:
            rates = [concentrated_damage.pass_rate(found, n, rules, reps=reps, seed=n, judge=judge) for n in sizes]  # type: ignore[arg-type]
            rows.append({"family": family, "shape": shape, "damaged": found.damaged, "share": found.share, "worsening": found.worsening,
                         "reps": reps, "pass": dict(zip(sizes, rates, strict=True))})
            print(f"  {family:10s} {shape:11s} damaged {100 * found.damaged:5.1f}%, concentration share {100 * found.share:4.2f}%, "
                  f"worsening {found.worsening:.4f} x T: " + ", ".join(f"n {n} {100 * rate:5.1f}%" for n, rate in zip(sizes, rates, strict=True)),
                  flush=True)
        damaged = [row for row in rows if row["family"] == family and row["shape"] != "unchanged"]
        worst = max((row["pass"][n], row["shape"], n) for row in damaged for n in sizes)
        print(f"  {family}: worst false-pass {100 * worst[0]:.1f}% ({worst[1]}, n {worst[2]}; {reps} sets per cell)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", choices=("scan", "large", "skewed", "concentrated"))
    parser.add_argument("--policy", type=Path, default=DEFAULT_POLICY)
    parser.add_argument("--recipe", default="w8a8")
    parser.add_argument("--sizes", help="scan: FIRST:LAST or a comma-separated list of n (default 47:1000); large: a list")
    parser.add_argument("--out", type=Path, help="scan, large: write every n's figures to this JSON file")
    parser.add_argument("--reps", type=int, default=1000, help="skewed, concentrated: simulated sets per cell")
    parser.add_argument("--families", default=",".join(concentrated_damage.FAMILIES), help="concentrated: metric families")
    parser.add_argument("--judge", choices=("rule", "set"), default="rule",
                        help="concentrated: the clipped rule alone (bounds judge_set's pass from above) or judge_set itself")
    args = parser.parse_args(argv)
    started = time.monotonic()
    policy = load_policy(args.policy)
    if args.check in ("scan", "large"):
        wanted = args.sizes or ("47:1000" if args.check == "scan" else LARGE_SIZES)
        first, _, last = wanted.partition(":")
        sizes = list(range(int(first), int(last) + 1)) if last else [int(part) for part in wanted.split(",")]
        rules = policy.for_set(args.recipe, "(a pass/fail set)")
        rows = scan(rules, sizes) if args.check == "scan" else large(rules, sizes)
        if args.out is not None:
            write_json_atomic(args.out, rows)
        if args.check == "scan":
            print_scan(rows, rules.confidence)
    elif args.check == "skewed":
        rules = policy.for_set(args.recipe, "(an averaged set)")
        target = rules.ni_margin / 100
        print(f"Averaged metric, true worsening {100 * target:g} points (the tolerance), P(bound < truth) = P(promote), {args.reps} sets per cell:")
        for n, broken, nudged, nudge in SKEWED_GRID:
            miss = skewed_miss(n, broken, nudged, nudge, target, reps=args.reps, confidence=rules.confidence, seed=n)
            print(f"  n {n:4d}, {100 * broken:.0f}% broken, {100 * nudged:.0f}% nudged ({nudge}): {100 * miss:5.1f}% "
                  f"(coverage {100 * (1 - miss):.1f}%)")
    else:
        rules = policy.for_set(args.recipe, "(a corpus set)")
        print(f"Corpus metrics, true worsening = the tolerance, concentration share = damage_share {rules.damage_share:g}, P(pass) "
              f"({args.judge}), {args.reps} sets per cell:")
        rows = concentrated_table(rules, args.families.split(","), reps=args.reps, judge=args.judge)
        if args.out is not None:
            write_json_atomic(args.out, rows)
    print(f"({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
