"""rlcore.kernels.nucleus (top-p nucleus replay) against a float64 loop written from the definition, and its
invariants: the whole vocabulary as nucleus is the plain log-prob; probabilities over a nucleus sum to one."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlcore.kernels import nucleus_log_probs, nucleus_mask, pad_nucleus


def _reference(logits: list[list[float]], targets: list[int], nuclei: list[list[int]], temperature: float):
    """log(p_y / sum_{v in nucleus or y} p_v), p = softmax(z / T), one row at a time in float64 Python arithmetic."""
    out = []
    for z, y, ids in zip(logits, targets, nuclei, strict=True):
        w = [math.exp(x / temperature) for x in z]
        kept = set(ids) | {y} if ids else set(range(len(z)))
        out.append(math.log(w[y] / sum(w[v] for v in kept)))
    return out


def test_matches_the_float64_reference_and_slimes_worked_example():
    # SLIME_REFERENCE D12: logits [2, 1, 0], T 1, nucleus {0, 1} (top_p 0.7), token 0: log(0.665 / 0.910) = -0.313.
    got = nucleus_log_probs(
        torch.tensor([[2.0, 1.0, 0.0]], dtype=torch.float64), torch.tensor([0]), torch.tensor([[0, 1]])
    )
    assert got.item() == pytest.approx(-0.3133, abs=1e-4)
    gen = torch.Generator().manual_seed(0)
    n, v = 7, 11
    logits = torch.randn(n, v, generator=gen, dtype=torch.float64) * 3
    targets = torch.randint(0, v, (n,), generator=gen)
    nuclei = [[], [1], [2, 3, 4], list(range(v)), [5, 9], [0], [10, 3, 7, 1]]  # rows 1, 5 may miss their target
    ids = torch.tensor([row + [-1] * (v - len(row)) for row in nuclei])
    got = nucleus_log_probs(logits, targets, ids, temperature=0.7)
    ref = _reference(logits.tolist(), targets.tolist(), nuclei, 0.7)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor(ref, dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_logits_give_float32_close_to_the_reference(dtype):
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(5, 300, generator=gen) * 3).to(dtype)
    targets = torch.randint(0, 300, (5,), generator=gen)
    nuclei = [torch.randperm(300, generator=gen)[: 7 * (i + 1)].tolist() for i in range(5)]
    ids = torch.tensor([row + [-1] * (35 - len(row)) for row in nuclei])
    got = nucleus_log_probs(logits, targets, ids, temperature=0.6)
    ref = _reference(logits.double().tolist(), targets.tolist(), nuclei, 0.6)  # the same rounded logits
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), torch.tensor(ref, dtype=torch.float64), rtol=0, atol=1e-5)


def test_gradient_reaches_only_the_nucleus():
    logits = torch.randn(2, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    nucleus_log_probs(logits, torch.tensor([1, 4]), torch.tensor([[1, 2], [0, -1]])).sum().backward()
    assert torch.equal(logits.grad != 0, torch.tensor([[0, 1, 1, 0, 0, 0], [1, 0, 0, 0, 1, 0]], dtype=torch.bool))


@given(
    st.integers(1, 6),
    st.integers(2, 40),
    st.floats(0.3, 2.0),
    st.integers(0, 2**31 - 1),
)
def test_invariants(n, v, temperature, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=gen, dtype=torch.float64) * 4
    targets = torch.randint(0, v, (n,), generator=gen)
    everything = torch.arange(v).expand(n, v)
    plain = torch.log_softmax(logits / temperature, -1).gather(-1, targets[:, None]).squeeze(-1)
    # The whole vocabulary as nucleus (top_p = 1), and no recorded nucleus, are both the plain log-prob.
    torch.testing.assert_close(nucleus_log_probs(logits, targets, everything, temperature=temperature), plain)
    torch.testing.assert_close(
        nucleus_log_probs(logits, targets, torch.full((n, 3), -1), temperature=temperature), plain
    )
    # A random nucleus: its probabilities (each token of it taken as the target) sum to 1, and each is >= plain.
    size = int(torch.randint(1, v + 1, (), generator=gen))
    ids = torch.stack([torch.randperm(v, generator=gen)[:size] for _ in range(n)])
    ids = torch.cat([ids, torch.full((n, 2), -1)], dim=1)
    got = nucleus_log_probs(logits, targets, ids, temperature=temperature)
    assert bool((got >= plain - 1e-12).all())
    assert bool(nucleus_mask(ids, targets, vocab_size=v)[torch.arange(n), targets].all())  # the target is kept
    for r in range(n):
        members = ids[r][ids[r] >= 0]
        each = nucleus_log_probs(logits[r].expand(size, v), members, ids[r].expand(size, -1), temperature=temperature)
        assert each.exp().sum().item() == pytest.approx(1.0, abs=1e-9)


def test_pad_nucleus_lays_out_slimes_ragged_layout():
    ids = torch.tensor([5, 6, 7, 1, 2], dtype=torch.int32)
    offsets = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    assert pad_nucleus(ids, offsets).tolist() == [[5, 6, 7], [-1, -1, -1], [1, 2, -1]]
    assert pad_nucleus(ids, offsets, width=4).shape == (3, 4)
    with pytest.raises(ValueError, match="offsets must start at 0 and end at len"):
        pad_nucleus(ids, torch.tensor([0, 3, 4]))
    with pytest.raises(ValueError, match="non-decreasing"):
        pad_nucleus(ids, torch.tensor([0, 4, 3, 5]))
    with pytest.raises(ValueError, match="width 2 is below"):
        pad_nucleus(ids, offsets, width=2)


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="nucleus_ids must be in"):
        nucleus_log_probs(torch.zeros(1, 3), torch.tensor([0]), torch.tensor([[3]]))
    with pytest.raises(ValueError, match="differ in rows"):
        nucleus_log_probs(torch.zeros(2, 3), torch.tensor([0, 1]), torch.tensor([[0]]))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        nucleus_log_probs(torch.zeros(1, 3), torch.tensor([0]), torch.tensor([[0]]), temperature=0.0)
