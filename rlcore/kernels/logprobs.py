"""Fused per-token log-probability and entropy from logits [N, V]: Triton kernels, autograd Function, public function.

Forward (one program per token row): one pass over the row in blocks with an online max and sum-exp, the target's
logit, and ``sum(exp(z - m) * (z - m))`` for the entropy; only per-token float32 ``lse`` and ``mu = sum(p * z)`` are
kept for the backward. A short batch splits each row into column segments, one program each, whose statistics a
small kernel merges (see ``SPLIT_PROGRAMS``). Backward (one pass, split the same way): recompute
``p = exp(z - lse)`` and write

    d(logits) = [g_lp * (onehot - p) + g_ent * p * (mu - z)] / T

(``dH/dz = p * (mu - z)`` since ``H = lse - mu``), optionally into the logits' own buffer. Temperature is applied
inside the kernels; offsets are 64-bit, so N * V beyond 2**31 is fine.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.function import once_differentiable
from triton.runtime.jit import JITFunction

from rlcore.kernels import _torch_ops
from rlcore.kernels._stats import (
    Partial,
    check_float_matrix,
    check_targets,
    check_temperature,
    group_layout,
    outputs,
)


# In both kernels the vocabulary size and the segment length are compile-time constants: under Triton's interpreter
# with NumPy >= 2.4 a runtime scalar arrives as a 1-element array that cannot bound a Python range. A training run
# sees one or two sizes (the vocabulary, or a chunk and its tail) and a few segment counts (powers of two), so
# the compilations are few.
@triton.jit
def _stats_kernel(
    logits_ptr,
    row_stride,
    targets_ptr,
    col_offset,
    out_ptr,
    n_rows,
    vocab: tl.constexpr,
    inv_temperature,
    WITH_ENTROPY: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SEGMENT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    # Program (row, k) reduces columns [k * SEGMENT, (k + 1) * SEGMENT) of the row into the k-th [4, N] block of out.
    segment = tl.program_id(1)
    first = segment * SEGMENT
    out_ptr += segment.to(tl.int64) * 4 * n_rows
    row_ptr = logits_ptr + row * row_stride
    cols = tl.arange(0, BLOCK_V)
    m = -1.0e30  # EMPTY_MAX: finite, so (m_old - m_new) * s never meets inf * 0
    s = 0.0
    a = 0.0
    for start in range(0, SEGMENT, BLOCK_V):
        idx = first + start + cols
        inside = idx < vocab
        z = tl.load(row_ptr + idx, mask=inside, other=-float("inf")).to(tl.float32) * inv_temperature
        m_new = tl.maximum(m, tl.max(z, axis=0))
        alpha = tl.exp(m - m_new)
        shifted = z - m_new
        e = tl.exp(shifted)
        if WITH_ENTROPY:
            # exp(-inf) * -inf is NaN; such columns (padding, -inf logits) carry no probability.
            a = (a + s * (m - m_new)) * alpha + tl.sum(tl.where(e > 0, e * shifted, 0.0), axis=0)
        s = s * alpha + tl.sum(e, axis=0)
        m = m_new
    target = tl.load(targets_ptr + row) - col_offset
    has_target = (target >= first) & (target < first + SEGMENT) & (target < vocab)
    safe_target = tl.where(has_target, target, 0)
    zt = tl.load(row_ptr + safe_target, mask=has_target, other=0.0).to(tl.float32) * inv_temperature
    if ACCUMULATE:
        # Merge with the statistics of the vocabulary pieces already in out (the same algebra as _stats.merge).
        m_prev = tl.load(out_ptr + row)
        s_prev = tl.load(out_ptr + n_rows + row)
        a_prev = tl.load(out_ptr + 2 * n_rows + row)
        m_new = tl.maximum(m_prev, m)
        scale_prev = tl.exp(m_prev - m_new)
        scale = tl.exp(m - m_new)
        a = (a_prev + s_prev * (m_prev - m_new)) * scale_prev + (a + s * (m - m_new)) * scale
        s = s_prev * scale_prev + s * scale
        m = m_new
        zt += tl.load(out_ptr + 3 * n_rows + row)
    tl.store(out_ptr + row, m)
    tl.store(out_ptr + n_rows + row, s)
    tl.store(out_ptr + 2 * n_rows + row, a)
    tl.store(out_ptr + 3 * n_rows + row, zt)


@triton.jit
def _merge_kernel(parts_ptr, out_ptr, n_rows, SEGMENTS: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Merge the [SEGMENTS, 4, N] statistics of a row's column segments (with out's own when ACCUMULATE) into out."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = rows < n_rows
    if ACCUMULATE:
        m = tl.load(out_ptr + rows, mask=inside, other=0.0)
        s = tl.load(out_ptr + n_rows + rows, mask=inside, other=0.0)
        a = tl.load(out_ptr + 2 * n_rows + rows, mask=inside, other=0.0)
        zt = tl.load(out_ptr + 3 * n_rows + rows, mask=inside, other=0.0)
    else:
        m = tl.full([BLOCK_N], -1.0e30, tl.float32)
        s = tl.zeros([BLOCK_N], tl.float32)
        a = tl.zeros([BLOCK_N], tl.float32)
        zt = tl.zeros([BLOCK_N], tl.float32)
    for k in tl.static_range(SEGMENTS):
        part = parts_ptr + k * 4 * n_rows
        m_k = tl.load(part + rows, mask=inside, other=0.0)
        s_k = tl.load(part + n_rows + rows, mask=inside, other=0.0)
        a_k = tl.load(part + 2 * n_rows + rows, mask=inside, other=0.0)
        m_new = tl.maximum(m, m_k)
        scale = tl.exp(m - m_new)
        scale_k = tl.exp(m_k - m_new)
        a = (a + s * (m - m_new)) * scale + (a_k + s_k * (m_k - m_new)) * scale_k
        s = s * scale + s_k * scale_k
        m = m_new
        zt += tl.load(part + 3 * n_rows + rows, mask=inside, other=0.0)
    tl.store(out_ptr + rows, m, mask=inside)
    tl.store(out_ptr + n_rows + rows, s, mask=inside)
    tl.store(out_ptr + 2 * n_rows + rows, a, mask=inside)
    tl.store(out_ptr + 3 * n_rows + rows, zt, mask=inside)


@triton.jit
def _grad_kernel(
    logits_ptr,
    row_stride,
    grad_ptr,
    grad_row_stride,
    targets_ptr,
    col_offset,
    lse_ptr,
    mu_ptr,
    grad_lp_ptr,
    grad_ent_ptr,
    vocab: tl.constexpr,
    inv_temperature,
    HAS_GRAD_LP: tl.constexpr,
    HAS_GRAD_ENT: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SEGMENT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * SEGMENT  # program (row, k) writes columns [k * SEGMENT, (k + 1) * SEGMENT)
    row_ptr = logits_ptr + row * row_stride
    grad_row_ptr = grad_ptr + row * grad_row_stride
    cols = tl.arange(0, BLOCK_V)
    lse = tl.load(lse_ptr + row)
    mu = tl.load(mu_ptr + row)
    target = tl.load(targets_ptr + row) - col_offset
    g_lp = 0.0
    g_ent = 0.0
    if HAS_GRAD_LP:
        g_lp = tl.load(grad_lp_ptr + row).to(tl.float32) * inv_temperature
    if HAS_GRAD_ENT:
        g_ent = tl.load(grad_ent_ptr + row).to(tl.float32) * inv_temperature
    for start in range(0, SEGMENT, BLOCK_V):
        idx = first + start + cols
        inside = idx < vocab
        z = tl.load(row_ptr + idx, mask=inside, other=0.0).to(tl.float32) * inv_temperature
        p = tl.exp(z - lse)
        grad = tl.zeros([BLOCK_V], dtype=tl.float32)
        if HAS_GRAD_LP:
            grad = tl.where(idx == target, g_lp, 0.0) - g_lp * p
        if HAS_GRAD_ENT:
            grad += g_ent * tl.where(p > 0, p * (mu - z), 0.0)
        tl.store(grad_row_ptr + idx, grad.to(grad_ptr.dtype.element_ty), mask=inside)


# Triton decides between compiler and interpreter when it is imported (its own tl.max, tl.sum are jitted then), from
# TRITON_INTERPRET: CPU tensors may take the Triton path only when these kernels were built for the interpreter.
INTERPRETED = not isinstance(_stats_kernel, JITFunction)


def _launch_config(vocab: int, element_size: int, kind: str) -> tuple[int, int]:
    """``(BLOCK_V, num_warps)`` of the ``"stats"`` or ``"grad"`` kernel; small blocks under the interpreter so short
    test rows still span several blocks.

    Swept on an H100 for bf16 rows of 12288 to 151936 columns (tools/bench_kernels.py --sweep): the read-only
    statistics pass was fastest with 8 KiB blocks and 4 warps (2.5-2.9 TB/s), the read-write gradient pass with
    16 KiB blocks and 16 warps (2.8-2.9 TB/s).
    """
    if INTERPRETED:
        return 128, 1
    block_bytes, warps = (8192, 4) if kind == "stats" else (16384, 16)
    block = min(triton.next_power_of_2(vocab), block_bytes // element_size)
    return block, max(1, min(warps, block // 512))


# A pass over N rows splits each row into column segments, one program each, until it has about this many programs:
# each program streams its columns with one block in flight, so with few long rows the SMs idle through the last
# programs' tail. Swept on an H100 (bf16, V = 151936, tools/bench_kernels.py --sweep): at 4096 rows two segments
# took the statistics pass from 1.11x to 1.08x its HBM floor and four the gradient pass from 1.08x to 1.07x; at 8192
# and 16384 rows one and two segments were within run-to-run noise of each other (1.01-1.07x). Under the interpreter
# a small number, so that the tests' short batches take both paths.
SPLIT_PROGRAMS = {"stats": 8, "grad": 8} if INTERPRETED else {"stats": 8192, "grad": 16384}
# Segments are whole blocks and at least this many of them, so a segment's loop amortises its start and end.
_MIN_SEGMENT_BLOCKS = 1 if INTERPRETED else 4


def _segments(rows: int, vocab: int, block: int, programs: int) -> tuple[int, int]:
    """``(segments, columns per segment)`` of a pass over ``rows`` rows of ``vocab`` columns in ``block`` blocks that
    aims at about ``programs`` programs. The count is aimed at a power of two, so that the row counts of a run (its
    micro-batches and chunks) compile few kernel variants."""
    blocks = triton.cdiv(vocab, block)
    wanted = min(triton.cdiv(programs, max(rows, 1)), blocks // _MIN_SEGMENT_BLOCKS)
    if wanted <= 1:
        return 1, blocks * block
    wanted = 1 << (wanted.bit_length() - 1)
    per_segment = triton.cdiv(blocks, wanted)
    return triton.cdiv(blocks, per_segment), per_segment * block


def _row_major(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def triton_partial_stats(
    logits: Tensor,
    targets: Tensor,
    col_offset: int,
    inv_temperature: float,
    with_entropy: bool,
    accumulate: Tensor | None = None,
) -> Tensor:
    """Packed [4, N] :class:`Partial` (m, s, a, zt) of ``logits [N, V]``, whose column 0 is vocabulary id
    ``col_offset``; merged into ``accumulate`` (a previous result, updated and returned) when given."""
    n, vocab = logits.shape
    out = torch.empty(4, n, dtype=torch.float32, device=logits.device) if accumulate is None else accumulate
    if not n:
        return out
    block, warps = _launch_config(vocab, logits.element_size(), "stats")
    segments, segment = _segments(n, vocab, block, SPLIT_PROGRAMS["stats"])
    parts = out if segments == 1 else torch.empty(segments, 4, n, dtype=torch.float32, device=logits.device)
    _stats_kernel[(n, segments)](
        logits,
        logits.stride(0),
        targets,
        col_offset,
        parts,
        n,
        vocab,
        inv_temperature,
        WITH_ENTROPY=with_entropy,
        ACCUMULATE=segments == 1 and accumulate is not None,
        BLOCK_V=block,
        SEGMENT=segment,
        num_warps=warps,
    )
    if segments > 1:
        block_n = 128 if INTERPRETED else 1024
        _merge_kernel[(triton.cdiv(n, block_n),)](
            parts, out, n, SEGMENTS=segments, ACCUMULATE=accumulate is not None, BLOCK_N=block_n, num_warps=4
        )
    return out


def triton_logits_grad(
    logits: Tensor,
    targets: Tensor,
    col_offset: int,
    lse: Tensor,
    mu: Tensor,
    grad_log_probs: Tensor | None,
    grad_entropy: Tensor | None,
    inv_temperature: float,
    out: Tensor,
) -> None:
    """Write d(loss)/d(logits) into ``out`` (``logits`` itself allowed: each element is read before it is written)."""
    n, vocab = logits.shape
    if not n:
        return
    block, warps = _launch_config(vocab, logits.element_size(), "grad")
    segments, segment = _segments(n, vocab, block, SPLIT_PROGRAMS["grad"])
    _grad_kernel[(n, segments)](
        logits,
        logits.stride(0),
        out,
        out.stride(0),
        targets,
        col_offset,
        lse,
        mu,
        grad_log_probs.contiguous() if grad_log_probs is not None else lse,
        grad_entropy.contiguous() if grad_entropy is not None else lse,
        vocab,
        inv_temperature,
        HAS_GRAD_LP=grad_log_probs is not None,
        HAS_GRAD_ENT=grad_entropy is not None,
        BLOCK_V=block,
        SEGMENT=segment,
        num_warps=warps,
    )


def backend_ops(x: Tensor):
    """``(partial_stats, logits_grad)`` for ``x``'s device: Triton, or chunked torch on the CPU."""
    if x.is_cuda or INTERPRETED:
        return triton_partial_stats, triton_logits_grad
    return _torch_ops.partial_stats, _torch_ops.logits_grad


class LogprobsEntropy(torch.autograd.Function):
    """Autograd wrapper: saves the logits (not a copy), the targets and per-token ``lse`` and ``mu``."""

    @staticmethod
    def forward(ctx, logits, targets, col_offset, inv_temperature, with_entropy, group, inplace_backward):
        partial_stats, _ = backend_ops(logits)
        part = Partial(*partial_stats(logits, targets, col_offset, inv_temperature, with_entropy))
        totals, log_probs, entropy = outputs(part, group, with_entropy)
        ctx.save_for_backward(logits, targets, totals.lse, totals.mu)
        ctx.col_offset = col_offset
        ctx.inv_temperature = inv_temperature
        ctx.inplace_backward = inplace_backward
        ctx.logits_overwritten = False
        ctx.set_materialize_grads(False)
        return log_probs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_log_probs, grad_entropy):
        if ctx.inplace_backward:
            if ctx.logits_overwritten:
                raise RuntimeError(
                    "logprobs_entropy(..., inplace_backward=True) can run its backward once: the first one "
                    "overwrote the logits with their gradient"
                )
            ctx.logits_overwritten = True
        logits, targets, lse, mu = ctx.saved_tensors
        _, logits_grad = backend_ops(logits)
        out = logits if ctx.inplace_backward else torch.empty_like(logits)
        logits_grad(logits, targets, ctx.col_offset, lse, mu, grad_log_probs, grad_entropy, ctx.inv_temperature, out)
        return out, None, None, None, None, None, None


def logprobs_entropy(
    logits: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    group: object = None,
    inplace_backward: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probability of ``targets`` and entropy of ``softmax(logits / temperature)``.

    Args:
        logits: [N, V] bfloat16, float16 or float32 (last dimension contiguous, or it is copied). With ``group``,
            this rank's contiguous vocabulary shard: rank ``r`` holds columns ``[r * V, (r + 1) * V)``.
        targets: [N] int64 or int32 token ids of the full vocabulary, each in ``[0, V * world_size)``; anything
            outside raises ``ValueError`` (there is no ignore index: give padded positions a valid id and mask them
            downstream).
        temperature: divides the logits inside the kernel.
        with_entropy: compute the entropy (else ``None`` is returned for it).
        group: a ``torch.distributed`` process group over which the vocabulary is sharded (tensor parallelism).
            Max, sum-exp, target logit and ``sum(p * z)`` are all-reduced, so outputs are the full-vocabulary ones on
            every rank, and each rank's logits gradient is its shard of the full-vocabulary gradient (the backward
            needs no communication, given the same upstream gradients on every rank, as under tensor parallelism).
        inplace_backward: the caller no longer needs ``logits`` after this call: the backward writes d(logits) into
            the logits' own buffer, which is overwritten (saves an [N, V] allocation; the returned gradient, and a
            leaf's ``.grad``, then alias the logits). Leave False if anything else reads the logits afterwards; the
            backward can then run only once.

    Returns:
        ``(log_probs [N] float32, entropy [N] float32 or None)``, both differentiable with respect to ``logits``.
        Accumulation is float32 for every input dtype; no float32 copy of the logits is made. A row whose logits
        are all ``-inf`` (after masking, say) defines no distribution: its log-prob and entropy are NaN, not an
        error, because checking would cost a pass over the logits (the caller's NaN checks downstream catch it).
    """
    logits = check_float_matrix("logits", logits)
    inv_temperature = 1.0 / check_temperature(temperature)
    rank, world = group_layout(group)
    vocab_local = logits.shape[1]
    targets, verify_targets = check_targets(
        targets,
        rows=logits.shape[0],
        rows_name=f"logits {tuple(logits.shape)}",
        vocab=vocab_local * world,
        device=logits.device,
    )
    log_probs, entropy = LogprobsEntropy.apply(
        _row_major(logits), targets, rank * vocab_local, inv_temperature, with_entropy, group, inplace_backward
    )
    verify_targets()
    return log_probs, entropy if with_entropy else None
