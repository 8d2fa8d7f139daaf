"""Helpers shared by the loss modules."""

import torch
from torch import Tensor


def upcast(x: Tensor) -> Tensor:
    """``x`` in at least float32: bf16/fp16 log-prob differences lose too much to exp(), float64 stays float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))
