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
from runtime.engines.decode import ATTENTION, decode, inverse_cdf, register_attention, sample_tokens


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


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 4),
    vocab=st.integers(2, 40),
    levels=st.integers(1, 5),
    top_k=st.integers(1, 12),
    top_p=st.sampled_from([0.37, 0.61, 0.93]),
    seed=st.integers(0, 2**31 - 1),
)
def test_top_p_after_a_top_k_pre_pass_keeps_the_sorted_vocabularys_nucleus_under_ties(
    batch, vocab, levels, top_k, top_p, seed
):
    """Logits of a few integer levels tie often, at the k-th value and inside the nucleus: the kept set (top-k with
    the k-th's ties, then top-p in value-then-id order), found from the k largest alone, is the float64 reference's.
    (The top-p levels are not sums of equal tied probabilities, so no boundary is hit exactly.)"""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (batch, vocab), generator=gen).float() * 0.8
    _, _, keep = sample_tokens(logits, temperature=0.7, top_k=top_k, top_p=top_p, generator=gen, nucleus=True)
    allowed = _kept_reference(logits, temperature=0.7, top_k=top_k, top_p=top_p)
    assert torch.equal(keep, allowed > 0)


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
    assert [len(t) for t in out.tokens] == [steps] * len(prompts) and out.finish == ["length"] * len(prompts)
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
    assert out.steps == 40 and [len(t) for t in out.tokens] == [40] * 3
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
    assert out.steps == 4 and [len(t) for t in out.tokens] == [1] * 3 and out.finish == ["stop"] * 3


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
    assert out.steps == 3 and [len(t) for t in out.tokens] == [3, 3] and out.finish == ["abort"] * 2
    assert all(math.isfinite(float(lp.sum())) for lp in out.log_probs)


def _decode(model, prompts, **kw):
    ids, mask = _left_padded(prompts, pad=0)
    args = {"max_new_tokens": 10, "temperature": 0.9, "top_k": -1, "top_p": 1.0, "stop_ids": [2], "pad_id": 0}
    return decode(model, ids, mask, **{**args, **kw})


@settings(max_examples=8, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 6), min_size=2, max_size=7),
    running=st.integers(1, 4),
    check_every=st.sampled_from([1, 3, 8]),
    sampling=st.sampled_from([{}, {"top_k": 5}, {"top_p": 0.8}, {"min_new_tokens": 3}]),
    seed=st.integers(0, 1000),
    lagged=st.booleans(),
)
def test_refill_draws_the_same_tokens_and_log_probs_as_one_batch(
    model, lengths, running, check_every, sampling, seed, lagged
):
    """Per-prompt streams: a prompt's response does not depend on the slot it ran in, its neighbours or refill. The
    tokens are the same; the log-probs agree to float32 rounding (MKL rounds a matmul of fewer than about 9 rows
    differently, and refill runs smaller batches; with as many rows they are bit-exact). ``lagged``: the refilled
    runs' checks decide from the previous check's state (the GPU's default), handing rows back a block later."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    seeds = [seed * 100 + i for i in range(len(prompts))]
    # Stop ids 2, 5 and 9 end about a sixth of the draws: the responses have mixed lengths.
    kw = {"seeds": seeds, "stop_ids": [2, 5, 9], "check_every": check_every, **sampling}
    whole = _decode(model, prompts, **kw)
    refilled = _decode(model, prompts, max_running=running, lagged_checks=lagged, **kw)
    reversed_ = _decode(
        model, prompts[::-1], max_running=running, lagged_checks=lagged, **{**kw, "seeds": seeds[::-1]}
    )
    assert refilled.finish == whole.finish == reversed_.finish[::-1]
    for a, b, c in zip(whole.tokens, refilled.tokens, reversed_.tokens[::-1], strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    for a, b, c in zip(whole.log_probs, refilled.log_probs, reversed_.log_probs[::-1], strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
        torch.testing.assert_close(c, a, rtol=0, atol=1e-6)
    for tokens, finish in zip(whole.tokens, whole.finish, strict=True):
        stops = [i for i, t in enumerate(tokens.tolist()) if t in (2, 5, 9)]
        # A response ends at its first stop id (kept), else at the length limit.
        assert stops == ([len(tokens) - 1] if finish == "stop" else [])
        assert finish == "stop" or len(tokens) == 10
        assert len(tokens) >= min(sampling.get("min_new_tokens", 0) + 1, 10)


def test_refilled_log_probs_equal_a_full_forward_and_the_cache_holds_the_slots_alone(model):
    torch.manual_seed(0)
    prompts = [torch.randint(3, model.config.vocab_size, (n,)).tolist() for n in (3, 1, 5, 2, 4, 6, 2)]
    caches, shapes = [], []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: shapes.append(tuple(out.shape)))
    try:
        out = _decode(model, prompts, max_running=2, stop_ids=[2, 5, 9], max_new_tokens=12, on_cache=caches.append)
    finally:
        hook.remove()
    heads = model.config.num_key_value_heads
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    kept = caches[0].kept_tensors()
    # Per layer a key and a value pool of pages for two rows (groups of one), each a prompt page (width 6) and a
    # response page (12 columns; on the CPU a page holds a row's longest, 16 here), and the scratch page: nothing
    # grows with the 7 prompts, and all come back.
    assert len(kept) == 2 * model.config.num_hidden_layers
    assert {tuple(t.shape) for t in kept} == {(1 + 2 * (1 + 1), heads, 16, head_dim)}
    assert caches[0].pages_in_use() == 0
    assert all(rows <= 2 and q == 1 for rows, q, _ in shapes)
    assert len({len(t) for t in out.tokens}) > 1, "the responses should have mixed lengths"
    with torch.no_grad():
        for prompt, row, lps in zip(prompts, out.tokens, out.log_probs, strict=True):
            logits = model(input_ids=torch.tensor([prompt + row.tolist()])).logits[0, len(prompt) - 1 : -1]
            ref = torch.log_softmax(logits.double() / 0.9, -1).gather(-1, row[:, None]).squeeze(-1)
            torch.testing.assert_close(lps.double(), ref, rtol=0, atol=2e-5)


def test_refill_honours_the_callers_stop_and_an_abort_leaves_waiting_prompts_empty(model):
    prompts = [[5, 6, 7], [8, 9], [10], [11, 12], [4]]
    seeds = list(range(5))
    seen: list[int] = []

    def stopped(rows: list[list[int]]) -> list[bool]:
        seen.append(len(rows))
        return [len(r) >= 4 for r in rows]

    out = _decode(model, prompts, seeds=seeds, stop_ids=[], max_running=2, check_every=2, stopped=stopped)
    # Every row is stopped by the caller at its first check with 4 tokens or more: 4 tokens each, reason "stop".
    assert [len(t) for t in out.tokens] == [4] * 5 and out.finish == ["stop"] * 5
    assert max(seen) <= 2
    calls = []
    out = _decode(
        model, prompts, seeds=seeds, stop_ids=[], max_running=2, is_aborted=lambda: calls.append(1) or len(calls) >= 3
    )
    assert out.steps == 3 and out.finish == ["abort"] * 5
    assert [len(t) for t in out.tokens] == [3, 3, 0, 0, 0]


@pytest.mark.parametrize(("running", "check_every"), [(None, 8), (1, 1), (2, 3), (3, 8)])
def test_refilled_slots_record_each_prompts_own_nuclei(model, running, check_every):
    """Top-p replay under refill: every prompt's nuclei (kept on the device between checks, read back at them) are
    the float64 truncation of a full forward of its own prompt and response, one per token, with the log-prob
    renormalised over it; reversing the prompts (and their seeds) gives each the same tokens and nuclei."""
    torch.manual_seed(3)
    prompts = [torch.randint(3, model.config.vocab_size, (n,)).tolist() for n in (3, 1, 5, 2, 4, 6, 2)]
    seeds = [100 + i for i in range(len(prompts))]
    stops = [2, 5, 9]
    kw = {"top_p": 0.7, "top_k": 6, "stop_ids": stops, "max_new_tokens": 12, "min_new_tokens": 2, "nucleus": True}
    kw |= {"max_running": running, "check_every": check_every}
    out = _decode(model, prompts, seeds=seeds, **kw)
    back = _decode(model, prompts[::-1], seeds=seeds[::-1], **kw)
    assert len({len(t) for t in out.tokens}) > 1, "the responses should have mixed lengths"
    assert [len(n) for n in out.nucleus] == [len(t) for t in out.tokens]
    assert back.nucleus[::-1] == out.nucleus
    with torch.no_grad():
        for prompt, row, lps, nuclei in zip(prompts, out.tokens, out.log_probs, out.nucleus, strict=True):
            logits = model(input_ids=torch.tensor([prompt + row.tolist()])).logits[0, len(prompt) - 1 : -1].double()
            logits[:2, stops] = float("-inf")  # min_new_tokens
            allowed = _kept_reference(logits, temperature=0.9, top_k=6, top_p=0.7)
            assert nuclei == [allowed[k].nonzero()[:, 0].tolist() for k in range(len(row))]
            ref = allowed.gather(-1, row[:, None]).squeeze(-1).log()
            torch.testing.assert_close(lps.double(), ref, rtol=0, atol=2e-5)


def test_an_abort_under_refill_reports_the_nuclei_drawn_so_far(model):
    calls = []
    out = _decode(
        model,
        [[5, 6, 7], [8, 9], [10], [11, 12], [4]],
        seeds=list(range(5)),
        stop_ids=[],
        max_running=2,
        top_p=0.8,
        nucleus=True,
        is_aborted=lambda: calls.append(1) or len(calls) >= 3,
    )
    assert out.finish == ["abort"] * 5 and [len(n) for n in out.nucleus] == [3, 3, 0, 0, 0]
    for tokens, nuclei in zip(out.tokens, out.nucleus, strict=True):
        assert all(int(t) in ids for t, ids in zip(tokens, nuclei, strict=True))


def test_inverse_cdf_never_draws_a_token_of_probability_zero():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.2, 0.0, 0.0, 0.0, 0.8], [0.0, 0.0, 0.0, 0.0, 1.0]])
    u = torch.tensor([0.0, 0.2, 0.999999])
    assert inverse_cdf(probs, u).tolist() == [1, 1, 4] or inverse_cdf(probs, u).tolist() == [1, 4, 4]
    edge = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    for row in probs:
        for x in (0.0, 0.3, 0.5, 0.7, float(edge)):
            token = int(inverse_cdf(row[None], torch.tensor([x]))[0])
            assert row[token] > 0


@settings(max_examples=6, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    per_group=st.integers(2, 4),
    running=st.sampled_from([None, 1, 2]),
    seed=st.integers(0, 1000),
)
def test_a_groups_samples_share_one_prefill_and_draw_as_if_apart(model, lengths, per_group, running, seed):
    """Rows in equal runs of one prompt (a GRPO group) prefill it once and keep its keys once; each sample still
    draws from its own stream, so it gives the tokens it gives with sharing off, and log-probs equal a full forward
    of its row. ``running`` groups at a time (in rows: ``running * per_group``) refill by whole groups."""
    gen = torch.Generator().manual_seed(seed)
    distinct = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    prompts = [p for p in distinct for _ in range(per_group)]
    seeds = [seed * 100 + i for i in range(len(prompts))]
    max_running = None if running is None else running * per_group
    caches, prefill_rows = [], []

    def count_prefill_rows(module, args, out) -> None:
        if caches[0].prefill_rows is not None:
            prefill_rows.append(out.shape[0])

    hook = model.lm_head.register_forward_hook(count_prefill_rows)
    try:
        kw = {"seeds": seeds, "stop_ids": [2, 5, 9], "max_running": max_running, "max_new_tokens": 9}
        shared = _decode(model, prompts, on_cache=caches.append, **kw)
    finally:
        hook.remove()
    apart = _decode(model, prompts, share_prompts=False, **kw)
    assert caches[0].per_group == per_group and sum(prefill_rows) == len(distinct)
    groups_at_once = len(distinct) if running is None else min(running, len(distinct))
    # The pool: the scratch page, one prompt page per running group and one response page per running row.
    pages = 1 + groups_at_once * (1 + per_group)
    page = caches[0].page_size  # on the CPU one page holds a row's longest prompt or response
    assert {tuple(t.shape[:3]) for t in caches[0].kept_tensors()} == {(pages, model.config.num_key_value_heads, page)}
    assert shared.finish == apart.finish
    for a, b in zip(shared.tokens, apart.tokens, strict=True):
        assert torch.equal(a, b)
    with torch.no_grad():
        for prompt, row, lps in zip(prompts, shared.tokens, shared.log_probs, strict=True):
            logits = model(input_ids=torch.tensor([prompt + row.tolist()])).logits[0, len(prompt) - 1 : -1]
            ref = torch.log_softmax(logits.double() / 0.9, -1).gather(-1, row[:, None]).squeeze(-1)
            torch.testing.assert_close(lps.double(), ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize(
    ("per_group", "kv_tokens", "checks"),
    [(1, 16 * 6, {}), (2, 16 * 8, {}), (1, 16 * 6, {"lagged_checks": True, "check_every": 4})],
)
def test_a_small_paged_cache_waits_and_preempts_yet_draws_the_same_tokens(model, per_group, kv_tokens, checks):
    """Pages of 16 columns, responses of 24 (two pages): a cache of ``kv_tokens`` holds fewer rows' longest
    responses than run, so groups wait for pages and a group that runs out is preempted and starts over.
    Per-prompt streams draw each prompt's tokens as with room for all, log-probs to float32 rounding (other batch
    shapes); the pages held never pass the pool and all come back at the end. ``lagged_checks``: checks that decide
    from the previous check's state, a row's pages handed out two blocks ahead (of 4 steps: within a row's first
    page, so that the second is still handed out as it runs)."""
    torch.manual_seed(7)
    distinct = [torch.randint(3, model.config.vocab_size, (n,)).tolist() for n in (3, 1, 5, 2, 4, 6)]
    prompts = [p for p in distinct for _ in range(per_group)]
    seeds = [40 + i for i in range(len(prompts))]
    kw = {"seeds": seeds, "stop_ids": [], "max_new_tokens": 24, "max_running": 4 * per_group, "page_size": 16}
    caches, held, starts = [], [], []

    def watch(cache) -> None:
        caches.append(cache)
        assign_prompt, cover = cache.assign_prompt, cache.cover

        def counted_assign(g: int, length: int) -> bool:
            starts.append(assign_prompt(g, length))
            return starts[-1]

        def counted_cover(row: int, columns: int) -> int:
            short = cover(row, columns)
            held.append(cache.pages_in_use())
            return short

        cache.assign_prompt, cache.cover = counted_assign, counted_cover

    small = _decode(model, prompts, kv_tokens=kv_tokens, on_cache=watch, **checks, **kw)
    roomy = _decode(model, prompts, **kw)
    assert caches[0].pages == 1 + kv_tokens // 16 and max(held) <= kv_tokens // 16
    assert sum(starts) > len(distinct), "some group should have been preempted and started over"
    assert caches[0].pages_in_use() == 0
    assert small.finish == roomy.finish
    for a, b in zip(small.tokens, roomy.tokens, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(small.log_probs, roomy.log_probs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_a_paged_cache_too_small_for_one_group_is_refused(model):
    with pytest.raises(ValueError, match="at least 5 pages of 16 tokens"):
        _decode(model, [[5, 6], [7]], kv_tokens=48, page_size=16, max_new_tokens=40)


def test_rows_that_are_not_equal_runs_of_one_prompt_are_groups_of_one(model):
    caches = []
    out = _decode(model, [[5, 6], [5, 6], [7], [7], [7]], on_cache=caches.append, max_new_tokens=3, stop_ids=[])
    assert caches[0].per_group == 1 and [len(t) for t in out.tokens] == [3] * 5
    caches.clear()
    _decode(model, [[5, 6], [5, 6], [7], [7]], on_cache=caches.append, max_new_tokens=3, stop_ids=[], max_running=1)
    assert caches[0].per_group == 1  # fewer rows than a group: nothing is shared


def test_engine_kv_cache_tokens_is_positive_and_reaches_the_embedded_engine():
    from runtime.config import parse_args
    from runtime.config.schema import ConfigError
    from runtime.engines.hf_engine import HFEngine
    from runtime.engines.registry import engine_kind

    kwargs = engine_kind("hf").kwargs
    assert kwargs(parse_args(["--engine-kv-cache-tokens", "4096"]), "m", 0)["kv_cache_tokens"] == 4096
    assert kwargs(parse_args([]), "m", 0)["kv_cache_tokens"] is None
    with pytest.raises(ConfigError, match="--engine-kv-cache-tokens must be > 0, got 0"):
        parse_args(["--engine-kv-cache-tokens", "0"])
    with pytest.raises(ValueError, match="kv_cache_tokens must be None or an int >= 1"):
        HFEngine("unused", seed=0, kv_cache_tokens=0)
