"""The MoE token permutation by gathers (``runtime.train.backends.megatron_permute``) against megatron-core 0.16.1's
own ``permute`` and ``unpermute`` on random top-k routings: the same outputs and indices, the same gradients (float64:
the same sums in another order), each token's copies summed back; what it does not compute handed to
megatron-core's; a routing map with a token of another expert count refused; installed into the dispatchers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("megatron.core")

from runtime.train.backends import megatron_permute as mp  # noqa: E402

MEGATRON_PERMUTE, MEGATRON_UNPERMUTE = mp._megatron()


@st.composite
def routings(draw):
    """``(tokens [T, H] float64, routing_map [T, E] bool with k per row, probs [T, E] float64)``."""
    rows, experts, hidden = draw(st.integers(1, 12)), draw(st.integers(2, 8)), draw(st.integers(1, 5))
    k = draw(st.integers(1, min(experts, 3)))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scores = torch.rand(rows, experts, generator=gen, dtype=torch.float64)
    routing_map = torch.zeros(rows, experts, dtype=torch.bool).scatter(1, scores.topk(k, dim=1).indices, True)
    tokens = torch.randn(rows, hidden, generator=gen, dtype=torch.float64)
    return tokens, routing_map, scores.softmax(-1), k


def _grads(fn, x, upstream):
    x = x.detach().clone().requires_grad_()
    out = fn(x)
    out.backward(upstream)
    return out.detach(), x.grad


@given(routings())
def test_permute_equals_megatrons_with_its_gradient(case):
    tokens, routing_map, probs, k = case
    n = tokens.shape[0] * k
    got = mp.permute(tokens, routing_map, probs, num_out_tokens=n)
    want = MEGATRON_PERMUTE(tokens, routing_map, probs, num_out_tokens=n)
    # The same rows gathered in the same order (index_select both): equal by construction.
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    upstream = torch.randn(n, tokens.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    out, grad = _grads(lambda x: mp.permute(x, routing_map, num_out_tokens=n)[0], tokens, upstream)
    _, want_grad = _grads(lambda x: MEGATRON_PERMUTE(x, routing_map, num_out_tokens=n)[0], tokens, upstream)
    # Each token's k copies' gradients summed, in another order (float64).
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)


@given(routings())
def test_unpermute_equals_megatrons_with_its_gradient(case):
    tokens, routing_map, _, k = case
    rows, hidden = tokens.shape
    permuted, _, sorted_indices = mp.permute(tokens, routing_map, num_out_tokens=rows * k)
    assert hasattr(sorted_indices, mp._GATHERED)  # unpermute takes the gathers for these indices
    rows_out = torch.randn(rows * k, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(rows))
    upstream = torch.randn(rows, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(hidden))
    got, grad = _grads(
        lambda x: mp.unpermute(x, sorted_indices, tokens.shape, routing_map=routing_map), rows_out, upstream
    )
    want, want_grad = _grads(
        lambda x: MEGATRON_UNPERMUTE(x, sorted_indices, tokens.shape, routing_map=routing_map), rows_out, upstream
    )
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)  # k terms summed in another order
    assert torch.equal(grad, want_grad)  # the gradient gathered to each copy: the same rows
    # Each token's k copies of itself sum back to k times the token.
    torch.testing.assert_close(mp.unpermute(permuted, sorted_indices, tokens.shape), k * tokens)


def test_bf16_sums_round_once():
    """In bf16 each token's copies are summed in float32 and rounded once: within half a bf16 step (at most 2^-8 of
    the value: 8 bits of mantissa) of the float64 sum, plus float32's rounding of the partial sums."""
    gen = torch.Generator().manual_seed(0)
    rows, experts, k, hidden = 64, 16, 8, 32
    scores = torch.rand(rows, experts, generator=gen)
    routing_map = torch.zeros(rows, experts, dtype=torch.bool).scatter(1, scores.topk(k, dim=1).indices, True)
    _, _, sorted_indices = mp.permute(torch.zeros(rows, 1), routing_map, num_out_tokens=rows * k)
    rows_out = torch.randn(rows * k, hidden, generator=gen).bfloat16()
    got = mp.unpermute(rows_out, sorted_indices, torch.Size((rows, hidden)))
    exact = torch.zeros(rows, hidden, dtype=torch.float64).index_add_(0, sorted_indices, rows_out.double())
    magnitude = torch.zeros(rows, hidden, dtype=torch.float64).index_add_(0, sorted_indices, rows_out.double().abs())
    assert got.dtype == torch.bfloat16
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + magnitude * k * 2**-24).all()


def test_a_token_with_another_expert_count_is_refused():
    routing_map = torch.tensor([[True, True, True], [True, False, False]])  # 4 copies of 2 tokens, as 3 and 1
    with pytest.raises(RuntimeError, match="other than --moe-router-topk"):
        mp.permute(torch.randn(2, 4), routing_map, num_out_tokens=4)


def test_what_it_does_not_compute_is_megatrons():
    """Probabilities merged in ``unpermute``, drop-and-pad, and the allgather dispatcher's uneven copies (its count
    a tensor: a token may have none of this rank's experts) go to megatron-core's."""
    gen = torch.Generator().manual_seed(1)
    tokens, probs = torch.randn(6, 3, generator=gen), torch.rand(6, 4, generator=gen)
    routing_map = torch.zeros(6, 4, dtype=torch.bool).scatter(1, probs.topk(2, dim=1).indices, True)
    permuted, _, sorted_indices = mp.permute(tokens, routing_map, num_out_tokens=12)
    merged = mp.unpermute(permuted, sorted_indices, tokens.shape, probs=probs, routing_map=routing_map)
    want = MEGATRON_UNPERMUTE(permuted, sorted_indices, tokens.shape, probs=probs, routing_map=routing_map)
    assert torch.equal(merged, want)
    capacity_map = torch.ones(6, 4, dtype=torch.bool)
    got = mp.permute(tokens, capacity_map, num_out_tokens=8, drop_and_pad=True)
    assert torch.equal(got[0], MEGATRON_PERMUTE(tokens, capacity_map, num_out_tokens=8, drop_and_pad=True)[0])
    # This rank's 2 experts of 4 (top 2 each): tokens with 2, 1 or 0 of them, 6 copies of 6 tokens in all.
    local = torch.tensor([[1, 1], [1, 0], [0, 0], [1, 1], [0, 1], [0, 0]], dtype=torch.bool)
    count = local.sum()
    uneven, _, indices = mp.permute(tokens, local, num_out_tokens=count)
    assert not hasattr(indices, mp._GATHERED)
    assert torch.equal(uneven, MEGATRON_PERMUTE(tokens, local, num_out_tokens=count)[0])
    back = mp.unpermute(uneven, indices, tokens.shape)
    assert torch.equal(back, MEGATRON_UNPERMUTE(uneven, indices, tokens.shape))


def test_a_moe_layer_spec_installs_them_into_the_dispatchers():
    from megatron.core.transformer.moe import token_dispatcher

    from runtime.train.backends.megatron_attention import local_layer_spec

    token_dispatcher.permute, token_dispatcher.unpermute = MEGATRON_PERMUTE, MEGATRON_UNPERMUTE  # as imported
    local_layer_spec(attention_backend="auto", qk_layernorm=True, normalization="RMSNorm", num_experts=4)
    assert token_dispatcher.permute is mp.permute and token_dispatcher.unpermute is mp.unpermute
