"""rl_loss and LossConfig: hand computations, split invariance, padding, bad input; Normalizer across ranks."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from rlcore import keys
from rlcore.losses import AGG_MODES, LossConfig, Normalizer, aggregate, cispo, gspo, rl_loss

F64 = torch.float64
TOKEN_KEYS = (
    keys.LOG_PROBS,
    keys.OLD_LOG_PROBS,
    keys.ROLLOUT_LOG_PROBS,
    keys.REF_LOG_PROBS,
    keys.ENTROPY,
    keys.VALUES,
    keys.OLD_VALUES,
    keys.RETURNS,
    keys.ADVANTAGES,
)


def make_batch(seed: int, B: int, T: int, *, density: float = 0.7) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    log_probs = -torch.rand(B, T, generator=g, dtype=F64) * 3

    def near(x, scale):
        return x + scale * torch.randn(B, T, generator=g, dtype=F64)

    mask = torch.rand(B, T, generator=g) < density
    mask[0, 0] = True
    values = torch.randn(B, T, generator=g, dtype=F64)
    return TensorDict(
        {
            keys.MASK: mask,
            keys.LOG_PROBS: log_probs,
            keys.OLD_LOG_PROBS: near(log_probs, 0.3),
            keys.ROLLOUT_LOG_PROBS: near(log_probs, 0.5),
            keys.REF_LOG_PROBS: near(log_probs, 0.5),
            keys.ENTROPY: torch.rand(B, T, generator=g, dtype=F64) * 2,
            keys.VALUES: values,
            keys.OLD_VALUES: near(values, 0.3),
            keys.RETURNS: near(values, 1.0),
            keys.ADVANTAGES: torch.randn(B, T, generator=g, dtype=F64),
        },
        batch_size=[B],
    )


def ref_rl_loss(td: TensorDict, cfg: LossConfig) -> tuple[float, dict[str, float]]:
    """rl_loss for the PPO policy loss and token-level mismatch, one token at a time in Python floats."""
    d = {k: td[k].tolist() for k in (*TOKEN_KEYS, keys.MASK)}
    B, T = td[keys.MASK].shape
    el = cfg.eps_clip
    eh = el if cfg.eps_clip_high is None else cfg.eps_clip_high
    terms = {"pg": {}, "kl": {}, "ent": {}, "value": {}}
    stats = {"clip": [], "kl_old": [], "ratio": [], "w": [], "dropped": [], "kl_ref": [], "entropy": [], "vclip": []}
    for b in range(B):
        for t in range(T):
            if not d[keys.MASK][b][t]:
                continue
            lp, old = d[keys.LOG_PROBS][b][t], d[keys.OLD_LOG_PROBS][b][t]
            a, r = d[keys.ADVANTAGES][b][t], math.exp(lp - old)
            objective = min(r * a, min(max(r, 1 - el), 1 + eh) * a)
            clipped = (a > 0 and r > 1 + eh) or (a < 0 and r < 1 - el)
            if cfg.eps_clip_c is not None and a < 0 and cfg.eps_clip_c * a > objective:
                objective, clipped = cfg.eps_clip_c * a, True
            w, keep = 1.0, True
            if cfg.use_tis:
                mr = math.exp(old - d[keys.ROLLOUT_LOG_PROBS][b][t])
                high, low = cfg.tis_clip, cfg.tis_clip_low
                if cfg.tis_mode == "tis":
                    w = min(max(mr, low or 0.0), high)
                else:
                    lo = (1 / high if low is None else low) if cfg.tis_mode == "icepop" else low
                    keep = mr <= high and (lo is None or mr >= lo)
                    w = mr if keep else 0.0
                stats["w"].append(w)
                stats["dropped"].append(0.0 if keep else 1.0)
            log_ratio_ref = lp - d[keys.REF_LOG_PROBS][b][t]
            kl = {"k1": log_ratio_ref, "k2": log_ratio_ref**2 / 2}.get(
                cfg.kl_loss_type, math.exp(-log_ratio_ref) - 1 + log_ratio_ref
            )
            kl_loss = kl * r if cfg.use_unbiased_kl else kl  # slime weights first, then clamps low_var_kl
            if cfg.kl_loss_type == "low_var_kl":
                kl, kl_loss = min(max(kl, -10.0), 10.0), min(max(kl_loss, -10.0), 10.0)
            v, old_v, ret = (d[k][b][t] for k in (keys.VALUES, keys.OLD_VALUES, keys.RETURNS))
            vloss = (v - ret) ** 2
            if cfg.value_clip is not None:
                vloss = max(vloss, (old_v + min(max(v - old_v, -cfg.value_clip), cfg.value_clip) - ret) ** 2)
            entropy = d[keys.ENTROPY][b][t]
            terms["pg"][b, t] = -objective * w if keep else 0.0
            terms["kl"][b, t] = kl_loss if keep else 0.0
            terms["ent"][b, t] = -entropy if keep else 0.0
            terms["value"][b, t] = vloss
            stats["clip"].append(float(clipped))
            stats["kl_old"].append(old - lp)
            stats["ratio"].append(r)
            stats["kl_ref"].append(kl)
            stats["entropy"].append(entropy)
            stats["vclip"].append(float(abs(v - old_v) > cfg.value_clip) if cfg.value_clip is not None else 0.0)

    lengths = [sum(d[keys.MASK][b]) for b in range(B)]
    n_seqs = B  # every row is a sample, with or without a valid token
    n_tokens = sum(lengths)

    def agg(term):
        total = sum(term.values())
        if cfg.loss_agg_mode == "token_mean":
            return total / n_tokens
        if cfg.loss_agg_mode == "seq_mean_token_mean":
            return sum(
                sum(x for (bb, _), x in term.items() if bb == b) / lengths[b] for b in range(B) if lengths[b]
            ) / (n_seqs)
        if cfg.loss_agg_mode == "seq_mean_token_sum":
            return total / n_seqs
        return total / (n_seqs * T)

    pg, kl, ent, value = (agg(terms[k]) for k in ("pg", "kl", "ent", "value"))
    loss = pg + cfg.kl_loss_coef * kl + cfg.entropy_coef * ent + cfg.value_coef * value

    def mean(xs):
        return sum(xs) / n_tokens

    metrics = {
        "loss": loss,
        "pg_loss": pg,
        "kl_loss": kl,
        "entropy_loss": ent,
        "value_loss": value,
        "clipfrac": mean(stats["clip"]),
        "approx_kl_old": mean(stats["kl_old"]),
        "ratio_mean": mean(stats["ratio"]),
        "ratio_max": max(stats["ratio"]),
        "approx_kl_ref": mean(stats["kl_ref"]),
        "entropy": mean(stats["entropy"]),
    }
    if cfg.value_clip is not None:
        metrics["value_clipfrac"] = mean(stats["vclip"])
    if cfg.use_tis:
        metrics |= {
            "tis_weight_mean": mean(stats["w"]),
            "tis_weight_max": max(stats["w"]),
            "tis_masked_frac": mean(stats["dropped"]),
        }
    return loss, metrics


configs = st.builds(
    LossConfig,
    eps_clip=st.floats(0.05, 0.3),
    eps_clip_high=st.one_of(st.none(), st.floats(0.05, 0.4)),
    eps_clip_c=st.one_of(st.none(), st.floats(1.5, 3.0)),
    use_tis=st.booleans(),
    tis_mode=st.sampled_from(["tis", "mis", "icepop"]),
    tis_clip_low=st.one_of(st.none(), st.floats(0.1, 0.8)),
    tis_clip=st.floats(1.1, 3.0),
    use_kl_loss=st.just(True),
    kl_loss_coef=st.floats(0.0, 1.0),
    kl_loss_type=st.sampled_from(["k1", "k2", "k3", "low_var_kl"]),
    use_unbiased_kl=st.booleans(),
    entropy_coef=st.floats(0.001, 0.1),
    value_coef=st.floats(0.1, 1.0),
    value_clip=st.one_of(st.none(), st.floats(0.05, 0.5)),
    loss_agg_mode=st.sampled_from(AGG_MODES),
)
shapes = st.tuples(st.integers(1, 5), st.integers(1, 6))
seeds = st.integers(0, 2**31 - 1)


@given(shape=shapes, seed=seeds, cfg=configs)
def test_rl_loss_and_metrics_match_hand_computation(shape, seed, cfg):
    td = make_batch(seed, *shape)
    loss, metrics = rl_loss(td, cfg)
    want_loss, want_metrics = ref_rl_loss(td, cfg)
    assert math.isclose(float(loss), want_loss, rel_tol=1e-9, abs_tol=1e-12)
    assert set(metrics.keys()) == {*want_metrics, "rollout_log_prob_abs_diff"}
    for name, want in want_metrics.items():
        assert math.isclose(float(metrics[name]), want, rel_tol=1e-9, abs_tol=1e-12), name
    assert all(not v.requires_grad for v in metrics.values())


def test_unbiased_low_var_kl_clamps_after_the_importance_ratio():
    """k3 of a token with pi_ref / pi = 20 is ~16; with ratio pi / pi_old = 1/4 slime's loss term is ~4 (weighted,
    then clamped), not 2.5 (clamped to 10, then weighted)."""
    td = TensorDict(
        {
            keys.MASK: torch.tensor([[True, False]]),
            keys.LOG_PROBS: torch.tensor([[0.0, float("nan")]], dtype=F64),
            keys.OLD_LOG_PROBS: torch.tensor([[math.log(4.0), 0.0]], dtype=F64),
            keys.REF_LOG_PROBS: torch.tensor([[math.log(20.0), float("nan")]], dtype=F64),
            keys.ADVANTAGES: torch.tensor([[0.0, 0.0]], dtype=F64),
        },
        batch_size=[1],
    )
    cfg = LossConfig(use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type="low_var_kl", use_unbiased_kl=True)
    _, metrics = rl_loss(td, cfg)
    k3 = 20.0 - 1.0 - math.log(20.0)
    assert float(metrics["kl_loss"]) == pytest.approx(0.25 * k3, rel=1e-12)
    assert float(metrics["approx_kl_ref"]) == pytest.approx(10.0)  # the metric is the unweighted estimate


def test_rl_loss_on_a_tiny_batch_by_hand():
    td = TensorDict(
        {
            keys.MASK: torch.tensor([[True, True, False]]),
            keys.LOG_PROBS: torch.tensor([[math.log(0.5), math.log(0.5), float("nan")]]),
            keys.OLD_LOG_PROBS: torch.tensor([[math.log(0.25), math.log(0.5), 0.0]]),
            keys.ADVANTAGES: torch.tensor([[1.0, -2.0, float("inf")]]),
            keys.ENTROPY: torch.tensor([[1.0, 3.0, 0.0]]),
        },
        batch_size=[1],
    )
    loss, m = rl_loss(td, LossConfig(eps_clip=0.2, entropy_coef=0.1))
    # token 0: ratio 2, A=1 -> clipped at 1.2, loss -1.2; token 1: ratio 1, A=-2 -> loss 2; pg = 0.4
    # entropy mean 2 -> loss = 0.4 - 0.1 * 2
    assert float(m["pg_loss"]) == pytest.approx(0.4)
    assert float(loss) == pytest.approx(0.2)
    assert float(m["clipfrac"]) == pytest.approx(0.5)
    assert float(m["ratio_mean"]) == pytest.approx(1.5)
    assert float(m["ratio_max"]) == pytest.approx(2.0)
    assert float(m["approx_kl_old"]) == pytest.approx(-math.log(2) / 2)
    assert float(m["entropy"]) == pytest.approx(2.0)


def test_every_policy_loss_has_one_term_in_the_table():
    """rl_loss dispatches through a table; a name LossConfig accepts without a term would fail only at loss time."""
    from rlcore.losses import POLICY_LOSSES
    from rlcore.losses.rl_loss import _POLICY_TERMS

    assert tuple(_POLICY_TERMS) == POLICY_LOSSES


@given(shape=shapes, seed=seeds, policy=st.sampled_from(["gspo", "cispo"]), mode=st.sampled_from(AGG_MODES))
def test_rl_loss_gspo_and_cispo_are_the_aggregated_tensor_losses(shape, seed, policy, mode):
    td = make_batch(seed, *shape)
    cfg = LossConfig(policy_loss=policy, eps_clip=0.1, eps_clip_high=0.3, loss_agg_mode=mode)
    lp = td[keys.LOG_PROBS].clone().requires_grad_()
    loss, metrics = rl_loss(td.set(keys.LOG_PROBS, lp), cfg)
    mask, old, adv = td[keys.MASK], td[keys.OLD_LOG_PROBS], td[keys.ADVANTAGES]
    lp_ref = td[keys.LOG_PROBS].detach().clone().requires_grad_()
    if policy == "gspo":
        per_token, clipped = gspo(lp_ref, old, adv, mask, eps_clip=0.1, eps_clip_high=0.3)
    else:
        per_token, clipped = cispo(lp_ref, old, adv, eps_clip_high=0.3)
    want = aggregate(per_token, mask, mode=mode)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(metrics["clipfrac"], clipped[mask].double().mean())
    (g,) = torch.autograd.grad(loss, lp)
    (g_ref,) = torch.autograd.grad(want, lp_ref)
    torch.testing.assert_close(g, g_ref)


@st.composite
def split_batches(draw):
    B = draw(st.integers(1, 6))
    cuts = sorted(draw(st.sets(st.integers(1, B - 1), max_size=B - 1))) if B > 1 else []
    return B, draw(st.integers(1, 5)), [0, *cuts, B], draw(seeds)


@settings(max_examples=25)
@given(split=split_batches(), cfg=configs)
def test_rl_loss_over_micro_batches_with_global_normalizer_equals_full_batch(split, cfg):
    B, T, bounds, seed = split
    td = make_batch(seed, B, T)
    grads = {}
    for name, chunks in (("full", [(0, B)]), ("split", list(zip(bounds[:-1], bounds[1:], strict=True)))):
        lp = td[keys.LOG_PROBS].clone().requires_grad_()
        values = td[keys.VALUES].clone().requires_grad_()
        batch = td.clone().set(keys.LOG_PROBS, lp).set(keys.VALUES, values)
        norm = Normalizer.of(td[keys.MASK])
        outs = [rl_loss(batch[lo:hi], cfg, norm=norm) for lo, hi in chunks]
        total = sum(loss for loss, _ in outs)
        grads[name] = (total.detach(), *torch.autograd.grad(total, [lp, values]))
        means = {k: sum(float(m[k]) for _, m in outs) for k in ("clipfrac", "approx_kl_old", "entropy", "loss")}
        grads[name] += (means,)
    for a, b in zip(grads["full"][:3], grads["split"][:3], strict=True):
        torch.testing.assert_close(a, b)
    for key, value in grads["full"][3].items():
        assert math.isclose(value, grads["split"][3][key], rel_tol=1e-9, abs_tol=1e-12), key


@given(shape=shapes, seed=seeds, cfg=configs, fill=st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30]))
def test_rl_loss_ignores_whatever_masked_positions_hold(shape, seed, cfg, fill):
    td = make_batch(seed, *shape)
    mask = td[keys.MASK]
    poisoned = td.clone()
    for key in TOKEN_KEYS:
        poisoned[key] = torch.where(mask, td[key], torch.full_like(td[key], fill))
    results = []
    for batch in (td, poisoned):
        lp = batch[keys.LOG_PROBS].clone().requires_grad_()
        ent = batch[keys.ENTROPY].clone().requires_grad_()
        loss, metrics = rl_loss(batch.clone().set(keys.LOG_PROBS, lp).set(keys.ENTROPY, ent), cfg)
        results.append((loss, metrics, *torch.autograd.grad(loss, [lp, ent])))
    (la, ma, ga, ea), (lb, mb, gb, eb) = results
    torch.testing.assert_close(la, lb)
    for key in ma.keys():
        torch.testing.assert_close(ma[key], mb[key])
    torch.testing.assert_close(ga, gb)
    torch.testing.assert_close(ea, eb)
    assert not gb[~mask].any() and not eb[~mask].any()


def test_rl_loss_does_not_mutate_its_input():
    td = make_batch(3, 4, 5)
    td[keys.LOG_PROBS] = torch.where(td[keys.MASK], td[keys.LOG_PROBS], float("nan"))
    before = td.clone()
    rl_loss(
        td,
        LossConfig(
            use_tis=True, tis_mode="icepop", use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.1, value_coef=1.0
        ),
    )
    assert set(td.keys()) == set(before.keys())
    for key in before.keys():
        assert torch.equal(td[key].nan_to_num(), before[key].nan_to_num()), key


def test_rl_loss_without_old_log_probs_is_one_on_policy_step():
    td = make_batch(5, 3, 4)
    on_policy = td.clone().set(keys.OLD_LOG_PROBS, td[keys.LOG_PROBS].clone())
    loss_a, metrics_a = rl_loss(td.exclude(keys.OLD_LOG_PROBS), LossConfig())
    loss_b, metrics_b = rl_loss(on_policy, LossConfig())
    torch.testing.assert_close(loss_a, loss_b)
    assert float(metrics_a["ratio_max"]) == 1.0 and float(metrics_a["clipfrac"]) == 0.0


def test_rl_loss_float32_batch_gives_float32_loss():
    td = make_batch(1, 2, 3).apply(lambda x: x.float() if x.is_floating_point() else x)
    loss, metrics = rl_loss(td, LossConfig(use_kl_loss=True, kl_loss_coef=0.1))
    assert loss.dtype == torch.float32 and metrics["pg_loss"].dtype == torch.float32


# ---------------------------------------------------------------- bad input


def _td(**changes):
    td = make_batch(0, 2, 3)
    for key, value in changes.items():
        if value is None:
            td = td.exclude(key)
        else:
            td[key] = value
    return td


BAD_CONFIGS = [
    (dict(eps_clip=-0.1), ValueError, "LossConfig.eps_clip must be >= 0"),
    (dict(eps_clip_high=-0.1), ValueError, "LossConfig.eps_clip_high"),
    (dict(eps_clip=float("nan")), ValueError, "LossConfig.eps_clip must be finite"),
    (dict(eps_clip_c=1.0), ValueError, "LossConfig.eps_clip_c must be > 1"),
    (dict(value_clip=-0.2), ValueError, "LossConfig.value_clip"),
    (dict(value_coef=-1.0), ValueError, "LossConfig.value_coef"),
    (dict(kl_loss_coef=-0.1), ValueError, "LossConfig.kl_loss_coef"),
    (dict(tis_clip=0.0), ValueError, "LossConfig.tis_clip must be > 0"),
    (dict(tis_clip_low=2.0, tis_clip=2.0), ValueError, "LossConfig.tis_clip_low"),
    (dict(tis_clip_low=-0.5), ValueError, "LossConfig.tis_clip_low"),
    (dict(use_tis="yes"), TypeError, "LossConfig.use_tis"),
    (dict(use_unbiased_kl=1), TypeError, "LossConfig.use_unbiased_kl"),
    (dict(eps_clip_high="0.3"), TypeError, "LossConfig.eps_clip_high"),
    (dict(policy_loss="grpo"), ValueError, "policy_loss"),
    (dict(loss_agg_mode="mean"), ValueError, "loss_agg_mode"),
    (dict(kl_loss_type="k4"), ValueError, "kl_loss_type"),
    (dict(tis_mode="truncate"), ValueError, "tis_mode"),
    (dict(tis_level="batch"), ValueError, "tis_level"),
    (dict(policy_loss="gspo", eps_clip_c=3.0), ValueError, "eps_clip_c"),
    (dict(tis_clip="2"), TypeError, "tis_clip"),
    (dict(entropy_coef="0.1"), TypeError, "entropy_coef"),
]


@pytest.mark.parametrize(("kwargs", "error", "needle"), BAD_CONFIGS)
def test_bad_loss_config_raises(kwargs, error, needle):
    with pytest.raises(error) as info:
        LossConfig(**kwargs)
    assert needle in str(info.value)


def test_loss_config_is_keyword_only():
    with pytest.raises(TypeError):
        LossConfig("ppo")


BAD_CALLS = [
    (lambda: rl_loss({"mask": torch.ones(2, 3, dtype=torch.bool)}, LossConfig()), TypeError, "td must be"),
    (lambda: rl_loss(_td(), {"policy_loss": "ppo"}), TypeError, "cfg must be"),
    (lambda: rl_loss(_td(mask=None), LossConfig()), ValueError, "'mask'"),
    (lambda: rl_loss(_td(mask=torch.ones(2, 3)), LossConfig()), TypeError, "mask"),
    (lambda: rl_loss(_td(advantages=None), LossConfig()), ValueError, "'advantages'"),
    (lambda: rl_loss(_td(log_probs=torch.zeros(2, 4)), LossConfig()), ValueError, "log_probs has shape (2, 4)"),
    (lambda: rl_loss(_td(log_probs=torch.full((2, 3), float("nan"))), LossConfig()), ValueError, "log_probs"),
    (lambda: rl_loss(_td(advantages=torch.zeros(2, 3, dtype=torch.long)), LossConfig()), TypeError, "advantages"),
    (lambda: rl_loss(_td(rollout_log_probs=None), LossConfig(use_tis=True)), ValueError, "'rollout_log_probs'"),
    (
        lambda: rl_loss(_td(ref_log_probs=None), LossConfig(use_kl_loss=True, kl_loss_coef=0.1)),
        ValueError,
        "'ref_log_probs'",
    ),
    (lambda: rl_loss(_td(entropy=None), LossConfig(entropy_coef=0.1)), ValueError, "'entropy'"),
    (lambda: rl_loss(_td(returns=None), LossConfig(value_coef=1.0)), ValueError, "'returns'"),
    (lambda: rl_loss(_td(), LossConfig(use_tis=True, tis_mode="icepop", tis_clip=0.5)), ValueError, "low"),
    (lambda: rl_loss(_td(), LossConfig(eps_clip=-0.5)), ValueError, "eps_clip"),
    (lambda: rl_loss(_td(), LossConfig(), norm=3), TypeError, "norm"),
]


@pytest.mark.parametrize(("call", "error", "needle"), BAD_CALLS)
def test_bad_rl_loss_input_raises_naming_the_argument(call, error, needle):
    with pytest.raises(error) as info:
        call()
    assert needle in str(info.value), str(info.value)


# ---------------------------------------------------------------- Normalizer across data-parallel ranks


def _rank_aggregate(rank: int, world: int, init_file: str, out_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        td = make_batch(11, 6, 5)
        rows = slice(0, 2) if rank == 0 else slice(2, 6)  # uneven shards
        mask = td[keys.MASK][rows]
        norm = Normalizer.of(mask).reduce(dist.group.WORLD)
        losses = torch.stack(
            [aggregate(td[keys.ADVANTAGES][rows], mask, mode=mode, norm=norm) for mode in AGG_MODES]
        ).contiguous()
        dist.all_reduce(losses, group=dist.group.WORLD)
        if rank == 0:
            torch.save(
                {"losses": losses, "norm": [int(norm.num_tokens), int(norm.num_seqs), int(norm.max_len)]}, out_file
            )
    finally:
        dist.destroy_process_group()


def test_normalizer_reduce_across_ranks_gives_the_global_loss(tmp_path):
    out = tmp_path / "out.pt"
    mp.start_processes(
        _rank_aggregate, args=(2, str(tmp_path / "init"), str(out)), nprocs=2, join=True, start_method="fork"
    )
    result = torch.load(out)
    td = make_batch(11, 6, 5)
    mask = td[keys.MASK]
    full = Normalizer.of(mask)
    assert result["norm"] == [int(full.num_tokens), int(full.num_seqs), int(full.max_len)]
    want = torch.stack([aggregate(td[keys.ADVANTAGES], mask, mode=mode) for mode in AGG_MODES])
    torch.testing.assert_close(result["losses"], want)
