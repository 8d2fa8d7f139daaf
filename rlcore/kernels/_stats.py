"""Per-token softmax statistics shared by every backend: merging vocabulary pieces and argument checks.

A backend reduces one piece of the vocabulary (a Triton block loop, a torch chunk, a column chunk of the LM head or
one rank's shard) to four float32 numbers per token, on the temperature-scaled logits ``z = logits / T``:

- ``m``: the piece's maximum (a large negative finite sentinel where the piece is empty or all ``-inf``),
- ``s = sum(exp(z - m))``,
- ``a = sum(exp(z - m) * (z - m))`` (kept relative to ``m`` so the entropy does not cancel catastrophically),
- ``zt``: the target's scaled logit where the target lies in the piece, else 0.

Pieces merge exactly (a log-sum-exp with a shifted first moment): across chunks with :func:`merge` (the Triton
statistics kernel does the same merge in place), across ranks with :func:`all_reduce`; :func:`finalize` turns the
totals into ``lse``, ``mu = sum(p * z)`` and the entropy ``lse - mu``. The backward only needs ``lse`` and ``mu``
per token.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from rlcore._checks import check_tensor

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Finite stand-in for "no maximum yet": keeps (m_old - m_new) * s free of inf * 0.
EMPTY_MAX = -1.0e30


class Partial(NamedTuple):
    """Statistics of one vocabulary piece, each [N] float32 (see the module docstring)."""

    m: Tensor
    s: Tensor
    a: Tensor
    zt: Tensor


class Totals(NamedTuple):
    """Whole-vocabulary statistics, each [N] float32: ``lse``, ``mu = sum(p * z)``, entropy, target ``z``."""

    lse: Tensor
    mu: Tensor
    entropy: Tensor
    zt: Tensor


def merge(x: Partial | None, y: Partial) -> Partial:
    """Statistics of the union of two disjoint vocabulary pieces."""
    if x is None:
        return y
    m = torch.maximum(x.m, y.m)
    sx, ax = _shift(x, m)
    sy, ay = _shift(y, m)
    return Partial(m, sx + sy, ax + ay, x.zt + y.zt)


def _shift(p: Partial, m: Tensor) -> tuple[Tensor, Tensor]:
    """``s`` and ``a`` of ``p`` re-expressed relative to the larger maximum ``m``."""
    scale = torch.exp(p.m - m)
    return p.s * scale, (p.a + p.s * (p.m - m)) * scale


def all_reduce(p: Partial, group: object) -> Partial:
    """Statistics over the whole vocabulary from each rank's shard: one MAX and one SUM all-reduce."""
    m = p.m.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    s, a = _shift(p, m)
    packed = torch.stack([s, a, p.zt])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return Partial(m, packed[0], packed[1], packed[2])


def finalize(p: Partial) -> Totals:
    """``lse``, ``mu``, entropy and target logit from whole-vocabulary statistics.

    A token whose logits are all ``-inf`` has ``s = 0``: its ``lse`` is ``-inf`` and ``mu``, the entropy and the
    log-prob ``zt - lse`` are NaN. That input defines no distribution; the NaN is left to show it.
    """
    log_s = torch.log(p.s)
    mean_shift = p.a / p.s
    return Totals(lse=p.m + log_s, mu=p.m + mean_shift, entropy=log_s - mean_shift, zt=p.zt)


def outputs(p: Partial, group: object, with_entropy: bool) -> tuple[Totals, Tensor, Tensor]:
    """Whole-vocabulary ``Totals`` of this rank's statistics ``p`` (all-reduced over ``group`` when given), with the
    forward's ``(log_probs, entropy)``; the entropy is zeros without ``with_entropy`` (autograd needs a tensor)."""
    if group is not None:
        p = all_reduce(p, group)
    totals = finalize(p)
    log_probs = totals.zt - totals.lse
    return totals, log_probs, totals.entropy if with_entropy else torch.zeros_like(log_probs)


def check_temperature(temperature: float) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        raise TypeError(f"temperature must be a float, got {type(temperature).__name__}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    return float(temperature)


def group_layout(group: object) -> tuple[int, int]:
    """``(rank, world_size)`` of ``group``, or ``(0, 1)`` without one."""
    if group is None:
        return 0, 1
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group was given but torch.distributed is not initialized")
    return dist.get_rank(group), dist.get_world_size(group)


def host_later(x: Tensor) -> Callable[[], Tensor]:
    """``x`` copied to the host without waiting for the device: a CUDA tensor goes to pinned memory asynchronously,
    behind the work queued so far. The returned function gives the host copy, waiting for that copy alone (the ops
    check device values this way after queuing their kernels). A CPU tensor is given as it is."""
    if not x.is_cuda:
        return lambda: x
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    done = torch.cuda.Event()
    done.record()

    def get() -> Tensor:
        done.synchronize()
        return host

    return get


def check_targets(
    targets: object, *, rows: int, rows_name: str, vocab: int, device: torch.device
) -> tuple[Tensor, Callable[[], None]]:
    """``targets`` as a contiguous int64 [rows] tensor on ``device``, and ``verify()``, which raises unless every id is
    in ``[0, vocab)``.

    Dtype, shape and device are checked at once. The id range is checked without stalling the GPU: the ids' minimum
    and maximum are copied to the host asynchronously, and the op calls ``verify()`` after launching its kernels
    (which ignore ids outside their piece of the vocabulary), so the host waits for that copy only while the GPU
    already has the op's work queued behind it. Nothing is written to any input either way.
    """
    targets = check_tensor("targets", targets, ndim=1)
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must have dtype int64 or int32, got {targets.dtype} (shape {tuple(targets.shape)})")
    if targets.shape[0] != rows:
        raise ValueError(f"targets has shape {tuple(targets.shape)} but {rows_name} has {rows} rows")
    if targets.device != device:
        raise ValueError(f"targets is on {targets.device} but {rows_name} is on {device}")
    if not rows:
        return targets.to(torch.int64).contiguous(), lambda: None
    bounds = host_later(torch.stack(torch.aminmax(targets)))

    def verify() -> None:
        low, high = bounds().tolist()
        if low < 0 or high >= vocab:
            raise ValueError(
                f"targets must lie in [0, {vocab}) (the full vocabulary); got ids from {low} to {high} "
                f"(shape {tuple(targets.shape)}). There is no ignore index: give padded positions any valid id "
                "and mask them downstream."
            )

    return targets.to(torch.int64).contiguous(), verify


def check_float_matrix(name: str, x: object) -> Tensor:
    x = check_tensor(name, x, ndim=2)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {x.dtype} (shape {tuple(x.shape)})")
    return x
