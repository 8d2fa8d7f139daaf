"""Tensor-level losses: float64 loop references, hypothesis invariants, torchrl as an independent reference."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.losses import (
    AGG_MODES,
    KL_KINDS,
    MISMATCH_LEVELS,
    Normalizer,
    aggregate,
    approx_kl,
    cispo,
    entropy_bonus,
    gspo,
    mismatch_weights,
    opsm_keep,
    ppo_clip,
    sft_loss,
    value_loss,
)

F64 = torch.float64


def make(seed: int, B: int, T: int, *, density: float = 0.7):
    """Random log-probs, old log-probs nearby, advantages and a mask with at least one valid token."""
    g = torch.Generator().manual_seed(seed)
    log_probs = -torch.rand(B, T, generator=g, dtype=F64) * 3
    old = log_probs + 0.4 * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, T, generator=g, dtype=F64)
    mask = torch.rand(B, T, generator=g) < density
    mask[0, 0] = True
    return log_probs, old, adv, mask


def nan_fill(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.full_like(x, float("nan")))


shapes = st.tuples(st.integers(1, 5), st.integers(1, 7))
seeds = st.integers(0, 2**31 - 1)


# ---------------------------------------------------------------- float64 loop references


def ref_kl(lp: float, ref: float, kind: str) -> float:
    log_r = lp - ref
    if kind == "k1":
        return log_r
    if kind == "k2":
        return log_r * log_r / 2
    k3 = math.exp(-log_r) - 1 + log_r
    return min(max(k3, -10.0), 10.0) if kind == "low_var_kl" else k3


def ref_ppo(lp, old, a, el, eh, c):
    """(loss, clipped) of one token, from the objective J = min(r A, clip(r) A), dual: max(J, c A) for A < 0."""
    r = math.exp(lp - old)
    objective = min(r * a, min(max(r, 1 - el), 1 + eh) * a)
    clipped = (a > 0 and r > 1 + eh) or (a < 0 and r < 1 - el)
    if c is not None and a < 0 and c * a > objective:
        objective, clipped = c * a, True
    return -objective, clipped


def ref_aggregate(x, mask, mode, num_tokens=None, num_seqs=None, max_len=None):
    rows = [[x[b][t] for t in range(len(x[b])) if mask[b][t]] for b in range(len(x))]
    num_tokens = sum(len(r) for r in rows) if num_tokens is None else num_tokens
    num_seqs = len(rows) if num_seqs is None else num_seqs
    max_len = len(x[0]) if max_len is None else max_len
    total = sum(sum(r) for r in rows)
    if mode == "token_mean":
        return total / max(num_tokens, 1)
    if mode == "seq_mean_token_mean":
        return sum(sum(r) / len(r) for r in rows if r) / max(num_seqs, 1)
    if mode == "seq_mean_token_sum":
        return total / max(num_seqs, 1)
    return total / max(num_seqs * max_len, 1)


def ref_mismatch(old, rollout, mask, mode, level, low, high):
    B, T = len(old), len(old[0])
    weights = [[0.0] * T for _ in range(B)]
    keep = [[False] * T for _ in range(B)]
    for b in range(B):
        diffs = [old[b][t] - rollout[b][t] for t in range(T) if mask[b][t]]
        for t in range(T):
            if not mask[b][t]:
                continue
            if level == "token":
                log_r = old[b][t] - rollout[b][t]
            elif level == "sequence":
                log_r = sum(diffs)
            else:
                log_r = sum(diffs) / len(diffs)
            r = math.exp(min(max(log_r, -20.0), 20.0))
            if mode == "tis":
                weights[b][t], keep[b][t] = min(max(r, low or 0.0), high), True
            else:
                lo = (1 / high if low is None else low) if mode == "icepop" else low
                ok = r <= high and (lo is None or r >= lo)
                weights[b][t], keep[b][t] = (r if ok else 0.0), ok
    return weights, keep


# ---------------------------------------------------------------- approx_kl


@given(shape=shapes, seed=seeds, kind=st.sampled_from(KL_KINDS))
def test_approx_kl_matches_loop_reference(shape, seed, kind):
    lp, ref, _, _ = make(seed, *shape)
    ref = ref * 3  # spread the ratios so low_var_kl's clamp is hit too
    got = approx_kl(lp, ref, kind=kind)
    want = [
        [ref_kl(a, b, kind) for a, b in zip(ra, rb, strict=True)]
        for ra, rb in zip(lp.tolist(), ref.tolist(), strict=True)
    ]
    assert got.dtype == F64
    torch.testing.assert_close(got, torch.tensor(want, dtype=F64))


@given(shape=shapes, seed=seeds, kind=st.sampled_from(KL_KINDS))
def test_approx_kl_importance_ratio_weights_before_the_clamp(shape, seed, kind):
    """As slime's compute_approx_kl: ``ratio * estimate``, and low_var_kl clamps that product (not the estimate)."""
    lp, ref, adv, _ = make(seed, *shape)
    ref = ref * 3
    ratio = torch.exp(2 * adv)  # from e^-6 to e^6: products both pushed past 10 and pulled back under it
    got = approx_kl(lp, ref, kind=kind, importance_ratio=ratio)
    unclamped = "k3" if kind == "low_var_kl" else kind
    want = []
    for ra, rb, rw in zip(lp.tolist(), ref.tolist(), ratio.tolist(), strict=True):
        row = [w * ref_kl(a, b, unclamped) for a, b, w in zip(ra, rb, rw, strict=True)]
        want.append([min(max(k, -10.0), 10.0) for k in row] if kind == "low_var_kl" else row)
    torch.testing.assert_close(got, torch.tensor(want, dtype=F64))


def test_low_var_kl_clamps_the_weighted_estimate():
    """k3 = 20 - 1 - ln 20 ~ 16 is clamped to 10 only after the weight 0.25 brings it to ~4: the result is ~4."""
    lp, ref = torch.tensor([0.0], dtype=F64), torch.tensor([math.log(20.0)], dtype=F64)
    got = approx_kl(lp, ref, kind="low_var_kl", importance_ratio=torch.tensor([0.25], dtype=F64))
    assert float(got) == pytest.approx(0.25 * (20 - 1 - math.log(20.0)), rel=1e-12)


@given(
    x=st.lists(st.tuples(st.floats(-30, 0), st.floats(-30, 0)), min_size=1, max_size=20),
    kind=st.sampled_from(["k2", "k3", "low_var_kl"]),
)
def test_k2_k3_are_non_negative(x, kind):
    lp, ref = torch.tensor(x, dtype=F64).unbind(-1)
    assert bool((approx_kl(lp, ref, kind=kind) >= 0).all())


@settings(max_examples=8)
@given(seed=seeds, vocab=st.integers(2, 12))
def test_k1_and_k3_estimate_the_exact_kl(seed, vocab):
    """Means over tokens sampled from pi of k1 and k3 are unbiased for KL(pi || pi_ref)."""
    g = torch.Generator().manual_seed(seed)
    log_p = torch.log_softmax(torch.randn(vocab, generator=g, dtype=F64), -1)
    log_q = torch.log_softmax(torch.randn(vocab, generator=g, dtype=F64), -1)
    exact = float((log_p.exp() * (log_p - log_q)).sum())
    tokens = torch.multinomial(log_p.exp(), 200_000, replacement=True, generator=g)
    for kind in ("k1", "k3"):
        samples = approx_kl(log_p[tokens], log_q[tokens], kind=kind)
        tol = 5 * float(samples.std()) / math.sqrt(samples.numel()) + 1e-9
        assert abs(float(samples.mean()) - exact) < tol, (kind, float(samples.mean()), exact)


def test_approx_kl_upcasts_half_precision_and_keeps_float64():
    lp = torch.tensor([-1.0, -2.0], dtype=torch.bfloat16)
    assert approx_kl(lp, lp - 1).dtype == torch.float32
    assert approx_kl(lp.double(), lp.double()).dtype == F64


# ---------------------------------------------------------------- ppo_clip

clip_knobs = st.tuples(
    st.floats(0.05, 0.4), st.one_of(st.none(), st.floats(0.05, 0.5)), st.one_of(st.none(), st.floats(1.5, 4.0))
)


@given(shape=shapes, seed=seeds, knobs=clip_knobs)
def test_ppo_clip_matches_loop_reference(shape, seed, knobs):
    el, eh, c = knobs
    lp, old, adv, _ = make(seed, *shape)
    old = lp + 2 * (old - lp)  # wide ratios: every branch, dual clip included
    loss, clipped = ppo_clip(lp, old, adv, eps_clip=el, eps_clip_high=eh, dual_clip=c)
    want = [
        [ref_ppo(a, b, d, el, el if eh is None else eh, c) for a, b, d in zip(*rows, strict=True)]
        for rows in zip(lp.tolist(), old.tolist(), adv.tolist(), strict=True)
    ]
    torch.testing.assert_close(loss, torch.tensor([[w[0] for w in row] for row in want], dtype=F64))
    assert clipped.dtype == torch.bool
    assert clipped.tolist() == [[w[1] for w in row] for row in want]


@given(shape=shapes, seed=seeds, knobs=clip_knobs, on_policy=st.booleans())
def test_ppo_clip_gradient_is_minus_a_ratio_inside_and_zero_where_clipped(shape, seed, knobs, on_policy):
    el, eh, c = knobs
    lp, old, adv, _ = make(seed, *shape)
    old = lp.clone() if on_policy else lp + 2 * (old - lp)
    lp = lp.requires_grad_()
    loss, clipped = ppo_clip(lp, old, adv, eps_clip=el, eps_clip_high=eh, dual_clip=c)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    ratio = torch.exp(lp.detach() - old)
    torch.testing.assert_close(grad, torch.where(clipped, 0.0, -adv * ratio))
    if on_policy:
        assert not clipped.any()
        torch.testing.assert_close(grad, -adv)
    eh = el if eh is None else eh
    # clipped exactly where the ratio left the range on A's side, or the dual clip held a negative advantage
    side = ((adv > 0) & (ratio > 1 + eh)) | ((adv < 0) & (ratio < 1 - el))
    dual = (adv < 0) & (ratio > c) if c is not None else torch.zeros_like(side)
    assert torch.equal(clipped, side | dual)


def test_ppo_dual_clip_bounds_negative_advantage_loss_by_c_abs_a():
    lp = torch.tensor([math.log(10.0), math.log(10.0), math.log(0.5)], dtype=F64)
    old = torch.zeros(3, dtype=F64)
    adv = torch.tensor([-1.0, 1.0, -1.0], dtype=F64)
    loss, clipped = ppo_clip(lp, old, adv, eps_clip=0.2, dual_clip=3.0)
    # ratio 10, A<0: -A r = 10 > c|A| = 3; ratio 10, A>0: clipped at 1.2; ratio 0.5, A<0: clipped at 0.8
    torch.testing.assert_close(loss, torch.tensor([3.0, -1.2, 0.8], dtype=F64))
    assert clipped.tolist() == [True, True, True]


def _torchrl_clip_ppo(log_probs, old_log_probs, advantages, *, eps_low, eps_high, values=None, clip_value=None):
    """torchrl's ClipPPOLoss on a trivial actor whose Normal log-prob of the action is exactly ``log_probs``."""
    from tensordict import TensorDict
    from tensordict.nn import TensorDictModule
    from torchrl.modules import ProbabilisticActor
    from torchrl.objectives import ClipPPOLoss

    half_log_2pi = 0.5 * math.log(2 * math.pi)

    class NormalAtAction(torch.nn.Module):
        def forward(self, lp, action):
            return action, torch.exp(-lp - half_log_2pi)

    actor = ProbabilisticActor(
        TensorDictModule(NormalAtAction(), in_keys=["lp", "action"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"],
        distribution_class=torch.distributions.Normal,
        return_log_prob=True,
    )
    n = log_probs.numel()
    data = {
        "lp": log_probs.reshape(n),
        "action": torch.zeros(n, dtype=log_probs.dtype),
        "old_lp": old_log_probs.reshape(n),
        "advantage": advantages.reshape(n, 1),
    }
    critic = None
    if values is not None:
        new_values, old_values, returns = values
        critic = TensorDictModule(torch.nn.Identity(), in_keys=["v_new"], out_keys=["state_value"])
        data |= {
            "v_new": new_values.reshape(n, 1),
            "state_value": old_values.reshape(n, 1),
            "value_target": returns.reshape(n, 1),
        }
    loss_module = ClipPPOLoss(
        actor,
        critic,
        clip_epsilon=(eps_low, eps_high),
        entropy_bonus=False,
        normalize_advantage=False,
        reduction="none",
        clip_value=clip_value,
        loss_critic_type="l2",
        critic_coeff=1.0 if critic is not None else None,
    )
    loss_module.set_keys(sample_log_prob="old_lp")
    return loss_module(TensorDict(data, batch_size=[n]))


@settings(max_examples=10)
@given(shape=shapes, seed=seeds, eps=st.tuples(st.floats(0.05, 0.4), st.floats(0.05, 0.5)))
def test_ppo_clip_agrees_with_torchrl_clip_ppo_loss(shape, seed, eps):
    lp, old, adv, _ = make(seed, *shape)
    lp = lp.requires_grad_()
    theirs = _torchrl_clip_ppo(lp, old, adv, eps_low=eps[0], eps_high=eps[1])["loss_objective"].reshape(shape)
    ours, _ = ppo_clip(lp, old, adv, eps_clip=eps[0], eps_clip_high=eps[1])
    torch.testing.assert_close(ours, theirs)
    (g_ours,) = torch.autograd.grad(ours.sum(), lp)
    (g_theirs,) = torch.autograd.grad(theirs.sum(), lp)
    torch.testing.assert_close(g_ours, g_theirs)


# ---------------------------------------------------------------- gspo


@given(shape=shapes, seed=seeds, eps=st.tuples(st.floats(1e-4, 0.3), st.one_of(st.none(), st.floats(1e-4, 0.3))))
def test_gspo_matches_loop_reference(shape, seed, eps):
    lp, old, adv, mask = make(seed, *shape)
    el, eh = eps
    eh_ = el if eh is None else eh
    loss, clipped = gspo(lp, old, adv, mask, eps_clip=el, eps_clip_high=eh)
    want_loss, want_clipped = torch.zeros(shape, dtype=F64), torch.zeros(shape, dtype=torch.bool)
    for b in range(shape[0]):
        valid = [t for t in range(shape[1]) if mask[b, t]]
        s = math.exp(sum(float(lp[b, t] - old[b, t]) for t in valid) / max(len(valid), 1))
        for t in valid:
            a = float(adv[b, t])
            want_loss[b, t] = -min(s * a, min(max(s, 1 - el), 1 + eh_) * a)
            want_clipped[b, t] = (a > 0 and s > 1 + eh_) or (a < 0 and s < 1 - el)
    torch.testing.assert_close(loss, want_loss)
    assert torch.equal(clipped, want_clipped)


@given(shape=shapes, seed=seeds, on_policy=st.booleans())
def test_gspo_gradient_equals_sequence_ratio_policy_gradient(shape, seed, on_policy):
    """GSPO-token with one advantage per sample, averaged per sample, has GSPO's gradient.

    GSPO differentiates s_i = exp(mean_t log r_it); on-policy that is the sequence-mean-weighted policy gradient
    -A_i / (B' |y_i|) on every valid token (B' = samples with a valid token).
    """
    lp, old, adv, mask = make(seed, *shape)
    if on_policy:
        old = lp.clone()
    adv = adv[:, :1].expand(shape).clone()
    eps = 10.0  # wide enough that nothing clips: the gradients compared are the unclipped ones
    lp = lp.requires_grad_()
    loss, _ = gspo(lp, old, adv, mask, eps_clip=0.99, eps_clip_high=eps)
    (g_ours,) = torch.autograd.grad(aggregate(loss, mask, mode="seq_mean_token_mean"), lp)

    count = mask.sum(-1).clamp_min(1)
    seq_ratio = torch.exp(torch.where(mask, lp - old, 0.0).sum(-1) / count)
    per_token = torch.where(mask, -adv * seq_ratio[:, None], 0.0)
    (g_seq,) = torch.autograd.grad(aggregate(per_token, mask, mode="seq_mean_token_mean"), lp)
    torch.testing.assert_close(g_ours, g_seq)
    if on_policy:
        n_seqs = mask.shape[0]
        torch.testing.assert_close(g_ours, torch.where(mask, -adv / (count[:, None] * n_seqs), 0.0))


@given(shape=shapes, seed=seeds)
def test_gspo_ignores_masked_positions_even_nan(shape, seed):
    lp, old, adv, mask = make(seed, *shape)
    lp_a = lp.clone().requires_grad_()
    lp_b = nan_fill(lp, mask).requires_grad_()
    loss_a, clipped_a = gspo(lp_a, old, adv, mask, eps_clip=0.1)
    loss_b, clipped_b = gspo(lp_b, nan_fill(old, mask), nan_fill(adv, mask), mask, eps_clip=0.1)
    torch.testing.assert_close(loss_a, loss_b)
    assert torch.equal(clipped_a, clipped_b)
    (g_a,) = torch.autograd.grad(loss_a.sum(), lp_a)
    (g_b,) = torch.autograd.grad(loss_b.sum(), lp_b)
    torch.testing.assert_close(g_a, g_b)
    assert not g_b[~mask].any()


# ---------------------------------------------------------------- cispo


@given(shape=shapes, seed=seeds, eps_high=st.floats(0.05, 3.0), eps_low=st.one_of(st.none(), st.floats(0.0, 0.9)))
def test_cispo_matches_loop_reference_value_and_gradient(shape, seed, eps_high, eps_low):
    lp, old, adv, _ = make(seed, *shape)
    lp = lp.requires_grad_()
    loss, clipped = cispo(lp, old, adv, eps_clip_high=eps_high, eps_clip=eps_low)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    want_loss, want_grad, want_clipped = [], [], []
    low = -math.inf if eps_low is None else 1 - eps_low  # None: the paper's form; a number: slime's two-sided clamp
    for a, b, d in zip(lp.detach().flatten().tolist(), old.flatten().tolist(), adv.flatten().tolist(), strict=True):
        r = math.exp(a - b)
        w = max(min(r, 1 + eps_high), low)
        want_loss.append(-w * d * a)
        want_grad.append(-w * d)  # the truncated weight is a constant: clipped tokens keep their gradient
        want_clipped.append(r > 1 + eps_high or r < low)
    torch.testing.assert_close(loss.flatten(), torch.tensor(want_loss, dtype=F64))
    torch.testing.assert_close(grad.flatten(), torch.tensor(want_grad, dtype=F64))
    assert clipped.flatten().tolist() == want_clipped


# ---------------------------------------------------------------- opsm_keep


@given(shape=shapes, seed=seeds, delta=st.floats(0.0, 0.5))
def test_opsm_keep_matches_loop_reference_and_ignores_masked_positions(shape, seed, delta):
    lp, old, adv, mask = make(seed, *shape)
    keep = opsm_keep(nan_fill(lp, mask), nan_fill(old, mask), nan_fill(adv, mask), mask, delta=delta)
    for i in range(shape[0]):
        n = int(mask[i].sum())
        seq_kl = sum(float(old[i, t] - lp[i, t]) for t in range(shape[1]) if mask[i, t]) / max(n, 1)
        for t in range(shape[1]):
            want = bool(mask[i, t]) and not (float(adv[i, t]) < 0 and seq_kl > delta)
            assert bool(keep[i, t]) == want
    # Tokens with a non-negative advantage are never masked; delta = inf masks nothing.
    assert bool(keep[mask & (adv >= 0)].all())
    assert torch.equal(opsm_keep(lp, old, adv, mask, delta=math.inf), mask)


def test_opsm_keep_checks_its_arguments():
    lp, old, adv, mask = make(0, 2, 3)
    with pytest.raises(ValueError, match="delta"):
        opsm_keep(lp, old, adv, mask, delta=-1.0)
    with pytest.raises(ValueError, match="mask"):
        opsm_keep(lp, old, adv, mask[:, :2], delta=0.1)


# ---------------------------------------------------------------- mismatch_weights

mismatch_knobs = st.tuples(
    st.sampled_from(["tis", "mis", "icepop"]),
    st.sampled_from(MISMATCH_LEVELS),
    st.one_of(st.none(), st.floats(0.0, 0.9)),
    st.floats(1.05, 3.0),
)


@given(shape=shapes, seed=seeds, knobs=mismatch_knobs)
def test_mismatch_weights_match_loop_reference(shape, seed, knobs):
    mode, level, low, high = knobs
    old, rollout, _, mask = make(seed, *shape)
    weights, keep = mismatch_weights(old, rollout, mask, mode=mode, level=level, low=low, high=high)
    want_w, want_keep = ref_mismatch(old.tolist(), rollout.tolist(), mask.tolist(), mode, level, low, high)
    torch.testing.assert_close(weights, torch.tensor(want_w, dtype=F64))
    assert keep.tolist() == want_keep


@given(shape=shapes, seed=seeds, knobs=mismatch_knobs)
def test_mismatch_weights_invariants(shape, seed, knobs):
    mode, level, low, high = knobs
    old, rollout, _, mask = make(seed, *shape)
    rollout_nan = nan_fill(rollout, mask)
    weights, keep = mismatch_weights(old, rollout_nan, mask, mode=mode, level=level, low=low, high=high)
    assert not (keep & ~mask).any()
    assert not weights[~keep].any()
    assert torch.isfinite(weights).all()
    if mode == "tis":
        assert torch.equal(keep, mask)  # truncation keeps every token
        assert (weights[mask] <= high).all()
        if low is not None:
            assert (weights[mask] >= low).all()
    else:
        assert (weights[keep] <= high).all()  # kept tokens keep their raw ratio, inside the bounds
        lo = (1 / high if low is None else low) if mode == "icepop" else low
        if lo is not None:
            assert (weights[keep] >= lo).all()
    if level != "token":  # one weight per sample
        for b in range(shape[0]):
            assert len(set(weights[b][keep[b]].tolist())) <= 1


def test_mismatch_levels_on_a_hand_example():
    old = torch.tensor([[0.0, 0.0, 0.0]], dtype=F64)
    rollout = torch.tensor([[-math.log(2.0), math.log(2.0), -math.log(4.0)]], dtype=F64)  # ratios 2, 1/2, 4
    mask = torch.tensor([[True, True, False]])
    w, keep = mismatch_weights(old, rollout, mask, mode="tis", level="token", high=1.5)
    torch.testing.assert_close(w, torch.tensor([[1.5, 0.5, 0.0]], dtype=F64))
    w, keep = mismatch_weights(old, rollout, mask, mode="tis", level="sequence", high=3.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0, 0.0]], dtype=F64))  # 2 * 1/2
    rollout = torch.tensor([[-math.log(4.0), 0.0, 0.0]], dtype=F64)  # ratios 4, 1
    w, keep = mismatch_weights(old, rollout, mask, mode="mis", level="geometric", high=3.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 2.0, 0.0]], dtype=F64))  # sqrt(4 * 1)
    w, keep = mismatch_weights(old, rollout, mask, mode="mis", level="sequence", high=3.0)
    assert keep.tolist() == [[False, False, False]]  # the sequence ratio 4 masks the whole sample
    rollout = torch.tensor([[math.log(4.0), 0.0, 0.0]], dtype=F64)  # ratios 1/4, 1
    _, keep = mismatch_weights(old, rollout, mask, mode="mis", high=2.0)
    assert keep.tolist() == [[True, True, False]]  # mis is one-sided unless low is given
    _, keep = mismatch_weights(old, rollout, mask, mode="icepop", high=2.0)
    assert keep.tolist() == [[False, True, False]]  # icepop masks below 1/high too


# ---------------------------------------------------------------- value, sft, entropy


@given(shape=shapes, seed=seeds, clip=st.one_of(st.none(), st.floats(0.0, 1.0)))
def test_value_loss_matches_loop_reference(shape, seed, clip):
    v, old_v, ret, _ = make(seed, *shape)
    got = value_loss(v, old_v, ret, clip=clip)
    want = []
    for a, b, r in zip(v.flatten().tolist(), old_v.flatten().tolist(), ret.flatten().tolist(), strict=True):
        loss = (a - r) ** 2
        if clip is not None:
            loss = max(loss, (b + min(max(a - b, -clip), clip) - r) ** 2)
        want.append(loss)
    torch.testing.assert_close(got.flatten(), torch.tensor(want, dtype=F64))


@settings(max_examples=10)
@given(shape=shapes, seed=seeds, clip=st.floats(0.01, 1.0))
def test_value_loss_agrees_with_torchrl_critic_loss(shape, seed, clip):
    v, old_v, ret, _ = make(seed, *shape)
    v = v.requires_grad_()
    out = _torchrl_clip_ppo(
        v.detach(), v.detach(), ret, eps_low=0.2, eps_high=0.2, values=(v, old_v, ret), clip_value=clip
    )
    theirs = out["loss_critic"].reshape(shape)
    ours = value_loss(v, old_v, ret, clip=clip)
    torch.testing.assert_close(ours, theirs)
    (g_ours,) = torch.autograd.grad(ours.sum(), v)
    (g_theirs,) = torch.autograd.grad(theirs.sum(), v)
    torch.testing.assert_close(g_ours, g_theirs)


@given(shape=shapes, seed=seeds, coef=st.floats(-1.0, 1.0))
def test_sft_loss_and_entropy_bonus(shape, seed, coef):
    lp, ent, _, _ = make(seed, *shape)
    lp = lp.requires_grad_()
    loss = sft_loss(lp)
    torch.testing.assert_close(loss, torch.tensor([[-x for x in row] for row in lp.tolist()], dtype=F64))
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    torch.testing.assert_close(grad, torch.full_like(lp, -1.0))
    bonus = entropy_bonus(ent, coef=coef)
    torch.testing.assert_close(bonus, torch.tensor([[-coef * x for x in row] for row in ent.tolist()], dtype=F64))
    assert sft_loss(lp.detach().half()).dtype == torch.float32


# ---------------------------------------------------------------- aggregate and Normalizer


@given(shape=shapes, seed=seeds, mode=st.sampled_from(AGG_MODES), density=st.floats(0.0, 1.0))
def test_aggregate_matches_loop_reference(shape, seed, mode, density):
    x, _, _, mask = make(seed, *shape, density=density)
    got = aggregate(x, mask, mode=mode)
    assert got.shape == ()
    assert math.isclose(float(got), ref_aggregate(x.tolist(), mask.tolist(), mode), rel_tol=1e-12, abs_tol=1e-12)


@given(shape=shapes, seed=seeds, mode=st.sampled_from(AGG_MODES))
def test_aggregate_ignores_masked_positions_even_nan_and_inf(shape, seed, mode):
    x, _, _, mask = make(seed, *shape)
    poisoned = torch.where(mask, x, torch.tensor([float("nan"), float("inf")], dtype=F64).repeat(shape[1])[: shape[1]])
    a, b = x.clone().requires_grad_(), poisoned.clone().requires_grad_()
    la, lb = aggregate(a, mask, mode=mode), aggregate(b, mask, mode=mode)
    torch.testing.assert_close(la, lb)
    (ga,) = torch.autograd.grad(la, a)
    (gb,) = torch.autograd.grad(lb, b)
    torch.testing.assert_close(ga, gb)
    assert not gb[~mask].any()


@st.composite
def split_batches(draw):
    B = draw(st.integers(1, 8))
    T = draw(st.integers(1, 6))
    cuts = sorted(draw(st.sets(st.integers(1, B - 1), max_size=B - 1))) if B > 1 else []
    return B, T, [0, *cuts, B], draw(seeds), draw(st.floats(0.0, 1.0))


@given(split=split_batches(), mode=st.sampled_from(AGG_MODES), trim=st.booleans())
def test_aggregate_over_any_micro_batch_split_equals_full_batch_loss_and_gradient(split, mode, trim):
    """Micro-batches (each optionally cut to its own padded length) with the global Normalizer sum to the whole."""
    B, T, bounds, seed, density = split
    x, _, _, mask = make(seed, B, T, density=density)
    full_x = x.clone().requires_grad_()
    full = aggregate(full_x, mask, mode=mode)
    (g_full,) = torch.autograd.grad(full, full_x)

    parts = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        m = mask[lo:hi]
        width = int(m.any(0).nonzero().max()) + 1 if trim and m.any() else T
        parts.append((lo, hi, width))
    norm = Normalizer.of(mask)
    if not trim:
        summed = sum(Normalizer.of(mask[lo:hi]) for lo, hi, _ in parts)  # counting per micro-batch gives the same
        assert (int(summed.num_tokens), int(summed.num_seqs), int(summed.max_len)) == (
            int(norm.num_tokens),
            int(norm.num_seqs),
            int(norm.max_len),
        )
        norm = summed
    leaf = x.clone().requires_grad_()
    total = sum(aggregate(leaf[lo:hi, :w], mask[lo:hi, :w], mode=mode, norm=norm) for lo, hi, w in parts)
    (g_total,) = torch.autograd.grad(total, leaf)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(g_total, g_full)


def test_normalizer_counts_and_combination():
    mask = torch.tensor([[True, True, False], [False, False, False], [True, False, False]])
    norm = Normalizer.of(mask)
    # The row without a valid token is a sample all the same: num_seqs counts rows.
    assert (int(norm.num_tokens), int(norm.num_seqs), int(norm.max_len)) == (3, 3, 3)
    combined = Normalizer(4, 1, 5) + Normalizer(2, 2, 7)
    assert combined == Normalizer(6, 3, 7)
    assert sum([Normalizer(1, 1, 2), Normalizer(2, 1, 9)]) == Normalizer(3, 2, 9)
    assert Normalizer(4, 1, 5).reduce(None) == Normalizer(4, 1, 5)
    x = torch.tensor([[1.0, 2.0, 9.0], [5.0, 5.0, 5.0], [4.0, 0.0, 0.0]], dtype=F64)
    assert float(aggregate(x, mask, mode="token_mean", norm=Normalizer(10, 1, 1))) == pytest.approx(0.7)
    assert float(aggregate(x, mask, mode="seq_mean_token_sum_norm")) == pytest.approx(7 / 9)
    assert float(aggregate(x, mask, mode="seq_mean_token_mean")) == pytest.approx((1.5 + 4) / 3)
    assert float(aggregate(x, mask, mode="seq_mean_token_sum")) == pytest.approx(7 / 3)
    assert float(aggregate(x, torch.zeros_like(mask))) == 0.0


@st.composite
def split_rollouts(draw):
    """A batch whose rows are pieces of rollouts (consecutive rows of one rollout share an id), cut anywhere."""
    sizes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=5))
    T = draw(st.integers(1, 5))
    ids = [r for r, k in enumerate(sizes) for _ in range(k)]
    B = len(ids)
    cuts = sorted(draw(st.sets(st.integers(1, B - 1), max_size=B - 1))) if B > 1 else []
    return ids, T, [0, *cuts, B], draw(seeds), draw(st.floats(0.0, 1.0))


def rollout_counts(ids: list[int], mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq_token_counts, seq_counts) of rows grouped by rollout ``ids``: slime's rollout_mask_sums, and 1 on each
    rollout's first row."""
    totals: dict[int, int] = {}
    for rid, row in zip(ids, mask.sum(-1).tolist(), strict=True):
        totals[rid] = totals.get(rid, 0) + row
    first = [1 if i == 0 or ids[i - 1] != rid else 0 for i, rid in enumerate(ids)]
    return torch.tensor([totals[r] for r in ids]), torch.tensor(first)


@given(split=split_rollouts())
def test_seq_mean_token_mean_of_split_rollouts_is_each_rollouts_token_mean(split):
    """slime's default reducer with fan-out: a row's token sum over its rollout's total mask, over the number of
    rollouts (a float64 loop reference), split-invariant over micro-batches."""
    ids, T, bounds, seed, density = split
    x, _, _, mask = make(seed, len(ids), T, density=density)
    counts, firsts = rollout_counts(ids, mask)
    rollouts: dict[int, list[float]] = {}
    for rid, row, m in zip(ids, x.tolist(), mask.tolist(), strict=True):
        rollouts.setdefault(rid, []).extend(v for v, keep in zip(row, m, strict=True) if keep)
    want = sum(sum(v) / len(v) if v else 0.0 for v in rollouts.values()) / len(rollouts)
    norm = Normalizer.of(mask, seq_counts=firsts)
    assert int(norm.num_seqs) == len(rollouts)
    full = aggregate(x, mask, mode="seq_mean_token_mean", norm=norm, seq_token_counts=counts)
    assert math.isclose(float(full), want, rel_tol=1e-12, abs_tol=1e-12)
    parts = list(zip(bounds[:-1], bounds[1:], strict=True))
    summed = sum(Normalizer.of(mask[lo:hi], seq_counts=firsts[lo:hi]) for lo, hi in parts)
    total = sum(
        aggregate(x[lo:hi], mask[lo:hi], mode="seq_mean_token_mean", norm=summed, seq_token_counts=counts[lo:hi])
        for lo, hi in parts
    )
    assert math.isclose(float(total), want, rel_tol=1e-12, abs_tol=1e-12)


@given(shape=shapes, seed=seeds, density=st.floats(0.0, 1.0))
def test_seq_token_counts_of_own_masks_change_nothing(shape, seed, density):
    x, _, _, mask = make(seed, *shape, density=density)
    for mode in AGG_MODES:
        own = aggregate(x, mask, mode=mode, seq_token_counts=mask.sum(-1))
        torch.testing.assert_close(own, aggregate(x, mask, mode=mode))


def test_row_counts_are_checked():
    mask = torch.ones(2, 3, dtype=torch.bool)
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="seq_token_counts must be an integer tensor"):
        aggregate(x, mask, seq_token_counts=torch.ones(2))
    with pytest.raises(ValueError, match="seq_counts must be an integer tensor"):
        Normalizer.of(mask, seq_counts=torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match="seq_counts must be >= 0"):
        Normalizer.of(mask, seq_counts=torch.tensor([1, -1]))


# ---------------------------------------------------------------- dtypes

TENSOR_LOSSES = {
    "approx_kl": lambda lp, old, adv, mask: approx_kl(lp, old, kind="k3"),
    "ppo_clip": lambda lp, old, adv, mask: ppo_clip(lp, old, adv, eps_clip=0.2, dual_clip=3.0)[0],
    "gspo": lambda lp, old, adv, mask: gspo(lp, old, adv, mask, eps_clip=0.1)[0],
    "cispo": lambda lp, old, adv, mask: cispo(lp, old, adv, eps_clip_high=0.5)[0],
    "mismatch_weights": lambda lp, old, adv, mask: mismatch_weights(lp, old, mask, mode="icepop")[0],
    "value_loss": lambda lp, old, adv, mask: value_loss(lp, old, adv, clip=0.2),
    "aggregate": lambda lp, old, adv, mask: aggregate(lp, mask, mode="seq_mean_token_mean"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(TENSOR_LOSSES))
def test_low_precision_inputs_compute_in_float32(name, dtype):
    """Half-precision inputs are upcast before any exp or sum: float32 results equal to float64 ones."""
    lp, old, adv, mask = (x.to(dtype) if x.is_floating_point() else x for x in make(7, 4, 6))
    got = TENSOR_LOSSES[name](lp, old, adv, mask)
    want = TENSOR_LOSSES[name](*(x.double() if x.is_floating_point() else x for x in (lp, old, adv)), mask)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)


MASKED_LOSSES = {
    "approx_kl": lambda lp, old, adv, mask: approx_kl(lp, old, kind="k3", mask=mask),
    # The ratio is the caller's tensor: built from the padded inputs it must not put NaN into the graph itself.
    "approx_kl_weighted": lambda lp, old, adv, mask: approx_kl(
        lp,
        old,
        kind="low_var_kl",
        importance_ratio=torch.exp(lp - adv if mask is None else torch.where(mask, lp - adv, 0.0)),
        mask=mask,
    ),
    "ppo_clip": lambda lp, old, adv, mask: ppo_clip(lp, old, adv, eps_clip=0.2, dual_clip=3.0, mask=mask)[0],
    "cispo": lambda lp, old, adv, mask: cispo(lp, old, adv, eps_clip_high=0.5, mask=mask)[0],
    "value_loss": lambda lp, old, adv, mask: value_loss(lp, old, adv, clip=0.2, mask=mask),
    "sft_loss": lambda lp, old, adv, mask: sft_loss(lp, mask=mask),
    "entropy_bonus": lambda lp, old, adv, mask: entropy_bonus(lp, coef=0.3, mask=mask),
}


@given(shape=shapes, seed=seeds, name=st.sampled_from(sorted(MASKED_LOSSES)))
def test_elementwise_losses_with_mask_are_clean_at_masked_positions(shape, seed, name):
    """With ``mask``, NaN padding reaches neither the per-token loss nor any gradient (0 at masked positions),
    and valid positions get exactly what the mask-free call gives on clean inputs."""
    fn = MASKED_LOSSES[name]
    lp, old, adv, mask = make(seed, *shape)
    clean = lp.clone().requires_grad_()
    dirty = nan_fill(lp, mask).requires_grad_()
    want = fn(clean, old, adv, None)
    got = fn(dirty, nan_fill(old, mask), nan_fill(adv, mask), mask)
    torch.testing.assert_close(got[mask], want[mask], rtol=0, atol=0)
    assert bool((got[~mask] == 0).all())
    weights = torch.randn(lp.shape, dtype=F64, generator=torch.Generator().manual_seed(seed))
    (g_clean,) = torch.autograd.grad((want * weights)[mask].sum(), clean)
    (g_dirty,) = torch.autograd.grad((got * weights).sum(), dirty)
    assert bool(torch.isfinite(g_dirty).all())
    assert bool((g_dirty[~mask] == 0).all())
    torch.testing.assert_close(g_dirty[mask], g_clean[mask], rtol=0, atol=0)


def test_policy_losses_with_mask_clear_clipped_at_masked_positions():
    lp, old, adv, mask = make(3, 4, 6)
    mask[1] = False
    old = torch.where(mask, old, lp + 5.0)  # a masked token far outside any clip range
    for _, clipped in (
        ppo_clip(lp, old, adv, eps_clip=0.1, dual_clip=2.0, mask=mask),
        cispo(lp, old, adv, eps_clip_high=0.1, mask=mask),
    ):
        assert not bool(clipped[~mask].any())


# ---------------------------------------------------------------- bad input

lp2 = torch.zeros(2, 3)
m2 = torch.ones(2, 3, dtype=torch.bool)

BAD_INPUTS = [
    (lambda: ppo_clip(lp2, lp2, lp2, mask=m2.float()), TypeError, "mask"),
    (lambda: cispo(lp2, lp2, lp2, eps_clip_high=0.2, mask=m2[:, :2]), ValueError, "mask has shape (2, 2)"),
    (lambda: value_loss(lp2, lp2, torch.full((2, 3), float("inf")), mask=m2), ValueError, "returns"),
    (lambda: approx_kl(lp2, lp2, importance_ratio=torch.ones(3)), ValueError, "importance_ratio (3,)"),
    (lambda: sft_loss(torch.full((2, 3), float("nan")), mask=m2), ValueError, "log_probs"),
    (lambda: entropy_bonus(lp2, mask=m2[0]), ValueError, "mask has shape (3,)"),
    (lambda: approx_kl(torch.zeros(2, 3, dtype=torch.long), lp2), TypeError, "shape (2, 3)"),
    (lambda: approx_kl(lp2, torch.zeros(2, 4)), ValueError, "shapes must match"),
    (lambda: approx_kl(lp2, lp2, kind="k4"), ValueError, "kind"),
    (lambda: approx_kl([0.0], lp2), TypeError, "log_probs"),
    (lambda: approx_kl(torch.zeros(2, 3, dtype=torch.long), lp2), TypeError, "floating"),
    (lambda: ppo_clip(lp2, lp2, torch.zeros(3)), ValueError, "advantages (3,)"),
    (lambda: ppo_clip(lp2, lp2, lp2, dual_clip=1.0), ValueError, "dual_clip"),
    (lambda: ppo_clip(lp2, lp2, lp2, eps_clip=-0.1), ValueError, "eps_clip"),
    (lambda: ppo_clip(lp2, lp2, lp2, eps_clip_high=-1.0), ValueError, "eps_clip_high"),
    (lambda: gspo(lp2, lp2, lp2, m2.float(), eps_clip=0.1), TypeError, "mask"),
    (lambda: gspo(lp2, lp2, lp2, m2[:, :2], eps_clip=0.1), ValueError, "mask has shape (2, 2)"),
    (lambda: gspo(lp2, lp2, torch.full((2, 3), float("nan")), m2, eps_clip=0.1), ValueError, "advantages"),
    (lambda: gspo(lp2[0], lp2[0], lp2[0], m2[0], eps_clip=0.1), ValueError, "2 dimension"),
    (lambda: cispo(lp2, lp2, lp2[:1], eps_clip_high=1.0), ValueError, "advantages (1, 3)"),
    (lambda: cispo(lp2, lp2, lp2, eps_clip_high=-2.0), ValueError, "eps_clip_high"),
    (lambda: mismatch_weights(lp2, lp2, m2, mode="clip"), ValueError, "mode"),
    (lambda: mismatch_weights(lp2, lp2, m2, level="batch"), ValueError, "level"),
    (lambda: mismatch_weights(lp2, lp2, m2.int()), TypeError, "mask"),
    (lambda: mismatch_weights(lp2, lp2[:, :1], m2), ValueError, "rollout_log_probs (2, 1)"),
    (lambda: mismatch_weights(lp2, torch.full((2, 3), float("inf")), m2), ValueError, "rollout_log_probs"),
    (lambda: mismatch_weights(lp2, lp2, m2, high=0.0), ValueError, "high"),
    (lambda: mismatch_weights(lp2, lp2, m2, low=3.0, high=2.0), ValueError, "low"),
    (lambda: mismatch_weights(lp2, lp2, m2, mode="icepop", high=0.5), ValueError, "low"),
    (lambda: value_loss(lp2, lp2, lp2[0]), ValueError, "returns (3,)"),
    (lambda: value_loss(lp2, lp2, lp2, clip=-1.0), ValueError, "clip"),
    (lambda: sft_loss(torch.zeros(2, dtype=torch.long)), TypeError, "log_probs"),
    (lambda: entropy_bonus(lp2, coef="x"), TypeError, "coef"),
    (lambda: aggregate(lp2, m2, mode="sum"), ValueError, "mode"),
    (lambda: aggregate(lp2, m2.float()), TypeError, "mask"),
    (lambda: aggregate(lp2, m2[:1]), ValueError, "mask has shape (1, 3)"),
    (lambda: aggregate(lp2[0], m2[0]), ValueError, "per_token must have 2"),
    (lambda: aggregate(torch.full((2, 3), float("nan")), m2), ValueError, "per_token"),
    (lambda: aggregate(lp2, m2, norm=(1, 1, 1)), TypeError, "norm"),
    (lambda: Normalizer(-1, 1, 1), ValueError, "num_tokens"),
    (lambda: Normalizer(1, torch.zeros(2), 1), ValueError, "num_seqs"),
    (lambda: Normalizer(1, 1, 2.5), TypeError, "max_len"),
    (lambda: Normalizer.of(m2.float()), TypeError, "mask"),
]


@pytest.mark.parametrize(("call", "error", "needle"), BAD_INPUTS)
def test_bad_input_raises_naming_the_argument(call, error, needle):
    with pytest.raises(error) as info:
        call()
    assert needle in str(info.value), str(info.value)
