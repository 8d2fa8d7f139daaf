"""Data-parallel advantages: group baselines over the whole batch, the rest of ``compute`` on row shards.

The driver runs ``sequence_advantages`` on the whole batch and each trainer rank runs ``compute`` on its shard of the
rows; a shard may hold part of a group only. The shards' results must be the rows of ``compute`` on the whole batch.
"""

import math
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from rlcore import keys
from rlcore.advantages import (
    ESTIMATORS,
    GROUP_BASELINE_ESTIMATORS,
    AdvantageConfig,
    compute,
    grpo,
    rloo,
    sequence_advantages,
    shard_keys,
)
from rlcore.losses.kl import KL_KINDS

OUTPUTS = (keys.ADVANTAGES, keys.RETURNS)
NEEDS_PAIRS = ("grpo", "gspo", "rloo")  # an unbiased std or a leave-one-out mean needs two samples per group


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rollout_batch(group_sizes: list[int], length: int, *, seed: int, first_token_valid: bool = False) -> TensorDict:
    """A float32 batch whose groups (ids arbitrary, rows interleaved) have the given sizes; NaN at masked positions.

    The mask has holes and right padding, and rows with no valid token at all unless ``first_token_valid``.
    """
    g = _gen(seed)
    group_ids = torch.tensor([7 * i - 5 for i, size in enumerate(group_sizes) for _ in range(size)])
    group_ids = group_ids[torch.randperm(group_ids.numel(), generator=g)]
    batch = group_ids.numel()
    mask = torch.rand(batch, length, generator=g) < 0.8
    mask &= torch.arange(length) < torch.randint(0, length + 1, (batch, 1), generator=g)
    mask[:, 0] |= first_token_valid

    def tokens(shift: float = 0.0) -> torch.Tensor:
        return torch.where(mask, torch.randn(batch, length, generator=g) + shift, math.nan)

    policy = tokens(-1.0)
    return TensorDict(
        {
            keys.MASK: mask,
            keys.OLD_LOG_PROBS: policy,
            keys.REF_LOG_PROBS: torch.where(mask, policy + 0.3 * torch.randn(batch, length, generator=g), math.nan),
            keys.TEACHER_LOG_PROBS: tokens(-1.0),
            keys.VALUES: tokens(),
            keys.REWARDS: torch.randn(batch, generator=g),
            keys.GROUP_IDS: group_ids,
        },
        batch_size=[batch],
    )


def sharded(whole: TensorDict, order: torch.Tensor, cuts: list[int], cfg: AdvantageConfig) -> TensorDict:
    """``compute`` on each shard of the rows of ``sequence_advantages(whole)`` taken in ``order``, concatenated."""
    rows = sequence_advantages(whole, cfg)[order]
    bounds = [0, *cuts, len(order)]
    shards = [compute(rows[start:stop], cfg) for start, stop in zip(bounds, bounds[1:], strict=False)]
    return torch.cat(shards)


def assert_same_rows(actual: TensorDict, expected: TensorDict) -> None:
    for key in OUTPUTS:
        assert actual[key].dtype == torch.float32
        assert torch.equal(actual[key], expected[key]), (key, (actual[key] - expected[key]).abs().max())


# ----------------------------------------------------------------------------- row-split invariance (hypothesis)


@st.composite
def split_cases(draw):
    estimator = draw(st.sampled_from(ESTIMATORS))
    std_normalize = draw(st.booleans())
    smallest = 2 if estimator in NEEDS_PAIRS and (estimator == "rloo" or std_normalize) else 1
    sizes = draw(st.lists(st.integers(smallest, 5), min_size=1, max_size=5))
    whole = rollout_batch(sizes, draw(st.integers(1, 12)), seed=draw(st.integers(0, 2**16)))
    batch = whole.batch_size[0]
    order = torch.randperm(batch, generator=_gen(draw(st.integers(0, 2**16))))
    cuts = sorted(draw(st.lists(st.integers(0, batch), max_size=4)))  # equal cuts give empty shards
    kl_coef = draw(st.sampled_from([0.0, 0.05, 0.3]))
    cfg = AdvantageConfig(
        estimator=estimator,
        kl_coef=kl_coef,
        kl_kind=draw(st.sampled_from(KL_KINDS)),
        std_normalize=std_normalize,
        gamma=draw(st.sampled_from([1.0, 0.9])),
        lam=draw(st.sampled_from([1.0, 0.95])),
    )
    return whole, order, cuts, cfg


@given(case=split_cases())
def test_compute_on_row_shards_equals_compute_on_the_whole_batch(case):
    whole, order, cuts, cfg = case
    assert_same_rows(sharded(whole, order, cuts, cfg), compute(whole, cfg)[order])


@pytest.mark.parametrize("estimator", GROUP_BASELINE_ESTIMATORS)
def test_a_group_cut_in_two_gets_the_baseline_of_the_whole_group(estimator):
    whole = rollout_batch([4, 3], 6, seed=3)
    whole[keys.GROUP_IDS] = torch.tensor([1, 1, 2, 1, 2, 1, 2])
    whole[keys.REWARDS] = torch.tensor([1.0, 0.0, 0.5, 3.0, -1.0, 1.0, 2.0])
    cfg = AdvantageConfig(estimator=estimator, kl_coef=0.1)
    expected = compute(whole, cfg)
    assert_same_rows(sharded(whole, torch.arange(7), [2], cfg), expected)
    # Without the whole-batch baselines, the shard [2:] sees only part of group 1 and gets other advantages.
    alone = compute(whole[2:], cfg)[keys.ADVANTAGES]
    assert not torch.allclose(alone[1], expected[keys.ADVANTAGES][3])


def test_sequence_advantages_sets_the_group_part_and_leaves_its_input_alone():
    whole = rollout_batch([3, 2, 4], 5, seed=1)
    rewards, group_ids = whole[keys.REWARDS], whole[keys.GROUP_IDS]
    before = whole.clone()
    expected = {
        "grpo": grpo(rewards, group_ids),
        "gspo": grpo(rewards, group_ids, eps=1e-3),
        "dr_grpo": grpo(rewards, group_ids, std_normalize=False),
        "rloo": rloo(rewards, group_ids),
        "reinforce_plus_plus_baseline": grpo(rewards, group_ids, std_normalize=False),
    }
    assert set(expected) == set(GROUP_BASELINE_ESTIMATORS)
    for estimator in ESTIMATORS:
        out = sequence_advantages(
            whole, AdvantageConfig(estimator=estimator, eps=1e-3 if estimator == "gspo" else 1e-6)
        )
        assert out is not whole
        assert set(out.keys()) - set(whole.keys()) == ({keys.SEQUENCE_ADVANTAGES} if estimator in expected else set())
        if estimator in expected:
            assert out[keys.SEQUENCE_ADVANTAGES].dtype == torch.float32
            assert torch.equal(out[keys.SEQUENCE_ADVANTAGES], expected[estimator])
    assert set(whole.keys()) == set(before.keys())
    for key, value in before.items():
        torch.testing.assert_close(whole[key], value, equal_nan=True)


def test_sequence_advantages_reads_only_rewards_and_group_ids():
    whole = rollout_batch([2, 3], 4, seed=2)
    for estimator in GROUP_BASELINE_ESTIMATORS:
        cfg = AdvantageConfig(estimator=estimator)
        only = sequence_advantages(whole.select(keys.REWARDS, keys.GROUP_IDS), cfg)
        assert torch.equal(only[keys.SEQUENCE_ADVANTAGES], sequence_advantages(whole, cfg)[keys.SEQUENCE_ADVANTAGES])


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_a_shard_with_only_its_shard_keys_computes_the_same(estimator, kl_coef):
    cfg = AdvantageConfig(estimator=estimator, kl_coef=kl_coef, whiten=True)
    rows = sequence_advantages(rollout_batch([3, 2, 2], 6, seed=4), cfg)
    assert_same_rows(compute(rows.select(*shard_keys(cfg)), cfg), compute(rows, cfg))


# ----------------------------------------------------------------------------- two ranks, global whitening (gloo)

TWO_RANK_ROWS = 7
TWO_RANK_CUT = 3  # rows 0..2 on rank 0, 3..6 on rank 1: both groups have samples on both ranks


def _two_rank_batch() -> TensorDict:
    whole = rollout_batch([4, 3], 8, seed=11, first_token_valid=True)  # every rank has valid tokens to whiten
    whole[keys.GROUP_IDS] = torch.tensor([5, 9, 5, 9, 5, 9, 5])
    return whole


def _two_rank_configs() -> list[AdvantageConfig]:
    return [AdvantageConfig(estimator=name, kl_coef=0.1, kl_kind="k3", whiten=True, gamma=0.9) for name in ESTIMATORS]


def _two_rank_worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        whole = _two_rank_batch()
        rows = slice(0, TWO_RANK_CUT) if rank == 0 else slice(TWO_RANK_CUT, TWO_RANK_ROWS)
        results = {}
        for cfg in _two_rank_configs():
            # The driver's part, then this rank's shard of the rows: one trip per step.
            shard = sequence_advantages(whole, cfg)[rows]
            out = compute(shard, cfg, group=dist.group.WORLD)
            results[cfg.estimator] = {key: out[key] for key in OUTPUTS}
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_with_a_split_group_and_global_whitening_equal_one_rank(tmp_path):
    whole = _two_rank_batch()
    assert set(whole[keys.GROUP_IDS][:TWO_RANK_CUT].tolist()) == set(whole[keys.GROUP_IDS][TWO_RANK_CUT:].tolist())
    # fork, as test_whiten_over_a_gloo_group_equals_whitening_the_concatenation: spawned children re-import torch and
    # tensordict (about 10 s of this test's time on a 2-core box, against 1 s forked). The workers set one intra-op
    # thread first, so the parent's OpenMP pool is never touched after the fork.
    mp.start_processes(_two_rank_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True, start_method="fork")
    shards = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for cfg in _two_rank_configs():
        expected = compute(whole, cfg)
        for key in OUTPUTS:
            got = torch.cat([shard[cfg.estimator][key] for shard in shards])
            torch.testing.assert_close(got, expected[key], rtol=1e-6, atol=1e-6, msg=f"{cfg.estimator} {key}")
    # Whitening is global: local moments would give other numbers on rank 0.
    cfg = _two_rank_configs()[0]
    local = compute(sequence_advantages(whole, cfg)[:TWO_RANK_CUT], cfg)[keys.ADVANTAGES]
    assert not torch.allclose(local, shards[0][cfg.estimator][keys.ADVANTAGES], rtol=1e-3, atol=1e-3)


# ----------------------------------------------------------------------------- bad input


def _with_sequence_advantages(value) -> TensorDict:
    rows = sequence_advantages(rollout_batch([2, 2], 3, seed=5), AdvantageConfig())
    rows.set(keys.SEQUENCE_ADVANTAGES, value)
    return rows


BAD_INPUTS = {
    "2-d": (lambda: _with_sequence_advantages(torch.zeros(4, 2)), ValueError, r"sequence_advantages.*\(4, 2\)"),
    "int": (lambda: _with_sequence_advantages(torch.zeros(4, dtype=torch.int64)), TypeError, r"sequence_adv.*int64"),
    "bool": (lambda: _with_sequence_advantages(torch.ones(4, dtype=torch.bool)), TypeError, r"sequence_adv.*bool"),
    "nan": (
        lambda: _with_sequence_advantages(torch.tensor([0.0, 1.0, math.nan, 0.0])),
        ValueError,
        r"sequence_advantages.*non-finite.*index 2",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_compute_rejects_a_bad_sequence_advantages(case):
    make, error, pattern = BAD_INPUTS[case]
    with pytest.raises(error, match=pattern):
        compute(make(), AdvantageConfig())


def test_sequence_advantages_rejects_bad_arguments():
    whole = rollout_batch([2, 2], 3, seed=6)
    with pytest.raises(TypeError, match=r"td must be a TensorDict"):
        sequence_advantages(whole.to_dict(), AdvantageConfig())
    with pytest.raises(TypeError, match=r"cfg must be an AdvantageConfig"):
        sequence_advantages(whole, {"estimator": "grpo"})
    with pytest.raises(ValueError, match=r"'rloo' needs key 'group_ids'"):
        sequence_advantages(whole.exclude(keys.GROUP_IDS), AdvantageConfig(estimator="rloo"))
    with pytest.raises(ValueError, match=r"batch_size \[B\], got \(4, 3\)"):
        sequence_advantages(TensorDict({keys.MASK: whole[keys.MASK]}, [4, 3]), AdvantageConfig())
    with pytest.raises(ValueError, match=r"group_ids.*1 sample"):
        sequence_advantages(whole.set(keys.GROUP_IDS, torch.tensor([1, 1, 1, 2])), AdvantageConfig())
    with pytest.raises(TypeError, match=r"cfg must be an AdvantageConfig"):
        shard_keys("grpo")
