"""Parity with slime's formulas under slime's flags: the flags go through ``rlcore-run``'s parser, the runtime builds
rlcore's configs from them, and rlcore's advantages and losses must equal references written in float64 from the
formulas of slime's ``ppo_utils.py`` and ``loss.py`` (SLIME_REFERENCE.md, section 2.1), not from rlcore."""

import pytest
import torch
from tensordict import TensorDict

from rlcore import keys
from rlcore.advantages import compute, sequence_advantages
from rlcore.losses import Normalizer, rl_loss
from runtime.config import ConfigError, build_parser, from_dict, parse_args
from runtime.train.algo import advantage_config, loss_config, model_roles
from runtime.train.step import train_rollout

F64 = torch.float64
B, T, N = 6, 5, 3  # two prompts x three samples


def slime_cfg(*argv):
    """A job's config from slime-style flags (a model and prompts are named, so slime's defaults apply)."""
    namespace = vars(build_parser().parse_args(["--hf-checkpoint", "model", *argv]))
    namespace.pop("dry_run", None)
    return from_dict(**namespace)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, 5, 3, 4, 2, 5])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    old = -torch.rand(B, T, generator=g, dtype=F64) - 0.1
    return TensorDict(
        {
            keys.MASK: mask,
            keys.REWARDS: torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0], dtype=F64),
            keys.GROUP_IDS: torch.arange(B) // N,
            keys.OLD_LOG_PROBS: old,
            keys.LOG_PROBS: old + 0.3 * torch.randn(B, T, generator=g, dtype=F64),
            keys.ROLLOUT_LOG_PROBS: old + 0.3 * torch.randn(B, T, generator=g, dtype=F64),
            keys.REF_LOG_PROBS: old + 0.2 * torch.randn(B, T, generator=g, dtype=F64),
        },
        batch_size=[B],
    )


def advantages(cfg, td):
    adv_cfg = advantage_config(cfg)
    return compute(sequence_advantages(td, adv_cfg), adv_cfg)[keys.ADVANTAGES]


def slime_group_normalized(rewards, *, std):
    """slime's _post_process_rewards: rewards in blocks of n, minus the block mean, over (unbiased std + 1e-6)."""
    grouped = rewards.view(-1, N)
    centred = grouped - grouped.mean(-1, keepdim=True)
    if std:
        centred = centred / (centred.std(-1, keepdim=True) + 1e-6)
    return centred.reshape(-1)


def assert_valid_close(got, want, mask):
    # Sequence advantages travel as float32 (the batch contract), so float32 precision is the bar here.
    torch.testing.assert_close(got[mask].double(), want.expand_as(got)[mask], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- advantages


def test_grpo_ignores_kl_coef_as_slime_does():
    td = batch()
    cfg = slime_cfg("--advantage-estimator", "grpo", "--kl-coef", "0.1", "--n-samples-per-prompt", "3")
    want = slime_group_normalized(td[keys.REWARDS], std=True)[:, None]
    assert_valid_close(advantages(cfg, td), want, td[keys.MASK])
    # No reference model is loaded for a coefficient that is not used.
    assert "reference" not in [role.name for role in model_roles(cfg)]


@pytest.mark.parametrize("estimator", ["grpo", "gspo", "cispo"])
def test_disable_grpo_std_normalization_is_dr_grpo(estimator):
    td = batch()
    cfg = slime_cfg("--advantage-estimator", estimator, "--disable-grpo-std-normalization")
    want = slime_group_normalized(td[keys.REWARDS], std=False)[:, None]
    assert_valid_close(advantages(cfg, td), want, td[keys.MASK])


def test_disable_rewards_normalization_trains_on_raw_rewards():
    td = batch()
    cfg = slime_cfg("--disable-rewards-normalization")
    assert_valid_close(advantages(cfg, td), td[keys.REWARDS][:, None], td[keys.MASK])


def test_reinforce_plus_plus_baseline_subtracts_the_kl_in_the_reward():
    td = batch()
    cfg = slime_cfg("--advantage-estimator", "reinforce_plus_plus_baseline", "--kl-coef", "0.1")
    kl = td[keys.OLD_LOG_PROBS] - td[keys.REF_LOG_PROBS]  # k1, slime's default --kl-loss-type
    want = slime_group_normalized(td[keys.REWARDS], std=False)[:, None] - 0.1 * kl
    assert_valid_close(advantages(cfg, td), want, td[keys.MASK])


@pytest.mark.parametrize("whiten", [False, True])
def test_opd_is_added_to_any_estimators_advantages_before_whitening(whiten):
    g = torch.Generator().manual_seed(3)
    td = batch().set(keys.TEACHER_LOG_PROBS, batch()[keys.OLD_LOG_PROBS] + 0.4 * torch.randn(B, T, generator=g))
    argv = ["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "teacher", "--opd-kl-coef", "0.5"]
    cfg = slime_cfg(*argv, *(["--normalize-advantages"] if whiten else []))
    mask = td[keys.MASK]
    want = slime_group_normalized(td[keys.REWARDS], std=True)[:, None] - 0.5 * (
        td[keys.OLD_LOG_PROBS] - td[keys.TEACHER_LOG_PROBS]
    )
    if whiten:  # slime's distributed_masked_whiten: unbiased variance, 1e-8 inside the rsqrt
        values = want.expand(B, T)[mask]
        mean, var = values.mean(), values.var(unbiased=True)
        want = (want - mean) * torch.rsqrt(var + 1e-8)
    assert_valid_close(advantages(cfg, td), want, mask)
    assert "teacher" in [role.name for role in model_roles(cfg)]


# ---------------------------------------------------------------- losses


def slime_reduce(x, mask, *, per_token):
    """slime's reducer over a step: per-sample token means then their mean (default), or a global token mean."""
    m = mask.to(F64)
    if per_token:
        return (x * m).sum() / m.sum(-1).clamp(min=1).sum()
    return ((x * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()


def slime_ppo(log_probs, old, adv, eps_low=0.2, eps_high=0.2):
    ratio = torch.exp(log_probs - old)
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_low, 1 + eps_high))


def with_advantages(td, adv):
    return td.clone().set(keys.ADVANTAGES, adv.expand(B, T).clone())


def loss_of(cfg, td, *, split=(3,)):
    """rlcore's loss, summed over micro-batches cut at ``split`` with the global batch's Normalizer."""
    norm = Normalizer.of(td[keys.MASK])
    bounds = [0, *split, B]
    total, metrics = 0.0, []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        loss, m = rl_loss(td[lo:hi], loss_config(cfg), norm=norm)
        total = total + loss
        metrics.append(m)
    return total, metrics


@pytest.mark.parametrize("per_token", [False, True])
def test_ppo_loss_under_both_aggregation_defaults(per_token):
    td = batch()
    adv = torch.linspace(-1, 1, B, dtype=F64)[:, None]
    flags = ["--eps-clip-high", "0.28", *(["--calculate-per-token-loss"] if per_token else [])]
    cfg = slime_cfg(*flags)
    assert cfg.algo.aggregation == ("token_mean" if per_token else "seq_mean_token_mean")
    got, _ = loss_of(cfg, with_advantages(td, adv))
    per_token_loss = slime_ppo(td[keys.LOG_PROBS], td[keys.OLD_LOG_PROBS], adv, 0.2, 0.28)
    want = slime_reduce(per_token_loss, td[keys.MASK], per_token=per_token)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_per_token_loss_contradicting_loss_agg_mode_is_refused():
    with pytest.raises(ConfigError, match="--calculate-per-token-loss is --loss-agg-mode token_mean"):
        parse_args(["--calculate-per-token-loss", "--loss-agg-mode", "seq_mean_token_mean"])


def test_cispo_loss_and_gradient_are_slimes():
    td = batch()
    adv = torch.linspace(-1, 1, B, dtype=F64)[:, None]
    cfg = slime_cfg("--advantage-estimator", "cispo", "--eps-clip", "0.2", "--eps-clip-high", "0.28")
    log_probs = td[keys.LOG_PROBS].clone().requires_grad_()
    got, _ = loss_of(cfg, with_advantages(td, adv).set(keys.LOG_PROBS, log_probs))
    got.backward()
    ref_lp = td[keys.LOG_PROBS].clone().requires_grad_()
    weight = torch.exp(ref_lp - td[keys.OLD_LOG_PROBS]).detach().clamp(0.8, 1.28)
    want = slime_reduce(-weight * adv * ref_lp, td[keys.MASK], per_token=False)
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(log_probs.grad, ref_lp.grad, rtol=1e-9, atol=1e-12)
    # The lower bound is active at slime's default --eps-clip: a ratio of 0.5 weighs 0.8, not 0.5.
    assert bool((weight == 0.8).any())


def test_gspo_loss_is_slimes_sequence_ratio():
    td = batch()
    adv = torch.linspace(-1, 1, B, dtype=F64)[:, None]
    cfg = slime_cfg("--advantage-estimator", "gspo", "--eps-clip", "3e-4", "--eps-clip-high", "4e-4")
    got, _ = loss_of(cfg, with_advantages(td, adv))
    m = td[keys.MASK].to(F64)
    seq_kl = ((td[keys.OLD_LOG_PROBS] - td[keys.LOG_PROBS]) * m).sum(-1) / m.sum(-1).clamp(min=1)
    ratio = torch.exp(-seq_kl)[:, None]
    per_token_loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - 3e-4, 1 + 4e-4))
    torch.testing.assert_close(got, slime_reduce(per_token_loss, td[keys.MASK], per_token=False), rtol=1e-9, atol=0)


def test_unbiased_kl_loss_is_weighted_by_the_importance_ratio():
    td = batch()
    adv = torch.zeros(B, 1, dtype=F64)
    argv = ["--use-kl-loss", "--kl-loss-coef", "0.1", "--kl-loss-type", "low_var_kl", "--use-unbiased-kl"]
    _, metrics = loss_of(slime_cfg(*argv), with_advantages(td, adv), split=())
    d = td[keys.LOG_PROBS] - td[keys.REF_LOG_PROBS]
    kl = ((torch.exp(-d) - 1 + d) * torch.exp(td[keys.LOG_PROBS] - td[keys.OLD_LOG_PROBS])).clamp(-10, 10)
    want = slime_reduce(kl, td[keys.MASK], per_token=False)
    torch.testing.assert_close(metrics[0]["kl_loss"], want, rtol=1e-9, atol=1e-12)


def test_tis_weights_use_tis_clip_and_tis_clip_low():
    td = batch()
    adv = torch.linspace(-1, 1, B, dtype=F64)[:, None]
    cfg = slime_cfg("--use-tis", "--tis-clip", "1.2", "--tis-clip-low", "0.9")
    _, metrics = loss_of(cfg, with_advantages(td, adv), split=())
    weight = torch.exp(td[keys.OLD_LOG_PROBS] - td[keys.ROLLOUT_LOG_PROBS]).clamp(0.9, 1.2)
    per_token_loss = slime_ppo(td[keys.LOG_PROBS], td[keys.OLD_LOG_PROBS], adv) * weight
    want = slime_reduce(per_token_loss, td[keys.MASK], per_token=False)
    torch.testing.assert_close(metrics[0]["pg_loss"], want, rtol=1e-9, atol=1e-12)


def test_mismatch_metrics_leave_the_loss_alone():
    td = with_advantages(batch(), torch.linspace(-1, 1, B, dtype=F64)[:, None])
    plain, _ = loss_of(slime_cfg(), td, split=())
    measured, metrics = loss_of(slime_cfg("--get-mismatch-metrics"), td, split=())
    torch.testing.assert_close(measured, plain, rtol=0, atol=0)
    mask = td[keys.MASK]
    weight = torch.exp(td[keys.OLD_LOG_PROBS] - td[keys.ROLLOUT_LOG_PROBS]).clamp(0, 2)
    torch.testing.assert_close(metrics[0]["tis_weight_mean"], weight[mask].mean(), rtol=1e-9, atol=1e-12)
    assert "mismatch_k3" in metrics[0].keys()


def test_opsm_masks_negative_advantages_of_drifted_sequences():
    td = batch()
    adv = torch.tensor([-1.0, 1.0, -0.5, -1.0, 0.5, -2.0], dtype=F64)[:, None]
    cfg = slime_cfg("--use-opsm", "--opsm-delta", "0.05")
    got, metrics = loss_of(cfg, with_advantages(td, adv))
    m = td[keys.MASK].to(F64)
    seq_kl = ((td[keys.OLD_LOG_PROBS] - td[keys.LOG_PROBS]) * m).sum(-1) / m.sum(-1).clamp(min=1)
    dropped = (adv < 0) & (seq_kl > 0.05)[:, None]
    assert bool(dropped.any()) and not bool(dropped.all())  # the case is not trivial
    per_token_loss = slime_ppo(td[keys.LOG_PROBS], td[keys.OLD_LOG_PROBS], adv) * (~dropped).to(F64)
    torch.testing.assert_close(got, slime_reduce(per_token_loss, td[keys.MASK], per_token=False), rtol=1e-9, atol=0)


class _RecordingBackend:
    """The three TrainBackend methods train_rollout calls, recording the shard it trains on."""

    def __init__(self, recompute):
        self.recompute = recompute

    def dp_info(self):
        return 0, 1

    def dp_group(self):
        return None

    def compute_log_probs(self, td):
        return TensorDict({keys.OLD_LOG_PROBS: self.recompute.clone()}, batch_size=td.batch_size)

    def train(self, td, *, per_step_rows, rollout_id=None):
        self.trained = td
        return {}


@pytest.mark.parametrize("use_rollout", [False, True])
def test_use_rollout_logprobs_makes_the_engines_log_probs_the_old_ones(use_rollout):
    td = batch()
    cfg = slime_cfg(*(["--use-rollout-logprobs"] if use_rollout else []))
    adv_cfg = advantage_config(cfg)
    recompute = td[keys.OLD_LOG_PROBS] + 1.0
    backend = _RecordingBackend(recompute)
    rows = sequence_advantages(td.exclude(keys.OLD_LOG_PROBS, keys.LOG_PROBS), adv_cfg)
    train_rollout(backend, rows, global_batch_size=B, adv_cfg=adv_cfg, use_rollout_log_probs=cfg.use_rollout_logprobs)
    want = td[keys.ROLLOUT_LOG_PROBS] if use_rollout else recompute
    torch.testing.assert_close(backend.trained[keys.OLD_LOG_PROBS], want, rtol=0, atol=0)


def test_use_rollout_logprobs_and_use_tis_exclude_each_other():
    with pytest.raises(ConfigError, match="--use-rollout-logprobs"):
        parse_args(["--use-rollout-logprobs", "--use-tis"])
