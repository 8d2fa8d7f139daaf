"""Model construction for the torch backend: a transformers causal LM loaded in float32 and wrapped for training —
frozen parts or LoRA adapters, activation recompute and ``torch.compile`` of its decoder blocks, FSDP2 across ranks —
or turned into a critic with a value head."""

from __future__ import annotations

import functools

import torch

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
