"""rlcore.advantages against float64 loop references, torchrl, and invariants (hypothesis)."""

import math
import statistics
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict
from torchrl.objectives.value.functional import generalized_advantage_estimate, vec_generalized_advantage_estimate

from rlcore import keys
from rlcore.advantages import (
    ESTIMATORS,
    AdvantageConfig,
    broadcast,
    compute,
    distillation,
    gae,
    grpo,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    rloo,
    whiten,
)

F64 = torch.float64


# ----------------------------------------------------------------------------- inputs


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_mask(batch: int, length: int, *, seed: int, p_valid: float = 0.7) -> torch.Tensor:
    """Holes anywhere (tool output mid-response), right padding, and one all-masked row when batch > 2."""
    g = _gen(seed)
    mask = torch.rand(batch, length, generator=g) < p_valid
    lengths = torch.randint(0, length + 1, (batch,), generator=g)
    mask &= torch.arange(length)[None, :] < lengths[:, None]
    if batch > 2:
        mask[-1] = False
    return mask


def random_tokens(mask: torch.Tensor, *, seed: int, scale: float = 1.0, dtype=F64) -> torch.Tensor:
    return scale * torch.randn(mask.shape, generator=_gen(seed), dtype=dtype)


def group_ids_of(sizes: list[int], ids: list[int], *, seed: int) -> torch.Tensor:
    """Samples of groups of the given sizes and ids, shuffled so that groups are not contiguous."""
    flat = torch.tensor([gid for gid, size in zip(ids, sizes, strict=True) for _ in range(size)], dtype=torch.int64)
    return flat[torch.randperm(flat.numel(), generator=_gen(seed))]


def poison(x: torch.Tensor, mask: torch.Tensor, *, seed: int) -> torch.Tensor:
    """``x`` with every masked position replaced by NaN, +inf, -inf or a huge number."""
    junk = torch.tensor([math.nan, math.inf, -math.inf, 1e30], dtype=x.dtype)
    pick = torch.randint(0, 4, x.shape, generator=_gen(seed))
    return torch.where(mask, x, junk[pick])


# ----------------------------------------------------------------------------- float64 references (slow and obvious)


def ref_gae(rewards, values, mask, gamma, lam):
    adv = torch.zeros(mask.shape, dtype=F64)
    ret = torch.zeros(mask.shape, dtype=F64)
    for b in range(mask.shape[0]):
        valid = [t for t in range(mask.shape[1]) if mask[b, t]]
        running = 0.0
        for k in reversed(range(len(valid))):
            t = valid[k]
            next_value = float(values[b, valid[k + 1]]) if k + 1 < len(valid) else 0.0
            delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
            running = delta + gamma * lam * running
            adv[b, t] = running
            ret[b, t] = running + float(values[b, t])
    return adv, ret


def ref_reinforce_plus_plus(rewards, kl, mask, kl_coef, gamma):
    out = torch.zeros(mask.shape, dtype=F64)
    for b in range(mask.shape[0]):
        valid = [t for t in range(mask.shape[1]) if mask[b, t]]
        running = 0.0
        for k in reversed(range(len(valid))):
            t = valid[k]
            token_reward = -kl_coef * float(kl[b, t]) + (float(rewards[b]) if k == len(valid) - 1 else 0.0)
            running = token_reward + gamma * running
            out[b, t] = running
    return out


def _members(group_ids, i):
    return [j for j in range(len(group_ids)) if group_ids[j] == group_ids[i]]


def ref_grpo(rewards, group_ids, std_normalize, eps):
    out = torch.zeros(len(rewards), dtype=F64)
    for i in range(len(rewards)):
        group = rewards[_members(group_ids, i)].to(F64)
        out[i] = float(rewards[i]) - float(group.mean())
        if std_normalize:
            out[i] /= float(torch.std(group)) + eps
    return out


def ref_rloo(rewards, group_ids):
    out = torch.zeros(len(rewards), dtype=F64)
    for i in range(len(rewards)):
        others = [j for j in _members(group_ids, i) if j != i]
        out[i] = float(rewards[i]) - sum(float(rewards[j]) for j in others) / len(others)
    return out


def ref_rpp_baseline(rewards, group_ids, kl, mask, kl_coef):
    out = torch.zeros(mask.shape, dtype=F64)
    for b in range(mask.shape[0]):
        baseline = sum(float(rewards[j]) for j in _members(group_ids, b)) / len(_members(group_ids, b))
        for t in range(mask.shape[1]):
            if mask[b, t]:
                out[b, t] = float(rewards[b]) - baseline - kl_coef * float(kl[b, t])
    return out


def ref_broadcast(seq, mask):
    out = torch.zeros(mask.shape, dtype=F64)
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[b, t]:
                out[b, t] = float(seq[b])
    return out


def ref_distillation(teacher, student, mask):
    out = torch.zeros(mask.shape, dtype=F64)
    for b, t in mask.nonzero().tolist():
        out[b, t] = float(teacher[b, t]) - float(student[b, t])
    return out


def ref_whiten(x, mask, shift_mean, eps):
    vals = [float(v) for v, keep in zip(x.flatten(), mask.flatten(), strict=True) if keep]
    n = len(vals)
    mean = sum(vals) / n
    var = sum((v - mean) ** 2 for v in vals) / (n - 1 if n >= 2 else n)
    out = torch.zeros(x.shape, dtype=F64)
    for idx in mask.nonzero().tolist():
        out[tuple(idx)] = (float(x[tuple(idx)]) - mean) / math.sqrt(var + eps) + (0.0 if shift_mean else mean)
    return out


def ref_kl(log_probs, ref_log_probs, kind):
    out = torch.zeros(log_probs.shape, dtype=F64)
    for idx in torch.ones(log_probs.shape, dtype=torch.bool).nonzero().tolist():
        log_ratio = float(log_probs[tuple(idx)]) - float(ref_log_probs[tuple(idx)])
        value = {
            "k1": log_ratio,
            "k2": 0.5 * log_ratio**2,
            "k3": math.exp(-log_ratio) - 1 + log_ratio,
            "low_var_kl": min(10.0, math.exp(-log_ratio) - 1 + log_ratio),
        }[kind]
        out[tuple(idx)] = value
    return out


def close(actual, expected, *, tol=1e-9):
    torch.testing.assert_close(actual.to(F64), expected.to(F64), rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- (1) references on random inputs


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.5, 1.0), (0.0, 0.3), (1.0, 0.0)])
def test_gae_matches_reference(seed, gamma, lam):
    mask = random_mask(5, 37, seed=seed)
    rewards, values = random_tokens(mask, seed=seed + 100), random_tokens(mask, seed=seed + 200)
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = ref_gae(rewards, values, mask, gamma, lam)
    assert adv.dtype == F64 and ret.dtype == F64
    close(adv, ref_adv)
    close(ret, ref_ret)
    adv32, ret32 = gae(rewards.float(), values.float(), mask, gamma=gamma, lam=lam)
    assert adv32.dtype == torch.float32
    close(adv32, ref_adv, tol=1e-4)
    close(ret32, ref_ret, tol=1e-4)


@pytest.mark.parametrize(("length", "discount"), [(8192, 1.0), (8192, 0.999), (8192, 0.5), (3000, 0.0), (1, 0.9)])
def test_gae_long_sequences_stay_accurate(length, discount):
    """The blocked scan must be as stable as the loop for T=8192 and gamma*lam both < 1 and = 1."""
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[1, length // 3 :: 7] = False
    rewards = random_tokens(mask, seed=1)
    values = torch.zeros_like(rewards)
    adv, _ = gae(rewards, values, mask, gamma=discount, lam=1.0)
    adv32, _ = gae(rewards.float(), values.float(), mask, gamma=discount, lam=1.0)
    ref = torch.zeros_like(rewards)
    for b in range(2):
        running = torch.zeros((), dtype=F64)
        for t in reversed(mask[b].nonzero().flatten().tolist()):
            running = rewards[b, t] + discount * running
            ref[b, t] = running
    scale = ref.abs().max()
    assert torch.isfinite(adv32).all()
    assert float((adv - ref).abs().max() / scale) < 1e-12
    assert float((adv32.double() - ref).abs().max() / scale) < 1e-5


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("std_normalize", [True, False])
def test_grpo_matches_reference(seed, std_normalize):
    group_ids = group_ids_of([3, 2, 5, 4], [7, -(2**40), 0, 123456789], seed=seed)
    rewards = torch.randn(len(group_ids), generator=_gen(seed), dtype=F64)
    out = grpo(rewards, group_ids, std_normalize=std_normalize, eps=1e-6)
    close(out, ref_grpo(rewards, group_ids, std_normalize, 1e-6))
    close(grpo(rewards.float(), group_ids, std_normalize=std_normalize), out, tol=1e-5)


def test_grpo_equal_rewards_give_zero():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0])
    out = grpo(rewards, torch.tensor([4, 4, 4, 9, 9]))
    close(out[:3], torch.zeros(3, dtype=F64))
    close(out[3:], torch.tensor([-0.5, 0.5], dtype=F64) / (2**-0.5 + 1e-6), tol=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_rloo_matches_reference(seed):
    group_ids = group_ids_of([2, 6, 3], [-5, 10**12, 1], seed=seed)
    rewards = torch.randn(len(group_ids), generator=_gen(seed), dtype=F64)
    close(rloo(rewards, group_ids), ref_rloo(rewards, group_ids))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("kl_coef", "gamma"), [(0.0, 1.0), (0.1, 1.0), (0.05, 0.9)])
def test_reinforce_plus_plus_matches_reference(seed, kl_coef, gamma):
    mask = random_mask(4, 23, seed=seed)
    rewards = torch.randn(4, generator=_gen(seed), dtype=F64)
    kl = random_tokens(mask, seed=seed + 5).abs()
    out = reinforce_plus_plus(rewards, kl, mask, kl_coef=kl_coef, gamma=gamma)
    close(out, ref_reinforce_plus_plus(rewards, kl, mask, kl_coef, gamma))


@pytest.mark.parametrize("seed", range(3))
def test_reinforce_plus_plus_baseline_matches_reference(seed):
    group_ids = group_ids_of([2, 1, 3], [3, 1, 2], seed=seed)
    mask = random_mask(6, 11, seed=seed)
    rewards = torch.randn(6, generator=_gen(seed), dtype=F64)
    kl = random_tokens(mask, seed=seed + 9)
    out = reinforce_plus_plus_baseline(rewards, group_ids, kl, mask, kl_coef=0.2)
    close(out, ref_rpp_baseline(rewards, group_ids, kl, mask, 0.2))


@pytest.mark.parametrize("seed", range(3))
def test_distillation_and_broadcast_match_reference(seed):
    mask = random_mask(4, 9, seed=seed)
    teacher, student = random_tokens(mask, seed=seed) - 2, random_tokens(mask, seed=seed + 1) - 2
    close(distillation(teacher, student, mask), ref_distillation(teacher, student, mask))
    seq = torch.randn(4, generator=_gen(seed), dtype=F64)
    close(broadcast(seq, mask), ref_broadcast(seq, mask))
    assert broadcast(seq.float(), mask).dtype == torch.float32


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("shift_mean", [True, False])
@pytest.mark.parametrize("shape", [(5, 13), (40,), (2, 3, 4)])
def test_whiten_matches_reference(seed, shift_mean, shape):
    mask = torch.rand(shape, generator=_gen(seed)) < 0.6
    mask.view(-1)[0] = True
    x = 3.0 + 2.0 * torch.randn(shape, generator=_gen(seed + 1), dtype=F64)
    close(whiten(x, mask, shift_mean=shift_mean, eps=1e-8), ref_whiten(x, mask, shift_mean, 1e-8))
    close(whiten(x.float(), mask, shift_mean=shift_mean), ref_whiten(x, mask, shift_mean, 1e-8), tol=1e-5)


def _batch(seed: int, *, batch: int = 6, length: int = 10) -> TensorDict:
    """A rollout batch with NaN/inf at masked positions and groups of differing sizes (2 and more)."""
    mask = random_mask(batch, length, seed=seed)
    mask[-1] = mask[0]  # the all-masked row of random_mask is not wanted here: compute whitens the whole batch
    mask[0, 0] = True
    policy = random_tokens(mask, seed=seed + 1, scale=0.5, dtype=torch.float32) - 1.0
    return TensorDict(
        {
            keys.MASK: mask,
            keys.OLD_LOG_PROBS: poison(policy, mask, seed=seed),
            keys.REF_LOG_PROBS: poison(
                policy + 0.3 * random_tokens(mask, seed=seed + 2, dtype=torch.float32), mask, seed=seed + 1
            ),
            keys.TEACHER_LOG_PROBS: poison(random_tokens(mask, seed=seed + 3, dtype=torch.float32) - 1, mask, seed=2),
            keys.VALUES: poison(random_tokens(mask, seed=seed + 4, dtype=torch.float32), mask, seed=seed + 3),
            keys.REWARDS: torch.randn(batch, generator=_gen(seed + 5)),
            keys.GROUP_IDS: group_ids_of(
                [2] * (batch // 2 - 1) + [2 + batch % 2], [11 * i - 3 for i in range(batch // 2)], seed=seed
            ),
        },
        batch_size=[batch],
    )


def _ref_compute(td: TensorDict, cfg: AdvantageConfig):
    mask = td[keys.MASK]
    rewards, group_ids = td[keys.REWARDS].to(F64), td[keys.GROUP_IDS]
    policy = td[keys.OLD_LOG_PROBS].to(F64)
    kl = torch.where(mask, ref_kl(policy, td[keys.REF_LOG_PROBS].to(F64), cfg.kl_kind), 0.0)
    penalty = -cfg.kl_coef * kl
    name = cfg.estimator
    if name == "gae":
        token_rewards = penalty.clone()
        for b in range(mask.shape[0]):
            valid = mask[b].nonzero().flatten()
            if len(valid):
                token_rewards[b, valid[-1]] += rewards[b]
        adv, ret = ref_gae(token_rewards, td[keys.VALUES].to(F64), mask, cfg.gamma, cfg.lam)
    elif name == "reinforce_plus_plus":
        adv = ret = ref_reinforce_plus_plus(rewards, kl, mask, cfg.kl_coef, cfg.gamma)
    elif name == "reinforce_plus_plus_baseline":
        adv = ret = ref_rpp_baseline(rewards, group_ids, kl, mask, cfg.kl_coef)
    elif name == "distillation":
        adv = ret = ref_distillation(td[keys.TEACHER_LOG_PROBS].to(F64), policy, mask) + penalty
    else:
        seq = (
            ref_rloo(rewards, group_ids)
            if name == "rloo"
            else ref_grpo(rewards, group_ids, cfg.std_normalize and name != "dr_grpo", cfg.eps)
        )
        adv = ret = ref_broadcast(seq, mask) + penalty
    if cfg.whiten:
        adv = ref_whiten(adv, mask, True, cfg.whiten_eps)
    return adv, ret


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize(
    ("kl_coef", "kl_kind", "whiten_it"),
    [(0.0, "k1", False), (0.1, "k1", True), (0.05, "k3", False), (0.2, "k2", True)],
)
def test_compute_matches_reference(estimator, kl_coef, kl_kind, whiten_it):
    td = _batch(0, batch=7)
    cfg = AdvantageConfig(estimator=estimator, kl_coef=kl_coef, kl_kind=kl_kind, whiten=whiten_it, gamma=0.97, lam=0.9)
    before = {k: v.clone() for k, v in td.items()}
    out = compute(td, cfg)
    ref_adv, ref_ret = _ref_compute(td, cfg)
    assert out[keys.ADVANTAGES].dtype == torch.float32 and out[keys.RETURNS].dtype == torch.float32
    assert out[keys.ADVANTAGES].shape == td[keys.MASK].shape
    close(out[keys.ADVANTAGES], ref_adv, tol=2e-5)
    close(out[keys.RETURNS], ref_ret, tol=2e-5)
    assert set(td.keys()) == set(before), "compute added keys to its input"
    for k, v in before.items():
        torch.testing.assert_close(td[k], v, equal_nan=True)
    for k in before:
        assert out[k] is td[k]


def test_compute_prefers_old_log_probs_and_falls_back_to_log_probs():
    td = _batch(1)
    cfg = AdvantageConfig(estimator="dr_grpo", kl_coef=0.1)
    with_old = compute(td, cfg)
    renamed = td.clone()
    renamed[keys.LOG_PROBS] = renamed.pop(keys.OLD_LOG_PROBS)
    torch.testing.assert_close(compute(renamed, cfg)[keys.ADVANTAGES], with_old[keys.ADVANTAGES])
    renamed[keys.OLD_LOG_PROBS] = renamed[keys.LOG_PROBS] + 1.0
    assert not torch.allclose(compute(renamed, cfg)[keys.ADVANTAGES], with_old[keys.ADVANTAGES])


def test_compute_without_kl_needs_no_log_probs():
    td = _batch(2).exclude(keys.OLD_LOG_PROBS, keys.REF_LOG_PROBS)
    out = compute(td, AdvantageConfig(estimator="reinforce_plus_plus_baseline"))
    assert torch.isfinite(out[keys.ADVANTAGES]).all()


# ----------------------------------------------------------------------------- (2) invariants (hypothesis)

ids_strategy = st.lists(st.integers(-(2**62), 2**62), min_size=1, max_size=5, unique=True)


@st.composite
def groups(draw, *, min_size: int):
    ids = draw(ids_strategy)
    sizes = draw(st.lists(st.integers(min_size, 5), min_size=len(ids), max_size=len(ids)))
    group_ids = group_ids_of(sizes, ids, seed=draw(st.integers(0, 2**16)))
    rewards = torch.tensor(
        draw(st.lists(st.floats(-10, 10, allow_subnormal=False), min_size=len(group_ids), max_size=len(group_ids))),
        dtype=F64,
    )
    return rewards, group_ids


def _per_group_sums(x, group_ids):
    ids, inverse = torch.unique(group_ids, return_inverse=True)
    return torch.zeros(len(ids), dtype=x.dtype).index_add_(0, inverse, x)


@given(data=groups(min_size=2), std_normalize=st.booleans(), shift_seed=st.integers(0, 2**16))
def test_grpo_zero_sum_and_group_shift_invariance(data, std_normalize, shift_seed):
    rewards, group_ids = data
    out = grpo(rewards, group_ids, std_normalize=std_normalize)
    close(_per_group_sums(out, group_ids), torch.zeros(len(torch.unique(group_ids)), dtype=F64), tol=1e-9)
    shift_per_id = {
        int(g): float(s)
        for g, s in zip(torch.unique(group_ids), torch.randn(99, generator=_gen(shift_seed)) * 5, strict=False)
    }
    shifted = rewards + torch.tensor([shift_per_id[int(g)] for g in group_ids], dtype=F64)
    close(grpo(shifted, group_ids, std_normalize=std_normalize), out, tol=1e-6)


@given(data=groups(min_size=1))
def test_dr_grpo_allows_groups_of_one(data):
    rewards, group_ids = data
    out = grpo(rewards, group_ids, std_normalize=False)
    close(out, ref_grpo(rewards, group_ids, False, 0.0))


@given(data=groups(min_size=2), scale=st.floats(0.1, 10), shift=st.floats(-100, 100))
def test_rloo_invariants(data, scale, shift):
    rewards, group_ids = data
    out = rloo(rewards, group_ids)
    close(_per_group_sums(out, group_ids), torch.zeros(len(torch.unique(group_ids)), dtype=F64), tol=1e-9)
    close(rloo(scale * rewards + shift, group_ids), scale * out, tol=1e-7)
    sizes = torch.tensor([int((group_ids == g).sum()) for g in group_ids], dtype=F64)
    close(out, grpo(rewards, group_ids, std_normalize=False) * sizes / (sizes - 1), tol=1e-9)


token_case = st.tuples(
    st.integers(1, 6), st.integers(1, 40), st.integers(0, 2**16), st.floats(0.0, 1.0), st.floats(0.0, 1.0)
)


@given(case=token_case)
def test_token_functions_ignore_masked_values(case):
    batch, length, seed, gamma, lam = case
    mask = random_mask(batch, length, seed=seed)
    a, b = random_tokens(mask, seed=seed + 1), random_tokens(mask, seed=seed + 2)
    a_bad, b_bad = poison(a, mask, seed=seed), poison(b, mask, seed=seed + 1)
    rewards = torch.randn(batch, generator=_gen(seed), dtype=F64)
    group_ids = torch.arange(batch) // 2
    pairs = [
        (gae(a, b, mask, gamma=gamma, lam=lam), gae(a_bad, b_bad, mask, gamma=gamma, lam=lam)),
        (
            reinforce_plus_plus(rewards, a, mask, kl_coef=0.3, gamma=gamma),
            reinforce_plus_plus(rewards, a_bad, mask, kl_coef=0.3, gamma=gamma),
        ),
        (
            reinforce_plus_plus_baseline(rewards, group_ids, a, mask, kl_coef=0.3),
            reinforce_plus_plus_baseline(rewards, group_ids, a_bad, mask, kl_coef=0.3),
        ),
        (distillation(a, b, mask), distillation(a_bad, b_bad, mask)),
    ]
    if mask.any():
        pairs.append((whiten(a, mask), whiten(a_bad, mask)))
    for clean, dirty in pairs:
        torch.testing.assert_close(dirty, clean, rtol=0, atol=0)
    # Nothing wrote into its inputs.
    torch.testing.assert_close(a_bad, poison(a, mask, seed=seed), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(b_bad, poison(b, mask, seed=seed + 1), rtol=0, atol=0, equal_nan=True)
    for out in [gae(a_bad, b_bad, mask, gamma=gamma, lam=lam)[0], distillation(a_bad, b_bad, mask)]:
        assert torch.isfinite(out).all() and (out[~mask] == 0).all()


@given(case=token_case, estimator=st.sampled_from(ESTIMATORS), whiten_it=st.booleans())
def test_compute_ignores_masked_values(case, estimator, whiten_it):
    batch, length, seed, gamma, lam = case
    td = _batch(seed, batch=2 * batch, length=length)
    cfg = AdvantageConfig(estimator=estimator, kl_coef=0.1, whiten=whiten_it, gamma=gamma, lam=lam)
    clean = td.clone()
    mask = td[keys.MASK]
    for key in (keys.OLD_LOG_PROBS, keys.REF_LOG_PROBS, keys.TEACHER_LOG_PROBS, keys.VALUES):
        clean[key] = torch.where(mask, td[key], 0.0)
    out_dirty, out_clean = compute(td, cfg), compute(clean, cfg)
    for key in (keys.ADVANTAGES, keys.RETURNS):
        torch.testing.assert_close(out_dirty[key], out_clean[key], rtol=0, atol=0)
        assert (out_dirty[key][~mask] == 0).all()


def _token_advantage_calls(mask, rewards, group_ids, gamma, lam):
    """Every token-level advantage function as ``(name, number of [B, T] inputs, call)``."""
    calls = [
        ("gae", 2, lambda a, b: torch.cat(gae(a, b, mask, gamma=gamma, lam=lam))),
        ("reinforce_plus_plus", 1, lambda a: reinforce_plus_plus(rewards, a, mask, kl_coef=0.3, gamma=gamma)),
        (
            "reinforce_plus_plus_baseline",
            1,
            lambda a: reinforce_plus_plus_baseline(rewards, group_ids, a, mask, kl_coef=0.3),
        ),
        ("distillation", 2, lambda a, b: distillation(a, b, mask)),
    ]
    if mask.any():
        calls += [
            ("whiten", 1, lambda a: whiten(a, mask)),
            ("whiten (shift_mean=False)", 1, lambda a: whiten(a, mask, shift_mean=False)),
        ]
    return calls


@given(case=token_case)
def test_token_functions_give_clean_gradients_under_nan_padding(case):
    """NaN/inf padding gives gradients that are finite everywhere, 0 at masked positions and, at valid ones, equal
    to those of zero padding (the backward must never meet 0 * NaN)."""
    batch, length, seed, gamma, lam = case
    mask = random_mask(batch, length, seed=seed)
    rewards = torch.randn(batch, generator=_gen(seed), dtype=F64)
    group_ids = torch.arange(batch) // 2
    weights = torch.randn(batch, length, generator=_gen(seed + 3), dtype=F64)
    for name, arity, call in _token_advantage_calls(mask, rewards, group_ids, gamma, lam):
        clean_inputs = [torch.where(mask, random_tokens(mask, seed=seed + k), 0.0) for k in range(arity)]
        clean = [x.clone().requires_grad_() for x in clean_inputs]
        dirty = [poison(x, mask, seed=seed + k).requires_grad_() for k, x in enumerate(clean_inputs)]
        out_clean, out_dirty = call(*clean), call(*dirty)
        w = weights.repeat(out_clean.shape[0] // batch, 1)
        grads_clean = torch.autograd.grad((out_clean * w).sum(), clean)
        grads_dirty = torch.autograd.grad((out_dirty * w).sum(), dirty)
        for g_clean, g_dirty in zip(grads_clean, grads_dirty, strict=True):
            assert bool(torch.isfinite(g_dirty).all()), name
            assert bool((g_dirty[~mask] == 0).all()), name
            torch.testing.assert_close(g_dirty, g_clean, rtol=1e-12, atol=1e-12, msg=name)


def test_whiten_has_no_cancellation_when_the_spread_is_tiny_next_to_the_mean():
    """Values near 1e8 spread by ~0.1: E[x^2] - E[x]^2 would lose every digit of the variance in float64 (the
    spacing of doubles near 1e16 is 2). The tolerance is what the inputs' own rounding (1.5e-8 / 0.1) allows."""
    mask = torch.ones(50, dtype=torch.bool)
    mask[::7] = False
    x = 1e8 + 0.1 * torch.randn(50, generator=_gen(5), dtype=F64)
    valid = x[mask].tolist()
    mean, var = statistics.mean(valid), statistics.variance(valid)  # exact rational arithmetic
    want = torch.tensor([(v - mean) / math.sqrt(var + 1e-8) for v in valid], dtype=F64)
    torch.testing.assert_close(whiten(x, mask)[mask], want, rtol=1e-5, atol=1e-5)


def test_whiten_of_a_tensor_that_requires_grad_does_not_warn():
    x = torch.randn(3, 4, generator=_gen(6), dtype=F64).requires_grad_()
    mask = torch.rand(3, 4, generator=_gen(7)) < 0.8
    mask[0, 0] = True
    # torch warns about converting a tensor that requires grad to a scalar only once per process unless told always.
    warn_always = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            whiten(x, mask).sum().backward()
    finally:
        torch.set_warn_always(warn_always)


@given(
    batch=st.integers(1, 6),
    length=st.integers(1, 12),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, F64, torch.bfloat16]),
)
def test_broadcast_spreads_each_value_over_its_valid_tokens_only(batch, length, seed, dtype):
    mask = random_mask(batch, length, seed=seed)
    values = torch.randn(batch, generator=_gen(seed), dtype=F64).to(dtype)
    # A sample without a valid token may hold anything, NaN included: it reaches neither output nor gradient.
    values = torch.where(mask.any(1), values, torch.tensor(math.nan, dtype=dtype)).requires_grad_()
    out = broadcast(values, mask)
    assert out.dtype == dtype and out.shape == mask.shape
    assert bool((out[~mask] == 0).all())
    rows, cols = mask.nonzero(as_tuple=True)
    torch.testing.assert_close(out[rows, cols], values.detach()[rows], rtol=0, atol=0)
    (grad,) = torch.autograd.grad(out.sum(), values)
    torch.testing.assert_close(grad, mask.sum(1).to(dtype), rtol=0, atol=0)


def test_grpo_rejects_eps_zero_because_equal_rewards_would_give_nan():
    with pytest.raises(ValueError, match=r"eps must be a finite number > 0, got 0.0"):
        grpo(torch.ones(3), torch.tensor([7, 7, 7]), eps=0.0)
    with pytest.raises(ValueError, match=r"eps must be a finite number > 0"):
        AdvantageConfig(eps=0.0)
    assert bool((grpo(torch.full((4,), 0.5), torch.tensor([1, 1, 1, 1])) == 0).all())


@given(seed=st.integers(0, 2**16), n=st.integers(2, 60), loc=st.floats(-100, 100), scale=st.floats(0.01, 100))
def test_whiten_gives_mean_zero_and_unit_variance(seed, n, loc, scale):
    mask = torch.rand(n + 5, generator=_gen(seed)) < 0.7
    mask[:2] = True
    x = loc + scale * torch.randn(n + 5, generator=_gen(seed + 1), dtype=F64)
    out = whiten(poison(x, mask, seed=seed), mask, eps=0.0)
    assert abs(float(out[mask].mean())) < 1e-9
    assert abs(float(out[mask].var()) - 1.0) < 1e-9
    kept = whiten(x, mask, shift_mean=False, eps=0.0)
    assert abs(float(kept[mask].mean()) - float(x[mask].mean())) < 1e-9 * max(1.0, abs(loc))


@given(case=token_case)
def test_reinforce_plus_plus_without_kl_is_the_reward_on_every_valid_token(case):
    batch, length, seed, _, _ = case
    mask = random_mask(batch, length, seed=seed)
    rewards = torch.randn(batch, generator=_gen(seed), dtype=F64)
    kl = poison(random_tokens(mask, seed=seed), mask, seed=seed)
    close(reinforce_plus_plus(rewards, kl, mask, kl_coef=0.0), ref_broadcast(rewards, mask))


# ----------------------------------------------------------------------------- (3) gae against torchrl


def _torchrl_gae(fn, rewards, values, mask, gamma, lam):
    """torchrl has no masks: run it on each row's valid tokens packed to the left, one trajectory per row.

    torchrl's ``next_state_value`` at the last valid token is ignored because that step is ``terminated`` (the value
    after the last valid token is 0); the zero padding after it is a separate trajectory that is discarded.
    """
    batch, length = mask.shape
    packed_r, packed_v = (
        torch.zeros(batch, length, 1, dtype=rewards.dtype),
        torch.zeros(batch, length, 1, dtype=values.dtype),
    )
    terminated = torch.zeros(batch, length, 1, dtype=torch.bool)
    terminated[:, -1] = True
    for b in range(batch):
        valid = mask[b].nonzero().flatten()
        packed_r[b, : len(valid), 0] = rewards[b, valid]
        packed_v[b, : len(valid), 0] = values[b, valid]
        if len(valid):
            terminated[b, len(valid) - 1] = True
    next_v = torch.cat([packed_v[:, 1:], torch.zeros_like(packed_v[:, :1])], dim=1)
    adv, target = fn(gamma, lam, packed_v, next_v, packed_r, terminated.clone(), terminated.clone())
    out_adv, out_ret = torch.zeros(batch, length, dtype=rewards.dtype), torch.zeros(batch, length, dtype=rewards.dtype)
    for b in range(batch):
        valid = mask[b].nonzero().flatten()
        out_adv[b, valid] = adv[b, : len(valid), 0]
        out_ret[b, valid] = target[b, : len(valid), 0]
    return out_adv, out_ret


@pytest.mark.parametrize("fn", [generalized_advantage_estimate, vec_generalized_advantage_estimate])
@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.3)])
def test_gae_agrees_with_torchrl(fn, holes, gamma, lam):
    mask = random_mask(6, 50, seed=3, p_valid=0.75 if holes else 1.0)
    rewards = random_tokens(mask, seed=4, dtype=torch.float32)
    values = random_tokens(mask, seed=5, dtype=torch.float32)
    ours_adv, ours_ret = gae(poison(rewards, mask, seed=1), poison(values, mask, seed=2), mask, gamma=gamma, lam=lam)
    theirs_adv, theirs_ret = _torchrl_gae(fn, rewards, values, mask, gamma, lam)
    torch.testing.assert_close(ours_adv, theirs_adv, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours_ret, theirs_ret, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- (5) whiten over a process group


def _whiten_shards(seed: int, *, empty_rank: int | None = None):
    """Two ranks' (x, mask) of different shapes, NaN at masked positions; one rank may own no valid entry."""
    shards = []
    for rank, shape in enumerate([(3, 5), (4, 2)]):
        mask = torch.rand(shape, generator=_gen(seed + rank)) < 0.6
        mask.view(-1)[0] = rank != empty_rank
        mask &= rank != empty_rank
        x = 1.5 + 4.0 * torch.randn(shape, generator=_gen(seed + 10 + rank), dtype=F64)
        shards.append((poison(x, mask, seed=seed + rank), mask))
    return shards


def _whiten_worker(rank: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        for shards in (_whiten_shards(0), _whiten_shards(1, empty_rank=1)):
            x, mask = shards[rank]
            flat_x = torch.cat([s[0].flatten() for s in shards])
            flat_mask = torch.cat([s[1].flatten() for s in shards])
            for shift_mean in (True, False):
                expected = whiten(flat_x, flat_mask, shift_mean=shift_mean)
                mine = expected.split([s[0].numel() for s in shards])[rank].view(x.shape)
                out = whiten(x, mask, shift_mean=shift_mean, group=dist.group.WORLD)
                torch.testing.assert_close(out, mine, rtol=1e-12, atol=1e-12)
    finally:
        dist.destroy_process_group()


def test_whiten_over_a_gloo_group_equals_whitening_the_concatenation(tmp_path):
    # fork, not spawn: a spawned child re-imports torch, tensordict and this module (tens of seconds on a busy CI
    # box). The children set one intra-op thread first, so the parent's OpenMP pool is never touched after the fork.
    mp.start_processes(_whiten_worker, args=(str(tmp_path / "store"),), nprocs=2, join=True, start_method="fork")


# ----------------------------------------------------------------------------- (4) bad input

M = torch.ones(2, 3, dtype=torch.bool)
X = torch.zeros(2, 3)
R = torch.zeros(2)
G = torch.tensor([1, 1])
X_NAN = torch.tensor([[0.0, math.nan, 0.0], [0.0, 0.0, 0.0]])

BAD_INPUTS = {
    "gae values shape": (lambda: gae(X, torch.zeros(2, 4), M), ValueError, r"values.*\(2, 4\)"),
    "gae mask shape": (lambda: gae(X, X, torch.ones(2, 4, dtype=torch.bool)), ValueError, r"mask.*\(2, 4\).*\(2, 3\)"),
    "gae float mask": (lambda: gae(X, X, M.float()), TypeError, r"mask.*bool.*float32"),
    "gae 1-d mask": (lambda: gae(X[0], X[0], M[0]), ValueError, r"mask.*\(3,\)"),
    "gae nan reward": (lambda: gae(X_NAN, X, M), ValueError, r"token_rewards.*non-finite.*\(0, 1\)"),
    "gae nan value": (lambda: gae(X, X_NAN, M), ValueError, r"values.*non-finite"),
    "gae int rewards": (lambda: gae(X.long(), X, M), TypeError, r"token_rewards.*floating.*int64 \(shape \(2, 3\)\)"),
    "gae gamma": (lambda: gae(X, X, M, gamma=1.5), ValueError, r"gamma.*\[0, 1\]"),
    "gae lam": (lambda: gae(X, X, M, lam=-0.1), ValueError, r"lam.*\[0, 1\]"),
    "grpo group of one": (lambda: grpo(torch.zeros(3), torch.tensor([1, 1, 2])), ValueError, r"group_ids.*group 2"),
    "grpo float ids": (lambda: grpo(R, G.float()), TypeError, r"group_ids.*integer.*float32 \(shape \(2,\)\)"),
    "grpo ids shape": (lambda: grpo(R, torch.tensor([1, 1, 1])), ValueError, r"group_ids.*\(3,\).*rewards.*\(2,\)"),
    "grpo nan reward": (lambda: grpo(torch.tensor([0.0, math.nan]), G), ValueError, r"rewards.*non-finite.*1"),
    "grpo 2-d rewards": (lambda: grpo(X, G), ValueError, r"rewards.*\(2, 3\)"),
    "grpo eps": (lambda: grpo(R, G, eps=-1.0), ValueError, r"eps"),
    "rloo group of one": (lambda: rloo(torch.zeros(3), torch.tensor([1, 1, 2])), ValueError, r"group_ids.*rloo"),
    "rloo nan": (lambda: rloo(torch.tensor([math.inf, 0.0]), G), ValueError, r"rewards.*non-finite"),
    "rpp kl shape": (lambda: reinforce_plus_plus(R, torch.zeros(2, 4), M, kl_coef=0.1), ValueError, r"kl.*\(2, 4\)"),
    "rpp batch": (lambda: reinforce_plus_plus(torch.zeros(3), X, M, kl_coef=0.1), ValueError, r"rewards.*\(3,\)"),
    "rpp kl nan": (lambda: reinforce_plus_plus(R, X_NAN, M, kl_coef=0.1), ValueError, r"kl.*non-finite"),
    "rpp kl_coef": (lambda: reinforce_plus_plus(R, X, M, kl_coef=-1.0), ValueError, r"kl_coef"),
    "rpp gamma": (lambda: reinforce_plus_plus(R, X, M, kl_coef=0.0, gamma=2.0), ValueError, r"gamma"),
    "rppb ids": (
        lambda: reinforce_plus_plus_baseline(R, torch.tensor([1]), X, M, kl_coef=0.1),
        ValueError,
        r"group_ids.*\(1,\)",
    ),
    "rppb mask": (lambda: reinforce_plus_plus_baseline(R, G, X, M.int(), kl_coef=0.1), TypeError, r"mask.*bool"),
    "rppb nan kl": (lambda: reinforce_plus_plus_baseline(R, G, X_NAN, M, kl_coef=0.1), ValueError, r"kl.*non-finite"),
    "distill shape": (lambda: distillation(X, torch.zeros(3, 3), M), ValueError, r"log_probs.*\(3, 3\)"),
    "distill nan": (lambda: distillation(X_NAN, X, M), ValueError, r"teacher_log_probs.*non-finite"),
    "broadcast batch": (lambda: broadcast(torch.zeros(3), M), ValueError, r"seq_values.*\(3,\).*mask.*\(2, 3\)"),
    "broadcast nan": (lambda: broadcast(torch.tensor([0.0, math.nan]), M), ValueError, r"seq_values.*non-finite"),
    "broadcast ints": (lambda: broadcast(G, M), TypeError, r"seq_values.*floating"),
    "whiten mask shape": (lambda: whiten(X, torch.ones(3, 2, dtype=torch.bool)), ValueError, r"mask.*\(3, 2\)"),
    "whiten empty": (lambda: whiten(X, torch.zeros(2, 3, dtype=torch.bool)), ValueError, r"no valid entry.*\(2, 3\)"),
    "whiten nan": (lambda: whiten(X_NAN, M), ValueError, r"x.*non-finite"),
    "whiten mask dtype": (lambda: whiten(X, M.to(torch.uint8)), TypeError, r"mask.*bool.*uint8"),
    "config estimator": (lambda: AdvantageConfig(estimator="ppo2"), ValueError, r"estimator 'ppo2'"),
    "config kl kind": (lambda: AdvantageConfig(kl_kind="k4"), ValueError, r"kl_kind 'k4'"),
    "config gamma": (lambda: AdvantageConfig(gamma=1.1), ValueError, r"gamma"),
    "config positional": (lambda: AdvantageConfig("grpo"), TypeError, r"positional"),
    "compute not td": (lambda: compute({keys.MASK: M}, AdvantageConfig()), TypeError, r"td must be a TensorDict"),
    "compute cfg": (lambda: compute(_batch(0), {"estimator": "grpo"}), TypeError, r"cfg must be an AdvantageConfig"),
    "compute missing key": (
        lambda: compute(_batch(0).exclude(keys.VALUES), AdvantageConfig(estimator="gae")),
        ValueError,
        r"'gae' needs key 'values'",
    ),
    "compute missing ref": (
        lambda: compute(_batch(0).exclude(keys.REF_LOG_PROBS), AdvantageConfig(kl_coef=0.1)),
        ValueError,
        r"needs key 'ref_log_probs'",
    ),
    "compute nan at valid": (
        lambda: compute(
            TensorDict({keys.MASK: M, keys.VALUES: X_NAN, keys.REWARDS: R}, [2]), AdvantageConfig(estimator="gae")
        ),
        ValueError,
        r"values.*non-finite",
    ),
    "compute kl overflow": (
        lambda: compute(
            TensorDict({keys.MASK: M, keys.OLD_LOG_PROBS: X, keys.REF_LOG_PROBS: X + 200.0, keys.REWARDS: R}, [2]),
            AdvantageConfig(estimator="reinforce_plus_plus", kl_coef=0.1, kl_kind="k3"),
        ),
        ValueError,
        r"kl \(k3 of ref_log_probs\).*non-finite",
    ),
    "compute nan old_log_probs": (
        lambda: compute(
            TensorDict({keys.MASK: M, keys.OLD_LOG_PROBS: X_NAN, keys.REF_LOG_PROBS: X, keys.REWARDS: R}, [2]),
            AdvantageConfig(estimator="reinforce_plus_plus", kl_coef=0.1),
        ),
        ValueError,
        r"old_log_probs.*non-finite",
    ),
    "compute gae 2-d rewards": (
        lambda: compute(
            TensorDict({keys.MASK: M, keys.VALUES: X, keys.REWARDS: X}, [2]), AdvantageConfig(estimator="gae")
        ),
        ValueError,
        r"rewards.*\(2, 3\)",
    ),
    "compute grpo group of one": (
        lambda: compute(
            TensorDict({keys.MASK: M, keys.REWARDS: R, keys.GROUP_IDS: torch.tensor([1, 2])}, [2]), AdvantageConfig()
        ),
        ValueError,
        r"group_ids.*1 sample",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_with_a_clear_message(case):
    call, error, pattern = BAD_INPUTS[case]
    with pytest.raises(error, match=pattern):
        call()


def test_frozen_config():
    cfg = AdvantageConfig()
    with pytest.raises(AttributeError):
        cfg.estimator = "gae"
