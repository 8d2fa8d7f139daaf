"""MoE routing replay in the torch backend (``--use-rollout-routing-replay``, ``--use-routing-replay``).

Each MoE block's router is made to pick given experts: its forward still computes the router logits from the current
weights, then takes the replayed experts in place of its own top-k and recomputes the gate weights at them exactly as
the family's router does (softmax over all experts or sigmoid, the top-k renormalisation, the scaling factor), so
gradients reach the router as in an ordinary forward. Only the expert set is replayed (R3, arXiv 2510.11370; R2, the
GSPO paper). One entry of :data:`REPLAYED_ROUTERS` per transformers router class is the whole patch point of a family.

Routes come in the batch's layout (``runtime.train.batch.ROUTED_EXPERTS``, ``[b, L, num_layers, topk]`` aligned with
``TOKENS``) and are laid out like the model's inputs (:func:`routes_for_inputs`: right-padded rows, or sequences
packed into one row). They stay set on the routers until the next micro-batch sets others, so activation recompute
in the backward replays the same experts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.engines.routes import moe_routers, routes_shape
from runtime.train.batch import dummy_routes


def _logits_in_model_dtype(router: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden.reshape(-1, router.hidden_dim), router.weight)


def _logits_in_float32(router: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden.reshape(-1, router.hidden_dim).float(), router.weight.float())


def _softmax_weights(router: torch.nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE: softmax over every expert in float32, renormalised over the top-k with ``norm_topk_prob``."""
    weights = F.softmax(logits, dtype=torch.float, dim=-1).gather(1, experts)
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def _sigmoid_weights(router: torch.nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """GLM-4.5, DeepSeek-V3: the sigmoid scores (without the expert bias, which only chooses), renormalised, scaled."""
    weights = logits.sigmoid().gather(1, experts)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


@dataclass(frozen=True)
class RouterFamily:
    """How one transformers router computes its logits from the hidden states, and its gate weights at given
    experts (``[N, topk]`` int64)."""

    logits: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
    weights: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


REPLAYED_ROUTERS: dict[str, RouterFamily] = {
    "Qwen3MoeTopKRouter": RouterFamily(_logits_in_model_dtype, _softmax_weights),
    "Glm4MoeTopkRouter": RouterFamily(_logits_in_float32, _sigmoid_weights),
    "DeepseekV3TopkRouter": RouterFamily(_logits_in_float32, _sigmoid_weights),
}


def routes_for_inputs(routes: torch.Tensor, lengths: torch.Tensor, *, packed: bool) -> torch.Tensor:
    """``[N, layers, topk]``: the batch-layout ``routes`` ``[b, L, layers, topk]`` of sequences of ``lengths`` tokens
    in the order the model's flattened inputs hold their tokens (``runtime.train.packing``): the ``b`` rows cut to the
    longest sequence, or the sequences one after the other (packed)."""
    if packed:
        total = int(lengths.sum())
        row = torch.repeat_interleave(torch.arange(len(lengths)), lengths, output_size=total)
        position = torch.arange(total) - (torch.cumsum(lengths, 0) - lengths)[row]
        return routes[row, position]
    return routes[:, : int(lengths.max())].reshape(-1, *routes.shape[2:])


def routes_from_inputs(flat: torch.Tensor, lengths: torch.Tensor, *, packed: bool, width: int) -> torch.Tensor:
    """The inverse of :func:`routes_for_inputs`: ``[b, width, layers, topk]``. Every input token keeps its row, the
    padding of padded rows included (so that replaying them reruns the recorded forward exactly: which experts the
    padding takes changes the experts' matmul shapes, hence their rounding); rows past the inputs are dummies."""
    b, (layers, topk) = len(lengths), flat.shape[1:]
    out = dummy_routes(b * width, layers, topk).view(b, width, layers, topk)
    if packed:
        total = int(lengths.sum())
        row = torch.repeat_interleave(torch.arange(len(lengths)), lengths, output_size=total)
        position = torch.arange(total) - (torch.cumsum(lengths, 0) - lengths)[row]
        out[row, position] = flat.to(torch.int32)
        return out
    longest = int(lengths.max())
    out[:, :longest] = flat.view(b, longest, layers, topk).to(torch.int32)
    return out


class RouteReplay:
    """The routers of one model, patched once: each forward replays the routes given by :meth:`replay`, records its
    own under :meth:`record`, or routes as usual (:meth:`off`, the start)."""

    def __init__(self, model: torch.nn.Module):
        self.routers = list(moe_routers(model))
        unknown = sorted({type(r).__name__ for _, r in self.routers} - set(REPLAYED_ROUTERS))
        if not self.routers or unknown:
            raise ValueError(
                f"routing replay replays the routers of {sorted(REPLAYED_ROUTERS)}; {type(model).__name__} has "
                f"{unknown or 'none'}"
            )
        self.layers, self.topk = routes_shape(model.config)
        self.num_experts = min(int(r.num_experts) for _, r in self.routers)
        self.mode: str | None = None
        self.paused = False
        self.routes: torch.Tensor | None = None
        self.recorded: dict[int, torch.Tensor] = {}
        for layer, router in self.routers:
            family = REPLAYED_ROUTERS[type(router).__name__]
            router.forward = self._forward_of(layer, router, family)

    def _forward_of(self, layer: int, router: torch.nn.Module, family: RouterFamily):
        own = type(router).forward

        def forward(hidden_states: torch.Tensor):
            if self.mode == "replay":
                experts = self.routes[:, layer].contiguous()
                logits = family.logits(router, hidden_states)
                if experts.shape[0] != logits.shape[0]:
                    raise ValueError(
                        f"routing replay: {experts.shape[0]} routed tokens for layer {layer}'s {logits.shape[0]}"
                    )
                return logits, family.weights(router, logits, experts), experts
            out = own(router, hidden_states)
            if self.mode == "record":
                self.recorded[layer] = out[2].detach()
            return out

        return forward

    def replay(self, routes: torch.Tensor, *, device: torch.device) -> None:
        """Every router replays ``routes`` ``[N, num_layers, topk]`` (its own layer's), ``N`` the tokens of the next
        forwards' flattened inputs; moved to ``device``, range-checked first where they are on the host."""
        shape = (self.layers, self.topk)
        if routes.dim() != 3 or tuple(routes.shape[1:]) != shape:
            raise ValueError(
                f"routed_experts must be [tokens, num_layers, topk] = [N, *{shape}], got {list(routes.shape)}"
            )
        on_host = routes.device.type == "cpu"
        if on_host and routes.numel() and not (int(routes.min()) >= 0 and int(routes.max()) < self.num_experts):
            raise ValueError(f"routed_experts: expert ids must be in [0, {self.num_experts})")
        self.mode, self.routes = "replay", routes.to(device, torch.long, non_blocking=on_host)

    def record(self) -> None:
        """The next forwards route as usual and keep each layer's experts (:meth:`recorded_routes`)."""
        self.mode, self.routes, self.recorded = "record", None, {}

    def recorded_routes(self) -> torch.Tensor:
        """``[N, num_layers, topk]`` int32 of the last recorded forward (a dense layer's rows 0, as SGLang's)."""
        any_layer = next(iter(self.recorded.values()))
        out = torch.zeros(any_layer.shape[0], self.layers, self.topk, dtype=torch.int32, device=any_layer.device)
        for layer, experts in self.recorded.items():
            out[:, layer] = experts.to(torch.int32)
        return out

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Forwards inside route as usual (another role computed with the actor's model: the LoRA base)."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False

    def off(self) -> None:
        self.mode, self.routes, self.recorded = None, None, {}
