"""Model construction for the torch backend: a transformers causal LM loaded in float32 and wrapped for training —
frozen parts or LoRA adapters, activation recompute and ``torch.compile`` of its decoder blocks, FSDP2 across ranks —
or turned into a critic with a value head."""

from __future__ import annotations

import functools

import torch

from runtime.config import TrainConfig
from runtime.train import attention
from runtime.train.backends import lora
from runtime.train.hooks import TrainHooks, freeze_parameters

# The critic's value head starts as slime's: weights drawn from N(0, 0.02^2) (Megatron's init_method_std), bias 0.
VALUE_HEAD_INIT_STD = 0.02


def checkpoint_blocks(model: torch.nn.Module, block_names: set[str]) -> int:
    """Activation checkpointing of every decoder block of ``model`` (``--recompute-granularity full``): a block keeps
    its inputs only and runs its forward again in the backward (``torch.utils.checkpoint``, non-reentrant). The
    block's ``forward`` is wrapped in place, so its module, its parameter names and FSDP2's hooks around its call stay
    as they are (the recompute runs inside the block's backward, where FSDP2 has gathered its parameters). Works
    whether the model is in train or eval mode (transformers' own checkpointing runs in train mode only, and the
    trainer keeps dropout off). Returns the number of blocks wrapped."""
    from torch.utils.checkpoint import checkpoint

    count = 0
    for module in model.modules():
        if type(module).__name__ in block_names:
            module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)
            count += 1
    if count == 0:
        raise ValueError(
            f"--recompute-granularity full: {type(model).__name__} names no decoder block class to checkpoint "
            "(transformers' _no_split_modules)"
        )
    return count


def compile_blocks(model: torch.nn.Module, block_names: set[str]) -> int:
    """``torch.compile`` every decoder block of ``model`` in place (``--torch-compile``; ``nn.Module.compile``, so
    names, hooks and a checkpointed ``forward`` stay). The blocks share one compiled graph (their parameters are
    the graph's inputs); packed micro-batches of changing length turn dynamic after the first recompile."""
    count = 0
    for module in model.modules():
        if type(module).__name__ in block_names:
            module.compile()
            count += 1
    if count == 0:
        raise ValueError(f"--torch-compile: {type(model).__name__} names no decoder block class (_no_split_modules)")
    return count


def replace_lm_head_with_value_head(model: torch.nn.Module, *, seed: int) -> None:
    """Turn a causal LM into a critic, as slime's ``LinearForLastLayer``: the LM head becomes ``Linear(hidden, 1)``
    with weights from N(0, ``VALUE_HEAD_INIT_STD``^2) drawn from ``seed`` (the same on every rank) and bias 0, so the
    model's ``logits`` [b, t, 1] are the values. The head is no longer tied to the embeddings, and a final logit
    soft-cap (Gemma 2) is turned off: values are not logits."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    old = model.get_output_embeddings()
    head = torch.nn.Linear(old.in_features, 1, bias=True)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * VALUE_HEAD_INIT_STD)
        head.bias.zero_()
    for cfg in {id(model.config): model.config, id(config): config}.values():
        cfg.tie_word_embeddings = False
        if getattr(cfg, "final_logit_softcapping", None) is not None:
            cfg.final_logit_softcapping = None
    model.set_output_embeddings(head)


def uses_bf16(setting: str, device: torch.device) -> bool:
    if setting == "true":
        return True
    if setting == "false":
        return False
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def attention_kwargs(cfg: TrainConfig, device: torch.device) -> dict[str, str]:
    """``from_pretrained``'s attention choice (``--attn-implementation``; nothing: transformers' default)."""
    choice = cfg.attn_implementation
    if choice == "auto":
        # varlen: a flash kernel over the packed sequences, with no mask to build (flex_attention builds a
        # BlockMask per micro-batch; SDPA a dense one). Elsewhere transformers' default.
        if not attention.flash_varlen_available(device):
            return {}
        choice = attention.ATTENTION
    if choice == attention.ATTENTION:
        attention.register_attention()
    return {"attn_implementation": choice}


def load_model(
    path: str,
    *,
    cfg: TrainConfig,
    hooks: TrainHooks,
    device: torch.device,
    seed: int,
    world_size: int,
    bf16: bool,
    trainable: bool,
    value_head: bool = False,
) -> torch.nn.Module:
    """The causal LM at ``path`` in float32 on ``device``, ready to train or to run frozen.

    ``trainable``: slime's ``--only-train-params-name-list`` / ``--freeze-params-name-list`` freeze parts of it, or
    ``--lora-rank`` wraps it in LoRA adapters (drawn from ``seed``, the same on every rank); otherwise frozen whole.
    ``value_head``: a critic (:func:`replace_lm_head_with_value_head`, trained whole). Decoder blocks are
    checkpointed (``--recompute-granularity full``, trained models) and compiled (``--torch-compile``); with
    ``world_size > 1`` each block and the root are sharded with FSDP2 (bf16 parameters, float32 reductions under
    ``bf16``). The model stays in eval mode (see the comment at the end)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **attention_kwargs(cfg, device))
    if value_head:
        replace_lm_head_with_value_head(model, seed=seed)
    if not trainable:
        model.requires_grad_(False)
    elif not value_head and (hooks.only_train or hooks.freeze):
        freeze_parameters(model, only_train=hooks.only_train, freeze=hooks.freeze)
    elif cfg.lora_rank > 0 and not value_head:
        # The adapters' random init must be the same on every rank (FSDP2 keeps each rank's own part of its own
        # tensor): drawn on the CPU from the job's seed, not the rank's stream.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = lora.wrap_lora(
                model,
                rank=cfg.lora_rank,
                alpha=cfg.lora_alpha,
                dropout=cfg.lora_dropout,
                target_modules=cfg.lora_target_modules,
                modules_to_save=cfg.lora_modules_to_save,
            )
    model.to(device)
    block_names = set(getattr(model, "_no_split_modules", None) or ())
    if trainable and cfg.recompute_granularity == "full":
        checkpoint_blocks(model, block_names)
    if cfg.torch_compile:
        compile_blocks(model, block_names)
    if world_size > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        kwargs = {"mp_policy": mp} if mp is not None else {}
        for module in model.modules():
            if type(module).__name__ in block_names:
                fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)
    # Training stays in eval mode: dropout on in train() but off when old log-probs are recomputed would make
    # the on-policy ratio differ from 1 (RL trainers disable dropout for the same reason).
    model.eval()
    return model


def loss_in_head(model: torch.nn.Module) -> bool:
    """Whether the loss runs inside ``model``'s LM head: a plain linear head (a LoRA-wrapped head's weight alone
    is not the layer) whose logits the model does not transform further (no final logit soft-cap)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    softcap = getattr(config, "final_logit_softcapping", None)
    return isinstance(model.get_output_embeddings(), torch.nn.Linear) and softcap is None
