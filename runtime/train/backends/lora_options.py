"""The LoRA options of the torch backend (peft; slime has none, the names follow verl's ``lora_rank`` /
``lora_alpha`` and peft's ``LoraConfig``), their parsing and their rules. Torch-free, so the config checks
``--lora-target-modules`` as the backend will read it without importing torch (:mod:`runtime.train.backends.lora`
applies them)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Literal

from runtime.option_fields import bounded, described


@dataclass(frozen=True)
class LoraOptions:
    """LoRA adapters (peft, on the transformers model): the torch backend's (:class:`TorchOptions` inherits them)."""

    OWN = "a LoRA setting"

    lora_rank: int = field(
        default=0,
        metadata=bounded(
            own="LoRA adapters (peft, on the transformers model)",
            ge=0,
            help="LoRA rank through peft; 0 trains every weight",
        ),
    )
    lora_alpha: float = field(default=16.0, metadata=described("LoRA alpha: the adapters are scaled by alpha / rank"))
    lora_dropout: float = field(default=0.0, metadata=described("dropout on the adapters' input while training"))
    lora_target_modules: str = field(
        default="all-linear",
        metadata=described(
            "modules given adapters: all-linear (every linear but the LM head) or names, q_proj,v_proj"
        ),
    )
    lora_modules_to_save: str = field(
        default="",
        metadata=described(
            "modules trained in full beside the adapters (peft's modules_to_save; a name matches every module ending "
            "with it: norm = every RMSNorm), comma-separated"
        ),
    )
    lora_export: Literal["merged", "adapter"] = field(
        default="merged",
        metadata=described("HF exports of a LoRA run: adapters merged into the weights, or a peft adapter folder"),
    )


def parse_target_modules(value: str) -> str | list[str]:
    """``--lora-target-modules``: ``all-linear`` (every linear layer but the output head) or comma-separated module
    names (``q_proj,v_proj``) as ``peft.LoraConfig.target_modules`` takes them."""
    value = value.strip()
    if value == "all-linear":
        return value
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names:
        raise ValueError("--lora-target-modules: give all-linear or comma-separated module names (q_proj,v_proj)")
    return names


def parse_modules_to_save(value: str) -> list[str] | None:
    """``--lora-modules-to-save``: comma-separated module names trained in full beside the adapters, as
    ``peft.LoraConfig.modules_to_save`` takes them (a name matches every module whose name ends with it: ``norm``
    is every RMSNorm of a Llama or Qwen model); empty: none."""
    names = [name.strip() for name in value.split(",") if name.strip()]
    return names or None


def check(problems: list[str], cfg: Any) -> None:
    """LoRA's rules, when ``--lora-rank`` is set."""
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
        parse_target_modules(t.lora_target_modules)  # the same parse the backend applies
    except ValueError as err:
        problems.append(str(err))
    if importlib.util.find_spec("peft") is None:
        problems.append("--lora-rank needs the peft package (pip install peft)")
