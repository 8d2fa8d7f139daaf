"""The core of the ``train`` section of the config: the backend, batch sizes and token budgets, the optimizer's
settings, which parameters train, and slime's Megatron hooks (read by the training driver and every backend:
``runtime.train.driver``, ``runtime.train.packing``, ``runtime.train.backends``). Torch-free: ``runtime.config``
composes :class:`TrainOptions` with the backends' own options (``runtime.train.backends.*_options``) into
:class:`~runtime.config.TrainConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from runtime.option_fields import bounded, described, hook, slime
from runtime.train.backends import TRAIN_BACKENDS

# Choices that registries define: the flag takes exactly their names.
TRAIN_BACKEND_NAMES = tuple(TRAIN_BACKENDS)


@dataclass(frozen=True)
class TrainOptions:
    # slime's flag is --train-backend (megatron/fsdp there); rlcore's first backend is torch (HF model, FSDP2).
    train_backend: Literal[TRAIN_BACKEND_NAMES] = field(
        default="torch",
        metadata=described(
            "training backend",
            slime=slime("mode", "megatron", differs="default torch (by design); megatron: megatron-core, local spec"),
        ),
    )
    global_batch_size: int | None = field(
        default=None,
        metadata=bounded(
            gt=0,
            help="samples per optimizer step, over all trainers; unset: --rollout-batch-size x "
            "--n-samples-per-prompt / --num-steps-per-rollout",
            slime=slime("megatron (reset by slime)", None, note="unset: rollout x n / steps per rollout"),
        ),
    )
    num_steps_per_rollout: int | None = field(
        default=None,
        metadata=bounded(
            gt=0, help="optimizer steps per rollout (sets --global-batch-size; unset: 1)", slime=slime("data", None)
        ),
    )
    micro_batch_size: int = field(
        default=1,
        metadata=bounded(
            gt=0,
            help="samples per forward/backward (without a token budget)",
            slime=slime("megatron (reset by slime)", 1, note="built-in job: 8"),
        ),
    )
    max_tokens_per_gpu: int | None = field(
        default=None,
        metadata=bounded(
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
        metadata=described(
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
        metadata=described(
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
        metadata=bounded(
            gt=0,
            help="learning rate (AdamW)",
            slime=slime("megatron (reset by slime)", 1e-06, note="built-in job: 1e-3"),
        ),
    )
    train_env_vars: dict = field(
        default_factory=dict,
        metadata=described(
            "JSON object of environment variables for the trainer processes, e.g. PyTorch allocator ones",
            slime=slime("train", {}),
        ),
    )
    weight_decay: float = field(default=0.0, metadata=bounded(ge=0, help="AdamW weight decay"))
    clip_grad: float = field(
        default=1.0, metadata=bounded(gt=0, help="max gradient norm", slime=slime("megatron (reset by slime)", 1.0))
    )
    sft_warmup_steps: int = field(default=0, metadata=bounded(ge=0, help="SFT steps before RL (built-in task)"))
    bf16: Literal["auto", "true", "false"] = field(
        default="auto",
        metadata=described(
            "bf16 training; bare --bf16 is Megatron's switch (true); absent is auto: bf16 where the device supports it"
        ),
    )
    recompute_granularity: Literal["full", "selective"] | None = field(
        default=None,
        metadata=described(
            "activation recompute: Megatron's full layers or selective core attention; the torch backend: full "
            "(every decoder layer checkpointed)",
            megatron=True,
        ),
    )
    lr_decay_iters: int | None = field(
        default=None,
        metadata=described("Megatron: optimizer steps of the decay; unset: the job's optimizer steps", megatron=True),
    )
    only_train_params_name_list: list[str] | None = field(
        default=None,
        metadata=described(
            "regexes (re.search) of the parameters to train; all others are frozen",
            slime=slime("train", None, note="regexes (re.search) over the backend's parameter names"),
        ),
    )
    freeze_params_name_list: list[str] | None = field(
        default=None,
        metadata=described(
            "regexes (re.search) of the parameters to freeze",
            slime=slime("train", None, note="regexes (re.search) over the backend's parameter names"),
        ),
    )
    custom_megatron_init_path: str | None = field(
        default=None,
        metadata=hook(
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
        metadata=hook(
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
        metadata=hook(
            "fn(args, rollout_id, step_id, model, optimizer, opt_param_scheduler) -> None, before each optimizer step",
            slime=slime(
                "custom_megatron_plugins",
                None,
                differs="torch backend: model is the torch module, optimizer AdamW, opt_param_scheduler None",
            ),
        ),
    )
