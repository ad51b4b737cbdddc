"""The runtime's own noise floor on this host: a model's 16-bit baseline scored twice through vLLM, per set.

    python -m pipelines.benchmarks.noise_floor --model models/demo-llama --eval-sets ticket_routing,payment_reference
    [--policy FILE] [--max-model-len N] [--out FILE]

The same path as a gate run with the policy's noise_floor on (pipelines.runs.runner.score_baseline: the first scoring
and the second, on a fresh server, both cached by content), every selected set scored twice whatever its metric kind;
then each set's A/A flips, their rate with its exact interval and the unstable items (pipelines.gate.floor). Wrap it in
`flock /tmp/quantgate-heavy.lock` on a shared machine: it starts vLLM servers.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pipelines.evaluation import baseline as baseline_cache
from pipelines.evaluation.evalsets import select_eval_sets
from pipelines.files.hashing import folder_hash
from pipelines.gate.floor import floor_from_scores
from pipelines.gate.policy import RuleOverrides, load_gate_policy
from pipelines.hardware.targets import host_record
from pipelines.runs.runner import GateSettings, score_baseline
from pipelines.serve.serving import ServeSettings


def measure(model_dir: Path, settings: GateSettings) -> list[dict]:
    """Score what is not cached (both passes), then one row per set."""
    started = time.monotonic()
    scored = score_baseline(model_dir, settings)
    model_hash = folder_hash(model_dir)
    rows = []
    for eval_set in settings.eval_sets:
        first = baseline_cache.load_cached(baseline_cache.cache_key(model_hash, eval_set, settings.serve), settings.cache_dir)
        assert first is not None, f"{eval_set.name}: the baseline was scored but is not in the cache"
        second = baseline_cache.load_cached(baseline_cache.repeat_key(first.key), settings.cache_dir, baseline_cache.RepeatEntry)
        assert second is not None, f"{eval_set.name}: the second scoring was not cached"
        floor = floor_from_scores(eval_set, first.score, second.score)
        rows.append({"eval_set": eval_set.name, "metric": eval_set.metric.name, "first_score": first.score.score,
                     "second_score": second.score.score, "first_wall_s": first.score.wall_s, "second_wall_s": second.score.wall_s,
                     **floor.model_dump(mode="json")})
    print(f"scored now: {', '.join(scored) or 'nothing (all cached)'}; {time.monotonic() - started:.1f} s")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--eval-sets", required=True)
    parser.add_argument("--policy", type=Path)
    parser.add_argument("--max-model-len", type=int, default=ServeSettings().max_model_len)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    policy, policy_path = load_gate_policy(args.policy)
    eval_sets = select_eval_sets([name.strip() for name in args.eval_sets.split(",") if name.strip()])
    every_set = {s.name: RuleOverrides(noise_floor=True) for s in eval_sets}
    policy = policy.model_copy(update={"eval_sets": {**policy.eval_sets, **every_set}})
    settings = GateSettings(eval_sets=eval_sets, policy=policy, policy_path=policy_path,
                            serve=ServeSettings(max_model_len=args.max_model_len), loadtest=False)
    rows = measure(args.model, settings)
    host = host_record()
    for row in rows:
        unstable = ", ".join(item.split(":")[0] for item in row["unstable_items"]) or "none"
        print(f"{row['eval_set']}: {row['flips']} / {row['n']} flipped ({row['right_to_wrong']} right->wrong, {row['wrong_to_right']} "
              f"wrong->right), rate {row['rate']:.2%} [{row['rate_low']:.2%}, {row['rate_high']:.2%}]; scores "
              f"{100 * row['first_score']:.1f} / {100 * row['second_score']:.1f}; unstable: {unstable}")
    if args.out is not None:
        args.out.write_text(json.dumps({"model": str(args.model), "host": host, "sets": rows}, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
