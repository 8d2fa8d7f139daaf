"""rlcore.kernels.linear_rl_loss against the float64 reference (``rl_loss`` on materialised logits, by autograd): loss,
metrics and both gradients over every policy loss, mismatch mode and level, KL kind, entropy bonus and aggregation
mode; the automatic fallback; split invariance under a global Normalizer; vocab-parallel (2-process gloo); errors.

Like ``test_kernels.py``, CPU tensors take the chunked torch backend here, and the Triton kernels in Triton's
interpreter when TRITON_INTERPRET=1 was set before triton was imported (``test_fused_loss_interpret.py`` runs this
file that way in a subprocess). Shapes are small and awkward: V = 129 or 300 (not multiples of the interpreter's
128-column block), chunks of a few rows so that every call runs several chunks, and GSPO both with chunks cut along
sequences and in its two-phase form (a sequence longer than a chunk).
"""

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from rlcore import keys
from rlcore.kernels import linear_logprobs_entropy, linear_rl_loss, reference
from rlcore.kernels.fused_loss import fusable, plan_chunks
from rlcore.losses import AGG_MODES, KL_KINDS, MISMATCH_LEVELS, MISMATCH_MODES, LossConfig, Normalizer, rl_loss

# float32 inputs against float64: the loss and the gradients carry float32 rounding of logits, softmax and matmuls
# (seen up to ~1e-6 relative to the largest gradient entry); 2e-5 leaves room and still catches any wrong term
# (a missing factor or sign moves a gradient by O(1) of its scale).
RTOL = 2e-5


def make_case(seed: int, batch: int, seq_len: int, hidden_size: int, vocab: int, *, with_old: bool = True):
    """Hidden, weight, targets and a batch whose old / rollout / reference log-probs lie near the policy's own, so
    ratios straddle every clip range; masked positions hold NaN (they must reach nothing)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch * seq_len, hidden_size, generator=g)
    weight = torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5 * 3
    targets = torch.randint(0, vocab, (batch * seq_len,), generator=g)
    mask = torch.rand(batch, seq_len, generator=g) < 0.75
    mask[0, 0] = True
    with torch.no_grad():
        log_probs = reference.linear_logprobs_entropy(hidden, weight, targets)[0].view(batch, seq_len)

    def near(scale: float) -> torch.Tensor:
        return torch.where(mask, log_probs + scale * torch.randn(batch, seq_len, generator=g), float("nan"))

    tensors = {
        keys.MASK: mask,
        keys.ADVANTAGES: torch.where(mask, torch.randn(batch, seq_len, generator=g), float("nan")),
        keys.ROLLOUT_LOG_PROBS: near(0.4),
        keys.REF_LOG_PROBS: near(0.6),
    }
    if with_old:
        tensors[keys.OLD_LOG_PROBS] = near(0.25)
    return hidden, weight, targets, TensorDict(tensors, batch_size=[batch])


def fused_and_reference(case, cfg, *, norm=None, temperature=1.0, chunk_bytes=10**9, cispo_eps_clip=None, **kwargs):
    hidden, weight, targets, td = case
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    loss, metrics = linear_rl_loss(
        h,
        w,
        targets,
        td,
        cfg,
        norm=norm,
        temperature=temperature,
        chunk_bytes=chunk_bytes,
        cispo_eps_clip=cispo_eps_clip,
        **kwargs,
    )
    loss.backward()
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    ref_loss, ref_metrics = reference.linear_rl_loss(
        h64, w64, targets, td, cfg, norm=norm, temperature=temperature, cispo_eps_clip=cispo_eps_clip
    )
    ref_loss.backward()
    return (loss, metrics, h.grad, w.grad), (ref_loss, ref_metrics, h64.grad, w64.grad)


def assert_close_to_reference(fused, ref, rtol=RTOL):
    loss, metrics, grad_h, grad_w = fused
    ref_loss, ref_metrics, ref_h, ref_w = ref
    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss.detach().double(), ref_loss.detach(), rtol=rtol, atol=rtol)
    assert set(metrics.keys()) == set(ref_metrics.keys())
    for name in ref_metrics.keys():
        torch.testing.assert_close(
            metrics[name].double(), ref_metrics[name].double(), rtol=rtol, atol=rtol, msg=lambda m, n=name: f"{n}: {m}"
        )
    for actual, expected in ((grad_h, ref_h), (grad_w, ref_w)):
        scale = float(expected.abs().max()) or 1.0
        torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=rtol * scale)


# Chunk budgets in bytes of float32 logits: 3 rows of V = 300 (several chunks; GSPO two-phase when T > 3) and
# everything in one chunk.
SMALL_CHUNK = 3 * 300 * 4
ONE_CHUNK = 10**9


@pytest.mark.parametrize("mode", AGG_MODES)
def test_rows_of_split_rollouts(mode):
    """Rows 0-1 and 2-3 are pieces of two rollouts (slime's fan-out): their token sums share one denominator."""
    hidden, weight, targets, td = make_case(4, batch=5, seq_len=4, hidden_size=16, vocab=300)
    row_tokens = td[keys.MASK].sum(-1)
    td = td.clone()
    td.set(
        keys.SEQ_TOKEN_COUNTS, torch.stack([row_tokens[:2].sum()] * 2 + [row_tokens[2:4].sum()] * 2 + [row_tokens[4]])
    )
    td.set(keys.SEQ_COUNTS, torch.tensor([1, 0, 1, 0, 1]))
    cfg = LossConfig(policy_loss="ppo", loss_agg_mode=mode, entropy_coef=0.01)
    fused, ref = fused_and_reference((hidden, weight, targets, td), cfg, chunk_bytes=SMALL_CHUNK)
    assert_close_to_reference(fused, ref)
    plain = fused_and_reference((hidden, weight, targets, td.exclude(keys.SEQ_TOKEN_COUNTS, keys.SEQ_COUNTS)), cfg)
    if mode == "seq_mean_token_mean":
        assert not torch.isclose(fused[0], plain[0][0])


@pytest.mark.parametrize(("policy_loss", "mode"), list(itertools.product(("ppo", "gspo", "cispo"), AGG_MODES)))
def test_every_policy_loss_and_aggregation_mode(policy_loss, mode):
    case = make_case(1, batch=3, seq_len=5, hidden_size=16, vocab=300)
    cfg = LossConfig(policy_loss=policy_loss, eps_clip=0.1, eps_clip_high=0.15, loss_agg_mode=mode, entropy_coef=0.01)
    assert_close_to_reference(*fused_and_reference(case, cfg, chunk_bytes=SMALL_CHUNK))


@pytest.mark.parametrize(("kind", "unbiased"), list(itertools.product(KL_KINDS, (False, True))))
def test_every_kl_kind(kind, unbiased):
    case = make_case(2, batch=2, seq_len=6, hidden_size=8, vocab=300)
    cfg = LossConfig(use_kl_loss=True, kl_loss_coef=0.7, kl_loss_type=kind, use_unbiased_kl=unbiased)
    assert_close_to_reference(*fused_and_reference(case, cfg, chunk_bytes=SMALL_CHUNK))


@pytest.mark.parametrize(("mode", "level"), list(itertools.product(MISMATCH_MODES, MISMATCH_LEVELS)))
def test_every_mismatch_mode_and_level(mode, level):
    case = make_case(3, batch=3, seq_len=4, hidden_size=8, vocab=129)
    cfg = LossConfig(use_tis=True, tis_mode=mode, tis_level=level, tis_clip=1.3, use_kl_loss=True, kl_loss_coef=0.2)
    assert_close_to_reference(*fused_and_reference(case, cfg, chunk_bytes=2 * 129 * 4))


def test_dual_clip_and_low_var_kl_clamp_are_reached():
    """Large log-ratios: the dual clip holds negative-advantage tokens and low_var_kl's clamp cuts gradients."""
    hidden, weight, targets, td = make_case(4, batch=2, seq_len=6, hidden_size=8, vocab=300)
    td = td.clone()
    td.set(keys.OLD_LOG_PROBS, td[keys.OLD_LOG_PROBS] - 3.0)
    td.set(keys.REF_LOG_PROBS, td[keys.REF_LOG_PROBS] + 4.0 * torch.sign(torch.randn(2, 6)))
    td.set(keys.ADVANTAGES, -td[keys.ADVANTAGES].abs())
    cfg = LossConfig(eps_clip_c=3.0, use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="low_var_kl")
    fused, ref = fused_and_reference((hidden, weight, targets, td), cfg, chunk_bytes=SMALL_CHUNK)
    assert float(fused[1]["clipfrac"]) > 0
    assert_close_to_reference(fused, ref)


@pytest.mark.parametrize("eps_clip", [0.0, 0.1])
def test_cispo_lower_bound(eps_clip):
    case = make_case(5, batch=2, seq_len=5, hidden_size=8, vocab=300)
    cfg = LossConfig(policy_loss="cispo", eps_clip_high=0.2, use_tis=True, loss_agg_mode="seq_mean_token_mean")
    fused, ref = fused_and_reference(case, cfg, chunk_bytes=SMALL_CHUNK, cispo_eps_clip=eps_clip)
    torch.testing.assert_close(fused[0].detach().double(), ref[0].detach(), rtol=RTOL, atol=RTOL)
    for actual, expected in zip(fused[2:], ref[2:], strict=True):
        torch.testing.assert_close(actual.double(), expected, rtol=RTOL, atol=RTOL * float(expected.abs().max()))
    one_sided = fused_and_reference(case, cfg, chunk_bytes=SMALL_CHUNK)[0]
    assert not torch.allclose(one_sided[3], fused[3]), "the lower bound changed no gradient: the test shows nothing"


@st.composite
def configs(draw):
    policy_loss = draw(st.sampled_from(("ppo", "gspo", "cispo")))
    use_kl = draw(st.booleans())
    return LossConfig(
        policy_loss=policy_loss,
        eps_clip=draw(st.sampled_from((0.05, 0.2))),
        eps_clip_high=draw(st.sampled_from((None, 0.28))),
        eps_clip_c=draw(st.sampled_from((None, 3.0))) if policy_loss == "ppo" else None,
        use_tis=draw(st.booleans()),
        tis_mode=draw(st.sampled_from(MISMATCH_MODES)),
        tis_level=draw(st.sampled_from(MISMATCH_LEVELS)),
        tis_clip=draw(st.sampled_from((1.2, 2.0))),
        use_kl_loss=use_kl,
        kl_loss_coef=0.3 if use_kl else 0.0,
        kl_loss_type=draw(st.sampled_from(KL_KINDS)),
        use_unbiased_kl=draw(st.booleans()),
        entropy_coef=draw(st.sampled_from((0.0, 0.02, -0.1))),
        loss_agg_mode=draw(st.sampled_from(AGG_MODES)),
    )


@settings(deadline=None)
@given(
    cfg=configs(),
    batch=st.integers(1, 3),
    seq_len=st.integers(1, 6),
    vocab=st.sampled_from((129, 300)),
    chunk_rows=st.sampled_from((1, 2, 4, 1000)),
    temperature=st.sampled_from((1.0, 0.7)),
    with_old=st.booleans(),
    global_norm=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_reference(cfg, batch, seq_len, vocab, chunk_rows, temperature, with_old, global_norm, seed):
    case = make_case(seed, batch, seq_len, 8, vocab, with_old=with_old)
    norm = None
    if global_norm:
        # This batch as one micro-batch of a larger global batch: denominators from both.
        other = torch.rand(4, seq_len + 2, generator=torch.Generator().manual_seed(seed)) < 0.5
        norm = Normalizer.of(case[3][keys.MASK]) + Normalizer.of(other)
    fused, ref = fused_and_reference(case, cfg, norm=norm, temperature=temperature, chunk_bytes=chunk_rows * vocab * 4)
    assert_close_to_reference(fused, ref)


def test_micro_batches_sum_to_the_global_batch():
    """Split invariance: the micro-batches' losses and gradients under the global Normalizer sum to the whole's."""
    hidden, weight, targets, td = make_case(6, batch=4, seq_len=5, hidden_size=8, vocab=300)
    cfg = LossConfig(policy_loss="gspo", loss_agg_mode="seq_mean_token_mean", use_kl_loss=True, kl_loss_coef=0.1)
    norm = Normalizer.of(td[keys.MASK])
    w = weight.clone().requires_grad_()
    whole_h = hidden.clone().requires_grad_()
    whole, _ = linear_rl_loss(whole_h, w, targets, td, cfg, norm=norm, chunk_bytes=SMALL_CHUNK)
    whole.backward()
    whole_w, w.grad = w.grad, None
    parts_h = hidden.clone().requires_grad_()
    total = 0.0
    for rows in (slice(0, 1), slice(1, 4)):
        token_rows = slice(rows.start * 5, rows.stop * 5)
        part, _ = linear_rl_loss(
            parts_h[token_rows], w, targets[token_rows], td[rows], cfg, norm=norm, chunk_bytes=SMALL_CHUNK
        )
        part.backward()
        total = total + part.detach()
    torch.testing.assert_close(total, whole.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(parts_h.grad, whole_h.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, whole_w, rtol=1e-5, atol=1e-6)


def test_fallback_with_value_loss_and_custom_loss():
    hidden, weight, targets, td = make_case(7, batch=2, seq_len=4, hidden_size=8, vocab=129)
    values = torch.randn(2, 4, requires_grad=True)
    td = td.clone()
    td.set(keys.VALUES, values)
    td.set(keys.OLD_VALUES, values.detach() + 0.1)
    td.set(keys.RETURNS, torch.randn(2, 4))
    cfg = LossConfig(value_coef=0.5, use_kl_loss=True, kl_loss_coef=0.1)
    assert not fusable(cfg, td)
    fused, ref = fused_and_reference((hidden, weight, targets, td), cfg)
    assert_close_to_reference(fused, ref)
    assert values.grad is not None and values.grad.abs().sum() > 0, "the value loss reached the critic's output"

    def custom(batch):
        lp = torch.where(batch[keys.MASK], batch[keys.LOG_PROBS], 0.0)
        loss = -(lp * batch[keys.ENTROPY].detach()).sum()
        return loss, TensorDict({"loss": loss.detach()}, batch_size=[])

    h = hidden.clone().requires_grad_()
    loss, metrics = linear_rl_loss(h, weight, targets, td, cfg, loss_fn=custom)
    loss.backward()
    h64 = hidden.double().requires_grad_()
    lp, ent = reference.linear_logprobs_entropy(h64, weight.double(), targets)
    expected = -(torch.where(td[keys.MASK].flatten(), lp, 0.0) * ent.detach()).sum()
    expected.backward()
    torch.testing.assert_close(loss.detach().double(), expected.detach(), rtol=RTOL, atol=RTOL)
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=RTOL, atol=RTOL * float(h64.grad.abs().max()))


def test_tis_without_old_log_probs_falls_back():
    case = make_case(8, batch=2, seq_len=4, hidden_size=8, vocab=129, with_old=False)
    cfg = LossConfig(use_tis=True, tis_level="sequence")
    assert not fusable(cfg, case[3])
    assert_close_to_reference(*fused_and_reference(case, cfg))


def test_upstream_gradient_scales_and_backward_runs_once():
    hidden, weight, targets, td = make_case(9, batch=2, seq_len=4, hidden_size=8, vocab=300)
    cfg = LossConfig(entropy_coef=0.05)
    grads = []
    for scale in (1.0, -2.5):
        h = hidden.clone().requires_grad_()
        loss, _ = linear_rl_loss(h, weight, targets, td, cfg, chunk_bytes=SMALL_CHUNK)
        (scale * loss).backward(retain_graph=True)
        grads.append(h.grad)
        if scale != 1.0:
            with pytest.raises(RuntimeError, match="already ran"):
                loss.backward()
    torch.testing.assert_close(grads[1], -2.5 * grads[0])


def test_without_gradient_gives_the_same_loss():
    hidden, weight, targets, td = make_case(10, batch=2, seq_len=5, hidden_size=8, vocab=300)
    cfg = LossConfig(policy_loss="gspo", use_kl_loss=True, kl_loss_coef=0.2, entropy_coef=0.01)
    with_grad, _ = linear_rl_loss(hidden.requires_grad_(), weight, targets, td, cfg, chunk_bytes=SMALL_CHUNK)
    with torch.no_grad():
        without, metrics = linear_rl_loss(hidden, weight, targets, td, cfg, chunk_bytes=SMALL_CHUNK)
    assert not without.requires_grad
    torch.testing.assert_close(without, with_grad.detach())
    torch.testing.assert_close(metrics["loss"], without)


def test_bf16_equals_unfused_within_bf16_tolerance():
    """Fused vs unfused (``linear_logprobs_entropy`` + ``rl_loss``) on bf16 inputs: the loss within 1e-3 relative and
    the gradient norms within 2**-6 relative (both round logits and gradients to bf16; they differ in the order of
    accumulation only). ``float32_logits`` and a float32 weight-gradient accumulator run the same math."""
    hidden, weight, targets, td = make_case(11, batch=3, seq_len=6, hidden_size=16, vocab=300)
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    cfg = LossConfig(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3", entropy_coef=0.01)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = linear_logprobs_entropy(h, w, targets)
    full = td.clone(recurse=False)
    full.set(keys.LOG_PROBS, lp.view(3, 6))
    full.set(keys.ENTROPY, ent.view(3, 6))
    unfused, _ = rl_loss(full, cfg)
    unfused.backward()
    for options in ({}, {"float32_logits": True}, {"grad_weight_dtype": torch.float32}):
        fh, fw = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        fused, _ = linear_rl_loss(fh, fw, targets, td, cfg, chunk_bytes=4 * 300 * 2, **options)
        fused.backward()
        assert fh.grad.dtype == fw.grad.dtype == torch.bfloat16
        torch.testing.assert_close(fused.detach(), unfused.detach(), rtol=1e-3, atol=1e-3)
        for actual, expected in ((fh.grad, h.grad), (fw.grad, w.grad)):
            assert abs(float(actual.float().norm()) / float(expected.float().norm()) - 1) < 2**-6
            torch.testing.assert_close(
                actual.float(), expected.float(), rtol=2**-6, atol=2**-6 * float(expected.abs().max())
            )


@settings(deadline=None)
@given(
    seq_lengths=st.lists(st.integers(0, 700), max_size=12),
    vocab=st.integers(1, 200_000),
    bytes_per_logit=st.sampled_from((2, 4, 6)),
    chunk_bytes=st.integers(1, 1 << 32),
    by_sequence=st.booleans(),
)
def test_plan_chunks_invariants(seq_lengths, vocab, bytes_per_logit, chunk_bytes, by_sequence):
    rows = sum(seq_lengths)
    chunks, aligned = plan_chunks(seq_lengths, vocab, bytes_per_logit, chunk_bytes, by_sequence)
    if rows == 0:
        assert chunks == []
        return
    assert [a for a, _ in chunks] == [0] + [b for _, b in chunks[:-1]]
    assert chunks[-1][1] == rows
    budget = max(1, chunk_bytes // (vocab * bytes_per_logit))
    assert all(0 < b - a <= budget for a, b in chunks)
    if by_sequence:
        assert aligned == (max(seq_lengths) <= budget)
    if aligned:
        sequence_bounds = set(itertools.accumulate(seq_lengths, initial=0))
        assert all(a in sequence_bounds and b in sequence_bounds for a, b in chunks)
    elif budget >= 128:
        assert all(a % 128 == 0 for a, _ in chunks)


def test_padding_rows_are_skipped_and_get_zero_gradient():
    """A sample with no valid token, and a batch with none: padding rows never reach the matmuls (their hidden
    states may be anything, NaN included) and get gradient 0."""
    hidden, weight, targets, td = make_case(15, batch=3, seq_len=4, hidden_size=8, vocab=129)
    td = td.clone()
    mask = td[keys.MASK].clone()
    mask[1] = False
    td.set(keys.MASK, mask)
    hidden = hidden.clone()
    hidden[~mask.flatten()] = float("nan")
    cfg = LossConfig(policy_loss="gspo", loss_agg_mode="seq_mean_token_mean", entropy_coef=0.01)
    h = hidden.clone().requires_grad_()
    loss, metrics = linear_rl_loss(h, weight, targets, td, cfg, chunk_bytes=SMALL_CHUNK)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
    assert torch.isfinite(h.grad).all() and (h.grad[~mask.flatten()] == 0).all()
    safe = torch.where(mask.flatten()[:, None], hidden, 0.0)
    assert_close_to_reference(*fused_and_reference((safe, weight, targets, td), cfg, chunk_bytes=SMALL_CHUNK))

    td.set(keys.MASK, torch.zeros_like(mask))
    w = weight.clone().requires_grad_()
    h = hidden.clone().requires_grad_()
    loss, _ = linear_rl_loss(h, w, targets, td, cfg)
    loss.backward()
    assert float(loss.detach()) == 0.0 and (h.grad == 0).all() and (w.grad == 0).all()


def _vocab_parallel_worker(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        group = dist.new_group([0, 1])
        hidden, weight, targets, td = make_case(12, batch=2, seq_len=5, hidden_size=8, vocab=300)
        cfg = LossConfig(policy_loss="gspo", use_kl_loss=True, kl_loss_coef=0.3, kl_loss_type="k3", entropy_coef=0.02)
        shard = slice(rank * 150, (rank + 1) * 150)
        h = hidden.clone().requires_grad_()
        w = weight[shard].clone().requires_grad_()
        loss, metrics = linear_rl_loss(h, w, targets, td, cfg, group=group, chunk_bytes=3 * 150 * 4)
        loss.backward()
        grad_h = h.grad.clone()
        dist.all_reduce(grad_h, group=group)
        h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
        ref_loss, ref_metrics = reference.linear_rl_loss(h64, w64, targets, td, cfg)
        ref_loss.backward()
        torch.testing.assert_close(loss.detach().double(), ref_loss.detach(), rtol=RTOL, atol=RTOL)
        torch.testing.assert_close(metrics["entropy"].double(), ref_metrics["entropy"].double(), rtol=RTOL, atol=RTOL)
        for actual, expected in ((grad_h, h64.grad), (w.grad, w64.grad[shard])):
            torch.testing.assert_close(actual.double(), expected, rtol=RTOL, atol=RTOL * float(expected.abs().max()))
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_two_ranks(tmp_path):
    mp.spawn(_vocab_parallel_worker, args=(2, str(tmp_path / "store")), nprocs=2, join=True)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"hidden": torch.randn(7, 8)}, ValueError, r"one row per position of mask \(2, 4\)"),
        ({"weight": torch.randn(129, 7)}, ValueError, r"weight \(129, 7\)"),
        ({"weight": torch.randn(129, 8).double()}, TypeError, "weight"),
        ({"targets": torch.full((8,), 129)}, ValueError, r"\[0, 129\)"),
        ({"td": {"mask": torch.ones(2, 4, dtype=torch.bool)}}, TypeError, "td must be a TensorDict"),
        ({"cfg": {"policy_loss": "ppo"}}, TypeError, "cfg must be a LossConfig"),
        ({"chunk_bytes": 0}, ValueError, "chunk_bytes"),
        ({"grad_weight_dtype": torch.float16}, ValueError, "grad_weight_dtype"),
        ({"cispo_eps_clip": 0.2}, ValueError, "cispo_eps_clip applies to policy_loss 'cispo'"),
        ({"temperature": 0.0}, ValueError, "temperature"),
    ],
)
def test_bad_input(change, error, match):
    hidden, weight, targets, td = make_case(13, batch=2, seq_len=4, hidden_size=8, vocab=129)
    args = {"hidden": hidden, "weight": weight, "targets": targets, "td": td, "cfg": LossConfig()}
    kwargs = {k: change.pop(k) for k in list(change) if k not in args}
    args.update(change)
    with pytest.raises(error, match=match):
        linear_rl_loss(args["hidden"], args["weight"], args["targets"], args["td"], args["cfg"], **kwargs)


def test_missing_batch_key_is_named():
    hidden, weight, targets, td = make_case(14, batch=2, seq_len=4, hidden_size=8, vocab=129)
    with pytest.raises(ValueError, match="needs td\\['ref_log_probs'\\]"):
        linear_rl_loss(hidden, weight, targets, td.exclude(keys.REF_LOG_PROBS), LossConfig(use_kl_loss=True))


def test_non_finite_batch_value_at_a_valid_position_is_named():
    hidden, weight, targets, td = make_case(16, batch=2, seq_len=4, hidden_size=8, vocab=129)
    td = td.clone()
    advantages = td[keys.ADVANTAGES].clone()
    advantages[0, 0] = float("inf")
    td.set(keys.ADVANTAGES, advantages)
    with pytest.raises(ValueError, match=r"advantages has a non-finite value at valid position \(0, 0\)"):
        linear_rl_loss(hidden, weight, targets, td, LossConfig())


def test_lengths_from_the_host_give_the_counted_result():
    """``seq_lengths`` (the caller's host copy of ``mask.sum(-1)``) changes nothing but the host sync: padding rows,
    the mismatch weights and every aggregation input come out the same, bit for bit."""
    hidden, weight, targets, td = make_case(21, batch=3, seq_len=5, hidden_size=8, vocab=131)
    cfg = LossConfig(use_tis=True, tis_mode="icepop", use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01)
    lengths = td[keys.MASK].sum(-1).tolist()
    assert sum(lengths) < td[keys.MASK].numel()  # the gather of valid rows runs
    results = []
    for host in (None, lengths):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, metrics = linear_rl_loss(h, w, targets, td, cfg, chunk_bytes=SMALL_CHUNK, seq_lengths=host)
        loss.backward()
        results.append((loss.detach(), metrics, h.grad, w.grad))
    (loss, metrics, grad_h, grad_w), (loss2, metrics2, grad_h2, grad_w2) = results
    assert torch.equal(loss, loss2) and torch.equal(grad_h, grad_h2) and torch.equal(grad_w, grad_w2)
    assert all(torch.equal(metrics[k], metrics2[k]) for k in metrics.keys())


@pytest.mark.parametrize(
    ("lengths", "match"),
    [
        ([1, 2], "3 ints in"),
        ([1, 2, 9], r"3 ints in \[0, 5\]"),
        ([1, 2, -1], "3 ints in"),
        ("mask", "do not match the valid tokens of mask"),
    ],
)
def test_wrong_lengths_from_the_host_are_refused(lengths, match):
    hidden, weight, targets, td = make_case(22, batch=3, seq_len=5, hidden_size=8, vocab=131)
    if lengths == "mask":
        lengths = td[keys.MASK].sum(-1).tolist()
        lengths[1] = (lengths[1] + 1) % 6
    with pytest.raises(ValueError, match=match):
        linear_rl_loss(hidden, weight, targets, td, LossConfig(), seq_lengths=lengths)


@pytest.mark.parametrize("key", [keys.ROLLOUT_LOG_PROBS, keys.OLD_LOG_PROBS])
def test_non_finite_mismatch_input_at_a_valid_position_is_named(key):
    """The mismatch weights are taken without a host sync; their inputs are still checked, naming the position."""
    hidden, weight, targets, td = make_case(23, batch=2, seq_len=4, hidden_size=8, vocab=129)
    td = td.clone()
    values = td[key].clone()
    values[0, 0] = float("nan")
    td.set(key, values)
    with pytest.raises(ValueError, match=rf"{key} has a non-finite value at valid position \(0, 0\)"):
        linear_rl_loss(hidden, weight, targets, td, LossConfig(use_tis=True))
