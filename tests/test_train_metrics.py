"""runtime.train.metrics: token means add up over micro-batches and average over steps; maxima stay maxima."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from runtime.train.metrics import add_step, is_max_metric, sums_and_maxima

NAMES = ["pg_loss", "ratio_max", "clipfrac", "tis_weight_max"]
values = st.floats(-1e6, 1e6, allow_nan=False)
metric_dicts = st.dictionaries(st.sampled_from(NAMES), values, min_size=1)


def test_which_metrics_are_maxima():
    assert is_max_metric("ratio_max") and is_max_metric("tis_weight_max")
    assert not is_max_metric("ratio_mean") and not is_max_metric("max_len") and not is_max_metric("pg_loss")
    # A hook's metric that only looks like a maximum by its name is summed, as its maker did not declare it one.
    assert not is_max_metric("custom_max")


def test_every_maximum_rl_loss_reports_is_declared():
    """rl_loss's metrics that are maxima over tokens equal the largest masked token value; each is in MAX_METRICS,
    and no declared name is missing from what rl_loss (with TIS on) reports."""
    from tensordict import TensorDict

    from rlcore import keys
    from rlcore.losses import MAX_METRICS, LossConfig, rl_loss

    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    old = -torch.rand(2, 3, generator=g) - 0.1
    td = TensorDict(
        {
            keys.MASK: mask,
            keys.LOG_PROBS: old + 0.1 * torch.randn(2, 3, generator=g),
            keys.OLD_LOG_PROBS: old,
            keys.ROLLOUT_LOG_PROBS: old + 0.1 * torch.randn(2, 3, generator=g),
            keys.ADVANTAGES: torch.randn(2, 3, generator=g),
        },
        batch_size=[2],
    )
    _, metrics = rl_loss(td, LossConfig(use_tis=True, tis_clip=10.0))
    ratio = torch.exp(td[keys.LOG_PROBS] - old)[mask]
    assert float(metrics["ratio_max"]) == pytest.approx(float(ratio.max()), rel=1e-6)
    assert MAX_METRICS <= set(metrics.keys())


@given(st.lists(metric_dicts, max_size=6))
def test_micro_batches_sum_their_means_and_keep_the_largest_maximum(micro_batches):
    sums, maxima = sums_and_maxima(micro_batches)
    names = {name for metrics in micro_batches for name in metrics}
    assert set(sums) | set(maxima) == names and not set(sums) & set(maxima)
    for name in names:
        seen = [metrics[name] for metrics in micro_batches if name in metrics]
        if is_max_metric(name):
            assert maxima[name] == max(seen)
        else:
            assert sums[name] == pytest.approx(math.fsum(seen), rel=1e-9, abs=1e-6)


def test_micro_batch_values_may_be_tensors():
    sums, maxima = sums_and_maxima([{"pg_loss": torch.tensor(0.5), "ratio_max": torch.tensor(1.5)}, {"pg_loss": 1}])
    assert sums == {"pg_loss": 1.5} and maxima == {"ratio_max": 1.5}


@given(st.lists(st.fixed_dictionaries({name: values for name in NAMES}), min_size=1, max_size=6))
def test_steps_average_means_and_keep_maxima(steps):
    totals: dict[str, float] = {}
    for step_metrics in steps:
        add_step(totals, step_metrics, steps=len(steps))
    for name in NAMES:
        seen = [step[name] for step in steps]
        if is_max_metric(name):
            assert totals[name] == max(seen)
        else:
            assert totals[name] == pytest.approx(math.fsum(seen) / len(seen), rel=1e-9, abs=1e-6)
