"""Fused LM head + log-probability + entropy: ``hidden [N, H] x weight [V, H]`` without ever holding [N, V] logits.

The vocabulary is walked in column chunks. Forward: each chunk's logits ``hidden @ weight[c]^T`` ([N, chunk], the
input dtype) go through the logits kernel's statistics pass, which merges them exactly into the running per-token
statistics (see ``_stats``); the chunk is then dropped, except the last chunks that fit in ``stash_bytes``, which are
kept for the backward (the last ones, so that no working chunk coexists with the full stash). Backward, per chunk,
stashed ones first: the stashed logits or a recomputed ``hidden @ weight[c]^T``; d(logits) written in place by the
logits kernel; ``grad_weight[c] = d(logits)^T @ hidden`` (complete in one matmul, so accumulated in float32 inside
it) and ``grad_hidden += d(logits) @ weight[c]`` (into a float32 accumulator).

Cost: 2NHV FLOPs forward, and 4NHV backward plus 2NHV for each chunk that was not stashed; the stash trades memory
for that recomputation. Extra memory: the stash, one working chunk when no stash is held, and the float32
[N, H] accumulator.
"""

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from rlcore._checks import check_tensor
from rlcore.kernels._stats import (
    Partial,
    check_float_matrix,
    check_targets,
    check_temperature,
    group_layout,
    outputs,
)
from rlcore.kernels.logprobs import backend_ops

DEFAULT_CHUNK = 12288
# 1.75 GiB: at [N, H, V] = [16384, 4096, 151936] on an H100 this kept the extra peak memory at 1.76 GiB and cut the
# recomputed share of the logits to ~65% (tools/bench_kernels.py --sweep). It never exceeds the bf16 logits' size.
DEFAULT_STASH_BYTES = 7 << 28


def _accumulate_matmul(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` with ``acc`` float32: on CUDA the matmul writes float32 itself, with no rounded temporary."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif a.is_cuda:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.add_(a @ b)


def _stashed_starts(rows: int, vocab: int, chunk: int, element_size: int, stash_bytes: int) -> set[int]:
    """Starts of the last chunks whose logits fit in ``stash_bytes`` together.

    The last ones: they are the final allocations of the forward, so the stash never coexists with a working chunk.
    """
    starts, used = set(), 0
    for start in reversed(range(0, vocab, chunk)):
        size = rows * (min(start + chunk, vocab) - start) * element_size
        if used + size > stash_bytes:
            break
        starts.add(start)
        used += size
    return starts


class LinearLogprobsEntropy(torch.autograd.Function):
    """Autograd wrapper; saves ``hidden``, ``weight``, per-token ``lse`` and ``mu`` and the stashed logit chunks."""

    @staticmethod
    def forward(
        ctx, hidden, weight, targets, col_offset, inv_temperature, with_entropy, group, chunk, stash_bytes, need_grad
    ):
        partial_stats, _ = backend_ops(hidden)
        vocab = weight.shape[0]
        keep = _stashed_starts(hidden.shape[0], vocab, chunk, hidden.element_size(), stash_bytes) if need_grad else ()
        packed = None
        stash: dict[int, Tensor] = {}
        for start in range(0, vocab, chunk):
            logits = hidden @ weight[start : start + chunk].T
            packed = partial_stats(logits, targets, col_offset + start, inv_temperature, with_entropy, packed)
            if start in keep:
                stash[start] = logits
            del logits
        totals, log_probs, entropy = outputs(Partial(*packed), group, with_entropy)
        ctx.save_for_backward(hidden, weight, targets, totals.lse, totals.mu)
        ctx.stash = stash
        ctx.chunk = chunk
        ctx.col_offset = col_offset
        ctx.inv_temperature = inv_temperature
        ctx.set_materialize_grads(False)
        return log_probs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, targets, lse, mu = ctx.saved_tensors
        # The stashed chunks are overwritten by their gradient below, so a second backward (retain_graph=True)
        # finds the stash empty and recomputes every chunk from the saved hidden and weight.
        stash = ctx.stash
        ctx.stash = {}
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        _, logits_grad = backend_ops(hidden)
        # Accumulated transposed ([H, N]): on an H100 cuBLAS ran this form of the product ~3% faster.
        grad_hidden_t = (
            torch.zeros(hidden.shape[::-1], dtype=torch.float32, device=hidden.device) if want_hidden else None
        )
        grad_weight = torch.empty_like(weight) if want_weight else None
        # Stashed chunks first, so their memory is released before recomputed chunks are allocated.
        starts = sorted(stash, reverse=True) + [s for s in range(0, weight.shape[0], ctx.chunk) if s not in stash]
        for start in starts:
            w = weight[start : start + ctx.chunk]
            logits = stash.pop(start) if start in stash else hidden @ w.T
            logits_grad(
                logits,
                targets,
                ctx.col_offset + start,
                lse,
                mu,
                grad_log_probs,
                grad_entropy,
                ctx.inv_temperature,
                logits,
            )
            if want_weight:
                torch.mm(logits.T, hidden, out=grad_weight[start : start + ctx.chunk])
            if want_hidden:
                _accumulate_matmul(grad_hidden_t, w.T, logits.T)
            del logits
        grad_hidden = torch.empty_like(hidden).copy_(grad_hidden_t.T) if want_hidden else None
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def linear_logprobs_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    group: object = None,
    chunk: int = DEFAULT_CHUNK,
    stash_bytes: int = DEFAULT_STASH_BYTES,
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probability and entropy of ``softmax(hidden @ weight^T / temperature)``, [N, V] never held.

    Args:
        hidden: [N, H] bfloat16, float16 or float32 final hidden states.
        weight: [V, H] LM-head weight of the same dtype and device. With ``group``, this rank's contiguous vocabulary
            shard (rank ``r`` holds rows ``[r * V, (r + 1) * V)``), as in a column-parallel output layer.
        targets: [N] int64 or int32 ids of the full vocabulary, each in ``[0, V * world_size)`` (no ignore index).
        temperature: divides the logits.
        with_entropy: compute the entropy (else ``None`` is returned for it).
        group: process group over which the vocabulary is sharded. Outputs are the full-vocabulary ones on every
            rank; ``weight``'s gradient is this rank's shard of the full one, and ``hidden``'s gradient is this
            rank's partial sum, as for any column-parallel layer: the caller reduces it over the group (Megatron's
            ``copy_to_tensor_model_parallel_region`` or sequence-parallel gather do that in their backward).
        chunk: vocabulary columns per chunk (the working set is an [N, chunk] logits block).
        stash_bytes: at most this many bytes of forward logit chunks are kept for the backward instead of being
            recomputed there (only when a gradient is needed); 0 recomputes every chunk.

    Returns:
        ``(log_probs [N] float32, entropy [N] float32 or None)``, differentiable with respect to ``hidden`` and
        ``weight``; the backward may run more than once (``retain_graph=True``), recomputing the stashed logits.
        A row whose logits are all ``-inf`` has no distribution: its outputs are NaN, as for ``logprobs_entropy``.
    """
    hidden = check_float_matrix("hidden", hidden)
    weight = check_tensor("weight", weight, ndim=2)
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise TypeError(
            f"weight ({weight.dtype}, {weight.device}) must match hidden ({hidden.dtype}, {hidden.device})"
        )
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be [V, H] for hidden {tuple(hidden.shape)} ([N, H])")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    if isinstance(stash_bytes, bool) or not isinstance(stash_bytes, int) or stash_bytes < 0:
        raise ValueError(f"stash_bytes must be a non-negative int, got {stash_bytes!r}")
    inv_temperature = 1.0 / check_temperature(temperature)
    rank, world = group_layout(group)
    vocab_local = weight.shape[0]
    targets = check_targets(
        targets,
        rows=hidden.shape[0],
        rows_name=f"hidden {tuple(hidden.shape)}",
        vocab=vocab_local * world,
        device=hidden.device,
    )
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    log_probs, entropy = LinearLogprobsEntropy.apply(
        hidden.contiguous(),
        weight.contiguous(),
        targets,
        rank * vocab_local,
        inv_temperature,
        with_entropy,
        group,
        chunk,
        stash_bytes,
        need_grad,
    )
    return log_probs, entropy if with_entropy else None
