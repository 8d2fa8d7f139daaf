"""The trainer's varlen attention (``--attn-implementation varlen``): causal attention within each packed sequence,
no mask and no padding compute, through transformers' attention interface.

A packed micro-batch (``runtime.train.packing.packed_inputs``) is one row of concatenated sequences; its
``ModelInputs`` carry ``cu_seq_lens`` (the sequences' cumulative token counts, int32 ``[n + 1]``) and the longest
sequence's length, passed to the model as transformers' flash-attention keywords (``cu_seq_lens_q``/``_k``,
``max_length_q``/``_k``), which reach every attention call. Then:

- on a GPU, in bf16 or fp16: ``torch.nn.attention.varlen.varlen_attn`` (PyTorch's flash-attention varlen kernel),
  grouped-query heads without ``repeat_kv`` copies where the kernel takes ``enable_gqa``;
- otherwise (the CPU, float32): SDPA causal per sequence, the same function computed one sequence at a time.

Right-padded rows (no ``cu_seq_lens``) run SDPA causal with no mask: a real token attends only to earlier
positions, which are real, so padding after it changes nothing it computes. Mask creation is skipped altogether
(transformers builds no mask for an attention function its mask interface does not name), so a packed row of L
tokens never builds an ``L x L`` mask.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

ATTENTION = "varlen"


@functools.cache
def _varlen_kernel() -> tuple[Any, frozenset[str]] | None:
    """PyTorch's varlen flash-attention function and its keyword names, or None where this PyTorch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _flash_varlen(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor, longest: int, scaling: float
) -> torch.Tensor:
    """query ``[L, H, D]``, key/value ``[L, Hkv, D]`` (bf16/fp16, CUDA), ``cu`` int32 ``[n + 1]`` -> ``[L, H, D]``."""
    kernel, names = _varlen_kernel()
    groups = query.shape[1] // key.shape[1]
    kwargs: dict[str, Any] = {"scale": scaling}
    if groups > 1:
        if "enable_gqa" in names:
            kwargs["enable_gqa"] = True
        else:
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    # Causal: PyTorch 2.10/2.11 name it is_causal, later ones a (left, right) window with right 0.
    kwargs.update({"is_causal": True} if "is_causal" in names else {"window_size": (-1, 0)})
    return kernel(query, key, value, cu, cu, longest, longest, **kwargs)


def _sdpa_per_sequence(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor, scaling: float
) -> torch.Tensor:
    """The same contract as :func:`_flash_varlen` by SDPA, one sequence at a time (any device and dtype)."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    bounds = cu.tolist()
    parts = [
        torch.nn.functional.scaled_dot_product_attention(
            query[a:b].transpose(0, 1),
            key[a:b].transpose(0, 1),
            value[a:b].transpose(0, 1),
            is_causal=True,
            scale=scaling,
        ).transpose(0, 1)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return torch.cat(parts)


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in: autocast's where it is on (SDPA is on its lower-precision list; the varlen kernel
    is not, so the cast is done here), else ``tensor``'s."""
    device = tensor.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return tensor.dtype


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query ``[b, H, L, D]``, key/value ``[b, Hkv, L, D]``; returns
    ``([b, L, H, D], None)``. ``cu_seq_lens_q`` int32 ``[n + 1]`` with ``b == 1`` marks a packed row of ``n``
    sequences (``max_length_q`` the longest, a Python int); without it the rows are right-padded sequences."""
    if dropout:
        raise ValueError(f"--attn-implementation varlen: attention dropout {dropout} is not supported")
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    dtype = _compute_dtype(value)
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if cu_seq_lens_q is None:
        groups = query.shape[1] // key.shape[1]
        if groups > 1:
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    if query.shape[0] != 1:
        raise ValueError(f"varlen attention: a packed micro-batch is one row, got {query.shape[0]} rows")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    flash = query.is_cuda and dtype in (torch.bfloat16, torch.float16) and _varlen_kernel() is not None
    if flash:
        if max_length_q is None:
            raise ValueError("varlen attention: max_length_q (the longest packed sequence) is required on the GPU")
        out = _flash_varlen(q, k, v, cu_seq_lens_q.to(torch.int32), int(max_length_q), scaling)
    else:
        out = _sdpa_per_sequence(q, k, v, cu_seq_lens_q, scaling)
    return out[None], None


def register_attention() -> None:
    """Make :func:`varlen_attention` selectable as ``attn_implementation="varlen"`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, varlen_attention)


def flash_varlen_available(device: torch.device) -> bool:
    """Whether :func:`varlen_attention` runs PyTorch's flash kernel on ``device`` (a CUDA device with a PyTorch that
    has ``varlen_attn``)."""
    return device.type == "cuda" and _varlen_kernel() is not None
