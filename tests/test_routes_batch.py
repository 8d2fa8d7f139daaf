"""Routing replay's batch plumbing: ``build_batch``'s ``ROUTED_EXPERTS`` stays aligned with ``TOKENS`` through every
split and reorder of a batch (micro-batches, data-parallel shards, --balance-data, packing)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.rollout.sample import Sample
from runtime.train.batch import (
    ROUTED_EXPERTS,
    TOKENS,
    balanced_order,
    build_batch,
    merge_shards,
    shard_for_ranks,
)
from runtime.train.packing import micro_batches

LAYERS, TOPK, EXPERTS = 3, 2, 16


def token_routes(token: int, position: int) -> np.ndarray:
    """[LAYERS, TOPK] expert ids that depend on the token and its position: a stand-in for what a router chose."""
    first = (token * 7 + position * 3) % EXPERTS
    return np.array([[(first + layer) % EXPERTS, (first + layer + 1) % EXPERTS] for layer in range(LAYERS)])


def sample(i: int, prompt: int, response: int, *, dtype=np.int32) -> Sample:
    tokens = [(5 * i + 3 * p) % 50 + 4 for p in range(prompt + response)]
    routes = np.stack([token_routes(t, p) for p, t in enumerate(tokens[:-1])]).astype(dtype)
    return Sample(
        group_index=i // 2, index=i, tokens=tokens, response_length=response, reward=1.0, rollout_routed_experts=routes
    )


def assert_aligned(tokens: torch.Tensor, routes: torch.Tensor, lengths: torch.Tensor) -> None:
    """Every real token's row (all but each row's last token) holds its own routes; the rest hold 0..topk-1."""
    assert routes.dtype == torch.int32 and routes.shape[:2] == tokens.shape
    dummy = torch.arange(TOPK, dtype=torch.int32).expand(LAYERS, TOPK)
    for row in range(tokens.shape[0]):
        n = int(lengths[row])
        for p in range(tokens.shape[1]):
            want = torch.from_numpy(token_routes(int(tokens[row, p]), p)).int() if p < n - 1 else dummy
            assert torch.equal(routes[row, p], want), (row, p)


def test_build_batch_lays_routes_out_like_tokens_with_dummy_last_and_padding_rows():
    # Catches: routes shifted by one row (row s = token s + 1), the last token's row left as a real route, padding
    # rows left at 0 (not distinct), int16 input kept as int16.
    samples = [sample(0, 3, 2), sample(1, 2, 4, dtype=np.int16), sample(2, 4, 1)]
    batch = build_batch(samples, pad_token_id=0, routed_experts=True)
    lengths = torch.tensor([len(s.tokens) for s in samples])
    assert_aligned(batch[TOKENS], batch[ROUTED_EXPERTS], lengths)
    assert batch[ROUTED_EXPERTS][2, len(samples[2].tokens) - 1 :].unique().tolist() == list(range(TOPK))


def test_missing_routes_are_refused_by_sample_when_replay_is_on():
    # Catches: a sample without routes silently getting dummy experts everywhere.
    samples = [sample(0, 3, 2), sample(1, 2, 2)]
    samples[1].rollout_routed_experts = None
    with pytest.raises(ValueError, match=r"sample 1 \(index 1\) has no rollout_routed_experts"):
        build_batch(samples, pad_token_id=0, routed_experts=True)
    assert ROUTED_EXPERTS not in build_batch(samples, pad_token_id=0).keys()  # None: only when every sample has them
    assert ROUTED_EXPERTS in build_batch(samples[:1], pad_token_id=0).keys()
    assert ROUTED_EXPERTS not in build_batch(samples[:1], pad_token_id=0, routed_experts=False).keys()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s.rollout_routed_experts[:-1], r"len\(tokens\) - 1 = 4"),
        (lambda s: s.rollout_routed_experts[:, :2], r"\[layers, topk\] \[2, 2\], sample 0 \[3, 2\]"),
        (lambda s: s.rollout_routed_experts.astype(np.float32), "must be integer"),
        (lambda s: -s.rollout_routed_experts - 1, "negative expert id"),
    ],
)
def test_malformed_routes_name_the_sample(change, message):
    # Catches: a short route list padded silently (misaligned rows), layers that differ between samples.
    samples = [sample(0, 3, 2), sample(1, 3, 2)]
    samples[1].rollout_routed_experts = change(samples[1])
    with pytest.raises(ValueError, match=r"sample 1 \(index 1\)"):
        build_batch(samples, pad_token_id=0, routed_experts=True)
    with pytest.raises(ValueError, match=message):
        build_batch(samples, pad_token_id=0, routed_experts=True)


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 4)), min_size=4, max_size=8),
    micro=st.integers(1, 3),
    budget=st.integers(8, 12),
    world=st.sampled_from([1, 2]),
)
def test_routes_follow_their_tokens_through_splits_and_reorders(sizes, micro, budget, world):
    # Catches: a split or reorder that moves TOKENS without ROUTED_EXPERTS (a key dropped by a select, or rebuilt
    # from the unsplit batch), so a row replays another sample's routes.
    sizes = sizes[: len(sizes) // world * world]
    samples = [sample(i, p, r) for i, (p, r) in enumerate(sizes)]
    batch = build_batch(samples, pad_token_id=0, routed_experts=True)
    lengths = torch.tensor([len(s.tokens) for s in samples])
    batch.set("length", lengths)
    order = balanced_order(lengths.tolist(), global_batch_size=len(samples), dp_size=world)
    balanced = batch[order]
    shards = shard_for_ranks(balanced, global_batch_size=len(samples), world_size=world)
    for shard in shards:
        for mb in [*micro_batches(shard, micro_batch_size=micro, max_tokens=None)] + [
            *micro_batches(shard, micro_batch_size=micro, max_tokens=budget)
        ]:
            assert_aligned(mb[TOKENS], mb[ROUTED_EXPERTS], mb["length"])
    merged = merge_shards(shards, global_batch_size=len(samples))
    assert torch.equal(merged[ROUTED_EXPERTS], balanced[ROUTED_EXPERTS])
