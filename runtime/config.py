"""The job's configuration: a frozen dataclass tree whose field names are slime's flag names.

A field ``rollout_batch_size`` is the flag ``--rollout-batch-size``; booleans take ``--flag`` / ``--no-flag``.
``parse_args`` reads an optional YAML file (``--config``; nested by section as ``to_dict`` writes it, or flat
as slime's ``--custom-config-path`` files are), lets flags override it, and validates the result: settings that
cannot work together raise ``ConfigError`` naming the flags, before anything starts.

On a CPU-only machine the ``*_gpus*`` fields count processes (CPU slots): ``--actor-num-gpus-per-node 2`` runs
two trainer processes, ``--rollout-num-gpus 1`` one embedded engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.machinery
import importlib.util
import json
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from rlcore.advantage_config import GROUP_BASELINE_ESTIMATORS
from runtime import slime_compat, slime_flags
from runtime.engines import sglang_flags
from runtime.engines.registry import ROLLOUT_ENGINES, sglang_urls
from runtime.hooks import HookError, resolve_hook
from runtime.train.backends import TRAIN_BACKENDS, backend_options, lora_options
from runtime.train.backends.megatron_options import MEGATRON_VALUES_BUILT  # the values the Megatron backend builds

# Choices that registries define: the flags take exactly their names.
TRAIN_BACKEND_NAMES = tuple(TRAIN_BACKENDS)
# Megatron's --attention-backend choices (megatron.core.transformer.enums.AttnBackend).
MEGATRON_ATTENTION_BACKENDS = ("auto", "local", "unfused", "flash", "fused")
ROLLOUT_ENGINE_NAMES = tuple(ROLLOUT_ENGINES)
ROLLOUT_SCHEDULES = ("sync", "one_step", "fully_async")
# --update-weight-transport (slime's choices); unset, the engine kind's own default (runtime.engines.registry).
WEIGHT_TRANSPORTS = ("nccl", "disk", "ipc", "lora_adapter")

# Estimators whose advantages slime computes without the KL in the reward (--kl-coef is ignored there); dr_grpo is
# grpo without the std, so it goes with them.
KL_COEF_IGNORED = ("grpo", "gspo", "cispo", "dr_grpo")
# slime's estimator names where rlcore.advantages names them differently.
_CORE_ESTIMATOR_NAMES = {"ppo": "gae", "on_policy_distillation": "distillation", "cispo": "grpo"}


# Reward types rlcore-run scores with (builtin: the built-in task's), and slime's that it does not yet.
RM_TYPES = ("builtin", "math", "exact_match", "deepscaler", "dapo", "f1", "gpqa", "random", "remote_rm")
SLIME_RM_TYPES_NOT_BUILT = ("ifbench",)


class ConfigError(ValueError):
    """Inconsistent or invalid settings. ``problems`` lists each one; every message names its flags."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        # One problem is the whole message (``rlcore-run: <flag> ...: <what>``); several are listed.
        message = (
            self.problems[0]
            if len(self.problems) == 1
            else "invalid configuration:\n  - " + "\n  - ".join(self.problems)
        )
        super().__init__(message)


def _help(text: str) -> dict[str, str]:
    return {"help": text}


def _bounded(*, help: str, **bounds: float) -> dict[str, Any]:
    """Metadata of a number field with bounds (``gt``, ``ge``, ``lt``, ``le``): the type check enforces them
    (pydantic's constraints; None, where the field allows it, is exempt) and a value out of them is reported as
    ``--flag must be > 0, got 0``."""
    return {"help": help, "bounds": bounds}


def _hook_help(text: str) -> dict[str, Any]:
    """Metadata of a hook flag: validation resolves it (``runtime.hooks.resolve_hook``) before anything starts."""
    return {"help": text, "hook": True}


@dataclass(frozen=True)
class ModelConfig:
    hf_checkpoint: str | None = field(
        default=None,
        metadata=_help("HF model directory (config, weights, tokenizer); unset: build the tiny default model"),
    )
    # Megatron's model-shape flags, as slime's run scripts pass them. The model is built from --hf-checkpoint's
    # config.json; a flag that is given must agree with it (slime's _hf_validate_args), any backend.
    num_layers: int | None = field(default=None, metadata=_help("Megatron: decoder layers (config.json's)"))
    hidden_size: int | None = field(default=None, metadata=_help("Megatron: hidden size (config.json's)"))
    ffn_hidden_size: int | None = field(default=None, metadata=_help("Megatron: MLP width (intermediate_size)"))
    num_attention_heads: int | None = field(default=None, metadata=_help("Megatron: query heads"))
    num_query_groups: int | None = field(default=None, metadata=_help("Megatron: key/value heads"))
    group_query_attention: bool | None = field(
        default=None, metadata=_help("Megatron: fewer key/value heads than query heads")
    )
    kv_channels: int | None = field(default=None, metadata=_help("Megatron: head dimension (head_dim)"))
    vocab_size: int | None = field(default=None, metadata=_help("Megatron: vocabulary before padding"))
    max_position_embeddings: int | None = field(default=None, metadata=_help("Megatron: longest position"))
    rotary_base: float | None = field(default=None, metadata=_help("Megatron: rope_theta"))
    rotary_percent: float | None = field(default=None, metadata=_help("Megatron: rotated part of a head (1.0)"))
    norm_epsilon: float | None = field(default=None, metadata=_help("Megatron: RMSNorm epsilon (rms_norm_eps)"))
    qk_layernorm: bool | None = field(default=None, metadata=_help("Megatron: per-head QK RMSNorm (Qwen3)"))
    add_qkv_bias: bool | None = field(default=None, metadata=_help("Megatron: bias on q/k/v (Qwen2)"))
    untie_embeddings_and_output_weights: bool | None = field(
        default=None, metadata=_help("Megatron: LM head apart from the embedding (not tie_word_embeddings)")
    )
    normalization: str | None = field(default=None, metadata=_help("Megatron: RMSNorm (the families built)"))
    swiglu: bool | None = field(default=None, metadata=_help("Megatron: SwiGLU MLP (hidden_act silu)"))
    disable_bias_linear: bool | None = field(default=None, metadata=_help("Megatron: no bias on linear layers"))
    position_embedding_type: str | None = field(default=None, metadata=_help("Megatron: rope"))
    use_rotary_position_embeddings: bool | None = field(
        default=None, metadata=_help("Megatron: rotary position embeddings (--position-embedding-type rope)")
    )
    # Megatron's MoE shape flags (runtime.train.backends.megatron_moe), checked against config.json alike.
    num_experts: int | None = field(default=None, metadata=_help("Megatron: experts per MoE layer (num_experts)"))
    moe_router_topk: int | None = field(
        default=None, metadata=_help("Megatron: experts per token (num_experts_per_tok)")
    )
    moe_ffn_hidden_size: int | None = field(
        default=None, metadata=_help("Megatron: an expert's MLP width (moe_intermediate_size)")
    )
    moe_router_pre_softmax: bool | None = field(
        default=None, metadata=_help("Megatron: softmax over all experts, top k unnormalised (not norm_topk_prob)")
    )
    moe_router_score_function: str | None = field(
        default=None, metadata=_help("Megatron: the router's score function (softmax for Qwen3-MoE)")
    )
    moe_layer_freq: str | None = field(
        default=None, metadata=_help("Megatron: MoE layers, an int N (every N-th) or a list such as [1]*48")
    )


@dataclass(frozen=True)
class DataConfig:
    prompt_data: str | None = field(
        default=None, metadata=_help("prompt file, .jsonl or .parquet; unset: the built-in task")
    )
    input_key: str = field(default="input", metadata=_help("key of the prompt (a string or a chat message list)"))
    label_key: str | None = field(
        default=None, metadata=_help("key of the label the reward compares against; unset: rows carry no label")
    )
    metadata_key: str = field(default="metadata", metadata=_help("key of a per-row metadata dict (optional in rows)"))
    tool_key: str = field(
        default="tools", metadata=_help("key of a row's tool list, passed to the chat template (when present)")
    )
    apply_chat_template: bool = field(default=False, metadata=_help("render prompts with the chat template"))
    apply_chat_template_kwargs: dict = field(
        default_factory=dict, metadata=_help("JSON object of keyword arguments for the chat template")
    )
    rollout_max_prompt_len: int | None = field(
        default=None,
        metadata=_bounded(
            gt=0, help="drop (and count) prompts longer than this many tokens (unset: --rollout-max-context-len - 1)"
        ),
    )
    rollout_max_context_len: int | None = field(
        default=None,
        metadata=_bounded(gt=0, help="the engines' context; sets --rollout-max-prompt-len's default to this - 1"),
    )
    rollout_shuffle: bool = field(
        default=False, metadata=_help("reshuffle the prompts every epoch (seeded by --rollout-seed)")
    )
    rollout_seed: int = field(default=42, metadata=_help("seed of the prompt order of --prompt-data"))
    balance_data: bool = field(
        default=False, metadata=_help("balance each optimizer step's tokens over the trainer ranks (rows reordered)")
    )
    on_bad_row: Literal["fail", "skip"] = field(
        default="fail", metadata=_help("a malformed row stops the job (fail) or is skipped and counted (skip)")
    )
    allow_prompt_data_change: bool = field(
        default=False,
        metadata=_help(
            "ours: --load a checkpoint although the prompt data's rows changed since it was saved (same row count; "
            "without it the resume stops naming the file)"
        ),
    )
    data_source_path: str | None = field(
        default=None,
        metadata=_hook_help(
            "class cls(args) with get_samples(n) -> list[list[Sample]], add_samples, save(rollout_id), "
            "load(rollout_id), __len__; unset: the prompt data with a buffer (slime's RolloutDataSourceWithBuffer)"
        ),
    )
    disable_rollout_global_dataset: bool = field(
        default=False,
        metadata=_help(
            "the default data source holds no prompt data, only the groups put back with add_samples (a "
            "--rollout-function-path makes its own prompts); hooks read args.rollout_global_dataset"
        ),
    )


@dataclass(frozen=True)
class RolloutConfig:
    rollout_batch_size: int | None = field(
        default=None, metadata=_bounded(gt=0, help="prompts per rollout step (required)")
    )
    n_samples_per_prompt: int = field(
        default=1, metadata=_bounded(gt=0, help="responses sampled per prompt (the group size)")
    )
    rollout_max_response_len: int | None = field(
        default=None,
        metadata=_bounded(gt=0, help="max new tokens per response; no default (as in slime): set it for your model"),
    )
    rollout_temperature: float = field(default=1.0, metadata=_bounded(gt=0, help="sampling temperature"))
    rollout_top_p: float = field(
        default=1.0, metadata=_bounded(gt=0, le=1, help="nucleus sampling threshold, in (0, 1]")
    )
    rollout_top_k: int = field(default=-1, metadata=_help("top-k sampling; -1 is off"))
    rollout_top_p_replay: bool = field(
        default=True,
        metadata=_help(
            "with --rollout-top-p below 1, take rollout and training log-probs over each token's sampled nucleus, "
            "as slime (ours: --no-rollout-top-p-replay keeps the untruncated log-probs)"
        ),
    )
    rollout_skip_special_tokens: bool = field(
        default=False, metadata=_help("leave special tokens (e.g. <|im_end|>) out of the response text")
    )
    rollout_stop: list[str] | None = field(
        default=None,
        metadata=_help("stop strings: a response ends at the first token after which its text holds one (kept)"),
    )
    rollout_stop_token_ids: list[int] | None = field(
        default=None, metadata=_help("token ids that end a response, besides the model's eos ids")
    )
    num_rollout: int | None = field(
        default=None, metadata=_bounded(gt=0, help="number of rollout (and training) steps; unset: from --num-epoch")
    )
    num_epoch: int | None = field(
        default=None,
        metadata=_bounded(
            gt=0, help="passes over --prompt-data when --num-rollout is unset (whole rollouts per epoch)"
        ),
    )
    custom_generate_function_path: str | None = field(
        default=None,
        metadata=_hook_help(
            "async def generate(args, sample, sampling_params[, evaluation]) -> Sample | list[Sample], as "
            "module:function"
        ),
    )
    rollout_function_path: str | None = field(
        default=None,
        metadata=_hook_help(
            "the whole rollout, generate_rollout(args, rollout_id, data_source, evaluation=False) -> "
            "RolloutFnTrainOutput | list[list[Sample]]; unset: the built-in rollout"
        ),
    )
    eval_function_path: str | None = field(
        default=None,
        metadata=_hook_help(
            "evaluation rollout, called with evaluation=True -> RolloutFnEvalOutput; unset: --rollout-function-path "
            "when set, else the built-in evaluation"
        ),
    )
    rollout_sample_hook_path: list[str] = field(
        default_factory=list,
        metadata={
            **_hook_help("(repeatable) [async] hook(args, sample, *, rollout_id, evaluation) -> Sample | None"),
            "append": True,
        },
    )
    buffer_filter_path: str | None = field(
        default=None,
        metadata=_hook_help("fn(args, rollout_id, buffer, num_samples) -> list[list[Sample]]: groups taken back"),
    )
    rollout_sample_filter_path: str | None = field(
        default=None,
        metadata=_hook_help("fn(args, data: list[list[Sample]]) -> None; sets sample.remove_sample"),
    )
    rollout_all_samples_process_path: str | None = field(
        default=None,
        metadata=_hook_help("fn(args, all_samples: list[list[Sample]], data_source) -> None, filtered groups too"),
    )
    rollout_data_postprocess_path: str | None = field(
        default=None,
        metadata=_hook_help("fn(args, rollout_id, rollout_data: dict) -> None, after log-probs and advantages"),
    )
    custom_rollout_log_function_path: str | None = field(
        default=None,
        metadata=_hook_help("fn(rollout_id, args, samples, extra_metrics, rollout_time) -> bool (True: skip ours)"),
    )
    custom_eval_rollout_log_function_path: str | None = field(
        default=None,
        metadata=_hook_help("fn(rollout_id, args, data, extra_metrics) -> bool (True: skip ours)"),
    )
    dynamic_sampling_filter_path: str | None = field(
        default=None,
        metadata=_hook_help("filter fn(args, samples) -> DynamicFilterOutput applied to each prompt's group"),
    )
    over_sampling_batch_size: int | None = field(
        default=None,
        metadata=_bounded(gt=0, help="prompts generated per sampling round when filtering; >= --rollout-batch-size"),
    )
    rollout_engine: Literal[ROLLOUT_ENGINE_NAMES] = field(
        default="hf", metadata=_help("rollout engine: embedded transformers (hf) or running SGLang servers (sglang)")
    )
    sglang_url: str | None = field(
        default=None, metadata=_help("alias of --rollout-external-engine-addrs (comma-separated base URLs)")
    )
    engine_compile: bool = field(
        default=False,
        metadata=_help(
            "ours: the embedded engine (--rollout-engine hf) on a GPU runs its decode step through torch.compile "
            "before capturing it as a CUDA graph: faster decoding (Qwen3-0.6B, 64x512 on an H100: 2.3 s instead of "
            "3.9 s) for a compile of about a minute per batch size and 128-token cache-length bucket"
        ),
    )
    engine_max_running_requests: int | None = field(
        default=None,
        metadata=_bounded(
            gt=0,
            help="ours: the embedded engine (--rollout-engine hf) decodes at most N prompts at once over a KV cache "
            "of N rows; a row that stops is refilled with a waiting prompt (continuous refill). Default: all prompts "
            "of a call at once. Each prompt draws from its own seeded stream, whatever N (docs/runtime.md, Engines)",
        ),
    )
    rollout_schedule: Literal[ROLLOUT_SCHEDULES] = field(
        default="sync",
        metadata=_help(
            "ours: sync, one_step (rollout k+1 generated while step k trains, slime's train_async.py; --async) or "
            "fully_async (groups in flight across steps under --max-staleness; --fully-async)"
        ),
    )
    update_weights_interval: int = field(
        default=1, metadata=_bounded(gt=0, help="sync weights to the engines every N steps")
    )
    update_weight_buffer_size: int = field(
        default=512 * 1024**2, metadata=_bounded(gt=0, help="bytes per bucket of a weight sync")
    )
    max_staleness: int = field(
        default=1,
        metadata=_bounded(
            ge=0,
            help="ours, fully_async: a group admitted at weight version v is trained by step v + N "
            "(admission control)",
        ),
    )
    partial_rollout: bool = field(
        default=False,
        metadata=_help("fully_async: cut generations off at a weight update and resume them with the new weights"),
    )
    mask_offpolicy_in_partial_rollout: bool = field(
        default=False, metadata=_help("partial rollout: tokens sampled before the weight update leave the loss")
    )


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
    ] = field(default="grpo", metadata=_help("advantage estimator"))
    eps_clip: float = field(default=0.2, metadata=_help("PPO clip range (lower, and upper unless --eps-clip-high)"))
    eps_clip_high: float | None = field(default=None, metadata=_help("PPO upper clip range (clip-higher)"))
    eps_clip_c: float | None = field(default=None, metadata=_help("dual-clip PPO constant, > 1"))
    value_clip: float = field(default=0.2, metadata=_help("clip of the critic's values around the old values (ppo)"))
    num_critic_only_steps: int = field(
        default=0, metadata=_bounded(ge=0, help="ppo: the first N rollouts train the critic only (the actor waits)")
    )
    kl_coef: float = field(
        default=0.0,
        metadata=_help(
            "KL penalty folded into the reward (ppo, reinforce_plus_plus[_baseline]; the grpo family "
            "ignores it, as slime does)"
        ),
    )
    use_kl_loss: bool = field(
        default=False, metadata=_help("add a KL-to-reference term to the loss (coefficient 0: KL is only logged)")
    )
    kl_loss_coef: float = field(default=0.0, metadata=_help("weight of the KL loss (with --use-kl-loss)"))
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = field(
        default="k1", metadata=_help("KL estimator of the KL loss (and of the KL in the reward)")
    )
    ref_update_interval: int | None = field(
        default=None, metadata=_bounded(gt=0, help="copy the actor's weights into the reference model every N steps")
    )
    reset_optimizer_states: bool = field(
        default=False, metadata=_help("drop the optimizer's moments after every rollout's training")
    )
    use_unbiased_kl: bool = field(
        default=False, metadata=_help("weight the KL loss by the importance ratio exp(log_probs - old_log_probs)")
    )
    entropy_coef: float = field(default=0.0, metadata=_help("entropy bonus weight"))
    use_rollout_entropy: bool = field(
        default=False,
        metadata=_help(
            "the log-prob passes also compute each token's entropy: rollout_data['entropy'] (actor) and "
            "['ref_entropy'] for the trainer hooks"
        ),
    )
    use_tis: bool = field(default=False, metadata=_help("truncated importance sampling on rollout/train mismatch"))
    tis_clip: float = field(default=2.0, metadata=_help("upper bound of the TIS weight"))
    tis_clip_low: float = field(default=0.0, metadata=_help("lower bound of the TIS weight"))
    custom_tis_function_path: str | None = field(
        default=None,
        metadata=_hook_help(
            "with --use-tis or --get-mismatch-metrics: fn(args, *, pg_loss, train_log_probs, rollout_log_probs, "
            "loss_masks, total_lengths, response_lengths) -> (pg_loss, modified_masks, metrics), in place of TIS"
        ),
    )
    use_rollout_logprobs: bool = field(
        default=False, metadata=_help("take the engine's log-probs as the old log-probs (no trainer recompute)")
    )
    get_mismatch_metrics: bool = field(
        default=False, metadata=_help("log rollout/train mismatch metrics (the TIS weights, not applied)")
    )
    use_opsm: bool = field(
        default=False,
        metadata=_help(
            "off-policy sequence masking: drop negative-advantage tokens of sequences whose KL(old||new) "
            "exceeds --opsm-delta"
        ),
    )
    opsm_delta: float = field(default=1e-4, metadata=_help("OPSM threshold on the sequence's mean log-ratio"))
    normalize_advantages: bool = field(default=False, metadata=_help("whiten advantages over the batch"))
    use_opd: bool = field(
        default=False,
        metadata=_help(
            "on-policy distillation on top of the estimator: minus --opd-kl-coef x (student - teacher) "
            "log-probs on every token's advantage"
        ),
    )
    opd_type: Literal["megatron", "sglang"] | None = field(
        default=None,
        metadata=_help(
            "where the teacher's log-probs come from: megatron = a teacher model in the trainers (any "
            "--train-backend here); sglang = a teacher server"
        ),
    )
    opd_kl_coef: float = field(default=1.0, metadata=_help("weight of the distillation term"))
    opd_teacher_load: str | None = field(
        default=None,
        metadata=_help(
            "the teacher model for --opd-type megatron: an HF folder; with --train-backend megatron also a torch_dist "
            "checkpoint or save root"
        ),
    )
    opd_teacher_ckpt_step: int | None = field(
        default=None,
        metadata=_help("--train-backend megatron: the step of a Megatron --opd-teacher-load save root (iter_NNNNNNN)"),
    )
    disable_grpo_std_normalization: bool = field(
        default=False, metadata=_help("grpo/gspo/cispo: centre rewards on the group mean only (Dr. GRPO)")
    )
    disable_rewards_normalization: bool = field(
        default=False, metadata=_help("no group normalization: the raw reward is the sequence advantage")
    )
    calculate_per_token_loss: bool = field(
        default=False,
        metadata=_help(
            "aggregate losses as a token mean over the step; off: each sample's token mean, then the mean over samples"
        ),
    )
    loss_agg_mode: (
        Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"] | None
    ) = field(
        default=None,
        metadata=_help(
            "ours: how per-token losses are aggregated; unset: from --calculate-per-token-loss "
            "(token_mean on, seq_mean_token_mean off)"
        ),
    )
    loss_type: Literal["policy_loss", "sft_loss", "custom_loss"] = field(
        default="policy_loss",
        metadata=_help(
            "policy_loss (RL), sft_loss (NLL of the loss-masked tokens) or custom_loss (--custom-loss-...)"
        ),
    )
    custom_loss_function_path: str | None = field(
        default=None,
        metadata=_hook_help(
            "with --loss-type custom_loss: fn(args, batch, logits, sum_of_sample_mean) -> (loss, dict)"
        ),
    )
    custom_advantage_function_path: str | None = field(
        default=None,
        metadata=_hook_help("fn(args, rollout_data) -> None, setting rollout_data['advantages'] and ['returns']"),
    )
    custom_pg_loss_reducer_function_path: str | None = field(
        default=None,
        metadata=_hook_help(
            "fn(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> reducer of the pg term"
        ),
    )
    disable_compute_advantages_and_returns: bool = field(
        default=False, metadata=_help("no advantages (SFT, custom losses): needs --loss-type sft_loss or custom_loss")
    )
    loss_mask_type: Literal["qwen", "qwen3", "qwen3_5", "distill_qwen"] = field(
        default="qwen", metadata=_help("multi-turn SFT loss masks by chat template (sft_rollout)")
    )
    gamma: float = field(default=1.0, metadata=_help("discount (ppo / reinforce++)"))
    lambd: float = field(default=1.0, metadata=_help("GAE lambda (ppo)"))

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


@dataclass(frozen=True)
class TrainConfig:
    # slime's flag is --train-backend (megatron/fsdp there); rlcore's first backend is torch (HF model, FSDP2).
    train_backend: Literal[TRAIN_BACKEND_NAMES] = field(default="torch", metadata=_help("training backend"))
    global_batch_size: int | None = field(
        default=None,
        metadata=_bounded(
            gt=0,
            help="samples per optimizer step, over all trainers; unset: --rollout-batch-size x "
            "--n-samples-per-prompt / --num-steps-per-rollout",
        ),
    )
    num_steps_per_rollout: int | None = field(
        default=None, metadata=_bounded(gt=0, help="optimizer steps per rollout (sets --global-batch-size; unset: 1)")
    )
    micro_batch_size: int = field(
        default=1, metadata=_bounded(gt=0, help="samples per forward/backward (without a token budget)")
    )
    max_tokens_per_gpu: int | None = field(
        default=None,
        metadata=_bounded(
            gt=0,
            help="token budget per micro-batch: real tokens with --use-dynamic-batch-size, else rows x longest row",
        ),
    )
    log_probs_max_tokens_per_gpu: int | None = field(
        default=None,
        metadata=_help("token budget of a log-prob pass's micro-batch; unset: --max-tokens-per-gpu"),
    )
    use_dynamic_batch_size: bool = field(
        default=False,
        metadata=_help(
            "micro-batches of at most --max-tokens-per-gpu real tokens: the torch backend concatenates each one's "
            "sequences without padding, the Megatron backend pads each to its longest row (no Transformer Engine)"
        ),
    )
    lr: float = field(default=1e-6, metadata=_bounded(gt=0, help="learning rate (AdamW)"))
    keep_old_actor: bool = field(
        default=False,
        metadata=_help(
            "one-step async: old log-probs from a CPU copy of the weights that sampled the rollout (needs --async)"
        ),
    )
    use_stateless_adam: bool = field(
        default=False,
        metadata=_help("AdamW with its moments reset at every step and stored nowhere (needs --no-save-optim)"),
    )
    train_env_vars: dict = field(
        default_factory=dict,
        metadata=_help("JSON object of environment variables for the trainer processes, e.g. PyTorch allocator ones"),
    )
    weight_decay: float = field(default=0.0, metadata=_bounded(ge=0, help="AdamW weight decay"))
    clip_grad: float = field(default=1.0, metadata=_bounded(gt=0, help="max gradient norm"))
    sft_warmup_steps: int = field(default=0, metadata=_bounded(ge=0, help="SFT steps before RL (built-in task)"))
    bf16: Literal["auto", "true", "false"] = field(
        default="auto",
        metadata=_help(
            "bf16 training; bare --bf16 is Megatron's switch (true); absent is auto: bf16 where the device supports it"
        ),
    )
    attn_implementation: Literal["auto", "varlen", "sdpa", "flex_attention", "eager"] = field(
        default="auto",
        metadata=_help(
            "torch backend: the trainer's attention (transformers' attn_implementation, or varlen: PyTorch's "
            "flash varlen kernel over packed sequences, no mask); auto: varlen on a GPU whose PyTorch has it, else "
            "transformers' default"
        ),
    )
    torch_compile: bool = field(
        default=False,
        metadata=_help(
            "torch backend: torch.compile each decoder layer (fuses its norms, rotary, activation and residual "
            "adds; the first steps pay the compile)"
        ),
    )
    # --train-backend megatron: Megatron's flags under slime's names and Megatron's meanings (the torch backend
    # refuses them away from their defaults, naming the flag).
    tensor_model_parallel_size: int = field(default=1, metadata=_help("Megatron: tensor-parallel ranks per model"))
    pipeline_model_parallel_size: int = field(default=1, metadata=_help("Megatron: pipeline stages"))
    context_parallel_size: int = field(default=1, metadata=_help("Megatron: context-parallel ranks (needs TE)"))
    sequence_parallel: bool = field(
        default=False,
        metadata=_help("Megatron: sequence parallelism within TP (off at TP 1, which Megatron-LM turns it off at)"),
    )
    recompute_granularity: Literal["full", "selective"] | None = field(
        default=None,
        metadata=_help(
            "activation recompute: Megatron's full layers or selective core attention; the torch backend: full "
            "(every decoder layer checkpointed)"
        ),
    )
    attention_backend: Literal[MEGATRON_ATTENTION_BACKENDS] = field(
        default="auto",
        metadata=_help(
            "Megatron: core attention; auto/flash: PyTorch's scaled_dot_product_attention (flash or memory-efficient "
            "kernels on GPUs), local/unfused: Megatron's unfused DotProductAttention (materialises seq x seq scores)"
        ),
    )
    recompute_method: Literal["uniform", "block"] | None = field(
        default=None, metadata=_help("Megatron: which layers --recompute-granularity full recomputes")
    )
    recompute_num_layers: int | None = field(default=None, metadata=_help("Megatron: layers per recompute unit"))
    optimizer: Literal["adam"] = field(default="adam", metadata=_help("Megatron: adam (AdamW; sgd is not built)"))
    adam_beta1: float = field(default=0.9, metadata=_help("Megatron: Adam beta1"))
    adam_beta2: float = field(default=0.999, metadata=_help("Megatron: Adam beta2"))
    adam_eps: float = field(default=1e-8, metadata=_help("Megatron: Adam epsilon"))
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root"] = field(
        default="constant",
        metadata=_help("Megatron: learning-rate decay (ours: default constant, as slime's scripts; Megatron linear)"),
    )
    lr_decay_iters: int | None = field(
        default=None, metadata=_help("Megatron: optimizer steps of the decay; unset: the job's optimizer steps")
    )
    lr_warmup_iters: int = field(default=0, metadata=_help("Megatron: linear warm-up steps"))
    lr_warmup_fraction: float | None = field(
        default=None, metadata=_help("Megatron: warm-up as a fraction of --lr-decay-iters (instead of iters)")
    )
    min_lr: float = field(default=0.0, metadata=_help("Megatron: the decay's floor"))
    accumulate_allreduce_grads_in_fp32: bool = field(
        default=False, metadata=_help("Megatron: keep and all-reduce gradients in float32 under --bf16")
    )
    use_distributed_optimizer: bool = field(
        default=True, metadata=_help("Megatron: shard optimizer state over data-parallel ranks (slime forces it on)")
    )
    overlap_grad_reduce: bool = field(
        default=False,
        metadata=_help(
            "Megatron: DDP reduces each gradient bucket during the last micro-batch's backward, as soon as it is ready"
        ),
    )
    bias_swiglu_fusion: bool = field(
        default=True,
        metadata=_help(
            "Megatron: SwiGLU as megatron-core's fused function (torch.compile'd, on GPUs; the CPU runs it eagerly); "
            "--no-bias-swiglu-fusion turns it off"
        ),
    )
    ddp_bucket_size: int | None = field(
        default=None,
        metadata=_help("Megatron: parameters per DDP gradient bucket (default: megatron-core's, 40M or 1M x DP)"),
    )
    # slime's flags of its Megatron backend (docs/runtime.md, "The Megatron backend"); the torch backend refuses them
    # away from their defaults, naming the flag.
    distributed_backend: Literal["nccl", "gloo"] = field(
        default="nccl",
        metadata=_help("Megatron: the trainers' torch.distributed backend (on the CPU always gloo, whatever given)"),
    )
    distributed_timeout_minutes: int = field(
        default=10,
        metadata=_help("Megatron: timeout of the trainers' collectives (the process group and Megatron's groups)"),
    )
    padded_vocab_size: int | None = field(
        default=None,
        metadata=_help(
            "Megatron: rows of the embedding and output layer (the padding rows start at zero; exports cut them "
            "off); unset: the vocabulary rounded up to a multiple of 128 x TP"
        ),
    )
    model_name: str | None = field(
        default=None,
        metadata=_help(
            "the Megatron-to-HF weight mapping, by slime's name rules (llama; qwen2 and qwen3 share one); unset: "
            "config.json's model class"
        ),
    )
    custom_model_provider_path: str | None = field(
        default=None,
        metadata=_hook_help(
            "fn(pre_process, post_process, vp_stage=None) -> GPTModel, in place of the model the Megatron backend "
            "builds (runtime.train.backends.megatron_backend.provider_context() gives its config and layer spec)"
        ),
    )
    recompute_loss_function: bool = field(
        default=False,
        metadata=_help("Megatron: recompute the loss in backward, keeping only the logits (same loss and gradients)"),
    )
    megatron_config_path: str | None = field(
        default=None,
        metadata=_help("YAML of per-role Megatron overrides (slime's megatron: [{role: actor, overrides: {...}}])"),
    )
    attention_dropout: float = field(
        default=0.0, metadata=_help("Megatron: attention dropout, 0.0 only (ours: default 0.0; Megatron 0.1)")
    )
    hidden_dropout: float = field(
        default=0.0, metadata=_help("Megatron: hidden-state dropout, 0.0 only (ours: default 0.0; Megatron 0.1)")
    )
    expert_model_parallel_size: int = field(default=1, metadata=_help("Megatron: expert-parallel ranks (1: dense)"))
    expert_tensor_parallel_size: int = field(
        default=1, metadata=_help("Megatron: tensor-parallel ranks of the experts (1: dense, which has none)")
    )
    # Megatron's MoE training flags (runtime.train.backends.megatron_options lists the values built).
    moe_grouped_gemm: bool = field(
        default=False, metadata=_help("Megatron: experts through torch._grouped_mm instead of a per-expert loop")
    )
    moe_token_dispatcher_type: str = field(
        default="alltoall", metadata=_help("Megatron: MoE token dispatcher, alltoall (ours: default alltoall)")
    )
    moe_router_load_balancing_type: str = field(
        default="aux_loss", metadata=_help("Megatron: the router's balancing loss (inert at --moe-aux-loss-coeff 0)")
    )
    moe_aux_loss_coeff: float = field(default=0.0, metadata=_help("Megatron: balancing loss weight, 0.0 only"))
    moe_router_dtype: str | None = field(default=None, metadata=_help("Megatron: router dtype, fp32 or fp64"))
    moe_token_drop_policy: str = field(
        default="probs", metadata=_help("Megatron: which tokens a full expert drops (no capacity here: none)")
    )
    deterministic_mode: bool = field(
        default=False, metadata=_help("Megatron: TransformerConfig.deterministic_mode (deterministic kernels only)")
    )
    optimizer_cpu_offload: bool = field(
        default=False,
        metadata=_help("Megatron: the optimizer's state and step on the CPU (all of it; GPUs only, not GPU-tested)"),
    )
    overlap_cpu_optimizer_d2h_h2d: bool = field(
        default=False,
        metadata=_help("Megatron: overlap --optimizer-cpu-offload's copies with its step (not GPU-tested)"),
    )
    # LoRA (ours: slime has none; the names follow verl's lora_rank / lora_alpha and peft's LoraConfig).
    lora_rank: int = field(default=0, metadata=_bounded(ge=0, help="LoRA rank through peft; 0 trains every weight"))
    lora_alpha: float = field(default=16.0, metadata=_help("LoRA alpha: the adapters are scaled by alpha / rank"))
    lora_dropout: float = field(default=0.0, metadata=_help("dropout on the adapters' input while training"))
    lora_target_modules: str = field(
        default="all-linear",
        metadata=_help("modules given adapters: all-linear (every linear but the LM head) or names, q_proj,v_proj"),
    )
    lora_modules_to_save: str = field(
        default="",
        metadata=_help(
            "modules trained in full beside the adapters (peft's modules_to_save; a name matches every module ending "
            "with it: norm = every RMSNorm), comma-separated"
        ),
    )
    only_train_params_name_list: list[str] | None = field(
        default=None, metadata=_help("regexes (re.search) of the parameters to train; all others are frozen")
    )
    freeze_params_name_list: list[str] | None = field(
        default=None, metadata=_help("regexes (re.search) of the parameters to freeze")
    )
    custom_megatron_init_path: str | None = field(
        default=None, metadata=_hook_help("fn(args) -> None, once on every trainer rank after the model is built")
    )
    custom_megatron_before_log_prob_hook_path: str | None = field(
        default=None, metadata=_hook_help("fn(args, model, store_prefix) -> None, before each log-prob forward")
    )
    custom_megatron_before_train_step_hook_path: str | None = field(
        default=None,
        metadata=_hook_help(
            "fn(args, rollout_id, step_id, model, optimizer, opt_param_scheduler) -> None, before each optimizer step"
        ),
    )
    lora_export: Literal["merged", "adapter"] = field(
        default="merged",
        metadata=_help("HF exports of a LoRA run: adapters merged into the weights, or a peft adapter folder"),
    )


@dataclass(frozen=True)
class ResourceConfig:
    """Processes and devices. On a CPU-only machine a "gpu" is a process (a CPU slot)."""

    colocate: bool = field(default=False, metadata=_help("trainer and engine share devices, offloading in turns"))
    actor_num_nodes: int = field(default=1, metadata=_bounded(gt=0, help="nodes for the trainer"))
    actor_num_gpus_per_node: int = field(
        default=8, metadata=_bounded(gt=0, help="trainer processes per node (GPUs, or CPU slots)")
    )
    rollout_num_gpus: int | None = field(
        default=None,
        metadata=_bounded(
            gt=0,
            help="rollout engine devices in all (or CPU slots); unset: the trainers' (--actor-num-nodes x "
            "--actor-num-gpus-per-node) under --colocate, as slime derives it, else one engine's "
            "(--rollout-num-gpus-per-engine), where slime needs it given",
        ),
    )
    num_gpus_per_node: int = field(
        default=8,
        metadata=_bounded(
            gt=0,
            help="GPUs per node for the rollout engines: launched SGLang server i gets --random-seed --seed + i x "
            "this (slime's), and one engine may not span more (multi-node servers are not built)",
        ),
    )

    @property
    def num_trainer_procs(self) -> int:
        """Data-parallel trainer processes: ``actor_num_nodes * actor_num_gpus_per_node``."""
        return self.actor_num_nodes * self.actor_num_gpus_per_node


@dataclass(frozen=True)
class RewardConfig:
    rm_type: str = field(
        default="builtin",
        metadata=_help(
            "builtin (the default task's), math, exact_match, deepscaler, dapo, f1, gpqa, random, remote_rm, or "
            "boxed_<type> (scores the last \\boxed{} of the response)"
        ),
    )
    custom_rm_path: str | None = field(
        default=None,
        metadata=_hook_help("reward function as module:function or file.py:function; overrides --rm-type"),
    )
    reward_timeout: float = field(
        default=30.0, metadata=_bounded(gt=0, help="seconds per reward call, sync or async; over it the reward is 0")
    )
    max_reward_error_rate: float = field(
        default=0.5,
        metadata=_bounded(
            ge=0,
            le=1,
            help="ours: stop the job (exit 1) when more than this fraction of a step's rewards fail or time out for "
            "--max-reward-error-steps steps in a row; 1 never stops",
        ),
    )
    max_reward_error_steps: int = field(
        default=3,
        metadata=_bounded(gt=0, help="ours: consecutive steps over --max-reward-error-rate that stop the job"),
    )
    rm_url: str | None = field(default=None, metadata=_help("URL of the reward server of --rm-type remote_rm"))
    http_proxy: str | None = field(default=None, metadata=_help("HTTP proxy of --rm-type remote_rm's requests"))
    reward_key: str | None = field(
        default=None, metadata=_help("the entry of a dict reward that trains (unset: 'score')")
    )
    eval_reward_key: str | None = field(
        default=None, metadata=_help("the entry of a dict reward that evaluation reports (unset: --reward-key)")
    )
    group_rm: bool = field(
        default=False, metadata=_help("--custom-rm-path is batched and called once per prompt's group")
    )
    custom_reward_post_process_path: str | None = field(
        default=None,
        metadata=_hook_help("fn(args, samples) -> (raw_rewards, rewards), in place of the group normalisation"),
    )
    custom_convert_samples_to_train_data_path: str | None = field(
        default=None,
        metadata=_hook_help("fn(args, samples) -> dict of slime's train data (tokens, response_lengths, ...)"),
    )


@dataclass(frozen=True)
class EvalConfig:
    eval_interval: int | None = field(default=None, metadata=_bounded(gt=0, help="evaluate every this many steps"))
    eval_prompt_data: list[str] | None = field(
        default=None,
        metadata=_help(
            "evaluation datasets as name/path pairs (aime /data/aime.jsonl ...), or one path (named after its file)"
        ),
    )
    eval_config: str | None = field(
        default=None,
        metadata=_help(
            "YAML of evaluation datasets with per-dataset settings (slime's layout); wins over --eval-prompt-data"
        ),
    )
    skip_eval_before_train: bool = field(
        default=False, metadata=_help("with --eval-interval, do not evaluate before the first step")
    )
    n_samples_per_eval_prompt: int = field(default=1, metadata=_bounded(gt=0, help="responses per evaluation prompt"))
    eval_input_key: str | None = field(default=None, metadata=_help("--input-key of the evaluation data"))
    eval_label_key: str | None = field(default=None, metadata=_help("--label-key of the evaluation data"))
    eval_tool_key: str | None = field(default=None, metadata=_help("--tool-key of the evaluation data"))
    eval_temperature: float | None = field(
        default=None, metadata=_bounded(gt=0, help="evaluation temperature (unset: rollout's)")
    )
    eval_top_p: float | None = field(
        default=None, metadata=_bounded(gt=0, le=1, help="evaluation top-p (unset: rollout's)")
    )
    eval_top_k: int | None = field(default=None, metadata=_help("evaluation top-k (unset: rollout's)"))
    eval_max_response_len: int | None = field(
        default=None, metadata=_bounded(gt=0, help="evaluation max new tokens (unset: --rollout-max-response-len)")
    )
    eval_max_context_len: int | None = field(
        default=None,
        metadata=_bounded(
            gt=0, help="evaluation context (unset: --rollout-max-context-len); as in slime, recorded only"
        ),
    )
    eval_max_prompt_len: int | None = field(
        default=None,
        metadata=_bounded(gt=0, help="drop evaluation prompts longer than this (unset: --rollout-max-prompt-len)"),
    )
    eval_min_new_tokens: int | None = field(
        default=None,
        metadata=_bounded(ge=0, help="evaluation responses get at least this many tokens (eos and stop ids held off)"),
    )


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None = field(default=None, metadata=_help("checkpoint directory"))
    save_interval: int | None = field(
        default=None, metadata=_bounded(gt=0, help="save every this many steps (and at the end)")
    )
    save_hf: str | None = field(
        default=None,
        metadata=_help("also write the model in HF format at every save, to this path formatted with {rollout_id}"),
    )
    start_rollout_id: int | None = field(
        default=None, metadata=_help("the first step to run (default: the --load checkpoint's next step, else 0)")
    )
    load: str | None = field(default=None, metadata=_help("checkpoint directory to resume from"))
    ref_load: str | None = field(
        default=None, metadata=_help("the reference model's HF folder (unset: --hf-checkpoint's weights)")
    )
    ref_ckpt_step: int | None = field(
        default=None,
        metadata=_help("--train-backend megatron: the step of a Megatron --ref-load save root to load (iter_NNNNNNN)"),
    )
    no_save_optim: bool = field(
        default=False, metadata=_help("checkpoints leave the optimizer's state out (a resume starts it afresh)")
    )


@dataclass(frozen=True)
class LogConfig:
    use_tensorboard: bool = field(default=False, metadata=_help("write TensorBoard event files to the output dir"))
    use_wandb: bool = field(default=False, metadata=_help("log to Weights & Biases (needs the wandb package)"))
    wandb_project: str | None = field(default=None, metadata=_help("W&B project"))
    wandb_team: str | None = field(default=None, metadata=_help("W&B entity"))
    wandb_group: str | None = field(default=None, metadata=_help("W&B group (and run name)"))
    wandb_mode: Literal["online", "offline", "disabled"] | None = field(default=None, metadata=_help("W&B mode"))
    wandb_dir: str | None = field(default=None, metadata=_help("W&B local folder (unset: --output-dir)"))
    wandb_key: str | None = field(default=None, metadata=_help("W&B API key (logs in unless offline)"))
    wandb_host: str | None = field(default=None, metadata=_help("W&B host of the login"))
    wandb_run_id: str | None = field(default=None, metadata=_help("resume this W&B run"))
    disable_wandb_random_suffix: bool = field(
        default=False, metadata=_help("no random suffix on --wandb-group (and the run name)")
    )
    tb_project_name: str | None = field(
        default=None, metadata=_help("TensorBoard: write to tensorboard_log/<this>/<--tb-experiment-name>")
    )
    tb_experiment_name: str | None = field(
        default=None, metadata=_help("TensorBoard experiment (unset: the start time) under --tb-project-name")
    )
    log_reward_category: str | None = field(
        default=None, metadata=_help("log the fraction of samples by this entry of their dict reward")
    )
    log_passrate: bool = field(
        default=False, metadata=_help("log pass@k (k = 1, 2, 4, ... up to the group size) of rollouts and evaluation")
    )
    log_multi_turn: bool = field(
        default=False, metadata=_help("log response lengths with and without tool output, and round counts")
    )
    log_correct_samples: bool = field(
        default=False,
        metadata=_help(
            "log the correct samples' (reward 1) response lengths by quarter of --rollout-max-response-len, and "
            "their mean -log-prob"
        ),
    )
    wandb_always_use_train_step: bool = field(
        default=False,
        metadata=_help(
            "W&B and TensorBoard x axis: optimizer steps so far (rollout x steps per rollout), not rollouts"
        ),
    )


@dataclass(frozen=True)
class DebugConfig:
    """slime's debug and replay modes: how to bisect train against rollout problems."""

    save_debug_rollout_data: str | None = field(
        default=None, metadata=_help("save each step's rollout samples to this path formatted with {rollout_id}")
    )
    load_debug_rollout_data: str | None = field(
        default=None,
        metadata=_help("replay saved rollouts (path formatted with {rollout_id}) instead of generating; no engines"),
    )
    load_debug_rollout_data_subsample: float | None = field(
        default=None, metadata=_help("replay about this fraction of each saved rollout, in (0, 1]")
    )
    load_forge_rollout_data: str | None = field(
        default=None,
        metadata=_help(
            "the saved rollout (a path, or formatted with {rollout_id}; missing steps fall back to 0) that "
            "--rollout-function-path slime.rollout.forge_load.generate_rollout returns; engines stay live"
        ),
    )
    save_debug_train_data: str | None = field(
        default=None, metadata=_help("save each step's training batch to this path formatted with {rollout_id}")
    )
    dump_details: str | None = field(
        default=None,
        metadata=_help(
            "a folder: sets --save-debug-rollout-data DIR/rollout_data/{rollout_id}.pt and "
            "--save-debug-train-data DIR/train_data/{rollout_id}.pt"
        ),
    )
    debug_rollout_only: bool = field(default=False, metadata=_help("generate and score rollouts only: no trainers"))
    record_memory_history: bool = field(
        default=False,
        metadata=_help(
            "record the trainers' CUDA allocator history; dump it at a step and on OOM (memory_viz pickles)"
        ),
    )
    memory_snapshot_dir: str = field(default=".", metadata=_help("folder of the memory snapshots"))
    memory_snapshot_num_steps: int | None = field(
        default=None, metadata=_help("dump the snapshot after this many rollouts trained (unset: on OOM only)")
    )
    memory_recorder: Literal["torch", "memray"] = field(
        default="torch", metadata=_help("torch: the CUDA allocator's history (memray is not built)")
    )
    profile_target: list[str] = field(
        default_factory=lambda: ["train_overall"],
        metadata=_help("what is profiled: train_overall (the memory history; the others need Megatron's profiler)"),
    )
    debug_train_only: bool = field(
        default=False, metadata=_help("train only, on --load-debug-rollout-data: no engines, no evaluation")
    )

    @property
    def rollout_data_path(self) -> str | None:
        """Where rollouts are saved: ``--save-debug-rollout-data``, or ``--dump-details``' folder."""
        if self.save_debug_rollout_data is None and self.dump_details is not None:
            return os.path.join(self.dump_details, "rollout_data", "{rollout_id}.pt")
        return self.save_debug_rollout_data

    @property
    def train_data_path(self) -> str | None:
        """Where training batches are saved: ``--save-debug-train-data``, or ``--dump-details``' folder."""
        if self.save_debug_train_data is None and self.dump_details is not None:
            return os.path.join(self.dump_details, "train_data", "{rollout_id}.pt")
        return self.save_debug_train_data

    @property
    def train_only(self) -> bool:
        """No engines: ``--debug-train-only``, which ``--load-debug-rollout-data`` implies (as in slime)."""
        return self.debug_train_only or self.load_debug_rollout_data is not None


@dataclass(frozen=True)
class SGLangConfig:
    """The SGLang fleet of ``--rollout-engine sglang``: launched servers (or running ones), the router in front,
    weight sync. ``sglang_args`` / ``router_args`` hold the ``--sglang-*`` / ``--router-*`` passthrough flags by
    SGLang's own names (``runtime.engines.sglang_flags``); they have no flag of their own."""

    rollout_num_gpus_per_engine: int = field(
        default=1, metadata=_help("GPUs per SGLang server (its tensor-parallel size); --rollout-num-gpus in all")
    )
    rollout_external_engine_addrs: str | None = field(
        default=None,
        metadata=_help("use these running SGLang servers (comma- or space-separated host:port or URLs); no launch"),
    )
    sglang_server_command: str = field(
        default="python -m sglang.launch_server",
        metadata=_help("ours: the command that starts one SGLang server (the launcher appends its flags)"),
    )
    sglang_server_startup_timeout: float = field(
        default=600.0, metadata=_help("ours: seconds a launched server may take to answer /health_generate")
    )
    sglang_router_ip: str | None = field(
        default=None, metadata=_help("use the running SGLang router at this address instead of launching one")
    )
    sglang_router_port: int | None = field(
        default=None, metadata=_help("port of the router (with --sglang-router-ip)")
    )
    sglang_router_request_timeout_secs: int = field(
        default=14400, metadata=_help("seconds the router waits for one request")
    )
    update_weight_transport: Literal[WEIGHT_TRANSPORTS] | None = field(
        default=None,
        metadata=_help(
            "how weights reach the engines: nccl (a torch.distributed broadcast in buckets; gloo on the CPU), disk "
            "(safetensors) or ipc (colocated engines load buckets as handles to the trainer's memory: CUDA IPC, "
            "shared memory on the CPU), lora_adapter (--lora-rank with SGLang: the adapters as a peft folder, loaded "
            "with /load_lora_adapter; the launcher adds --enable-lora); unset: ipc under --colocate (disk where ipc "
            "is not built: SGLang engines of several GPUs, several Megatron processes), else nccl on GPUs (from "
            "the trainer's GPU memory, the next bucket packed while one is in flight) and for SGLang, and Ray's "
            "object store for the embedded engine on the CPU"
        ),
    )
    check_weight_update_equal: bool = field(
        default=False, metadata=_help("after the first weight sync, compare every engine's weights with the trainer's")
    )
    update_weight_disk_dir: str | None = field(
        default=None,
        metadata=_help(
            "where --update-weight-transport disk writes one HF folder per sync (weight_v<version, 6 digits>), on a "
            "file system the engines read; unset: a temporary folder (slime needs it given)"
        ),
    )
    update_weight_disk_keep_files: bool = field(
        default=False,
        metadata=_help("keep every folder a disk sync writes (by default each is deleted once the engines loaded it)"),
    )
    custom_update_weight_post_write_path: str | None = field(
        default=None,
        metadata=_hook_help(
            "fn(args, version_dir, rollout_engines) -> None, after a disk sync's folder is written and before the "
            "engines read it (to publish it on a file system without cross-host visibility); rollout_engines are "
            "the engine actors"
        ),
    )
    sglang_server_concurrency: int = field(
        default=512,
        metadata=_bounded(
            gt=0, help="requests in flight per SGLang engine through the router (this x the engines in all)"
        ),
    )
    offload_rollout: bool | None = field(
        default=None,
        metadata=_help(
            "release the engines' memory while training (weights back before a sync); unset: auto under --colocate "
            "(offload in the first step, then only if trainer and engine do not fit their device together; SGLang "
            "engines always), off otherwise"
        ),
    )
    offload_train: bool | None = field(
        default=None,
        metadata=_help(
            "offload the trainers while the engines generate; unset: auto under --colocate (as --offload-rollout)"
        ),
    )
    offload: bool = field(default=False, metadata=_help("--offload-train and --offload-rollout both on (slime's)"))
    sglang_args: dict = field(default_factory=dict, metadata={"help": "--sglang-<flag> values", "passthrough": True})
    router_args: dict = field(default_factory=dict, metadata={"help": "--router-<flag> values", "passthrough": True})


@dataclass(frozen=True)
class FaultConfig:
    """What a job survives: a dead or unhealthy rollout engine (slime's fault-tolerance group, on by default here)
    and a dead trainer process (ours)."""

    use_fault_tolerance: bool = field(
        default=True,
        metadata=_help(
            "check the rollout engines' health, re-dispatch a dead engine's requests to live ones, restart it and "
            "re-push the weights (on by default, unlike slime; --no-use-fault-tolerance: a dead engine stops the job)"
        ),
    )
    rollout_health_check_interval: float = field(
        default=30.0, metadata=_bounded(gt=0, help="seconds between two health checks of every engine")
    )
    rollout_health_check_timeout: float = field(
        default=30.0,
        metadata=_bounded(gt=0, help="seconds an engine may take to answer a health check before it is restarted"),
    )
    rollout_health_check_first_wait: float = field(
        default=0.0,
        metadata=_bounded(ge=0, help="seconds of grace after the engines are (re)started or resumed before checking"),
    )
    max_trainer_restarts: int = field(
        default=2,
        metadata=_bounded(
            ge=0,
            help="ours: times a dead trainer process is survived by rebuilding the job from the latest --save "
            "checkpoint",
        ),
    )


@dataclass(frozen=True)
class Config:
    seed: int = field(default=1234, metadata=_help("seed of prompt shuffling, sampling and initialisation"))
    output_dir: str = field(default="outputs/default", metadata=_help("metrics, event files, plots, final model"))
    custom_config_path: str | None = field(
        default=None,
        metadata=_help(
            "slime's YAML of settings that override the command line; keys that are no flag reach hooks as args.<key>"
        ),
    )
    custom_args: dict = field(
        default_factory=dict, metadata=_help("ours: extra settings for hooks, read as args.<key> (the YAML's others)")
    )
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    resources: ResourceConfig = field(default_factory=ResourceConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)

    def __getattr__(self, name: str) -> Any:
        # slime's hooks read a flat namespace (args.n_samples_per_prompt); leaf names are unique across sections,
        # so a flat read resolves to exactly one field. Only called when normal lookup fails.
        spec = _SPECS.get(name) if not name.startswith("_") else None
        if name in _SLIME_POSITIVE:
            # slime stores its --disable-* flags under the positive name (args.rewards_normalization).
            return _SLIME_POSITIVE[name](self)
        if spec is None or spec[0] is None:
            # A hook's own setting from --custom-config-path (slime sets any key of that YAML on args).
            extra = object.__getattribute__(self, "custom_args")
            if not name.startswith("_") and name in extra:
                return extra[name]
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(object.__getattribute__(self, spec[0]), name)

    @property
    def is_builtin_job(self) -> bool:
        """Whether this is the built-in demo job: no ``--hf-checkpoint`` and no ``--prompt-data``."""
        return self.model.hf_checkpoint is None and self.data.prompt_data is None


# slime's args that its --disable-* flags store into, as hooks read them.
_SLIME_POSITIVE: dict[str, Any] = {
    "rollout_global_dataset": lambda c: not c.data.disable_rollout_global_dataset,
    "compute_advantages_and_returns": lambda c: not c.algo.disable_compute_advantages_and_returns,
    "rewards_normalization": lambda c: not c.algo.disable_rewards_normalization,
    "grpo_std_normalization": lambda c: not c.algo.disable_grpo_std_normalization,
}

_CONFIG_HINTS = typing.get_type_hints(Config)
SECTIONS: dict[str, type] = {name: tp for name, tp in _CONFIG_HINTS.items() if dataclasses.is_dataclass(tp)}
_TOP_LEVEL = tuple(f.name for f in dataclasses.fields(Config) if f.name not in SECTIONS)


# The built-in demo job's tuned values (no --hf-checkpoint, no --prompt-data). They fill only the settings the user
# did not give (flag or YAML key); every other job gets the flag defaults above, which follow slime's.
BUILTIN_JOB_DEFAULTS: dict[str, Any] = {
    "rollout_max_response_len": 8,
    "lr": 1e-3,
    "use_kl_loss": True,
    "kl_loss_type": "low_var_kl",
    "rollout_shuffle": True,
    "rollout_batch_size": 32,
    "n_samples_per_prompt": 8,
    "num_rollout": 250,
    "micro_batch_size": 8,
    "actor_num_gpus_per_node": 1,
    "calculate_per_token_loss": True,
    "use_tensorboard": True,
    "rollout_skip_special_tokens": True,
    # Under --lora-rank: the random-init model's logits are bounded by its frozen tied embedding (rows of norm 0.18
    # under an RMSNorm of gain 1 cap a token's probability near 0.2), so adapters alone cannot make it confident:
    # the embedding (and with it the tied LM head) trains in full beside them.
    "lora_modules_to_save": "embed_tokens",
}


# One folder per NVIDIA GPU the driver has.
NVIDIA_GPUS_DIR = "/proc/driver/nvidia/gpus"


def _local_gpus() -> int:
    """NVIDIA devices this process sees (the built-in job runs on this machine alone): the driver's GPUs, as many as
    ``CUDA_VISIBLE_DEVICES`` leaves. Read without torch, which the front end does not import (torch's own count
    initialises CUDA's runtime for it)."""
    try:
        present = len(os.listdir(NVIDIA_GPUS_DIR))
    except OSError:
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return present
    # CUDA takes the listed devices up to the first that is no device (empty, or negative as in "-1").
    listed = 0
    for entry in visible.split(","):
        if not entry.strip() or entry.strip().startswith("-"):
            break
        listed += 1
    return min(present, listed)


# slime's forge rollout function (--load-forge-rollout-data), by slime's path and ours.
FORGE_ROLLOUT_PATHS = ("slime.rollout.forge_load.generate_rollout", "runtime.rollout.replay.forge_rollout")


def top_p_replay(cfg: Config) -> bool:
    """Whether the job replays the rollout's top-p nucleus in training (slime's rule: ``--rollout-top-p`` below 1;
    ``--no-rollout-top-p-replay`` is ours)."""
    return cfg.rollout.rollout_top_p < 1 and cfg.rollout.rollout_top_p_replay


def teacher_from_samples(cfg: Config) -> bool:
    """Whether the teacher's log-probs come with the samples (``--use-opd --opd-type sglang``: a teacher server,
    asked by a reward or generate function), not from a teacher model in the trainers."""
    return cfg.algo.use_opd and cfg.algo.opd_type == "sglang"


def flag(name: str) -> str:
    """The command-line flag of a field: ``rollout_batch_size`` -> ``--rollout-batch-size``."""
    return "--" + name.replace("_", "-")


def _field_specs() -> dict[str, tuple[str | None, dataclasses.Field, Any]]:
    """Every leaf field by name: (section or None for top level, the Field, its resolved type)."""
    specs: dict[str, tuple[str | None, dataclasses.Field, Any]] = {}
    for f in dataclasses.fields(Config):
        if f.name in SECTIONS:
            cls = SECTIONS[f.name]
            hints = typing.get_type_hints(cls)
            for sub in dataclasses.fields(cls):
                if sub.name in specs:
                    raise RuntimeError(f"field {sub.name} appears in two config sections")
                specs[sub.name] = (f.name, sub, hints[sub.name])
        else:
            specs[f.name] = (None, f, _CONFIG_HINTS[f.name])
    return specs


_SPECS = _field_specs()


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


@functools.cache
def _schema(*, strict: bool) -> Any:
    """pydantic's validator of the flat settings (every field by name, with its declared type): strict, the type check
    (no bool for an int, no text for a number); lax, over the float fields only, the conversion of YAML's numbers that
    arrive as text. Built on first use (one schema for all fields: one per field took ~10x longer); ``--help``
    needs neither."""
    from pydantic import ConfigDict, TypeAdapter
    from typing_extensions import TypedDict  # pydantic's TypedDict support needs this one below Python 3.12

    fields = {
        name: _constrained(tp, f.metadata.get("bounds")) if strict else tp
        for name, (_, f, tp) in _SPECS.items()
        if strict or _unwrap_optional(tp)[0] is float
    }
    flat = TypedDict("FlatConfig", fields, total=False)
    flat.__pydantic_config__ = ConfigDict(strict=strict)
    return TypeAdapter(flat)


def _constrained(tp: Any, bounds: Mapping[str, float] | None) -> Any:
    """``tp`` with a field's declared bounds as pydantic constraints on its number (``X | None`` keeps None free)."""
    if not bounds:
        return tp
    from typing import Annotated

    from pydantic import Field

    inner, optional = _unwrap_optional(tp)
    number = Annotated[inner, Field(**bounds)]
    return number | None if optional else number


# How a bound reads in a message: ``gt=0`` -> "> 0"; both ends -> an interval.
_BOUND_WORDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
_LOWER_BRACKET, _UPPER_BRACKET = {"gt": "(", "ge": "["}, {"lt": ")", "le": "]"}


def _bounds_text(bounds: Mapping[str, float]) -> str:
    lower = [(k, v) for k, v in bounds.items() if k in _LOWER_BRACKET]
    upper = [(k, v) for k, v in bounds.items() if k in _UPPER_BRACKET]
    if lower and upper:
        (lk, lv), (uk, uv) = lower[0], upper[0]
        return f"in {_LOWER_BRACKET[lk]}{lv:g}, {uv:g}{_UPPER_BRACKET[uk]}"
    return " and ".join(f"{_BOUND_WORDS[k]} {v:g}" for k, v in bounds.items())


# pydantic's error types of a declared bound (the value has the right type, out of range).
_BOUND_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal"})


def _type_problems(values: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """``(type problems, bound problems)``: a message for each of ``values`` (field name -> value) that does not fit
    its field's type, and for each out of its declared bounds (pydantic decides both)."""
    from pydantic import ValidationError

    try:
        _schema(strict=True).validate_python(dict(values))
    except ValidationError as err:
        kinds: dict[str, bool] = {}
        for e in err.errors():
            if e["loc"]:
                kinds[e["loc"][0]] = kinds.get(e["loc"][0], True) and e["type"] in _BOUND_ERRORS
        types = [_type_message(name, values[name]) for name, bound in kinds.items() if not bound]
        return types, [_type_message(name, values[name]) for name, bound in kinds.items() if bound]
    return [], []


def _type_message(name: str, value: Any) -> str:
    inner, _ = _unwrap_optional(_SPECS[name][2])
    bounds = _SPECS[name][1].metadata.get("bounds")
    if bounds and isinstance(value, int | float) and not isinstance(value, bool):
        return f"{flag(name)} must be {_bounds_text(bounds)}, got {value!r}"
    if value is None:
        return f"{flag(name)} must be set (got None)"
    if typing.get_origin(inner) is Literal:
        return f"{flag(name)} must be one of {', '.join(map(str, typing.get_args(inner)))}; got {value!r}"
    if typing.get_origin(inner) is list:
        return f"{flag(name)} must be a list of {typing.get_args(inner)[0].__name__}, got {value!r}"
    return f"{flag(name)} must be a {inner.__name__}, got {type(value).__name__} {value!r}"


def _coerce(name: str, value: Any) -> Any:
    """Lenient conversions for YAML input, by pydantic's lax mode: ints and numeric strings (YAML 1.1 reads ``1e-6``
    as text) to floats. Other fields, and values it cannot convert, are left for the type check to report."""
    from pydantic import ValidationError

    inner, _ = _unwrap_optional(_SPECS[name][2])
    if inner is not float or isinstance(value, bool) or value is None:
        return value
    try:
        return _schema(strict=False).validate_python({name: value})[name]
    except ValidationError:
        return value


def _normalise_key(key: Any) -> str:
    if not isinstance(key, str):
        raise ConfigError([f"config keys must be strings, got {key!r}"])
    return key.replace("-", "_")


def from_dict(tree: Mapping[str, Any] | None = None, /, **overrides: Any) -> Config:
    """Build a ``Config`` from a nested (``{"rollout": {"rollout_batch_size": 8}}``) or flat mapping and overrides.

    Keys may use dashes or underscores. Unknown keys raise ``ConfigError``. For the built-in job (neither
    ``hf_checkpoint`` nor ``prompt_data`` given) every setting absent from ``tree`` and ``overrides`` takes its
    ``BUILTIN_JOB_DEFAULTS`` value. The result is not validated: call ``validate``.
    """
    flat: dict[str, Any] = {}
    problems: list[str] = []

    def put(key: str, value: Any, where: str) -> None:
        if key not in _SPECS:
            if key in slime_flags.REFUSED_BY_DEST:
                problems.extend(slime_flags.refused_problems({key: value}))
            else:
                problems.append(f"unknown setting {key!r} in {where}")
            return
        section = _SPECS[key][0]
        if where != "top level" and where != section:
            problems.append(f"setting {key!r} belongs to section {section!r}, not {where!r}")
            return
        flat[key] = _coerce(key, value)

    for raw_key, value in (tree or {}).items():
        key = _normalise_key(raw_key)
        if key in SECTIONS:
            if value is None:
                continue
            if not isinstance(value, Mapping):
                problems.append(f"section {key!r} must be a mapping, got {type(value).__name__}")
                continue
            for sub_key, sub_value in value.items():
                put(_normalise_key(sub_key), sub_value, key)
        else:
            put(key, value, "top level")
    for key, value in overrides.items():
        put(_normalise_key(key), value, "top level")
    if problems:
        raise ConfigError(problems)
    flat = slime_compat.apply_slime_settings(flat)  # slime's paths that stand for settings (its fully-async rollout)
    fleet = ("sglang_args", "router_args", "rollout_num_gpus_per_engine", "sglang_router_ip")
    if any(flat.get(key) for key in fleet) and "rollout_engine" not in flat:
        # These configure SGLang servers: as in slime (whose only engine SGLang is), they select it.
        flat["rollout_engine"] = "sglang"
    builtin_on_one_gpu = False
    builtin = flat.get("hf_checkpoint") is None and flat.get("prompt_data") is None
    if builtin or "actor_num_gpus_per_node" in flat:
        # On N GPUs with no placement flag, the measured-faster plan (runtime.cluster.plan).
        from runtime.cluster.plan import default_placement

        for key, value in default_placement(flat, gpus=_local_gpus()).items():
            flat.setdefault(key, value)
    if builtin:
        builtin_on_one_gpu = _local_gpus() == 1 and "micro_batch_size" not in flat
        for key, value in BUILTIN_JOB_DEFAULTS.items():
            flat.setdefault(key, value)
        if flat.get("rollout_schedule", "sync") == "sync" and _local_gpus() == 1:
            # One GPU cannot hold a trainer and an engine apart: they share it in turns.
            flat.setdefault("colocate", True)
        if flat.get("rollout_schedule", "sync") != "sync":
            # One version behind, the built-in job learns clearly slower uncorrected and level with sync with
            # TIS on its off-policy tokens (5 seeds, docs/runtime.md); in sync TIS would change nothing it needs.
            flat.setdefault("use_tis", True)
    if flat.get("colocate") and "rollout_num_gpus" not in flat:
        # slime's rule: colocated engines run on the trainers' GPUs.
        per_node = flat.get("actor_num_gpus_per_node", _SPECS["actor_num_gpus_per_node"][1].default)
        flat["rollout_num_gpus"] = flat.get("actor_num_nodes", 1) * per_node
    elif "rollout_num_gpus" not in flat:
        # Running servers: slime counts their GPUs (asking each); ours counts --rollout-num-gpus-per-engine each.
        # Otherwise slime has no default (its placement needs the number); ours: one engine.
        external = flat.get("rollout_external_engine_addrs") or flat.get("sglang_url")
        servers = len(external.replace(",", " ").split()) if isinstance(external, str) else 0
        per_engine = flat.get("rollout_num_gpus_per_engine", 1)
        if isinstance(per_engine, int):
            flat["rollout_num_gpus"] = max(servers, 1) * per_engine
    if flat.get("offload") is True:
        # slime's --offload: both offloads on.
        flat.setdefault("offload_train", True)
        flat.setdefault("offload_rollout", True)
    _resolve_global_batch_size(flat)
    if builtin_on_one_gpu and isinstance(flat.get("global_batch_size"), int):
        # A GPU takes the tiny model's whole batch at once: 32 micro-batches of 8 rows made the GPU slower than
        # the CPU (each a few kernels too small to fill it).
        flat["micro_batch_size"] = flat["global_batch_size"]
    _resolve_lr_decay_iters(flat)
    # slime's defaults from --rollout-max-context-len: room for one generated token, and the evaluation's context.
    if flat.get("rollout_max_context_len") is not None and "rollout_max_prompt_len" not in flat:
        if isinstance(flat["rollout_max_context_len"], int):
            flat["rollout_max_prompt_len"] = flat["rollout_max_context_len"] - 1
    if flat.get("rollout_max_context_len") is not None and "eval_max_context_len" not in flat:
        flat["eval_max_context_len"] = flat["rollout_max_context_len"]

    sections = {name: cls(**{k: v for k, v in flat.items() if _SPECS[k][0] == name}) for name, cls in SECTIONS.items()}
    return Config(**sections, **{k: flat[k] for k in _TOP_LEVEL if k in flat})


def _resolve_global_batch_size(flat: dict[str, Any]) -> None:
    """slime's default: one rollout is ``--num-steps-per-rollout`` (1 when unset) optimizer steps."""
    if "global_batch_size" in flat:
        return
    rollout, n = flat.get("rollout_batch_size"), flat.get("n_samples_per_prompt", 1)
    steps = flat.get("num_steps_per_rollout") or 1
    if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (rollout, n, steps)):
        if rollout * n % steps == 0:
            flat["global_batch_size"] = rollout * n // steps


def _resolve_lr_decay_iters(flat: dict[str, Any]) -> None:
    """Megatron's default: the decay spans the job's optimizer steps (``--num-rollout`` x steps per rollout)."""
    if "lr_decay_iters" in flat:
        return
    rollouts, rollout, n = flat.get("num_rollout"), flat.get("rollout_batch_size"), flat.get("n_samples_per_prompt", 1)
    gbs = flat.get("global_batch_size")
    if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (rollouts, rollout, n, gbs)):
        flat["lr_decay_iters"] = max(1, rollouts * (rollout * n // gbs))


@dataclass(frozen=True)
class EvalDataset:
    """One evaluation dataset with its settings resolved: the dataset's own (``--eval-config``), else the config's
    ``defaults``, else the ``--eval-*`` flags, else the rollout's (as slime resolves them)."""

    name: str
    path: str
    n_samples_per_eval_prompt: int
    temperature: float
    top_p: float
    top_k: int
    max_response_len: int | None
    stop_token_ids: tuple[int, ...]
    stop: tuple[str, ...]
    min_new_tokens: int | None
    input_key: str
    label_key: str | None
    tool_key: str
    metadata_key: str
    apply_chat_template: bool
    apply_chat_template_kwargs: Mapping[str, Any]
    max_prompt_len: int | None
    rm_type: str | None = None
    custom_rm_path: str | None = None
    metadata_overrides: Mapping[str, Any] = field(default_factory=dict)


# Per-dataset keys of slime's --eval-config that rlcore-run takes, with the flags they fall back to (first set wins).
_EVAL_KEY_FALLBACKS: dict[str, tuple[str, ...]] = {
    "n_samples_per_eval_prompt": ("n_samples_per_eval_prompt",),
    "temperature": ("eval_temperature", "rollout_temperature"),
    "top_p": ("eval_top_p", "rollout_top_p"),
    "top_k": ("eval_top_k", "rollout_top_k"),
    "max_response_len": ("eval_max_response_len", "rollout_max_response_len"),
    "stop_token_ids": ("rollout_stop_token_ids",),
    "stop": ("rollout_stop",),
    "min_new_tokens": ("eval_min_new_tokens",),
    "input_key": ("eval_input_key", "input_key"),
    "label_key": ("eval_label_key", "label_key"),
    "tool_key": ("eval_tool_key", "tool_key"),
    "metadata_key": ("metadata_key",),
    "apply_chat_template": ("apply_chat_template",),
    "apply_chat_template_kwargs": ("apply_chat_template_kwargs",),
    "max_prompt_len": ("eval_max_prompt_len", "rollout_max_prompt_len"),
}
_EVAL_KEYS_OWN = ("name", "path", "rm_type", "custom_rm_path", "metadata_overrides")


def _eval_config_entries(path: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(defaults, datasets)`` of an ``--eval-config`` YAML file (slime's layout: ``eval: {defaults, datasets}``,
    the ``eval`` level optional, ``datasets`` a list of entries with a ``name`` or a mapping by name)."""
    if not os.path.isfile(path):
        raise ConfigError([f"--eval-config: file {os.path.abspath(path)!r} does not exist"])
    with open(path) as fh:
        try:
            root = yaml.safe_load(fh)
        except yaml.YAMLError as err:
            raise ConfigError([f"--eval-config: {path} is not valid YAML ({err})"]) from err
    tree = root.get("eval", root) if isinstance(root, Mapping) else None
    if not isinstance(tree, Mapping):
        raise ConfigError([f"--eval-config: {path} must hold a mapping (an `eval` section, or its content)"])
    defaults = dict(tree.get("defaults") or {})
    raw = tree.get("datasets")
    if isinstance(raw, Mapping):
        entries = [{"name": name, **dict(entry or {})} for name, entry in raw.items()]
    elif isinstance(raw, list) and all(isinstance(entry, Mapping) for entry in raw):
        entries = [dict(entry) for entry in raw]
    else:
        raise ConfigError([f"--eval-config: {path} defines no datasets under `eval.datasets` (a list or a mapping)"])
    problems = []
    for where, entry in [("defaults", defaults), *((f"dataset {e.get('name')!r}", e) for e in entries)]:
        unknown = sorted(set(entry) - set(_EVAL_KEY_FALLBACKS) - set(_EVAL_KEYS_OWN))
        if unknown:
            problems.append(
                f"--eval-config: {where} sets {', '.join(unknown)}, which rlcore-run does not take (it takes "
                f"{', '.join(sorted(set(_EVAL_KEY_FALLBACKS) | set(_EVAL_KEYS_OWN)))})"
            )
    for entry in entries:
        if not entry.get("name") or not entry.get("path"):
            problems.append(f"--eval-config: every dataset needs a name and a path, got {entry!r}")
    if problems:
        raise ConfigError(problems)
    return defaults, entries


def eval_datasets(cfg: Config) -> list[EvalDataset]:
    """The evaluation datasets, settings resolved: from ``--eval-config`` when given, else ``--eval-prompt-data``'s
    name/path pairs (one bare path is named ``aime``, as slime names it). Raises ``ConfigError``."""
    if cfg.eval.eval_config is not None:
        defaults, entries = _eval_config_entries(cfg.eval.eval_config)
    else:
        values = cfg.eval.eval_prompt_data or []
        if len(values) == 1:
            values = ["aime", values[0]]
        if len(values) % 2:
            raise ConfigError(
                [f"--eval-prompt-data takes name/path pairs (aime /data/aime.jsonl ...) or one path; got {values!r}"]
            )
        defaults, entries = {}, [{"name": n, "path": p} for n, p in zip(values[::2], values[1::2], strict=True)]
    names = [str(entry["name"]) for entry in entries]
    if len(set(names)) != len(names):
        raise ConfigError([f"evaluation dataset names must differ, got {names}"])
    return [resolve_eval_dataset(cfg, entry, defaults) for entry in entries]


def resolve_eval_dataset(
    cfg: Config, entry: Mapping[str, Any], defaults: Mapping[str, Any] | None = None
) -> EvalDataset:
    """An evaluation dataset (``entry``: its name, path and own settings) with every setting resolved: the entry's,
    else ``defaults``', else the ``--eval-*`` flags', else the rollout's."""
    defaults = defaults or {}
    resolved = {}
    for key, fallbacks in _EVAL_KEY_FALLBACKS.items():
        if key in entry:
            resolved[key] = entry[key]
        elif key in defaults:
            resolved[key] = defaults[key]
        else:
            resolved[key] = next((v for v in (getattr(cfg, f) for f in fallbacks) if v is not None), None)
    resolved["stop_token_ids"] = tuple(resolved["stop_token_ids"] or ())
    # slime takes one stop string or a list of them.
    stop = resolved["stop"]
    resolved["stop"] = (stop,) if isinstance(stop, str) else tuple(stop or ())
    resolved["apply_chat_template_kwargs"] = dict(resolved["apply_chat_template_kwargs"] or {})
    own = {key: entry.get(key, defaults.get(key)) for key in ("rm_type", "custom_rm_path")}
    overrides = dict(defaults.get("metadata_overrides") or {}) | dict(entry.get("metadata_overrides") or {})
    return EvalDataset(
        name=str(entry["name"]), path=str(entry["path"]), metadata_overrides=overrides, **own, **resolved
    )


def to_dict(cfg: Config) -> dict[str, Any]:
    """The nested plain-dict form of ``cfg`` (what ``dump_yaml`` writes and ``from_dict`` reads back)."""
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config, path: str | os.PathLike[str]) -> None:
    """Write ``cfg`` as YAML to ``path``; ``parse_args(["--config", path])`` reads it back equal."""
    with open(path, "w") as fh:
        yaml.safe_dump(to_dict(cfg), fh, sort_keys=False)


def load_yaml(path: str | os.PathLike[str]) -> Config:
    """Read a YAML config file (nested or flat); not validated."""
    return from_dict(read_yaml_tree(path))


def read_yaml_tree(path: str | os.PathLike[str], *, flag_name: str = "--config") -> Mapping[str, Any]:
    """The mapping a YAML config file holds, as written (only the keys it sets); raises ``ConfigError``."""
    if not os.path.isfile(path):
        raise ConfigError([f"{flag_name}: file {os.path.abspath(path)!r} does not exist"])
    with open(path) as fh:
        try:
            tree = yaml.safe_load(fh)
        except yaml.YAMLError as err:
            raise ConfigError([f"{flag_name}: {path} is not valid YAML ({err})"]) from err
    if tree is not None and not isinstance(tree, Mapping):
        raise ConfigError([f"{flag_name}: {path} must hold a mapping, got {type(tree).__name__}"])
    return tree or {}


def format_config(cfg: Config) -> str:
    """A readable listing, one ``--flag value`` per line by section; values changed from the defaults of this kind of
    job (built-in or not) are starred."""
    default = to_dict(from_dict(hf_checkpoint=cfg.model.hf_checkpoint, prompt_data=cfg.data.prompt_data))
    current = to_dict(cfg)
    width = max(len(flag(name)) for name in _SPECS)
    lines = []
    for name in _TOP_LEVEL:
        mark = "*" if current[name] != default[name] else " "
        lines.append(f"{mark} {flag(name):<{width}} {current[name]!r}")
    for section in SECTIONS:
        lines.append(f"[{section}]")
        for name, value in current[section].items():
            mark = "*" if value != default[section][name] else " "
            lines.append(f"{mark} {flag(name):<{width}} {value!r}")
    return "\n".join(lines)


def _arg_type(name: str, inner: Any, optional: bool):
    def convert(text: str) -> Any:
        if optional and text.lower() in ("none", "null"):
            return None
        if inner is dict:
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                value = None
            if not isinstance(value, dict):
                raise argparse.ArgumentTypeError(f"{flag(name)} expects a JSON object, got {text!r}")
            return value
        try:
            return inner(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag(name)} expects a {inner.__name__}, got {text!r}") from None

    convert.__name__ = inner.__name__
    return convert


# slime's schedule switches, each the same as one --rollout-schedule.
SCHEDULE_SHORTHANDS = {"--async": "one_step", "--fully-async": "fully_async"}


def _schedule_problem(namespace: dict[str, Any]) -> str | None:
    """Fold the schedule shorthands of a parsed command line into ``rollout_schedule``; a message naming both flags
    when two of them (or one and ``--rollout-schedule``) ask for different schedules."""
    given = list(dict(namespace.pop("schedule_shorthands", None) or []).items())
    if "rollout_schedule" in namespace:
        given.append((f"--rollout-schedule {namespace['rollout_schedule']}", namespace["rollout_schedule"]))
    if len({schedule for _, schedule in given}) > 1:
        first, a = given[0]
        second, b = next((other, schedule) for other, schedule in given if schedule != a)
        return f"{first} and {second} ask for different rollout schedules ({a} and {b}): give one"
    if given:
        namespace["rollout_schedule"] = given[0][1]
    return None


def negated(name: str) -> str:
    """The flag that sets a boolean field False: ``use_tis`` -> ``--no-use-tis``, ``no_save_optim`` ->
    ``--no-no-save-optim`` (the field's own flag ``--no-save-optim`` sets it True)."""
    return "--no-" + name.replace("_", "-")


class _Switch(argparse.Action):
    """A boolean field's two flags: its own sets True, the ``--no-`` one False. Unlike argparse's
    BooleanOptionalAction, which reads any flag starting ``--no-`` as False, a field named ``no_*``
    (``--no-save-optim``) is set True by its own flag."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any):
        super().__init__(option_strings, dest, nargs=0, **kwargs)
        self.positive = option_strings[0]

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, option_string == self.positive)

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's layout with a plain greedy word wrap: ``textwrap`` (argparse's) was most of ``--help``'s time over
    the ~900 flags (rlcore's and SGLang's passthrough ones)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        lines: list[str] = []
        line = ""
        for word in text.split():
            if line and len(line) + 1 + len(word) > width:
                lines.append(line)
                line = word
            else:
                line = f"{line} {word}" if line else word
        return [*lines, line] if line else lines


def build_parser() -> argparse.ArgumentParser:
    """The ``rlcore-run`` argument parser: one flag per config field, defaults suppressed so YAML can sit between."""
    parser = argparse.ArgumentParser(
        prog="rlcore-run",
        usage="rlcore-run [--config PATH.yaml] [--FLAG VALUE ...] [--sglang-FLAG ...] [--router-FLAG ...]",
        description=(
            "Run an RL post-training job (GRPO and friends). With no arguments: the built-in CPU demo job. Flag "
            "defaults follow slime's; the built-in job (no --hf-checkpoint and no --prompt-data) uses its own tuned "
            "values for the flags you leave unset: "
            + ", ".join(f"{flag(k)} {v}" for k, v in BUILTIN_JOB_DEFAULTS.items())
            + "."
        ),
        argument_default=argparse.SUPPRESS,
        # A prefix of a flag must not silently select it: --rollout-max could mean two flags as new ones land.
        allow_abbrev=False,
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--config", metavar="PATH.yaml", help="YAML config (nested by section, or flat); flags win")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="ours: parse, validate and resolve the config, print it and the placement plan, and exit (no Ray)",
    )
    for shorthand, schedule in SCHEDULE_SHORTHANDS.items():
        # Each given shorthand is recorded with its flag, so that two that disagree are named, not the last taken.
        parser.add_argument(
            shorthand,
            dest="schedule_shorthands",
            action="append_const",
            const=(shorthand, schedule),
            help=f"--rollout-schedule {schedule}",
        )
    defaults = Config()
    groups = {None: parser.add_argument_group("general")}
    for section in SECTIONS:
        groups[section] = parser.add_argument_group(section)
    for name, (section, f, tp) in _SPECS.items():
        if f.metadata.get("passthrough"):
            continue
        default = getattr(defaults, name)
        help_text = f.metadata.get("help", "") + f" (default: {default!r}"
        if name in BUILTIN_JOB_DEFAULTS:
            help_text += f"; built-in job: {BUILTIN_JOB_DEFAULTS[name]!r}"
        help_text += ")"
        group = groups[section]
        inner, optional = _unwrap_optional(tp)
        if inner is bool:
            group.add_argument(flag(name), negated(name), dest=name, action=_Switch, help=help_text)
        elif typing.get_origin(inner) is list and f.metadata.get("append"):
            group.add_argument(flag(name), dest=name, action="append", help=help_text)
        elif typing.get_origin(inner) is list:
            (item,) = typing.get_args(inner)
            group.add_argument(flag(name), dest=name, nargs="+", type=_arg_type(name, item, False), help=help_text)
        elif name == "bf16":
            # Megatron's --bf16 is a bare switch; rlcore's takes auto|true|false too.
            group.add_argument(
                flag(name), dest=name, nargs="?", const="true", choices=typing.get_args(inner), help=help_text
            )
        elif typing.get_origin(inner) is Literal:
            group.add_argument(flag(name), dest=name, choices=typing.get_args(inner), help=help_text)
        else:
            group.add_argument(flag(name), dest=name, type=_arg_type(name, inner, optional), help=help_text)
    slime_flags.add_refused_arguments(parser)
    slime_flags.add_megatron_switches(parser)
    sglang_flags.add_passthrough_flags(parser, "server")
    sglang_flags.add_passthrough_flags(parser, "router")
    return parser


def _tree_value(tree: Mapping[str, Any], key: str) -> Any:
    """The value a YAML config tree (flat, or nested by section; dashes or underscores) sets for ``key``, or None."""
    section = _SPECS[key][0]
    for raw, value in tree.items():
        name = raw.replace("-", "_") if isinstance(raw, str) else raw
        if name == key:
            return value
        if name == section and isinstance(value, Mapping):
            for sub_raw, sub_value in value.items():
                if isinstance(sub_raw, str) and sub_raw.replace("-", "_") == key:
                    return sub_value
    return None


# Keys of a --megatron-config-path entry that slime ignores (GPU allocation follows the command line).
_MEGATRON_ROLE_IGNORED = ("num_nodes", "num_gpus_per_node")


def megatron_role_overrides(path: str, *, role: str = "actor") -> dict[str, Any]:
    """The settings a ``--megatron-config-path`` YAML file (slime's ``megatron: [{name, role, overrides}]``; ``args``
    in place of ``overrides`` too) sets for ``role``, by field name; ``{}`` when it has no entry for the role.

    rlcore's Megatron backend trains the actor only, so the actor's entry is applied to the job (its keys must be
    flags of the train or algo section: the trainers'), and a critic entry is refused. ``ConfigError`` naming the
    flag and the key."""
    name = "--megatron-config-path"
    tree = read_yaml_tree(path, flag_name=name)
    entries = tree.get("megatron")
    if not isinstance(entries, list) or not all(isinstance(e, Mapping) for e in entries):
        raise ConfigError(
            [f"{name} {path}: needs a top-level 'megatron' list, e.g. megatron: [{{role: actor, overrides: {{...}}}}]"]
        )
    problems = []
    roles = [e.get("role") for e in entries]
    for other in sorted({str(r) for r in roles} - {"actor"}):
        if other == "critic":
            problems.append(
                f"{name} {path}: a critic entry, but rlcore's Megatron critic trains with the actor's flags "
                "(per-role overrides for it are not built)"
            )
        else:
            problems.append(f"{name} {path}: role {other!r} is neither actor nor critic (slime's roles)")
    if roles.count(role) > 1:
        problems.append(f"{name} {path}: {roles.count(role)} entries with role {role}, slime takes at most one")
    out: dict[str, Any] = {}
    for entry in entries:
        if entry.get("role") != role:
            continue
        overrides = entry.get("overrides") or entry.get("args") or {}
        if not isinstance(overrides, Mapping):
            problems.append(f"{name} {path}: the {role} entry's overrides must be a mapping")
            continue
        for raw_key, value in overrides.items():
            key = _normalise_key(raw_key)
            if key in _MEGATRON_ROLE_IGNORED:
                continue
            if key not in _SPECS:
                problems.append(f"{name} {path}: the {role} entry sets {raw_key!r}, which is no flag of rlcore-run")
            elif _SPECS[key][0] not in ("train", "algo"):
                problems.append(
                    f"{name} {path}: the {role} entry sets {flag(key)}, a flag of the {_SPECS[key][0]} section; a "
                    "role's overrides take the trainers' flags (train and algo sections)"
                )
            elif key == "megatron_config_path":
                problems.append(f"{name} {path}: the {role} entry cannot set {name} itself")
            else:
                out[key] = value
    if problems:
        raise ConfigError(problems)
    return out


def parse_args(argv: Sequence[str] | None = None) -> Config:
    """Parse ``rlcore-run``'s command line (``sys.argv[1:]`` when None) into a validated ``Config``.

    Precedence: defaults (the built-in job's for settings left unset when neither ``--hf-checkpoint`` nor
    ``--prompt-data`` is given), then the ``--config`` YAML file, then flags. Raises ``ConfigError``.
    """
    cfg, problems = _resolve(argv)
    if cfg is not None:
        try:
            validate(cfg)
        except ConfigError as err:
            problems += err.problems
    if problems:
        raise ConfigError(problems)
    return cfg


def resolve_args(argv: Sequence[str] | None = None) -> Config:
    """The ``Config`` a command line resolves to (YAML files read, flags applied, derived defaults filled), not
    validated: ``parse_args`` is this plus ``validate``. Raises ``ConfigError`` for flags and keys it cannot take."""
    cfg, problems = _resolve(argv)
    if problems:
        raise ConfigError(problems)
    return cfg


@functools.lru_cache(maxsize=1)
def _cached_parser() -> argparse.ArgumentParser:
    # Parsing does not change a parser: one per process serves every parse_args call.
    return build_parser()


def _resolve(argv: Sequence[str] | None) -> tuple[Config | None, list[str]]:
    """The unvalidated ``Config`` of a command line (None when it cannot be built) and the problems found."""
    parsed, extras = _cached_parser().parse_known_args(argv)
    namespace = vars(parsed)
    # Flags of slime's that this parser does not take (the SGLang fleet's, Megatron's) are named with their issue.
    problems = [slime_flags.unknown_flag_problem(arg) for arg in slime_flags.unknown_flags(extras)]
    if extras and not problems:
        problems.append(f"unexpected arguments {' '.join(extras)!r} (every value belongs to a --flag)")
    refused = {dest: namespace.pop(dest) for dest in list(namespace) if dest in slime_flags.REFUSED_BY_DEST}
    switches = slime_flags.pop_megatron_switches(namespace)
    problems += slime_flags.refused_problems(refused)
    namespace.pop("dry_run", None)  # the CLI's business (runtime.cli), not the job's
    schedule_problem = _schedule_problem(namespace)
    if schedule_problem is not None:
        return None, [*problems, schedule_problem]
    config_path = namespace.pop("config", None)
    try:
        tree = read_yaml_tree(config_path) if config_path is not None else {}
        # Passthrough flags add to (and override) the passthrough settings of the YAML file, one flag at a time.
        for key, values in sglang_flags.pop_passthrough(namespace).items():
            from_yaml = from_dict(tree) if tree else Config()
            namespace[key] = {**getattr(from_yaml.sglang, key), **values}
        custom_path = namespace.get("custom_config_path", tree.get("custom_config_path"))
        if custom_path is not None:
            # slime's --custom-config-path: its keys override the command line; the ones that are no flag of ours
            # are the hooks' (args.<key>), unless they are slime flags this runtime refuses.
            custom = read_yaml_tree(custom_path, flag_name="--custom-config-path")
            extras = dict(tree.get("custom_args") or {}) | dict(namespace.pop("custom_args", {}) or {})
            for raw_key, value in custom.items():
                key = _normalise_key(raw_key)
                if key in _SPECS:
                    namespace[key] = value
                elif key in slime_flags.REFUSED_BY_DEST:
                    problems += slime_flags.refused_problems({key: value})
                else:
                    extras[key] = value
            namespace["custom_args"] = extras
        megatron_path = namespace.get("megatron_config_path", _tree_value(tree, "megatron_config_path"))
        if megatron_path is not None:
            # slime's actor role args: the entry's overrides win over the command line.
            namespace.update(megatron_role_overrides(megatron_path, role="actor"))
        cfg = from_dict(tree, **namespace)
        given = namespace.get("train_backend", _tree_value(tree, "train_backend"))
        backend = slime_compat.backend_choice(cfg, given=given, switches=switches).name  # slime's: Megatron
        cfg = cfg if backend == cfg.train.train_backend else from_dict(tree, **namespace, train_backend=backend)
    except ConfigError as err:
        return None, problems + err.problems
    problems += slime_flags.megatron_switch_problems(switches, backend=cfg.train.train_backend)
    return cfg, problems


# Flags whose range is rlcore's: flag field -> (rlcore config class name, its field, the flags of the fields its rule
# compares it with). Each value is checked by building that class with it (and those), so the range is the one rlcore
# enforces, in rlcore's words (rlcore.loss_config / rlcore.advantage_config: torch-free).
CORE_RANGES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "eps_clip": ("LossConfig", "eps_clip", ()),
    "eps_clip_high": ("LossConfig", "eps_clip_high", ()),
    "eps_clip_c": ("LossConfig", "eps_clip_c", ()),
    "tis_clip": ("LossConfig", "tis_clip", ()),
    "tis_clip_low": ("LossConfig", "tis_clip_low", ("tis_clip",)),
    "opsm_delta": ("LossConfig", "opsm_delta", ()),
    "kl_loss_coef": ("LossConfig", "kl_loss_coef", ()),
    "entropy_coef": ("LossConfig", "entropy_coef", ()),
    "value_clip": ("LossConfig", "value_clip", ()),
    "gamma": ("AdvantageConfig", "gamma", ()),
    "lambd": ("AdvantageConfig", "lam", ()),
    "kl_coef": ("AdvantageConfig", "kl_coef", ()),
    "opd_kl_coef": ("AdvantageConfig", "opd_kl_coef", ()),
}


def _check_core_ranges(problems: list[str], cfg: Config) -> None:
    from rlcore.advantage_config import AdvantageConfig
    from rlcore.loss_config import LossConfig

    classes = {"LossConfig": LossConfig, "AdvantageConfig": AdvantageConfig}
    failed: set[str] = set()
    for name, (cls, core, partners) in CORE_RANGES.items():
        if failed & set(partners):
            continue  # a partner out of range is reported already; the comparison with it says nothing more
        values = {core: getattr(cfg, name)} | {CORE_RANGES[p][1]: getattr(cfg, p) for p in partners}
        try:
            classes[cls](**values)
        except (TypeError, ValueError) as err:
            failed.add(name)
            problems.append(f"{flag(name)} {getattr(cfg, name)!r}: out of rlcore's range ({err})")


def _check_positive(problems: list[str], cfg: Config) -> None:
    # Each number's own bounds are declared on its field (_bounded) and rlcore's are rlcore's (_check_core_ranges);
    # these are the rules that involve more than one value, or more than a bound.
    r, t, res, e = cfg.rollout, cfg.train, cfg.resources, cfg.eval
    if res.rollout_num_gpus is None:
        problems.append("--rollout-num-gpus must be a number (leave it out to have it derived)")
    if top_p_replay(cfg):
        cannot = {
            "--rollout-engine sglang": r.rollout_engine == "sglang",
            "--train-backend megatron": t.train_backend == "megatron",
        }
        problems += [
            f"--rollout-top-p {r.rollout_top_p} replays each token's nucleus in training (slime's top-p replay), "
            f"which {what} does not do yet (the embedded engine reports the nucleus, the torch backend replays it; "
            "SGLang needs slime's sglang-top_p.patch): add --no-rollout-top-p-replay to train on untruncated "
            "log-probs"
            for what, true in cannot.items()
            if true
        ]
    if e.eval_top_k is not None and e.eval_top_k != -1 and e.eval_top_k < 1:
        problems.append(f"--eval-top-k must be -1 (off) or >= 1, got {e.eval_top_k!r}")
    context, prompt = cfg.data.rollout_max_context_len, cfg.data.rollout_max_prompt_len
    if context is not None and prompt is not None and prompt > context - 1:
        problems.append(
            f"--rollout-max-prompt-len {prompt} must be below --rollout-max-context-len {context}: a response needs "
            "at least one token"
        )
    bad_env = {k: v for k, v in t.train_env_vars.items() if not isinstance(v, str) or not k or "=" in k}
    if bad_env:
        problems.append(
            f"--train-env-vars {json.dumps(bad_env)}: names must be non-empty without '=', and values strings "
            '(write {"NAME": "1"}, not {"NAME": 1})'
        )
    if any(not stop for stop in r.rollout_stop or ()):
        problems.append("--rollout-stop: stop strings must not be empty")
    if r.rollout_top_k != -1 and r.rollout_top_k < 1:
        problems.append(f"--rollout-top-k must be -1 (off) or >= 1, got {r.rollout_top_k!r}")
    _check_lora(problems, cfg)


def _check_lora(problems: list[str], cfg: Config) -> None:
    t = cfg.train
    if t.lora_rank == 0:
        return
    if cfg.algo.ref_update_interval is not None:
        problems.append(
            "--ref-update-interval with --lora-rank: the LoRA reference is the base model under the adapters, which "
            "is never trained (checkpoints hold the adapters only); drop one of them"
        )
    if t.lora_alpha <= 0:
        problems.append(f"--lora-alpha must be > 0, got {t.lora_alpha!r}")
    if not 0 <= t.lora_dropout < 1:
        problems.append(f"--lora-dropout must be in [0, 1), got {t.lora_dropout!r}")
    try:
        lora_options.parse_target_modules(t.lora_target_modules)  # the same parse the backend applies
    except ValueError as err:
        problems.append(str(err))
    if importlib.util.find_spec("peft") is None:
        problems.append("--lora-rank needs the peft package (pip install peft)")


def _check_required(problems: list[str], cfg: Config) -> None:
    """What slime requires (or derives) and this job left unset."""
    r, t = cfg.rollout, cfg.train
    if r.rollout_batch_size is None:
        problems.append("--rollout-batch-size is required (prompts per rollout), as in slime")
    if r.num_rollout is None and r.num_epoch is None:
        problems.append("set --num-rollout (rollout steps) or --num-epoch (passes over --prompt-data)")
    if r.num_rollout is None and r.num_epoch is not None and cfg.data.prompt_data is None:
        problems.append("--num-epoch counts passes over --prompt-data; the built-in task needs --num-rollout")
    steps = t.num_steps_per_rollout
    if r.rollout_batch_size is not None and steps is not None:
        per_rollout = r.rollout_batch_size * r.n_samples_per_prompt
        if per_rollout % steps:
            problems.append(
                f"--num-steps-per-rollout {steps} must divide --rollout-batch-size x --n-samples-per-prompt = "
                f"{per_rollout}"
            )
        elif t.global_batch_size is not None and t.global_batch_size != per_rollout // steps:
            problems.append(
                f"--global-batch-size {t.global_batch_size} disagrees with --num-steps-per-rollout {steps} "
                f"({per_rollout} samples per rollout / {steps} = {per_rollout // steps}): set one of them"
            )
    if t.global_batch_size is None and r.rollout_batch_size is not None and not problems:
        problems.append("--global-batch-size is unset: set it, or --num-steps-per-rollout")
    if cfg.eval.eval_prompt_data is not None or cfg.eval.eval_config is not None:
        try:
            for dataset in eval_datasets(cfg):
                problems.extend(_eval_dataset_problems(dataset))
        except ConfigError as err:
            problems.extend(err.problems)


def _eval_dataset_problems(d: EvalDataset) -> list[str]:
    """Type and range problems of one resolved evaluation dataset, named by the dataset and key."""
    where = f"evaluation dataset {d.name!r}"
    checks = {
        "n_samples_per_eval_prompt": isinstance(d.n_samples_per_eval_prompt, int) and d.n_samples_per_eval_prompt > 0,
        "temperature": isinstance(d.temperature, int | float) and d.temperature > 0,
        "top_p": isinstance(d.top_p, int | float) and 0 < d.top_p <= 1,
        "top_k": isinstance(d.top_k, int) and (d.top_k == -1 or d.top_k >= 1),
        "max_response_len": d.max_response_len is None
        or (isinstance(d.max_response_len, int) and d.max_response_len > 0),
        "rm_type": d.rm_type is None or d.rm_type in RM_TYPES or d.rm_type.removeprefix("boxed_") in RM_TYPES[1:],
        "min_new_tokens": d.min_new_tokens is None
        or (isinstance(d.min_new_tokens, int) and not isinstance(d.min_new_tokens, bool) and d.min_new_tokens >= 0),
        "stop": all(isinstance(x, str) and x for x in d.stop),
    }
    return [f"{where}: {key} {getattr(d, key)!r} is out of range" for key, ok in checks.items() if not ok]


def _check_batches(problems: list[str], cfg: Config) -> None:
    r, t, res = cfg.rollout, cfg.train, cfg.resources
    procs = res.num_trainer_procs
    if t.max_tokens_per_gpu is None:
        per_step = t.micro_batch_size * procs
        if t.global_batch_size % per_step:
            problems.append(
                f"--global-batch-size {t.global_batch_size} must be a multiple of --micro-batch-size "
                f"{t.micro_batch_size} x trainer processes {procs} (--actor-num-nodes {res.actor_num_nodes} x "
                f"--actor-num-gpus-per-node {res.actor_num_gpus_per_node}) = {per_step}"
            )
    elif t.global_batch_size % procs:
        problems.append(
            f"--global-batch-size {t.global_batch_size} must be a multiple of the trainer processes {procs} "
            f"(--actor-num-nodes x --actor-num-gpus-per-node)"
        )
    per_rollout = r.rollout_batch_size * r.n_samples_per_prompt
    if per_rollout % t.global_batch_size:
        problems.append(
            f"--global-batch-size {t.global_batch_size} must divide --rollout-batch-size {r.rollout_batch_size} x "
            f"--n-samples-per-prompt {r.n_samples_per_prompt} = {per_rollout} (each rollout is whole optimizer steps)"
        )
    # A group of one has no baseline for the estimators whose baseline is the rest of the prompt's group.
    no_baseline = cfg.algo.disable_rewards_normalization and cfg.algo.advantage_estimator != "rloo"
    # SFT and custom losses without advantages need no baseline.
    no_baseline = no_baseline or cfg.algo.disable_compute_advantages_and_returns or cfg.algo.loss_type == "sft_loss"
    if r.n_samples_per_prompt == 1 and cfg.algo.core_estimator in GROUP_BASELINE_ESTIMATORS and not no_baseline:
        problems.append(
            f"--n-samples-per-prompt 1 leaves --advantage-estimator {cfg.algo.advantage_estimator} without a group "
            f"baseline: sample >= 2 per prompt or use reinforce_plus_plus / ppo"
        )
    if r.over_sampling_batch_size is not None and r.over_sampling_batch_size < r.rollout_batch_size:
        problems.append(
            f"--over-sampling-batch-size {r.over_sampling_batch_size} must be >= --rollout-batch-size "
            f"{r.rollout_batch_size}"
        )
    prompt_len = cfg.data.rollout_max_prompt_len
    # Without --rollout-max-prompt-len the bound is the data's longest prompt: checked once the data is tokenized
    # (runtime.loop.prepare_model_and_data, still before Ray starts).
    if t.use_dynamic_batch_size and t.max_tokens_per_gpu is None:
        problems.append("--use-dynamic-batch-size packs micro-batches by --max-tokens-per-gpu: set it")
    if t.log_probs_max_tokens_per_gpu is not None and t.max_tokens_per_gpu is None:
        problems.append("--log-probs-max-tokens-per-gpu needs --max-tokens-per-gpu (the training passes' budget)")
    for name in ("max_tokens_per_gpu", "log_probs_max_tokens_per_gpu"):
        value = getattr(t, name)
        if value is not None and value < 1:
            problems.append(f"{flag(name)} must be >= 1, got {value}")
    if t.max_tokens_per_gpu is not None and prompt_len is not None and r.rollout_max_response_len is not None:
        longest = r.rollout_max_response_len + prompt_len
        if t.max_tokens_per_gpu < longest:
            problems.append(
                f"--max-tokens-per-gpu {t.max_tokens_per_gpu} cannot hold one sample of up to {longest} tokens "
                f"(--rollout-max-prompt-len {prompt_len} + --rollout-max-response-len {r.rollout_max_response_len})"
            )
    if res.colocate and res.rollout_num_gpus != procs:
        problems.append(
            f"--colocate shares devices: --rollout-num-gpus {res.rollout_num_gpus} must equal --actor-num-nodes x "
            f"--actor-num-gpus-per-node = {procs}"
        )


def _check_paths(problems: list[str], cfg: Config) -> None:
    paths = [("prompt_data", cfg.data.prompt_data)]
    if cfg.eval.eval_prompt_data is not None or cfg.eval.eval_config is not None:
        flag_name = "eval_config" if cfg.eval.eval_config is not None else "eval_prompt_data"
        paths += [(flag_name, d.path) for d in eval_datasets(cfg)]
    for name, path in paths:
        if path is None:
            continue
        if not os.path.isfile(path):
            problems.append(f"{flag(name)}: file {os.path.abspath(path)!r} does not exist")
        elif not path.endswith((".jsonl", ".parquet")):
            problems.append(f"{flag(name)}: {path!r} must be a .jsonl or .parquet file")
    checkpoint = cfg.model.hf_checkpoint
    if checkpoint is not None:
        if not os.path.isdir(checkpoint):
            problems.append(f"--hf-checkpoint: directory {os.path.abspath(checkpoint)!r} does not exist")
        elif not os.path.isfile(os.path.join(checkpoint, "config.json")):
            problems.append(f"--hf-checkpoint: {checkpoint!r} has no config.json (not a HF model directory)")
    _check_checkpoints(problems, cfg)
    # Every hook flag is resolved (imported) now, before Ray or the model start.
    for name, (_, f, _) in _SPECS.items():
        value = getattr(cfg, name)
        if not f.metadata.get("hook") or value is None:
            continue
        for path in value if isinstance(value, list) else [value]:
            try:
                resolve_hook(flag(name), path)
            except HookError as err:
                problems.append(str(err))


def _check_checkpoints(problems: list[str], cfg: Config) -> None:
    """``--load`` is a complete checkpoint whose files match its manifest and that has steps left to run (or, with
    --train-backend megatron, where the actor's weights start: :func:`runtime.cluster.checkpoint.actor_start`), or a
    folder that does not exist yet or is empty (the job starts afresh, as slime's); ``--save`` is a directory that
    exists or can be created."""
    from runtime.cluster.checkpoint import (
        CheckpointError,
        actor_start,
        final_export_done,
        resolve,
        starts_fresh,
        verify,
    )

    try:
        start = actor_start(
            backend=cfg.train.train_backend,
            load=cfg.ckpt.load,
            ref_load=cfg.ckpt.ref_load,
            ref_ckpt_step=cfg.ckpt.ref_ckpt_step,
        )
    except ValueError as err:
        problems.append(str(err))
        return
    if cfg.ckpt.load is not None and start is None and not starts_fresh(cfg.ckpt.load):
        try:
            step = verify(resolve(cfg.ckpt.load))
        except (FileNotFoundError, CheckpointError) as err:
            problems.append(str(err))
        else:
            # A job stopped during its final export (its last step saved, final_model/ not written) finishes the
            # export on --load: the output folder's config.yaml (the stopped run's) ends at this step.
            finishing = (
                step == cfg.rollout.num_rollout
                and not cfg.debug.debug_rollout_only
                and not final_export_done(os.path.join(cfg.output_dir, "final_model"))
                and _earlier_num_rollout(cfg.output_dir) == step
            )
            if step >= cfg.rollout.num_rollout and not finishing:
                problems.append(
                    f"--load {cfg.ckpt.load}: the checkpoint is at step {step}, at or past --num-rollout "
                    f"{cfg.rollout.num_rollout}: nothing is left to train and final_model/ is exported (raise "
                    "--num-rollout to go on)"
                )
    if cfg.ckpt.save is not None and (problem := _not_creatable_dir(cfg.ckpt.save)):
        problems.append(f"--save {cfg.ckpt.save}: {problem}")


def _earlier_num_rollout(output_dir: str) -> int | None:
    """``--num-rollout`` of the run that last wrote ``output_dir`` (its ``config.yaml``), or None."""
    try:
        return _tree_value(read_yaml_tree(os.path.join(output_dir, "config.yaml")), "num_rollout")
    except ConfigError:
        return None


def _check_opd_teacher(problems: list[str], cfg: Config) -> None:
    """``--opd-teacher-load`` (with ``--opd-teacher-ckpt-step``): an HF folder, or under --train-backend megatron a
    torch_dist checkpoint, or the save root holding the step asked for (slime's)."""
    a = cfg.algo
    load, step = a.opd_teacher_load, a.opd_teacher_ckpt_step
    megatron = cfg.train.train_backend == "megatron"
    if step is not None:
        if not megatron:
            problems.append(
                "--opd-teacher-ckpt-step picks a step of a Megatron --opd-teacher-load save root: it needs "
                "--train-backend megatron"
            )
            return
        from runtime.train.backends.megatron_paths import find_checkpoint

        try:
            find_checkpoint(load, step=step, flag="--opd-teacher-load")
        except ValueError as err:
            problems.append(f"{err} (--opd-teacher-ckpt-step {step})")
        return
    if os.path.isfile(os.path.join(load, "config.json")):
        return
    if not megatron:
        problems.append(
            f"--opd-teacher-load: {load!r} is not an HF model folder (no config.json); Megatron torch_dist "
            "checkpoints need --train-backend megatron"
        )
    elif not _is_megatron_checkpoint(load, "--opd-teacher-load", problems):
        problems.append(
            f"--opd-teacher-load {load!r} is neither an HF folder (config.json) nor a Megatron torch_dist checkpoint "
            "(metadata.json, or a save root with latest_checkpointed_iteration.txt)"
        )


def _is_megatron_checkpoint(path: str, flag_name: str, problems: list[str]) -> bool:
    """Whether ``path`` is a Megatron torch_dist checkpoint (folder or save root); a save root naming a missing folder
    is a problem of its own."""
    from runtime.train.backends.megatron_paths import find_checkpoint

    if not os.path.isdir(path):
        return False
    try:
        return find_checkpoint(path, flag=flag_name) is not None
    except ValueError as err:
        problems.append(str(err))
        return True


def _not_creatable_dir(path: str) -> str | None:
    """Why ``path`` can neither be used nor created as a writable directory; None when it can."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        if not os.path.isdir(path):
            return "exists and is not a directory"
        return None if os.access(path, os.W_OK | os.X_OK) else "is a directory this user cannot write to"
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot be created: {parent!r} is a file"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: {parent!r} is not writable"
    return None


def _check_combinations(problems: list[str], cfg: Config) -> None:
    if cfg.rollout.rollout_max_response_len is None and not slime_compat.is_sft_job(cfg):
        problems.append(
            "--rollout-max-response-len has no default outside the built-in job (slime has none either): set the "
            "longest response to sample, e.g. --rollout-max-response-len 1024"
        )
    if cfg.train.keep_old_actor and (
        cfg.rollout.rollout_schedule != "one_step" or cfg.rollout.update_weights_interval != 1
    ):
        problems.append(
            "--keep-old-actor keeps the weights that sampled a one-step-async rollout (slime's train_async.py): it "
            "needs --async (--rollout-schedule one_step) and --update-weights-interval 1; under the sync schedule the "
            "actor's own weights sampled the rollout, and under fully_async a batch mixes weight versions"
        )
    if cfg.train.use_stateless_adam and not cfg.ckpt.no_save_optim:
        problems.append("--use-stateless-adam keeps no optimizer state to save: add --no-save-optim (as slime asks)")
    if cfg.ckpt.save_interval is not None and cfg.ckpt.save is None and cfg.ckpt.save_hf is None:
        problems.append("--save-interval needs --save (the checkpoint directory) or --save-hf")
    if cfg.ckpt.save_hf is not None:
        try:
            cfg.ckpt.save_hf.format(rollout_id=0)
        except (KeyError, IndexError, ValueError) as err:
            problems.append(f"--save-hf {cfg.ckpt.save_hf!r}: a path formatted with {{rollout_id}} only ({err!r})")
    ref_load, ref_step = cfg.ckpt.ref_load, cfg.ckpt.ref_ckpt_step
    if ref_step is not None:
        if ref_load is None or cfg.train.train_backend != "megatron":
            problems.append(
                "--ref-ckpt-step picks a step of a Megatron --ref-load: it needs both --ref-load and "
                "--train-backend megatron"
            )
        else:
            from runtime.train.backends.megatron_paths import find_checkpoint

            try:
                find_checkpoint(ref_load, step=ref_step, flag="--ref-load")
            except ValueError as err:
                problems.append(f"{err} (--ref-ckpt-step {ref_step})")
    if ref_load is not None and not os.path.isfile(os.path.join(ref_load, "config.json")):
        if cfg.train.train_backend != "megatron":
            problems.append(
                f"--ref-load {ref_load!r}: the {cfg.train.train_backend} backend loads the reference from an HF "
                "folder (config.json and weights); Megatron torch_dist checkpoints need --train-backend megatron"
            )
        elif not _is_megatron_checkpoint(ref_load, "--ref-load", problems):
            problems.append(
                f"--ref-load {ref_load!r} is neither an HF folder (config.json) nor a Megatron torch_dist checkpoint "
                "(metadata.json, or a save root with latest_checkpointed_iteration.txt)"
            )
    start, total = cfg.ckpt.start_rollout_id, cfg.rollout.num_rollout
    if start is not None and (start < 0 or (total is not None and start >= total)):
        problems.append(f"--start-rollout-id {start} must be in [0, --num-rollout {total})")
    has_eval_data = cfg.eval.eval_prompt_data is not None or cfg.eval.eval_config is not None
    if cfg.eval.eval_interval is not None and cfg.data.prompt_data is not None and not has_eval_data:
        problems.append("--eval-interval with --prompt-data needs --eval-prompt-data")
    rm_type = cfg.reward.rm_type
    known = rm_type in RM_TYPES or (rm_type.startswith("boxed_") and rm_type[6:] in RM_TYPES[1:])
    if not known and cfg.reward.custom_rm_path is None:
        if rm_type.removeprefix("boxed_") in SLIME_RM_TYPES_NOT_BUILT:
            problems.append(f"--rm-type {rm_type}: slime's reward type is not built yet in rlcore-run (issue 13)")
        else:
            problems.append(
                f"--rm-type must be one of {', '.join(RM_TYPES)} or boxed_<type> (or use --custom-rm-path); got "
                f"{rm_type!r}"
            )
    if rm_type.removeprefix("boxed_") == "remote_rm" and not cfg.reward.rm_url and cfg.reward.custom_rm_path is None:
        problems.append("--rm-type remote_rm needs --rm-url (the reward server's URL)")
    sft = cfg.algo.loss_type == "sft_loss"  # (SFT samples carry reward 0: nothing is scored)
    if cfg.data.prompt_data is not None and rm_type == "builtin" and cfg.reward.custom_rm_path is None and not sft:
        problems.append(
            "--rm-type builtin scores the built-in task only; with --prompt-data choose --rm-type math or "
            "exact_match, or --custom-rm-path"
        )
    if cfg.algo.kl_loss_coef > 0 and not cfg.algo.use_kl_loss:
        problems.append(
            f"--kl-loss-coef {cfg.algo.kl_loss_coef} has no effect without --use-kl-loss (add it, or use --kl-coef "
            "for a KL penalty in the reward)"
        )
    a = cfg.algo
    if a.loss_agg_mode is not None and a.calculate_per_token_loss and a.loss_agg_mode != "token_mean":
        problems.append(
            "--calculate-per-token-loss is --loss-agg-mode token_mean; it contradicts --loss-agg-mode "
            f"{a.loss_agg_mode}"
        )
    kl_in_reward = a.kl_coef != 0 and a.advantage_estimator not in KL_COEF_IGNORED
    if a.ref_update_interval is not None and not a.use_kl_loss and not kl_in_reward:
        problems.append(
            "--ref-update-interval refreshes the reference model, which the job keeps only with --use-kl-loss or "
            "--kl-coef"
        )
    if a.use_opd:
        if a.opd_type is None:
            problems.append("--use-opd needs --opd-type megatron (a teacher model in the trainers) or sglang")
        elif a.opd_type == "sglang":
            if a.opd_teacher_load is not None:
                problems.append(
                    "--opd-teacher-load is for --opd-type megatron; with sglang the teacher is a server (as slime)"
                )
            teacher_filled = (
                cfg.reward.custom_rm_path is not None
                or cfg.rollout.custom_generate_function_path is not None
                or cfg.rollout.rollout_function_path not in (None, "slime.rollout.sglang_rollout.generate_rollout")
            )
            if not teacher_filled:
                problems.append(
                    "--opd-type sglang trains on each sample's teacher_log_probs, which a reward or generate function "
                    "sets: add --custom-rm-path slime.rollout.on_policy_distillation.reward_func "
                    "--custom-reward-post-process-path slime.rollout.on_policy_distillation.post_process_rewards "
                    "--rm-url http://<teacher>/generate (as slime's examples)"
                )
        elif a.opd_teacher_load is None:
            problems.append(
                "--opd-type megatron needs --opd-teacher-load (the teacher's HF folder; with --train-backend megatron "
                "also a torch_dist checkpoint)"
            )
        else:
            _check_opd_teacher(problems, cfg)
    elif a.opd_type is not None or a.opd_teacher_load is not None or a.opd_teacher_ckpt_step is not None:
        problems.append("--opd-type, --opd-teacher-load and --opd-teacher-ckpt-step take effect with --use-opd only")
    if a.num_critic_only_steps and a.advantage_estimator != "ppo":
        problems.append(
            f"--num-critic-only-steps {a.num_critic_only_steps} trains the critic, which only --advantage-estimator "
            "ppo has"
        )
    if a.use_rollout_logprobs and a.use_tis:
        problems.append(
            "--use-rollout-logprobs makes the engine's log-probs the old ones, leaving nothing for --use-tis to "
            "correct: use one of them (as slime)"
        )
    if a.kl_coef != 0 and a.kl_loss_coef != 0:
        problems.append(
            f"--kl-coef {a.kl_coef} (KL in the reward) and --kl-loss-coef {a.kl_loss_coef} (KL loss) cannot both be "
            "set, as in slime"
        )
    _check_megatron(problems, cfg)
    _check_backend_fields(problems, cfg)
    _check_hook_combinations(problems, cfg)
    _check_sglang(problems, cfg)
    _check_schedule(problems, cfg)
    _check_debug(problems, cfg)
    if cfg.log.use_wandb and importlib.util.find_spec("wandb") is None:
        problems.append("--use-wandb needs the wandb package (pip install 'rlcore[wandb]')")


MODEL_SHAPE_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name != "hf_checkpoint")


def _read_config_json(path: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(path, "config.json")) as fh:
            value = json.load(fh)
    except (OSError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


def _installed(dotted: str) -> bool:
    """Whether the module ``dotted`` can be imported, found without importing it or its parents (``find_spec`` of
    ``a.b`` imports ``a``, and megatron's ``__init__`` imports torch)."""
    top, *rest = dotted.split(".")
    spec = importlib.util.find_spec(top)
    for part in rest:
        if spec is None or not spec.submodule_search_locations:
            return False
        spec = importlib.machinery.PathFinder.find_spec(part, list(spec.submodule_search_locations))
    return spec is not None


def _check_backend_fields(problems: list[str], cfg: Config) -> None:
    """A flag that another training backend declares as its own (``OWN_FIELDS`` of its options module, named in
    ``runtime.train.backends.TRAIN_BACKEND_OPTIONS``), set away from its default, is refused: the chosen backend
    would ignore it. Which flags belong to which backend is the backends' declaration, not a list kept here."""
    chosen = cfg.train.train_backend
    # The defaults of this kind of job (the built-in job has its own, --lora-modules-to-save among them).
    defaults = from_dict(hf_checkpoint=cfg.model.hf_checkpoint, prompt_data=cfg.data.prompt_data)
    for owner in TRAIN_BACKENDS:
        if owner == chosen:
            continue
        for name, what in backend_options(owner).OWN_FIELDS.items():
            if getattr(cfg, name) != getattr(defaults, name):
                problems.append(f"{flag(name)}: {what}, used by --train-backend {owner} only")


def _check_megatron(problems: list[str], cfg: Config) -> None:
    """--train-backend megatron's flags: used only there, consistent, and (with the model shape flags, any backend)
    in agreement with --hf-checkpoint's config.json."""
    from runtime.train.backends import megatron_config

    t = cfg.train
    hf = _read_config_json(cfg.model.hf_checkpoint) if cfg.model.hf_checkpoint else None
    shape = None
    if hf is not None:
        source = f"--hf-checkpoint {cfg.model.hf_checkpoint}/config.json"
        try:
            shape = megatron_config.shape_from_hf(hf, source=source)
        except ValueError as err:
            if t.train_backend == "megatron":
                problems.append(str(err))
        if shape is not None:
            given = {name: getattr(cfg.model, name) for name in MODEL_SHAPE_FIELDS}
            problems.extend(megatron_config.shape_flag_problems(given, shape, source=source))
    if t.train_backend != "megatron":
        if t.recompute_granularity == "selective":
            problems.append(
                "--recompute-granularity selective (Megatron's core-attention recompute): the torch backend "
                "recomputes whole decoder layers only (full)"
            )
        return
    if t.ddp_bucket_size is not None and t.ddp_bucket_size < 1:
        problems.append(f"--ddp-bucket-size must be >= 1 parameters, got {t.ddp_bucket_size}")
    if t.distributed_timeout_minutes <= 0:
        problems.append(f"--distributed-timeout-minutes must be > 0, got {t.distributed_timeout_minutes}")
    if t.padded_vocab_size is not None and t.padded_vocab_size < 1:
        problems.append(f"--padded-vocab-size must be >= 1, got {t.padded_vocab_size}")
    elif shape is not None and t.padded_vocab_size is not None:
        try:
            megatron_config.vocab_rows(
                dataclasses.replace(shape, padded_vocab_size=t.padded_vocab_size),
                tp_size=max(t.tensor_model_parallel_size, 1),
            )
        except ValueError as err:
            problems.append(str(err))
    if t.megatron_config_path is not None:
        # parse_args applied the actor entry; a Config built otherwise still has its file checked.
        try:
            megatron_role_overrides(t.megatron_config_path, role="actor")
        except ConfigError as err:
            problems.extend(err.problems)
    if t.model_name is not None:
        try:
            if shape is None:
                megatron_config.mapping_of_name(t.model_name)
            else:
                megatron_config.weight_mapping(t.model_name, shape)
        except ValueError as err:
            problems.append(str(err))
    if cfg.algo.loss_type == "custom_loss" or cfg.algo.custom_pg_loss_reducer_function_path is not None:
        problems.append(
            "--loss-type custom_loss and --custom-pg-loss-reducer-function-path are hooks of the torch backend's loss "
            "(handed the HF model's logits); --train-backend megatron runs policy_loss and sft_loss"
        )
    if cfg.algo.custom_tis_function_path is not None or cfg.algo.use_rollout_entropy:
        problems.append(
            "--custom-tis-function-path and --use-rollout-entropy are built for --train-backend torch only (the "
            "Megatron backend's loss and log-prob passes do not call them yet)"
        )
    if not _installed("megatron.core"):
        problems.append("--train-backend megatron needs megatron-core 0.16.1: pip install 'rlcore[megatron]'")
    tp, pp, cp = t.tensor_model_parallel_size, t.pipeline_model_parallel_size, t.context_parallel_size
    for name, value in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp)):
        if value < 1:
            problems.append(f"{flag(name)} must be >= 1, got {value}")
    if cp != 1:
        problems.append(
            f"--context-parallel-size {cp}: context parallelism needs Transformer Engine's attention, which "
            "rlcore's Megatron backend (the local layer spec) does not use yet"
        )
    procs = cfg.resources.num_trainer_procs
    if tp >= 1 and pp >= 1 and procs % (tp * pp):
        problems.append(
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} must divide the trainer "
            f"processes ({procs}: --actor-num-nodes x --actor-num-gpus-per-node)"
        )
    if t.recompute_granularity == "full" and (t.recompute_method is None or t.recompute_num_layers is None):
        problems.append(
            "--recompute-granularity full needs --recompute-method (uniform|block) and --recompute-num-layers"
        )
    if t.recompute_granularity != "full" and (t.recompute_method is not None or t.recompute_num_layers is not None):
        problems.append("--recompute-method and --recompute-num-layers apply with --recompute-granularity full only")
    if t.lr_warmup_fraction is not None and t.lr_warmup_iters:
        problems.append("--lr-warmup-fraction and --lr-warmup-iters both set the warm-up: give one (as Megatron)")
    if t.lr_warmup_fraction is not None and not 0.0 <= t.lr_warmup_fraction <= 1.0:
        problems.append(f"--lr-warmup-fraction must be in [0, 1], got {t.lr_warmup_fraction}")
    if t.min_lr > t.lr:
        problems.append(f"--min-lr {t.min_lr} is above --lr {t.lr}")
    if t.lr_decay_style != "constant" and t.lr_decay_iters is None and cfg.rollout.num_epoch is None:
        # With --num-epoch, slime derives it from the dataset's size at the start (runtime.loop.resolve_num_rollout).
        problems.append(
            f"--lr-decay-style {t.lr_decay_style} needs --lr-decay-iters (or --num-rollout or --num-epoch to "
            "derive it)"
        )
    for name, (values, why) in MEGATRON_VALUES_BUILT.items():
        value = getattr(t, name)
        if value not in values:
            shown = ", ".join(map(str, values))
            problems.append(f"{flag(name)} {value}: {why} (takes {shown})")
    if t.overlap_cpu_optimizer_d2h_h2d and not t.optimizer_cpu_offload:
        problems.append("--overlap-cpu-optimizer-d2h-h2d overlaps the copies of --optimizer-cpu-offload: give both")
    if shape is not None:
        problems.extend(
            megatron_config.parallel_problems(
                shape, tp_size=max(tp, 1), pp_size=max(pp, 1), ep_size=max(t.expert_model_parallel_size, 1)
            )
        )


def _check_hook_combinations(problems: list[str], cfg: Config) -> None:
    """slime's hook flags that need one another, or cannot run together here."""
    a, r, t = cfg.algo, cfg.rollout, cfg.train
    if a.loss_type == "custom_loss" and a.custom_loss_function_path is None:
        problems.append("--loss-type custom_loss needs --custom-loss-function-path")
    if a.custom_loss_function_path is not None and a.loss_type != "custom_loss":
        problems.append("--custom-loss-function-path takes effect with --loss-type custom_loss only")
    if a.disable_compute_advantages_and_returns and a.loss_type == "policy_loss":
        problems.append(
            "--disable-compute-advantages-and-returns leaves --loss-type policy_loss without advantages: use "
            "--loss-type sft_loss or custom_loss"
        )
    if t.only_train_params_name_list and t.freeze_params_name_list:
        problems.append("--only-train-params-name-list and --freeze-params-name-list: give one of them (as slime)")
    for name in ("only_train_params_name_list", "freeze_params_name_list"):
        for pattern in getattr(t, name) or []:
            try:
                re.compile(pattern)
            except re.error as err:
                problems.append(f"{flag(name)} {pattern!r}: not a regular expression ({err})")
    if (t.only_train_params_name_list or t.freeze_params_name_list) and t.lora_rank > 0:
        problems.append("--only-train-params-name-list / --freeze-params-name-list cannot go with --lora-rank")
    custom_rollout = r.rollout_function_path not in (None, "slime.rollout.sglang_rollout.generate_rollout")
    custom_source = cfg.data.data_source_path not in (None, "slime.rollout.data_source.RolloutDataSourceWithBuffer")
    if cfg.data.disable_rollout_global_dataset and not (custom_rollout or custom_source):
        problems.append(
            "--disable-rollout-global-dataset leaves the built-in rollout no prompts (the default data source then "
            "holds only groups put back with add_samples): give --rollout-function-path or --data-source-path"
        )
    if cfg.data.disable_rollout_global_dataset and r.num_epoch is not None:
        problems.append("--num-epoch counts passes over the prompt data, which --disable-rollout-global-dataset drops")
    if a.custom_tis_function_path is not None and not (a.use_tis or a.get_mismatch_metrics):
        problems.append(
            "--custom-tis-function-path is called with --use-tis or --get-mismatch-metrics only (as slime): set one"
        )
    if r.rollout_schedule == "fully_async":
        if custom_rollout:
            problems.append("--rollout-function-path runs whole rollouts: use --rollout-schedule sync or one_step")
        if r.rollout_all_samples_process_path is not None:
            problems.append(
                "--rollout-all-samples-process-path runs at the end of a rollout, which --fully-async has not"
            )


def _check_debug(problems: list[str], cfg: Config) -> None:
    d = cfg.debug
    unknown_targets = sorted(set(d.profile_target) - {"train_overall", "train_actor", "train_log_probs"})
    if unknown_targets:
        problems.append(
            f"--profile-target {' '.join(unknown_targets)}: choose from train_overall, train_actor, train_log_probs"
        )
    if set(d.profile_target) - {"train_overall"}:
        problems.append(
            "--profile-target train_actor / train_log_probs select what --use-pytorch-profiler (a Megatron flag, "
            "issue 11) traces; rlcore-run's profiling is the memory history of train_overall"
        )
    if d.memory_recorder == "memray":
        problems.append("--memory-recorder memray: memray is not a dependency of rlcore; use torch (the default)")
    if d.memory_snapshot_num_steps is not None and d.memory_snapshot_num_steps <= 0:
        problems.append(f"--memory-snapshot-num-steps must be > 0, got {d.memory_snapshot_num_steps}")
    if d.record_memory_history:
        import torch

        if not torch.cuda.is_available():
            problems.append("--record-memory-history records the CUDA allocator: this machine has no CUDA device")
    forge = cfg.rollout.rollout_function_path in FORGE_ROLLOUT_PATHS
    if d.load_forge_rollout_data is not None and not forge:
        problems.append(
            "--load-forge-rollout-data is read by slime's forge rollout: add --rollout-function-path "
            "slime.rollout.forge_load.generate_rollout"
        )
    if forge and d.load_forge_rollout_data is None:
        problems.append(
            f"--rollout-function-path {cfg.rollout.rollout_function_path} replays a saved rollout: it needs "
            "--load-forge-rollout-data"
        )
    for name, path in (
        ("save_debug_rollout_data", d.save_debug_rollout_data),
        ("load_debug_rollout_data", d.load_debug_rollout_data),
        ("load_forge_rollout_data", d.load_forge_rollout_data),
        ("save_debug_train_data", d.save_debug_train_data),
    ):
        if path is not None:
            try:
                path.format(rollout_id=0)
            except (KeyError, IndexError, ValueError) as err:
                problems.append(f"{flag(name)} {path!r}: a path formatted with {{rollout_id}} only ({err!r})")
    if d.rollout_data_path is not None and d.rollout_data_path == d.train_data_path:
        problems.append("--save-debug-train-data must differ from --save-debug-rollout-data")
    if d.load_debug_rollout_data_subsample is not None and not 0 < d.load_debug_rollout_data_subsample <= 1:
        problems.append(
            f"--load-debug-rollout-data-subsample must be in (0, 1], got {d.load_debug_rollout_data_subsample!r}"
        )
    sft = slime_compat.is_sft_job(cfg)  # slime's SFT: --debug-train-only trains on the dataset, with no engine
    if d.debug_train_only and d.load_debug_rollout_data is None and not sft:
        problems.append(
            "--debug-train-only trains on saved rollouts: it needs --load-debug-rollout-data (or slime's SFT rollout, "
            "--rollout-function-path slime.rollout.sft_rollout.generate_rollout)"
        )
    if d.debug_rollout_only and d.train_only:
        problems.append("--debug-rollout-only and --debug-train-only (--load-debug-rollout-data) exclude each other")
    if d.debug_rollout_only and (cfg.ckpt.save is not None or cfg.ckpt.save_hf is not None):
        problems.append("--debug-rollout-only trains nothing: it cannot go with --save or --save-hf")
    replaying = d.debug_rollout_only or (d.train_only and not sft)
    if replaying and (cfg.ckpt.load is not None or cfg.train.sft_warmup_steps):
        problems.append(
            "the debug modes (--debug-rollout-only, --debug-train-only, --load-debug-rollout-data) start from "
            "--hf-checkpoint: they cannot go with --load or --sft-warmup-steps"
        )


def _check_sglang(problems: list[str], cfg: Config) -> None:
    s, res = cfg.sglang, cfg.resources
    uses_sglang = cfg.rollout.rollout_engine == "sglang"
    if cfg.rollout.sglang_url and s.rollout_external_engine_addrs:
        problems.append("--sglang-url is an alias of --rollout-external-engine-addrs: give one of them")
    if s.update_weight_transport == "lora_adapter":
        t = cfg.train
        if t.lora_rank == 0 or cfg.rollout.rollout_engine != "sglang":
            problems.append(
                "--update-weight-transport lora_adapter pushes LoRA adapters to SGLang engines: it needs --lora-rank "
                "and --rollout-engine sglang"
            )
        if t.lora_modules_to_save:
            problems.append(
                "--update-weight-transport lora_adapter sends the adapters only: --lora-modules-to-save "
                f"{t.lora_modules_to_save!r} trains whole modules too (drop it, or push merged weights)"
            )
        if s.check_weight_update_equal:
            problems.append(
                "--check-weight-update-equal compares the engines' weights with the trainer's merged ones; under "
                "--update-weight-transport lora_adapter the engines keep the base weights and hold the adapter apart"
            )
    if s.update_weight_transport == "ipc" and not res.colocate:
        problems.append(
            "--update-weight-transport ipc shares the trainer's memory with engines on its own devices: it needs "
            "--colocate"
        )
    if s.update_weight_transport == "ipc" and cfg.train.train_backend == "megatron" and res.num_trainer_procs > 1:
        problems.append(
            "--update-weight-transport ipc reaches one engine from the Megatron backend: with more than one trainer "
            "process give nccl or disk (unset under --colocate: disk)"
        )
    if s.update_weight_transport == "ipc" and uses_sglang and s.rollout_num_gpus_per_engine > 1:
        problems.append(
            "--update-weight-transport ipc is built for one GPU per SGLang engine: with --rollout-num-gpus-per-engine "
            "> 1 give nccl or disk (unset under --colocate: disk)"
        )
    if cfg.rollout.engine_compile and uses_sglang:
        problems.append("--engine-compile is for the embedded engine (--rollout-engine hf); SGLang compiles its own")
    if cfg.rollout.engine_max_running_requests is not None and uses_sglang:
        problems.append(
            "--engine-max-running-requests is for the embedded engine (--rollout-engine hf); SGLang servers take "
            "--sglang-max-running-requests"
        )
    for name in ("sglang_url", "rollout_external_engine_addrs"):
        if getattr(cfg, name) and not uses_sglang:
            problems.append(f"{flag(name)} is used only with --rollout-engine sglang")
    for which, values in (("server", s.sglang_args), ("router", s.router_args)):
        problems.extend(sglang_flags.passthrough_problems(which, values))
        if values and not uses_sglang:
            prefix = sglang_flags.SERVER_PREFIX if which == "server" else sglang_flags.ROUTER_PREFIX
            problems.append(f"{prefix}* flags are used only with --rollout-engine sglang")
    if s.rollout_num_gpus_per_engine < 1:
        problems.append(f"--rollout-num-gpus-per-engine must be >= 1, got {s.rollout_num_gpus_per_engine}")
    if s.offload and not (s.offload_train and s.offload_rollout):
        problems.append(
            "--offload turns --offload-train and --offload-rollout on: it cannot go with --no-offload-train or "
            "--no-offload-rollout"
        )
    if s.rollout_num_gpus_per_engine >= 1 and res.rollout_num_gpus % s.rollout_num_gpus_per_engine:
        problems.append(
            f"--rollout-num-gpus {res.rollout_num_gpus} must be a multiple of --rollout-num-gpus-per-engine "
            f"{s.rollout_num_gpus_per_engine} (each engine takes that many)"
        )
    if uses_sglang and not sglang_urls(cfg) and s.rollout_num_gpus_per_engine > res.num_gpus_per_node:
        problems.append(
            f"--rollout-num-gpus-per-engine {s.rollout_num_gpus_per_engine} > --num-gpus-per-node "
            f"{res.num_gpus_per_node}: an engine would span nodes, and rlcore launches single-node SGLang servers only"
        )
    if s.rollout_num_gpus_per_engine != 1 and not uses_sglang:
        problems.append("--rollout-num-gpus-per-engine applies to SGLang engines (--rollout-engine sglang) only")
    if (s.sglang_router_ip is None) != (s.sglang_router_port is None):
        problems.append("--sglang-router-ip and --sglang-router-port go together (the address of a running router)")
    if s.sglang_router_port is not None and not 0 < s.sglang_router_port < 65536:
        problems.append(f"--sglang-router-port must be in [1, 65535], got {s.sglang_router_port}")
    if s.sglang_router_ip is not None and s.router_args:
        problems.append("--router-* flags configure the router rlcore launches: not with --sglang-router-ip")
    if s.sglang_router_request_timeout_secs <= 0 or s.sglang_server_startup_timeout <= 0:
        problems.append("--sglang-router-request-timeout-secs and --sglang-server-startup-timeout must be > 0")
    if not s.sglang_server_command.split():
        problems.append("--sglang-server-command must not be empty")
    for name in ("offload_rollout", "offload_train"):
        if res.colocate and uses_sglang and getattr(s, name) is False:
            problems.append(
                f"--colocate shares devices between trainers and SGLang servers, which hold a fixed fraction of "
                f"their GPU: it needs {flag(name)}"
            )
        if getattr(s, name) and cfg.rollout.rollout_schedule != "sync":
            problems.append(
                f"{flag(name)} takes turns between rollout and training: it needs --rollout-schedule sync, not "
                f"{cfg.rollout.rollout_schedule}"
            )
    if uses_sglang and s.sglang_router_ip is None and importlib.util.find_spec("sglang_router") is None:
        problems.append(
            "--rollout-engine sglang launches the SGLang router, which needs the sglang-router package "
            "(pip install 'rlcore[sglang]'), or give a running one with --sglang-router-ip/--sglang-router-port"
        )


def _check_schedule(problems: list[str], cfg: Config) -> None:
    r = cfg.rollout
    if r.rollout_schedule != "sync" and cfg.resources.colocate:
        problems.append(
            f"--rollout-schedule {r.rollout_schedule} (--async / --fully-async) overlaps rollout and training, which "
            "needs trainers and engines on separate devices: colocated mode (--colocate) stays synchronous"
        )
    if r.rollout_schedule == "fully_async" and r.max_staleness < r.update_weights_interval - 1:
        problems.append(
            f"--max-staleness {r.max_staleness} must be >= --update-weights-interval {r.update_weights_interval} - 1: "
            "between two weight syncs the engines sample with one version for that many steps"
        )
    if r.partial_rollout and r.rollout_schedule != "fully_async":
        problems.append("--partial-rollout resumes generations cut off at a weight update: it needs --fully-async")
    if r.partial_rollout and r.custom_generate_function_path:
        problems.append(
            "--partial-rollout continues the default generation; it cannot resume a --custom-generate-function-path"
        )
    if r.mask_offpolicy_in_partial_rollout and not r.partial_rollout:
        problems.append("--mask-offpolicy-in-partial-rollout needs --partial-rollout")


def validate(cfg: Config) -> Config:
    """Return ``cfg`` if its settings work together; raise ``ConfigError`` listing every problem otherwise."""
    if not isinstance(cfg, Config):
        raise TypeError(f"cfg must be a runtime.config.Config, got {type(cfg).__name__}")
    problems: list[str] = []
    types, bounds = _type_problems({name: getattr(cfg, name) for name in _SPECS})
    if types:
        # Range and consistency checks assume well-typed values.
        raise ConfigError(types)
    problems += bounds
    _check_core_ranges(problems, cfg)
    _check_positive(problems, cfg)
    if problems:
        # The batch arithmetic below divides by these sizes.
        raise ConfigError(problems)
    _check_required(problems, cfg)
    if not problems:
        _check_batches(problems, cfg)
    _check_paths(problems, cfg)
    _check_combinations(problems, cfg)
    if problems:
        raise ConfigError(problems)
    return cfg
