"""Rollout: prompts and ``Sample``s, generation on the engines, rewards, filters, and the rollout source.

Custom generate functions (``--custom-generate-function-path``) reach the job's engines through
:func:`generate` (one default turn) and :func:`engine_generate` (raw token ids in, a ``Generation`` out); rollout
functions (``--rollout-function-path``) through :func:`run`, :func:`generate_and_rm` and
:func:`generate_and_rm_group` (see ``runtime.rollout.plugins``).
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
    multi_turn_metrics,
    reward_category_metrics,
    sample_metrics,
    split_aborted,
)
from runtime.rollout.plugins import (
    RolloutFnEvalOutput,
    RolloutFnTrainOutput,
    generate_and_rm,
    generate_and_rm_group,
    rollout_tokenizer,
    run,
)

__all__ = [
    "RolloutContext",
    "RolloutFnEvalOutput",
    "RolloutFnTrainOutput",
    "generate_and_rm",
    "generate_and_rm_group",
    "rollout_tokenizer",
    "run",
    "apply_generation",
    "collect_rollout",
    "current_context",
    "engine_generate",
    "expand_groups",
    "generate",
    "generate_groups",
    "multi_turn_metrics",
    "reward_category_metrics",
    "sample_metrics",
    "split_aborted",
]
