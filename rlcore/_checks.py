"""Argument checks shared by the tensor-level functions: one clear error naming the argument and the shapes seen."""

import torch
from torch import Tensor

from rlcore._values import check_choice

__all__ = ["check_choice"]  # re-exported: the torch-free checks live in rlcore._values


def check_tensor(name: str, x: object, *, ndim: int | None = None, floating: bool = False) -> Tensor:
    """Raise ``TypeError`` unless ``x`` is a tensor (floating point if asked) of ``ndim`` dimensions."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype} (shape {tuple(x.shape)})")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(x.shape)}")
    return x


def check_mask(mask: object, *, like: Tensor | None = None, like_name: str = "log_probs") -> Tensor:
    """Raise unless ``mask`` is a bool tensor (of the shape of ``like`` when given)."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a torch.Tensor of dtype bool, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must have dtype torch.bool, got {mask.dtype} (shape {tuple(mask.shape)})")
    if like is not None and mask.shape != like.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)} but {like_name} has shape {tuple(like.shape)}")
    return mask


def check_same_shape(**tensors: Tensor) -> None:
    """Raise ``ValueError`` naming every argument and its shape unless all shapes agree."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        seen = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"shapes must match: {seen}")


def check_finite_where(name: str, x: Tensor, mask: Tensor) -> None:
    """Raise ``ValueError`` if ``x`` holds NaN or inf at a position where ``mask`` is True."""
    bad = mask & ~torch.isfinite(x)
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name} has a non-finite value at valid position {first} (shape {tuple(x.shape)})")


def masked_fill_zero(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` with masked-out positions set to 0, so NaN/inf padding never reaches a sum or a gradient."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
