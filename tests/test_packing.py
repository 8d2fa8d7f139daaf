"""runtime.train.packing's helpers shared by the torch and Megatron backends: the token budget of a pass, and undoing
the regrouping of --use-dynamic-batch-size on a pass's concatenated outputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from runtime.config import TrainConfig
from runtime.train.packing import in_row_order, pack_by_tokens, token_budget


def test_token_budget_of_a_log_prob_pass_prefers_its_own_flag():
    both = TrainConfig(max_tokens_per_gpu=100, log_probs_max_tokens_per_gpu=300)
    assert token_budget(both, log_probs=True) == 300
    assert token_budget(both, log_probs=False) == 100
    train_only = TrainConfig(max_tokens_per_gpu=100)
    assert token_budget(train_only, log_probs=True) == 100
    assert token_budget(TrainConfig(), log_probs=True) is None


def test_in_row_order_puts_each_row_back_and_none_keeps_the_order():
    values = torch.tensor([[10.0], [20.0], [30.0], [40.0]])
    # Rows 1 and 3 ran in the first micro-batch, 0 and 2 in the second.
    assert torch.equal(in_row_order(values, [[1, 3], [0, 2]]), torch.tensor([[30.0], [10.0], [40.0], [20.0]]))
    assert in_row_order(values, None) is values


@given(st.lists(st.integers(1, 30), min_size=1, max_size=25), st.integers(30, 90), st.integers(1, 6))
def test_in_row_order_undoes_pack_by_tokens(lengths, budget, width):
    rows = torch.arange(len(lengths) * width, dtype=torch.float64).view(len(lengths), width)
    groups = pack_by_tokens(lengths, max_tokens=budget)
    regrouped = torch.cat([rows[torch.tensor(g)] for g in groups])
    assert torch.equal(in_row_order(regrouped, groups), rows)


def test_in_row_order_refuses_rows_that_do_not_match_the_groups():
    with pytest.raises(IndexError):
        in_row_order(torch.zeros(2, 3), [[0, 1, 2]])
