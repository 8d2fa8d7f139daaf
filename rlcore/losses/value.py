"""PPO's clipped value loss, per token."""

import torch
from torch import Tensor

from rlcore._checks import check_same_shape, check_tensor
from rlcore.losses._common import upcast


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, *, clip: float | None = None) -> Tensor:
    """Squared error of the critic, pessimistically clipped around the old values as in PPO.

    ``(values - returns)^2``, and with ``clip``: ``max((values - returns)^2, (v_clip - returns)^2)`` where
    ``v_clip = old_values + clamp(values - old_values, -clip, clip)``. As slime's ``value_loss_function`` (and
    torchrl's ``ClipPPOLoss`` critic loss), there is no factor 1/2.

    Args:
        values: [...] current critic outputs (the gradient flows through these).
        old_values: [...] critic outputs when the batch was collected.
        returns: [...] regression targets.
        clip: half-width of the trust region around ``old_values``; ``None`` turns clipping off.

    Returns:
        [...] per-token loss (float32, float64 for float64 inputs). Elementwise: positions the caller masks
        out may hold anything.
    """
    check_tensor("values", values, floating=True)
    check_tensor("old_values", old_values, floating=True)
    check_tensor("returns", returns, floating=True)
    check_same_shape(values=values, old_values=old_values, returns=returns)
    values, returns = upcast(values), upcast(returns)
    loss = (values - returns).square()
    if clip is None:
        return loss
    if not isinstance(clip, int | float) or not clip >= 0:
        raise ValueError(f"clip must be a non-negative number or None, got {clip!r}")
    old_values = upcast(old_values)
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    return torch.maximum(loss, (clipped_values - returns).square())
