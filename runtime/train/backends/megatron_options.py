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
_DENSE = "expert parallelism splits MoE experts, and the Megatron backend builds dense models only"
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
    "expert_model_parallel_size": ((1,), _DENSE),
    "expert_tensor_parallel_size": ((1,), _DENSE),
}

# Every flag this backend alone reads -> what it is (the refusal under another backend names it).
OWN_FIELDS: dict[str, str] = {
    **{name: "a Megatron flag" for name in MEGATRON_TRAIN_FIELDS},
    **{name: "a flag of slime's Megatron backend" for name in MEGATRON_SLIME_FIELDS},
}
