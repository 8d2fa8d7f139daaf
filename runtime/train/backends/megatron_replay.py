"""Routing replay under ``--train-backend megatron``: the actor's MoE routers pick the experts a batch names instead
of their own top k, through megatron-core's own ``RouterReplay`` (``TransformerConfig.moe_enable_routing_replay``; no
patch of megatron-core). Only the expert set is replayed: each router still computes its scores from the current
weights and gathers them at the given experts (softmax or sigmoid, renormalised and scaled as the family's router
does), so the gate weights follow the current router and its gradient flows.

slime's two flags (actor only; the modes of :func:`runtime.train.hooks.routing_replay`, :data:`PASS_ACTIONS`):

- ``--use-rollout-routing-replay`` (R3, mode ``"rollout"``): every actor forward (the old log-probs' and the
  update's) replays the routes the rollout engine chose while sampling, the batch's ``routed_experts``
  (``[B, L, num_layers, topk]``, :data:`runtime.train.batch.ROUTED_EXPERTS`: row ``s`` holds the experts that routed
  token ``s`` in each decoder layer, as SGLang reports them; dense layers' rows unused; the last token's row and the
  padding rows hold the distinct dummy experts ``0 .. topk - 1``).
- ``--use-routing-replay`` (R2, mode ``"trainer"``): the old-log-prob pass records the actor's own routes, which
  :meth:`MegatronTrainer.compute_log_probs` hands back as ``routed_experts`` (the shard's rows, whatever the
  micro-batches), and the update replays them. With both flags R3 wins, as in slime.

Layout (:func:`token_routes`): megatron-core's routers see a micro-batch's tokens sequence-major (``[s, b]``
flattened, token ``s * b + i``), under ``--sequence-parallel`` only this tensor-parallel rank's chunk of the sequence;
each MoE layer of this pipeline stage takes its own decoder layer's slice of the layer axis (dense layers have no
router: GLM-4.5's and DeepSeek-V3's first layers). Expert ids are global, so expert parallelism needs nothing more.

megatron-core keeps every ``RouterReplay`` in one process-global list (``RouterReplay.global_router_replay_instances``)
and its static methods act on all of them. This module never calls those: it addresses the actor's routers one by one
(:class:`ActorRouters`), and only the actor is built with replay; the reference, teacher and critic models of the same
process never replay. The actor's instances leave the global list when the trainer shuts down.

Activation recompute (``--recompute-granularity``) reruns the routers during the backward: megatron-core's
``REPLAY_BACKWARD`` pops each router's routes in the order the forwards set them. A hook on the forward's output
switches the actor's routers to it when that micro-batch's backward starts, and the next forward switches them back,
so 1F1B pipelines (several forwards ahead of their backwards) replay each micro-batch's routes in its recompute.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from runtime.train.backends.megatron_build import sequence_parallel
from runtime.train.batch import ROUTED_EXPERTS, TOKENS

if TYPE_CHECKING:
    from tensordict import TensorDict

# The flag that selects each replay mode (runtime.train.hooks.routing_replay's names).
REPLAY_FLAGS = {"rollout": "--use-rollout-routing-replay", "trainer": "--use-routing-replay"}
# Where each mode's routes come from (named when a batch lacks them).
ROUTES_FROM = {"rollout": "the rollout engine reports them", "trainer": "the old-log-prob pass records them"}
# What the actor's routers do in each pass of a mode ("record": their own top k, kept; "replay": the batch's routes);
# a pass not listed (the SFT step; no mode) routes as the routers choose.
PASS_ACTIONS: dict[str | None, dict[str, str]] = {
    None: {},
    "trainer": {"log_probs": "record", "train": "replay"},
    "rollout": {"log_probs": "replay", "train": "replay"},
}


def replay_mode(hooks: Any) -> str | None:
    """The trainer's routing-replay mode (a key of :data:`PASS_ACTIONS`): the driver's
    :class:`~runtime.train.hooks.TrainHooks`' ``routing_replay``, from slime's flags."""
    return hooks.routing_replay


def replay_problems(mode: str | None, moe: Any) -> list[str]:
    """What stops ``mode`` on a model of MoE shape ``moe`` (None: dense), one line each."""
    if mode not in PASS_ACTIONS:
        return [f"routing replay mode {mode!r}: not one of {sorted(m for m in PASS_ACTIONS if m)}"]
    if mode is None or moe is not None:
        return []
    return [f"{REPLAY_FLAGS[mode]}: routing replay needs a MoE model (this one is dense: no router to replay)"]


def dummy_routes(shape: Sequence[int], *, topk: int, device: torch.device | None = None) -> torch.Tensor:
    """``[*shape, topk]`` int64 rows of the distinct dummy experts ``0 .. topk - 1`` (the last token's row and the
    padding rows of a batch's routes)."""
    return torch.arange(topk, device=device).expand(*shape, topk)


def check_routes(
    routes: torch.Tensor, *, num_experts: int, layer_pattern: Sequence[int], topk: int, flag: str
) -> None:
    """``ValueError`` naming what is wrong unless ``routes`` is ``[b, L, num_layers, topk]`` integer expert ids (one
    slice per decoder layer of ``layer_pattern``) whose MoE layers' ids lie in ``[0, num_experts)``, distinct within
    each row (a repeated expert would route a token to fewer than ``topk``); dense layers' slices are not read."""
    layers = len(layer_pattern)
    if routes.dim() != 4 or tuple(routes.shape[2:]) != (layers, topk):
        raise ValueError(
            f"{flag}: {ROUTED_EXPERTS} of shape {tuple(routes.shape)}, want [rows, tokens, {layers} decoder layers, "
            f"top {topk}]"
        )
    if routes.dtype.is_floating_point or routes.dtype == torch.bool:
        raise ValueError(f"{flag}: {ROUTED_EXPERTS} of dtype {routes.dtype}, want integer expert ids")
    moe = [i for i, kind in enumerate(layer_pattern) if kind]
    routes = routes[:, :, moe]
    if routes.numel() == 0:
        return
    low, high = int(routes.min()), int(routes.max())
    if low < 0 or high >= num_experts:
        raise ValueError(f"{flag}: {ROUTED_EXPERTS} holds expert ids {low}..{high}, outside 0..{num_experts - 1}")
    ordered = routes.sort(dim=-1).values
    repeated = (ordered[..., 1:] == ordered[..., :-1]).any(dim=-1).nonzero()
    if len(repeated):
        row, token, j = repeated[0].tolist()
        raise ValueError(
            f"{flag}: {ROUTED_EXPERTS} row {row}, token {token}, decoder layer {moe[j]} names an expert twice: "
            f"{routes[row, token, j].tolist()}"
        )


def token_routes(routes: torch.Tensor, *, width: int, sp_rank: int = 0, sp_size: int = 1) -> torch.Tensor:
    """``[layers, tokens, topk]`` int64: micro-batch routes ``[b, L, layers, topk]`` in the order
    megatron-core's routers see the micro-batch's ``[b, width]`` tokens: cut or padded (dummy experts) to ``width``,
    sequence-major (token ``s * b + i`` is row ``i``'s position ``s``), and under sequence parallelism only chunk
    ``sp_rank`` of ``sp_size`` of the sequence (``width`` a multiple of ``sp_size``)."""
    b, length, layers, topk = routes.shape
    if width % sp_size:
        raise ValueError(f"a sequence of {width} tokens does not split over {sp_size} sequence-parallel ranks")
    routes = routes[:, :width].long()
    if length < width:
        pad = dummy_routes((b, width - length, layers), topk=topk, device=routes.device)
        routes = torch.cat([routes, pad], dim=1)
    chunk = width // sp_size
    mine = routes[:, sp_rank * chunk : (sp_rank + 1) * chunk]
    return mine.permute(2, 1, 0, 3).reshape(layers, chunk * b, topk).contiguous()


def rows_of(tokens: torch.Tensor, *, rows: int) -> torch.Tensor:
    """The inverse of :func:`token_routes` over a whole sequence: ``[num_layers, width * rows, topk]`` sequence-major
    routes as ``[rows, width, num_layers, topk]``."""
    layers, count, topk = tokens.shape
    return tokens.reshape(layers, count // rows, rows, topk).permute(2, 1, 0, 3)


def layer_slot(layer_number: int, layer_pattern: Sequence[int]) -> int:
    """The index on a batch's layer axis of the router of decoder layer ``layer_number`` (megatron-core's, from 1,
    global over pipeline stages); ``ValueError`` for a dense layer."""
    if not layer_pattern[layer_number - 1]:
        raise ValueError(f"decoder layer {layer_number - 1} is dense in the model's layer pattern: it has no router")
    return layer_number - 1


class ActorRouters:
    """The ``RouterReplay`` of each MoE router of one model (the actor's stage), in layer order: ``slots[j]`` is the
    index of ``replays[j]``'s decoder layer on a batch's layer axis."""

    def __init__(self, model: torch.nn.Module, *, layer_pattern: Sequence[int]):
        from megatron.core.transformer.moe.router import TopKRouter

        found = sorted(
            (layer_slot(m.layer_number, layer_pattern), m.router_replay)
            for m in model.modules()
            if isinstance(m, TopKRouter) and m.router_replay is not None
        )
        self.slots = [slot for slot, _ in found]
        self.replays = [replay for _, replay in found]

    def replay(self, tokens: torch.Tensor) -> None:
        """Hand each router its routes (``tokens[j]`` for ``replays[j]``: :func:`token_routes` of this stage's
        layers) and replay them."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for j, replay in enumerate(self.replays):
            replay.set_target_indices(tokens[j])
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def replay_backward(self) -> None:
        """The recompute in the backward pops the routes each router was handed, in order."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for replay in self.replays:
            replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

    def record(self) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for replay in self.replays:
            replay.set_router_replay_action(RouterReplayAction.RECORD)

    def recorded(self) -> list[torch.Tensor]:
        """Each router's routes of its last forward, ``[tokens, topk]``."""
        return [replay.get_recorded_indices() for replay in self.replays]

    def reset(self) -> None:
        """Back to routing by the routers' own top k, nothing held."""
        for replay in self.replays:
            replay.clear_router_replay_action()
            replay.clear_indices()

    def close(self) -> None:
        """Take these routers out of megatron-core's process-global list (which would keep them alive)."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        mine = {id(r) for r in self.replays}
        RouterReplay.global_router_replay_instances[:] = [
            r for r in RouterReplay.global_router_replay_instances if id(r) not in mine
        ]
        self.replays, self.slots = [], []


class MegatronReplay:
    """Routing replay of :class:`~runtime.train.backends.megatron_backend.MegatronTrainer` (methods of the trainer):
    which pass does what (:data:`PASS_ACTIONS`), the actor's routers handed each micro-batch's routes before its
    forward, and R2's recorded routes gathered back into the shard's rows."""

    replay_mode: str | None = None
    routers: ActorRouters | None = None
    _replay_action: str | None = None
    _recorded: list[torch.Tensor]

    def _replay_setup(self, mode: str | None) -> None:
        """Find the actor's routers (built with ``moe_enable_routing_replay`` when ``mode`` is set)."""
        self.replay_mode = mode
        if mode is not None:
            self.routers = ActorRouters(self._module(self.model), layer_pattern=self.shape.moe.layer_pattern)
            if not self.routers.replays:  # a pipeline stage of dense layers only: nothing to replay here
                self.replay_mode = None

    def _replay_close(self) -> None:
        if self.routers is not None:
            self.routers.close()

    @contextlib.contextmanager
    def _replay_pass(self, name: str) -> Iterator[None]:
        """Within the block, the actor's forwards do what ``name``'s pass does in this trainer's mode; after it, the
        routers route by themselves again and hold nothing."""
        self._replay_action = PASS_ACTIONS[self.replay_mode].get(name)
        self._recorded = []
        try:
            yield
        finally:
            self._replay_action = None
            if self.routers is not None:
                self.routers.reset()

    def _replay_before(self, model: torch.nn.Module, mb: TensorDict, width: int) -> None:
        """Set the actor's routers up for the forward of micro-batch ``mb`` (``width`` tokens a row)."""
        if self._replay_action is None or model is not self.model:
            return
        if self._replay_action == "record":
            self.routers.record()
            return
        if ROUTED_EXPERTS not in mb.keys():
            raise ValueError(
                f"{REPLAY_FLAGS[self.replay_mode]}: the batch has no {ROUTED_EXPERTS} (the routes to replay: "
                f"{ROUTES_FROM[self.replay_mode]})"
            )
        moe = self.shape.moe
        routes = mb[ROUTED_EXPERTS]
        check_routes(
            routes,
            num_experts=moe.num_experts,
            layer_pattern=moe.layer_pattern,
            topk=moe.router_topk,
            flag=REPLAY_FLAGS[self.replay_mode],
        )
        sp = sequence_parallel(self.cfg)
        mine = routes[:, :, self.routers.slots].to(self.device)
        tokens = token_routes(mine, width=width, sp_rank=self.tp_rank if sp else 0, sp_size=self.tp if sp else 1)
        self.routers.replay(tokens)

    def _replay_after(self, model: torch.nn.Module, output: torch.Tensor, mb: TensorDict) -> None:
        """After the forward of ``mb``: its recorded routes kept (``record``), or its backward set to pop its routes
        in the recompute (``replay``)."""
        if self._replay_action is None or model is not self.model:
            return
        if self._replay_action == "record":
            self._recorded.append(self._gathered_records(rows=mb.batch_size[0]))
        elif output.requires_grad:
            routers = self.routers
            output.register_hook(lambda grad: routers.replay_backward())

    def _gathered_records(self, *, rows: int) -> torch.Tensor:
        """``[rows, width, this stage's MoE layers, topk]`` int32: the routes the actor's routers recorded in the last
        forward, the whole sequence (gathered over the sequence-parallel ranks)."""
        local = torch.stack(self.routers.recorded())
        if sequence_parallel(self.cfg):
            parts = [torch.empty_like(local) for _ in range(self.tp)]
            torch.distributed.all_gather(parts, local.contiguous(), group=self.tp_group)
            # Each rank holds its chunk of the sequence, all rows: sequence-major chunks concatenate in order.
            local = torch.cat(parts, dim=1)
        return rows_of(local, rows=rows).to(torch.int32).cpu()

    def _recorded_routes(self, td: TensorDict, groups: list[list[int]] | None) -> Mapping[str, torch.Tensor]:
        """R2's recorded routes of the shard ``td`` in its row order, ``{ROUTED_EXPERTS: [B, L, num_layers, topk]}``
        (empty where this pass recorded nothing): this stage's MoE layers hold what its routers chose for every token
        of each micro-batch, its padding included (so that an update over the same micro-batches routes exactly as
        the recording did); positions past a micro-batch's width, dense layers and other pipeline stages' layers
        (each stage replays its own) the dummy experts."""
        if not self._recorded:
            return {}
        from runtime.train.packing import in_row_order

        topk, layers = self.shape.moe.router_topk, len(self.shape.moe.layer_pattern)
        rows, length = td.batch_size[0], td[TOKENS].shape[1]
        parts = []
        for part in self._recorded:
            part = part[:, :length]
            pad = dummy_routes((part.shape[0], length - part.shape[1], part.shape[2]), topk=topk)
            parts.append(torch.cat([part, pad.to(part.dtype)], dim=1))
        out = dummy_routes((rows, length, layers), topk=topk).to(torch.int32).clone()
        out[:, :, self.routers.slots] = in_row_order(torch.cat(parts), groups)
        return {ROUTED_EXPERTS: out}


__all__ = [
    "PASS_ACTIONS",
    "REPLAY_FLAGS",
    "ActorRouters",
    "MegatronReplay",
    "check_routes",
    "dummy_routes",
    "layer_slot",
    "replay_mode",
    "replay_problems",
    "rows_of",
    "token_routes",
]
