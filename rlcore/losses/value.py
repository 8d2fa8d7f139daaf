"""PPO's clipped value loss, per token."""

import torch
from torch import Tensor

from rlcore._checks import check_same_shape, check_tensor
from rlcore.losses._common import zero_masked


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    *,
    clip: float | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """Squared error of the critic, pessimistically clipped around the old values as in PPO.

    ``(values - returns)^2``, and with ``clip``: ``max((values - returns)^2, (v_clip - returns)^2)`` where
    ``v_clip = old_values + clamp(values - old_values, -clip, clip)``. As slime's ``value_loss_function`` (and
    torchrl's ``ClipPPOLoss`` critic loss), there is no factor 1/2.

    Args:
        values: [...] current critic outputs (the gradient flows through these).
        old_values: [...] critic outputs when the batch was collected.
        returns: [...] regression targets.
        clip: half-width of the trust region around ``old_values``; ``None`` turns clipping off.
        mask: [...] bool, valid tokens, or ``None``. With it the inputs must be finite where it is True and the
            others may hold anything, NaN included: they are zeroed first, so the loss is 0 and ``values`` gets
            gradient 0 there. Without it a NaN input gives a NaN loss and gradient at its own position only.

    Returns:
        [...] per-token loss (float32, float64 for float64 inputs).
    """
    check_tensor("values", values, floating=True)
    check_tensor("old_values", old_values, floating=True)
    check_tensor("returns", returns, floating=True)
    check_same_shape(values=values, old_values=old_values, returns=returns)
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, int | float) or not clip >= 0):
        raise ValueError(f"clip must be a non-negative number or None, got {clip!r}")
    values, old_values, returns = zero_masked(mask, values=values, old_values=old_values, returns=returns)
    loss = (values - returns).square()
    if clip is None:
        return loss
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    return torch.maximum(loss, (clipped_values - returns).square())
