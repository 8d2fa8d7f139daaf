"""slime's ``--advantage-estimator ppo``: GAE advantages from a critic, the critic's targets and value loss (against
float64 references written from slime's ``loss.py`` formulas, not from rlcore), the torch backend's critic role, and
a PPO job through ``rlcore-run`` whose value loss falls."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from rlcore import keys
from rlcore.advantages import compute, sequence_advantages
from rlcore.losses import Normalizer, critic_loss
from runtime.cli import main
from runtime.config import ConfigError, build_parser, from_dict, parse_args, validate
from runtime.demo import task
from runtime.demo.tiny_model import make_tiny_model
from runtime.rollout.sample import Sample
from runtime.train.algo import advantage_config, loss_config, model_roles
from runtime.train.backends.torch_backend import TorchTrainer
from runtime.train.backends.torch_models import VALUE_HEAD_INIT_STD
from runtime.train.batch import build_batch
from runtime.train.roles import ACTOR, CRITIC
from runtime.train.step import critic_targets, train_rollout

F64 = torch.float64
B, T = 4, 6


def slime_cfg(*argv):
    namespace = vars(build_parser().parse_args(["--hf-checkpoint", "model", *argv]))
    namespace.pop("dry_run", None)
    return from_dict(**namespace)


def ppo_batch(seed=0):
    """Prefix masks (slime's masks have no holes at the advantage step), rewards, values, old and ref log-probs."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, 6, 3, 4])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    old = -torch.rand(B, T, generator=g, dtype=F64) - 0.1
    values = torch.randn(B, T, generator=g, dtype=F64)
    return TensorDict(
        {
            keys.MASK: mask,
            keys.REWARDS: torch.tensor([1.0, 0.0, 0.5, -1.0], dtype=F64),
            keys.GROUP_IDS: torch.arange(B),
            keys.OLD_LOG_PROBS: old,
            keys.REF_LOG_PROBS: old + 0.2 * torch.randn(B, T, generator=g, dtype=F64),
            keys.VALUES: values.masked_fill(~mask, float("nan")),  # padding may hold anything
        },
        batch_size=[B],
    )


def slime_gae(td, *, kl_coef, gamma, lambd):
    """slime's ppo branch: u_t = -kl_coef * k1(old, ref), the reward added at the last response position, then
    chunked_gae's scan (V after the last position is 0) and returns = A + V; rows of R response tokens."""
    adv, ret = torch.zeros(B, T, dtype=F64), torch.zeros(B, T, dtype=F64)
    for i in range(B):
        R = int(td[keys.MASK][i].sum())
        v = td[keys.VALUES][i, :R]
        u = -kl_coef * (td[keys.OLD_LOG_PROBS][i, :R] - td[keys.REF_LOG_PROBS][i, :R])
        u[R - 1] += td[keys.REWARDS][i]
        last = 0.0
        for t in reversed(range(R)):
            next_v = v[t + 1] if t + 1 < R else 0.0
            last = u[t] + gamma * next_v - v[t] + gamma * lambd * last
            adv[i, t] = last
        ret[i, :R] = adv[i, :R] + v
    return adv, ret


def assert_valid_close(got, want, mask):
    torch.testing.assert_close(got[mask].to(F64), want[mask], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- advantages and the critic's targets


@pytest.mark.parametrize(("kl_coef", "gamma", "lambd"), [(0.0, 1.0, 1.0), (0.1, 0.9, 0.8), (0.05, 1.0, 0.95)])
def test_ppo_advantages_and_returns_are_slimes_gae(kl_coef, gamma, lambd):
    cfg = slime_cfg(
        "--advantage-estimator", "ppo", "--kl-coef", str(kl_coef), "--gamma", str(gamma), "--lambd", str(lambd)
    )
    td = ppo_batch()
    out = compute(sequence_advantages(td, advantage_config(cfg)), advantage_config(cfg))
    want_adv, want_ret = slime_gae(td, kl_coef=kl_coef, gamma=gamma, lambd=lambd)
    assert_valid_close(out[keys.ADVANTAGES], want_adv, td[keys.MASK])
    assert_valid_close(out[keys.RETURNS], want_ret, td[keys.MASK])


def test_critic_targets_are_the_gae_returns_without_the_kl_penalty():
    # slime's critic group runs with kl_coef 0 (and no OPD, no whitening): its targets are the rewards' returns, while
    # the actor's advantages carry the KL penalty.
    cfg = slime_cfg("--advantage-estimator", "ppo", "--kl-coef", "0.1", "--gamma", "0.9", "--normalize-advantages")
    td = ppo_batch()
    adv_cfg = advantage_config(cfg)
    targets = critic_targets(compute(td, adv_cfg), adv_cfg)
    _, want = slime_gae(td, kl_coef=0.0, gamma=0.9, lambd=1.0)
    assert set(targets.keys()) == {keys.MASK, keys.REWARDS, keys.OLD_VALUES, keys.RETURNS}
    assert_valid_close(targets[keys.RETURNS], want, td[keys.MASK])
    torch.testing.assert_close(targets[keys.OLD_VALUES], td[keys.VALUES], equal_nan=True)


def slime_value_loss(values, old_values, returns, mask, *, clip, per_token):
    """slime's value_loss_function with its reducer: max of the clipped and unclipped squared errors, no 1/2."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    per = torch.maximum((clipped - returns) ** 2, (values - returns) ** 2)
    per = torch.where(mask, per, 0.0)
    m = mask.to(F64)
    if per_token:
        return per.sum() / m.sum(-1).clamp(min=1).sum()
    return (per.sum(-1) / m.sum(-1).clamp(min=1)).mean()


def value_batch(seed, *, n=B, min_len=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, T + 1, (n,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    old = torch.randn(n, T, generator=g, dtype=F64)
    return TensorDict(
        {
            keys.MASK: mask,
            keys.VALUES: (old + 0.4 * torch.randn(n, T, generator=g, dtype=F64)).requires_grad_(),
            keys.OLD_VALUES: old.masked_fill(~mask, float("nan")),
            keys.RETURNS: torch.randn(n, T, generator=g, dtype=F64).masked_fill(~mask, float("inf")),
        },
        batch_size=[n],
    )


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("clip", [0.2, 0.05])
def test_critic_loss_and_gradient_are_slimes_value_loss(per_token, clip):
    cfg = slime_cfg(
        "--advantage-estimator", "ppo", "--value-clip", str(clip), *(["--calculate-per-token-loss"] * per_token)
    )
    lc = loss_config(cfg)
    # No empty rows: slime's per-token normalizer counts one token for them, rlcore's none (a documented difference).
    td = value_batch(1, min_len=1)
    values = td[keys.VALUES]
    loss, metrics = critic_loss(td, clip=lc.value_clip, loss_agg_mode=lc.loss_agg_mode)
    (grad,) = torch.autograd.grad(loss, values)
    ref_values = values.detach().clone().requires_grad_()
    mask = td[keys.MASK]
    old = torch.where(mask, td[keys.OLD_VALUES], 0.0)
    ret = torch.where(mask, td[keys.RETURNS], 0.0)
    want = slime_value_loss(ref_values, old, ret, mask, clip=clip, per_token=per_token)
    (want_grad,) = torch.autograd.grad(want, ref_values)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)
    outside = ((values.detach() - old).abs() > clip) & mask
    assert float(metrics["value_clipfrac"]) == pytest.approx(float(outside.sum() / mask.sum()))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), cut=st.integers(1, 5), mode=st.sampled_from(["token_mean", "seq_mean_token_mean"]))
def test_critic_loss_is_split_invariant(seed, cut, mode):
    td = value_batch(seed, n=6)
    norm = Normalizer.of(td[keys.MASK])
    whole, _ = critic_loss(td, clip=0.2, loss_agg_mode=mode, norm=norm)
    parts = sum(critic_loss(td[s], clip=0.2, loss_agg_mode=mode, norm=norm)[0] for s in (slice(0, cut), slice(cut, 6)))
    torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-12)


def test_critic_loss_names_what_is_missing():
    with pytest.raises(ValueError, match="critic_loss needs td\\['old_values'\\]"):
        critic_loss(value_batch(0).exclude(keys.OLD_VALUES))
    with pytest.raises(ValueError, match="loss_agg_mode"):
        critic_loss(value_batch(0), loss_agg_mode="mean")


# ---------------------------------------------------------------- flags


def test_num_critic_only_steps_and_value_clip_reach_the_job():
    cfg = slime_cfg("--advantage-estimator", "ppo", "--num-critic-only-steps", "3", "--value-clip", "0.5")
    assert cfg.algo.num_critic_only_steps == 3 and loss_config(cfg).value_clip == 0.5
    assert model_roles(cfg) == (ACTOR, CRITIC)
    with pytest.raises(ConfigError, match="--num-critic-only-steps 2 trains the critic, which only"):
        parse_args(["--num-critic-only-steps", "2"])
    with pytest.raises(ConfigError, match="--num-critic-only-steps must be >= 0"):
        parse_args(["--advantage-estimator", "ppo", "--num-critic-only-steps", "-1"])


class _CriticOnly:
    """A TrainBackend double that records which of its training methods ran."""

    def __init__(self):
        self.ran = []

    def dp_info(self):
        return 0, 1

    def dp_group(self):
        return None

    def compute_log_probs(self, td):
        return TensorDict({keys.OLD_LOG_PROBS: td[keys.OLD_LOG_PROBS], keys.VALUES: td[keys.VALUES]}, td.batch_size)

    def train_critic(self, td, *, per_step_rows):
        self.ran.append(("critic", sorted(td.keys())))
        return {"critic/value_loss": 1.0}

    def train(self, td, *, per_step_rows, rollout_id=None):
        self.ran.append(("actor", sorted(td.keys())))
        return {"pg_loss": 0.0}


@pytest.mark.parametrize("train_actor", [False, True])
def test_the_critic_trains_first_and_the_actor_only_after_the_critic_only_steps(train_actor):
    cfg = slime_cfg("--advantage-estimator", "ppo")
    adv_cfg = advantage_config(cfg)
    backend = _CriticOnly()
    td = ppo_batch().exclude(keys.REF_LOG_PROBS)
    td.set(keys.VALUES, torch.nan_to_num(td[keys.VALUES]))
    metrics = train_rollout(backend, td, global_batch_size=B, adv_cfg=adv_cfg, train_actor=train_actor)
    assert [name for name, _ in backend.ran] == ["critic", "actor"][: 1 + train_actor]
    assert backend.ran[0][1] == sorted([keys.MASK, keys.REWARDS, keys.OLD_VALUES, keys.RETURNS])
    assert ("pg_loss" in metrics) is train_actor and metrics["critic/value_loss"] == 1.0


# ---------------------------------------------------------------- the torch backend's critic


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), alphabet=task.ALPHABET, seed=0))


def tiny_batch(model_path, n=8, seed=0):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, rec in enumerate(task.make_records(n, seed=seed)):
        prompt = tokenizer(rec["prompt"])["input_ids"]
        response = torch.randint(4, len(tokenizer), (int(torch.randint(1, 5, (1,), generator=g)),), generator=g)
        samples.append(
            Sample(
                index=i,
                group_index=i,
                tokens=prompt + response.tolist(),
                response_length=len(response),
                reward=float(i % 2),
            )
        )
    return build_batch(samples, pad_token_id=tokenizer.pad_token_id)


def test_the_torch_critic_is_a_value_head_copy_that_learns_its_targets(model_path, tmp_path):
    cfg = validate(
        from_dict(
            None,
            output_dir=str(tmp_path),
            advantage_estimator="ppo",
            lr=3e-3,
            micro_batch_size=4,
            global_batch_size=8,
            rollout_batch_size=8,
            n_samples_per_prompt=1,
        )
    )
    trainer = TorchTrainer(
        model_path, train_cfg=cfg.train, loss_cfg=loss_config(cfg), temperature=1.0, seed=0, roles=model_roles(cfg)
    )
    head = trainer.critic.get_output_embeddings()
    assert tuple(head.weight.shape) == (1, trainer.model.config.hidden_size) and torch.equal(head.bias, torch.zeros(1))
    assert 0.5 * VALUE_HEAD_INIT_STD < float(head.weight.std()) < 1.5 * VALUE_HEAD_INIT_STD
    # The actor keeps its tied LM head; the critic's body starts from the same weights.
    actor_head = trainer.model.get_output_embeddings().weight
    assert actor_head.data_ptr() == trainer.model.get_input_embeddings().weight.data_ptr()
    torch.testing.assert_close(
        trainer.critic.get_input_embeddings().weight, trainer.model.get_input_embeddings().weight
    )

    td = tiny_batch(model_path)
    td.update(trainer.compute_log_probs(td))
    adv_cfg = advantage_config(cfg)
    targets = critic_targets(compute(td, adv_cfg), adv_cfg)
    losses = []
    for _ in range(15):
        targets.set(keys.OLD_VALUES, trainer.compute_log_probs(td)[keys.VALUES])
        losses.append(trainer.train_critic(targets, per_step_rows=8)["critic/value_loss"])
    assert losses[-1] < 0.2 * losses[0], losses
    # The critic's weights and optimizer go into the checkpoint and come back.
    trainer.save(str(tmp_path / "ckpt"))
    saved_values = trainer.compute_log_probs(td)[keys.VALUES]
    trainer.train_critic(targets, per_step_rows=8)
    assert not torch.equal(trainer.compute_log_probs(td)[keys.VALUES], saved_values)
    trainer.load(str(tmp_path / "ckpt"))
    torch.testing.assert_close(trainer.compute_log_probs(td)[keys.VALUES], saved_values, rtol=0, atol=0)
    trainer.reset_optimizer()
    assert not trainer.optimizer.state and not trainer.critic_optimizer.state
    trainer.shutdown()


# ---------------------------------------------------------------- a PPO job through rlcore-run


def test_ppo_job_through_the_cli_trains_the_critic_first_and_its_value_loss_falls(ray_session, tmp_path, capsys):
    out = tmp_path / "ppo"
    argv = ["--advantage-estimator", "ppo", "--num-critic-only-steps", "2", "--rollout-batch-size", "4"]
    argv += [
        "--n-samples-per-prompt",
        "4",
        "--num-rollout",
        "6",
        "--global-batch-size",
        "8",
        "--micro-batch-size",
        "8",
    ]
    argv += ["--no-use-tensorboard", "--output-dir", str(out)]
    assert main(argv) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(6))
    for row in rows:
        assert row["train/critic/num_steps"] == 2  # 16 samples, global batch 8: as many steps as the actor's
        assert ("train/pg_loss" in row) is (row["step"] >= 2)  # --num-critic-only-steps 2
    value_loss = [row["train/critic/value_loss"] for row in rows]
    assert sum(value_loss[-2:]) / 2 < value_loss[0], value_loss
    assert "value_loss" in capsys.readouterr().out  # the step line shows it
