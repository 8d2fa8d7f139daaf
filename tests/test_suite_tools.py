"""The order that lets test modules share a Ray (``suite_tools.ray_module_order``, used by tests/conftest.py)."""

from hypothesis import given
from hypothesis import strategies as st
from suite_tools import ray_module_order

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
