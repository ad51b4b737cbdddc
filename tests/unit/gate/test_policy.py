"""Policy files: validation, override precedence, the shipped default."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipelines.errors import InputError
from pipelines.gate.policy import DEFAULT_POLICY, RuleOverrides, SetPolicy, load_policy

DEFAULTS = {
    "max_abs_drop": 2.0,
    "max_rel_drop": 0.05,
    "non_inferiority": True,
    "ni_margin": 5.0,
    "max_flip_rate": 0.05,
    "max_kl": 0.1,
    "min_items": 100,
}


def write_policy(tmp_path: Path, **sections) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump({"schema_version": 1, "defaults": dict(DEFAULTS), **sections}))
    return path


def test_shipped_default_policy_loads_with_documented_values():
    policy = load_policy(DEFAULT_POLICY)
    rules = policy.for_set("any-recipe", "any-set")
    # The numbers docs/gate-json.md's operating-characteristics tables were computed for.
    assert rules.non_inferiority and rules.ni_margin == 5.5 and rules.confidence == 0.95
    assert rules.max_abs_drop == 5.5 and rules.max_rel_drop is None and rules.rel_margin == 0.05
    assert rules.max_flip_rate == 0.05
    assert rules.max_kl == 0.1 and rules.max_kl_action == "warn"
    assert policy.for_set("w8a8", "payment_reference").max_flip_rate == 0.03


def test_rules_left_out_of_an_older_policy_take_their_defaults(tmp_path):
    # A policy written before confidence, rel_margin and max_kl_action existed still loads.
    rules = load_policy(write_policy(tmp_path)).for_set("w8a8", "tickets")
    assert (rules.confidence, rules.rel_margin, rules.max_kl_action) == (0.95, None, "warn")


def test_policy_by_name_resolves_to_policies_folder():
    assert load_policy("default") == load_policy(DEFAULT_POLICY)


def test_precedence_eval_set_over_recipe_over_defaults(tmp_path):
    path = write_policy(
        tmp_path,
        recipes={"w4a16": {"max_abs_drop": 3.0, "max_kl": 0.2}},
        eval_sets={"orders": {"max_abs_drop": 1.0}},
    )
    policy = load_policy(path)
    assert policy.for_set("w8a8", "tickets").max_abs_drop == 2.0
    assert policy.for_set("w4a16", "tickets").max_abs_drop == 3.0
    assert policy.for_set("w8a8", "orders").max_abs_drop == 1.0
    both = policy.for_set("w4a16", "orders")
    assert both.max_abs_drop == 1.0  # eval set beats recipe
    assert both.max_kl == 0.2  # the recipe still applies where the eval set is silent
    assert both.max_flip_rate == 0.05  # and defaults where both are


def test_explicit_null_turns_a_rule_off_but_omission_inherits(tmp_path):
    path = write_policy(tmp_path, recipes={"gptq": {"max_kl": None}}, eval_sets={"free_text": {"max_flip_rate": None}})
    policy = load_policy(path)
    assert policy.for_set("gptq", "orders").max_kl is None
    assert policy.for_set("w8a8", "orders").max_kl == 0.1
    assert policy.for_set("gptq", "free_text").max_flip_rate is None


@pytest.mark.parametrize(
    ("sections", "field"),
    [
        ({"defaults": {**DEFAULTS, "max_abs_dorp": 1.0}}, "defaults.max_abs_dorp"),
        ({"eval_sets": {"orders": {"max_flip": 0.1}}}, "eval_sets.orders.max_flip"),
        ({"recipes": {"w8a8": {"fit": {"gpu": "L4-24GB", "max_model_len": 2048, "gpus": 2}}}}, "recipes.w8a8.fit.gpus"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_unknown_keys_are_refused_naming_file_and_field(tmp_path, sections, field):
    path = write_policy(tmp_path, **sections)
    with pytest.raises(InputError) as raised:
        load_policy(path)
    assert raised.value.field == field
    assert raised.value.file == str(path)
    assert "unknown key" in raised.value.message


@pytest.mark.parametrize(
    ("sections", "field"),
    [
        ({"defaults": {**DEFAULTS, "max_flip_rate": 1.5}}, "defaults.max_flip_rate"),
        ({"defaults": {**DEFAULTS, "ni_margin": 0}}, "defaults.ni_margin"),
        ({"defaults": {k: v for k, v in DEFAULTS.items() if k != "max_kl"}}, "defaults.max_kl"),
        ({"eval_sets": {"orders": {"ni_margin": None}}}, "eval_sets.orders.ni_margin"),
        ({"recipes": {"w8a8": {"min_items": None}}}, "recipes.w8a8.min_items"),
        ({"schema_version": 2}, "schema_version"),
        ({"defaults": {**DEFAULTS, "confidence": 0.3}}, "defaults.confidence"),
        ({"defaults": {**DEFAULTS, "confidence": 1.0}}, "defaults.confidence"),
        ({"defaults": {**DEFAULTS, "rel_margin": 0}}, "defaults.rel_margin"),
        ({"defaults": {**DEFAULTS, "max_kl_action": "fail"}}, "defaults.max_kl_action"),
        ({"eval_sets": {"orders": {"confidence": None}}}, "eval_sets.orders.confidence"),
        ({"eval_sets": {"orders": {"max_kl_action": None}}}, "eval_sets.orders.max_kl_action"),
    ],
)
def test_bad_values_are_refused_naming_the_field(tmp_path, sections, field):
    with pytest.raises(InputError) as raised:
        load_policy(write_policy(tmp_path, **sections))
    assert raised.value.field == field


def test_fit_requirement_needs_exactly_one_target(tmp_path):
    with pytest.raises(InputError, match="exactly one of `gpu` or `memory_gib`"):
        load_policy(write_policy(tmp_path, fit={"gpu": "L4-24GB", "memory_gib": 24, "max_model_len": 2048}))
    with pytest.raises(InputError, match="exactly one"):
        load_policy(write_policy(tmp_path, fit={"max_model_len": 2048}))


def test_fit_for_recipe_override_beats_top_level(tmp_path):
    path = write_policy(
        tmp_path,
        fit={"gpu": "A100-80GB", "max_model_len": 8192, "concurrency": 32},
        recipes={"w4a16": {"fit": {"memory_gib": 24, "max_model_len": 4096}}, "w8a8": {"max_kl": 0.05}},
    )
    policy = load_policy(path)
    assert policy.fit_for("w8a8").gpu == "A100-80GB"
    small = policy.fit_for("w4a16")
    assert (small.memory_gib, small.max_model_len, small.concurrency) == (24, 4096, 1)
    assert load_policy(write_policy(tmp_path, fit={"gpu": "L4", "max_model_len": 512}, recipes={"cpu": {"fit": None}})).fit_for("cpu") is None


def test_malformed_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("defaults: [unclosed\n")
    with pytest.raises(InputError) as raised:
        load_policy(bad)
    assert raised.value.field.startswith("line ")
    with pytest.raises(InputError, match="no such policy"):
        load_policy(tmp_path / "missing.yaml")
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n")
    with pytest.raises(InputError, match="mapping"):
        load_policy(listing)


def test_override_model_names_the_same_rules_as_set_policy():
    assert list(RuleOverrides.model_fields) == list(SetPolicy.model_fields)


# --- refused at load: before any quantizing or serving ---------------------------------------------------


@pytest.mark.parametrize("fit, field, words", [
    ({"gpu": "B9000", "max_model_len": 512}, "fit.gpu", "unknown GPU (known: T4, "),
    ({"gpu": "[/x]", "max_model_len": 512}, "fit.gpu", "unknown GPU"),
    ({"gpu": "L4", "max_model_len": 10**12}, "fit.max_model_len", "less than or equal to 16777216"),
    ({"gpu": "L4", "max_model_len": 512, "concurrency": 10**30}, "fit.concurrency", "less than or equal to"),
    ({"memory_gib": float("inf"), "max_model_len": 512}, "fit.memory_gib", "finite number"),
])
def test_an_unknown_gpu_or_an_absurd_size_is_refused_at_load(tmp_path, fit, field, words):
    with pytest.raises(InputError) as raised:
        load_policy(write_policy(tmp_path, fit=fit))
    assert raised.value.field == field and words in raised.value.message
    assert raised.value.file == str(tmp_path / "policy.yaml")


def test_a_recipe_override_naming_an_unknown_gpu_is_refused_at_load(tmp_path):
    with pytest.raises(InputError) as raised:
        load_policy(write_policy(tmp_path, recipes={"w8a8": {"fit": {"gpu": "B9000", "max_model_len": 512}}}))
    assert raised.value.field == "recipes.w8a8.fit.gpu"


def test_gpu_names_are_matched_like_the_planner_does(tmp_path):
    assert load_policy(write_policy(tmp_path, fit={"gpu": "h100 80gb", "max_model_len": 512})).fit.gpu == "h100 80gb"


@pytest.mark.parametrize("scalar, words", [(".nan", "finite number"), (".inf", "finite number"), ("1.0e+999", "finite number"),
                                           ("9" * 5000, "malformed YAML value")])
def test_non_finite_and_overflowing_numbers_are_refused(tmp_path, scalar, words):
    path = write_policy(tmp_path)
    path.write_text(path.read_text().replace("max_abs_drop: 2.0", f"max_abs_drop: {scalar}"))
    with pytest.raises(InputError, match=words):
        load_policy(path)


def test_a_byte_order_mark_is_accepted_and_other_encodings_are_named(tmp_path):
    path = write_policy(tmp_path)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert load_policy(path).defaults.max_abs_drop == 2.0
    path.write_bytes(("# caf\xe9\n" + path.read_text(encoding="utf-8-sig")).encode("latin-1"))
    with pytest.raises(InputError) as raised:
        load_policy(path)
    assert raised.value.file == str(path) and raised.value.field == "line 1" and "not UTF-8" in raised.value.message


def test_aliases_are_read_and_an_alias_bomb_is_refused(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump({"defaults": DEFAULTS}) + "recipes:\n  a: &rules {max_kl: 0.2}\n  b: *rules\n")
    assert load_policy(path).for_set("b", "tickets").max_kl == 0.2
    bomb = "".join(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}" if i else "1"] * 9) + "]\n" for i in range(9))
    path.write_text(yaml.safe_dump({"defaults": DEFAULTS}) + bomb)
    with pytest.raises(InputError, match="more than 10000 values"):
        load_policy(path)


# --- matching a recipe by name, base or tag ---------------------------------------------------------------


def test_recipe_overrides_match_name_then_base_then_tags(tmp_path):
    from pipelines.recipe import RecipeIdentity

    policy = load_policy(write_policy(tmp_path, recipes={
        "w4a16": {"max_kl": 0.2},
        "int4": {"max_kl": 0.3, "max_abs_drop": 4.0},
        "weight-only": {"max_kl": 0.4},
        "my-w4": {"max_kl": 0.25},
    }))
    variant = RecipeIdentity(name="w4-wide", base="w4a16", tags=("int4",))
    assert policy.recipe_key(variant) == "w4a16"
    assert policy.for_set(variant, "tickets").max_kl == 0.2  # the family's rule...
    assert policy.for_set(variant, "tickets").max_abs_drop == 2.0  # ...alone: overrides are not merged
    assert policy.recipe_key(RecipeIdentity(name="my-w4", base="w4a16", tags=("int4",))) == "my-w4"  # its own name wins
    assert policy.for_set(RecipeIdentity(name="other", tags=("weight-only", "int4")), "t").max_kl == 0.4  # tags in the recipe's order
    assert policy.for_set(RecipeIdentity(name="other", base="unknown", tags=("int4",)), "t").max_kl == 0.3
    assert policy.recipe_key(RecipeIdentity(name="w8a8", tags=("int8",))) is None
    assert policy.for_set(RecipeIdentity(name="w8a8"), "t") == policy.for_set("w8a8", "t")  # a name still works


def test_the_eval_set_override_still_beats_a_base_match(tmp_path):
    from pipelines.recipe import RecipeIdentity

    policy = load_policy(write_policy(tmp_path, recipes={"w4a16": {"max_kl": 0.2}}, eval_sets={"orders": {"max_kl": 0.01}}))
    assert policy.for_set(RecipeIdentity(name="v", base="w4a16"), "orders").max_kl == 0.01


def test_fit_for_follows_the_same_match(tmp_path):
    from pipelines.recipe import RecipeIdentity

    policy = load_policy(write_policy(
        tmp_path, fit={"gpu": "A100-80GB", "max_model_len": 8192},
        recipes={"int4": {"fit": {"memory_gib": 24, "max_model_len": 4096}}, "w4a16": {"max_kl": 0.2}},
    ))
    assert policy.fit_for(RecipeIdentity(name="v", tags=("int4",))).memory_gib == 24
    # w4a16 matches first (by base) and names no fit: the top-level one, not the tag's
    assert policy.fit_for(RecipeIdentity(name="v", base="w4a16", tags=("int4",))).gpu == "A100-80GB"
    assert policy.fit_for("w8a8").gpu == "A100-80GB"


def test_identity_keys_are_ordered_and_unique():
    from pipelines.recipe import RecipeIdentity

    assert RecipeIdentity(name="a", base="a", tags=("b", "a", "c")).keys() == ["a", "b", "c"]
    assert RecipeIdentity.of("w8a8") == RecipeIdentity(name="w8a8")


def test_shipped_recipes_identities_match_the_default_policy():
    from pipelines.recipe import load_recipe

    policy = load_policy(DEFAULT_POLICY)
    assert policy.recipe_key(load_recipe("w4a16").recipe.identity) == "w4a16"
    assert policy.recipe_key(load_recipe("gptq").recipe.identity) is None  # tags int4/weight-only name no override there


# --- a policy the selected sets cannot meet: refused at load ------------------------------------------------


def sized(name: str, n: int, metric: str = "exact_match", aggregation: str = "mean", higher_is_better: bool = True):
    from types import SimpleNamespace

    from pipelines.evaluation.metrics import make_spec

    return SimpleNamespace(name=name, num_items=n, metric=make_spec(metric, aggregation, higher_is_better))


def test_a_set_too_small_for_its_tolerance_is_refused_at_load_naming_file_field_set_and_n(tmp_path):
    from pipelines.gate.policy import check_attainable, load_gate_policy

    path = write_policy(tmp_path, eval_sets={"tiny": {"ni_margin": 3.0}})
    policy = load_policy(path)
    check_attainable(policy, [sized("tickets", 60), sized("tiny", 200)], file=path)  # 5.0 needs 59, 3.0 needs 99 (exact)
    with pytest.raises(InputError) as raised:
        check_attainable(load_gate_policy(path)[0], [sized("tickets", 60), sized("tiny", 80)], file=path)
    error = raised.value
    assert error.file == str(path) and error.field == "eval_sets.tiny.ni_margin" and error.exit_code == 2
    assert error.message == ("eval set tiny: 80 items cannot show a worsening under ni_margin 3 points at 95% confidence even "
                             "against an identical model (its bound is at least 3.36 points); it needs at least 99 items")
    assert "\n" not in error.one_line()
    with pytest.raises(InputError) as raised:
        check_attainable(load_gate_policy(path)[0], [sized("tickets", 58)], file=path)
    assert raised.value.field == "defaults.ni_margin" and "it needs at least 59 items" in raised.value.message


def test_the_recipe_override_that_sets_the_tolerance_is_named(tmp_path):
    from pipelines.gate.policy import check_attainable

    policy = load_policy(write_policy(tmp_path, recipes={"w4a16": {"ni_margin": 8.0, "confidence": 0.99}}))
    check_attainable(policy, [sized("tickets", 80)], "w8a8")
    with pytest.raises(InputError) as raised:
        check_attainable(policy, [sized("tickets", 60)], "w4a16")  # 99%: at least ln(0.01) / ln(0.92) = 55.2; calibrated, 65
    assert raised.value.field == "recipes.w4a16.ni_margin" and "at 99% confidence" in raised.value.message
    assert "it needs at least 65 items" in raised.value.message


def test_the_shipped_policy_accepts_the_demo_and_the_cut_real_sets(tmp_path):
    from pipelines.gate.policy import check_attainable, load_gate_policy

    policy, path = load_gate_policy(None)
    check_attainable(policy, [sized(name, 250) for name in ("ticket_routing", "payment_reference", "date_normalisation")], file=path)
    check_attainable(policy, [sized(name, 60, "acc") for name in ("retail_sentiment", "retail_faulty_item")], "sixteen-bit", file=path)
    with pytest.raises(InputError, match="it needs at least 53 items"):
        check_attainable(policy, [sized("retail_order_id", 30)], file=path)


def test_a_metric_in_its_own_unit_needs_a_relative_tolerance(tmp_path):
    from pipelines.gate.policy import check_attainable

    path = write_policy(tmp_path)  # no rel_margin, max_rel_drop 0.05
    wiki = sized("wiki", 400, "word_perplexity", "weighted_perplexity", False)
    check_attainable(load_policy(path), [wiki])  # max_rel_drop applies
    path = write_policy(tmp_path, eval_sets={"wiki": {"max_rel_drop": None}})
    with pytest.raises(InputError) as raised:
        check_attainable(load_policy(path), [wiki], file=path)
    assert raised.value.field == "defaults.rel_margin" and raised.value.file == str(path)
    assert "metric word_perplexity is in its own unit, not points" in raised.value.message
    assert "set rel_margin" in raised.value.message
    # A corpus metric in its own unit has a relative floor (its value range is the score itself), the zero-count bound
    # 1 - 0.05^(1/n): 2% needs 149 items at 95%, bleu, chrf and ter included, whatever their baseline (and 173 for the
    # default damage_share 0.02: test_a_corpus_set_needs_the_items_its_damage_share_asks_for).
    tight = load_policy(write_policy(tmp_path, eval_sets={"wiki": {"max_rel_drop": None, "rel_margin": 0.02}, "mt": {"rel_margin": 0.02}}))
    check_attainable(tight, [sized("wiki", 203, "word_perplexity", "weighted_perplexity", False), sized("mt", 173, "bleu", "bleu")])
    with pytest.raises(InputError, match="it needs at least 149 items") as raised:
        check_attainable(tight, [sized("wiki", 100, "word_perplexity", "weighted_perplexity", False)])
    assert raised.value.field == "eval_sets.wiki.rel_margin"
    with pytest.raises(InputError, match="eval set mt: 60 items cannot show a relative worsening under rel_margin 0.02") as raised:
        check_attainable(tight, [sized("mt", 60, "bleu", "bleu")])
    assert raised.value.field == "eval_sets.mt.rel_margin"


def test_a_corpus_set_needs_the_items_its_damage_share_asks_for(tmp_path):
    # The concentrated-damage rule (pipelines.gate.concentrated) passes an identical candidate from 173 items at damage_share
    # 0.02 (68 at 0.05): perplexities and bleu alike, more than a relative tolerance of 5% alone asks (59).
    from pipelines.gate.policy import check_attainable

    policy = load_policy(write_policy(tmp_path))  # max_rel_drop 0.05
    wiki = sized("wiki", 100, "word_perplexity", "weighted_perplexity", False)
    with pytest.raises(InputError) as raised:
        check_attainable(policy, [wiki])
    assert raised.value.field == "defaults.damage_share"
    assert raised.value.message == ("eval set wiki: 100 items cannot rule out a worsening concentrated in 2% of items (damage_share 0.02) "
                                    "at 95% confidence even against an identical model; it needs at least 173 items")
    with pytest.raises(InputError, match="eval set mt: 172 items cannot rule out"):
        check_attainable(policy, [sized("mt", 172, "bleu", "bleu")])
    check_attainable(policy, [sized("wiki", 173, "word_perplexity", "weighted_perplexity", False), sized("mt", 173, "bleu", "bleu")])
    wider = load_policy(write_policy(tmp_path, eval_sets={"wiki": {"damage_share": 0.05}}))
    check_attainable(wider, [wiki])


def test_rule_source_follows_precedence(tmp_path):
    policy = load_policy(write_policy(tmp_path, recipes={"w4a16": {"max_kl": 0.2}}, eval_sets={"orders": {"max_kl": None}}))
    assert policy.rule_source("w4a16", "orders", "max_kl") == "eval_sets.orders.max_kl"
    assert policy.rule_source("w4a16", "tickets", "max_kl") == "recipes.w4a16.max_kl"
    assert policy.rule_source("w8a8", "tickets", "max_kl") == "defaults.max_kl"
    assert policy.rule_source(None, "tickets", "max_kl") == "defaults.max_kl"
    assert policy.for_set(None, "tickets").max_kl == 0.1


def test_power_says_a_corpus_set_needs_the_items_its_damage_share_asks_for(tmp_path):
    # `eval-sets power` and the refusal at load agree: 173 items at damage_share 0.02, whichever relative rule is in force,
    # bleu included (59 from a rel_margin's floor alone)
    from pipelines.gate.power import power_rows

    small, enough = (sized("wiki", n, "word_perplexity", "weighted_perplexity", False) for n in (150, 173))
    for policy in (load_policy(write_policy(tmp_path)), load_policy(write_policy(tmp_path, eval_sets={"wiki": {"rel_margin": 0.05}}))):
        rows = power_rows([small, enough], policy, "w8a8", [0.1])
        assert [row["identical_items_needed"] for row in rows] == [173, 173]
        assert "it needs at least 173 items" in (rows[0]["refused"] or "") and rows[1]["refused"] is None
    margin = load_policy(write_policy(tmp_path, eval_sets={"mt": {"rel_margin": 0.05}}))
    assert power_rows([sized("mt", 150, "bleu", "bleu")], margin, "w8a8", [0.1])[0]["identical_items_needed"] == 173
