"""The torch backend's checkpoints: the trained parameters and optimizer state of the actor (and critic) sharded with
``torch.distributed.checkpoint``, and the HF folder of the trained model."""

from __future__ import annotations

from typing import Any


def _trained_only_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Frozen parameters (a LoRA run's base model) are not checkpointed: they are the --hf-checkpoint's. strict=False
    # lets set_state_dict leave them as they are.
    return StateDictOptions(ignore_frozen_params=True, strict=False)


TRAINED_ONLY = _trained_only_options()
