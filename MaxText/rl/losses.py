"""GRPO's loss and advantages live in MaxText/losses/policy.py (the objectives' layer, so that
DPO and the methods read them without importing rl/); this module keeps their old names."""
from MaxText.losses.policy import (ADVANTAGE_ESTIMATORS, AGGREGATIONS, IMPORTANCE_SAMPLING,
                                   KL_ESTIMATORS, LOG_RATIO_CLAMP, ZERO_STD, aggregate,
                                   batch_totals, group_advantages, informative_rows, kl_penalty,
                                   overlong_penalty, policy_loss)

__all__ = ["ADVANTAGE_ESTIMATORS", "AGGREGATIONS", "IMPORTANCE_SAMPLING", "KL_ESTIMATORS",
           "LOG_RATIO_CLAMP", "ZERO_STD", "aggregate", "batch_totals", "group_advantages",
           "informative_rows", "kl_penalty", "overlong_penalty", "policy_loss"]
