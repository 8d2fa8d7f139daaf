"""The ``algo`` section of the config: the advantage estimator, the policy loss and its clipping, the KL terms,
the mismatch corrections and on-policy distillation (slime's algorithm flags), read by :mod:`runtime.train.algo`
(which builds rlcore's ``AdvantageConfig`` and ``LossConfig`` from it). Torch-free: ``runtime.config`` composes
:class:`AlgoConfig` into :class:`~runtime.config.Config` and checks it before anything starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from runtime.option_fields import bounded, described, hook, slime

# Estimators whose advantages slime computes without the KL in the reward (--kl-coef is ignored there); dr_grpo is
# grpo without the std, so it goes with them.
KL_COEF_IGNORED = ("grpo", "gspo", "cispo", "dr_grpo")
# slime's estimator names where rlcore.advantages names them differently.
_CORE_ESTIMATOR_NAMES = {"ppo": "gae", "on_policy_distillation": "distillation", "cispo": "grpo"}


@dataclass(frozen=True)
class AlgoConfig:
    advantage_estimator: Literal[
        "grpo",
        "cispo",
        "dr_grpo",
        "gspo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "ppo",
        "on_policy_distillation",
    ] = field(
        default="grpo",
        metadata=described(
            "advantage estimator",
            slime=slime(
                "algo",
                "grpo",
                differs="adds dr_grpo, rloo, on_policy_distillation; ppo's "
                "critic is a value-head copy of the model in the trainers",
            ),
        ),
    )
    eps_clip: float = field(
        default=0.2,
        metadata=described("PPO clip range (lower, and upper unless --eps-clip-high)", slime=slime("algo", 0.2)),
    )
    eps_clip_high: float | None = field(
        default=None, metadata=described("PPO upper clip range (clip-higher)", slime=slime("algo", None))
    )
    eps_clip_c: float | None = field(
        default=None, metadata=described("dual-clip PPO constant, > 1", slime=slime("algo", None))
    )
    value_clip: float = field(
        default=0.2,
        metadata=described(
            "clip of the critic's values around the old values (ppo)",
            slime=slime("algo", 0.2, note="the critic's value loss (ppo)"),
        ),
    )
    num_critic_only_steps: int = field(
        default=0,
        metadata=bounded(
            ge=0, help="ppo: the first N rollouts train the critic only (the actor waits)", slime=slime("algo", 0)
        ),
    )
    kl_coef: float = field(
        default=0.0,
        metadata=described(
            "KL penalty folded into the reward (ppo, reinforce_plus_plus[_baseline]; the grpo family "
            "ignores it, as slime does)",
            slime=slime("algo", 0.0, note="ignored by grpo/gspo/cispo/dr_grpo, as slime ignores it"),
        ),
    )
    use_kl_loss: bool = field(
        default=False,
        metadata=described(
            "add a KL-to-reference term to the loss (coefficient 0: KL is only logged)",
            slime=slime("algo", False, note="built-in job: on"),
        ),
    )
    kl_loss_coef: float = field(
        default=0.0, metadata=described("weight of the KL loss (with --use-kl-loss)", slime=slime("algo", 0.0))
    )
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = field(
        default="k1",
        metadata=described("KL estimator of the KL loss (and of the KL in the reward)", slime=slime("algo", "k1")),
    )
    ref_update_interval: int | None = field(
        default=None,
        metadata=bounded(
            gt=0, help="copy the actor's weights into the reference model every N steps", slime=slime("algo", None)
        ),
    )
    reset_optimizer_states: bool = field(
        default=False,
        metadata=described("drop the optimizer's moments after every rollout's training", slime=slime("algo", False)),
    )
    use_unbiased_kl: bool = field(
        default=False,
        metadata=described(
            "weight the KL loss by the importance ratio exp(log_probs - old_log_probs)", slime=slime("algo", False)
        ),
    )
    entropy_coef: float = field(default=0.0, metadata=described("entropy bonus weight", slime=slime("algo", 0.0)))
    use_rollout_entropy: bool = field(
        default=False,
        metadata=described(
            "the log-prob passes also compute each token's entropy: rollout_data['entropy'] (actor) and "
            "['ref_entropy'] for the trainer hooks",
            slime=slime("algo", False, differs="torch backend only; not in the --keep-old-actor pass"),
        ),
    )
    use_tis: bool = field(
        default=False,
        metadata=described("truncated importance sampling on rollout/train mismatch", slime=slime("algo", False)),
    )
    tis_clip: float = field(default=2.0, metadata=described("upper bound of the TIS weight", slime=slime("algo", 2.0)))
    tis_clip_low: float = field(
        default=0.0, metadata=described("lower bound of the TIS weight", slime=slime("algo", 0.0))
    )
    custom_tis_function_path: str | None = field(
        default=None,
        metadata=hook(
            "with --use-tis or --get-mismatch-metrics: fn(args, *, pg_loss, train_log_probs, rollout_log_probs, "
            "loss_masks, total_lengths, response_lengths) -> (pg_loss, modified_masks, metrics), in place of TIS",
            slime=slime("algo", None, differs="torch backend only; metrics are token means"),
        ),
    )
    use_routing_replay: bool = field(
        default=False,
        metadata=described(
            "MoE routing replay (R2, arXiv 2507.18071): the actor's old-log-prob forward records each token's experts "
            "and its training forwards replay them, the gate weights recomputed from the current router",
            slime=slime("algo", False, differs="MoE models only (refused for a dense model)"),
        ),
    )
    use_rollout_routing_replay: bool = field(
        default=False,
        metadata=described(
            "MoE rollout routing replay (R3, arXiv 2510.11370): every forward of the actor replays the experts the "
            "rollout engine chose for each token (implies --use-routing-replay), the gate weights recomputed from the "
            "current router",
            slime=slime(
                "algo",
                False,
                differs="MoE models only; the embedded engine reports routes too (slime: SGLang's "
                "return_routed_experts)",
            ),
        ),
    )
    use_rollout_logprobs: bool = field(
        default=False,
        metadata=described(
            "take the engine's log-probs as the old log-probs (no trainer recompute)", slime=slime("algo", False)
        ),
    )
    get_mismatch_metrics: bool = field(
        default=False,
        metadata=described(
            "log rollout/train mismatch metrics (the TIS weights, not applied)", slime=slime("algo", False)
        ),
    )
    use_opsm: bool = field(
        default=False,
        metadata=described(
            "off-policy sequence masking: drop negative-advantage tokens of sequences whose KL(old||new) "
            "exceeds --opsm-delta",
            slime=slime("algo", False),
        ),
    )
    opsm_delta: float = field(
        default=1e-4,
        metadata=described("OPSM threshold on the sequence's mean log-ratio", slime=slime("algo", 0.0001)),
    )
    normalize_advantages: bool = field(
        default=False,
        metadata=described(
            "whiten advantages over the batch",
            slime=slime("algo", False, differs="not required for reinforce_plus_plus[_baseline]"),
        ),
    )
    use_opd: bool = field(
        default=False,
        metadata=described(
            "on-policy distillation on top of the estimator: minus --opd-kl-coef x (student - teacher) "
            "log-probs on every token's advantage",
            slime=slime("on_policy_distillation", False),
        ),
    )
    opd_type: Literal["megatron", "sglang"] | None = field(
        default=None,
        metadata=described(
            "where the teacher's log-probs come from: megatron = a teacher model in the trainers (any "
            "--train-backend here); sglang = a teacher server",
            slime=slime(
                "on_policy_distillation",
                None,
                note="megatron: a teacher model in the trainers, any "
                "backend; sglang: a teacher server, through slime's on_policy_distillation reward pair",
            ),
        ),
    )
    opd_kl_coef: float = field(
        default=1.0, metadata=described("weight of the distillation term", slime=slime("on_policy_distillation", 1.0))
    )
    opd_teacher_load: str | None = field(
        default=None,
        metadata=described(
            "the teacher model for --opd-type megatron: an HF folder; with --train-backend megatron also a torch_dist "
            "checkpoint or save root",
            slime=slime(
                "on_policy_distillation",
                None,
                differs="an HF folder; with --train-backend megatron also "
                "a torch_dist checkpoint (slime: a Megatron checkpoint)",
            ),
        ),
    )
    opd_teacher_ckpt_step: int | None = field(
        default=None,
        metadata=described(
            "--train-backend megatron: the step of a Megatron --opd-teacher-load save root (iter_NNNNNNN)",
            slime=slime(
                "on_policy_distillation",
                None,
                differs="--train-backend megatron "
                "only (the torch backend refuses it): iter_NNNNNNN of a --opd-teacher-load save root",
            ),
        ),
    )
    disable_grpo_std_normalization: bool = field(
        default=False,
        metadata=described(
            "grpo/gspo/cispo: centre rewards on the group mean only (Dr. GRPO)", slime=slime("algo", False)
        ),
    )
    disable_rewards_normalization: bool = field(
        default=False,
        metadata=described(
            "no group normalization: the raw reward is the sequence advantage", slime=slime("algo", False)
        ),
    )
    calculate_per_token_loss: bool = field(
        default=False,
        metadata=described(
            "aggregate losses as a token mean over the step; off: each sample's token mean, then the mean over "
            "samples",
            slime=slime("megatron (reset by slime)", False, note="built-in job: on"),
        ),
    )
    loss_agg_mode: (
        Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"] | None
    ) = field(
        default=None,
        metadata=described(
            "ours: how per-token losses are aggregated; unset: from --calculate-per-token-loss "
            "(token_mean on, seq_mean_token_mean off)"
        ),
    )
    loss_type: Literal["policy_loss", "sft_loss", "custom_loss"] = field(
        default="policy_loss",
        metadata=described(
            "policy_loss (RL), sft_loss (NLL of the loss-masked tokens) or custom_loss (--custom-loss-...)",
            slime=slime("algo", "policy_loss"),
        ),
    )
    custom_loss_function_path: str | None = field(
        default=None,
        metadata=hook(
            "with --loss-type custom_loss: fn(args, batch, logits, sum_of_sample_mean) -> (loss, dict)",
            slime=slime("algo", None, differs="logits [1, T, V] over the padded rows, one by one"),
        ),
    )
    custom_advantage_function_path: str | None = field(
        default=None,
        metadata=hook(
            "fn(args, rollout_data) -> None, setting rollout_data['advantages'] and ['returns']",
            slime=slime("algo", None, note="on every trainer rank, over its shard"),
        ),
    )
    custom_pg_loss_reducer_function_path: str | None = field(
        default=None,
        metadata=hook(
            "fn(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> reducer of the pg term",
            slime=slime("algo", None, note="the pg term's reducer (--loss-agg-mode is ours)"),
        ),
    )
    disable_compute_advantages_and_returns: bool = field(
        default=False,
        metadata=described(
            "no advantages (SFT, custom losses): needs --loss-type sft_loss or custom_loss",
            slime=slime("algo", False, note="with --loss-type sft_loss or custom_loss"),
        ),
    )
    loss_mask_type: Literal["qwen", "qwen3", "qwen3_5", "distill_qwen"] = field(
        default="qwen",
        metadata=described(
            "multi-turn SFT loss masks by chat template (sft_rollout)",
            slime=slime("rollout_buffer", "qwen", note="sft_rollout's loss masks by chat template"),
        ),
    )
    gamma: float = field(default=1.0, metadata=described("discount (ppo / reinforce++)", slime=slime("algo", 1.0)))
    lambd: float = field(default=1.0, metadata=described("GAE lambda (ppo)", slime=slime("algo", 1.0)))

    @property
    def aggregation(self) -> str:
        """The loss aggregation in force: ``--loss-agg-mode`` when given, else slime's by
        ``--calculate-per-token-loss`` (on: a token mean over the step; off: per-sample token means, then their
        mean)."""
        if self.loss_agg_mode is not None:
            return self.loss_agg_mode
        return "token_mean" if self.calculate_per_token_loss else "seq_mean_token_mean"

    @property
    def core_estimator(self) -> str:
        """The estimator's name in ``rlcore.advantages`` (slime's ``ppo`` is ``gae``, ``on_policy_distillation``
        is ``distillation``; the others are spelled alike)."""
        return _CORE_ESTIMATOR_NAMES.get(self.advantage_estimator, self.advantage_estimator)
