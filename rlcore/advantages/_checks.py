"""Argument checks specific to the advantage estimators (the generic ones live in :mod:`rlcore._checks`)."""

import torch
from torch import Tensor

from rlcore._checks import check_finite_where, check_mask, check_tensor
from rlcore._values import check_non_negative, check_positive, check_unit_interval

__all__ = ["check_non_negative", "check_positive", "check_unit_interval"]  # re-exported from rlcore._values


def check_token_tensor(name: str, x: object, mask: Tensor) -> Tensor:
    """A floating [B, T] tensor shaped like ``mask`` and finite wherever ``mask`` is True."""
    check_tensor(name, x, ndim=2, floating=True)
    check_mask(mask, like=x, like_name=name)
    check_finite_where(name, x, mask)
    return x


def check_token_mask(mask: object) -> Tensor:
    """A bool [B, T] mask."""
    check_mask(mask)
    if mask.dim() != 2:
        raise ValueError(f"mask must have 2 dimensions [B, T], got shape {tuple(mask.shape)}")
    return mask


def check_rewards(rewards: object, *, batch: int | None = None, batch_from: str = "mask") -> Tensor:
    """A finite floating [B] tensor (B equal to ``batch`` when given)."""
    check_tensor("rewards", rewards, ndim=1, floating=True)
    if batch is not None and rewards.shape[0] != batch:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)} but {batch_from} has batch size {batch}")
    if not bool(torch.isfinite(rewards).all()):
        first = int((~torch.isfinite(rewards)).nonzero()[0])
        raise ValueError(f"rewards has a non-finite value at index {first} (shape {tuple(rewards.shape)})")
    return rewards


def check_group_ids(group_ids: object, rewards: Tensor) -> Tensor:
    """An integer [B] tensor of the shape of ``rewards``."""
    check_tensor("group_ids", group_ids, ndim=1)
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise TypeError(
            f"group_ids must be an integer tensor (int64), got dtype {group_ids.dtype} "
            f"(shape {tuple(group_ids.shape)})"
        )
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids has shape {tuple(group_ids.shape)} but rewards has shape {tuple(rewards.shape)}")
    return group_ids


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype the math runs in: the inputs' promoted dtype, at least float32."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype
