"""The weight layout on the wire: a HF checkpoint's own tensor names, mapped onto a transformers model's tensors.

transformers 5 keeps the experts of an MoE layer fused in the model (``mlp.experts.gate_up_proj [E, 2I, H]``, rows
``[gate; up]`` of each expert, and ``mlp.experts.down_proj [E, H, I]``), while checkpoints, ``save_pretrained`` and
SGLang's loader use one tensor per expert and projection (``mlp.experts.{e}.gate_proj.weight [I, H]``, ...). rlcore
moves weights in the checkpoint's layout (trainer -> engines, HF exports), and converts at the edges with
:class:`CheckpointLayout`: every checkpoint name is a *slot*, an index into one of the model's tensors (the whole
tensor for a name the model has itself, an expert's rows of a fused tensor otherwise). A dense model's slots are its
``state_dict`` names.

The fused tensors and their checkpoint names are read from transformers' own conversion table
(``transformers.conversion_mapping.get_model_conversion_mapping``, what ``from_pretrained`` and ``save_pretrained``
use), so every family transformers fuses is covered as transformers does it (in 5.17 ``qwen2_moe``, ``qwen3_moe``,
``glm4_moe``, ``glm4_moe_lite``, ``deepseek_v3``, ``olmoe`` and more share one rule). A rule built of other operations
than stacking experts and concatenating projections is refused by name.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Slot:
    """Checkpoint tensor = ``model_tensor[index]`` (``index`` None: the whole tensor)."""

    model_name: str
    index: tuple[Any, ...] | None
    shape: tuple[int, ...]


def _fused_rules(model: torch.nn.Module) -> list[tuple[str, tuple[str, ...], int | None]]:
    """``(target pattern, source patterns, concatenation dim or None)`` of each expert-fusing rule transformers applies
    to ``model``'s checkpoints."""
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    if not isinstance(model, PreTrainedModel):  # a plain module: its state_dict names are its checkpoint's
        return []
    rules = []
    for conversion in get_model_conversion_mapping(model, add_legacy=False):
        if not isinstance(conversion, WeightConverter):
            continue
        ops = list(conversion.operations)
        kinds = [type(op) for op in ops]
        sources = tuple(conversion.source_patterns)
        targets = list(conversion.target_patterns)
        if kinds not in ([MergeModulelist], [MergeModulelist, Concatenate]) or ops[0].dim != 0 or len(targets) != 1:
            raise ValueError(
                f"{model.config.model_type}: transformers converts {sources} -> {targets} by "
                f"{[k.__name__ for k in kinds]}, which rlcore's checkpoint layout does not map"
            )
        if not all(s.count("*") == 1 for s in sources):
            raise ValueError(f"{model.config.model_type}: expert patterns {sources} need one '*' (the expert index)")
        concat = ops[1].dim if len(ops) == 2 else None
        if concat is None and len(sources) != 1:
            raise ValueError(f"{model.config.model_type}: {len(sources)} sources {sources} stacked without a concat")
        rules.append((targets[0], sources, concat))
    return rules


class CheckpointLayout:
    """The checkpoint's names of a model's tensors (:class:`Slot` each), from the model's ``state_dict`` shapes.

    ``model`` may live on the ``meta`` device, and may be a peft model (its base model's rules apply): only its names,
    shapes and transformers config are read.
    """

    def __init__(self, model: torch.nn.Module, shapes: Mapping[str, tuple[int, ...]] | None = None):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.rules = _fused_rules(base)
        if shapes is None:
            shapes = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
        self.slots: dict[str, Slot] = dict(
            item for name, shape in shapes.items() for item in self._slots_of(name, tuple(shape))
        )

    def _slots_of(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, Slot]]:
        """The checkpoint names and slots of model tensor ``name`` of ``shape``, experts outermost."""
        rule = next(((t, s, c) for t, s, c in self.rules if name == t or name.endswith("." + t)), None)
        if rule is None:
            return [(name, Slot(name, None, shape))]
        target, sources, concat = rule
        prefix = name[: len(name) - len(target)]
        if concat is not None and shape[concat] % len(sources):
            raise ValueError(f"{name} {list(shape)}: dim {concat} does not split into {len(sources)} projections")
        width = shape[concat] // len(sources) if concat is not None else 0
        out = []
        for e in range(shape[0]):
            for j, source in enumerate(sources):
                index: list[Any] = [e]
                piece = list(shape[1:])
                if concat is not None:
                    index += [slice(None)] * (concat - 1) + [slice(j * width, (j + 1) * width)]
                    piece[concat - 1] = width
                out.append((prefix + source.replace("*", str(e)), Slot(name, tuple(index), tuple(piece))))
        return out

    @property
    def fused(self) -> bool:
        """Whether any checkpoint name is a part of a model tensor (an MoE model's experts)."""
        return any(slot.index is not None for slot in self.slots.values())

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: slot.shape for name, slot in self.slots.items()}

    def target(self, tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
        """The part of ``tensors`` (the model's, by model name) that checkpoint tensor ``name`` is: a view to copy
        into or read from (through ``.data``: no autograd history)."""
        slot = self.slots[name]
        tensor = tensors[slot.model_name]
        tensor = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
        return tensor if slot.index is None else tensor[slot.index]

    def to_checkpoint(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint tensors of model tensor ``name`` (one per expert and projection of a fused tensor, each a
        contiguous copy so that it travels alone; ``tensor`` itself otherwise)."""
        for checkpoint_name, slot in self._slots_of(name, tuple(tensor.shape)):
            yield checkpoint_name, tensor if slot.index is None else tensor[slot.index].clone()

    def state_dict(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` (model names) in the checkpoint's names."""
        return {k: v for name, tensor in tensors.items() for k, v in self.to_checkpoint(name, tensor)}


def load_checkpoint_state_dict(
    model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]
) -> tuple[list[str], list[str]]:
    """Copy ``state_dict`` (checkpoint names) into ``model``; return ``(missing, unexpected)`` checkpoint names, tied
    weights (lm_head = embeddings) not counted as missing."""
    tensors = model.state_dict(keep_vars=True)
    layout = CheckpointLayout(model)
    unexpected = [name for name in state_dict if name not in layout.slots]
    with torch.no_grad():
        for name, value in state_dict.items():
            if name in layout.slots:
                layout.target(tensors, name).copy_(value)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    loaded = {layout.slots[name].model_name for name in state_dict if name in layout.slots}
    # A tied weight is one tensor under several names: loading it under any of them loads them all.
    by_tensor: dict[int, set[str]] = {}
    for name, tensor in tensors.items():
        by_tensor.setdefault(id(tensor), set()).add(name)
    loaded |= {other for name in list(loaded) for other in by_tensor[id(tensors[name])]}
    missing = [
        name
        for name, slot in layout.slots.items()
        if name not in state_dict and not (slot.index is None and (name in tied or name in loaded))
    ]
    return missing, unexpected
