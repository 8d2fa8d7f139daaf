"""Plain temperature sampling (no top-k, no top-p, no kept sets) by inverse CDF in one Triton kernel.

:func:`runtime.engines.decode.sample_tokens` is the definition: row ``b`` draws the first token whose cumulative
probability under ``softmax(logits / temperature)`` exceeds ``uniforms[b]`` times the row's total, never a token of
probability zero, and reports ``log_softmax(logits.float() / temperature)`` at it. In torch that is about fifteen
passes over the ``[B, V]`` logits (scale, log-softmax, softmax, cumulative sum, masks, maximum, argmax); with no
truncation to apply, :func:`plain_sample_triton` does it in two, one program per row: an online maximum and sum,
then a running cumulative sum that stops at the drawn token. It sums in another order than ``torch.cumsum``, so a
uniform within float32 rounding of a boundary between two tokens may draw the neighbour; every draw is still an
exact inverse-CDF sample of the row's distribution, and a token of probability zero is never drawn.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU path needs no Triton
    triton = None


def plain_sample_triton(
    logits: torch.Tensor, uniforms: torch.Tensor, *, temperature: float, block: int = 4096, num_warps: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits ``[B, V]`` (rows contiguous), uniforms ``[B]`` float32 in ``[0, 1)`` -> tokens ``[B]`` int64 and
    log-probs ``[B]`` float32 (module docstring). ``block``: vocabulary entries per inner step (a power of two)."""
    if logits.dim() != 2 or logits.stride(-1) != 1 or uniforms.shape != logits.shape[:1]:
        raise ValueError(
            f"logits must be [B, V] with contiguous rows and uniforms [B], got {logits.shape}, {uniforms.shape}"
        )
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    log_probs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _plain_sample_kernel[(rows,)](
        logits, uniforms.float(), tokens, log_probs, logits.stride(0), 1.0 / temperature, VOCAB=vocab,
        BLOCK=block, num_warps=num_warps,
    )  # fmt: skip
    return tokens, log_probs


if triton is not None:

    @triton.jit
    def _plain_sample_kernel(
        logits_ptr, u_ptr, tok_ptr, lp_ptr, stride, inv_t, VOCAB: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        cols = tl.arange(0, BLOCK)
        # Pass 1: the row's maximum and its sum of exp(x - maximum), each lane online over its columns.
        lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
        lane_sum = tl.zeros([BLOCK], tl.float32)
        for start in range(0, VOCAB, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < VOCAB, other=float("-inf")).to(tl.float32) * inv_t
            new_max = tl.maximum(lane_max, x)
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            lane_sum = lane_sum * tl.exp(lane_max - shift) + tl.exp(x - shift)
            lane_max = new_max
        top = tl.max(lane_max, 0)
        total = tl.sum(lane_sum * tl.exp(lane_max - top), 0)
        # Pass 2: the first token of positive probability whose running sum exceeds u * total; where rounding leaves
        # none (the running sum ends a little below total), the last token of positive probability.
        target = tl.load(u_ptr + row) * total
        carry = tl.zeros([1], tl.float32)
        first_hit = tl.full([], 0, tl.int32) + VOCAB
        last_positive = tl.full([], -1, tl.int32)
        for start in range(0, VOCAB, BLOCK):
            col = start + cols
            x = tl.load(base + col, mask=col < VOCAB, other=float("-inf")).to(tl.float32) * inv_t
            p = tl.exp(x - top)
            running = tl.sum(carry, 0) + tl.cumsum(p, 0)
            positive = p > 0
            first_hit = tl.minimum(first_hit, tl.min(tl.where(positive & (running > target), col, VOCAB), 0))
            last_positive = tl.maximum(last_positive, tl.max(tl.where(positive, col, -1), 0))
            carry += tl.sum(p, 0)
        token = tl.where(first_hit < VOCAB, first_hit, last_positive)
        x_token = tl.load(base + token).to(tl.float32) * inv_t
        tl.store(tok_ptr + row, token.to(tl.int64))
        tl.store(lp_ptr + row, x_token - top - tl.log(total))
