"""Advantage estimators: tensor-level functions and the TensorDict step :func:`compute` that wraps them.

Token-level: :func:`gae`, :func:`reinforce_plus_plus`, :func:`distillation`. Sequence-level with group baselines:
:func:`grpo` (Dr. GRPO with ``std_normalize=False``), :func:`rloo`, :func:`reinforce_plus_plus_baseline`.
Helpers: :func:`broadcast` (one value per sample onto its valid tokens) and :func:`whiten` (masked, optionally
global over a process group). Data parallel: :func:`sequence_advantages` computes the group baselines over a whole
batch, then :func:`compute` runs on each rank's row shard (:func:`shard_keys` lists what it reads there).
"""

from rlcore.advantage_config import ESTIMATORS, GROUP_BASELINE_ESTIMATORS, AdvantageConfig
from rlcore.advantages.compute import compute, sequence_advantages, shard_keys
from rlcore.advantages.group import broadcast, grpo, reinforce_plus_plus_baseline, rloo
from rlcore.advantages.token import distillation, gae, reinforce_plus_plus
from rlcore.advantages.whiten import whiten

__all__ = [
    "ESTIMATORS",
    "GROUP_BASELINE_ESTIMATORS",
    "AdvantageConfig",
    "broadcast",
    "compute",
    "distillation",
    "gae",
    "grpo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "rloo",
    "sequence_advantages",
    "shard_keys",
    "whiten",
]
