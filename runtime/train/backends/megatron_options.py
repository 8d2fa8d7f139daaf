"""The Megatron backend's own options: the flags that only ``--train-backend megatron`` reads (Megatron's flags under
slime's names and Megatron's meanings, and slime's flags of its Megatron backend), the values of Megatron's flags that
it builds, and the rules that hold between them. Declared here, beside the backend: ``runtime.config`` composes
:class:`MegatronOptions` into its ``train`` section (``cfg.train.tensor_model_parallel_size``), refuses these flags
under another backend (from :data:`OWN_FIELDS`), and runs :func:`check` when this backend is chosen."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from runtime.option_fields import described, flag, hook, own_fields, slime

# Megatron's --attention-backend choices (megatron.core.transformer.enums.AttnBackend).
MEGATRON_ATTENTION_BACKENDS = ("auto", "local", "unfused", "flash", "fused")


@dataclass(frozen=True)
class MegatronOptions:
    """Megatron's flags (the torch backend refuses them away from their defaults, naming the flag)."""

    OWN = "a Megatron flag"

    tensor_model_parallel_size: int = field(
        default=1, metadata=described(own="a Megatron flag", text="Megatron: tensor-parallel ranks per model")
    )
    pipeline_model_parallel_size: int = field(
        default=1, metadata=described(own="a Megatron flag", text="Megatron: pipeline stages")
    )
    decoder_first_pipeline_num_layers: int | None = field(
        default=None,
        metadata=described(
            own="a Megatron flag",
            text="Megatron: decoder layers of the first pipeline stage (unset: as the middle stages, which split the "
            "rest equally)",
        ),
    )
    decoder_last_pipeline_num_layers: int | None = field(
        default=None,
        metadata=described(
            own="a Megatron flag",
            text="Megatron: decoder layers of the last pipeline stage (unset: as the middle stages, which split the "
            "rest equally)",
        ),
    )
    context_parallel_size: int = field(
        default=1, metadata=described(own="a Megatron flag", text="Megatron: context-parallel ranks (needs TE)")
    )
    sequence_parallel: bool = field(
        default=False,
        metadata=described(
            own="a Megatron flag",
            text=(
                "Megatron: sequence parallelism within TP (off at TP 1, as Megatron-LM turns it off there); MoE "
                "layers at TP > 1 need it"
            ),
        ),
    )
    recompute_method: Literal["uniform", "block"] | None = field(
        default=None,
        metadata=described(
            own="a Megatron flag", text="Megatron: which layers --recompute-granularity full recomputes"
        ),
    )
    recompute_num_layers: int | None = field(
        default=None, metadata=described(own="a Megatron flag", text="Megatron: layers per recompute unit")
    )
    optimizer: Literal["adam"] = field(
        default="adam", metadata=described(own="a Megatron flag", text="Megatron: adam (AdamW; sgd is not built)")
    )
    adam_beta1: float = field(default=0.9, metadata=described(own="a Megatron flag", text="Megatron: Adam beta1"))
    adam_beta2: float = field(default=0.999, metadata=described(own="a Megatron flag", text="Megatron: Adam beta2"))
    adam_eps: float = field(default=1e-8, metadata=described(own="a Megatron flag", text="Megatron: Adam epsilon"))
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root"] = field(
        default="constant",
        metadata=described(
            own="a Megatron flag",
            text="Megatron: learning-rate decay (ours: default constant, as slime's scripts; Megatron linear)",
        ),
    )
    lr_warmup_iters: int = field(
        default=0, metadata=described(own="a Megatron flag", text="Megatron: linear warm-up steps")
    )
    lr_warmup_fraction: float | None = field(
        default=None,
        metadata=described(
            own="a Megatron flag", text="Megatron: warm-up as a fraction of --lr-decay-iters (instead of iters)"
        ),
    )
    min_lr: float = field(default=0.0, metadata=described(own="a Megatron flag", text="Megatron: the decay's floor"))
    accumulate_allreduce_grads_in_fp32: bool = field(
        default=False,
        metadata=described(
            own="a Megatron flag", text="Megatron: keep and all-reduce gradients in float32 under --bf16"
        ),
    )
    use_distributed_optimizer: bool = field(
        default=True,
        metadata=described(
            own="a Megatron flag", text="Megatron: shard optimizer state over data-parallel ranks (slime forces it on)"
        ),
    )
    overlap_grad_reduce: bool = field(
        default=False,
        metadata=described(
            own="a Megatron flag",
            text="Megatron: DDP reduces each gradient bucket during the last micro-batch's backward, as soon as "
            "it is ready",
        ),
    )
    ddp_bucket_size: int | None = field(
        default=None,
        metadata=described(
            own="a Megatron flag",
            text="Megatron: parameters per DDP gradient bucket (default: megatron-core's, 40M or 1M x DP)",
        ),
    )
    bias_swiglu_fusion: bool = field(
        default=True,
        metadata=described(
            own="a Megatron flag",
            text="Megatron: SwiGLU as megatron-core's fused function (torch.compile'd, on GPUs; the CPU runs it "
            "eagerly); "
            "--no-bias-swiglu-fusion turns it off",
        ),
    )
    attention_backend: Literal[MEGATRON_ATTENTION_BACKENDS] = field(
        default="auto",
        metadata=described(
            own="a Megatron flag",
            text="Megatron: core attention; auto/flash: PyTorch's scaled_dot_product_attention (flash or "
            "memory-efficient "
            "kernels on GPUs), local/unfused: Megatron's unfused DotProductAttention (materialises seq x seq scores)",
        ),
    )
    attention_dropout: float = field(
        default=0.0,
        metadata=described(
            own="a Megatron flag", text="Megatron: attention dropout, 0.0 only (ours: default 0.0; Megatron 0.1)"
        ),
    )
    hidden_dropout: float = field(
        default=0.0,
        metadata=described(
            own="a Megatron flag", text="Megatron: hidden-state dropout, 0.0 only (ours: default 0.0; Megatron 0.1)"
        ),
    )
    expert_model_parallel_size: int = field(
        default=1,
        metadata=described(
            own="a Megatron flag", text="Megatron: expert-parallel ranks, dividing the experts (1 for a dense model)"
        ),
    )
    expert_tensor_parallel_size: int = field(
        default=1,
        metadata=described(
            own="a Megatron flag", text="Megatron: tensor-parallel ranks of the experts (1: experts are whole)"
        ),
    )
    deterministic_mode: bool = field(
        default=False,
        metadata=described(
            own="a Megatron flag", text="Megatron: TransformerConfig.deterministic_mode (deterministic kernels only)"
        ),
    )
    optimizer_cpu_offload: bool = field(
        default=False,
        metadata=described(
            own="a Megatron flag",
            text="Megatron: the optimizer's state and step on the CPU (all of it; GPUs only, not GPU-tested)",
        ),
    )
    overlap_cpu_optimizer_d2h_h2d: bool = field(
        default=False,
        metadata=described(
            own="a Megatron flag",
            text="Megatron: overlap --optimizer-cpu-offload's copies with its step (not GPU-tested)",
        ),
    )
    # Megatron's MoE training flags (the MoE shape flags, --num-experts and the like, are the model section's, checked
    # against config.json by megatron_config.SHAPE_FLAGS); runtime.train.backends.megatron_moe builds them.
    moe_grouped_gemm: bool = field(
        default=False,
        metadata=described(
            own="a Megatron flag", text="Megatron: experts through torch._grouped_mm instead of a per-expert loop"
        ),
    )
    moe_token_dispatcher_type: str = field(
        default="alltoall",
        metadata=described(
            own="a Megatron flag", text="Megatron: MoE token dispatcher, alltoall (ours: default alltoall)"
        ),
    )
    moe_router_load_balancing_type: str = field(
        default="aux_loss",
        metadata=described(
            own="a Megatron flag", text="Megatron: the router's balancing loss (inert at --moe-aux-loss-coeff 0)"
        ),
    )
    moe_aux_loss_coeff: float = field(
        default=0.0,
        metadata=described(
            own="a Megatron flag",
            text="Megatron: balancing loss weight (aux_loss, seq_aux_loss, global_aux_loss; padding tokens left out; "
            "reported as moe_aux_loss)",
        ),
    )
    moe_router_dtype: str | None = field(
        default=None, metadata=described(own="a Megatron flag", text="Megatron: router dtype, fp32 or fp64")
    )
    moe_router_bias_update_rate: float = field(
        default=1e-3,
        metadata=described(
            own="a Megatron flag",
            text="Megatron: step of the expert bias towards balanced loads after each optimizer step (slime's "
            "GLM-4.5 and DeepSeek-V3 scripts pass 0)",
        ),
    )
    moe_token_drop_policy: str = field(
        default="probs",
        metadata=described(
            own="a Megatron flag", text="Megatron: which tokens a full expert drops (no capacity here: none)"
        ),
    )
    distributed_backend: Literal["nccl", "gloo"] = field(
        default="nccl",
        metadata=described(
            own="a flag of slime's Megatron backend",
            text="Megatron: the trainers' torch.distributed backend (on the CPU always gloo, whatever given)",
            slime=slime(
                "megatron (reset by slime)",
                "nccl",
                differs="--train-backend megatron only (the torch backend refuses it); trainers "
                "on the CPU use gloo whatever is given",
            ),
        ),
    )
    distributed_timeout_minutes: int = field(
        default=10,
        metadata=described(
            own="a flag of slime's Megatron backend",
            text="Megatron: timeout of the trainers' collectives (the process group and Megatron's groups)",
            slime=slime(
                "megatron (reset by slime)", 10, differs="--train-backend megatron only (the torch backend refuses it)"
            ),
        ),
    )
    padded_vocab_size: int | None = field(
        default=None,
        metadata=described(
            own="a flag of slime's Megatron backend",
            text="Megatron: rows of the embedding and output layer (the padding rows start at zero; exports cut them "
            "off); unset: the vocabulary rounded up to a multiple of 128 x TP",
            slime=slime(
                "megatron (reset by slime)",
                None,
                differs="--train-backend megatron only (the torch backend refuses it); exports cut "
                "the padding off; smaller than the vocabulary is refused",
            ),
        ),
    )
    model_name: str | None = field(
        default=None,
        metadata=described(
            own="a flag of slime's Megatron backend",
            text="the Megatron-to-HF weight mapping, by slime's name rules (llama; qwen2 and qwen3 share one; "
            "qwen3moe); unset: config.json's model class",
            slime=slime(
                "rollout",
                None,
                differs="--train-backend megatron only (the torch backend refuses it): "
                "picks the Megatron-to-HF mapping by slime's name rules (llama, qwen2, qwen3, qwen3moe); other "
                "families' names are refused",
            ),
        ),
    )
    custom_model_provider_path: str | None = field(
        default=None,
        metadata=hook(
            "fn(pre_process, post_process, vp_stage=None) -> GPTModel, in place of the model the Megatron backend "
            "builds (runtime.train.backends.megatron_backend.provider_context() gives its config and layer spec)",
            own="a flag of slime's Megatron backend",
            slime=slime(
                "train",
                None,
                differs="--train-backend megatron only (the torch backend refuses it); the "
                "returned GPTModel is checked tensor by tensor against --hf-checkpoint",
            ),
        ),
    )
    recompute_loss_function: bool = field(
        default=False,
        metadata=described(
            own="a flag of slime's Megatron backend",
            text="Megatron: recompute the loss in backward, keeping only the logits (same loss and gradients)",
            slime=slime("train", False, differs="--train-backend megatron only (the torch backend refuses it)"),
        ),
    )
    megatron_config_path: str | None = field(
        default=None,
        metadata=described(
            own="a flag of slime's Megatron backend",
            text="YAML of per-role Megatron overrides (slime's megatron: [{role: actor, overrides: {...}}])",
            slime=slime(
                "algo",
                None,
                differs="--train-backend megatron only (the torch backend refuses it); the "
                "actor entry's overrides take the trainers' flags (train and algo sections); a critic entry is "
                "refused (the Megatron critic trains with the actor's flags)",
            ),
        ),
    )


# Each section of the config this backend adds fields to.
OPTIONS: dict[str, type] = {"train": MegatronOptions}
# Every flag this backend alone reads -> what it is (the refusal under another backend names it).
OWN_FIELDS: dict[str, str] = own_fields(MegatronOptions)
# Top-p replay (--rollout-top-p below 1) needs the backend to take log-probs over each token's nucleus (the refusal
# quotes the note).
REPLAYS_TOP_P_NUCLEI = False
# Reads Megatron torch_dist checkpoints (a save root or a step's folder) for --ref-load and --opd-teacher-load, where
# a backend without it takes HF folders only.
READS_TORCH_DIST = True
# Sends the weights to the engines from its rank 0 alone (the other ranks' shards are gathered there): CUDA IPC, which
# hands one process's memory to the engine beside it, reaches one engine only when the backend runs one process.
WEIGHTS_FROM_RANK0 = True
TOP_P_NUCLEI_NOTE = "its loss takes log-probs over the whole vocabulary (no nucleus replay is built)"
# Megatron's own flags (the others are slime's flags of its Megatron backend).
MEGATRON_TRAIN_FIELDS = tuple(name for name, what in OWN_FIELDS.items() if what == MegatronOptions.OWN)
MEGATRON_SLIME_FIELDS = tuple(name for name, what in OWN_FIELDS.items() if what != MegatronOptions.OWN)
_MOE_TP = "experts are whole on every tensor-parallel rank (expert tensor parallelism is not built)"
_NO_DROPOUT = (
    "the Megatron backend trains with dropout off, so that its old and new log-probs are computed alike (slime's "
    "scripts pass 0.0)"
)
# The values of Megatron's flags that the Megatron backend builds (TrainConfig field -> (values, why no other)): one
# table, read by the validation and by the tests.
MEGATRON_VALUES_BUILT: dict[str, tuple[tuple[Any, ...], str]] = {
    "attention_backend": (
        ("auto", "flash", "local", "unfused"),
        "fused is Transformer Engine's cuDNN attention, which is not installed (auto and flash run PyTorch's "
        "scaled_dot_product_attention, its flash kernel on GPUs; local and unfused megatron-core's own)",
    ),
    "attention_dropout": ((0.0,), _NO_DROPOUT),
    "hidden_dropout": ((0.0,), _NO_DROPOUT),
    # --expert-model-parallel-size is checked against the model's experts (megatron_config.parallel_problems).
    "expert_tensor_parallel_size": ((1,), _MOE_TP),
    "moe_token_dispatcher_type": (
        ("alltoall",),
        "allgather refuses variable sequence lengths (rlcore's micro-batches) and flex needs DeepEP",
    ),
    "moe_router_load_balancing_type": (
        ("aux_loss", "seq_aux_loss", "global_aux_loss", "none"),
        "sinkhorn re-balances the routes themselves, unlike the checkpoint's router (the others are balancing "
        "losses, off at --moe-aux-loss-coeff 0)",
    ),
    "moe_router_dtype": (("fp32", "fp64", None), "megatron-core's router computes in fp32, fp64 or the model's dtype"),
    "moe_token_drop_policy": (
        ("probs", "position"),
        "megatron-core's two policies (inert here: no --moe-expert-capacity-factor, no token is dropped)",
    ),
}


def check(problems: list[str], cfg: Any) -> None:
    """``--train-backend megatron``'s rules: its flags consistent with each other, with the trainer processes and with
    ``--hf-checkpoint``'s model, and the job's other settings ones this backend runs."""
    from runtime.config.checks import installed, read_config_json
    from runtime.config.schema import ConfigError
    from runtime.config.yaml_io import megatron_role_overrides
    from runtime.train.backends import megatron_config
    from runtime.train.backends.megatron_moe import aux_loss_problems as moe_aux_loss_problems

    t = cfg.train
    hf = read_config_json(cfg.model.hf_checkpoint) if cfg.model.hf_checkpoint else None
    shape = None
    if hf is not None:
        try:
            shape = megatron_config.shape_from_hf(hf, source=f"--hf-checkpoint {cfg.model.hf_checkpoint}/config.json")
        except ValueError as err:
            problems.append(str(err))
    problems.extend(moe_aux_loss_problems(t))
    if t.moe_router_bias_update_rate < 0:
        problems.append(f"--moe-router-bias-update-rate must be >= 0, got {t.moe_router_bias_update_rate}")
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
    if not installed("megatron.core"):
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
        # With --num-epoch, slime derives it from the data's size at the start (runtime.job_data.resolve_num_rollout).
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
        stages = dict(
            first_stage_layers=t.decoder_first_pipeline_num_layers,
            last_stage_layers=t.decoder_last_pipeline_num_layers,
        )
        problems.extend(
            megatron_config.parallel_problems(
                dataclasses.replace(shape, **stages),
                tp_size=max(tp, 1),
                pp_size=max(pp, 1),
                ep_size=max(t.expert_model_parallel_size, 1),
                sequence_parallel=t.sequence_parallel,
            )
        )
