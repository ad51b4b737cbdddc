"""One repair, from a rejected run to a passing artifact (or the closest attempt): the evidence of every step.

The repair folder is artifacts/runs/<stamp>-repair-<recipe>-<pid>-<hex>/, beside the runs it starts from and
creates: repair.json (RepairResult, rewritten after every attempt, so that an interrupted repair keeps its
evidence), attempt-N.yaml (each proposal, a recipe), repaired.yaml (the passing one, `--recipe FILE`),
report.md and sensitivity.png. Each attempt is an ordinary run (quantize, vLLM, lm-eval, the same gate,
pipelines.runs.runner.quantize_and_gate) with its own run folder and registry version; every attempt's version gets
a `lineage` event naming the parent run and version and the overrides added.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pipelines.bounds import MiB
from pipelines.console.output import progress
from pipelines.console.progress import duration
from pipelines.errors import EXIT_ERROR, EXIT_OK, EXIT_REJECTED, QuantGateError
from pipelines.files.atomic import write_json_atomic, write_text_atomic
from pipelines.files.hashing import sha256_text
from pipelines.gate.schema import GateReport
from pipelines.hardware.targets import ServeTarget, installed_target
from pipelines.quantize.compiler import scheme_summary
from pipelines.quantize.layout import layout_from_model_dir
from pipelines.recipe import GroupScheme, RecipeIdentity, parse_recipe
from pipelines.registry.store import Registry, registry_exists
from pipelines.repair import frontier
from pipelines.repair.compare import ShippedRecipe, measured_bytes, registered_versions, shipped_comparison
from pipelines.repair.ladder import LoadedLadder, UnitLadder, calibration_available, kv_options, load_ladder, unit_ladder
from pipelines.repair.objective import Objective, choose, quality_bound, require_load_test
from pipelines.repair.page import REPORT_HTML, render_repair_page
from pipelines.repair.parent import ParentRun, load_parent
from pipelines.repair.pricing import Price, QuantizeCost, price, quantize_cost, recipe_bytes, shape_of, unit_bytes
from pipelines.repair.proposal import kv_proposal_text, overrides_for, proposal_text, write_proposal
from pipelines.repair.report import moved_by_rung, write_report
from pipelines.repair.result import REPAIR_JSON, Attempt, Found, OrderChoice, RepairResult, SetMove, Status
from pipelines.repair.search import (
    LEVEL_ORDER,
    PROBING_GATES,
    Budget,
    GateResult,
    Move,
    Search,
    SearchSettings,
    assignment_at,
    first_below,
    level_sequence,
    moved_units,
    promotion_sequence,
    same_storage,
)
from pipelines.repair.sensitivity import SensitivityModel, SensitivitySettings, sensitivity_dir
from pipelines.repair.units import Unit, quantized_units, recipe_units
from pipelines.runs.runfolder import run_folder
from pipelines.runs.runner import GateSettings, RunOutcome, quantize_and_gate

REPAIRED_RECIPE = "repaired.yaml"
RULES = ("max_abs_drop", "max_rel_drop", "rel_margin", "ni_margin", "max_flip_rate", "max_kl", "fit")
GateFn = Callable[..., RunOutcome]


class RepairOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    budget: Budget = Budget()
    search: SearchSettings = SearchSettings()
    sensitivity: SensitivitySettings = SensitivitySettings()
    ladder: Path | None = Field(default=None, description="ladder file; default: recipes/ladders/<target>.yaml")
    objective: Objective = Field(default="size", description="size: the passing attempt with the fewest bytes; speed: the one with "
                                                             "the best measured throughput (pipelines.repair.objective)")


class Repair:
    """The state of one repair while it runs; `run()` returns the final RepairResult."""

    def __init__(self, parent: ParentRun, options: RepairOptions | None = None, *, gate_fn: GateFn = quantize_and_gate,
                 target: ServeTarget | None = None, now: Callable[[], float] = time.monotonic):
        options = options or RepairOptions()
        self.parent, self.options, self.gate_fn, self.now = parent, options, gate_fn, now
        self.started = now()
        self.target = target or installed_target()
        self.calibrated = calibration_available(parent.recipe.recipe, parent.calibration)
        self.ladder: LoadedLadder = load_ladder(options.ladder, self.target, calibrated=self.calibrated)
        self._prices: dict[int, Price] = {}
        self.outcomes: dict[int, RunOutcome] = {}  # attempt number -> its run's outcome

    # ------------------------------------------------------------------------------------ phases

    def run(self) -> RepairResult:
        """The repair, in its own folder under runs/ (evidence written in place as it goes: pipelines.runs.runfolder)."""
        with run_folder(self.parent.settings.runs_dir, f"repair-{self.parent.recipe.name}", staged=False) as folder:
            self.folder = folder.path
            self.result = self._new_result()
            try:
                self._prepare()
                if not self._move_kv_cache() and self.units:
                    self._measure()
                    self._search()
            except BaseException as error:
                self.result.status, self.result.exit_code = "error", EXIT_ERROR
                self.result.error = error.one_line() if isinstance(error, QuantGateError) else f"{type(error).__name__}: {error}"
                self._save()
                raise
            self._finish()
        return self.result

    def _new_result(self) -> RepairResult:
        options, parent = self.options, self.parent
        return RepairResult(
            repair_id=self.folder.name, created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), status="running",
            repair_dir=str(self.folder), parent=_parent_record(parent), model=str(parent.model_dir), target=str(self.target),
            ladder={"path": str(self.ladder.path), "sha256": sha256_text(self.ladder.text)}, budget=options.budget, objective=options.objective,
            settings={"search": options.search.model_dump(), "sensitivity": options.sensitivity.model_dump()}, units=0,
        )

    def _prepare(self) -> None:
        parent = self.parent
        layout = layout_from_model_dir(parent.model_dir)
        self.units = quantized_units(recipe_units(parent.recipe.recipe, layout, parent.recipe.path, self.target))
        self.by_name: dict[str, Unit] = {unit.name: unit for unit in self.units}
        self.layout = layout
        self.ladders: dict[str, UnitLadder] = {u.name: unit_ladder(u, self.ladder.ladder, self.target, self.calibrated) for u in self.units}
        self.shape = shape_of(parent.model_dir)
        self.current = {unit.name: unit.scheme for unit in self.units if unit.scheme is not None}
        self.result.units = len(self.units)
        self.result.ladders_skipped = {name: ladder.skipped for name, ladder in self.ladders.items() if ladder.skipped}
        self.base = parent.recipe  # what the proposals add overrides to: the parent, or the parent with its KV cache moved
        self.kv_options, kv_skipped = kv_options(self.ladder.ladder, parent.recipe.recipe.kv_cache, self.target, layout.head_dim)
        if not parent.recipe.recipe.quantizes_weights:
            self.kv_options = [dtype for dtype in self.kv_options if dtype != "auto"]  # that would be the 16-bit baseline itself
        if kv_skipped:
            self.result.ladders_skipped["kv_cache"] = kv_skipped
        self.result.bytes = self._reference_bytes()
        self._save()

    def _move_kv_cache(self) -> bool:
        """A quantized KV cache moves one rung up its ladder first, in a proposal of its own: it costs no weight bytes (the
        repair's measure), so it is the cheapest move there is. Passed: that is the repair. Failed: the KV cache stays
        there in every later proposal, as a moved module does. Whether it passed."""
        if not self.kv_options:
            return False
        before, dtype = self.parent.recipe.recipe.kv_cache.dtype, self.kv_options[0]
        proposal = write_proposal(kv_proposal_text(self.parent.recipe, dtype, self.parent.settings.policy),
                                  self.folder / f"attempt-{len(self.result.attempts) + 1}.yaml")
        recipe = proposal.recipe
        attempt = Attempt(
            number=len(self.result.attempts) + 1, moves=0, why=f"the KV cache from {before} to {dtype}: no weight bytes added (not simulated)",
            recipe_name=proposal.name, recipe_file=str(proposal.path), modules_moved={"kv_cache": dtype}, overrides_added=[],
            predicted_kl=0.0, weight_bytes=recipe_bytes(self.shape, recipe),
            price=price(self.parent.model_dir, self.shape, recipe, self.parent.settings.policy.fit_for(recipe.identity)),
        )
        progress(f"repair: attempt {attempt.number}: the KV cache from {before} to {dtype} (weights unchanged); gating {proposal.name}")
        started = self.now()
        outcome = self.gate_fn(proposal, self.parent.model_dir, self.parent.settings, calibration=self.parent.calibration)
        self._record(attempt, outcome, round(self.now() - started, 2))
        self.base = proposal
        return outcome.verdict == "promoted"

    def _measure(self) -> None:
        parent = self.parent
        self.sensitivity_model = SensitivityModel(
            parent.model_dir, parent.recipe.recipe, parent.recipe.text, self.units, self.ladders, parent.settings.eval_sets,
            parent.settings.serve, sensitivity_dir(parent.settings.cache_dir), self.ladder.text, self.options.sensitivity, parent.calibration,
        )
        started = self.now()
        self.sensitivity = self.sensitivity_model.measure()
        self.result.sensitivity = self.sensitivity
        self.result.near_ties = self.sensitivity_model.near_ties
        self._solve_s = {e.unit: e.gptq_s / max(1, self._gptq_rungs(e.unit)) for e in self.sensitivity.units if e.gptq_s}
        self.result.wall_s["sensitivity"] = round(self.now() - started, 2)
        self.sequence = self._choose_order()
        self.result.sequence = [_move_record(move) for move in self.sequence]
        progress(f"repair: {len(self.sequence)} moves in the promotion sequence ({self.result.order}) over {len(self.units)} modules "
                 f"(sensitivity pass {self.result.wall_s['sensitivity']:.0f} s)")
        self._save()

    def _choose_order(self) -> list[Move]:
        """Level by level when the budget runs probes (three gates or more): its tier ends are whole formats a probe
        can test, where the order by KL per byte mixes formats and 16-bit modules from its first moves (on SmolLM2 gptq
        its first proposal at the target saved 1.1% of the bytes, 253.9 against 256.8 MB). Otherwise the order whose
        first proposal (the fewest moves simulated under the target) costs the fewest bytes (pipelines.repair.search
        explains both)."""
        def cost(unit: str, scheme: GroupScheme | None) -> int:
            return unit_bytes(self.by_name[unit], scheme)

        estimate, ladders = self.sensitivity.estimated_kl, self.ladders.items()
        orders = {
            "by KL per byte": promotion_sequence(self.current, {n: [o.scheme for o in x.options] for n, x in ladders}, cost, estimate),
            LEVEL_ORDER: level_sequence(self.current, {n: [(o.position, o.scheme) for o in x.options] for n, x in ladders},
                                             cost, estimate, [entry.unit for entry in self.sensitivity.units]),
        }
        target, choices = self._target_kl(), []
        for name, sequence in orders.items():
            self.sequence, self._prices = sequence, {}
            k = first_below(self._predict, 0, len(sequence), target) if sequence else 0
            choices.append(OrderChoice(order=name, moves=len(sequence), first_k=k, simulated_kl=self._predict(k),
                                       weight_bytes=self._price(k).weight_bytes, estimated_quantize_s=self._cost(k).seconds))
        best = min(choices, key=lambda c: (c.simulated_kl > target, c.weight_bytes, c.estimated_quantize_s))
        if self.options.budget.max_gates >= PROBING_GATES and orders[LEVEL_ORDER]:
            best = next(c for c in choices if c.order == LEVEL_ORDER)
        self.result.orders, self.result.order, self._prices = choices, best.order, {}
        return orders[best.order]

    def _search(self) -> None:
        search = Search(
            len(self.sequence), predict=self._predict, price=lambda k: self._price(k).weight_bytes, fits=lambda k: self._price(k).fits,
            gate=self._gate, budget=self.options.budget, settings=self.options.search, target_kl=self._target_kl(),
            expected_gate_s=self.parent.candidate_wall_s + self._load_test_allowance(), kl_limit=self._kl_limit(), started=self.started,
            clock=self.now, extra_s=self._extra_quantize_s, tier_ends=self._tier_ends(),
        )
        self.result.search = search.run()

    def _load_test_allowance(self) -> float:
        """speed: a passing attempt's gate also runs the load test, which the rejected run's times do not hold; until a
        pass is measured the search adds the comparison's budget (its servers' starts and the sweep come on top, and are
        in the measured gate time the search uses from the first pass on). size: nothing added, as before."""
        if self.options.objective != "speed":
            return 0.0
        return self.parent.settings.policy.performance_for(self.parent.recipe.recipe.identity).comparison.budget_s

    def _tier_ends(self) -> dict[int, str]:
        """The last proposal before any unit changes its storage (zero points, bits), and before any goes to 16-bit: on
        the level order, where each is a whole format (on the other, a few moves past the rejected recipe)."""
        ends: dict[int, str] = {}
        if self.result.order != LEVEL_ORDER:
            return ends
        for what, changes in (("another storage format", lambda move: not same_storage(move.scheme, self.current[move.unit])),
                              ("16-bit", lambda move: move.scheme is None)):  # 16-bit changes the storage too: its name wins
            ends[next((k for k, move in enumerate(self.sequence) if changes(move)), len(self.sequence))] = what
        return ends

    # ------------------------------------------------------------------------------- one proposal

    def _predict(self, k: int) -> float:
        return self.sensitivity_model.predict(assignment_at(self.current, self.sequence, k))

    def _moved(self, k: int) -> dict[str, Any]:
        return moved_units(self.current, self.sequence, k)

    def _text(self, k: int) -> str:
        return proposal_text(self.base, overrides_for(self._moved(k), self.by_name), self.parent.settings.policy)

    def _price(self, k: int) -> Price:
        if k not in self._prices:

            recipe = parse_recipe(self._text(k), "proposal")
            fit = self.parent.settings.policy.fit_for(recipe.identity)
            self._prices[k] = price(self.parent.model_dir, self.shape, recipe, fit)
        return self._prices[k]

    def _gptq_rungs(self, unit: str) -> int:
        return sum(_gptq(scheme) for scheme in (self.current[unit], *(o.scheme for o in self.ladders[unit].options)))

    def _cost(self, k: int) -> QuantizeCost:
        """The quantize wall time proposal k implies (pipelines.repair.pricing.quantize_cost), from measured parts."""
        moved, current = self._moved(k), self.current
        added = sum(self._solve_s.get(u, 0.0) for u, s in moved.items() if _gptq(s) and not _gptq(current[u]))
        removed = sum(self._solve_s.get(u, 0.0) for u, s in moved.items() if _gptq(current[u]) and not _gptq(s))
        calibrates = self.parent.recipe.recipe.needs_calibration or any(s is not None and s.needs_calibration for s in moved.values())
        assert self.sensitivity is not None
        return quantize_cost(self.parent.manifest.wall_time_s, self.parent.recipe.recipe.needs_calibration, calibrates,
                             self.sensitivity.wall_s.get("calibration", 0.0), added, removed)

    def _extra_quantize_s(self, k: int) -> float:
        """What proposal k's quantize should take beyond the slowest quantize measured so far (the parent's, or an
        attempt's): the search adds it to a gate's expected time before it starts one (--repair-time)."""
        measured = max([self.parent.manifest.wall_time_s, *(a.quantize_s or 0.0 for a in self.result.attempts)])
        return max(0.0, self._cost(k).seconds - measured)

    def _gate(self, k: int, why: str) -> GateResult:
        number = len(self.result.attempts) + 1
        moved = self._moved(k)
        overrides = overrides_for(moved, self.by_name)
        proposal = write_proposal(self._text(k), self.folder / f"attempt-{number}.yaml")
        attempt = Attempt(
            number=number, moves=k, why=why, recipe_name=proposal.name, recipe_file=str(proposal.path),
            modules_moved={unit: scheme_summary(scheme) for unit, scheme in moved.items()}, overrides_added=overrides,
            predicted_kl=self._predict(k), weight_bytes=self._price(k).weight_bytes, price=self._price(k),
            estimated_quantize_s=self._cost(k).seconds,
        )
        budget = self.options.budget.max_gates
        left = self.options.budget.max_wall_s - (self.now() - self.started)
        by_rung = moved_by_rung({unit: scheme_summary(scheme) for unit, scheme in moved.items()})
        progress(f"repair: attempt {number}/{budget}: {len(moved)} module(s) moved ({k} moves; {by_rung}), "
                 f"{attempt.weight_bytes / MiB:.2f} MiB predicted, simulated KL {attempt.predicted_kl:.3g}, "
                 f"quantize ~{duration(attempt.estimated_quantize_s or 0)}; "
                 f"gating {proposal.name} ({duration(left)} of the repair's time left)")
        started = self.now()
        try:
            outcome = self.gate_fn(proposal, self.parent.model_dir, self.parent.settings, calibration=self.parent.calibration)
        except QuantGateError as error:
            if not any(a.verdict == "promoted" for a in self.result.attempts):
                raise  # nothing found yet: the repair's own error (exit 2)
            return self._undecided(attempt, error, round(self.now() - started, 2))
        self._record(attempt, outcome, round(self.now() - started, 2))
        return GateResult(passed=outcome.verdict == "promoted", wall_s=attempt.wall_s)

    def _undecided(self, attempt: Attempt, error: QuantGateError, wall_s: float) -> GateResult:
        """A shrink attempt the gate could not decide: kept as evidence; the search stops with its pass in hand."""
        attempt.error, attempt.wall_s = error.one_line(), wall_s
        self.result.attempts.append(attempt)
        progress(f"repair: attempt {attempt.number} could not be gated ({attempt.error}); keeping the pass already found")
        self._save()
        return GateResult(passed=False, wall_s=wall_s, error=attempt.error)

    def _record(self, attempt: Attempt, outcome: RunOutcome, wall_s: float) -> None:
        report = outcome.gate_report()
        attempt.verdict, attempt.reasons, attempt.wall_s = outcome.verdict, outcome.reasons, wall_s
        attempt.failed_rules = failed_rules(report)
        attempt.kl_by_set = {s.eval_set: s.kl_mean for s in report.gate.sets}
        attempt.scores = {s.eval_set: SetMove(baseline=s.baseline_score, candidate=s.candidate_score, unit=s.unit,
                                              right_to_wrong=s.flips_right_to_wrong, wrong_to_right=s.flips_wrong_to_right)
                          for s in report.gate.sets}
        attempt.run_dir, attempt.artifact_dir = str(outcome.run_dir), str(outcome.artifact_dir)
        attempt.measured_weight_bytes = measured_bytes(outcome.artifact_dir)
        attempt.quantize_s = report.stages.get("quantize_s")
        attempt.registry_version = outcome.registry_version
        attempt.quality, attempt.performance = quality_bound(report), outcome.performance
        attempt.loadtest_s = _load_test_seconds(outcome.stages)
        self.result.attempts.append(attempt)
        self.outcomes[attempt.number] = outcome
        self._lineage(attempt)
        more = "..." if len(attempt.failed_rules) > 3 else ""
        verdict = "PASSED" if outcome.verdict == "promoted" else f"failed ({'; '.join(attempt.failed_rules[:3])}{more})"
        progress(f"repair: attempt {attempt.number} {verdict} in {wall_s:.0f} s; evidence in {outcome.run_dir}")
        self._save()

    def _lineage(self, attempt: Attempt) -> None:
        registry_path = self.parent.settings.registry_path
        if registry_path is None or attempt.registry_version is None:
            return

        evidence = {
            "repair": self.result.repair_id, "repair_json": str(self.folder / REPAIR_JSON), "attempt": attempt.number,
            "parent": {"run": self.parent.run_id, "version": self.parent.registry_version, "recipe": self.parent.recipe.name},
            "overrides_added": attempt.overrides_added, "modules_moved": attempt.modules_moved,
        }
        reason = f"repair attempt {attempt.number} of {self.parent.recipe.name} (run {self.parent.run_id})"
        Registry(registry_path).record_lineage(self.parent.model_dir.name, attempt.registry_version, reason, evidence)

    # ------------------------------------------------------------------------------------ the end

    def _finish(self) -> None:
        search, gated = self.result.search, self.result.gated()
        self.result.choice = choose([a.contender() for a in gated], self.options.objective)
        best = next((a for a in gated if a.contender().name == self.result.choice.winner), None)
        if best is not None:  # size: bytes first, then the quantize's wall time; speed: the best throughput measured
            self.result.found = self._found(best)
            self.result.status, self.result.exit_code = "repaired", EXIT_OK
        else:
            stops: dict[str, Status] = {"ladder exhausted": "ladder exhausted", "does not fit": "does not fit"}
            self.result.status = stops.get(search.stop, "budget exhausted") if search is not None else "ladder exhausted"
            self.result.exit_code = EXIT_REJECTED
            self.result.closest = closest(self.result.attempts)
        self.result.shipped = self._shipped()
        self.result.wall_s["gates"] = round(sum(a.wall_s for a in self.result.attempts), 2)
        self.result.wall_s["load tests (in the gates)"] = round(sum(a.loadtest_s or 0.0 for a in self.result.attempts), 2)
        self.result.wall_s["total"] = round(self.now() - self.started, 2)
        self.result.frontier_plots = frontier.write_plots([a.contender() for a in gated], self.result.choice, self.folder)
        self.result.report_md, self.result.plot = write_report(self.result, self.folder)
        write_text_atomic(self.folder / REPORT_HTML, render_repair_page(self.result))
        self._save()

    def _found(self, attempt: Attempt) -> Found:
        repaired = self.folder / REPAIRED_RECIPE
        write_text_atomic(repaired, Path(attempt.recipe_file).read_text())
        return Found(
            attempt=attempt.number, recipe_file=str(repaired), recipe_name=attempt.recipe_name, artifact_dir=attempt.artifact_dir,
            run_dir=attempt.run_dir, registry_version=attempt.registry_version,
            weight_bytes=attempt.measured_weight_bytes or attempt.weight_bytes, modules_moved=len(attempt.modules_moved),
        )

    def _kl_limit(self) -> float | None:
        """The smallest max_kl that rejects (max_kl_action: reject) over the parent's sets (None: no set's KL rule rejects;
        by default max_kl only warns, so a proposal simulated over it is still gated)."""
        sets = self.parent.report.gate.sets
        return min((s.rules.max_kl for s in sets if s.rules.max_kl is not None and s.rules.max_kl_action == "reject"), default=None)

    def _target_kl(self) -> float:
        """The simulated KL the first proposal aims under: a share of the smallest max_kl, warning or not."""
        limit = min((s.rules.max_kl for s in self.parent.report.gate.sets if s.rules.max_kl is not None), default=None)
        settings = self.options.search
        return settings.kl_safety * limit if limit is not None else settings.kl_target_without_rule

    def _reference_bytes(self) -> dict[str, int | None]:
        """The 16-bit model and the parent (every shipped recipe is in `shipped`, with its verdict here)."""
        return {"16-bit": recipe_bytes(self.shape, None), "parent (predicted)": recipe_bytes(self.shape, self.parent.recipe.recipe),
                "parent (measured)": self.parent.manifest.weight_bytes.after}

    def _shipped(self) -> list[ShippedRecipe]:
        parent = self.parent
        registered = registered_versions(parent.settings.registry_path, parent.model_dir.name)
        source = next((v.source_hash for v in registered if v.version == parent.registry_version), None)
        sets = [(s.name, s.sha256) for s in parent.settings.eval_sets]
        return shipped_comparison(self.shape, self.layout, self.target, registered, source, sets)

    def _save(self) -> None:
        write_json_atomic(self.folder / REPAIR_JSON, self.result.model_dump(mode="json"))


# ------------------------------------------------------------------------------------- helpers


def _parent_record(parent: ParentRun) -> dict[str, Any]:
    return {
        "run_id": parent.run_id, "run_dir": str(parent.run_dir), "gate_json": str(parent.gate_json), "recipe": parent.recipe.name,
        "recipe_sha256": parent.recipe.sha256, "artifact_dir": str(parent.artifact_dir), "registry_version": parent.registry_version,
        "calibration": parent.calibration, "quantize_s": parent.manifest.wall_time_s, "reasons": parent.report.gate.reasons,
    }


def _move_record(move: Move) -> dict[str, Any]:
    return {"unit": move.unit, "to": move.label, "delta_bytes": move.delta_bytes, "estimated_kl_removed": round(move.delta_kl, 8)}


def _load_test_seconds(stages: dict[str, float]) -> float | None:
    """The load test's stages of one gate run (its comparison and sweep, and the servers it started); None: it did not run."""
    spent = [seconds for stage, seconds in stages.items() if stage.startswith("loadtest")]
    return round(sum(spent), 2) if spent else None


def _gptq(scheme: GroupScheme | None) -> bool:
    return scheme is not None and scheme.algorithm == "gptq"


def failed_rules(report: GateReport) -> list[str]:
    """`set: rule` for every rule a set failed, and `fit` (read from the reasons the gate wrote)."""
    failed = []
    for verdict in report.gate.sets:
        for reason in verdict.reasons:
            rule = next((r for r in RULES if r in reason), "other")
            failed.append(f"{verdict.eval_set}: {rule}")
    if report.gate.fit is not None and not report.gate.fit.fits:
        failed.append("fit")
    return failed


def closest(attempts: list[Attempt]) -> dict[str, Any] | None:
    """The failed attempt that came closest: the fewest failed rules, then the lowest mean KL."""
    gated = [a for a in attempts if a.verdict == "rejected"]
    if not gated:
        return None

    def mean_kl(attempt: Attempt) -> float:
        values = [v for v in attempt.kl_by_set.values() if v is not None]
        return sum(values) / len(values) if values else float("inf")

    best = min(gated, key=lambda a: (len(a.failed_rules), mean_kl(a)))
    return {"attempt": best.number, "recipe_file": best.recipe_file, "run_dir": best.run_dir, "failed_rules": best.failed_rules,
            "reasons": best.reasons}


def parent_version(parent: ParentRun) -> int | None:
    """The registry version the rejected run registered (its gate.json is the version's evidence), if any."""
    if not registry_exists(parent.settings.registry_path):
        return None

    gate = parent.gate_json.resolve().as_posix()
    try:
        versions = Registry(parent.settings.registry_path).list(parent.model_dir.name)
    except QuantGateError:
        return None
    return next((v.version for v in versions if v.gate_path == gate), None)


def check_objective(objective: Objective, settings: GateSettings, identity: RecipeIdentity) -> None:
    """speed ranks the passing attempts by their load tests: refused before any work when none would run."""
    require_load_test(objective, loadtest=settings.loadtest, enabled=settings.policy.performance_for(identity).enabled,
                      policy_path=settings.policy_path)


def start(parent: ParentRun, options: RepairOptions | None = None, *, gate_fn: GateFn = quantize_and_gate,
          target: ServeTarget | None = None) -> Repair:
    options = options or RepairOptions()
    check_objective(options.objective, parent.settings, parent.recipe.recipe.identity)
    parent = parent.model_copy(update={"registry_version": parent_version(parent)})
    progress(f"repair: {parent.recipe.name} on {parent.model_dir.name}, rejected in run {parent.run_id}; "
             f"budget {options.budget.max_gates} gate(s), {options.budget.max_wall_s:.0f} s; objective {options.objective}")
    return Repair(parent, options, gate_fn=gate_fn, target=target)


def repair(parent: ParentRun, options: RepairOptions | None = None, *, gate_fn: GateFn = quantize_and_gate,
           target: ServeTarget | None = None) -> RepairResult:
    """Repair a rejected run (pipelines.repair.parent.load_parent): see the module docstring."""
    return start(parent, options, gate_fn=gate_fn, target=target).run()


def repair_outcome(outcome: RunOutcome, settings: GateSettings, calibration: str | None = None,
                   options: RepairOptions | None = None, *, gate_fn: GateFn = quantize_and_gate) -> tuple[RunOutcome, RepairResult]:
    """Repair the rejected run `outcome` under the settings that gated it (a job candidate with `repair: true`).
    Returns the found attempt's outcome (promoted), or `outcome` itself with the repair's verdict added to its reasons."""

    # The run this process has just made (a Ray worker's is not registered yet): nothing in it can have been edited since.
    parent = load_parent(outcome.run_dir.name, outcome.run_dir.parent, registry_path=settings.registry_path,
                         calibration=calibration, loadtest=settings.loadtest, allow_unverified=True)
    session = start(parent, options, gate_fn=gate_fn)
    result = session.run()
    if result.found is not None:
        return session.outcomes[result.found.attempt], result
    closest_note = f"; closest attempt {result.closest['attempt']} failed {', '.join(result.closest['failed_rules'])}" if result.closest else ""
    note = f"repair: {result.status} after {len(result.attempts)} gate(s){closest_note} ({result.repair_dir})"
    return outcome.model_copy(update={"reasons": [*outcome.reasons, note]}), result
