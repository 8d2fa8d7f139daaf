"""The MoE token dispatcher of the Megatron backend: all-to-all, each token sent once to each expert-parallel rank
that holds any of its experts, its copies for that rank's experts made there.

megatron-core 0.16.1's alltoall dispatcher (``MoEAlltoAllTokenDispatcher``) copies each token once per chosen expert
before the all-to-all, so a token routed to ``k`` experts crosses the network ``k`` times even when several of them
live on one rank (Qwen3-30B-A3B, top 8 of 128 experts on four ranks: 8 copies sent where about 3.6 ranks receive
one); and it sorts what it receives by local expert with a split and a cat of ``ranks x local experts`` chunks. On
four H200s the all-to-all was the largest kernel of a step (``docs/gpu-results.md`` M2). With DeepEP megatron-core's
``flex`` dispatcher sends each token once per rank; this is that dispatch over ``torch.distributed``'s
``all_to_all_single`` (no DeepEP needed), on GPUs over NCCL and on the CPU over gloo:

1. ``dispatch_preprocess``: each rank tells each other rank, in one small all-to-all, how many of its tokens each of
   that rank's experts gets and how many rows it sends it; one host sync reads those counts (megatron-core's
   dispatcher syncs once too, for its split sizes). Each token is copied once per rank it goes to (rank-major,
   tokens in order).
2. ``token_dispatch``: the rows, their gate weights for the receiving rank's experts and which of them chose the row
   (a ``[rows, local experts]`` mask) cross in three all-to-alls.
3. ``dispatch_postprocess``: each received row is copied once per local expert that chose it, expert-major (expert
   0's rows from rank 0, then from rank 1, ..., then expert 1's): the order, and so the rows, the experts see from
   megatron-core's dispatcher (its sort by local expert gives the same order).
4. ``combine_preprocess``: each received row's expert outputs summed (its copies), ``token_combine``: the sums back
   by the reverse all-to-all, ``combine_postprocess``: each token's sums from its ranks summed.

Every sum gathers a row's copies and adds them in order in float32, rounded once to the rows' dtype (:class:`Copies`,
one Triton kernel on GPUs): deterministic, with no atomic add, its backward a gather. A token's expert outputs are so
summed in two stages (per rank, then over ranks), each rounded once; megatron-core's unfused combine adds the ``k``
outputs one by one in bf16 (``scatter_add``), its fused one (Transformer Engine) once in float32.

:func:`use_once_per_rank` gives a built model's MoE layers this dispatcher where megatron-core built its alltoall one
(the Megatron backend's only dispatcher); :data:`DISPATCHER` keeps megatron-core's own instead (the benchmark's
baseline, ``tools/bench_backends.py --moe-dispatcher megatron``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
    from triton.runtime.jit import JITFunction
except ImportError:  # pragma: no cover - CUDA builds of torch carry Triton; the CPU path needs none
    triton = None

# The dispatcher of MoE layers of --moe-token-dispatcher-type alltoall: "once_per_rank" (this module's) or "megatron"
# (megatron-core's MoEAlltoAllTokenDispatcher; the benchmark's baseline). Read by use_once_per_rank() after a build.
DISPATCHERS = ("once_per_rank", "megatron")
DISPATCHER = "once_per_rank"


# ------------------------------------------------------------------ copies of rows and their sums

if triton is not None:

    @triton.jit
    def _sum_copies_kernel(
        x_ptr, order_ptr, offsets_ptr, out_ptr, width, MOST: tl.constexpr, BLOCK: tl.constexpr, WIDE: tl.constexpr
    ):
        """``out[row, cols] = sum(x[order[j], cols] for j in offsets[row]..offsets[row + 1])``, from zero in float32
        (float64 where ``WIDE``), in order, rounded once to ``out``'s dtype; a row has at most ``MOST`` copies."""
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < width
        start = tl.load(offsets_ptr + row)
        count = tl.load(offsets_ptr + row + 1) - start
        acc = tl.zeros([BLOCK], dtype=tl.float64 if WIDE else tl.float32)
        for i in tl.static_range(MOST):  # a row's copies past its count add nothing (+0.0 leaves any sum as it is)
            take = i < count
            src = tl.load(order_ptr + start + i, mask=take, other=0).to(tl.int64)
            acc += tl.load(x_ptr + src * width + cols, mask=inside & take, other=0.0).to(acc.dtype)
        tl.store(out_ptr + row.to(tl.int64) * width + cols, acc.to(out_ptr.dtype.element_ty), mask=inside)

    # TRITON_INTERPRET: CPU tensors take the kernel only when it was built for the interpreter (as rlcore.kernels).
    INTERPRETED = not isinstance(_sum_copies_kernel, JITFunction)
else:  # pragma: no cover
    INTERPRETED = False


@dataclasses.dataclass(frozen=True)
class Copies:
    """Where the copies of ``rows`` rows lie among ``n`` copies: ``source [n]``, the row each copy copies; and the
    copies grouped by row, ``order [n]`` (row 0's copies in ascending place, then row 1's, ...) with ``offsets
    [rows + 1]`` (row ``r``'s are ``order[offsets[r]:offsets[r + 1]]``); a row has at most ``most`` copies."""

    source: torch.Tensor
    order: torch.Tensor
    offsets: torch.Tensor
    most: int

    @property
    def rows(self) -> int:
        return self.offsets.shape[0] - 1

    @classmethod
    def of_slots(
        cls, mask: torch.Tensor, position: torch.Tensor, source: torch.Tensor, *, most: int | None = None
    ) -> Copies:
        """The copies of ``mask``'s rows: ``mask [rows, slots]`` (bool) marks a row's copies, ``position [rows,
        slots]`` where each lies, ascending along a row's slots, ``source [n]`` the row each copy copies, and
        ``most`` the most copies a row has (at most ``slots``, the default)."""
        n = source.shape[0]
        by_row, _ = compact(mask, n)  # a row's copies in slot order, which is their places' order
        offsets = torch.zeros(mask.shape[0] + 1, dtype=torch.long, device=mask.device)
        torch.cumsum(mask.sum(1), 0, out=offsets[1:])
        most = mask.shape[1] if most is None else min(most, mask.shape[1])
        if most < mask.shape[1]:  # the kernel adds a row's first `most` copies: checked on the device, no sync
            torch._assert_async((offsets.diff() <= most).all(), "MoE dispatch: a token with more than top-k copies")
        return cls(source, position.reshape(-1).index_select(0, by_row), offsets, most)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """``[rows, ...]``: each row's copies in ``x [n, ...]`` added in their order from zero in float32 (or
        ``x``'s wider dtype) and rounded once to ``x``'s dtype; zeros for a row without copies. The same adds in the
        same order on either path, so the same bits: one Triton program per row and column block on GPUs (and
        under ``TRITON_INTERPRET=1``), ``index_add_`` (sequential over the copies) on the CPU."""
        acc = torch.promote_types(x.dtype, torch.float32)
        if (x.is_cuda or INTERPRETED) and x.numel() and self.rows:
            flat = x.reshape(x.shape[0], -1)
            out = torch.empty(self.rows, flat.shape[1], dtype=x.dtype, device=x.device)
            block = min(triton.next_power_of_2(flat.shape[1]), 1024)
            grid = (self.rows, triton.cdiv(flat.shape[1], block))
            _sum_copies_kernel[grid](
                flat.contiguous(), self.order, self.offsets, out, flat.shape[1], MOST=self.most, BLOCK=block,
                WIDE=acc == torch.float64,
            )  # fmt: skip
            return out.view(self.rows, *x.shape[1:])
        out = torch.zeros(self.rows, *x.shape[1:], dtype=acc, device=x.device)
        return out.index_add_(0, self.source, x.to(acc)).to(x.dtype)


class _Expand(torch.autograd.Function):
    """``x [rows, ...]`` -> its copies ``[n, ...]`` (``copies.source``); the backward sums each row's copies."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, copies: Copies) -> torch.Tensor:
        ctx.copies = copies
        return x.index_select(0, copies.source)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.copies.sum(grad), None


class _Combine(torch.autograd.Function):
    """The copies ``y [n, ...]`` -> each row's sum ``[rows, ...]``; the backward hands each copy its row's
    gradient."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, copies: Copies) -> torch.Tensor:
        ctx.copies = copies
        return copies.sum(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.index_select(0, ctx.copies.source), None


def expand(x: torch.Tensor, copies: Copies) -> torch.Tensor:
    """Each row of ``x [rows, ...]`` copied as ``copies`` says: ``[n, ...]``; differentiable (:class:`_Expand`)."""
    return _Expand.apply(x, copies)


def combine(y: torch.Tensor, copies: Copies) -> torch.Tensor:
    """The sum of each row's copies in ``y [n, ...]``: ``[rows, ...]``, float32 accumulation rounded once;
    differentiable (:class:`_Combine`)."""
    return _Combine.apply(y, copies)


class _AllToAll(torch.autograd.Function):
    """``torch.distributed.all_to_all_single`` of ``x``'s rows over ``group``: ``sent[r]`` rows to rank ``r``,
    ``received[r]`` from it (host ints), on ``x``'s device (megatron-core's ``all_to_all`` allocates on the current
    CUDA device); the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, sent: list[int], received: list[int]) -> torch.Tensor:
        ctx.group, ctx.sent, ctx.received = group, sent, received
        return _all_to_all(x, group, sent, received)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _all_to_all(grad, ctx.group, ctx.received, ctx.sent), None, None, None


def _all_to_all(x: torch.Tensor, group: Any, sent: list[int], received: list[int]) -> torch.Tensor:
    import torch.distributed as dist

    x = x.contiguous()
    out = x.new_empty(sum(received), *x.shape[1:])
    dist.all_to_all_single(out, x, output_split_sizes=received, input_split_sizes=sent, group=group)
    return out


def all_to_all(x: torch.Tensor, group: Any, *, sent: list[int], received: list[int]) -> torch.Tensor:
    """``x``'s rows exchanged over ``group`` (``sent[r]`` of them to rank ``r``, ``received[r]`` from it);
    differentiable (:class:`_AllToAll`)."""
    return _AllToAll.apply(x, group, sent, received)


def compact(mask: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index [count], position)`` of the ``count`` True entries of the flat bool ``mask [m]`` (``count`` known on
    the host, so no sync): their indices in order, and for each entry its place among them (``count`` where
    False)."""
    flat = mask.reshape(-1)
    position = torch.where(flat, torch.cumsum(flat, 0) - 1, count)
    # Every False entry writes the one spare slot (which of them lands there does not matter: it is cut off).
    index = torch.empty(count + 1, dtype=torch.long, device=flat.device)
    index.scatter_(0, position, torch.arange(flat.numel(), device=flat.device))
    return index[:count], position


# ------------------------------------------------------------------ the dispatcher


@functools.cache
def once_per_rank_dispatcher() -> type:
    """:class:`OncePerRankDispatcher`, megatron-core imported here."""
    import torch.distributed as dist
    from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

    class OncePerRankDispatcher(MoETokenDispatcher):
        """megatron-core's token dispatcher protocol (``dispatch_preprocess``, ``token_dispatch``,
        ``dispatch_postprocess``, ``combine_preprocess``, ``token_combine``, ``combine_postprocess``), each token
        sent once per expert-parallel rank (this module's docstring). Dropless top-k routing over ranks whose experts
        are whole on each (expert tensor parallelism 1); :func:`eligible` says where it applies."""

        def __init__(self, num_local_experts: int, local_expert_indices: list[int], config: Any, pg_collection: Any):
            super().__init__(config=config, pg_collection=pg_collection)
            self.num_local_experts = num_local_experts
            self.local_expert_indices = local_expert_indices
            self.num_experts = config.num_moe_experts
            if self.num_experts != num_local_experts * self.ep_size or self.tp_size != 1:
                raise ValueError(
                    f"OncePerRankDispatcher: {num_local_experts} local experts on each of {self.ep_size} ranks must "
                    f"make --num-experts {self.num_experts}, with expert tensor parallelism 1 (got {self.tp_size})"
                )

        def set_shared_experts(self, shared_experts: Any) -> None:
            raise ValueError("--moe-shared-expert-overlap: the once-per-rank dispatcher computes shared experts apart")

        # ---------------------------------------------------------- dispatch

        def dispatch_preprocess(
            self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            """Counts exchanged (one host sync), each token copied once per rank it goes to: ``(rows [N1, H],
            their gate weights for that rank's experts [N1, L])``."""
            self.hidden_shape = hidden_states.shape
            hidden = hidden_states.reshape(-1, self.hidden_shape[-1])
            tokens, ranks, local = hidden.shape[0], self.ep_size, self.num_local_experts
            by_rank = routing_map.reshape(tokens, ranks, local)
            to_rank = by_rank.any(-1)  # [T, R]
            # What this rank tells each rank r: how many of its tokens each of r's experts gets, and how many rows
            # (tokens) it sends r.
            sent = torch.cat([by_rank.sum(0), to_rank.sum(0).unsqueeze(1)], dim=1).long()  # [R, L + 1]
            received = torch.empty_like(sent)
            if ranks > 1:
                dist.all_to_all_single(received, sent, group=self.ep_group)
            else:
                received.copy_(sent)
            host = torch.stack([sent, received]).cpu()  # the one host sync
            self.input_splits = host[0, :, local].tolist()  # rows sent to each rank
            self.output_splits = host[1, :, local].tolist()  # rows received from each rank
            self.tokens_per_expert = host[1, :, :local].sum(0)  # [L], on the host
            self.sent_mask = by_rank.transpose(0, 1).reshape(ranks * tokens, local)
            if ranks == 1:  # every token stays, once
                self.to_ranks = None
                return hidden, probs
            # Rank-major: the rows for rank 0 (tokens in order), then those for rank 1, ...
            index, position = compact(to_rank.T, sum(self.input_splits))
            topk = self.config.moe_router_topk
            self.to_ranks = Copies.of_slots(to_rank, position.view(ranks, tokens).T, index % tokens, most=topk)
            self.sent_mask = self.sent_mask.index_select(0, index).to(torch.uint8)
            sent_probs = probs.reshape(tokens, ranks, local).transpose(0, 1).reshape(ranks * tokens, local)
            return expand(hidden, self.to_ranks), sent_probs.index_select(0, index)

        def token_dispatch(
            self, hidden_states: torch.Tensor, probs: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            """The rows, their gate weights and their expert masks to the ranks of their experts."""
            if self.ep_size == 1:
                self.received_mask, self.sent_mask = self.sent_mask, None
                return hidden_states, probs
            splits = {"sent": self.input_splits, "received": self.output_splits}
            self.received_mask = _all_to_all(self.sent_mask, self.ep_group, **splits).bool()
            self.sent_mask = None
            return all_to_all(hidden_states, self.ep_group, **splits), all_to_all(probs, self.ep_group, **splits)

        def dispatch_postprocess(
            self, hidden_states: torch.Tensor, probs: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            """Each received row copied once per local expert that chose it, expert-major: ``(rows [M2, H], tokens
            per local expert [L] on the host, their gate weights [M2])``."""
            mask, rows = self.received_mask, hidden_states.shape[0]
            count = int(self.tokens_per_expert.sum())
            index, position = compact(mask.T, count)  # expert-major: expert 0's rows in order, then expert 1's
            local = self.num_local_experts
            topk = self.config.moe_router_topk
            self.to_experts = Copies.of_slots(mask, position.view(local, rows).T, index % rows, most=topk)
            permuted_probs = probs.T.reshape(-1).index_select(0, index)
            self.received_mask = None
            return expand(hidden_states, self.to_experts), self.tokens_per_expert, permuted_probs

        # ---------------------------------------------------------- combine

        def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
            """Each received row's expert outputs summed: ``[M1, H]``."""
            out = combine(hidden_states, self.to_experts)
            self.to_experts = None
            return out

        def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
            """The sums back to the ranks that sent the rows."""
            if self.ep_size == 1:
                return hidden_states
            return all_to_all(hidden_states, self.ep_group, sent=self.output_splits, received=self.input_splits)

        def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
            """Each token's sums from its ranks summed, in the layer's input shape."""
            out = hidden_states if self.to_ranks is None else combine(hidden_states, self.to_ranks)
            self.to_ranks = None
            return out.view(self.hidden_shape)

    return OncePerRankDispatcher


def eligible(config: Any) -> bool:
    """Whether :class:`OncePerRankDispatcher` computes what megatron-core's alltoall dispatcher does for
    ``config``: dropless routing (no capacity padding, no quantization padding of the routes), no shared experts
    overlapped with the dispatch, no fused permutation, experts whole on each rank."""
    return (
        config.moe_token_dispatcher_type == "alltoall"
        and not config.moe_pad_expert_input_to_capacity
        and not config.moe_router_padding_for_quantization
        and not config.moe_shared_expert_overlap
        and not config.moe_permute_fusion
        and (config.expert_tensor_parallel_size or 1) == 1
    )


def use_once_per_rank(model: torch.nn.Module) -> None:
    """Give each megatron-core ``MoELayer`` of ``model`` whose alltoall dispatcher :class:`OncePerRankDispatcher`
    replaces (:func:`eligible`; :data:`DISPATCHER` read now) that dispatcher, over the process groups megatron-core's
    was built with. (Swapped after the build: megatron-core's
    ``TransformerLayer`` hands its process groups only to an MLP whose module is ``MoELayer`` itself, not a
    subclass.)"""
    import types

    from megatron.core.transformer.moe.moe_layer import MoELayer

    if DISPATCHER not in DISPATCHERS:
        raise ValueError(f"megatron_dispatch.DISPATCHER {DISPATCHER!r}: one of {DISPATCHERS}")
    if DISPATCHER != "once_per_rank":
        return
    for layer in model.modules():
        if not isinstance(layer, MoELayer) or not eligible(layer.config):
            continue
        old = layer.token_dispatcher
        groups = types.SimpleNamespace(ep=old.ep_group, expt_tp=old.tp_group, tp_ep=old.tp_ep_group)
        layer.token_dispatcher = once_per_rank_dispatcher()(
            layer.num_local_experts, layer.local_expert_indices, config=layer.config, pg_collection=groups
        )


__all__ = [
    "DISPATCHER",
    "DISPATCHERS",
    "Copies",
    "all_to_all",
    "combine",
    "compact",
    "eligible",
    "expand",
    "use_once_per_rank",
]
