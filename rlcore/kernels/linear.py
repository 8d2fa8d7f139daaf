"""Fused LM head + log-probability + entropy: ``hidden [N, H] x weight [V, H]`` without ever holding [N, V] logits.

The vocabulary is walked in column pieces (:func:`plan_pieces`). Forward: each piece's logits ``hidden @ weight[c]^T``
([N, piece], the input dtype) go through the logits kernel's statistics pass, which merges them exactly into the
running per-token statistics (see ``_stats``). Most pieces are then dropped and recomputed in the backward; two kinds
are kept instead, since the backward's costliest part is that recomputation:

- head pieces (the first columns) are kept inside the weight gradient's own buffer, allocated in the forward. The
  backward consumes them first, in order, and each piece's ``grad_weight`` rows are laid out to land only on bytes
  whose logits are already consumed (piece ``[a, b)`` lies at element offset ``>= H * b``), so they cost no memory.
  Only ``N > H`` leaves much room beyond the first piece; the buffer is the gradient the backward returns anyway,
  and an LM head's backward follows its forward with only the loss in between, so this does not raise a training
  step's peak (which is at the start of the backward, when this buffer existed before too).
- tail pieces (the last columns), up to ``stash_bytes``, are kept as their own tensor: the forward's last allocation,
  so that the stash never coexists with a working piece.

Backward, per piece (head, tail, then the recomputed middle): d(logits) written in place by the logits kernel;
``grad_weight[c] = d(logits)^T @ hidden`` (complete in one matmul, so accumulated in float32 inside it) and
``grad_hidden += d(logits) @ weight[c]`` (into a float32 accumulator).

Cost: 2NHV FLOPs forward, and 4NHV backward plus 2NHV for each column that was not kept. Extra memory: at most
``max(stash_bytes, N * chunk * itemsize)`` of logits at any time, plus the float32 [N, H] accumulator.
"""

from typing import NamedTuple

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
# 1.75 GiB: at [N, H, V] = [16384, 4096, 151936] on an H100 the extra peak memory stays under 2 GiB with the float32
# gradient accumulator (tools/bench_kernels.py). It never exceeds the bf16 logits' size.
DEFAULT_STASH_BYTES = 7 << 28
# Head pieces start on 128-byte boundaries of the weight-gradient buffer (in elements of 2 bytes; 4-byte dtypes are
# over-aligned), and none is narrower than this fraction of ``chunk``: the space left after geometrically shrinking
# pieces (N < H) is not worth their launches.
_ALIGN = 64
_MIN_HEAD_FRACTION = 8
# Working pieces at most half the stash: end to end, splits of 1, 2 and 3 measured within noise of each other
# (106-108 ms at [N, H, V] = [16384, 4096, 151936] on an H100, tools/bench_kernels.py --sweep), and in isolation
# cuBLAS ran the forward matmul of a 28288-column piece 5% faster per column than that of a 57344-column one.
DEFAULT_SPLIT = 2
# Piece bounds fall on multiples of this many columns (see plan_pieces).
_COL_ALIGN = 128


class Piece(NamedTuple):
    """Vocabulary columns ``[start, stop)`` of one step, and where its logits wait for the backward.

    ``kept``: ``"head"`` (in the weight-gradient buffer from element ``offset`` on), ``"tail"`` (its own tensor) or
    ``""`` (recomputed in the backward).
    """

    start: int
    stop: int
    kept: str = ""
    offset: int = 0


class Plan(NamedTuple):
    """The forward's pieces (head, middle, tail) and the backward's (head, tail, middle), each covering ``[0, V)``."""

    forward: tuple[Piece, ...]
    backward: tuple[Piece, ...]


def _split(start: int, stop: int, width: int, unit: int, kept: str = "") -> list[Piece]:
    """``[start, stop)`` in the fewest pieces at most ``width`` wide, of near-equal widths, every bound but ``stop`` on
    a multiple of ``unit`` (``start`` is one; ``width >= unit``)."""
    if stop <= start:
        return []
    units = -(-(stop - start) // unit)
    count = -(-units // max(1, width // unit))
    bounds = [min(stop, start + unit * (units * i // count)) for i in range(count + 1)]
    return [Piece(a, b, kept) for a, b in zip(bounds, bounds[1:], strict=False)]


def _head_pieces(rows: int, hidden_size: int, vocab: int, chunk: int, unit: int) -> list[Piece]:
    """Head pieces laid out in a [vocab, hidden_size] buffer so that writing piece ``[a, b)``'s gradient rows (elements
    ``[H * a, H * b)``) never touches logits not yet consumed: piece ``j`` starts at ``offset_j >= H * b_j``."""
    size = vocab * hidden_size
    first = min(chunk, vocab, size // (rows + hidden_size))
    pieces, start, offset = [], 0, hidden_size * first
    while start < vocab:
        offset = -(-offset // _ALIGN) * _ALIGN
        limit = min(offset // hidden_size - start, (size - offset) // rows)
        if not pieces:
            limit = min(limit, first)
        width = vocab - start if vocab - start <= limit else limit // unit * unit
        if width < (max(unit, chunk // _MIN_HEAD_FRACTION) if pieces else 1):
            break
        pieces.append(Piece(start, start + width, "head", offset))
        start += width
        offset += rows * width
    return pieces


def plan_pieces(
    rows: int,
    hidden_size: int,
    vocab: int,
    element_size: int,
    *,
    chunk: int,
    stash_bytes: int,
    keep: bool,
    head: bool,
    split: int = DEFAULT_SPLIT,
) -> Plan:
    """The column pieces of one call (pure: it only decides widths and offsets).

    Args:
        rows, hidden_size, vocab, element_size: ``N``, ``H``, ``V`` and the logits' bytes per element.
        chunk: the narrowest working piece; pieces widen up to what ``stash_bytes`` holds.
        stash_bytes: bytes of logits kept as the tail stash, and the widest working piece.
        keep: a backward will follow (else nothing is kept).
        head: keep head pieces in the weight-gradient buffer (the weight needs a gradient).
        split: working pieces are at most ``1 / split`` of the budget, and the tail is kept in ``split`` pieces.

    Returns:
        A :class:`Plan`. Every piece of the tail and middle is at most ``width = max(chunk, stash_bytes // (rows *
        element_size)) // split`` columns wide, the tail is at most ``stash_bytes`` in at most ``split`` pieces, and
        every bound but ``vocab`` is a multiple of ``min(128, width)`` (unaligned rows slow cuBLAS down severalfold).
    """
    budget_cols = stash_bytes // (rows * element_size) if rows else vocab
    width = max(1, max(chunk, budget_cols) // split)
    unit = min(_COL_ALIGN, width)
    if not keep:
        pieces = tuple(_split(0, vocab, width, unit))
        return Plan(pieces, pieces)
    heads = _head_pieces(rows, hidden_size, vocab, chunk, unit) if head and rows else []
    head_end = heads[-1].stop if heads else 0
    tail_start = vocab - min(vocab - head_end, budget_cols)
    tail_start = min(vocab, -(-tail_start // unit) * unit)
    tail_units = -(-(vocab - tail_start) // unit)
    tails = _split(tail_start, vocab, unit * -(-tail_units // split), unit, "tail")
    middle = _split(head_end, tail_start, width, unit)
    return Plan(tuple(heads + middle + tails), tuple(heads + tails + middle))


def _accumulate_matmul(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` with ``acc`` float32: on CUDA the matmul writes float32 itself, with no rounded temporary."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif a.is_cuda:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.add_(a @ b)


def _piece_logits(hidden: Tensor, weight: Tensor, piece: Piece, buffer: Tensor | None) -> Tensor:
    """``hidden @ weight[piece]^T``, written into its place in ``buffer`` for a head piece."""
    w = weight[piece.start : piece.stop]
    if piece.kept != "head":
        return hidden @ w.T
    size = hidden.shape[0] * (piece.stop - piece.start)
    out = buffer.view(-1)[piece.offset : piece.offset + size].view(hidden.shape[0], -1)
    return torch.mm(hidden, w.T, out=out)


class LinearLogprobsEntropy(torch.autograd.Function):
    """Autograd wrapper; saves ``hidden``, ``weight``, per-token ``lse`` and ``mu``, and the kept logit pieces."""

    @staticmethod
    def forward(
        ctx, hidden, weight, targets, col_offset, inv_temperature, with_entropy, group, chunk, stash_bytes, grads
    ):
        want_hidden, want_weight = grads
        partial_stats, _ = backend_ops(hidden)
        plan = plan_pieces(
            hidden.shape[0],
            hidden.shape[1],
            weight.shape[0],
            hidden.element_size(),
            chunk=chunk,
            stash_bytes=stash_bytes,
            keep=want_hidden or want_weight,
            head=want_weight,
            split=DEFAULT_SPLIT,  # read at call time, so that tools/bench_kernels.py --sweep can vary it
        )
        # The weight gradient's buffer, holding the head pieces' logits until the backward overwrites them.
        buffer = torch.empty_like(weight) if any(p.kept == "head" for p in plan.forward) else None
        packed = None
        kept: dict[int, Tensor] = {}
        for piece in plan.forward:
            logits = _piece_logits(hidden, weight, piece, buffer)
            packed = partial_stats(logits, targets, col_offset + piece.start, inv_temperature, with_entropy, packed)
            if piece.kept:
                kept[piece.start] = logits
            del logits
        totals, log_probs, entropy = outputs(Partial(*packed), group, with_entropy)
        ctx.save_for_backward(hidden, weight, targets, totals.lse, totals.mu)
        ctx.plan = plan
        ctx.kept = kept
        ctx.buffer = buffer
        ctx.col_offset = col_offset
        ctx.inv_temperature = inv_temperature
        ctx.set_materialize_grads(False)
        return log_probs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, targets, lse, mu = ctx.saved_tensors
        # The kept pieces are overwritten by their gradient below (and the buffer is handed out as the gradient), so
        # a second backward (retain_graph=True) finds nothing kept and recomputes every piece.
        kept, buffer = ctx.kept, ctx.buffer
        ctx.kept, ctx.buffer = {}, None
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        _, logits_grad = backend_ops(hidden)
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32) if want_hidden else None
        grad_weight = None
        if want_weight:
            grad_weight = buffer if buffer is not None else torch.empty_like(weight)
        for piece in ctx.plan.backward:
            w = weight[piece.start : piece.stop]
            logits = kept.pop(piece.start) if piece.start in kept else hidden @ w.T
            logits_grad(
                logits,
                targets,
                ctx.col_offset + piece.start,
                lse,
                mu,
                grad_log_probs,
                grad_entropy,
                ctx.inv_temperature,
                logits,
            )
            if want_weight:
                torch.mm(logits.T, hidden, out=grad_weight[piece.start : piece.stop])
            if want_hidden:
                _accumulate_matmul(grad_hidden, logits, w)
            del logits
        if want_hidden:
            grad_hidden = grad_hidden.to(hidden.dtype)
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
        chunk: the narrowest block of vocabulary columns worked on at once (an [N, chunk] logits block).
        stash_bytes: the memory for logits besides that block: up to this many bytes of the last columns' forward
            logits are kept for the backward instead of being recomputed there (only when a gradient is needed), and
            blocks that are not kept may be this large. 0 recomputes all but the head pieces.

    Returns:
        ``(log_probs [N] float32, entropy [N] float32 or None)``, differentiable with respect to ``hidden`` and
        ``weight``; the backward may run more than once (``retain_graph=True``), recomputing the kept logits.
        A row whose logits are all ``-inf`` has no distribution: its outputs are NaN, as for ``logprobs_entropy``.

    When ``weight`` needs a gradient, its gradient's buffer is allocated by the forward and holds the first columns'
    logits until the backward (see the module docstring): the memory between forward and backward is then one
    weight-sized tensor more than the stash, the one the backward would allocate anyway.
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
    targets, verify_targets = check_targets(
        targets,
        rows=hidden.shape[0],
        rows_name=f"hidden {tuple(hidden.shape)}",
        vocab=vocab_local * world,
        device=hidden.device,
    )
    grad_enabled = torch.is_grad_enabled()
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
        (grad_enabled and hidden.requires_grad, grad_enabled and weight.requires_grad),
    )
    verify_targets()
    return log_probs, entropy if with_entropy else None
