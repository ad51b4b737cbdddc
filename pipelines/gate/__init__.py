"""The gate: paired statistics, the policy, the verdict per eval set and its report."""
