"""Rollout: prompts and ``Sample``s, generation on the engines, rewards, filters, and the rollout source.

Custom generate functions (``--custom-generate-function-path``) reach the job's engines through
:func:`generate` (one default turn) and :func:`engine_generate` (raw token ids in, a ``Generation`` out).
"""

from runtime.rollout.generation import (
    RolloutContext,
    apply_generation,
    collect_rollout,
    current_context,
    engine_generate,
    expand_groups,
    generate,
    generate_groups,
    reward_category_metrics,
    sample_metrics,
    split_aborted,
)

__all__ = [
    "RolloutContext",
    "apply_generation",
    "collect_rollout",
    "current_context",
    "engine_generate",
    "expand_groups",
    "generate",
    "generate_groups",
    "reward_category_metrics",
    "sample_metrics",
    "split_aborted",
]
