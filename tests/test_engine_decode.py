"""The embedded engine's decode loop (``runtime.engines.decode``): sampling, log-probs, the static cache, memory.

``sample_tokens`` is checked against a float64 reference of top-k / top-p truncation, both for the log-prob it
reports (untruncated) and for the distribution it draws from; ``decode`` against full-sequence forwards of the same
model, and for keeping one step of logits at a time.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from runtime.demo import task
from runtime.demo.tiny_model import make_tiny_model
from runtime.engines.decode import ATTENTION, decode, register_attention, sample_tokens


def _kept_reference(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """float64 ``[B, V]`` probabilities of the truncated, renormalised distribution, one row at a time."""
    out = torch.zeros(logits.shape, dtype=torch.float64)
    for b, row in enumerate(logits.double() / temperature):
        probs = torch.softmax(row, -1)
        order = sorted(range(len(row)), key=lambda i: -float(row[i]))
        keep = set(order)
        if 0 < top_k < len(row):
            kth = float(row[order[top_k - 1]])
            keep = {i for i in keep if float(row[i]) >= kth}
        if top_p < 1.0:
            kept = [i for i in order if i in keep]
            mass = probs[kept].sum()
            chosen, before = set(), 0.0
            for i in kept:
                if before > top_p:
                    break
                chosen.add(i)
                before += float(probs[i] / mass)
            keep = chosen
        idx = torch.tensor(sorted(keep))
        out[b, idx] = probs[idx] / probs[idx].sum()
    return out


@given(
    batch=st.integers(1, 4),
    vocab=st.integers(2, 50),
    temperature=st.floats(0.3, 2.0),
    top_k=st.sampled_from([-1, 1, 2, 5]),
    top_p=st.sampled_from([1.0, 0.9, 0.5, 0.1]),
    seed=st.integers(0, 2**31 - 1),
)
def test_sample_reports_the_untruncated_log_prob_of_a_token_it_may_draw(batch, vocab, temperature, top_k, top_p, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen, dtype=torch.float32) * 3
    tokens, log_probs, keep = sample_tokens(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=gen)
    assert keep is None
    full = torch.log_softmax(logits.double() / temperature, -1)
    torch.testing.assert_close(log_probs.double(), full.gather(-1, tokens[:, None]).squeeze(-1), rtol=0, atol=1e-6)
    allowed = _kept_reference(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    assert bool((allowed.gather(-1, tokens[:, None]) > 0).all())


@given(
    batch=st.integers(1, 4),
    vocab=st.integers(2, 50),
    temperature=st.floats(0.3, 2.0),
    top_k=st.sampled_from([-1, 1, 2, 5]),
    top_p=st.sampled_from([1.0, 0.9, 0.5, 0.1]),
    seed=st.integers(0, 2**31 - 1),
)
def test_sample_reports_the_nucleus_and_the_log_prob_over_it(batch, vocab, temperature, top_k, top_p, seed):
    # Top-p replay: the kept set is the truncation's (the drawn token always in it), the log-prob the drawn
    # token's under the renormalised distribution it was drawn from.
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen, dtype=torch.float32) * 3
    tokens, log_probs, keep = sample_tokens(
        logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=gen, nucleus=True
    )
    allowed = _kept_reference(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    assert bool(keep[torch.arange(batch), tokens].all())
    assert torch.equal(keep, allowed > 0)
    torch.testing.assert_close(
        log_probs.double(), allowed.gather(-1, tokens[:, None]).squeeze(-1).log(), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize(("top_k", "top_p"), [(-1, 1.0), (3, 1.0), (-1, 0.7), (4, 0.6)])
def test_sample_draws_from_the_truncated_distribution(top_k, top_p):
    gen = torch.Generator().manual_seed(7)
    row = torch.tensor([2.0, 1.5, 1.2, 0.3, 0.0, -0.5, -1.0, -3.0])
    n = 40_000
    tokens, _, _ = sample_tokens(row.expand(n, -1), temperature=0.9, top_k=top_k, top_p=top_p, generator=gen)
    expected = _kept_reference(row[None], temperature=0.9, top_k=top_k, top_p=top_p)[0]
    counts = torch.bincount(tokens, minlength=len(row)).double()
    assert bool((counts[expected == 0] == 0).all())
    # Pearson's chi-square over the kept tokens, against the 1e-4 quantile for its degrees of freedom (at most 7).
    kept = expected > 0
    chi2 = float(((counts[kept] - n * expected[kept]) ** 2 / (n * expected[kept])).sum())
    assert chi2 < 30.0, (chi2, counts, expected * n)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("tiny"), alphabet=task.ALPHABET, seed=0)
    register_attention()
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    m.set_attn_implementation(ATTENTION)
    return m


def _left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    return ids, mask


@settings(max_examples=10, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    steps=st.integers(1, 7),
    seed=st.integers(0, 1000),
)
def test_decode_log_probs_equal_a_full_forward_of_each_unpadded_row(model, lengths, steps, seed):
    torch.manual_seed(seed)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,)).tolist() for n in lengths]
    ids, mask = _left_padded(prompts, pad=0)
    out = decode(model, ids, mask, max_new_tokens=steps, temperature=0.7, top_k=-1, top_p=1.0, stop_ids=[], pad_id=0)
    assert out.tokens.shape == (len(prompts), steps)
    with torch.no_grad():
        for prompt, row, lps in zip(prompts, out.tokens, out.log_probs, strict=True):
            logits = model(input_ids=torch.tensor([prompt + row.tolist()])).logits[0, len(prompt) - 1 : -1]
            ref = torch.log_softmax(logits.double() / 0.7, -1).gather(-1, row[:, None]).squeeze(-1)
            torch.testing.assert_close(lps.double(), ref, rtol=0, atol=2e-5)


def test_decode_keeps_one_step_of_logits_and_stops_when_every_row_has(model):
    shapes = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: shapes.append(tuple(out.shape)))
    try:
        ids, mask = _left_padded([[5, 6, 7], [8, 9], [10]], pad=0)
        out = decode(model, ids, mask, max_new_tokens=40, temperature=1.0, top_k=-1, top_p=1.0, stop_ids=[], pad_id=0)
    finally:
        hook.remove()
    vocab = model.config.vocab_size
    # Prefill keeps the last position only, then one [B, 1, V] per step: O(B x V), whatever the response length.
    assert shapes == [(3, 1, vocab)] * 40
    assert out.tokens.shape == (3, 40)
    # Every token is a stop token: all rows stop at once and the loop ends at its first check.
    out = decode(
        model,
        ids,
        mask,
        max_new_tokens=40,
        temperature=1.0,
        top_k=-1,
        top_p=1.0,
        stop_ids=list(range(vocab)),
        pad_id=0,
        check_every=4,
    )
    assert out.tokens.shape == (3, 4) and bool((out.tokens[:, 1:] == 0).all())


def test_decode_stops_after_the_step_an_abort_lands_in(model):
    ids, mask = _left_padded([[5, 6, 7], [8, 9]], pad=0)
    calls = []

    def aborted() -> bool:
        calls.append(1)
        return len(calls) >= 3

    out = decode(
        model,
        ids,
        mask,
        max_new_tokens=50,
        temperature=1.0,
        top_k=-1,
        top_p=1.0,
        stop_ids=[],
        pad_id=0,
        is_aborted=aborted,
    )
    assert out.tokens.shape == (2, 3) and math.isfinite(float(out.log_probs.sum()))
