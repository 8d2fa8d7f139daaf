"""The token permutation of megatron-core's MoE token dispatchers by gathers: deterministic, without atomic adds.

megatron-core 0.16.1's unfused ``permute`` (tokens to expert order, before the all-to-all) copies each token once
per chosen expert with ``index_select``, whose backward sums a token's copies with ``index_add`` (atomic adds);
its ``unpermute`` (the experts' outputs back to token order) sums each token's copies with ``scatter_add`` (atomic
adds, its backward a gather). On GPUs atomic adds of bf16 rows are slow (on four H200s, Qwen3-30B-A3B layers at
micro-batch 4, the two took 0.14 s of a 1.45 s step: ``docs/gpu-results.md`` M2), their order of summation varies
from run to run, and each add rounds to bf16. With Transformer Engine megatron-core runs fused kernels instead
(``--moe-permute-fusion``), which these hosts do not have.

Where every token has the same number of copies (``copies``: the alltoall dispatcher's dropless top-k routing gives
each token exactly ``--moe-router-topk`` experts; a routing map that does not is refused by a device-side check, no
host sync), the sum of a token's copies is a gather of its copies into ``[tokens, copies, hidden]`` (the inverse of
the permutation, by a stable ``argsort``, computed once in :func:`permute`) and a sum over ``copies``, accumulated in
float32 and rounded once; and the copies' gradient is a gather too. Both are deterministic; the gathered
``[tokens x copies, hidden]`` copy is transient memory that atomic adds do not need (0.5 GB a layer at 16k tokens,
top 8, hidden 2048, bf16). :func:`permute` and :func:`unpermute` keep megatron-core's signatures and outputs
(``sorted_indices`` as it computes them) and hand everything else (fused, drop-and-pad, the allgather dispatcher's
uneven copies, probabilities merged in ``unpermute``) to megatron-core's own; :func:`install` puts them into the
dispatchers' module.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


class _CopyRows(torch.autograd.Function):
    """``x[index]``: each of ``x``'s ``rows`` rows ``copies`` times; the backward sums a row's copies by gathering
    them (``inverse``: the rows of the output grouped by the input row they copy)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, copies: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.rows, ctx.copies = x.shape[0], copies
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (inverse,) = ctx.saved_tensors
        return _sum_copies(grad, inverse, rows=ctx.rows, copies=ctx.copies), None, None, None


class _SumCopies(torch.autograd.Function):
    """The reverse of :class:`_CopyRows`: output row ``t`` is the sum of the rows of ``x`` that copy row ``t``
    (``index``: the row each row of ``x`` copies); the backward gathers the gradient to the copies."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, rows: int, copies: int
    ) -> torch.Tensor:
        ctx.save_for_backward(index)
        return _sum_copies(x, inverse, rows=rows, copies=copies)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None, None, None


def _sum_copies(x: torch.Tensor, inverse: torch.Tensor, *, rows: int, copies: int) -> torch.Tensor:
    """``[rows, hidden]``: the sum of each row's ``copies`` rows of ``x`` (``inverse`` groups them), in float32
    (torch's reductions of bf16 accumulate in float32), in ``x``'s dtype."""
    grouped = x.index_select(0, inverse).view(rows, copies, *x.shape[1:])
    return grouped.sum(1, dtype=torch.promote_types(x.dtype, torch.float32)).to(x.dtype)


def _inverse(index: torch.Tensor, *, rows: int, copies: int) -> torch.Tensor:
    """The positions in ``index`` of row 0's copies, then row 1's, ...; a device-side check (no host sync on GPUs)
    that every row of ``rows`` has exactly ``copies`` of them."""
    inverse = torch.argsort(index, stable=True)
    expected = torch.arange(rows, device=index.device).repeat_interleave(copies)
    torch._assert_async(
        (index[inverse] == expected).all(),
        "MoE permutation: a token routed to other than --moe-router-topk experts",
    )
    return inverse


# The attribute of a permutation's ``sorted_indices`` that :func:`permute` computed by gathers: ``(inverse,
# copies)``, which :func:`unpermute` reuses. megatron-core's dispatchers hand ``permute``'s ``sorted_indices`` to
# ``unpermute`` as they got them; indices without it (another caller's) go to megatron-core's ``unpermute``.
_GATHERED = "_rlcore_gathered"


@functools.cache
def _megatron() -> tuple[Any, Any]:
    """megatron-core's own ``permute`` and ``unpermute``, for what this module hands on."""
    from megatron.core.transformer.moe import moe_utils

    return moe_utils.permute, moe_utils.unpermute


def permute(
    tokens: torch.Tensor,
    routing_map: torch.Tensor,
    probs: torch.Tensor | None = None,
    num_out_tokens: int | None = None,
    fused: bool = False,
    drop_and_pad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """megatron-core's ``permute``: ``tokens [T, H]`` to expert order by ``routing_map [T, E]`` (bool), the
    copies of expert 0's tokens first; ``(permuted [N, H], permuted probs [N] or None, sorted_indices [N])`` with
    ``N = num_out_tokens``; the backward sums each token's ``N / T`` copies by gathers."""
    rows = tokens.shape[0]
    # Gathers only where every token has the same number of copies: the alltoall dispatcher's dropless top-k, whose
    # count is a Python int (tokens x top-k); the allgather dispatcher's and token dropping's are tensors.
    if fused or drop_and_pad or type(num_out_tokens) is not int or rows == 0 or num_out_tokens % rows:
        return _megatron()[0](tokens, routing_map, probs, num_out_tokens, fused, drop_and_pad)
    by_expert = routing_map.bool().T.contiguous()  # [E, T]: expert-major, as megatron-core orders the copies
    token_ids = torch.arange(rows, device=routing_map.device).unsqueeze(0).expand_as(by_expert)
    sorted_indices = token_ids.masked_select(by_expert)
    permuted_probs = probs.T.contiguous().masked_select(by_expert) if probs is not None else None
    copies = num_out_tokens // rows
    inverse = _inverse(sorted_indices, rows=rows, copies=copies)
    setattr(sorted_indices, _GATHERED, (inverse, copies))
    return _CopyRows.apply(tokens, sorted_indices, inverse, copies), permuted_probs, sorted_indices


def unpermute(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    restore_shape: torch.Size,
    probs: torch.Tensor | None = None,
    routing_map: torch.Tensor | None = None,
    fused: bool = False,
    drop_and_pad: bool = False,
) -> torch.Tensor:
    """megatron-core's ``unpermute``: the rows of ``permuted_tokens [N, H]`` summed back to ``restore_shape``'s
    ``[T, H]`` token order (``sorted_indices``: :func:`permute`'s), in ``permuted_tokens``' dtype, by gathers;
    with ``probs`` (weights to merge by), or indices that :func:`permute` did not gather, megatron-core's own."""
    gathered = getattr(sorted_indices, _GATHERED, None)
    if fused or drop_and_pad or probs is not None or gathered is None:
        return _megatron()[1](permuted_tokens, sorted_indices, restore_shape, probs, routing_map, fused, drop_and_pad)
    inverse, copies = gathered
    return _SumCopies.apply(permuted_tokens, sorted_indices, inverse, restore_shape[0], copies)


def install() -> None:
    """Give megatron-core's token dispatchers (``transformer/moe/token_dispatcher.py``, which binds ``permute`` and
    ``unpermute`` at import) this module's functions; idempotent."""
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.permute, token_dispatcher.unpermute = permute, unpermute


__all__ = ["install", "permute", "unpermute"]
