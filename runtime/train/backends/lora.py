"""LoRA for the torch backend, through ``peft``: wrap a transformers model, and read it back as merged HF weights.

The trained module is a ``peft`` model whose LoRA layers hold a frozen ``base_layer`` and the adapters ``lora_A`` /
``lora_B``; only the adapters require gradients, so only they reach the optimizer. Engines and HF exports receive the
merged weights ``W + scaling * B @ A`` under the base model's own names, so nothing downstream knows about LoRA. The
reference model is the same module with its adapters disabled (``peft``'s ``disable_adapter``): no second copy.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from runtime.train.backends.lora_options import parse_modules_to_save, parse_target_modules

ADAPTER = "default"
# Where peft puts the wrapped model's own parameter names, and what it inserts inside a LoRA layer.
_PEFT_PREFIX = "base_model.model."
_BASE_LAYER = ".base_layer"
# A module of --lora-modules-to-save: peft keeps the frozen original and a trained copy per adapter.
_ORIGINAL = ".original_module."
_SAVED = f".modules_to_save.{ADAPTER}."


def wrap_lora(
    model: torch.nn.Module,
    *,
    rank: int,
    alpha: float,
    dropout: float,
    target_modules: str,
    modules_to_save: str = "",
) -> torch.nn.Module:
    """``model`` with LoRA adapters of ``rank`` on ``target_modules``, scaling ``alpha / rank``; base frozen but for
    a trained copy of each of ``modules_to_save`` (peft's ``modules_to_save``; a tied embedding stays tied).

    The adapters start as peft initialises them (``B = 0``) and the copies equal their originals, so the wrapped model
    computes exactly the base model.
    """
    from peft import LoraConfig, get_peft_model

    saved = parse_modules_to_save(modules_to_save)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=parse_target_modules(target_modules),
        modules_to_save=saved,
        ensure_weight_tying=saved is not None,
        bias="none",
    )
    try:
        wrapped = get_peft_model(model, config, adapter_name=ADAPTER)
    except ValueError as err:  # peft names the target modules it could not find
        raise ValueError(f"--lora-target-modules {target_modules!r}: {err}") from None
    found = {name for name, _ in wrapped.named_parameters() if _SAVED in name}
    missing = [m for m in saved or () if not any(n.split(_SAVED)[0].endswith(m) for n in found)]
    if missing:
        raise ValueError(f"--lora-modules-to-save {modules_to_save!r}: no module of the model is named {missing}")
    return wrapped


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """``(module name, peft LoRA layer)`` of every adapted layer, in module order."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            yield name, module


def hf_name(peft_name: str) -> str:
    """The base model's name of a peft parameter: ``base_model.model.x.q_proj.base_layer.weight`` ->
    ``x.q_proj.weight``, and ``x.norm.modules_to_save.default.weight`` (a trained copy) -> ``x.norm.weight``."""
    name = peft_name.removeprefix(_PEFT_PREFIX)
    return name.replace(_BASE_LAYER + ".", ".").replace(_SAVED, ".")


def _is_trained(peft_name: str) -> bool:
    """Whether a peft state-dict entry is trained: an adapter, or the copy of a module to save."""
    return ".lora_" in peft_name or _SAVED in peft_name


def _full(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (a collective every rank runs in the same order), else the tensor."""
    value = value.detach()
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, whole tensor)`` of every base weight with its adapter merged in, tied weights once.

    Works on a plain model too (then it is the state dict, tied weights once). Under FSDP2 every rank must iterate
    it in step (each shard is gathered once, with the adapters of its layer); the merge runs in float32.
    """
    adapters = {
        hf_name(f"{name}{_BASE_LAYER}.weight"): (
            layer.lora_A[ADAPTER].weight,
            layer.lora_B[ADAPTER].weight,
            float(layer.scaling[ADAPTER]),
        )
        for name, layer in lora_layers(model)
    }
    lora = is_lora(model)
    seen: set[int] = set()
    for name, value in model.state_dict(keep_vars=True).items():
        # Adapters go out merged into their base weight, a module to save as its trained copy; a tied weight is one
        # tensor under two names.
        if (lora and (".lora_" in name or _ORIGINAL in name)) or id(value) in seen:
            continue
        seen.add(id(value))
        name = hf_name(name) if lora else name
        full = _full(value)
        if name in adapters:
            a, b, scaling = adapters[name]
            delta = _full(b).float() @ _full(a).float()
            full = (full.float() + scaling * delta).to(full.dtype)
        yield name, full


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' (and the saved modules') whole tensors under peft's names (what ``PeftModel.save_pretrained``
    writes), on the CPU."""
    return {name: _full(value).cpu() for name, value in model.state_dict(keep_vars=True).items() if _is_trained(name)}


def base_only(model: torch.nn.Module) -> AbstractContextManager:
    """A context in which ``model`` computes its base model (adapters disabled): the reference of a LoRA run."""
    return model.disable_adapter()


def set_dropout(model: torch.nn.Module, *, active: bool) -> None:
    """Turn the adapters' dropout on (the training forward) or off; the rest of the model stays in eval mode."""
    for _, layer in lora_layers(model):
        layer.lora_dropout[ADAPTER].train(active)
