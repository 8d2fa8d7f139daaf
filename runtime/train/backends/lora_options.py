"""The LoRA flags' parsing: torch-free, so the config checks ``--lora-target-modules`` as the backend will read it
without importing torch (:mod:`runtime.train.backends.lora` applies them)."""

from __future__ import annotations


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
