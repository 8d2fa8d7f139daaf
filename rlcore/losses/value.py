"""PPO's clipped value loss: per token, and the critic's aggregated loss over a batch TensorDict."""

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from rlcore import keys
from rlcore._checks import check_choice, check_mask, check_same_shape, check_tensor
from rlcore.losses._common import zero_masked
from rlcore.losses.aggregate import AGG_MODES, Normalizer, aggregate


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


def critic_loss(
    td: TensorDictBase, *, clip: float | None = 0.2, loss_agg_mode: str = "token_mean", norm: Normalizer | None = None
) -> tuple[Tensor, TensorDict]:
    """The critic's training loss of a (micro-)batch: :func:`value_loss`, aggregated, and its metrics.

    This is slime's ``value_loss_function`` (the loss the critic of ``--advantage-estimator ppo`` trains on):
    ``max((v_clip - R)^2, (v - R)^2)`` per valid token, reduced with ``aggregate(mode=loss_agg_mode, norm=norm)``.

    Reads (batch contract, ``keys``): ``mask`` [B, T] bool, ``values`` [B, T] (the critic's current outputs, with
    gradient), ``old_values`` [B, T] (its outputs when the batch was collected) and ``returns`` [B, T] (the
    targets); the last two are detached. Masked positions may hold anything, NaN included.

    Args:
        td: the batch, ``batch_size=[B]``.
        clip: half-width of the trust region around ``old_values`` (slime's ``--value-clip``), ``None`` off.
        loss_agg_mode: one of ``AGG_MODES``.
        norm: denominators of the global batch; ``None`` uses this batch's.

    Returns:
        ``(loss, metrics)``: the 0-dim differentiable loss and a detached TensorDict (batch size []) of
        ``value_loss`` (the loss), ``value_clipfrac`` (token mean of ``|values - old_values| > clip``, 0 without
        ``clip``) and ``values_mean`` (token mean of ``values``), token means over ``norm``'s token count so that
        they add up over the micro-batches of the global batch.
    """
    if not isinstance(td, TensorDictBase):
        raise TypeError(f"td must be a TensorDict, got {type(td).__name__}")
    for key in (keys.MASK, keys.VALUES, keys.OLD_VALUES, keys.RETURNS):
        if key not in td.keys():
            raise ValueError(f"critic_loss needs td[{key!r}]; the batch has keys {sorted(td.keys())}")
    mask = check_mask(td.get(keys.MASK))
    check_tensor(keys.MASK, mask, ndim=2)
    check_choice("loss_agg_mode", loss_agg_mode, AGG_MODES)
    if norm is None:
        norm = Normalizer.of(mask)
    values, old_values, returns = zero_masked(
        mask, values=td.get(keys.VALUES), old_values=td.get(keys.OLD_VALUES), returns=td.get(keys.RETURNS)
    )
    per_token = value_loss(values, old_values.detach(), returns.detach(), clip=clip)
    loss = aggregate(per_token, mask, mode=loss_agg_mode, norm=norm)
    outside = (values - old_values).abs() > clip if clip is not None else torch.zeros_like(mask)
    metrics = {
        "value_loss": loss,
        "value_clipfrac": aggregate(outside.to(per_token.dtype), mask, mode="token_mean", norm=norm),
        "values_mean": aggregate(values.detach(), mask, mode="token_mean", norm=norm),
    }
    return loss, TensorDict({name: value.detach() for name, value in metrics.items()}, batch_size=[])
