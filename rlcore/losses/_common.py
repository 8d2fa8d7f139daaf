"""Helpers shared by the loss modules."""

import torch
from torch import Tensor

from rlcore._checks import check_finite_where, check_mask, masked_fill_zero


def upcast(x: Tensor) -> Tensor:
    """``x`` in at least float32: bf16/fp16 log-prob differences lose too much to exp(), float64 stays float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def zero_masked(mask: Tensor | None, **tensors: Tensor) -> tuple[Tensor, ...]:
    """The ``tensors`` (all of one shape, in the order given) upcast, and with ``mask`` zeroed where it is False.

    Used by the elementwise losses' optional ``mask``: each tensor must be finite where ``mask`` is True, and padding
    is replaced by 0 before any arithmetic, so that a NaN there reaches neither the result nor (as 0 * NaN) the
    gradient. Without ``mask`` the tensors are only upcast.
    """
    if mask is None:
        return tuple(upcast(x) for x in tensors.values())
    first = next(iter(tensors))
    check_mask(mask, like=tensors[first], like_name=first)
    for name, x in tensors.items():
        check_finite_where(name, x, mask)
    return tuple(masked_fill_zero(upcast(x), mask) for x in tensors.values())
