"""Chunked torch versions of the two kernel operations, for CPU tensors outside the Triton interpreter.

Each works on a few rows at a time, so the float32 temporaries stay near ``_CHUNK_ELEMENTS`` elements whatever the
size of the logits: a float32 copy of the whole [N, V] logits never exists.
"""

import torch
from torch import Tensor

from rlcore.kernels._stats import EMPTY_MAX, Partial, merge

_CHUNK_ELEMENTS = 1 << 22


def _row_chunks(rows: int, vocab: int):
    step = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    for start in range(0, rows, step):
        yield start, min(start + step, rows)


def _target_mask(targets: Tensor, vocab: int) -> tuple[Tensor, Tensor]:
    """Whether each row's target lies in this piece, and the target clamped to a safe column."""
    inside = (targets >= 0) & (targets < vocab)
    return inside, torch.where(inside, targets, torch.zeros_like(targets))


def partial_stats(
    logits: Tensor,
    targets: Tensor,
    col_offset: int,
    inv_temperature: float,
    with_entropy: bool,
    accumulate: Tensor | None = None,
) -> Tensor:
    """Packed [4, N] :class:`Partial` of ``logits [N, V]`` (column 0 is vocabulary id ``col_offset``), merged into
    ``accumulate`` when given (see ``logprobs.triton_partial_stats``)."""
    n, vocab = logits.shape
    out = torch.empty(4, n, dtype=torch.float32, device=logits.device)
    for start, stop in _row_chunks(n, vocab):
        z = logits[start:stop].float() * inv_temperature
        m = z.amax(dim=-1).clamp_min(EMPTY_MAX)
        shifted = z - m[:, None]
        e = torch.exp(shifted)
        out[0, start:stop] = m
        out[1, start:stop] = e.sum(dim=-1)
        if with_entropy:
            # exp(-inf) * -inf is NaN; those columns carry no probability.
            out[2, start:stop] = torch.where(e > 0, e * shifted, 0.0).sum(dim=-1)
        else:
            out[2, start:stop] = 0.0
        inside, safe = _target_mask(targets[start:stop] - col_offset, vocab)
        picked = z.gather(1, safe[:, None]).squeeze(1)
        out[3, start:stop] = torch.where(inside, picked, 0.0)
    if accumulate is None:
        return out
    accumulate.copy_(torch.stack(merge(Partial(*accumulate), Partial(*out))))
    return accumulate


def logits_grad(
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
    """Write d(loss)/d(logits) into ``out`` (which may be ``logits`` itself): chunk by chunk, read before written."""
    n, vocab = logits.shape
    for start, stop in _row_chunks(n, vocab):
        z = logits[start:stop].float() * inv_temperature
        p = torch.exp(z - lse[start:stop, None])
        grad = torch.zeros_like(z)
        if grad_log_probs is not None:
            g = grad_log_probs[start:stop, None].float() * inv_temperature
            grad -= g * p
            inside, safe = _target_mask(targets[start:stop] - col_offset, vocab)
            grad.scatter_add_(1, safe[:, None], torch.where(inside[:, None], g, 0.0))
        if grad_entropy is not None:
            g = grad_entropy[start:stop, None].float() * inv_temperature
            grad += g * torch.where(p > 0, p * (mu[start:stop, None] - z), 0.0)
        out[start:stop] = grad.to(out.dtype)
