"""KL estimators, policy and value losses, mismatch correction, aggregation and the composed ``rl_loss``."""

from rlcore.loss_config import AGG_MODES, KL_KINDS, MISMATCH_LEVELS, MISMATCH_MODES, POLICY_LOSSES, LossConfig
from rlcore.losses.aggregate import Normalizer, aggregate
from rlcore.losses.entropy import entropy_bonus
from rlcore.losses.kl import approx_kl
from rlcore.losses.mismatch import mismatch_weights
from rlcore.losses.policy import cispo, gspo, opsm_keep, ppo_clip
from rlcore.losses.rl_loss import MAX_METRICS, rl_loss
from rlcore.losses.sft import sft_loss
from rlcore.losses.value import critic_loss, value_loss

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "MISMATCH_LEVELS",
    "MISMATCH_MODES",
    "MAX_METRICS",
    "POLICY_LOSSES",
    "LossConfig",
    "Normalizer",
    "aggregate",
    "approx_kl",
    "cispo",
    "critic_loss",
    "opsm_keep",
    "entropy_bonus",
    "gspo",
    "mismatch_weights",
    "ppo_clip",
    "rl_loss",
    "sft_loss",
    "value_loss",
]
