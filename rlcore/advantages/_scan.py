"""Vectorised building blocks of the token-level estimators: compaction of valid tokens and a discounted reverse scan.

Both GAE and REINFORCE++ need ``y[t] = x[t] + c * y[t + 1]`` over the *valid* tokens of each row only (tool output
in the middle of a multi-turn response is skipped, as verl does). Valid tokens are first moved to the left of each
row, the scan runs over that dense prefix, and the result is moved back.
"""

import math

import torch
from einops import rearrange
from torch import Tensor


def compaction_index(mask: Tensor) -> Tensor:
    """Where each token goes when the valid tokens of each row are packed to the left.

    Args:
        mask: [B, T] bool.

    Returns:
        [B, T] int64: for a valid token, its rank among the valid tokens of its row; for a masked token, ``T``
        (a spare column that :func:`compact` writes to and discards, and :func:`expand` reads as 0).
    """
    rank = mask.cumsum(dim=1) - 1
    return torch.where(mask, rank, mask.shape[1])


def compact(x: Tensor, index: Tensor) -> Tensor:
    """[B, T] -> [B, T]: valid tokens packed to the left in order, zeros after them; masked values never leak."""
    batch, length = x.shape
    out = x.new_zeros(batch, length + 1)
    out.scatter_(1, index, x)
    return out[:, :length]


def expand(packed: Tensor, index: Tensor) -> Tensor:
    """Inverse of :func:`compact`: [B, T] packed -> [B, T] at the original positions, 0 at masked positions."""
    padded = torch.cat([packed, packed.new_zeros(packed.shape[0], 1)], dim=1)
    return padded.gather(1, index)


def _powers(discount: float, exponents: Tensor, dtype: torch.dtype) -> Tensor:
    # Only non-negative exponents of a discount in [0, 1] occur, so every entry lies in [0, 1]: nothing can overflow
    # (unlike the cumsum(x * c**-t) * c**t trick), and c**large underflows harmlessly to 0. pow(0, 0) is 1.
    # Powers below the smallest normal number are flushed to exactly 0: subnormal operands make CPU matmuls and
    # multiplies an order of magnitude slower, and their contribution is below the precision of the result anyway.
    base = torch.tensor(discount, dtype=torch.float64, device=exponents.device)
    powers = torch.pow(base, exponents.to(torch.float64))
    return torch.where(powers < torch.finfo(dtype).tiny, 0.0, powers).to(dtype)


def _reverse_discount_matrix(size: int, discount: float, *, dtype: torch.dtype, device: torch.device) -> Tensor:
    """[size, size] M with M[i, j] = discount ** (i - j) for i >= j, else 0, so ``y = x @ M`` is the reverse scan."""
    steps = torch.arange(size, device=device)
    lag = steps[:, None] - steps[None, :]
    return torch.where(lag >= 0, _powers(discount, lag.clamp(min=0), dtype), 0.0)


def discounted_reverse_cumsum(x: Tensor, *, discount: float) -> Tensor:
    """``y[:, t] = sum_{s >= t} discount ** (s - t) * x[:, s]`` along dim 1, without a loop over time.

    Two-level blocked scan: rows are cut into ``nb`` blocks of ``b ~ sqrt(T)`` steps. Within a block the scan is a
    matmul with a [b, b] discount matrix; the carries between blocks (the scanned value at each block start) are a
    second matmul with an [nb, nb] matrix of powers ``discount ** (b * k)``. All matrix entries are powers with
    non-negative exponents of ``discount`` in [0, 1], so the result is as stable as the sequential recurrence for any
    ``T`` and for ``discount`` both below and equal to 1.

    Args:
        x: [B, T] floating.
        discount: in [0, 1].

    Returns:
        [B, T] of ``x``'s dtype.
    """
    length = x.shape[1]
    if length == 0:
        return x.clone()
    block = 1 << max(3, math.ceil(math.log2(math.sqrt(length))))
    num_blocks = -(-length // block)
    padded = x if length == num_blocks * block else torch.nn.functional.pad(x, (0, num_blocks * block - length))
    padded = rearrange(padded, "b (n k) -> b n k", k=block)
    within = padded @ _reverse_discount_matrix(block, discount, dtype=x.dtype, device=x.device)
    # Scanned value at the start of each block, from the block-start partial sums of every later-or-equal block.
    starts = within[:, :, 0] @ _reverse_discount_matrix(num_blocks, discount**block, dtype=x.dtype, device=x.device)
    # The value carried into block k is the scan at the start of block k + 1 (0 after the last block).
    carry = torch.nn.functional.pad(starts[:, 1:], (0, 1))
    decay = _powers(discount, torch.arange(block, 0, -1, device=x.device), x.dtype)
    out = within + carry[:, :, None] * decay
    return rearrange(out, "b n k -> b (n k)")[:, :length]
