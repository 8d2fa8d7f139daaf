"""The experts each token was routed to, as the rollout engines report them for routing replay (slime's
``rollout_routed_experts``, ``--use-rollout-routing-replay``).

The layout is SGLang's (``return_routed_experts``, SGLang 0.5.23's ``state_capturer/routed_experts.py``): per sample
``[len(tokens) - 1, num_hidden_layers, num_experts_per_tok]`` int32, row ``s`` the experts that routed token ``s``
in every decoder layer (a dense layer's rows 0). The last token has no row: no engine feeds it through the model.
On the wire it is ``meta_info["routed_experts"]``, the base64 of those int32s in C order.

The embedded engine records them with a forward hook on each MoE router (transformers' routers return
``(logits, weights, indices)``): :class:`RouteRecorder` copies the indices into fixed device buffers, the prompt's
rows at its prefill (once per prompt, shared by its samples) and one column per decoding step, so the copies are part
of the decode step's CUDA graph and cost no host sync; rows are read back with the tokens when a sample ends. The
hooks are installed on a model the first time routes are asked for, or before the decode step is compiled
(:func:`install_route_hooks`), and do nothing while no recorder is attached.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

# transformers' top-k routers whose forward returns (router_logits, routing_weights, selected_experts), by class name.
ROUTER_CLASSES = ("Qwen3MoeTopKRouter", "Glm4MoeTopkRouter", "DeepseekV3TopkRouter")
_LAYER = re.compile(r"layers\.(\d+)\.")
_RECORDER = "_rlcore_route_recorder"


def routes_shape(config: Any) -> tuple[int, int]:
    """``(num_hidden_layers, num_experts_per_tok)`` of a HF config (a ``PretrainedConfig`` or its ``config.json``
    dict; a multimodal one's text config); raises for a model without routed experts."""
    if not isinstance(config, dict):
        config = config.get_text_config(decoder=True).to_dict()
    config = config.get("text_config", config)
    layers, topk = config.get("num_hidden_layers"), config.get("num_experts_per_tok")
    if not layers or not topk:
        raise ValueError(
            f"routing replay needs a MoE model; this {config.get('model_type', 'model')} config has no "
            "num_experts_per_tok"
        )
    return int(layers), int(topk)


def routes_from_base64(text: str, *, rows: int, layers: int, topk: int) -> np.ndarray:
    """SGLang's ``meta_info["routed_experts"]`` as ``[rows, layers, topk]`` int32 (``rows = len(tokens) - 1``)."""
    if not isinstance(text, str):
        raise ValueError(f"meta_info routed_experts must be a base64 string, got {type(text).__name__}")
    flat = np.frombuffer(base64.b64decode(text), dtype=np.int32)
    if flat.size != rows * layers * topk:
        raise ValueError(
            f"meta_info routed_experts holds {flat.size} ids, [len(tokens) - 1 = {rows}, layers {layers}, topk "
            f"{topk}] = {rows * layers * topk} expected"
        )
    return flat.reshape(rows, layers, topk).copy()


def routes_to_base64(routes: np.ndarray | torch.Tensor) -> str:
    """The inverse of :func:`routes_from_base64` (what SGLang sends)."""
    array = routes.numpy() if isinstance(routes, torch.Tensor) else np.asarray(routes)
    return base64.b64encode(np.ascontiguousarray(array, dtype=np.int32).tobytes()).decode("ascii")


def moe_routers(model: torch.nn.Module) -> Iterator[tuple[int, torch.nn.Module]]:
    """``(decoder layer index, router)`` of each MoE layer of a transformers model, in layer order."""
    for name, module in model.named_modules():
        if type(module).__name__ in ROUTER_CLASSES:
            found = _LAYER.search(name)
            if found is None:
                raise ValueError(f"router {name} is not inside a numbered decoder layer (layers.N.)")
            yield int(found.group(1)), module


def install_route_hooks(model: torch.nn.Module) -> bool:
    """Put the recording hook on each MoE router of ``model``, once (it does nothing while no
    :class:`RouteRecorder` is attached). Returns whether ``model`` has routers.

    A model is compiled (``torch.compile``) with the hooks it has then: dynamo does not guard on module hooks
    (``torch._dynamo.config.skip_nnmodule_hook_guards``), so hooks added later never run in the compiled step and
    its routes would stay zeros. The embedded engine installs them before it compiles (``decode._compiled``)."""
    routers = list(moe_routers(model))
    if routers and not getattr(model, "_rlcore_route_hooks", False):
        for layer, router in routers:
            router.register_forward_hook(lambda module, args, out, layer=layer: _record(model, layer, out[2]))
        model._rlcore_route_hooks = True
    return bool(routers)


class RouteRecorder:
    """Fixed device buffers of the routes of one decode call: the prompt of each group row (``[group_rows, width,
    layers, topk]``) and each slot's response columns (``[slots, columns, layers, topk]``), int32."""

    def __init__(self, model: torch.nn.Module, *, group_rows: int, slots: int, width: int, columns: int):
        if not install_route_hooks(model):
            raise ValueError(
                f"routing replay needs a MoE model; {type(model).__name__} has no router of {ROUTER_CLASSES}"
            )
        self.layers, self.topk = routes_shape(model.config)
        device = next(model.parameters()).device
        self.width = width
        self.prompt = torch.zeros(group_rows, width, self.layers, self.topk, dtype=torch.int32, device=device)
        self.response = torch.zeros(slots, columns, self.layers, self.topk, dtype=torch.int32, device=device)
        self._slots = torch.arange(slots, device=device)
        self._prefill: torch.Tensor | None = None
        self._prefill_rows: torch.Tensor | None = None
        self._column: torch.Tensor | None = None
        setattr(model, _RECORDER, self)

    @staticmethod
    def detach(model: torch.nn.Module) -> None:
        """No recorder on ``model``: its hooks (if any) do nothing."""
        if hasattr(model, _RECORDER):
            setattr(model, _RECORDER, None)

    def prefill(self, group_rows: torch.Tensor) -> None:
        """Before a prefill of ``len(group_rows)`` left-padded prompts ``[n, width]``: their routes go to those rows
        (at :meth:`prefilled`)."""
        self._prefill = torch.zeros(
            len(group_rows) * self.width, self.layers, self.topk, dtype=torch.int32, device=self.prompt.device
        )
        self._prefill_rows = group_rows

    def prefilled(self) -> None:
        """After the prefill :meth:`prefill` announced."""
        rows = self._prefill_rows
        self.prompt[rows] = self._prefill.view(len(rows), self.width, self.layers, self.topk)
        self._prefill = self._prefill_rows = None

    def step(self, columns: torch.Tensor) -> None:
        """Before a decoding step's forward: slot ``i``'s token goes to response column ``columns[i]`` (a device
        tensor of the step, read when the routers run: inside a CUDA graph too)."""
        self._column = columns

    def take(self, slot: int, group_row: int, *, prompt_length: int, drawn: int) -> np.ndarray:
        """The routes of slot ``slot``'s sample: its prompt's (``prompt_length`` tokens) then its first ``drawn - 1``
        response tokens', ``[prompt_length + drawn - 1, layers, topk]`` (the last token has none)."""
        prompt = self.prompt[group_row, self.width - prompt_length :]
        rows = torch.cat([prompt, self.response[slot, : max(drawn - 1, 0)]])
        return rows[: prompt_length + drawn - 1].cpu().numpy()

    def _write(self, layer: int, indices: torch.Tensor) -> None:
        if self._prefill is not None:
            self._prefill[:, layer] = indices
        elif self._column is not None:
            self.response[self._slots, self._column, layer] = indices.to(torch.int32)


def _record(model: torch.nn.Module, layer: int, indices: torch.Tensor) -> None:
    recorder = getattr(model, _RECORDER, None)
    if recorder is not None:
        recorder._write(layer, indices.reshape(-1, recorder.topk))
