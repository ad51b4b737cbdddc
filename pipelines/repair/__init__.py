"""Repair search: when the gate rejects a recipe, find the smallest artifact that passes (docs/repair.md).

units        the modules a repair moves: one per vLLM-served Linear (fused q/k/v and gate/up shards together)
ladder       the fallback ladders (recipes/ladders/default.yaml), checked against vLLM's kernels
pricing      what a proposal costs: the planner's weight bytes (and the plan at the policy's fit)
proposal     a proposal as a recipe: the parent recipe plus overrides that move modules up their ladder
fakequant    compressed-tensors fake quantization of one module (weights, dynamic and static activations)
sensitivity  how much each module moves the outputs: a proxy for all, KL on the gate's own paths for the top
search       the search over how many moves to make: predicted first, every proposal gated for real
session      a repair from a rejected run to repair.json, report.md, the plot and registry lineage
"""
