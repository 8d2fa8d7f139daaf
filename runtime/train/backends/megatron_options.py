"""The Megatron backend's own options: the flags that only ``--train-backend megatron`` reads, and the values of
Megatron's flags that it builds. Declared here, beside the backend; the config refuses these flags under another
backend (``runtime.config``'s backend-fields check reads ``OWN_FIELDS``) and the backend's values check reads
``MEGATRON_VALUES_BUILT``."""

from __future__ import annotations

from typing import Any

# TrainConfig fields that only --train-backend megatron reads (lr_decay_iters is resolved for every job).
MEGATRON_TRAIN_FIELDS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "sequence_parallel",
    "recompute_method",
    "recompute_num_layers",
    "optimizer",
    "adam_beta1",
    "adam_beta2",
    "adam_eps",
    "lr_decay_style",
    "lr_warmup_iters",
    "lr_warmup_fraction",
    "min_lr",
    "accumulate_allreduce_grads_in_fp32",
    "use_distributed_optimizer",
    "overlap_grad_reduce",
    "ddp_bucket_size",
    "bias_swiglu_fusion",
    "attention_backend",
    "attention_dropout",
    "hidden_dropout",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "deterministic_mode",
    "optimizer_cpu_offload",
    "overlap_cpu_optimizer_d2h_h2d",
)
# Megatron's MoE training flags (TrainConfig fields; the MoE shape flags are ModelConfig's, checked against
# config.json by megatron_config.SHAPE_FLAGS): runtime.train.backends.megatron_moe builds them.
MEGATRON_MOE_FIELDS = (
    "moe_grouped_gemm",
    "moe_token_dispatcher_type",
    "moe_router_load_balancing_type",
    "moe_aux_loss_coeff",
    "moe_router_dtype",
    "moe_token_drop_policy",
)
# slime's flags of its Megatron backend that rlcore builds for --train-backend megatron only.
MEGATRON_SLIME_FIELDS = (
    "distributed_backend",
    "distributed_timeout_minutes",
    "padded_vocab_size",
    "model_name",
    "custom_model_provider_path",
    "recompute_loss_function",
    "megatron_config_path",
)
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
    "moe_aux_loss_coeff": (
        (0.0,),
        "the balancing loss is not scaled over rlcore's micro-batches and data-parallel ranks yet (slime's RL "
        "scripts pass 0: RL does not train the balance)",
    ),
    "moe_router_dtype": (("fp32", "fp64", None), "megatron-core's router computes in fp32, fp64 or the model's dtype"),
    "moe_token_drop_policy": (
        ("probs", "position"),
        "megatron-core's two policies (inert here: no --moe-expert-capacity-factor, no token is dropped)",
    ),
}

# Every flag this backend alone reads -> what it is (the refusal under another backend names it).
OWN_FIELDS: dict[str, str] = {
    **{name: "a Megatron flag" for name in MEGATRON_TRAIN_FIELDS},
    **{name: "a Megatron flag" for name in MEGATRON_MOE_FIELDS},
    **{name: "a flag of slime's Megatron backend" for name in MEGATRON_SLIME_FIELDS},
}
