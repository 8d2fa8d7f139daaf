"""From the job's config to rlcore's: the advantage and loss settings, and what this runtime cannot run yet."""

from __future__ import annotations

import os

from rlcore.advantage_config import AdvantageConfig
from rlcore.loss_config import LossConfig
from runtime.cluster.checkpoint import actor_start, reference_path
from runtime.cluster.loopback import RAY_ADDRESS_ENV
from runtime.config import KL_COEF_IGNORED, Config, ConfigError
from runtime.train.roles import ACTOR, REFERENCE, TEACHER, ModelRole, roles_for

# Estimators that need a model the torch backend does not run yet: a teacher of its own.
_UNSUPPORTED_ESTIMATORS = {
    "distillation": "a teacher model of its own (slime's form is additive: --use-opd --opd-type megatron)",
}
# slime's policy loss by estimator (PPO's clipped surrogate for the rest).
_POLICY_LOSS = {"gspo": "gspo", "cispo": "cispo"}


def effective_kl_coef(cfg: Config) -> float:
    """``--kl-coef`` as slime applies it: 0 for the estimators that ignore it."""
    a = cfg.algo
    return 0.0 if a.advantage_estimator in KL_COEF_IGNORED else a.kl_coef


def check_supported(cfg: Config) -> None:
    """Raise ``ConfigError`` for valid settings that this runtime cannot run (yet)."""
    problems = []
    a = cfg.algo
    if a.core_estimator in _UNSUPPORTED_ESTIMATORS:
        problems.append(
            f"--advantage-estimator {a.advantage_estimator} needs {_UNSUPPORTED_ESTIMATORS[a.core_estimator]}, "
            "which the torch backend lacks; use grpo, dr_grpo, gspo, cispo, ppo, rloo or "
            "reinforce_plus_plus[_baseline]"
        )
    if cfg.train.sft_warmup_steps and cfg.data.prompt_data is not None:
        problems.append(
            "--sft-warmup-steps trains on the built-in task's format examples; it cannot go with --prompt-data"
        )
    if cfg.resources.actor_num_nodes > 1 and not os.environ.get(RAY_ADDRESS_ENV):
        # rlcore-run's own Ray is one node, listening on 127.0.0.1 (runtime.cluster.loopback).
        problems.append(
            f"--actor-num-nodes {cfg.resources.actor_num_nodes}: this runtime runs trainers on one node only, unless "
            f"it joins a Ray cluster of several (`ray start` on each node, then {RAY_ADDRESS_ENV} set for "
            "rlcore-run); or use --actor-num-nodes 1 with --actor-num-gpus-per-node N"
        )
    if problems:
        raise ConfigError(problems)


def advantage_config(cfg: Config) -> AdvantageConfig:
    a = cfg.algo
    return AdvantageConfig(
        estimator=a.core_estimator,
        gamma=a.gamma,
        lam=a.lambd,
        kl_coef=effective_kl_coef(cfg),
        kl_kind=a.kl_loss_type,
        whiten=a.normalize_advantages,
        std_normalize=not a.disable_grpo_std_normalization,
        group_normalize=not a.disable_rewards_normalization,
        opd_kl_coef=a.opd_kl_coef if a.use_opd else 0.0,
    )


def loss_config(cfg: Config) -> LossConfig:
    a = cfg.algo
    return LossConfig(
        policy_loss=_POLICY_LOSS.get(a.advantage_estimator, "ppo"),
        eps_clip=a.eps_clip,
        eps_clip_high=a.eps_clip_high,
        eps_clip_c=a.eps_clip_c,
        cispo_clip_low=True,
        use_tis=a.use_tis,
        tis_clip=a.tis_clip,
        tis_clip_low=a.tis_clip_low,
        mismatch_metrics=a.get_mismatch_metrics,
        use_opsm=a.use_opsm,
        opsm_delta=a.opsm_delta,
        use_kl_loss=a.use_kl_loss,
        kl_loss_coef=a.kl_loss_coef,
        kl_loss_type=a.kl_loss_type,
        use_unbiased_kl=a.use_unbiased_kl,
        entropy_coef=a.entropy_coef,
        value_clip=a.value_clip,
        loss_agg_mode=a.aggregation,
    )


def model_roles(cfg: Config) -> tuple[ModelRole, ...]:
    """The model roles the job runs (the actor; the reference for a KL loss or KL-in-reward penalty; the teacher
    of ``--opd-type megatron``: ``sglang``'s teacher is a server, whose log-probs come with the samples; ...)."""
    a = cfg.algo
    roles = roles_for(use_kl_loss=a.use_kl_loss, kl_coef=effective_kl_coef(cfg), estimator=a.core_estimator)
    if a.use_opd and a.opd_type == "megatron" and TEACHER not in roles:
        roles = (*roles, TEACHER)
    return roles


def role_paths(cfg: Config) -> dict[str, str]:
    """The models of roles that are not ``--hf-checkpoint``: the reference's ``--ref-load``, the OPD teacher's
    ``--opd-teacher-load`` (its ``--opd-teacher-ckpt-step``), and the actor's Megatron checkpoint when it starts
    from one (:func:`runtime.cluster.checkpoint.actor_start`)."""
    a = cfg.algo
    paths = {}
    if a.use_opd and a.opd_teacher_load:
        # --opd-teacher-ckpt-step: slime's step of a Megatron save root (iter_NNNNNNN).
        paths[TEACHER.name] = reference_path(
            ref_load=a.opd_teacher_load, ref_ckpt_step=a.opd_teacher_ckpt_step, flag="--opd-teacher-load"
        )
    c = cfg.ckpt
    if c.ref_load is not None:
        paths[REFERENCE.name] = reference_path(ref_load=c.ref_load, ref_ckpt_step=c.ref_ckpt_step)
    start = actor_start(
        backend=cfg.train.train_backend, load=c.load, ref_load=c.ref_load, ref_ckpt_step=c.ref_ckpt_step
    )
    if start is not None:
        paths[ACTOR.name] = start
    return paths


def needs_rollout_log_probs(cfg: Config) -> bool:
    """Whether the batch must carry the engine's log-probs (TIS, mismatch metrics, or as the old log-probs)."""
    a = cfg.algo
    return a.use_tis or a.get_mismatch_metrics or a.use_rollout_logprobs
