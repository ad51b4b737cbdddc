"""The repair search without servers: ladders against the kernel rules, pricing against the planner, the
search's budget with a fake gate, and a whole repair (real sensitivity pass on a tiny random Llama, fake gate,
real registry) whose lineage and evidence are complete."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from fakes import make_artifact, make_eval_set, promote

from pipelines.artifact import CalibrationRecord, Manifest, PeakMemory, WeightBytes
from pipelines.cli import main
from pipelines.errors import InputError, ServeError
from pipelines.evaluation.metrics import make_spec
from pipelines.files.hashing import sha256_file
from pipelines.gate.policy import load_policy
from pipelines.gate.schema import GateReport
from pipelines.gate.verdict import PairedItem, SetComparison, decide
from pipelines.hardware.targets import CPU, parse_target
from pipelines.planner import gpu_spec, model_shape, predict_weight_bytes
from pipelines.quantize.compiler import check_recipe, scheme_summary
from pipelines.quantize.layout import layout_from_config, layout_from_model_dir
from pipelines.recipe import LoadedRecipe, load_recipe, parse_recipe
from pipelines.registry.store import EvalSetRef, NewVersion, Registry
from pipelines.repair import sensitivity as sensitivity_module
from pipelines.repair.ladder import LADDERS_DIR, load_ladder, unit_ladder
from pipelines.repair.parent import ParentRun, load_parent
from pipelines.repair.pricing import recipe_bytes, shape_of, unit_bytes
from pipelines.repair.proposal import overrides_for, proposal_text
from pipelines.repair.result import Attempt, load_result
from pipelines.repair.search import (
    LEVEL_ORDER,
    Budget,
    GateResult,
    Search,
    SearchSettings,
    assignment_at,
    level_sequence,
    promotion_sequence,
)
from pipelines.repair.sensitivity import SensitivitySettings
from pipelines.repair.session import REPAIRED_RECIPE, RepairOptions, repair
from pipelines.repair.simulate import RefPath
from pipelines.repair.units import quantized_units, recipe_units
from pipelines.runs.runner import GateSettings, RunOutcome

SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 2, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192,
    "tie_word_embeddings": True, "dtype": "bfloat16",
}
W8A16 = "      - weights: {bits: 8, granularity: channel}\n"
FAST = SensitivitySettings(kl_top=6)  # KL for the proxy's top 6 of the tiny model's 16 units


def ladder_file(tmp_path: Path, rungs: str) -> Path:
    path = tmp_path / "ladder.yaml"
    path.write_text(f"schema_version: 1\nfamilies:\n  weight_only:\n    rungs:\n{rungs}")
    return path


def units_for(config: dict, recipe_name: str):
    loaded = load_recipe(recipe_name)
    return loaded, quantized_units(recipe_units(loaded.recipe, layout_from_config(config), loaded.path, CPU))


# ------------------------------------------------------------------------------------------- ladders


def test_the_shipped_ladders_load_on_their_targets():
    assert load_ladder(None, CPU).path == LADDERS_DIR / "cpu.yaml"
    assert load_ladder(None, parse_target("cuda:8.9")).path == LADDERS_DIR / "cuda.yaml"


def test_a_rung_no_kernel_serves_is_refused_at_validation_naming_the_rung(tmp_path):
    path = ladder_file(tmp_path, "      - weights: {bits: 4, granularity: channel}\n" + W8A16 + "      - 16-bit\n")
    with pytest.raises(InputError) as error:
        load_ladder(path, CPU)
    assert error.value.file == str(path) and error.value.field == "families.weight_only.rungs.1.weights.bits"
    assert "no vLLM kernel serves this rung on cpu" in error.value.message
    load_ladder(path, parse_target("cuda:8.9"))  # the CUDA build serves W8A16 (Marlin)


def test_a_rung_that_needs_calibration_is_refused_when_the_repair_has_none(tmp_path):
    """A given ladder is refused at load, naming the rung; the shipped ladder's such rungs are skipped per unit."""
    path = ladder_file(tmp_path, "      - weights: {bits: 4, granularity: channel}\n"
                                 "      - weights: {bits: 4, granularity: channel}\n        algorithm: gptq\n      - 16-bit\n")
    with pytest.raises(InputError) as error:
        load_ladder(path, CPU, calibrated=False)
    assert error.value.file == str(path) and error.value.field == "families.weight_only.rungs.1.algorithm"
    assert "w4 channel sym / a16, gptq needs calibration data" in error.value.message
    load_ladder(path, CPU)  # with calibration data it loads
    _, units = units_for(SMOLLM2, "w4a16")
    shipped = unit_ladder(units[0], load_ladder(None, CPU, calibrated=False).ladder, CPU, calibrated=False)
    assert shipped.options and not any(o.scheme is not None and o.scheme.algorithm == "gptq" for o in shipped.options)
    assert any(", gptq: needs calibration data" in reason for reason in shipped.skipped)


def test_a_gptq_rung_gives_a_recipe_that_calibrates_nothing_the_default_calibration():
    loaded, units = units_for(SMOLLM2, "w4a16")
    by_name = {unit.name: unit for unit in units}
    gptq = units[0].scheme.model_copy(update={"algorithm": "gptq"})
    text = proposal_text(loaded, overrides_for({units[0].name: gptq}, by_name), load_policy())
    proposal = parse_recipe(text, "proposal")
    assert proposal.calibration is not None and proposal.calibration.num_samples == 64 and proposal.algorithm.method == "rtn"
    assert list(yaml_keys(text)).index("calibration") < list(yaml_keys(text)).index("groups")
    assert proposal.overrides[-1].attention is not None and proposal.overrides[-1].attention.algorithm == "gptq"
    same_bytes = recipe_bytes(model_shape(SMOLLM2), proposal) == recipe_bytes(model_shape(SMOLLM2), loaded.recipe)
    assert same_bytes  # RTN -> GPTQ costs no bytes
    rtn_only = proposal_text(loaded, overrides_for({units[0].name: None}, by_name), load_policy())
    assert parse_recipe(rtn_only, "proposal").calibration is None  # 16-bit reads nothing


def yaml_keys(text: str) -> list[str]:
    import yaml

    return list(yaml.safe_load(text))


@pytest.mark.parametrize("rungs, message", [
    ("      - 16-bit\n      - weights: {bits: 4, granularity: channel}\n", "can only be the last rung"),
    ("      - weights: {bits: 4, granularity: channel}\n      - 8-bit\n", "is not a rung"),
    ("      - weights: {bits: 4, granularity: channel}\n      - weights: {bits: 4, granularity: channel}\n", "given twice"),
])
def test_a_malformed_ladder_is_one_line_naming_the_file(tmp_path, rungs, message):
    with pytest.raises(InputError) as error:
        load_ladder(ladder_file(tmp_path, rungs), CPU)
    assert message in error.value.message and error.value.file.endswith("ladder.yaml")


def test_every_option_of_every_unit_compiles_on_the_target():
    """The ladder respects the kernel rules: each rung a unit may move to gives a recipe the compiler accepts."""
    ladder = load_ladder(None, CPU).ladder
    for config, recipe_name in ((SMOLLM2, "w4a16"), (SMOLLM2, "w8a8"), ({**SMOLLM2, "hidden_size": 512, "num_attention_heads": 8,
                                                                         "num_key_value_heads": 2}, "aggressive")):
        loaded, units = units_for(config, recipe_name)
        layout = layout_from_config(config)
        by_name = {unit.name: unit for unit in units}
        for unit in units:
            for option in unit_ladder(unit, ladder, CPU).options:
                text = proposal_text(loaded, overrides_for({unit.name: option.scheme}, by_name), load_policy())
                check_recipe(parse_recipe(text, "proposal"), layout, "proposal", CPU)


def test_rungs_a_layer_cannot_take_are_skipped_with_the_compilers_reason():
    """576 inputs: group 128 does not divide them (w4a16 already gives those layers group 64, so only 32 is above);
    a layer whose sizes are not multiples of 32 cannot take any 4-bit rung on the CPU."""
    ladder = load_ladder(None, CPU).ladder
    _loaded, units = units_for(SMOLLM2, "w4a16")
    options = {u.name: [o.label for o in unit_ladder(u, ladder, CPU).options] for u in units}
    assert options["layers.0.self_attn.qkv"] == ["w4 group64 sym / a16, gptq", "w4 group64 asym / a16", "w4 group64 asym / a16, gptq",
                                                 "w4 group32 sym / a16", "w4 group32 sym / a16, gptq", "w4 group32 asym / a16",
                                                 "w4 group32 asym / a16, gptq", "16-bit"]
    assert options["layers.0.mlp.down"][:2] == ["w4 group128 sym / a16, gptq", "w4 group128 asym / a16"]  # 1536 inputs: group 128 under w4a16
    odd = {**SMOLLM2, "intermediate_size": 1544}  # 1544 = 8 x 193: gate/up outputs are not multiples of 32
    aggressive = load_recipe("aggressive").recipe
    gate_up = next(u for u in quantized_units(recipe_units(load_recipe("w8a8").recipe, layout_from_config(odd), "w8a8", CPU))
                   if u.name == "layers.0.mlp.gate_up").model_copy(update={"scheme": aggressive.groups.mlp})
    found = unit_ladder(gate_up, ladder, CPU)
    assert [reason.split(":")[0] for reason in found.skipped] == [f"w4 group{size} {sym} / a16{algorithm}" for size in (128, 64, 32)
                                                                  for sym in ("sym", "asym") for algorithm in ("", ", gptq")]
    assert "does not divide the input size 576" in found.skipped[0] and "multiples of 32" in found.skipped[4]
    assert [o.label for o in found.options] == ["16-bit"]  # the weight-only family keeps activations 16-bit on every rung


# ------------------------------------------------------------------------------------------- pricing


def test_pricing_is_the_planners_and_moves_add_up():
    loaded, units = units_for(SMOLLM2, "w4a16")
    shape = model_shape(SMOLLM2)
    by_name = {unit.name: unit for unit in units}
    ladder = load_ladder(None, CPU).ladder
    options = {u.name: [o.scheme for o in unit_ladder(u, ladder, CPU).options] for u in units}
    current = {u.name: u.scheme for u in units}
    def kl(unit, scheme):  # any KL that falls as bytes grow
        return 0.0 if scheme is None else 1.0 / (1 + unit_bytes(by_name[unit], scheme))

    sequence = promotion_sequence(current, options, lambda u, s: unit_bytes(by_name[u], s), kl)
    parent = recipe_bytes(shape, loaded.recipe)
    assert parent == predict_weight_bytes(shape, loaded.recipe).total_bytes
    for k in (1, 5, len(sequence)):
        moved = {u: s for u, s in assignment_at(current, sequence, k).items() if s != current[u]}
        proposal = parse_recipe(proposal_text(loaded, overrides_for(moved, by_name), load_policy()), "p")
        assert recipe_bytes(shape, proposal) == parent + sum(m.delta_bytes for m in sequence[:k])


def test_free_moves_come_first_the_most_useful_of_them_first():
    """Static -> dynamic activations saves 2 bytes: a free move; among free moves the larger KL gain goes first."""
    _loaded, units = units_for(SMOLLM2, "w8a8")
    by_name = {unit.name: unit for unit in units}
    ladder = load_ladder(None, CPU).ladder
    options = {u.name: [o.scheme for o in unit_ladder(u, ladder, CPU).options] for u in units}
    gain = {u.name: float(i + 1) for i, u in enumerate(units)}

    def kl(unit, scheme):
        return 0.0 if scheme is None or scheme.activations.dynamic else gain[unit]

    sequence = promotion_sequence({u.name: u.scheme for u in units}, options, lambda u, s: unit_bytes(by_name[u], s), kl)
    free = [m for m in sequence if m.delta_bytes <= 0]
    assert free == sequence[: len(free)] and [m.delta_kl for m in free] == sorted((m.delta_kl for m in free), reverse=True)
    assert {m.unit for m in free} == {u.name for u in units if u.kind == "mlp"}  # the MLP's static activations
    assert all(m.label == "16-bit" for m in sequence[len(free):])


def test_level_by_level_moves_every_unit_one_rung_before_any_goes_further():
    """Level by level over each unit's hull: a rung estimated worse than the one below it (group 32 round-to-nearest
    after group 64 GPTQ) is no level for that unit; the rungs keeping the parent's storage come first."""
    _loaded, units = units_for(SMOLLM2, "w4a16")
    by_name = {unit.name: unit for unit in units}
    ladder = load_ladder(None, CPU).ladder
    options = {u.name: [(o.position, o.scheme) for o in unit_ladder(u, ladder, CPU).options] for u in units}
    ranking = [u.name for u in reversed(units)]
    error = {"w4 group128 sym / a16": 1.0, "w4 group128 sym / a16, gptq": 0.5, "w4 group64 sym / a16": 0.8,
             "w4 group64 sym / a16, gptq": 0.4, "w4 group32 sym / a16": 0.6, "w4 group32 sym / a16, gptq": 0.3, "16-bit": 0.0,
             "w4 group128 asym / a16": 0.7, "w4 group128 asym / a16, gptq": 0.35, "w4 group64 asym / a16": 0.5,
             "w4 group64 asym / a16, gptq": 0.25, "w4 group32 asym / a16": 0.45, "w4 group32 asym / a16, gptq": 0.2}

    def kl(unit, scheme):
        return error[scheme_summary(scheme)]

    sequence = level_sequence({u.name: u.scheme for u in units}, options, lambda u, s: unit_bytes(by_name[u], s), kl, ranking)
    labels = [m.label for m in sequence]
    assert "w4 group32 sym / a16" not in labels and "w4 group64 sym / a16" not in labels  # never a step up
    assert all(m.delta_kl > 0 for m in sequence)
    twins = [m for m in sequence if m.delta_bytes == 0]
    assert {m.unit for m in twins} == set(by_name)  # every unit's GPTQ twin, before any unit goes to group 32
    assert max(map(sequence.index, twins)) < min(i for i, label in enumerate(labels) if label.startswith("w4 group32"))
    assert [m.unit for m in twins if m.unit.endswith("mlp.down")] == [n for n in ranking if n.endswith("mlp.down")]  # most sensitive first
    assert labels.index("16-bit") > max(i for i, label in enumerate(labels) if label.startswith("w4 group32"))  # group 32 everywhere first
    symmetric = [i for i, label in enumerate(labels) if " sym " in label]
    asymmetric = [i for i, label in enumerate(labels) if " asym " in label]
    assert asymmetric and min(asymmetric) > max(symmetric)  # the parent's own storage (symmetric int4) climbed first
    assert {m.unit for m in sequence[: max(symmetric) + 1] if m.label == "w4 group32 sym / a16, gptq"} == set(by_name)


def test_a_proposal_is_judged_by_the_parents_policy_rules():
    policy = load_policy()
    for name in ("w4a16", "aggressive", "w8a8"):
        loaded = load_recipe(name)
        _, units = units_for(SMOLLM2, name)
        proposal = parse_recipe(proposal_text(loaded, overrides_for({units[0].name: None}, {u.name: u for u in units}), policy), "p")
        assert proposal.name.startswith(f"{name}-repair-") and proposal.overrides[-1].keep
        assert policy.recipe_key(proposal.identity) == policy.recipe_key(loaded.recipe.identity)
        assert policy.for_set(proposal.identity, "x") == policy.for_set(loaded.recipe.identity, "x")


# ------------------------------------------------------------------------------------------- the search


def fake_search(threshold: int | None, *, moves: int = 40, budget: int = 4, wall_s: float = 1e6, gate_s: float = 10.0,
                predict: Callable[[int], float] = lambda k: 1.0 / (1 + k), target_kl: float = 0.1, kl_limit: float | None = None,
                tier_ends: dict[int, str] | None = None):
    """A search over `moves` moves whose gate passes from `threshold` moves on (None: never); a fake clock."""
    clock = {"now": 0.0}
    gated: list[int] = []

    def gate(k: int, why: str) -> GateResult:
        gated.append(k)
        clock["now"] += gate_s
        return GateResult(passed=threshold is not None and k >= threshold, wall_s=gate_s)

    search = Search(moves, predict=predict, price=lambda k: 1000 + 10 * k, fits=lambda k: True, gate=gate,
                    budget=Budget(max_gates=budget, max_wall_s=wall_s), settings=SearchSettings(min_saving=0.0), target_kl=target_kl,
                    expected_gate_s=gate_s, kl_limit=kl_limit, started=0.0, clock=lambda: clock["now"], tier_ends=tier_ends)
    return search.run(), gated


def test_the_search_stops_at_its_gate_budget():
    result, gated = fake_search(None, budget=3)
    assert len(gated) == 3 and result.stop == "gate budget" and result.best is None
    assert gated == sorted(gated) and gated[-1] <= 40  # each failure asks for more


def test_the_search_stops_before_a_gate_that_would_overrun_the_wall_time():
    result, gated = fake_search(None, budget=10, wall_s=25.0)
    assert len(gated) == 2 and result.stop == "time budget"  # 20 s used: a third 10 s gate would end at 30 > 25


def test_the_search_shrinks_to_the_fewest_moves_that_pass():
    result, gated = fake_search(13, budget=20)
    assert result.best == 13 and result.stop == "shrunk" and 12 in gated
    # the first gate, with gates to spare: the fewest moves under the geometric mean of the parent's KL (1) and the target (0.1)
    assert gated[0] == 3 and gated[1] == 9  # it failed: the target's proposal next (1 / (1 + k) <= 0.1)
    _, two_gates = fake_search(13, budget=2)
    assert two_gates[0] == 9  # with two gates the safe target comes first


def test_a_failed_cheap_proposal_is_followed_by_the_last_one_before_any_16_bit_module():
    # cheap k=3 (1 / (1 + k) under 0.316), the target's k=9; the moves before the first to 16-bit end at 6
    result, gated = fake_search(6, budget=4, tier_ends={6: "16-bit"})
    assert gated[:2] == [3, 6] and result.best is not None and result.best <= 6
    failed, gated_after = fake_search(8, budget=4, tier_ends={6: "16-bit"})
    assert gated_after == [3, 6, 9, 8] and failed.best == 8  # the tier's failure does not raise the bar: the target is next
    _, beyond = fake_search(8, budget=4, tier_ends={12: "16-bit"})
    assert beyond[:2] == [3, 9]  # the target's proposal is within the tier: nothing to gate before it
    _, two_gates = fake_search(None, budget=2, tier_ends={6: "16-bit"})
    assert two_gates == [9, 39]  # no cheap probes with two gates; the target's failure raises the bar to 0.1 / 4: k=39


def test_the_parents_own_format_at_its_finest_is_gated_before_another_format_and_before_16_bit():
    tiers = {5: "another storage format", 7: "16-bit"}
    result, gated = fake_search(5, budget=4, tier_ends=tiers)
    assert gated == [3, 5, 4] and result.best == 5  # the format's end passed: the shrink follows (4 fails)
    failed, both = fake_search(7, budget=4, tier_ends=tiers)
    assert both == [3, 5, 7, 6] and failed.best == 7  # the other format's end next, then the shrink
    _, none = fake_search(None, budget=4, tier_ends=tiers)
    assert none == [3, 5, 7, 9]  # neither tier passed: the last gate goes to the target's proposal
    _, three = fake_search(None, budget=3, tier_ends=tiers)
    assert three == [3, 5, 9]  # with one gate left after a tier, the target's proposal takes it
    _, before_cheap = fake_search(None, budget=4, tier_ends={2: "another storage format", 7: "16-bit"})
    assert before_cheap == [2, 3, 7, 9]  # a format's end below the cheap proposal is the cheaper probe: it goes first


def test_the_shrink_never_gates_a_proposal_simulated_over_max_kl():
    def predict(k: int) -> float:
        return 10.0 / (1 + k)  # within max_kl 1.0 from 9 moves on

    result, gated = fake_search(5, budget=20, predict=predict, target_kl=0.5, kl_limit=1.0)
    assert gated[0] == 9 and min(gated) == 9  # the gate would pass 5, but below 9 the KL rule would reject
    assert result.best == 9 and result.stop == "shrunk"
    unlimited, gated_without = fake_search(5, budget=20, predict=predict, target_kl=0.5)
    assert unlimited.best == 5 and min(gated_without) == 4


def test_the_search_reports_an_exhausted_ladder():
    result, gated = fake_search(None, moves=3, budget=10)
    assert gated[-1] == 3 and result.stop == "ladder exhausted"


def test_the_search_does_not_gate_a_proposal_that_cannot_fit():
    search = Search(10, predict=lambda k: 0.0, price=lambda k: k, fits=lambda k: False, gate=lambda k, w: pytest.fail("gated"),
                    budget=Budget(), settings=SearchSettings(), target_kl=0.1, expected_gate_s=1.0)
    result = search.run()
    assert result.stop == "does not fit" and not result.steps[0].gated


# ------------------------------------------------------------------------------------------- a whole repair


def passing_rule(threshold: int):
    """Fake verdict: promoted when the proposal moves at least `threshold` units (one layer of one override each)."""
    return lambda recipe: sum(len(o.layers or []) for o in recipe.overrides) >= threshold


class FakeGate:
    """quantize_and_gate stand-in: a real gate.json (decide on synthetic items), a real artifact folder and a
    real registry version per call; promoted by `rule`."""

    def __init__(self, tmp_path: Path, registry_path: Path, model_dir: Path, rule, *, server_fails_at: int | None = None):
        self.tmp_path, self.registry, self.model_dir, self.rule = tmp_path, Registry(registry_path), model_dir, rule
        self.calls: list[LoadedRecipe] = []
        self.server_fails_at = server_fails_at

    def __call__(self, loaded: LoadedRecipe, model_dir: Path, settings: GateSettings, **kwargs) -> RunOutcome:
        self.calls.append(loaded)
        if len(self.calls) == self.server_fails_at:
            raise ServeError("vLLM did not become healthy within 300 s", file="candidate-server.log")
        verdict = "promoted" if self.rule(loaded.recipe) else "rejected"
        run_dir = self.tmp_path / "runs" / f"attempt-{len(self.calls)}"
        run_dir.mkdir(parents=True)
        report = fake_report(verdict, loaded.name)
        (run_dir / "gate.json").write_text(report.model_dump_json())
        artifact = make_artifact(self.tmp_path / "candidates" / f"{loaded.name}-{len(self.calls)}", weights=loaded.text.encode())
        version = self.registry.register(NewVersion(
            source_model=model_dir.name, source_hash="s", artifact_path=artifact, recipe_name=loaded.name, recipe_hash=loaded.sha256,
            eval_sets=[EvalSetRef(name="tickets", hash="h")], gate_path=run_dir / "gate.json"))
        if verdict == "promoted":
            promote(self.registry, version, verdict)  # through the one door: signed
        else:
            self.registry.reject(version.id, verdict)
        return RunOutcome(verdict=verdict, exit_code=0 if verdict == "promoted" else 1, run_dir=run_dir, gate_json=run_dir / "gate.json",
                          report_md=run_dir / "report.md", artifact_dir=artifact, registry_version=version.version,
                          reasons=report.gate.reasons, stages={})


def fake_report(verdict: str, recipe: str) -> GateReport:
    lost = 0 if verdict == "promoted" else 40
    items = [PairedItem(item_id=f"t{i}", baseline=1.0, candidate=0.0 if i < lost else 1.0, kl=0.001 if lost == 0 else 0.3)
             for i in range(200)]
    comparison = SetComparison(eval_set="tickets", metric=make_spec("exact_match"), items=items, kl_method="top-20 logprobs")
    return GateReport(inputs={"recipe": recipe}, gate=decide([comparison], load_policy(), recipe))


@pytest.fixture(scope="session")
def shared_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The parents' cache folder, shared by the repairs of this file as one artifacts root shares it between runs: the
    sensitivity pass of the same model, recipe and paths (the same key) is measured once per worker, not once per test
    (it was most of each repair here; test_the_sensitivity_pass_is_cached starts from an empty cache of its own)."""
    return tmp_path_factory.mktemp("repair-cache") / "baseline"


@pytest.fixture
def parent(tmp_path: Path, tiny_llama_dir: Path, shared_cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> ParentRun:
    """The aggressive recipe rejected on the tiny random Llama (a fake run folder), its registry version, and
    reference paths made of random prompts (no baseline cache, no lm-eval)."""
    import random

    rng = random.Random(0)
    paths = [RefPath(eval_set="tickets", doc_id=i, prompt_ids=[rng.randrange(3, 500) for _ in range(12)],
                     generated_ids=[rng.randrange(3, 500) for _ in range(4)]) for i in range(8)]
    monkeypatch.setattr(sensitivity_module, "cached_baselines", lambda *a, **k: {})
    monkeypatch.setattr(sensitivity_module, "reference_paths", lambda *a, **k: (paths, "baseline cache"))
    eval_set = make_eval_set(tmp_path / "eval_sets", "tickets")
    loaded = load_recipe("aggressive")
    registry_path = tmp_path / "registry.db"
    run_dir = tmp_path / "runs" / "20261201T000000Z-aggressive-1-abcdef"
    run_dir.mkdir(parents=True)
    (run_dir / "gate.json").write_text(fake_report("rejected", "aggressive").model_dump_json())
    artifact = make_artifact(tmp_path / "candidates" / "aggressive", weights=b"parent")
    registry = Registry(registry_path)
    version = registry.register(NewVersion(source_model=tiny_llama_dir.name, source_hash="s", artifact_path=artifact, recipe_name="aggressive",
                                           recipe_hash=loaded.sha256, gate_path=run_dir / "gate.json"))
    registry.reject(version.id, "rejected")
    manifest = Manifest(
        recipe="aggressive", model_name=tiny_llama_dir.name, source_model=str(tiny_llama_dir), input_key="k", recipe_file=str(loaded.path),
        recipe_text=loaded.text, compiled_recipe="", calibration=None, versions={}, source_files={}, artifact_files={}, layers={},
        weight_bytes=WeightBytes(before=2, after=1, ratio=0.5), wall_time_s=3.0, peak_memory=PeakMemory(bytes=1), stages={},
    )
    settings = GateSettings(eval_sets=[eval_set], policy=load_policy(), policy_path=Path("policies/default.yaml"), registry_path=registry_path,
                            runs_dir=tmp_path / "runs", cache_dir=shared_cache_dir, loadtest=False)
    return ParentRun(run_id=run_dir.name, run_dir=run_dir, report=fake_report("rejected", "aggressive"), model_dir=tiny_llama_dir,
                     artifact_dir=artifact, manifest=manifest, recipe=loaded, calibration=None, settings=settings)


@pytest.mark.slow
def test_a_repair_finds_the_fewest_moves_and_records_complete_lineage(parent: ParentRun, tmp_path: Path):
    fake = FakeGate(tmp_path, parent.settings.registry_path, parent.model_dir, passing_rule(3))
    result = repair(parent, RepairOptions(budget=Budget(max_gates=12), sensitivity=FAST), gate_fn=fake, target=CPU)
    assert result.status == "repaired" and result.exit_code == 0 and result.search.stop == "shrunk"
    assert len(fake.calls) == len(result.attempts) <= 12
    assert result.order == LEVEL_ORDER and {c.order for c in result.orders} == {LEVEL_ORDER, "by KL per byte"}  # 12 gates: probes
    assert result.found is not None and result.found.modules_moved == 3  # bisected down to the fewest that pass
    repaired = load_recipe(result.found.recipe_file)  # reusable as --recipe FILE
    assert repaired.text == fake.calls[result.found.attempt - 1].text and Path(result.found.recipe_file).name == REPAIRED_RECIPE
    # every attempt: its proposal file, its run, its verdict and failed rules, and a lineage event in the registry
    registry = Registry(parent.settings.registry_path)
    lineage = [e for e in registry.history(parent.model_dir.name) if e.kind == "lineage"]
    assert len(lineage) == len(result.attempts)
    for attempt, event in zip(result.attempts, lineage, strict=True):
        assert Path(attempt.recipe_file).is_file() and attempt.run_dir and attempt.verdict in ("promoted", "rejected")
        assert event.version == attempt.registry_version
        assert event.evidence["parent"] == {"run": parent.run_id, "version": 1, "recipe": "aggressive"}
        assert event.evidence["overrides_added"] == attempt.overrides_added and event.evidence["attempt"] == attempt.number
        assert (attempt.verdict == "rejected") == bool(attempt.failed_rules)
    assert result.parent["registry_version"] == 1
    # the evidence on disk: repair.json (round-trips), report.md linking the plot, the plot itself
    folder = Path(result.repair_dir)
    assert load_result(folder) == result
    report = (folder / "report.md").read_text()
    assert "![sensitivity ranking](sensitivity.png)" in report and (folder / "sensitivity.png").stat().st_size > 1000
    assert "| # | proposal | moves | modules moved, by rung | weight bytes |" in report
    assert result.sensitivity.units[0].kl is not None and len(result.sensitivity.units) == 16
    # each set's score under each proposal, beside the baseline (a rejected fake loses 40 of 200 items)
    scores = [attempt.scores["tickets"] for attempt in result.attempts]
    assert all(s.baseline == 100.0 and s.unit == "points" for s in scores)
    assert {(s.candidate, s.right_to_wrong) for s in scores} == {(100.0, 0), (80.0, 40)}
    assert "## How each eval set moved" in report and "| tickets | 100.0 | - | " in report and "80.0 (40 / 0)" in report
    assert "tickets: scores spread over more than 10 points" in report


@pytest.mark.slow
def test_a_repair_by_speed_searches_as_by_size_then_picks_the_fastest_passing_attempt(parent: ParentRun, tmp_path: Path):
    """The search is the size search (the same proposals gated); among the passing attempts the best measured throughput wins
    (each proposal's ratio here is drawn from its recipe's hash, with a narrow interval); the load tests' cost is summed."""
    from pipelines.loadtest.results import PerformanceSummary

    def measured(fake: FakeGate):
        def gate(loaded: LoadedRecipe, model_dir: Path, settings: GateSettings, **kwargs) -> RunOutcome:
            outcome = fake(loaded, model_dir, settings, **kwargs)
            if outcome.verdict != "promoted":
                return outcome
            ratio = 0.5 + int(loaded.sha256[:6], 16) / 2**24
            return outcome.model_copy(update={"stages": {"loadtest_s": 40.0, "loadtest_baseline_serve_start_s": 20.0},
                                              "performance": PerformanceSummary(
                enforced=False, passed=True, target="cpu", deployment_concurrency=16, throughput_ratio=ratio,
                throughput_interval=[ratio - 1e-6, ratio + 1e-6], speed="slower", pairs=6, ttft_p95_ratio=1.0, measured_max_num_seqs=16)})
        return gate

    with_loadtest = parent.model_copy(update={"settings": parent.settings.model_copy(update={"loadtest": True})})
    by_size = repair(with_loadtest, RepairOptions(budget=Budget(max_gates=12), sensitivity=FAST),
                     gate_fn=measured(FakeGate(tmp_path / "size", parent.settings.registry_path, parent.model_dir, passing_rule(3))), target=CPU)
    by_speed = repair(with_loadtest, RepairOptions(budget=Budget(max_gates=12), sensitivity=FAST, objective="speed"),
                      gate_fn=measured(FakeGate(tmp_path / "speed", parent.settings.registry_path, parent.model_dir, passing_rule(3))), target=CPU)
    assert [a.moves for a in by_speed.attempts] == [a.moves for a in by_size.attempts]  # the same search
    passing = [a for a in by_speed.attempts if a.verdict == "promoted"]
    assert len(passing) >= 2 and by_size.found is not None and by_speed.found is not None
    fastest = max(passing, key=lambda a: a.performance.throughput_ratio)
    assert by_speed.found.attempt == fastest.number and by_size.found.attempt == min(passing, key=Attempt.size_order).number
    assert by_size.choice.decided_by == "size" and by_speed.choice.decided_by == "speed" and by_speed.choice.tied == []
    assert Path(by_speed.found.recipe_file).read_text() == Path(fastest.recipe_file).read_text()
    assert by_speed.wall_s["load tests (in the gates)"] == 60.0 * len(passing)
    report = Path(by_speed.report_md).read_text()
    assert "## Objective: speed; the frontiers" in report and f"By speed: attempt {fastest.number}" in report
    assert {Path(by_speed.repair_dir, name).is_file() for name in by_speed.frontier_plots.values()} == {True}
    assert len(by_speed.frontier_plots) == 2


@pytest.mark.slow
def test_a_repair_that_runs_out_of_gates_exits_1_with_the_closest_attempt(parent: ParentRun, tmp_path: Path):
    fake = FakeGate(tmp_path, parent.settings.registry_path, parent.model_dir, lambda recipe: False)
    result = repair(parent, RepairOptions(budget=Budget(max_gates=2), sensitivity=FAST), gate_fn=fake, target=CPU)
    assert result.status == "budget exhausted" and result.exit_code == 1 and len(fake.calls) == 2
    assert result.closest["attempt"] in (1, 2) and result.closest["failed_rules"]
    assert "## Closest attempt" in (Path(result.repair_dir) / "report.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("fails_at, status", [(1, None), (2, "repaired")])
def test_a_gate_that_cannot_decide_is_an_error_unless_a_pass_is_in_hand(parent: ParentRun, tmp_path: Path, fails_at, status):
    fake = FakeGate(tmp_path, parent.settings.registry_path, parent.model_dir, passing_rule(1), server_fails_at=fails_at)
    # a strict target: the first proposal moves many units and passes; the second (shrinking) cannot be decided
    options = RepairOptions(budget=Budget(max_gates=6), sensitivity=FAST, search=SearchSettings(kl_safety=0.001))
    if status is None:
        with pytest.raises(ServeError):
            repair(parent, options, gate_fn=fake, target=CPU)
        (folder,) = [p for p in (tmp_path / "runs").iterdir() if "-repair-" in p.name]
        assert load_result(folder).status == "error" and "healthy" in load_result(folder).error  # the evidence is kept
        return
    result = repair(parent, options, gate_fn=fake, target=CPU)
    assert result.status == status and result.exit_code == 0 and result.search.stop == "gate error"
    assert result.attempts[-1].error and result.attempts[-1].verdict is None and result.found is not None


@pytest.mark.slow
def test_the_sensitivity_pass_is_cached(parent: ParentRun, tmp_path: Path):
    parent = parent.model_copy(update={"settings": parent.settings.model_copy(update={"cache_dir": tmp_path / "cache" / "baseline"})})
    fake = FakeGate(tmp_path, parent.settings.registry_path, parent.model_dir, passing_rule(1))
    # round-to-nearest rungs only: nothing reads calibration data
    rtn = ladder_file(tmp_path, "      - weights: {bits: 4, granularity: group, group_size: 32}\n      - 16-bit\n")
    options = RepairOptions(budget=Budget(max_gates=1), sensitivity=FAST, ladder=rtn)
    first = repair(parent, options, gate_fn=fake, target=CPU)
    second = repair(parent, options, gate_fn=fake, target=CPU)
    assert not first.sensitivity.cached and second.sensitivity.cached
    assert second.sensitivity.units == first.sensitivity.units
    assert fake.calls[0].text == fake.calls[1].text  # the same moves: the same proposal, hence the same artifact
    # aggressive and these rungs calibrate nothing: naming --calibration (quantize --repair) or not (quantize repair RUN_ID) measures the same
    assert not parent.recipe.recipe.needs_calibration
    named = parent.model_copy(update={"calibration": "from-eval-sets" if parent.calibration is None else None})
    third = repair(named, options, gate_fn=fake, target=CPU)
    assert third.sensitivity.cached and third.sensitivity.key == first.sensitivity.key


@pytest.mark.slow
def test_w8a8_sensitivity_smooths_first_and_calibrates_static_scales(parent: ParentRun, tmp_path: Path):
    """SmoothQuant by llm-compressor's modifier, static input scales from the calibration texts, the dynamic rung priced."""
    from pipelines.repair.sensitivity import SensitivityModel

    shipped = load_recipe("w8a8")
    text = shipped.text.replace("num_samples: 64", "num_samples: 8").replace("max_seq_length: 256", "max_seq_length: 64")
    loaded = LoadedRecipe(recipe=parse_recipe(text, "w8a8"), path=shipped.path, text=text)
    units = quantized_units(recipe_units(loaded.recipe, layout_from_model_dir(parent.model_dir), loaded.path, CPU))
    ladder = load_ladder(None, CPU)
    ladders = {u.name: unit_ladder(u, ladder.ladder, CPU) for u in units}
    model = SensitivityModel(parent.model_dir, loaded.recipe, loaded.text, units, ladders, parent.settings.eval_sets, parent.settings.serve,
                             tmp_path / "sensitivity", ladder.text, FAST)
    result = model.measure()
    assert result.smoothquant and model.text_source == "calibration" and len(model.texts) == 8
    static = {name for (name, scheme) in model.simulator().static}
    assert static == {info.name for u in units if u.kind == "mlp" for info in u.modules}  # the MLP's static activations
    gate_up = result.by_unit()["layers.0.mlp.gate_up"]  # w8a8 is GPTQ'd: its current rung, then those above it
    assert set(gate_up.proxy) == {"w8 channel sym / a8 tensor static, gptq", "w8 channel sym / a8 token dynamic",
                                  "w8 channel sym / a8 token dynamic, gptq"}
    assert all(value >= 0 for value in gate_up.proxy.values()) and result.kl_parent > 0
    # GPTQ measured with GPTQ (each unit's input Hessian from the calibration texts), not as its RTN twin
    assert set(model.simulator().hessians) == {u.name for u in units} and gate_up.gptq_s is not None
    assert gate_up.proxy["w8 channel sym / a8 token dynamic, gptq"] != gate_up.proxy["w8 channel sym / a8 token dynamic"]


# ------------------------------------------------------------------------------------------- the command line


def test_repair_refuses_bad_input_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path))
    promoted = tmp_path / "runs" / "20261201T000000Z-w8a8-1-abcdef"
    promoted.mkdir(parents=True)
    (promoted / "gate.json").write_text(fake_report("promoted", "w8a8").model_dump_json())
    (tmp_path / "runs" / "failed-error").mkdir()
    cases = {
        ("repair", "nosuch"): "no run 'nosuch'",
        ("repair", promoted.name): "not a rejection: the gate promoted this run",
        ("repair", "failed-error"): "not a rejection: the run has no gate.json",
        ("repair", promoted.name, "--repair-budget", "0"): "must be an integer from 1 to 1000 (got 0)",
        ("repair", "../x"): "RUN_ID",
    }
    for argv, message in cases.items():
        assert main(list(argv)) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (argv, lines)


def test_a_ladder_no_kernel_serves_fails_the_command_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path))
    monkeypatch.setenv("QUANTGATE_SERVE_TARGET", "cpu")
    path = ladder_file(tmp_path, W8A16 + "      - 16-bit\n")
    assert main(["repair", "whatever", "--ladder", str(path), "--json"]) == 2
    document = json.loads(capsys.readouterr().out)
    assert document["field"] == "families.weight_only.rungs.0.weights.bits" and document["file"] == str(path)


def test_parent_runs_are_read_back_with_their_gate(tmp_path, monkeypatch, tiny_llama_dir):
    """A rejected run folder as the runner writes it: model, artifact (manifest with the recipe), sets, policy."""
    pytest.importorskip("safetensors")
    eval_set = make_eval_set(tmp_path / "eval_sets", "tickets")
    from pipelines.evaluation import evalsets

    monkeypatch.setattr(evalsets, "discover_eval_sets", lambda: [eval_set])
    loaded = load_recipe("aggressive")
    artifact = tmp_path / "artifact"
    artifact.mkdir()
    (artifact / "config.json").write_text("{}")
    manifest = Manifest(
        recipe="aggressive", model_name="m", source_model=str(tiny_llama_dir), input_key="k", recipe_file=str(loaded.path), recipe_text=loaded.text,
        compiled_recipe="", calibration=CalibrationRecord(dataset="from-eval-sets: tickets", sha256="x", num_samples=1, seed=0, max_seq_length=8),
        versions={}, source_files={}, artifact_files={"config.json": "0" * 64}, layers={}, weight_bytes=WeightBytes(before=2, after=1, ratio=0.5),
        wall_time_s=1.0, peak_memory=PeakMemory(bytes=1), stages={},
    )
    (artifact / "manifest.json").write_text(manifest.model_dump_json())
    report = fake_report("rejected", "aggressive").model_copy(update={"inputs": {
        "artifact": {"path": str(artifact)}, "baseline": {"path": str(tiny_llama_dir)}, "eval_sets": {"tickets": eval_set.sha256},
        "policy": {"path": "policies/default.yaml", "sha256": sha256_file(Path("policies/default.yaml"))}, "serve": {"max_model_len": 256}}})
    run_dir = tmp_path / "runs" / "run-1"
    run_dir.mkdir(parents=True)
    (run_dir / "gate.json").write_text(report.model_dump_json())
    parent = load_parent("run-1", tmp_path / "runs", registry_path=None, allow_unverified=True)  # no registry recorded this run
    assert parent.recipe.name == "aggressive" and parent.calibration == "from-eval-sets" and parent.settings.serve.max_model_len == 256
    changed = report.model_copy(update={"inputs": {**report.inputs, "eval_sets": {"tickets": "0" * 64}}})
    (run_dir / "gate.json").write_text(changed.model_dump_json())
    with pytest.raises(InputError, match="eval set tickets changed since this run"):
        load_parent("run-1", tmp_path / "runs", registry_path=None, allow_unverified=True)


# ------------------------------------------------------------------------------------------- jobs


def test_a_job_candidate_with_repair_true_is_repaired_when_rejected(tmp_path, monkeypatch):
    from fakes import FakeRunner, make_model

    from pipelines.evaluation import evalsets
    from pipelines.jobs import job as job_module

    sets = [make_eval_set(tmp_path / "eval_sets", "tickets")]
    monkeypatch.setattr(evalsets, "discover_eval_sets", lambda: sets)
    make_model(tmp_path / "models" / "demo-llama")
    fake = FakeRunner(tmp_path, {"aggressive-w4a8": "rejected"})
    monkeypatch.setattr(job_module, "quantize_and_gate", fake)
    repaired = []

    def fake_repair(outcome, settings, calibration=None, options=None):
        repaired.append(outcome.run_dir)
        found = fake(load_recipe("w4a16"), tmp_path / "models" / "demo-llama", settings)  # stands for the passing attempt
        return found, type("Result", (), {"repair_dir": str(tmp_path / "runs" / "repair-1")})()

    monkeypatch.setattr(job_module, "repair_outcome", fake_repair)
    job = tmp_path / "job.yaml"
    job.write_text("name: nightly\nregistry: registry.db\ncandidates:\n  - model: models/demo-llama\n    recipes: [aggressive-w4a8, w8a8]\n"
                   "    repair: true\n")
    summary = job_module.run_job(job, jobs_dir=tmp_path / "jobs")
    results = {r.recipe: r for r in summary.results}
    assert results["aggressive-w4a8"].status == "promoted", results["aggressive-w4a8"]
    assert results["aggressive-w4a8"].repair_dir.endswith("repair-1")
    assert results["w8a8"].status == "promoted" and results["w8a8"].repair_dir is None  # promoted at once: nothing to repair
    assert len(repaired) == 1
    plain = job_module.plan_candidates(job_module.load_job(job), job)[0].key
    job.write_text(job.read_text().replace("    repair: true\n", ""))
    assert job_module.plan_candidates(job_module.load_job(job), job)[0].key != plain  # a repaired verdict is not the plain one


def test_a_policy_edit_is_accepted_unless_it_changes_the_rules_that_judged_the_run(tmp_path):
    from pipelines.gate.policy import RecipeOverrides
    from pipelines.recipe import RecipeIdentity
    from pipelines.repair.parent import check_same_rules

    policy = load_policy()
    report = fake_report("rejected", "aggressive").model_copy(update={
        "inputs": {"policy": {"sha256": "0" * 64}},
        "plan": {"gpu": {"name": "L4-24GB", "memory_bytes": gpu_spec("L4").memory_bytes}, "max_model_len": 512, "concurrency": 16}})
    identity, path, gate = RecipeIdentity(name="aggressive"), Path("policies/default.yaml"), tmp_path / "gate.json"
    other = policy.model_copy(update={"recipes": {**policy.recipes, "gptq": RecipeOverrides(max_kl=0.3)}})
    check_same_rules(report, other, identity, path, gate)  # another recipe's rules changed: the same gate for this one
    stricter = policy.model_copy(update={"recipes": {**policy.recipes, "aggressive": RecipeOverrides(max_kl=0.05)}})
    with pytest.raises(InputError, match=r"max_kl for aggressive on tickets changed since this run \(0.1 -> 0.05\)"):
        check_same_rules(report, stricter, identity, path, gate)
    with pytest.raises(InputError, match="fit for aggressive changed"):
        check_same_rules(report, policy.model_copy(update={"fit": None}), identity, path, gate)


# ------------------------------------------------------------------------------------------- against the shipped recipes


def test_every_shipped_recipe_is_compared_by_bytes_and_by_its_verdict_on_the_same_model_and_sets():
    from pipelines.recipe import shipped_recipes
    from pipelines.repair.compare import Registered, shipped_comparison

    sets = [("retail_sentiment", "a"), ("retail_order_id", "b")]
    gptq = load_recipe("gptq")

    def version(recipe: str, number: int, verdict: str, **change) -> Registered:
        fields = {"recipe": recipe, "recipe_hash": load_recipe(recipe).sha256, "source_hash": "model", "eval_sets": sets,
                  "version": number, "verdict": verdict, "artifact_path": "/nonexistent", **change}
        return Registered(**fields)

    registered = [version("gptq", 1, "rejected"), version("gptq", 3, "promoted"),  # the latest run of gptq as shipped counts
                  version("w8a8", 2, "promoted", eval_sets=sets[:1]),  # other sets: not comparable
                  version("w4a16", 4, "promoted", recipe_hash="edited"),  # another recipe text under the same name
                  version("aggressive", 5, "promoted", source_hash="another model")]
    rows = {row.recipe: row for row in shipped_comparison(model_shape(SMOLLM2), layout_from_config(SMOLLM2), CPU, registered, "model", sets)}
    assert sorted(rows) == shipped_recipes()
    assert (rows["gptq"].verdict, rows["gptq"].registry_version) == ("promoted", 3)
    assert rows["gptq"].predicted_bytes == recipe_bytes(model_shape(SMOLLM2), gptq.recipe) and rows["gptq"].measured_bytes is None
    assert all(rows[name].verdict is None for name in ("w8a8", "w4a16", "aggressive"))


def test_the_quantize_cost_adds_the_calibration_pipeline_and_the_gptq_solves_a_proposal_brings():
    from pipelines.repair.pricing import quantize_cost

    same = quantize_cost(50.0, parent_calibrates=False, proposal_calibrates=False, calibration_pass_s=30.0, gptq_added_s=0, gptq_removed_s=0)
    assert same.seconds == 50.0
    gptq = quantize_cost(50.0, parent_calibrates=False, proposal_calibrates=True, calibration_pass_s=30.0, gptq_added_s=12.0, gptq_removed_s=0)
    assert gptq.seconds == 50.0 + 2 * 30.0 + 12.0 and gptq.parts["calibration pipeline"] == 60.0
    already = quantize_cost(500.0, parent_calibrates=True, proposal_calibrates=True, calibration_pass_s=30.0, gptq_added_s=0, gptq_removed_s=8.0)
    assert already.seconds == 492.0  # a GPTQ parent pays no new pipeline; moving units off GPTQ saves their solves


def test_near_ties_are_items_whose_baseline_answer_starts_on_two_close_tokens():
    from pipelines.evaluation.baseline import BaselineEntry
    from pipelines.evaluation.divergence import Reference

    def reference(first: dict[str, float]) -> Reference:
        return Reference(doc_id=0, prompt_ids=[1], generated_ids=[2], baseline_topk=[first])

    entry = BaselineEntry.model_construct(references=[
        reference({"token_id:2": -0.5, "token_id:3": -0.9}),  # margin 0.4: a near-tie
        reference({"token_id:2": -0.1, "token_id:3": -2.5}),  # margin 2.4
        reference({"token_id:2": -0.6, "token_id:3": -1.1}),  # margin 0.5: not under it
        reference({"token_id:2": 0.0}),  # one token known: no margin, not counted
    ])
    assert sensitivity_module.near_tie_shares({"orders": entry}) == {"orders": round(1 / 3, 4)}
    assert sensitivity_module.near_tie_shares({"empty": BaselineEntry.model_construct(references=[])}) == {}


# --- the KV cache's precision, moved like a unit --------------------------------------------------------------------


def _with_kv(parent: ParentRun, tmp_path: Path, kv: str) -> ParentRun:
    """The parent run with its recipe's KV cache quantized (`kv_cache: <kv>` added to aggressive)."""
    path = tmp_path / "aggressive-kv.yaml"
    path.write_text(parent.recipe.text.replace("name: aggressive", "name: aggressive-kv") + f"kv_cache: {kv}\n")
    return parent.model_copy(update={"recipe": load_recipe(str(path))})


def test_the_shipped_ladders_move_the_kv_cache_back_to_16_bit() -> None:
    from pipelines.recipe import KvCache

    cpu, cuda = load_ladder(None, CPU).ladder, load_ladder(None, parse_target("cuda:9.0")).ladder
    assert cpu.kv_rungs_above(KvCache(dtype="fp8")) == ["bfloat16", "auto"] and cuda.kv_rungs_above(KvCache(dtype="fp8_e5m2")) == ["auto"]
    assert cpu.kv_rungs_above(KvCache()) == []


def test_a_quantized_kv_cache_moves_up_first_and_alone_when_that_passes(parent: ParentRun, tmp_path: Path):
    kv_parent = _with_kv(parent, tmp_path, "fp8")
    fake = FakeGate(tmp_path, parent.settings.registry_path, parent.model_dir, lambda recipe: recipe.kv_cache.dtype != "fp8")
    result = repair(kv_parent, RepairOptions(budget=Budget(max_gates=4), sensitivity=FAST), gate_fn=fake, target=CPU)
    assert result.status == "repaired" and len(fake.calls) == 1 and result.sensitivity is None
    first = fake.calls[0].recipe
    assert first.kv_cache.dtype == "bfloat16" and first.overrides == [] and first.groups == kv_parent.recipe.recipe.groups
    assert result.attempts[0].modules_moved == {"kv_cache": "bfloat16"} and result.found is not None
    assert result.found.weight_bytes == recipe_bytes(shape_of(parent.model_dir), parent.recipe.recipe)


@pytest.mark.slow
def test_a_kv_move_that_fails_stays_in_every_later_proposal(parent: ParentRun, tmp_path: Path):
    kv_parent = _with_kv(parent, tmp_path, "fp8")
    fake = FakeGate(tmp_path, parent.settings.registry_path, parent.model_dir, passing_rule(3))
    result = repair(kv_parent, RepairOptions(budget=Budget(max_gates=6), sensitivity=FAST), gate_fn=fake, target=CPU)
    assert result.attempts[0].modules_moved == {"kv_cache": "bfloat16"} and result.attempts[0].verdict == "rejected"
    assert len(fake.calls) > 1 and all(call.recipe.kv_cache.dtype == "bfloat16" for call in fake.calls)
    assert result.status == "repaired" and result.found is not None and result.found.attempt > 1

