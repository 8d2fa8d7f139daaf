"""The job's settings: a frozen dataclass tree (one section per part of the job) whose field names are slime's
flag names, the choices the registries define, and the field table the flags and YAML keys are generated from.

A section is declared beside the code that reads it where one part of the runtime does: ``algo`` in
``runtime.train.algo_options``, ``data`` in ``runtime.rollout.data_options``, ``reward`` in
``runtime.rollout.reward_options``, ``eval`` in ``runtime.evaluation_options``, ``ckpt`` in
``runtime.cluster.checkpoint_options``, ``log`` in ``runtime.logger_options``, ``fault`` in ``runtime.fault_options``,
and the rollout's functions and hooks in ``runtime.rollout.plugin_options``. The sections that many parts read
(``model``, ``rollout``, ``train``, ``resources``, ``debug``, ``sglang``) are declared here, composed with the
plug-ins' options (:func:`_plugin_options`).
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from runtime.cluster import weight_sync_options
from runtime.cluster.checkpoint_options import CheckpointConfig  # noqa: F401  (runtime.config's)
from runtime.cluster.weight_sync_options import WEIGHT_SYNC_OPTIONS, WEIGHT_TRANSPORTS  # noqa: F401  (runtime.config's)
from runtime.engines.registry import ROLLOUT_ENGINE_OPTIONS, ROLLOUT_ENGINES, engine_options
from runtime.evaluation_options import EvalConfig  # noqa: F401  (runtime.config's)
from runtime.fault_options import FaultConfig  # noqa: F401  (runtime.config's)
from runtime.logger_options import LogConfig  # noqa: F401  (runtime.config's)
from runtime.option_fields import bounded, described, flag, hook, slime  # noqa: F401  (flag: runtime.config.flag)
from runtime.rollout.data_options import DataConfig  # noqa: F401  (runtime.config's)
from runtime.rollout.plugin_options import RolloutFunctionOptions
from runtime.rollout.reward_options import RM_TYPES, SLIME_RM_TYPES_NOT_BUILT, RewardConfig  # noqa: F401  (runtime.config's)
from runtime.rollout.schedule_options import SCHEDULE_OPTIONS
from runtime.train.algo_options import KL_COEF_IGNORED, AlgoConfig  # noqa: F401  (runtime.config's)
from runtime.train.backends import TRAIN_BACKEND_OPTIONS, TRAIN_BACKENDS, backend_options

# Choices that registries define: the flags take exactly their names.
TRAIN_BACKEND_NAMES = tuple(TRAIN_BACKENDS)
ROLLOUT_ENGINE_NAMES = tuple(ROLLOUT_ENGINES)
ROLLOUT_SCHEDULES = tuple(SCHEDULE_OPTIONS)


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


# The metadata helpers every section uses (runtime.option_fields: the plug-ins' options modules use them too).
_help, _bounded, _hook_help = described, bounded, hook


def _plugin_options(section: str) -> tuple[type, ...]:
    """The options dataclasses that the plug-ins (training backends, engines, rollout schedules, weight syncs)
    declare for ``section``: the section inherits their fields, so ``cfg.train.tensor_model_parallel_size`` is a field
    the Megatron backend declares. Every plug-in's fields are there; the chosen plug-in's are checked, another's
    refused when set (``runtime.config.checks``)."""
    modules = [backend_options(n) for n in TRAIN_BACKEND_OPTIONS] + [engine_options(n) for n in ROLLOUT_ENGINE_OPTIONS]
    modules += [*SCHEDULE_OPTIONS.values(), weight_sync_options, *WEIGHT_SYNC_OPTIONS.values()]
    return tuple(dict.fromkeys(m.OPTIONS[section] for m in modules if section in m.OPTIONS))


@dataclass(frozen=True)
class ModelConfig:
    hf_checkpoint: str | None = field(
        default=None,
        metadata=_help(
            "HF model directory (config, weights, tokenizer); unset: build the tiny default model",
            slime=slime("rollout", None, note="unset: the built-in tiny model"),
        ),
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
    add_qkv_bias: bool | None = field(default=None, metadata=_help("Megatron: bias on q/k/v (Qwen2, GLM-4)"))
    post_self_attn_layernorm: bool | None = field(
        default=None, metadata=_help("Megatron: an RMSNorm after self-attention (GLM-4)")
    )
    post_mlp_layernorm: bool | None = field(default=None, metadata=_help("Megatron: an RMSNorm after the MLP (GLM-4)"))
    rotary_interleaved: bool | None = field(
        default=None, metadata=_help("Megatron: rotary pairs (2i, 2i+1), not (i, i+d/2) (GLM-4)")
    )
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
    moe_shared_expert_intermediate_size: int | None = field(
        default=None, metadata=_help("Megatron: the shared experts' width (n_shared_experts x moe_intermediate_size)")
    )
    moe_router_enable_expert_bias: bool | None = field(
        default=None, metadata=_help("Megatron: a per-expert bias for the choice (e_score_correction_bias)")
    )
    moe_router_topk_scaling_factor: float | None = field(
        default=None, metadata=_help("Megatron: gate weights' factor (routed_scaling_factor)")
    )
    moe_router_num_groups: int | None = field(default=None, metadata=_help("Megatron: expert groups (n_group)"))
    moe_router_group_topk: int | None = field(
        default=None, metadata=_help("Megatron: groups a token's experts come from (topk_group)")
    )
    # Multi-latent attention's shape flags (runtime.train.backends.megatron_mla), checked against config.json alike.
    multi_latent_attention: bool | None = field(
        default=None, metadata=_help("Megatron: multi-latent attention (DeepSeek-V3, Moonlight)")
    )
    q_lora_rank: int | None = field(default=None, metadata=_help("Megatron: MLA's query latent rank (q_lora_rank)"))
    kv_lora_rank: int | None = field(default=None, metadata=_help("Megatron: MLA's key/value latent rank"))
    qk_head_dim: int | None = field(
        default=None, metadata=_help("Megatron: MLA's query/key head without position (qk_nope_head_dim)")
    )
    qk_pos_emb_head_dim: int | None = field(
        default=None, metadata=_help("Megatron: MLA's rotary part of a query/key head (qk_rope_head_dim)")
    )
    v_head_dim: int | None = field(default=None, metadata=_help("Megatron: MLA's value head (v_head_dim)"))
    # Megatron-LM's rotary flags for MLA (YaRN), checked against config.json's rope_scaling alike.
    rope_type: str | None = field(
        default=None, metadata=_help("Megatron: rope or yarn (MLA's default: yarn; rope_scaling's type)")
    )
    rotary_scaling_factor: float | None = field(
        default=None, metadata=_help("Megatron: YaRN's context factor (rope_scaling's factor; 1: plain rotary)")
    )
    mscale: float | None = field(default=None, metadata=_help("Megatron: YaRN's mscale (rope_scaling's mscale)"))
    mscale_all_dim: float | None = field(
        default=None, metadata=_help("Megatron: YaRN's mscale_all_dim (rope_scaling's mscale_all_dim)")
    )


@dataclass(frozen=True)
class RolloutConfig(RolloutFunctionOptions, *_plugin_options("rollout")):
    rollout_batch_size: int | None = field(
        default=None,
        metadata=_bounded(
            gt=0,
            help="prompts per rollout step (required)",
            slime=slime("data", None, note="required, as in slime; built-in job: 32"),
        ),
    )
    n_samples_per_prompt: int = field(
        default=1,
        metadata=_bounded(
            gt=0,
            help="responses sampled per prompt (the group size)",
            slime=slime("data", 1, note="built-in job: 8; 1 is refused with a group baseline (by design)"),
        ),
    )
    rollout_max_response_len: int | None = field(
        default=None,
        metadata=_bounded(
            gt=0,
            help="max new tokens per response; no default (as in slime): set it for your model",
            slime=slime("rollout", None, note="built-in job: 8"),
        ),
    )
    rollout_temperature: float = field(
        default=1.0, metadata=_bounded(gt=0, help="sampling temperature", slime=slime("rollout", 1.0))
    )
    rollout_top_p: float = field(
        default=1.0,
        metadata=_bounded(
            gt=0,
            le=1,
            help="nucleus sampling threshold, in (0, 1]",
            slime=slime(
                "rollout",
                1.0,
                note="below 1: nucleus replay (embedded engine, torch backend); "
                "--no-rollout-top-p-replay (ours) opts out",
            ),
        ),
    )
    rollout_top_k: int = field(default=-1, metadata=_help("top-k sampling; -1 is off", slime=slime("rollout", -1)))
    rollout_top_p_replay: bool = field(
        default=True,
        metadata=_help(
            "with --rollout-top-p below 1, take rollout and training log-probs over each token's sampled nucleus, "
            "as slime (ours: --no-rollout-top-p-replay keeps the untruncated log-probs)"
        ),
    )
    rollout_skip_special_tokens: bool = field(
        default=False,
        metadata=_help(
            "leave special tokens (e.g. <|im_end|>) out of the response text",
            slime=slime("rollout", False, note="built-in job: on"),
        ),
    )
    rollout_stop: list[str] | None = field(
        default=None,
        metadata=_help(
            "stop strings: a response ends at the first token after which its text holds one (kept)",
            slime=slime("rollout", None),
        ),
    )
    rollout_stop_token_ids: list[int] | None = field(
        default=None,
        metadata=_help("token ids that end a response, besides the model's eos ids", slime=slime("rollout", None)),
    )
    num_rollout: int | None = field(
        default=None,
        metadata=_bounded(
            gt=0,
            help="number of rollout (and training) steps; unset: from --num-epoch",
            slime=slime("data", None, note="built-in job: 250; unset: from --num-epoch"),
        ),
    )
    num_epoch: int | None = field(
        default=None,
        metadata=_bounded(
            gt=0,
            help="passes over --prompt-data when --num-rollout is unset (whole rollouts per epoch)",
            slime=slime("data", None),
        ),
    )
    over_sampling_batch_size: int | None = field(
        default=None,
        metadata=_bounded(
            gt=0,
            help="prompts generated per sampling round when filtering; >= --rollout-batch-size",
            slime=slime("rollout", None, differs="rounds run in order (not first-completed)"),
        ),
    )
    rollout_engine: Literal[ROLLOUT_ENGINE_NAMES] = field(
        default="hf", metadata=_help("rollout engine: embedded transformers (hf) or running SGLang servers (sglang)")
    )
    rollout_schedule: Literal[ROLLOUT_SCHEDULES] = field(
        default="sync",
        metadata=_help(
            "ours: sync, one_step (rollout k+1 generated while step k trains, slime's train_async.py; --async) or "
            "fully_async (groups in flight across steps under --max-staleness; --fully-async)"
        ),
    )


@dataclass(frozen=True)
class TrainConfig(*_plugin_options("train")):
    # slime's flag is --train-backend (megatron/fsdp there); rlcore's first backend is torch (HF model, FSDP2).
    train_backend: Literal[TRAIN_BACKEND_NAMES] = field(
        default="torch",
        metadata=_help(
            "training backend",
            slime=slime("mode", "megatron", differs="default torch (by design); megatron: megatron-core, local spec"),
        ),
    )
    global_batch_size: int | None = field(
        default=None,
        metadata=_bounded(
            gt=0,
            help="samples per optimizer step, over all trainers; unset: --rollout-batch-size x "
            "--n-samples-per-prompt / --num-steps-per-rollout",
            slime=slime("megatron (reset by slime)", None, note="unset: rollout x n / steps per rollout"),
        ),
    )
    num_steps_per_rollout: int | None = field(
        default=None,
        metadata=_bounded(
            gt=0, help="optimizer steps per rollout (sets --global-batch-size; unset: 1)", slime=slime("data", None)
        ),
    )
    micro_batch_size: int = field(
        default=1,
        metadata=_bounded(
            gt=0,
            help="samples per forward/backward (without a token budget)",
            slime=slime("megatron (reset by slime)", 1, note="built-in job: 8"),
        ),
    )
    max_tokens_per_gpu: int | None = field(
        default=None,
        metadata=_bounded(
            gt=0,
            help="token budget per micro-batch: real tokens with --use-dynamic-batch-size, else rows x longest row",
            slime=slime(
                "data",
                None,
                differs="real tokens with --use-dynamic-batch-size; without it, rows x "
                "longest row, applied whenever set",
            ),
        ),
    )
    log_probs_max_tokens_per_gpu: int | None = field(
        default=None,
        metadata=_help(
            "token budget of a log-prob pass's micro-batch; unset: --max-tokens-per-gpu",
            slime=slime(
                "data",
                None,
                differs="both backends; counted as "
                "--max-tokens-per-gpu is (real tokens with --use-dynamic-batch-size)",
            ),
        ),
    )
    use_dynamic_batch_size: bool = field(
        default=False,
        metadata=_help(
            "micro-batches of at most --max-tokens-per-gpu real tokens: the torch backend concatenates each one's "
            "sequences without padding, the Megatron backend pads each to its longest row (no Transformer Engine)",
            slime=slime(
                "data",
                False,
                differs="torch backend: a packed row per micro-batch (attention split by "
                "position ids); megatron: rows grouped by real tokens, each group padded (no THD packing without "
                "Transformer Engine)",
            ),
        ),
    )
    lr: float = field(
        default=1e-6,
        metadata=_bounded(
            gt=0,
            help="learning rate (AdamW)",
            slime=slime("megatron (reset by slime)", 1e-06, note="built-in job: 1e-3"),
        ),
    )
    train_env_vars: dict = field(
        default_factory=dict,
        metadata=_help(
            "JSON object of environment variables for the trainer processes, e.g. PyTorch allocator ones",
            slime=slime("train", {}),
        ),
    )
    weight_decay: float = field(default=0.0, metadata=_bounded(ge=0, help="AdamW weight decay"))
    clip_grad: float = field(
        default=1.0, metadata=_bounded(gt=0, help="max gradient norm", slime=slime("megatron (reset by slime)", 1.0))
    )
    sft_warmup_steps: int = field(default=0, metadata=_bounded(ge=0, help="SFT steps before RL (built-in task)"))
    bf16: Literal["auto", "true", "false"] = field(
        default="auto",
        metadata=_help(
            "bf16 training; bare --bf16 is Megatron's switch (true); absent is auto: bf16 where the device supports it"
        ),
    )
    recompute_granularity: Literal["full", "selective"] | None = field(
        default=None,
        metadata=_help(
            "activation recompute: Megatron's full layers or selective core attention; the torch backend: full "
            "(every decoder layer checkpointed)",
            megatron=True,
        ),
    )
    lr_decay_iters: int | None = field(
        default=None,
        metadata=_help("Megatron: optimizer steps of the decay; unset: the job's optimizer steps", megatron=True),
    )
    only_train_params_name_list: list[str] | None = field(
        default=None,
        metadata=_help(
            "regexes (re.search) of the parameters to train; all others are frozen",
            slime=slime("train", None, note="regexes (re.search) over the backend's parameter names"),
        ),
    )
    freeze_params_name_list: list[str] | None = field(
        default=None,
        metadata=_help(
            "regexes (re.search) of the parameters to freeze",
            slime=slime("train", None, note="regexes (re.search) over the backend's parameter names"),
        ),
    )
    custom_megatron_init_path: str | None = field(
        default=None,
        metadata=_hook_help(
            "fn(args) -> None, once on every trainer rank after the model is built",
            slime=slime(
                "custom_megatron_plugins",
                None,
                differs="torch backend: model is the torch module, optimizer AdamW, opt_param_scheduler None",
            ),
        ),
    )
    custom_megatron_before_log_prob_hook_path: str | None = field(
        default=None,
        metadata=_hook_help(
            "fn(args, model, store_prefix) -> None, before each log-prob forward",
            slime=slime(
                "custom_megatron_plugins",
                None,
                differs="torch backend: model is the torch module, optimizer AdamW, opt_param_scheduler None",
            ),
        ),
    )
    custom_megatron_before_train_step_hook_path: str | None = field(
        default=None,
        metadata=_hook_help(
            "fn(args, rollout_id, step_id, model, optimizer, opt_param_scheduler) -> None, before each optimizer step",
            slime=slime(
                "custom_megatron_plugins",
                None,
                differs="torch backend: model is the torch module, optimizer AdamW, opt_param_scheduler None",
            ),
        ),
    )


@dataclass(frozen=True)
class ResourceConfig:
    """Processes and devices. On a CPU-only machine a "gpu" is a process (a CPU slot)."""

    colocate: bool = field(
        default=False,
        metadata=_help(
            "trainer and engine share devices, offloading in turns",
            slime=slime(
                "cluster",
                False,
                differs="the embedded engine offloads only when trainer and "
                "engine do not fit their GPU together (auto)",
            ),
        ),
    )
    actor_num_nodes: int = field(
        default=1,
        metadata=_bounded(
            gt=0,
            help="nodes for the trainer",
            slime=slime(
                "cluster",
                1,
                differs="above 1 only when rlcore-run joins a Ray cluster "
                "(RAY_ADDRESS); its own Ray is one node on 127.0.0.1",
            ),
        ),
    )
    actor_num_gpus_per_node: int = field(
        default=8,
        metadata=_bounded(
            gt=0,
            help="trainer processes per node (GPUs, or CPU slots)",
            slime=slime("cluster", 8, note="built-in job: 1 (on a CPU a GPU is a process)"),
        ),
    )
    rollout_num_gpus: int | None = field(
        default=None,
        metadata=_bounded(
            gt=0,
            help="rollout engine devices in all (or CPU slots); unset: the trainers' (--actor-num-nodes x "
            "--actor-num-gpus-per-node) under --colocate, as slime derives it, else one engine's "
            "(--rollout-num-gpus-per-engine), where slime needs it given",
            slime=slime(
                "cluster",
                None,
                differs="unset: the trainers' GPUs under --colocate (slime's rule), else "
                "one engine's (slime needs it given); with --rollout-external-engine-addrs one engine's per server "
                "(slime asks each server for its GPUs)",
            ),
        ),
    )
    num_gpus_per_node: int = field(
        default=8,
        metadata=_bounded(
            gt=0,
            help="GPUs per node for the rollout engines: launched SGLang server i gets --random-seed --seed + i x "
            "this (slime's), and one engine may not span more (multi-node servers are not built)",
            slime=slime(
                "cluster",
                8,
                note="launched server i gets --random-seed --seed + i x this; an engine "
                "wider than it (a multi-node server) is refused",
            ),
        ),
    )

    @property
    def num_trainer_procs(self) -> int:
        """Data-parallel trainer processes: ``actor_num_nodes * actor_num_gpus_per_node``."""
        return self.actor_num_nodes * self.actor_num_gpus_per_node


@dataclass(frozen=True)
class DebugConfig:
    """slime's debug and replay modes: how to bisect train against rollout problems."""

    save_debug_rollout_data: str | None = field(
        default=None,
        metadata=_help(
            "save each step's rollout samples to this path formatted with {rollout_id}",
            slime=slime("debug", None, note="evaluation rollouts are not saved"),
        ),
    )
    load_debug_rollout_data: str | None = field(
        default=None,
        metadata=_help(
            "replay saved rollouts (path formatted with {rollout_id}) instead of generating; no engines",
            slime=slime("mode", None),
        ),
    )
    load_debug_rollout_data_subsample: float | None = field(
        default=None,
        metadata=_help("replay about this fraction of each saved rollout, in (0, 1]", slime=slime("debug", None)),
    )
    load_forge_rollout_data: str | None = field(
        default=None,
        metadata=_help(
            "the saved rollout (a path, or formatted with {rollout_id}; missing steps fall back to 0) that "
            "--rollout-function-path slime.rollout.forge_load.generate_rollout returns; engines stay live",
            slime=slime(
                "debug",
                None,
                note="read by --rollout-function-path slime.rollout.forge_load.generate_rollout (engines stay live)",
            ),
        ),
    )
    save_debug_train_data: str | None = field(
        default=None,
        metadata=_help(
            "save each step's training batch to this path formatted with {rollout_id}",
            slime=slime("debug", None, differs="one file per step: the whole batch, from the driver"),
        ),
    )
    dump_details: str | None = field(
        default=None,
        metadata=_help(
            "a folder: sets --save-debug-rollout-data DIR/rollout_data/{rollout_id}.pt and "
            "--save-debug-train-data DIR/train_data/{rollout_id}.pt",
            slime=slime("debug", None),
        ),
    )
    debug_rollout_only: bool = field(
        default=False, metadata=_help("generate and score rollouts only: no trainers", slime=slime("mode", False))
    )
    record_memory_history: bool = field(
        default=False,
        metadata=_help(
            "record the trainers' CUDA allocator history; dump it at a step and on OOM (memory_viz pickles)",
            slime=slime("megatron (reset by slime)", False, note="the trainers' CUDA allocator; needs CUDA"),
        ),
    )
    memory_snapshot_dir: str = field(
        default=".", metadata=_help("folder of the memory snapshots", slime=slime("debug", "."))
    )
    memory_snapshot_num_steps: int | None = field(
        default=None,
        metadata=_help(
            "dump the snapshot after this many rollouts trained (unset: on OOM only)", slime=slime("debug", None)
        ),
    )
    memory_recorder: Literal["torch", "memray"] = field(
        default="torch",
        metadata=_help(
            "torch: the CUDA allocator's history (memray is not built)",
            slime=slime("debug", "torch", differs="torch only (memray is not a dependency)"),
        ),
    )
    profile_target: list[str] = field(
        default_factory=lambda: ["train_overall"],
        metadata=_help(
            "what is profiled: train_overall (the memory history; the others need Megatron's profiler)",
            slime=slime(
                "debug",
                ["train_overall"],
                differs="train_overall only (train_actor / "
                "train_log_probs are Megatron's --use-pytorch-profiler targets)",
            ),
        ),
    )
    debug_train_only: bool = field(
        default=False,
        metadata=_help(
            "train only, on --load-debug-rollout-data: no engines, no evaluation",
            slime=slime("mode", False, differs="needs --load-debug-rollout-data"),
        ),
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
class SGLangConfig(*_plugin_options("sglang")):
    """The engines' fleet: the SGLang engine's options (``runtime.engines.sglang_options``: servers, router,
    passthrough flags), the weight sync's (``runtime.cluster.weight_sync_options``) and the offloads between rollout
    and training."""

    sglang_server_concurrency: int = field(
        default=512,
        metadata=_bounded(
            gt=0,
            help="requests in flight per SGLang engine through the router (this x the engines in all)",
            slime=slime(
                "sglang", 512, note="requests in flight through the router: this x the engines (slime's semaphore)"
            ),
        ),
    )
    offload_rollout: bool | None = field(
        default=None,
        metadata=_help(
            "release the engines' memory while training (weights back before a sync); unset: auto under --colocate "
            "(offload in the first step, then only if trainer and engine do not fit their device together; SGLang "
            "engines always), off otherwise",
            slime=slime("cluster", None, differs="unset under --colocate: auto, as --offload-train"),
        ),
    )
    offload_train: bool | None = field(
        default=None,
        metadata=_help(
            "offload the trainers while the engines generate; unset: auto under --colocate (as --offload-rollout)",
            slime=slime(
                "cluster",
                None,
                differs="unset under --colocate: auto (offload in the first step, then "
                "only if needed; SGLang engines always)",
            ),
        ),
    )
    offload: bool = field(
        default=False,
        metadata=_help(
            "--offload-train and --offload-rollout both on (slime's)",
            slime=slime(
                "cluster",
                False,
                differs="sets --offload-train and --offload-rollout; refused "
                "beside --no-offload-train/-rollout (slime lets it win)",
            ),
        ),
    )


@dataclass(frozen=True)
class Config:
    seed: int = field(
        default=1234,
        metadata=_help(
            "seed of prompt shuffling, sampling and initialisation", slime=slime("megatron (reset by slime)", 1234)
        ),
    )
    output_dir: str = field(default="outputs/default", metadata=_help("metrics, event files, plots, final model"))
    custom_config_path: str | None = field(
        default=None,
        metadata=_help(
            "slime's YAML of settings that override the command line; keys that are no flag reach hooks as args.<key>",
            slime=slime(
                "megatron (reset by slime)",
                None,
                note="its keys override the command line; the ones that are no flag reach hooks as args.<key>",
            ),
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


MODEL_SHAPE_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name != "hf_checkpoint")
