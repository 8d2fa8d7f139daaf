"""The once-per-rank MoE token dispatcher (``runtime.train.backends.megatron_dispatch``): its copies and sums of
rows against float64 references (hypothesis); the whole dispatch and combine, with a toy expert computation, against
a dense float64 reference (each token's sum of its experts' outputs, weighted) and against megatron-core 0.16.1's
``MoEAlltoAllTokenDispatcher``: the same rows in the same order for each expert, the same outputs and gradients; at
EP=1 in this process and at EP=2 over gloo; a MoE layer spec builds it."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("megatron.core")

from runtime.train.backends import megatron_dispatch as md  # noqa: E402

# ------------------------------------------------------------------ copies of rows


@st.composite
def masks(draw):
    """``(mask [rows, slots] bool, seed)``: any rows, some without copies."""
    rows, slots = draw(st.integers(1, 9)), draw(st.integers(1, 6))
    bits = draw(st.lists(st.booleans(), min_size=rows * slots, max_size=rows * slots))
    return torch.tensor(bits, dtype=torch.bool).view(rows, slots), draw(st.integers(0, 2**31 - 1))


def _copies(mask: torch.Tensor) -> md.Copies:
    """The copies of ``mask``'s rows slot-major (slot 0's rows first), as the dispatcher lays them out."""
    rows, slots = mask.shape
    index, position = md.compact(mask.T, int(mask.sum()))
    return md.Copies.of_slots(mask, position.view(slots, rows).T, index % rows)


@given(masks())
def test_compact_lists_the_true_entries_in_order(case):
    mask, _ = case
    index, position = md.compact(mask, int(mask.sum()))
    assert torch.equal(index, mask.reshape(-1).nonzero().squeeze(1))
    assert torch.equal(position[index], torch.arange(index.numel()))
    assert (position[~mask.reshape(-1)] == index.numel()).all()


@given(masks())
def test_expand_and_combine_against_float64_references(case):
    mask, seed = case
    rows, slots = mask.shape
    copies = _copies(mask)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    y = md.expand(x, copies)
    # Slot-major copies of the rows: slot 0's rows (in order), then slot 1's, ...
    row_of = torch.arange(rows).unsqueeze(0).expand(slots, rows)[mask.T]
    assert torch.equal(copies.source, row_of) and torch.equal(y, x[row_of])
    upstream = torch.randn_like(y)
    y.backward(upstream)
    # Each row's gradient: the sum of its copies' (zeros for a row without copies).
    want = torch.zeros_like(x).index_add_(0, row_of, upstream)
    torch.testing.assert_close(x.grad, want, rtol=1e-12, atol=1e-12)
    z = upstream.clone().requires_grad_()
    summed = md.combine(z, copies)
    torch.testing.assert_close(summed, want, rtol=1e-12, atol=1e-12)
    back = torch.randn_like(summed)
    summed.backward(back)
    assert torch.equal(z.grad, back[row_of])


@pytest.mark.skipif(not md.INTERPRETED, reason="the Triton kernel against the CPU path: under TRITON_INTERPRET=1")
@given(masks())
def test_the_kernel_adds_as_the_cpu_path_does(case):
    """The same float32 adds in the same order (each row's copies in place order, from zero): the same bits."""
    mask, seed = case
    copies = _copies(mask)
    y = torch.randn(int(mask.sum()), 5, generator=torch.Generator().manual_seed(seed))
    want = torch.zeros(mask.shape[0], 5).index_add_(0, copies.source, y)
    assert torch.equal(copies.sum(y), want)


def test_copies_under_the_triton_interpreter():
    """This file's copy tests through the Triton kernel, in Triton's interpreter (a fresh process)."""
    if md.INTERPRETED:
        pytest.skip("this process already runs interpreted")
    from suite_tools import run_interpreted

    # Only the tests whose sums take the kernel (compact runs none).
    run_interpreted("test_megatron_dispatch.py", select="expand_and or kernel_adds", expect_passed=2, timeout=600)


@pytest.mark.skipif(md.INTERPRETED, reason="Triton's interpreter rounds float32 to bfloat16 by truncation")
def test_bf16_sums_round_once():
    """In bf16 each row's copies are summed in float32 and rounded once: within half a bf16 step (2^-8 of the value:
    8 bits of mantissa) of the float64 sum, plus float32's rounding of the partial sums."""
    gen = torch.Generator().manual_seed(0)
    rows, slots, hidden = 64, 16, 32
    mask = torch.rand(rows, slots, generator=gen) < 0.4
    copies = _copies(mask)
    y = torch.randn(int(mask.sum()), hidden, generator=gen).bfloat16()
    got = md.combine(y, copies)
    exact = torch.zeros(rows, hidden, dtype=torch.float64).index_add_(0, copies.source, y.double())
    magnitude = torch.zeros(rows, hidden, dtype=torch.float64).index_add_(0, copies.source, y.double().abs())
    assert got.dtype == torch.bfloat16
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + magnitude * slots * 2**-24).all()


# ------------------------------------------------------------------ the dispatcher


def _config(experts: int, topk: int, hidden: int, ep: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=1,
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_router_pre_softmax=True,  # megatron-core's check for top 1 (the router is not run here)
        moe_ffn_hidden_size=hidden,
        moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=ep,
        use_cpu_initialization=True,
        params_dtype=torch.float64,
    )


def _routing(tokens: int, experts: int, topk: int, seed: int, *, skew: bool = False):
    """``(hidden [T, H], routing_map [T, E], probs [T, E])`` in float64; with ``skew`` every token prefers the first
    experts (some ranks and experts get nothing)."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=gen, dtype=torch.float64)
    if skew:
        scores = scores + torch.linspace(2, 0, experts, dtype=torch.float64)
    top = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, top, True)
    probs = torch.zeros(tokens, experts, dtype=torch.float64).scatter(1, top, scores.gather(1, top).softmax(-1))
    return torch.randn(tokens, 1, 4, generator=gen, dtype=torch.float64), routing_map, probs


def _weights(experts: int, hidden: int) -> torch.Tensor:
    return torch.randn(experts, hidden, hidden, generator=torch.Generator().manual_seed(99), dtype=torch.float64)


def _run(dispatcher, hidden, routing_map, probs, weights, first_expert: int, upstream):
    """One dispatch, the local experts (``x @ W_e`` weighted by the gate), one combine, and the backward of
    ``upstream``: ``(output, expert inputs, tokens per expert, grad of hidden, grad of probs)``."""
    hidden = hidden.detach().clone().requires_grad_()
    probs = probs.detach().clone().requires_grad_()
    x, p = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
    x, p = dispatcher.token_dispatch(x, p)
    x, counts, p = dispatcher.dispatch_postprocess(x, p)
    outs, start = [], 0
    for e, n in enumerate(torch.as_tensor(counts).tolist()):
        outs.append((x[start : start + n] @ weights[first_expert + e]) * p[start : start + n, None])
        start += n
    y = dispatcher.combine_preprocess(torch.cat(outs))
    y = dispatcher.token_combine(y)
    out = dispatcher.combine_postprocess(y)
    out.backward(upstream)
    return out.detach(), x.detach(), torch.as_tensor(counts).clone(), hidden.grad, probs.grad


def _dense(hidden, routing_map, probs, weights):
    """Each token's sum over its experts of ``(x @ W_e) * p``: the float64 reference."""
    x = hidden.reshape(hidden.shape[0], -1)
    per_expert = torch.einsum("th,ehk->tek", x, weights)
    return (per_expert * (probs * routing_map)[..., None]).sum(1).view(hidden.shape)


CASES = [(8, 2, 2, 0, False), (12, 4, 3, 1, False), (5, 8, 8, 2, False), (10, 4, 2, 3, True), (1, 4, 1, 4, False)]


def _compare(ep: int, rank: int, pg, tokens: int, experts: int, topk: int, seed: int, skew: bool) -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from runtime.train.backends.megatron_build import _cpu_shims

    config = _config(experts, topk, 4, ep)
    local = experts // ep
    indices = list(range(rank * local, (rank + 1) * local))
    hidden, routing_map, probs = _routing(tokens, experts, topk, seed + 100 * rank, skew=skew)
    weights = _weights(experts, 4)
    upstream = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ours = md.once_per_rank_dispatcher()(local, indices, config=config, pg_collection=pg)
    got = _run(ours, hidden, routing_map, probs, weights, rank * local, upstream)
    with _cpu_shims():  # megatron-core's dispatcher on the CPU (ours needs none)
        theirs = MoEAlltoAllTokenDispatcher(local, indices, config=config, pg_collection=pg)
        want = _run(theirs, hidden, routing_map, probs, weights, rank * local, upstream)
    # Each expert sees the same rows in the same order, with the same gate weights: the same copies, exactly.
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    # The outputs: each token's expert outputs summed in another order (float64).
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[0], _dense(hidden, routing_map, probs, weights), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[3], want[3], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[4], want[4], rtol=1e-12, atol=1e-12)


@pytest.fixture
def one_rank():
    """A one-rank gloo group in this process (megatron-core's dispatcher all-to-alls over it even alone)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield types.SimpleNamespace(ep=dist.group.WORLD, expt_tp=dist.group.WORLD, tp_ep=dist.group.WORLD)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-E{c[1]}-k{c[2]}{'-skew' * c[4]}")
def test_one_rank_equals_megatrons_dispatcher_and_the_dense_sum(case, one_rank):
    _compare(1, 0, one_rank, *case)


def _two_rank_worker(rank: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        own = [dist.new_group([r], backend="gloo") for r in range(2)][rank]
        pg = types.SimpleNamespace(ep=dist.group.WORLD, expt_tp=own, tp_ep=dist.group.WORLD)
        for case in CASES:
            if case[1] % 2 == 0:
                _compare(2, rank, pg, *case)
    finally:
        dist.destroy_process_group()


def test_two_ranks_over_gloo_equal_megatrons_dispatcher_and_the_dense_sum(gloo_ranks):
    """EP=2: each rank's tokens (other routings on each) reach the other rank's experts once per rank; a skewed
    routing leaves experts and a rank without rows."""
    from test_megatron_backend import _free_port

    gloo_ranks.run(_two_rank_worker, _free_port())


@pytest.mark.parametrize("dispatcher", md.DISPATCHERS)
def test_a_built_moe_model_dispatches_as_selected(dispatcher, tmp_path, monkeypatch):
    """Every MoE layer of a built model carries the once-per-rank dispatcher, or megatron-core's own where
    ``DISPATCHER`` says so (the benchmark's baseline); an ineligible configuration keeps megatron-core's."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from test_megatron_backend import trainer
    from test_megatron_moe import _job, save_qwen3_moe

    from runtime.train.roles import ACTOR

    monkeypatch.setattr(md, "DISPATCHER", dispatcher)
    path = save_qwen3_moe(tmp_path / "m")
    mega = trainer("megatron", path, _job(tmp_path), roles=(ACTOR,))
    try:
        layers = [m for m in mega.model.modules() if isinstance(m, MoELayer)]
        want = md.once_per_rank_dispatcher() if dispatcher == "once_per_rank" else MoEAlltoAllTokenDispatcher
        assert layers and all(type(m.token_dispatcher) is want for m in layers)
        if dispatcher == "once_per_rank":
            config = layers[0].config
            assert md.eligible(config)
            monkeypatch.setattr(config, "moe_pad_expert_input_to_capacity", True)
            assert not md.eligible(config)
    finally:
        mega.shutdown()
