"""The forward passes of :class:`~runtime.train.backends.torch_backend.TorchTrainer` (methods of the trainer, as
a mixin): micro-batches (padded or packed, ``runtime.train.packing``) and the balanced passes over them across
ranks, the bf16 scope of a pass, the model's log-probs and entropies through its full logits or its final hidden
states (for the loss inside the LM head), the critic's values, and the log-prob passes of every role
(``compute_log_probs``)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from rlcore import keys
from rlcore.kernels import linear_logprobs_entropy, logprobs_entropy, nucleus_log_probs
from runtime.train.backends import lora
from runtime.train.backends.torch_models import loss_in_head
from runtime.train.backends.torch_replay import routes_for_inputs, routes_from_inputs
from runtime.train.batch import (
    NUCLEUS_IDS,
    PROMPT_LENGTHS,
    RESPONSE_LENGTHS,
    RESPONSE_TOKENS,
    ROUTED_EXPERTS,
    TOKENS,
)
from runtime.train.hooks import STORE_PREFIX
from runtime.train.packing import (
    ModelInputs,
    in_row_order,
    micro_batches,
    pack_by_tokens,
    packed_inputs,
    padded_inputs,
    token_budget,
)
from runtime.train.roles import ACTOR, CRITIC, REFERENCE

# Where --use-rollout-entropy puts each log-prob pass's entropy (slime's "entropy" and "ref_entropy").
ROLLOUT_ENTROPY = {keys.OLD_LOG_PROBS: keys.OLD_ENTROPY, keys.REF_LOG_PROBS: keys.REF_ENTROPY}


def _identity(hidden: torch.Tensor) -> torch.Tensor:
    """The LM head's forward while the loss runs inside the head (``TorchTrainer._response_hidden``)."""
    return hidden


class TorchForward:
    """The trainer's forward passes: micro-batches, the model's log-probs, entropies and values."""

    def _autocast(self):
        """bf16 autocast on one process outside a :meth:`_step_scope` (inside one the weights are bf16 already)."""
        if self.bf16 and self.world_size == 1 and self._masters is None:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def _inputs(self, mb: TensorDict) -> ModelInputs:
        """Model inputs of micro-batch ``mb`` (on the device): one packed row with ``--use-dynamic-batch-size``,
        right-padded rows otherwise."""
        layout = packed_inputs if self.cfg.use_dynamic_batch_size else padded_inputs
        # Laid out where ``mb`` is (the host, for the trainer's own micro-batches: no device syncs), then moved.
        lengths = mb[PROMPT_LENGTHS] + mb[RESPONSE_LENGTHS]
        inputs = layout(mb[TOKENS], mb[PROMPT_LENGTHS], lengths, horizon=mb[RESPONSE_TOKENS].shape[1])
        return inputs.to(self.device)

    @contextmanager
    def _base_model(self) -> Iterator[None]:
        """The LoRA base model as the reference: adapters disabled, routing as usual (replay is the actor's)."""
        with lora.base_only(self.model), self.route_replay.pause() if self.route_replay else nullcontext():
            yield

    def _route(self, model: torch.nn.Module, mb: TensorDict, *, packed: bool | None = None) -> None:
        """Before a forward of ``model`` on ``mb``: under routing replay the actor's routers replay ``mb``'s
        ``ROUTED_EXPERTS`` (laid out like :meth:`_inputs`, or as ``packed`` says), or, under R2 before its routes
        exist (the old-log-prob pass), record their own. Other models, and the LoRA base as the reference, route as
        usual."""
        replay = self.route_replay
        if replay is None or model is not self.model or replay.paused:
            if replay is not None:
                replay.off()
            return
        if ROUTED_EXPERTS in mb.keys():
            lengths = (mb[PROMPT_LENGTHS] + mb[RESPONSE_LENGTHS]).cpu()
            packed = self.cfg.use_dynamic_batch_size if packed is None else packed
            flat = routes_for_inputs(mb[ROUTED_EXPERTS], lengths, packed=packed)
            replay.replay(flat, device=self.device)
        elif self.hooks.routing_replay == "trainer":
            replay.record()
        else:
            raise ValueError(
                "--use-rollout-routing-replay: the batch has no routed_experts (build_batch(routed_experts=True) "
                "from samples the engine reported routes for)"
            )

    def _recorded_routes(self, mb: TensorDict) -> torch.Tensor:
        """R2: the routes the actor's last forward on ``mb`` recorded, in the batch layout ``[b, L, layers, topk]``."""
        lengths = (mb[PROMPT_LENGTHS] + mb[RESPONSE_LENGTHS]).cpu()
        flat = self.route_replay.recorded_routes().cpu()
        return routes_from_inputs(flat, lengths, packed=self.cfg.use_dynamic_batch_size, width=mb[TOKENS].shape[1])

    def _forward(self, model: torch.nn.Module, mb: TensorDict, *, with_entropy: bool) -> tuple[torch.Tensor, Any]:
        """Response-aligned ``(log_probs [b, T], entropy [b, T] or None)`` of ``model`` on micro-batch ``mb``, through
        the model's full logits. Under top-p replay (``NUCLEUS_IDS`` in ``mb``) the log-probs are renormalised over
        each token's nucleus (:func:`rlcore.kernels.nucleus_log_probs`); the entropy stays the full
        distribution's, as in slime."""
        inputs = self._inputs(mb)
        self._route(model, mb)
        # Top-p replay: the nucleus ids are range-checked where they arrive (the host), not with a device sync.
        host_nucleus = mb[NUCLEUS_IDS] if NUCLEUS_IDS in mb.keys() else None
        mb = mb.to(self.device)
        with self._autocast():
            logits = model(**inputs.model_kwargs(), use_cache=False).logits
        response = mb[RESPONSE_TOKENS]
        # ``picked`` is a fresh copy nothing else reads (index_select's backward does not need its output), so the
        # backward may write d(logits) into it instead of allocating another [b * T, V] buffer (not when the nucleus
        # replay reads it too).
        picked = logits.reshape(-1, logits.shape[-1]).index_select(0, inputs.picks.reshape(-1))
        if host_nucleus is None:
            log_probs, entropy = logprobs_entropy(
                picked,
                response.reshape(-1),
                temperature=self.temperature,
                with_entropy=with_entropy,
                inplace_backward=True,
            )
        else:
            vocab = logits.shape[-1]
            if host_nucleus.device.type == "cpu" and bool(((host_nucleus < -1) | (host_nucleus >= vocab)).any()):
                raise ValueError(f"{NUCLEUS_IDS}: ids must be in [0, {vocab}) or -1 (padding)")
            nucleus = mb[NUCLEUS_IDS]
            log_probs = nucleus_log_probs(
                picked,
                response.reshape(-1),
                nucleus.reshape(-1, nucleus.shape[-1]),
                temperature=self.temperature,
                validate=host_nucleus.device.type != "cpu",
            ).float()
            entropy = None
            if with_entropy:  # the full distribution's, as in slime
                _, entropy = logprobs_entropy(
                    picked,
                    response.reshape(-1),
                    temperature=self.temperature,
                    with_entropy=True,
                    inplace_backward=False,
                )
        shape = response.shape
        return log_probs.view(shape), (entropy.view(shape) if entropy is not None else None)

    def _values(self, mb: TensorDict) -> torch.Tensor:
        """Response-aligned critic values [b, T] float32 on micro-batch ``mb`` (with gradient when enabled): the value
        head's output at the position that predicts each response token, i.e. the value of the state before it."""
        inputs = self._inputs(mb)
        mb = mb.to(self.device)
        with self._autocast():
            out = self.critic(**inputs.model_kwargs(), use_cache=False)
        return out.logits[..., 0].float().reshape(-1)[inputs.picks]

    def _response_hidden(
        self, model: torch.nn.Module, mb: TensorDict
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(hidden [b * T, H], lm_head weight [V, H], targets [b * T])``: the final hidden states at the positions
        that predict the response tokens, the LM head's weight in their dtype, and the response tokens.

        The model runs through its own (root) forward with the LM head made the identity, so under FSDP2 the root's
        hooks run: its parameters (embeddings, final norm, LM head) are unsharded for the forward and stay so until
        the backward (FSDP2 does not reshard the root after its forward), and their gradients are reduce-scattered
        after it as if the head had run inside. The weight read after the forward is that unsharded parameter (in the
        mixed-precision policy's dtype under bf16). On one process under bf16 it is the step's bf16 copy
        (:meth:`_step_scope`)."""
        inputs = self._inputs(mb)
        self._route(model, mb)
        mb = mb.to(self.device)
        head = model.get_output_embeddings()
        head.forward = _identity
        try:
            with self._autocast(), warnings.catch_warnings():
                # FSDP2 warns that the root returns a view (the head's input); nothing writes into it in place.
                warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
                hidden = model(**inputs.model_kwargs(), use_cache=False).logits
        finally:
            del head.forward
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, inputs.picks.reshape(-1))
        return picked.to(dtype), self._cast(head.weight, dtype), mb[RESPONSE_TOKENS].reshape(-1)

    def _cast(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``weight`` in ``dtype`` (already so inside a bf16 :meth:`_step_scope` and under FSDP2's policy)."""
        return weight.to(dtype)

    @contextmanager
    def _step_scope(self) -> Iterator[None]:
        """The micro-batches of one optimizer step (or one log-prob pass). Under bf16 on one process, what FSDP2's
        ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)`` does across ranks: every float32 parameter of
        the trainer's models is cast to bf16 once for the scope (its ``data`` swapped for the copy), so the forward
        and backward run wholly in bf16, the residual stream and norms included (autocast would keep them in float32,
        with a cast before every matmul); each micro-batch's bf16 gradients are summed into float32 accumulators
        (:meth:`_accumulate_grads`). On exit the float32 weights are put back with the summed gradients, before the
        optimizer step."""
        if not (self.bf16 and self.world_size == 1):
            yield
            return
        params = {id(p): p for model in self._models() for p in model.parameters() if p.dtype == torch.float32}
        self._masters = []
        for param in params.values():
            accum, param.grad = param.grad, None
            self._masters.append((param, param.data, accum))
            param.data = param.data.to(torch.bfloat16)
        try:
            yield
        finally:
            for param, master, accum in self._masters:
                param.data = master
                param.grad = accum
            self._masters = None

    def _balanced(self, parts: list[TensorDict]) -> Iterator[tuple[TensorDict, bool]]:
        """Yield ``(micro_batch, real)``; under FSDP every rank runs as many passes (extra ones are not real)."""
        count = len(parts)
        if self.group is not None:
            n = torch.tensor([count], device=self.device)
            dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.group)
            count = int(n)
        for i in range(count):
            yield (parts[i], True) if i < len(parts) else (parts[-1], False)

    def _micro_batches(self, td: TensorDict, *, log_probs: bool = False) -> list[TensorDict]:
        """``td``'s rows in micro-batches: packed by real tokens with ``--use-dynamic-batch-size`` (rows regrouped:
        see :meth:`_parts_and_groups`), else consecutive rows by ``--micro-batch-size`` or the token budget
        (:func:`runtime.train.packing.token_budget`; ``log_probs``: a log-prob pass's)."""
        if self.cfg.use_dynamic_batch_size:
            return self._parts_and_groups(td, log_probs=log_probs)[0]
        return micro_batches(
            td, micro_batch_size=self.cfg.micro_batch_size, max_tokens=token_budget(self.cfg, log_probs=log_probs)
        )

    def _parts_and_groups(self, td: TensorDict, *, log_probs: bool) -> tuple[list[TensorDict], list[list[int]] | None]:
        """The micro-batches of a pass over ``td`` (``log_probs``: a log-prob pass, with its token budget), and
        their rows for :func:`runtime.train.packing.in_row_order` to undo the regrouping of
        ``--use-dynamic-batch-size`` on their concatenated outputs (``None``: consecutive rows)."""
        if not self.cfg.use_dynamic_batch_size:
            return self._micro_batches(td, log_probs=log_probs), None
        lengths = (td[PROMPT_LENGTHS] + td[RESPONSE_LENGTHS]).tolist()
        groups = pack_by_tokens(lengths, max_tokens=token_budget(self.cfg, log_probs=log_probs))
        return [td[torch.tensor(rows)] for rows in groups], groups

    @torch.no_grad()
    def compute_log_probs(self, td: TensorDict) -> TensorDict:
        """``old_log_probs`` (the actor's current weights) and what each other role writes (``ref_log_probs`` for the
        reference, ``teacher_log_probs`` for the teacher, ``values`` for the critic), [B, T] float32 each, for this
        rank's shard ``td``."""
        self._check_resident()
        models = {ACTOR.writes: (self.model, nullcontext), **{k: (m, nullcontext) for k, m in self.frozen.items()}}
        if self.base_is_reference:
            models[REFERENCE.writes] = (self.model, self._base_model)
        out: dict[str, list[torch.Tensor]] = {key: [] for key in models}
        for key, (model, context) in models.items():
            # slime's store prefixes: "" for the actor, "ref_" for the reference, "teacher_" for the teacher.
            with context():
                self._call_hook("custom_megatron_before_log_prob_hook_path", model, STORE_PREFIX.get(key, ""))
        if self.old_actor is not None:
            # The old log-probs under the old actor's weights (slime's _switch_model("old_actor")): they are swapped
            # in for this pass and the current ones put back after it.
            # Under R2 that pass records the routes the update replays: the old actor's, as slime records them
            # after its switch to "old_actor".
            current = self._actor_copy()
            self._load_actor_copy(self.old_actor)
            try:
                old = self._log_probs_of(self.model, nullcontext, td)
            finally:
                self._load_actor_copy(current)
            del models[ACTOR.writes], out[ACTOR.writes]
        if self.critic is not None:
            out[CRITIC.writes] = []
        parts, groups = self._parts_and_groups(td, log_probs=True)
        with self._step_scope():
            for mb, real in self._balanced(parts):
                if self.critic is not None:
                    values = self._values(mb)
                    if real:
                        out[CRITIC.writes].append(values.detach())
                for key, (model, context) in models.items():
                    entropy_key = ROLLOUT_ENTROPY.get(key) if self.hooks.rollout_entropy else None
                    with context():
                        if entropy_key is None:
                            log_probs = self._micro_log_probs(model, mb)
                        else:
                            log_probs, entropy = self._forward(model, mb, with_entropy=True)
                    if real:
                        out[key].append(log_probs.float())
                        if (
                            key == ACTOR.writes
                            and self.route_replay is not None
                            and self.route_replay.mode == "record"
                        ):
                            out.setdefault(ROUTED_EXPERTS, []).append(self._recorded_routes(mb))
                        if entropy_key is not None:
                            out.setdefault(entropy_key, []).append(entropy.float())
        # One device-to-host copy per pass, after every micro-batch is queued (a .cpu() each would wait for it).
        logs = {k: in_row_order(torch.cat(v).cpu(), groups) for k, v in out.items()}
        if self.old_actor is not None:
            logs.update(old)
        return TensorDict(logs, batch_size=td.batch_size)

    def _log_probs_of(self, model: torch.nn.Module, context: Any, td: TensorDict) -> dict[str, torch.Tensor]:
        """``old_log_probs`` [B, T] float32 of ``model`` (under ``context()``) on this rank's shard ``td``, and the
        ``routed_experts`` its routers recorded where the actor records them (R2)."""
        parts, groups = self._parts_and_groups(td, log_probs=True)
        out: dict[str, list[torch.Tensor]] = {ACTOR.writes: []}
        with self._step_scope():
            for mb, real in self._balanced(parts):
                with context():
                    log_probs = self._micro_log_probs(model, mb)
                if real:
                    out[ACTOR.writes].append(log_probs.float())
                    if model is self.model and self.route_replay is not None and self.route_replay.mode == "record":
                        out.setdefault(ROUTED_EXPERTS, []).append(self._recorded_routes(mb))
        return {k: in_row_order(torch.cat(v).cpu(), groups) for k, v in out.items()}

    def _micro_log_probs(self, model: torch.nn.Module, mb: TensorDict) -> torch.Tensor:
        if loss_in_head(model) and NUCLEUS_IDS not in mb.keys():
            hidden, weight, targets = self._response_hidden(model, mb)
            log_probs, _ = linear_logprobs_entropy(
                hidden, weight, targets, temperature=self.temperature, with_entropy=False
            )
            return log_probs.view(mb[RESPONSE_TOKENS].shape)
        return self._forward(model, mb, with_entropy=False)[0]
