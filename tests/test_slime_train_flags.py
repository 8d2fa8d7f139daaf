"""slime's trainer flags: ``--use-stateless-adam`` (against torch's AdamW with its state cleared before every step),
``--train-env-vars`` (reaching the trainer processes) and ``--keep-old-actor`` (old log-probs from the weights that
sampled a one-step-async rollout, through the real loop)."""

import os

import pytest
import ray
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.cluster.placement import create_placement
from runtime.cluster.trainers import TrainerGroup, _with_env
from runtime.config import ConfigError, from_dict, parse_args, validate
from runtime.logger import METRICS_FILE, read_metrics
from runtime.loop import run
from runtime.train.algo import loss_config, model_roles
from runtime.train.backends.stateless_adam import StatelessAdamW

SMALL = {
    "rollout_batch_size": 4,
    "n_samples_per_prompt": 4,
    "rollout_max_response_len": 5,
    "global_batch_size": 16,
    "micro_batch_size": 8,
    "lr": 1e-3,
    "actor_num_gpus_per_node": 1,
    "use_tensorboard": False,
}


# ---------------------------------------------------------------- --use-stateless-adam


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), lr=st.sampled_from([1e-3, 0.1]), weight_decay=st.sampled_from([0.0, 0.1]))
def test_stateless_adam_is_adamw_with_its_state_cleared_before_every_step(seed, lr, weight_decay):
    g = torch.Generator().manual_seed(seed)
    start = torch.randn(5, 3, generator=g, dtype=torch.float64)
    ours, ref = start.clone().requires_grad_(), start.clone().requires_grad_()
    stateless = StatelessAdamW([ours], lr=lr, weight_decay=weight_decay)
    adamw = torch.optim.AdamW([ref], lr=lr, weight_decay=weight_decay)
    for _ in range(3):
        grad = torch.randn(5, 3, generator=g, dtype=torch.float64) * 10 ** float(torch.randint(-4, 2, (1,)))
        ours.grad, ref.grad = grad.clone(), grad.clone()
        stateless.step()
        adamw.state.clear()  # slime's --reset-optimizer-states before each step
        adamw.step()
        torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    assert not stateless.state  # no moments kept


def test_stateless_adam_needs_no_save_optim_and_reaches_the_trainer(tmp_path):
    with pytest.raises(
        ConfigError, match="--use-stateless-adam keeps no optimizer state to save: add --no-save-optim"
    ):
        parse_args(["--use-stateless-adam"])
    cfg = validate(from_dict(None, output_dir=str(tmp_path), use_stateless_adam=True, no_save_optim=True, **SMALL))
    from runtime.demo import task
    from runtime.demo.tiny_model import make_tiny_model
    from runtime.train.backends.torch_backend import TorchTrainer

    path = make_tiny_model(tmp_path / "tiny", alphabet=task.ALPHABET, seed=0)
    trainer = TorchTrainer(
        str(path), train_cfg=cfg.train, loss_cfg=loss_config(cfg), temperature=1.0, seed=0, roles=model_roles(cfg)
    )
    assert isinstance(trainer.optimizer, StatelessAdamW)
    trainer.shutdown()


# ---------------------------------------------------------------- --train-env-vars


def test_train_env_vars_reach_every_trainer_process(ray_session, tmp_path):
    assert _with_env({"runtime_env": {"env_vars": {"A": "1", "B": "2"}}}, {"B": "3"}) == {
        "runtime_env": {"env_vars": {"A": "1", "B": "3"}}
    }
    with pytest.raises(ConfigError, match='--train-env-vars {"N": 1}: names must be non-empty'):
        parse_args(["--train-env-vars", '{"N": 1}'])
    cfg = validate(
        from_dict(
            None,
            output_dir=str(tmp_path),
            train_env_vars={"RLCORE_TRAIN_ENV_TEST": "on", "OMP_NUM_THREADS": "3"},
            **SMALL,
        )
    )
    placement = create_placement(cfg)
    from runtime.demo import task
    from runtime.demo.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path / "tiny", alphabet=task.ALPHABET, seed=0)
    group = TrainerGroup(
        placement,
        backend="torch",
        model_path=str(path),
        env_vars=cfg.train.train_env_vars,
        roles=model_roles(cfg),
        train_cfg=cfg.train,
        loss_cfg=loss_config(cfg),
        temperature=1.0,
        seed=0,
    )
    try:
        seen = ray.get(
            [
                a.__ray_call__.remote(
                    lambda self: (os.environ.get("RLCORE_TRAIN_ENV_TEST"), os.environ["OMP_NUM_THREADS"])
                )
                for a in group.actors
            ]
        )
        assert seen == [("on", "3")]  # the flag's value wins over the placement's own OMP_NUM_THREADS
    finally:
        group.shutdown()
        ray.util.remove_placement_group(placement.group)


# ---------------------------------------------------------------- --keep-old-actor


def test_keep_old_actor_needs_the_one_step_schedule():
    with pytest.raises(ConfigError, match="--keep-old-actor keeps the weights that sampled a one-step-async rollout"):
        parse_args(["--keep-old-actor"])
    with pytest.raises(ConfigError, match="--keep-old-actor"):
        parse_args(["--keep-old-actor", "--async", "--update-weights-interval", "2"])
    assert parse_args(["--keep-old-actor", "--async"]).train.keep_old_actor


@pytest.mark.parametrize("keep", [False, True])
def test_keep_old_actor_makes_old_log_probs_the_sampling_policys_under_one_step_async(ray_session, tmp_path, keep):
    cfg = validate(
        from_dict(
            None,
            output_dir=str(tmp_path / "out"),
            num_rollout=3,
            rollout_schedule="one_step",
            keep_old_actor=keep,
            **SMALL,
        )
    )
    rows = read_metrics(run(cfg, progress=False).output_dir / METRICS_FILE)
    diffs = [row["train/rollout_log_prob_abs_diff"] for row in rows]
    assert diffs[0] < 1e-4  # the first rollout was sampled by the weights the trainer starts with
    if keep:
        # Rollouts 1 and 2 were sampled one version behind the trainer: the old actor holds those weights.
        assert max(diffs[1:]) < 1e-4, diffs
    else:
        assert min(diffs[1:]) > 1e-3, diffs  # the trainer's recompute is one optimizer step ahead of the sampler
