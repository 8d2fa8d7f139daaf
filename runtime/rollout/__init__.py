"""Rollout: prompts and ``Sample``s, generation on the engines, rewards, filters, and the rollout source.

Custom generate functions (``--custom-generate-function-path``) reach the job's engines through
:func:`generate` (one default turn) and :func:`engine_generate` (raw token ids in, a ``Generation`` out); rollout
functions (``--rollout-function-path``) through :func:`run`, :func:`generate_and_rm` and
:func:`generate_and_rm_group` (see ``runtime.rollout.plugins``).

The names load on first use (PEP 562): ``runtime.rollout.data`` (the config's data checks) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "RolloutContext": "runtime.rollout.generation",
    "apply_generation": "runtime.rollout.generation",
    "collect_rollout": "runtime.rollout.generation",
    "current_context": "runtime.rollout.generation",
    "engine_generate": "runtime.rollout.generation",
    "expand_groups": "runtime.rollout.generation",
    "generate": "runtime.rollout.generation",
    "generate_groups": "runtime.rollout.generation",
    "multi_turn_metrics": "runtime.rollout.generation",
    "reward_category_metrics": "runtime.rollout.generation",
    "sample_metrics": "runtime.rollout.generation",
    "split_aborted": "runtime.rollout.generation",
    "RolloutFnEvalOutput": "runtime.rollout.plugins",
    "RolloutFnTrainOutput": "runtime.rollout.plugins",
    "generate_and_rm": "runtime.rollout.plugins",
    "generate_and_rm_group": "runtime.rollout.plugins",
    "rollout_tokenizer": "runtime.rollout.plugins",
    "run": "runtime.rollout.plugins",
}

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


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
