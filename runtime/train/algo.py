"""From the job's config to rlcore's: the advantage and loss settings, and what this runtime cannot run yet."""

from __future__ import annotations

from rlcore.advantages import AdvantageConfig
from rlcore.losses import LossConfig
from runtime.config import Config, ConfigError
from runtime.train.roles import ModelRole, roles_for

# Estimators that need a model the torch backend does not run yet: a critic (slime's ppo) or a teacher.
_UNSUPPORTED_ESTIMATORS = {"gae": "a critic (value model)", "distillation": "a teacher model"}


def check_supported(cfg: Config) -> None:
    """Raise ``ConfigError`` for valid settings that this runtime cannot run (yet)."""
    problems = []
    a = cfg.algo
    if a.core_estimator in _UNSUPPORTED_ESTIMATORS:
        problems.append(
            f"--advantage-estimator {a.advantage_estimator} needs {_UNSUPPORTED_ESTIMATORS[a.core_estimator]}, "
            "which the torch backend lacks; use grpo, dr_grpo, gspo, rloo or reinforce_plus_plus[_baseline]"
        )
    if cfg.train.sft_warmup_steps and cfg.data.prompt_data is not None:
        problems.append(
            "--sft-warmup-steps trains on the built-in task's format examples; it cannot go with --prompt-data"
        )
    if cfg.resources.actor_num_nodes > 1:
        # The trainers rendezvous at the driver's 127.0.0.1 with a port picked there: ranks on other nodes
        # could never reach it.
        problems.append(
            f"--actor-num-nodes {cfg.resources.actor_num_nodes}: this runtime runs trainers on one node only; use "
            "--actor-num-nodes 1 with --actor-num-gpus-per-node N"
        )
    if problems:
        raise ConfigError(problems)


def advantage_config(cfg: Config) -> AdvantageConfig:
    a = cfg.algo
    return AdvantageConfig(
        estimator=a.core_estimator,
        gamma=a.gamma,
        lam=a.lambd,
        kl_coef=a.kl_coef,
        kl_kind=a.kl_loss_type,
        whiten=a.normalize_advantages,
    )


def loss_config(cfg: Config) -> LossConfig:
    a = cfg.algo
    return LossConfig(
        policy_loss="gspo" if a.advantage_estimator == "gspo" else "ppo",
        eps_clip=a.eps_clip,
        eps_clip_high=a.eps_clip_high,
        eps_clip_c=a.eps_clip_c,
        use_tis=a.use_tis,
        use_kl_loss=a.use_kl_loss,
        kl_loss_coef=a.kl_loss_coef,
        kl_loss_type=a.kl_loss_type,
        entropy_coef=a.entropy_coef,
        loss_agg_mode=a.loss_agg_mode,
    )


def model_roles(cfg: Config) -> tuple[ModelRole, ...]:
    """The model roles the job runs (the actor; the reference for a KL loss or KL-in-reward penalty; ...)."""
    a = cfg.algo
    return roles_for(use_kl_loss=a.use_kl_loss, kl_coef=a.kl_coef, estimator=a.core_estimator)
