"""The torch backend's checkpoints: the trained parameters and optimizer state of the actor (and critic) sharded with
``torch.distributed.checkpoint``, and the HF folder of the trained model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from runtime.engines.checkpoint_layout import load_checkpoint_state_dict


def _trained_only_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Frozen parameters (a LoRA run's base model) are not checkpointed: they are the --hf-checkpoint's. strict=False
    # lets set_state_dict leave them as they are.
    return StateDictOptions(ignore_frozen_params=True, strict=False)


TRAINED_ONLY = _trained_only_options()


def trained_entries(model: torch.nn.Module, model_sd: dict[str, Any], *, lora_only: bool) -> dict[str, Any]:
    """Under LoRA (``lora_only``), the adapters' entries of ``model_sd`` only (a frozen weight tied to another, the LM
    head, would still be listed); otherwise the whole state dict."""
    if not lora_only:
        return model_sd
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    return {name: value for name, value in model_sd.items() if name in trained}


def save_state(
    path: str,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    critic: torch.nn.Module | None = None,
    critic_optimizer: torch.optim.Optimizer | None = None,
    with_optimizer: bool = True,
    lora_only: bool = False,
) -> None:
    """``model``'s trained parameters and (unless ``with_optimizer`` is False) ``optimizer``'s state, and the
    critic's, sharded with torch.distributed.checkpoint into the folder ``path`` (a collective). Frozen parameters
    are left out: under LoRA (``lora_only``) the checkpoint holds the adapters only."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=TRAINED_ONLY)
    model_sd = trained_entries(model, model_sd, lora_only=lora_only)
    state = {"model": model_sd, "optim": optim_sd} if with_optimizer else {"model": model_sd}
    if critic is not None:
        critic_sd, critic_optim_sd = get_state_dict(critic, critic_optimizer)
        state["critic"] = critic_sd
        if with_optimizer:
            state["critic_optim"] = critic_optim_sd
    dcp.save(state, checkpoint_id=path)


def load_state(
    path: str,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    critic: torch.nn.Module | None = None,
    critic_optimizer: torch.optim.Optimizer | None = None,
    lora_only: bool = False,
) -> None:
    """Restore what :func:`save_state` wrote to ``path`` into ``model`` and ``optimizer`` (and the critic). A
    checkpoint saved without its optimizer state (``--no-save-optim``) leaves the optimizers as they are."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=TRAINED_ONLY)
    model_sd = trained_entries(model, model_sd, lora_only=lora_only)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    if any(key.startswith("optim") for key in saved):
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=TRAINED_ONLY,
        )
    else:  # saved with --no-save-optim: the optimizer starts afresh (or keeps what it has)
        state = {"model": model_sd}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"], options=TRAINED_ONLY)
    if critic is not None:
        _load_critic(path, saved, critic=critic, optimizer=critic_optimizer)


def _load_critic(path: str, saved: Mapping[str, Any], *, critic: torch.nn.Module, optimizer: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict

    if not any(key.startswith("critic.") for key in saved):
        raise RuntimeError(f"{path} holds no critic (saved by a job without --advantage-estimator ppo)")
    critic_sd, optim_sd = get_state_dict(critic, optimizer)
    if any(key.startswith("critic_optim") for key in saved):
        state = {"critic": critic_sd, "critic_optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            critic,
            optimizer,
            model_state_dict=state["critic"],
            optim_state_dict=state["critic_optim"],
        )
    else:
        state = {"critic": critic_sd}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(critic, state["critic"])


def write_hf_folder(path: str, weights: dict[str, torch.Tensor], *, model_path: str) -> None:
    """A HF folder (config, safetensors weights, tokenizer) at ``path`` that ``from_pretrained`` loads: ``weights``
    (the checkpoint's names and layout) in ``model_path``'s architecture, with its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # A key mismatch would silently leave random weights in the saved model. The weights come in the checkpoint's
    # layout; save_pretrained writes that layout again.
    missing, unexpected = load_checkpoint_state_dict(model, weights)
    if missing or unexpected:
        raise RuntimeError(
            f"save_hf: the trained weights do not match {model_path}'s architecture: missing "
            f"{missing[:5]}{' ...' if len(missing) > 5 else ''} ({len(missing)}), unexpected "
            f"{unexpected[:5]} ({len(unexpected)})"
        )
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(path)
