"""KL estimators, policy and value losses, mismatch correction, aggregation and the composed ``rl_loss``."""

from rlcore.losses.kl import KL_KINDS, approx_kl

__all__ = ["KL_KINDS", "approx_kl"]
