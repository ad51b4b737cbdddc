"""Scoring: eval sets, prompt templates, lm-eval runs, metrics, the 16-bit baseline and divergence."""
