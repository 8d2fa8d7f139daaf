"""Correction for the mismatch between the inference engine's and the trainer's log-probs (TIS, MIS, IcePop)."""

import torch
from torch import Tensor

from rlcore._checks import (
    check_choice,
    check_finite_where,
    check_mask,
    check_same_shape,
    check_tensor,
    masked_fill_zero,
)
from rlcore.loss_config import MISMATCH_LEVELS, MISMATCH_MODES
from rlcore.losses._common import upcast

# exp(20) ~ 5e8: far beyond any bound anyone sets, small enough that exp() never overflows (slime's mis.py
# uses the same safety bound).
_LOG_RATIO_BOUND = 20.0


def mismatch_weights(
    old_log_probs: Tensor,
    rollout_log_probs: Tensor,
    mask: Tensor,
    *,
    mode: str = "tis",
    level: str = "token",
    low: float | None = None,
    high: float = 2.0,
) -> tuple[Tensor, Tensor]:
    """Importance weights ``pi_train / pi_rollout`` for the policy loss, bounded or masked as ``mode`` says.

    The log-ratio ``old_log_probs - rollout_log_probs`` is taken per token (``token``), summed over each
    sample's valid tokens (``sequence``, the sequence-level IS ratio) or averaged over them (``geometric``,
    its geometric mean per token), then clamped to [-20, 20] before ``exp``.

    - ``tis`` (truncated IS, slime's ``--use-tis``): ``weights = clamp(ratio, low or 0, high)``, every valid
      token kept.
    - ``mis`` (masked IS): tokens with ``ratio > high`` (or ``ratio < low`` when ``low`` is given) are
      masked out; the others keep ``weights = ratio``.
    - ``icepop``: masked out on both sides, outside ``[low, high]`` with ``low`` defaulting to ``1 / high``;
      the others keep ``weights = ratio``, as slime's ``icepop_function`` does. (slime's own default lower
      bound is 0, i.e. one-sided; pass ``low=0.0`` for that.)

    Args:
        old_log_probs: [B, T] trainer log-probs of the sampling policy.
        rollout_log_probs: [B, T] inference-engine log-probs of the same tokens.
        mask: [B, T] bool, valid tokens.
        mode: ``tis``, ``mis`` or ``icepop``.
        level: ``token``, ``sequence`` or ``geometric``.
        low: lower bound on the ratio (see the modes), ``None`` for the mode's default.
        high: upper bound on the ratio.

    Returns:
        ``(weights, keep)``, both [B, T]: detached weights (float32, float64 for float64 inputs; 0 where
        ``keep`` is False) and a bool ``keep``, a subset of ``mask``. Multiply the per-token policy loss by
        ``weights`` and drop the tokens outside ``keep`` from the numerator of the aggregation; keep the
        denominator of ``mask`` (as slime does) so that rejecting tokens does not up-weight the rest.
    """
    check_tensor("old_log_probs", old_log_probs, ndim=2, floating=True)
    check_tensor("rollout_log_probs", rollout_log_probs, floating=True)
    check_same_shape(old_log_probs=old_log_probs, rollout_log_probs=rollout_log_probs)
    check_mask(mask, like=old_log_probs, like_name="old_log_probs")
    check_choice("mode", mode, MISMATCH_MODES)
    check_choice("level", level, MISMATCH_LEVELS)
    check_finite_where("old_log_probs", old_log_probs, mask)
    check_finite_where("rollout_log_probs", rollout_log_probs, mask)
    return mismatch_weights_unchecked(
        old_log_probs, rollout_log_probs, mask, mode=mode, level=level, low=low, high=high
    )


def mismatch_weights_unchecked(
    old_log_probs: Tensor,
    rollout_log_probs: Tensor,
    mask: Tensor,
    *,
    mode: str,
    level: str,
    low: float | None,
    high: float,
) -> tuple[Tensor, Tensor]:
    """:func:`mismatch_weights` without its tensor checks, which wait for the device (the finiteness of the log-probs
    at valid positions): for callers that check them without a host sync (``rlcore.kernels.linear_rl_loss``). The
    bounds are still checked, on the host."""
    if not isinstance(high, int | float) or not high > 0:
        raise ValueError(f"high must be a positive number, got {high!r}")
    if mode == "icepop" and low is None:
        low = 1.0 / high
    if low is not None and not (isinstance(low, int | float) and 0 <= low < high):
        raise ValueError(f"low must be a number in [0, high={high}), got {low!r} (mode {mode!r})")

    log_ratio = masked_fill_zero(upcast(old_log_probs) - upcast(rollout_log_probs), mask).detach()
    if level != "token":
        total = log_ratio.sum(-1, keepdim=True)
        if level == "geometric":
            total = total / mask.sum(-1, keepdim=True).clamp_min(1)
        log_ratio = total.expand_as(log_ratio)
    ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))

    if mode == "tis":
        keep = mask
        weights = ratio.clamp(min=0.0 if low is None else low, max=high)
    else:
        in_range = ratio <= high
        if low is not None:
            in_range = in_range & (ratio >= low)
        keep = mask & in_range
        weights = ratio
    return masked_fill_zero(weights, keep), keep
