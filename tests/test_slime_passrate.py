"""--log-passrate: the unbiased pass@k against a brute-force count over every k-subset of a group."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.rollout.passrate import pass_at_k, passrate_metrics
from runtime.rollout.sample import Sample


def brute_force(correct, k):
    subsets = list(itertools.combinations(range(len(correct)), k))
    return sum(any(correct[i] for i in subset) for subset in subsets) / len(subsets)


@given(correct=st.lists(st.booleans(), min_size=1, max_size=9), data=st.data())
def test_pass_at_k_is_the_fraction_of_k_subsets_with_a_correct_sample(correct, data):
    k = data.draw(st.integers(1, len(correct)))
    assert pass_at_k(len(correct), sum(correct), k) == pytest.approx(brute_force(correct, k), abs=1e-12)


def test_passrate_metrics_average_over_groups_at_powers_of_two():
    rewards = [[1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 0, 1, 0, 0.5]]  # 0.5 is not correct
    samples = [Sample(group_index=g, reward=float(r)) for g, row in enumerate(rewards) for r in row]
    metrics = passrate_metrics(samples, prefix="eval/aime")
    assert sorted(metrics) == ["eval/aime/pass@1", "eval/aime/pass@2", "eval/aime/pass@4"]  # 8 > 6 samples
    for k in (1, 2, 4):
        want = sum(brute_force([r == 1 for r in row], k) for row in rewards) / 3
        assert metrics[f"eval/aime/pass@{k}"] == pytest.approx(want)
    assert metrics["eval/aime/pass@1"] == pytest.approx((1 / 6 + 0 + 3 / 6) / 3)


def test_passrate_reads_the_reward_key_and_skips_groups_of_one():
    samples = [Sample(group_index=0, reward={"acc": 1.0, "score": 0.0}), Sample(group_index=0, reward={"acc": 0.0})]
    assert passrate_metrics(samples, prefix="r", reward_key="acc") == {"r/pass@1": 0.5, "r/pass@2": 1.0}
    assert passrate_metrics([Sample(group_index=0, reward=1.0)], prefix="r") == {}
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(2, 1, 3)


def test_reward_category_fractions():
    from runtime.rollout import reward_category_metrics

    rewards = [{"score": 0.0, "cat": "format"}, {"score": 1.0, "cat": "ok"}, {"score": 0.0, "cat": "format"}, 0.5]
    samples = [Sample(group_index=0, reward=r) for r in rewards]
    assert reward_category_metrics(samples, "cat") == {
        "rollout/error_cat/format": 0.5,
        "rollout/error_cat/ok": 0.25,
        "rollout/error_cat/none": 0.25,
    }
    assert reward_category_metrics([], "cat") == {}
