"""The order that lets test modules share a Ray and the gloo ranks (``suite_tools.ray_module_order``,
``ranks_first``, used by tests/conftest.py), and the ranks themselves (``suite_tools.RankPool``)."""

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st
from suite_tools import RankPool, ranks_first, ray_module_order

TWO_CPUS, THREE_CPUS, ONE_GPU = (("num_cpus", 2),), (("num_cpus", 3),), (("num_cpus", 2), ("num_gpus", 1))


@given(st.lists(st.sampled_from([None, TWO_CPUS, THREE_CPUS, ONE_GPU]), max_size=30))
def test_each_ray_starts_once_and_every_module_runs_once_in_its_given_order_within_its_group(keys):
    order, hand_on = ray_module_order(keys)
    assert sorted(order) == list(range(len(keys)))
    plain = [i for i in order if keys[i] is None]
    assert order[: len(plain)] == plain == [i for i, key in enumerate(keys) if key is None]
    ray_part = order[len(plain) :]
    for key in set(filter(None, keys)):
        at = [n for n, i in enumerate(ray_part) if keys[i] == key]
        assert at == list(range(at[0], at[0] + len(at)))  # one contiguous group: its Ray starts once
        assert [ray_part[n] for n in at] == [i for i, k in enumerate(keys) if k == key]
    for n, here in enumerate(order):
        after = order[n + 1] if n + 1 < len(order) else None
        assert hand_on[here] == (keys[here] is not None and after is not None and keys[after] == keys[here])
    starts = sum(1 for n, i in enumerate(ray_part) if n == 0 or not hand_on[ray_part[n - 1]])
    assert starts == len(set(filter(None, keys)))


def test_neighbouring_modules_of_one_size_share_and_a_different_size_starts_its_own():
    # The suite's shape: plain modules between Ray modules of two sizes.
    keys = [TWO_CPUS, None, THREE_CPUS, TWO_CPUS, None, TWO_CPUS]
    order, hand_on = ray_module_order(keys)
    assert order == [1, 4, 0, 3, 5, 2]
    assert hand_on == [True, False, False, True, False, False]


@given(st.lists(st.tuples(st.sampled_from([None, TWO_CPUS, ONE_GPU]), st.booleans()), max_size=30))
def test_the_modules_that_share_gloo_ranks_run_first_together_and_hand_them_on(modules):
    keys, pooled = [k for k, _ in modules], [p for _, p in modules]
    ray_order, _ = ray_module_order(keys)
    order, hand_on = ranks_first(ray_order, keys, pooled)
    assert sorted(order) == list(range(len(keys)))
    first = [i for i, k in enumerate(keys) if k is None and pooled[i]]
    assert order[: len(first)] == first  # the ranks start once, for all of them, in their given order
    # Everything else keeps ray_module_order's order (its Ray groups intact).
    assert order[len(first) :] == [i for i in ray_order if i not in first]
    for n, here in enumerate(order):
        after = order[n + 1] if n + 1 < len(order) else None
        assert hand_on[here] == (pooled[here] and after is not None and pooled[after])


def _rank_ok(rank, folder):
    (folder / f"rank{rank}").write_text(str(rank))


def _rank_raises(rank, folder):
    if rank == 1:
        raise ValueError("rank 1 says no")


def _rank_exits(rank, folder):
    if rank == 0:
        os._exit(3)


def test_a_rank_pool_runs_each_rank_and_fails_a_task_with_the_ranks_own_error_then_starts_afresh(tmp_path):
    # Mutations caught: a pool that returned before every rank answered (rank files missing), that swallowed a rank's
    # exception or a rank's death, or that handed a failed rank on (the task after a failure would hang or fail).
    pool = RankPool(2)
    try:
        pool.run(_rank_ok, tmp_path)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]
        with pytest.raises(AssertionError, match="rank 1 of _rank_raises raised:(.|\n)*ValueError: rank 1 says no"):
            pool.run(_rank_raises, tmp_path)
        with pytest.raises(AssertionError, match="_rank_exits: rank 0 exited with code 3"):
            pool.run(_rank_exits, tmp_path)
        (tmp_path / "again").mkdir()
        pool.run(_rank_ok, tmp_path / "again")
        assert sorted(p.name for p in (tmp_path / "again").iterdir()) == ["rank0", "rank1"]
    finally:
        pool.close()
    assert not pool.alive
