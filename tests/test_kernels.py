"""rlcore.kernels against the float64 reference: forward, backward (log-prob and entropy gradients), in-place backward,
fused linear, vocab-parallel (2-process gloo) and argument errors.

The same tests exercise whichever backend CPU tensors take in this process: the chunked torch fallback normally, the
Triton kernels in Triton's interpreter when TRITON_INTERPRET=1 was set before triton was imported
(``test_kernels_interpret.py`` runs this file that way in a subprocess).
"""

import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.kernels import _torch_ops, linear_logprobs_entropy, logprobs_entropy, reference
from rlcore.kernels import linear as linear_module
from rlcore.kernels import logprobs as logprobs_module
from rlcore.kernels._stats import Partial, finalize

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Gradients are rounded to the input dtype; forward outputs are float32 whatever the input. float32: p = exp(z - lse)
# carries the rounding of z - lse, ~|z| * 2**-24 relative; the "mixed" rows reach |z| ~ 150 at temperature 0.6, so
# 1e-5 failed for 7 of 300 random upstream gradients there (2.5e-5 seen); 4e-5 passed all 300.
GRAD_RTOL = {torch.float32: 4e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}


@pytest.fixture(autouse=True)
def _seeded_global_rng():
    """Tests draw upstream gradients from torch's global generator: seed it, so no result depends on test order."""
    torch.manual_seed(0)


def make_logits(n: int, v: int, dtype: torch.dtype, *, seed: int, kind: str = "normal") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=gen) * 3
    if kind == "peaked":
        x[torch.arange(n), torch.randint(0, v, (n,), generator=gen)] += 60.0
    elif kind == "flat":
        x = torch.full((n, v), 1.5) + 1e-3 * x
    elif kind == "mixed" and n >= 3:
        x[0, torch.randint(0, v, (1,), generator=gen)] += 60.0
        x[1] = 0.25
        x[2] *= 10
    return x.to(dtype)


def reference_step(logits, targets, g_lp, g_ent, *, temperature=1.0, with_entropy=True):
    x = logits.detach().double().requires_grad_()
    lp, ent = reference.logprobs_entropy(x, targets, temperature=temperature, with_entropy=with_entropy)
    outputs, grads = [lp], [g_lp.double()]
    if with_entropy:
        outputs.append(ent)
        grads.append(g_ent.double())
    (grad,) = torch.autograd.grad(outputs, x, grads)
    return lp, ent, grad


def assert_grad_close(actual, expected, dtype):
    rtol = GRAD_RTOL[dtype]
    scale = float(expected.abs().max()) or 1.0
    # Plus the dtype's smallest normal number: gradients of a very peaked row can underflow in float16.
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=rtol * scale + torch.finfo(dtype).tiny)


def assert_forward_close(actual, expected):
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual.double(), expected, rtol=2e-5, atol=2e-5)


def test_backend_follows_environment():
    assert logprobs_module.INTERPRETED == (os.environ.get("TRITON_INTERPRET", "0") == "1")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "v"), [(1, 1), (1, 300), (7, 129), (5, 300), (3, 1000)])
@pytest.mark.parametrize("kind", ["normal", "peaked", "flat", "mixed"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_entropy_matches_reference(dtype, n, v, kind, temperature):
    logits = make_logits(n, v, dtype, seed=n * v + len(kind), kind=kind).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(v))
    g_lp, g_ent = torch.randn(n), torch.randn(n)
    lp, ent = logprobs_entropy(logits, targets, temperature=temperature)
    ref_lp, ref_ent, ref_grad = reference_step(logits, targets, g_lp, g_ent, temperature=temperature)
    assert_forward_close(lp, ref_lp)
    assert_forward_close(ent, ref_ent)
    (grad,) = torch.autograd.grad([lp, ent], logits, [g_lp, g_ent])
    assert grad.dtype == dtype
    assert_grad_close(grad, ref_grad, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_inplace_backward_writes_into_logits(dtype):
    n, v = 4, 300
    base = make_logits(n, v, dtype, seed=3)
    logits = base.clone().requires_grad_()
    targets = torch.tensor([0, 299, 150, 7])
    g_lp, g_ent = torch.randn(n), torch.randn(n)
    _, _, ref_grad = reference_step(base, targets, g_lp, g_ent, temperature=0.8)
    lp, ent = logprobs_entropy(logits, targets, temperature=0.8, inplace_backward=True)
    (grad,) = torch.autograd.grad([lp, ent], logits, [g_lp, g_ent])
    assert grad.data_ptr() == logits.data_ptr()
    assert_grad_close(logits.detach(), ref_grad, dtype)


def test_inplace_backward_runs_once():
    logits = make_logits(2, 50, torch.float32, seed=4).requires_grad_()
    lp, _ = logprobs_entropy(logits, torch.tensor([1, 2]), inplace_backward=True)
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward once"):
        lp.sum().backward()


@pytest.mark.parametrize("targets_dtype", [torch.int64, torch.int32])
def test_strided_inputs(targets_dtype):
    """A strided logits view (copied to row-major) and strided targets give the reference values."""
    wide = make_logits(4, 600, torch.bfloat16, seed=8)
    logits = wide[:, ::2].requires_grad_()
    targets = torch.tensor([5, 0, 17, 0, 299, 0, 42, 0], dtype=targets_dtype)[::2]
    g_lp, g_ent = torch.randn(4), torch.randn(4)
    lp, ent = logprobs_entropy(logits, targets, temperature=1.3)
    ref_lp, ref_ent, ref_grad = reference_step(logits, targets, g_lp, g_ent, temperature=1.3)
    assert_forward_close(lp, ref_lp)
    assert_forward_close(ent, ref_ent)
    assert_grad_close(torch.autograd.grad([lp, ent], logits, [g_lp, g_ent])[0], ref_grad, torch.bfloat16)


def test_single_output_gradients():
    n, v = 3, 257
    logits = make_logits(n, v, torch.float32, seed=5).requires_grad_()
    targets = torch.tensor([1, 256, 100])
    zeros, g = torch.zeros(n), torch.randn(n)
    lp, ent = logprobs_entropy(logits, targets)
    (grad_ent_only,) = torch.autograd.grad(ent, logits, g, retain_graph=True)
    (grad_lp_only,) = torch.autograd.grad(lp, logits, g)
    assert_grad_close(grad_ent_only, reference_step(logits, targets, zeros, g)[2], torch.float32)
    assert_grad_close(grad_lp_only, reference_step(logits, targets, g, zeros)[2], torch.float32)


def test_without_entropy():
    n, v = 5, 300
    logits = make_logits(n, v, torch.bfloat16, seed=9).requires_grad_()
    targets = torch.randint(0, v, (n,))
    g = torch.randn(n)
    lp, ent = logprobs_entropy(logits, targets, with_entropy=False)
    assert ent is None
    ref_lp, _, ref_grad = reference_step(logits, targets, g, g, with_entropy=False)
    assert_forward_close(lp, ref_lp)
    assert_grad_close(torch.autograd.grad(lp, logits, g)[0], ref_grad, torch.bfloat16)


def test_minus_inf_logits_are_excluded():
    logits = make_logits(2, 300, torch.float32, seed=1)
    logits[:, 100:200] = float("-inf")
    logits.requires_grad_()
    targets = torch.tensor([5, 250])
    g_lp, g_ent = torch.randn(2), torch.randn(2)
    lp, ent = logprobs_entropy(logits, targets)
    ref_lp, ref_ent, ref_grad = reference_step(logits, targets, g_lp, g_ent)
    assert_forward_close(lp, ref_lp)
    assert_forward_close(ent, ref_ent)
    assert_grad_close(torch.autograd.grad([lp, ent], logits, [g_lp, g_ent])[0], ref_grad, torch.float32)


def test_chunked_fallback_across_row_chunks(monkeypatch):
    monkeypatch.setattr(_torch_ops, "_CHUNK_ELEMENTS", 600)
    n, v = 7, 250
    logits = make_logits(n, v, torch.bfloat16, seed=11).requires_grad_()
    targets = torch.randint(0, v, (n,))
    g_lp, g_ent = torch.randn(n), torch.randn(n)
    m, s, _, _ = _torch_ops.partial_stats(logits.detach(), targets, 0, 1.0, True)
    lse = m + s.log()
    torch.testing.assert_close(lse.double(), torch.logsumexp(logits.double(), -1), rtol=1e-6, atol=1e-6)
    lp, ent = logprobs_entropy(logits, targets)
    ref_lp, ref_ent, ref_grad = reference_step(logits, targets, g_lp, g_ent)
    assert_forward_close(lp, ref_lp)
    assert_forward_close(ent, ref_ent)
    assert_grad_close(torch.autograd.grad([lp, ent], logits, [g_lp, g_ent])[0], ref_grad, torch.bfloat16)


@given(
    n=st.integers(1, 6),
    v=st.integers(1, 300),
    temperature=st.floats(0.3, 3.0),
    shift=st.floats(-50.0, 50.0),
    seed=st.integers(0, 2**16),
)
def test_invariants(n, v, temperature, shift, seed):
    """Shift invariance, log-probs <= 0, 0 <= entropy <= log V, and agreement with the reference."""
    logits = make_logits(n, v, torch.float32, seed=seed)
    targets = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(seed))
    lp, ent = logprobs_entropy(logits, targets, temperature=temperature)
    lp_shifted, ent_shifted = logprobs_entropy(logits + shift, targets, temperature=temperature)
    torch.testing.assert_close(lp_shifted, lp, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ent_shifted, ent, rtol=1e-4, atol=1e-4)
    assert bool((lp <= 1e-6).all())
    assert bool((ent >= -1e-5).all()) and bool((ent <= torch.log(torch.tensor(float(v))) + 1e-5).all())
    ref_lp, ref_ent = reference.logprobs_entropy(logits.double(), targets, temperature=temperature)
    assert_forward_close(lp, ref_lp)
    assert_forward_close(ent, ref_ent)


@given(
    n=st.integers(1, 4),
    cuts=st.lists(st.integers(1, 299), max_size=4, unique=True),
    with_entropy=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_accumulated_pieces_equal_whole(n, cuts, with_entropy, seed):
    """Statistics accumulated over any column split of the vocabulary equal those of the whole row."""
    v = 300
    logits = make_logits(n, v, torch.float32, seed=seed, kind="mixed")
    targets = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(seed))
    partial_stats, _ = logprobs_module.backend_ops(logits)
    whole = finalize(Partial(*partial_stats(logits, targets, 0, 0.8, with_entropy)))
    bounds = [0, *sorted(cuts), v]
    packed = None
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        packed = partial_stats(logits[:, start:stop].contiguous(), targets, start, 0.8, with_entropy, packed)
    pieces = finalize(Partial(*packed))
    # Without entropy the first-moment statistics are not accumulated, so only lse and the target logit count.
    fields = ("lse", "mu", "entropy", "zt") if with_entropy else ("lse", "zt")
    for field in fields:
        torch.testing.assert_close(getattr(pieces, field), getattr(whole, field), rtol=1e-5, atol=1e-5)


@given(
    rows=st.integers(1, 100_000),
    vocab=st.integers(1, 300_000),
    block=st.sampled_from([128, 1024, 4096, 8192]),
    programs=st.integers(1, 1 << 15),
)
def test_segments_cover_each_row_once(rows, vocab, block, programs):
    """A split pass covers every column of a row exactly once, in whole blocks, and splits only short batches."""
    segments, segment = logprobs_module._segments(rows, vocab, block, programs)
    assert segments >= 1 and segment % block == 0
    assert (segments - 1) * segment < vocab <= segments * segment
    if rows >= programs:
        assert segments == 1
    if segments > 1:
        assert rows * segments <= 2 * programs and segment >= logprobs_module._MIN_SEGMENT_BLOCKS * block


@pytest.mark.skipif(
    not logprobs_module.INTERPRETED, reason="the CPU's torch ops do not split rows; test_kernels_interpret runs this"
)
@settings(deadline=None)
@given(
    n=st.integers(1, 6),
    v=st.integers(1, 700),
    inplace=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rows_split_into_segments_equal_whole_rows(n, v, inplace, seed):
    """Statistics and gradients of a pass whose rows are split into column segments (each its own program, merged
    afterwards) equal those of one program per row: the split is an implementation detail of short batches. Also
    when the statistics are accumulated onto a previous vocabulary piece's, whose target logits count."""
    wide = make_logits(n, 2 * v, torch.float32, seed=seed, kind="mixed")
    targets = torch.randint(0, 2 * v, (n,), generator=torch.Generator().manual_seed(seed))
    logits = wide[:, v:].contiguous()  # vocabulary ids [v, 2v); [0, v) is the previous piece
    g_lp, g_ent = torch.randn(n, dtype=torch.float64).float(), torch.randn(n, dtype=torch.float64).float()
    partial_stats, _ = logprobs_module.backend_ops(logits)
    results = []
    # One program per row; two segments of several blocks each; one block per segment.
    for programs in (1, 2 * n, 1 << 20):
        with mock.patch.dict(logprobs_module.SPLIT_PROGRAMS, stats=programs, grad=programs):
            previous = partial_stats(wide[:, :v].contiguous(), targets, 0, 1.0, True)
            accumulated = partial_stats(logits, targets, v, 1.0, True, previous)
            alone = partial_stats(logits, targets % v, 0, 1.0, True)
            x = logits.clone().requires_grad_()
            log_probs, entropy = logprobs_entropy(x, targets % v, inplace_backward=inplace)
            (grad,) = torch.autograd.grad([log_probs, entropy], x, [g_lp, g_ent])
        results.append((accumulated, alone, log_probs, entropy, grad))
    for split in results[1:]:
        for whole, part in zip(results[0], split, strict=True):
            torch.testing.assert_close(part, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("n", "h", "v", "chunk", "stash_chunks"),
    # The last two have N >= H: head pieces kept in the weight gradient's buffer, five of them then 15 recomputed
    # pieces without a stash, four then four recomputed then a two-piece tail with one. N = 12 or 13 just above H
    # gives more head pieces than N = 40 and 33 did, in a fifth of the interpreter's time (its cost grows with N).
    [(1, 8, 300, 128, 0), (5, 16, 257, 64, 2), (4, 8, 300, 1000, 1), (12, 8, 300, 16, 0), (13, 8, 301, 24, 2)],
)
def test_linear_matches_reference(dtype, n, h, v, chunk, stash_chunks):
    gen = torch.Generator().manual_seed(n + h + v)
    hidden = torch.randn(n, h, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) * 0.7).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen)
    g_lp, g_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    stash_bytes = stash_chunks * n * chunk * hidden.element_size()
    lp, ent = linear_logprobs_entropy(hidden, weight, targets, temperature=0.9, chunk=chunk, stash_bytes=stash_bytes)
    grad_h, grad_w = torch.autograd.grad([lp, ent], [hidden, weight], [g_lp, g_ent])
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref_lp, ref_ent = reference.linear_logprobs_entropy(h64, w64, targets, temperature=0.9)
    ref_h, ref_w = torch.autograd.grad([ref_lp, ref_ent], [h64, w64], [g_lp.double(), g_ent.double()])
    # bf16 logits are rounded once by the matmul: a few bf16 ulps of slack on every output.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(lp.double(), ref_lp, rtol=tol, atol=tol)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=tol, atol=tol)
    for got, want in ((grad_h, ref_h), (grad_w, ref_w)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * float(want.abs().max()))


@settings(deadline=None)
@given(
    rows=st.integers(0, 70),
    hidden_size=st.integers(1, 40),
    vocab=st.integers(1, 400),
    element_size=st.sampled_from([2, 4]),
    chunk=st.integers(1, 200),
    stash_bytes=st.integers(0, 60_000),
    keep=st.booleans(),
    head=st.booleans(),
    split=st.sampled_from([1, 2]),
)
def test_plan_pieces_invariants(rows, hidden_size, vocab, element_size, chunk, stash_bytes, keep, head, split):
    """Both orders cover the vocabulary once; head pieces fit the gradient buffer and are never overwritten before
    they are read; the tail fits ``stash_bytes``; working pieces fit the budget."""
    plan = linear_module.plan_pieces(
        rows, hidden_size, vocab, element_size, chunk=chunk, stash_bytes=stash_bytes, keep=keep, head=head, split=split
    )
    for order in plan:
        assert sorted((p.start, p.stop) for p in order) == [(p.start, p.stop) for p in plan.forward]
    cover = sorted((p.start, p.stop) for p in plan.forward)
    assert cover[0][0] == 0 and cover[-1][1] == vocab
    assert all(a < b for a, b in cover) and all(x[1] == y[0] for x, y in zip(cover, cover[1:], strict=False))
    kinds = [p.kept for p in plan.backward]
    assert kinds == sorted(kinds, key=["head", "tail", ""].index), "backward: head, then tail, then recomputed"
    heads = [p for p in plan.backward if p.kept == "head"]
    tails = [p for p in plan.backward if p.kept == "tail"]
    if not keep:
        assert not heads and not tails
    if not head or not rows:
        assert not heads
    width = max(1, max(chunk, stash_bytes // (rows * element_size) if rows else vocab) // split)
    for p in plan.backward:
        if not p.kept:
            assert p.stop - p.start <= width
        assert p.start % min(128, width) == 0 and (p.stop == vocab or p.stop % min(128, width) == 0)
    # Head pieces: consecutive from column 0, disjoint in the [V, H] buffer, and piece j's gradient rows
    # (elements [H * start, H * stop)) end before its own logits, so they never land on logits still to be read.
    end = 0
    for p in heads:
        assert p.start == end
        end = p.stop
        assert hidden_size * p.stop <= p.offset
        assert p.offset + rows * (p.stop - p.start) <= vocab * hidden_size
    for x, y in zip(heads, heads[1:], strict=False):
        assert y.offset >= x.offset + rows * (x.stop - x.start)
    # Tail: the last columns, within the stash budget, in at most `split` pieces.
    tail_cols = sum(p.stop - p.start for p in tails)
    assert rows * element_size * tail_cols <= stash_bytes or not rows
    assert not tails or max(p.stop for p in tails) == vocab
    assert len(tails) <= split


def test_head_pieces_use_the_gradient_buffer():
    """At N = 4H (a long sequence batch) the buffer holds about (V - chunk) / 4 columns besides the first piece."""
    plan = linear_module.plan_pieces(16384, 4096, 151936, 2, chunk=12288, stash_bytes=0, keep=True, head=True, split=1)
    kept = sum(p.stop - p.start for p in plan.forward if p.kept == "head")
    assert 34_000 <= kept <= (151936 - 12288) // 4


def test_linear_weight_gradient_not_requested():
    """The weight requires a gradient (its buffer keeps head logits) but only hidden's is asked for; and a frozen
    weight (no head pieces at all)."""
    n, h, v = 12, 8, 300  # N > H: four head pieces with the first weight
    gen = torch.Generator().manual_seed(21)
    hidden = torch.randn(n, h, generator=gen).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen)
    g_lp, g_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    for weight in (torch.randn(v, h, generator=gen).requires_grad_(), torch.randn(v, h, generator=gen)):
        lp, ent = linear_logprobs_entropy(hidden, weight, targets, chunk=32, stash_bytes=0)
        (grad_h,) = torch.autograd.grad([lp, ent], [hidden], [g_lp, g_ent])
        h64 = hidden.detach().double().requires_grad_()
        ref_lp, ref_ent = reference.linear_logprobs_entropy(h64, weight.detach().double(), targets)
        (ref_h,) = torch.autograd.grad([ref_lp, ref_ent], [h64], [g_lp.double(), g_ent.double()])
        assert_grad_close(grad_h, ref_h, torch.float32)


def test_linear_without_entropy_and_without_grad():
    hidden, weight = torch.randn(3, 8), torch.randn(300, 8)
    targets = torch.tensor([0, 299, 42])
    lp, ent = linear_logprobs_entropy(hidden, weight, targets, with_entropy=False, chunk=100)
    assert ent is None
    assert_forward_close(lp, reference.linear_logprobs_entropy(hidden.double(), weight.double(), targets)[0])


def test_logits_unchanged_without_inplace_backward():
    """The default backward writes d(logits) into a fresh buffer: the logits read by anything else stay intact."""
    logits = make_logits(4, 300, torch.bfloat16, seed=12).requires_grad_()
    before = logits.detach().clone()
    lp, ent = logprobs_entropy(logits, torch.tensor([0, 299, 150, 7]), inplace_backward=False)
    (grad,) = torch.autograd.grad([lp, ent], logits, [torch.randn(4), torch.randn(4)])
    assert grad.data_ptr() != logits.data_ptr()
    torch.testing.assert_close(logits.detach(), before, rtol=0, atol=0)


@pytest.mark.parametrize("stash_chunks", [0, 2, 5])
def test_linear_gradients_without_entropy(stash_chunks):
    n, h, v, chunk = 4, 8, 300, 64
    gen = torch.Generator().manual_seed(13)
    hidden = torch.randn(n, h, generator=gen).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) * 0.7).requires_grad_()
    targets = torch.tensor([0, 299, 64, 127])
    g_lp = torch.randn(n, generator=gen)
    stash_bytes = stash_chunks * n * chunk * hidden.element_size()
    lp, ent = linear_logprobs_entropy(
        hidden, weight, targets, temperature=1.2, with_entropy=False, chunk=chunk, stash_bytes=stash_bytes
    )
    assert ent is None
    grad_h, grad_w = torch.autograd.grad(lp, [hidden, weight], g_lp)
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref_lp, _ = reference.linear_logprobs_entropy(h64, w64, targets, temperature=1.2, with_entropy=False)
    ref_h, ref_w = torch.autograd.grad(ref_lp, [h64, w64], g_lp.double())
    assert_forward_close(lp, ref_lp)
    assert_grad_close(grad_h, ref_h, torch.float32)
    assert_grad_close(grad_w, ref_w, torch.float32)


@pytest.mark.parametrize("stash_chunks", [0, 2, 5])
@pytest.mark.parametrize("n", [3, 12])
def test_linear_backward_twice_with_retain_graph(stash_chunks, n):
    """A second backward recomputes the pieces the first one overwrote (the head ones too, whose buffer the first
    backward handed out as the weight gradient): correct gradients both times. At N = 12 the stash sizes give two head
    pieces, two head pieces and a two-piece tail, and a tail alone."""
    h, v, chunk = 8, 300, 64
    gen = torch.Generator().manual_seed(14)
    hidden = torch.randn(n, h, generator=gen).requires_grad_()
    weight = torch.randn(v, h, generator=gen).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen)
    g_lp, g_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    stash_bytes = stash_chunks * n * chunk * hidden.element_size()
    lp, ent = linear_logprobs_entropy(hidden, weight, targets, chunk=chunk, stash_bytes=stash_bytes)
    first = torch.autograd.grad([lp, ent], [hidden, weight], [g_lp, g_ent], retain_graph=True)
    second = torch.autograd.grad([lp, ent], [hidden, weight], [g_lp, g_ent])
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref_lp, ref_ent = reference.linear_logprobs_entropy(h64, w64, targets)
    ref = torch.autograd.grad([ref_lp, ref_ent], [h64, w64], [g_lp.double(), g_ent.double()])
    for got_first, got_second, want in zip(first, second, ref, strict=True):
        assert_grad_close(got_first, want, torch.float32)
        assert_grad_close(got_second, want, torch.float32)


def test_all_minus_inf_row_gives_nan_not_an_error():
    """Documented degenerate input: a row with no finite logit has no distribution; only that row is NaN."""
    logits = make_logits(2, 50, torch.float32, seed=15)
    logits[1] = float("-inf")
    lp, ent = logprobs_entropy(logits, torch.tensor([3, 4]))
    assert torch.isfinite(lp[0]) and torch.isfinite(ent[0])
    assert torch.isnan(lp[1]) and torch.isnan(ent[1])


def _vocab_parallel_worker(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        group = dist.new_group([0, 1])
        n, v_local, h = 5, 150, 8
        v = v_local * world
        shard = slice(rank * v_local, (rank + 1) * v_local)
        gen = torch.Generator().manual_seed(0)  # the same full tensors on every rank
        full = make_logits(n, v, torch.bfloat16, seed=21, kind="mixed")
        targets = torch.tensor([0, v_local - 1, v_local, v - 1, 77])
        g_lp, g_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        logits = full[:, shard].clone().requires_grad_()
        lp, ent = logprobs_entropy(logits, targets, temperature=0.7, group=group)
        ref_lp, ref_ent, ref_grad = reference_step(full, targets, g_lp, g_ent, temperature=0.7)
        assert_forward_close(lp, ref_lp)
        assert_forward_close(ent, ref_ent)
        (grad,) = torch.autograd.grad([lp, ent], logits, [g_lp, g_ent])
        assert_grad_close(grad, ref_grad[:, shard], torch.bfloat16)

        hidden = torch.randn(n, h, generator=gen).requires_grad_()
        weight_full = torch.randn(v, h, generator=gen)
        weight = weight_full[shard].clone().requires_grad_()
        lp, ent = linear_logprobs_entropy(hidden, weight, targets, group=group, chunk=64, stash_bytes=256)
        grad_h, grad_w = torch.autograd.grad([lp, ent], [hidden, weight], [g_lp, g_ent])
        dist.all_reduce(grad_h, group=group)
        h64, w64 = hidden.detach().double().requires_grad_(), weight_full.double().requires_grad_()
        ref_lp, ref_ent = reference.linear_logprobs_entropy(h64, w64, targets)
        ref_h, ref_w = torch.autograd.grad([ref_lp, ref_ent], [h64, w64], [g_lp.double(), g_ent.double()])
        assert_forward_close(lp, ref_lp)
        assert_forward_close(ent, ref_ent)
        assert_grad_close(grad_h, ref_h, torch.float32)
        assert_grad_close(grad_w, ref_w[shard], torch.float32)

        with pytest.raises(ValueError, match=r"\[0, 300\)"):
            logprobs_entropy(logits, torch.tensor([0, 1, 2, 3, v]), group=group)
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_two_ranks(tmp_path):
    mp.spawn(_vocab_parallel_worker, args=(2, str(tmp_path / "store")), nprocs=2, join=True)


@pytest.mark.parametrize(
    ("logits", "targets", "kwargs", "error", "match"),
    [
        (torch.randn(3, 10), torch.tensor([0, 1, 10]), {}, ValueError, r"\[0, 10\).*10"),
        (torch.randn(3, 10), torch.tensor([0, -1, 2]), {}, ValueError, "targets must lie in"),
        (torch.randn(3, 10), torch.tensor([0, 1]), {}, ValueError, r"targets has shape \(2,\).*3 rows"),
        (torch.randn(3, 10), torch.tensor([0.0, 1.0, 2.0]), {}, TypeError, "targets must have dtype"),
        (torch.randn(3, 10), torch.tensor([[0, 1, 2]]), {}, ValueError, "targets must have 1 dimension"),
        (torch.randn(30), torch.tensor([0]), {}, ValueError, r"logits must have 2 dimension.*\(30,\)"),
        (torch.randn(3, 10).double(), torch.tensor([0, 1, 2]), {}, TypeError, "logits must be bfloat16"),
        (torch.randint(0, 5, (3, 10)), torch.tensor([0, 1, 2]), {}, TypeError, "logits must be bfloat16"),
        ([[0.0]], torch.tensor([0]), {}, TypeError, "logits must be a torch.Tensor"),
        (torch.randn(3, 10), torch.tensor([0, 1, 2]), {"temperature": 0.0}, ValueError, "temperature"),
        (torch.randn(3, 10), torch.tensor([0, 1, 2]), {"temperature": float("nan")}, ValueError, "temperature"),
    ],
)
def test_logprobs_entropy_bad_input(logits, targets, kwargs, error, match):
    with pytest.raises(error, match=match):
        logprobs_entropy(logits, targets, **kwargs)


@pytest.mark.parametrize(
    ("hidden", "weight", "kwargs", "error", "match"),
    [
        (torch.randn(3, 8), torch.randn(20, 7), {}, ValueError, r"weight \(20, 7\).*hidden \(3, 8\)"),
        (torch.randn(3, 8), torch.randn(20, 8).bfloat16(), {}, TypeError, "weight"),
        (torch.randn(3, 8), torch.randn(20, 8), {"chunk": 0}, ValueError, "chunk"),
        (torch.randn(3, 8), torch.randn(20, 8), {"stash_bytes": -1}, ValueError, "stash_bytes"),
        (torch.randn(3, 8), torch.randn(20, 8), {"targets": torch.tensor([0, 1, 20])}, ValueError, r"\[0, 20\)"),
    ],
)
def test_linear_bad_input(hidden, weight, kwargs, error, match):
    targets = kwargs.pop("targets", torch.tensor([0, 1, 2]))
    with pytest.raises(error, match=match):
        linear_logprobs_entropy(hidden, weight, targets, **kwargs)


def test_group_without_distributed():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized here")
    with pytest.raises(ValueError, match="not initialized"):
        logprobs_entropy(torch.randn(2, 4), torch.tensor([0, 1]), group=object())
