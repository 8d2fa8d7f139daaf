"""The ``torch`` training backend: a transformers causal LM trained with AdamW, sharded with FSDP2 across processes.

One :class:`TorchTrainer` runs per data-parallel rank (a Ray actor, see ``runtime.cluster.placement``). Ranks form a
``torch.distributed`` group (gloo on the CPU, NCCL on GPUs) and the model's decoder layers and root are wrapped with
``torch.distributed.fsdp.fully_shard``; with one rank the model is used as is.

The loss of an optimizer step is the loss of its whole global batch: every micro-batch is aggregated with a
:class:`rlcore.losses.Normalizer` of the global batch (summed over micro-batches and reduced over ranks), so its
gradients add up to the global batch's (FSDP averages over ranks, so each rank scales its loss by the world size).
Log-probs and entropies come from :func:`rlcore.kernels.logprobs_entropy` at the rollout temperature. With the LM head
a plain linear layer, it is never applied to all positions: the model's root forward runs with the head as the
identity (so FSDP2's root hooks gather the head's weight, as when the head runs inside), the response positions are
picked from the final hidden states, and :func:`rlcore.kernels.linear_rl_loss` computes the loss inside the LM head
(:func:`rlcore.kernels.linear_logprobs_entropy` for the old and reference recompute). With a LoRA adapter on the LM
head, a final logit soft-cap, or top-p replay (the batch's ``NUCLEUS_IDS``), the full logits of each micro-batch are
materialised.

Speed options (docs/runtime.md): packed micro-batches (``--use-dynamic-batch-size``, ``runtime.train.packing``),
activation recompute of every decoder layer (``--recompute-granularity full``), the attention implementation,
and bf16 weights cast once per optimizer step from the float32 ones, gradients summed in float32
(:meth:`TorchTrainer._step_scope`).

This module is the trainer's forward passes and steps; the models it trains are built and wrapped (LoRA, recompute,
compile, FSDP2, the critic's value head) by ``torch_models``, slime's loss hooks adapted to its micro-batches by
``torch_loss_hooks``, its weights sent out and checkpoints written by ``torch_export`` (through ``torch_checkpoint``),
its memory released while colocated by ``torch_offload``, and its micro-batches cut by ``runtime.train.packing``.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.constants import default_pg_timeout

from rlcore import keys
from rlcore.kernels import linear_logprobs_entropy, linear_rl_loss, logprobs_entropy, nucleus_log_probs
from rlcore.losses import LossConfig, Normalizer, critic_loss, rl_loss
from runtime.cluster.loopback import confine_collectives, is_loopback, rendezvous_store
from runtime.config import TrainConfig
from runtime.engines.hf_engine import pick_device, restore_rng_state, rng_state
from runtime.train.backends import lora
from runtime.train.backends.stateless_adam import StatelessAdamW
from runtime.train.backends.torch_export import TorchExport
from runtime.train.backends.torch_loss_hooks import TorchLossHooks
from runtime.train.backends.torch_models import load_model, loss_in_head, uses_bf16
from runtime.train.backends.torch_offload import TorchOffload
from runtime.train.backends.torch_replay import RouteReplay, routes_for_inputs, routes_from_inputs
from runtime.train.batch import (
    NUCLEUS_IDS,
    PROMPT_LENGTHS,
    RESPONSE_LENGTHS,
    RESPONSE_TOKENS,
    ROUTED_EXPERTS,
    TOKENS,
)
from runtime.train.hooks import (
    STORE_PREFIX,
    TrainHooks,
)
from runtime.train.metrics import add_step, sums_and_maxima
from runtime.train.offload import HostOffload
from runtime.train.packing import (
    ModelInputs,
    in_row_order,
    micro_batches,
    pack_by_tokens,
    packed_inputs,
    padded_inputs,
    token_budget,
)
from runtime.train.roles import ACTOR, CRITIC, REFERENCE, TEACHER, ModelRole

# Where --use-rollout-entropy puts each log-prob pass's entropy (slime's "entropy" and "ref_entropy").
ROLLOUT_ENTROPY = {keys.OLD_LOG_PROBS: keys.OLD_ENTROPY, keys.REF_LOG_PROBS: keys.REF_ENTROPY}

# slime's store_prefix of each role's log-prob forward (--custom-megatron-before-log-prob-hook-path).
# The roles this backend builds a model for; others are refused by name at construction.
SUPPORTED_ROLES = (ACTOR, REFERENCE, TEACHER, CRITIC)


def _identity(hidden: torch.Tensor) -> torch.Tensor:
    """The LM head's forward while the loss runs inside the head (``TorchTrainer._response_hidden``)."""
    return hidden


def _host_lengths(mb: TensorDict) -> list[int] | None:
    """Each row's valid response tokens, counted where the micro-batch lives if that is the host (then the fused
    loss queues its work without waiting for the device); ``None`` for a batch already on the device."""
    mask = mb[keys.MASK]
    return mask.sum(-1).tolist() if mask.device.type == "cpu" else None


class TorchTrainer(TorchLossHooks, TorchExport, TorchOffload):
    """One data-parallel rank of the torch backend. Every public method is called on all ranks at once."""

    def __init__(
        self,
        model_path: str,
        *,
        train_cfg: TrainConfig,
        loss_cfg: LossConfig,
        temperature: float,
        seed: int,
        roles: Sequence[ModelRole] = (ACTOR,),
        rank: int = 0,
        world_size: int = 1,
        master_addr: str = "127.0.0.1",
        master_port: int = 0,
        device: str = "auto",
        role_paths: Mapping[str, str] | None = None,
        hooks: TrainHooks | None = None,
    ):
        unsupported = [role.name for role in roles if role not in SUPPORTED_ROLES]
        if unsupported or ACTOR not in roles:
            raise ValueError(
                f"the torch backend runs the roles {[r.name for r in SUPPORTED_ROLES]} (the actor always); "
                f"asked for {[r.name for r in roles]}"
            )
        self.cfg = train_cfg
        self.loss_cfg = loss_cfg
        # slime's trainer-side hooks and loss type (runtime.train.hooks), imported in this process.
        self.hooks = hooks or TrainHooks()
        self._hook = self.hooks.resolve()
        self.temperature = temperature
        self.rank, self.world_size = rank, world_size
        self.model_path = model_path
        self.device = pick_device(device)
        self.seed = seed
        torch.manual_seed(seed + rank)
        self.group = None
        if world_size > 1:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            if is_loopback(master_addr):
                # One node: the rendezvous and the collectives' sockets listen on 127.0.0.1 only.
                confine_collectives()
                store = rendezvous_store(master_port, rank=rank, world_size=world_size, timeout=default_pg_timeout)
                dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
            else:
                dist.init_process_group(
                    backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=world_size
                )
            self.group = dist.group.WORLD
        self.bf16 = uses_bf16(train_cfg.bf16, self.device)
        # Inside a bf16 _step_scope on one process: (parameter, its float32 data, float32 gradient sum or None).
        self._masters: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor | None]] | None = None
        self.model = self._load(trainable=True)
        self.lora = lora.is_lora(self.model)
        paths = dict(role_paths or {})
        # Frozen roles by the key they write (the reference's ref_log_probs). Under LoRA the reference is the actor
        # with its adapters disabled, not a second copy (unless --ref-load names another model).
        self.base_is_reference = self.lora and REFERENCE in roles and REFERENCE.name not in paths
        self.frozen = {
            role.writes: self._load(trainable=False, path=paths.get(role.name))
            for role in roles
            if role not in (ACTOR, CRITIC) and not (self.base_is_reference and role == REFERENCE)
        }
        # slime's critic (--advantage-estimator ppo): the actor's model (or its own folder) with the LM head replaced
        # by a fresh linear value head, all of it trained (never LoRA), with an optimizer of its own.
        self.critic = None
        if CRITIC in roles:
            self.critic = self._load(trainable=True, path=paths.get(CRITIC.name), value_head=True)
        for role in roles:
            other = self.frozen.get(role.writes)
            if role != ACTOR and other is not None and other.config.vocab_size != self.model.config.vocab_size:
                raise ValueError(
                    f"the {role.name} model {paths.get(role.name, model_path)!r} has a vocabulary of "
                    f"{other.config.vocab_size}, the actor {self.model.config.vocab_size}: they must share a tokenizer"
                )
        # MoE routing replay of the actor's routers (torch_replay): "rollout" (R3) replays the batch's ROUTED_EXPERTS,
        # "trainer" (R2) records them in the old-log-prob pass and replays them in the update.
        self.route_replay = RouteReplay(self.model) if self.hooks.routing_replay else None
        if self.hooks.routing_replay == "trainer" and train_cfg.keep_old_actor:
            raise ValueError(
                "--use-routing-replay records the routes of the old-log-prob pass, which --keep-old-actor runs on "
                "another copy of the weights: use --use-rollout-routing-replay, or leave one of them out"
            )
        self.optimizer = self._adamw(self.model)
        self.critic_optimizer = self._adamw(self.critic) if self.critic is not None else None
        self.released = False
        # Colocated offload on one GPU: bucketed copies through pinned host buffers (runtime.train.offload); under
        # FSDP the sharded modules move with .to() instead.
        self.host_offload = HostOffload(self.device) if self.device.type == "cuda" and self.world_size == 1 else None
        # --keep-old-actor: CPU copies of the actor's trained weights, slime's "old_actor" (what the old log-probs
        # are computed with) and "rollout_actor" (the weights the engines got last); see advance_old_actor.
        self.old_actor: list[torch.Tensor] | None = None
        self.rollout_actor: list[torch.Tensor] | None = None
        if train_cfg.keep_old_actor:
            self.old_actor, self.rollout_actor = self._actor_copy(), self._actor_copy()
        init = self._hook.get("custom_megatron_init_path")
        if init is not None:
            init(self.hooks.args)

    def _call_hook(self, name: str, *args: Any) -> None:
        hook = self._hook.get(name)
        if hook is not None:
            hook(self.hooks.args, *args)

    def _trained_tensors(self) -> list[torch.Tensor]:
        """The actor's trained parameters as plain tensors (this rank's shard under FSDP)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        return [p.to_local() if hasattr(p, "to_local") else p for p in params]

    @torch.no_grad()
    def _actor_copy(self) -> list[torch.Tensor]:
        return [t.detach().to("cpu", copy=True) for t in self._trained_tensors()]

    @torch.no_grad()
    def _load_actor_copy(self, copy: list[torch.Tensor]) -> None:
        for target, source in zip(self._trained_tensors(), copy, strict=True):
            target.copy_(source)

    def advance_old_actor(self) -> None:
        """After a weight sync (slime's ``--keep-old-actor`` queue at ``--update-weights-interval 1``): the old actor
        becomes the weights the engines had, and those become the actor's current ones. Under the one-step async
        schedule the rollout trained next was sampled by the weights before the sync, so its old log-probs are the
        sampling policy's."""
        if self.old_actor is None or self.rollout_actor is None:
            raise RuntimeError("advance_old_actor: this trainer keeps no old actor (--keep-old-actor)")
        self.old_actor, self.rollout_actor = self.rollout_actor, self._actor_copy()

    def _adamw(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """AdamW over ``model``'s trained parameters; with ``--use-stateless-adam`` one that keeps no moments."""
        params = [p for p in model.parameters() if p.requires_grad]
        if self.cfg.use_stateless_adam:
            return StatelessAdamW(params, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        return torch.optim.AdamW(params, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)

    def _load(self, *, trainable: bool, path: str | None = None, value_head: bool = False) -> torch.nn.Module:
        """One of this trainer's models (:func:`runtime.train.backends.torch_models.load_model`)."""
        return load_model(
            path or self.model_path,
            cfg=self.cfg,
            hooks=self.hooks,
            device=self.device,
            seed=self.seed,
            world_size=self.world_size,
            bf16=self.bf16,
            trainable=trainable,
            value_head=value_head,
        )

    def _autocast(self):
        """bf16 autocast on one process outside a :meth:`_step_scope` (inside one the weights are bf16 already)."""
        if self.bf16 and self.world_size == 1 and self._masters is None:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def _backward(self, loss: torch.Tensor, *, real: bool) -> None:
        # Each rank's loss is its share of the global batch's loss (a global Normalizer), so gradients must add up
        # over ranks; FSDP averages them (and gloo has no pre-scaled sum), hence the factor world_size.
        # Outside autocast: the backward runs in the forward's dtypes (recompute restores the forward's autocast).
        with torch.autocast(self.device.type, enabled=False):
            (loss * (self.world_size if real else 0.0)).backward()
        if self._masters is not None:
            self._accumulate_grads()

    def _accumulate_grads(self) -> None:
        """Inside a bf16 :meth:`_step_scope`: add the micro-batch's bf16 gradients into the float32 accumulators and
        free them, so the step's gradient is summed in float32 (as FSDP2's ``reduce_dtype``)."""
        assert self._masters is not None
        for i, (param, master, accum) in enumerate(self._masters):
            if param.grad is not None:
                self._masters[i] = (param, master, param.grad.float() if accum is None else accum.add_(param.grad))
                param.grad = None

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

    def _route(self, model: torch.nn.Module, mb: TensorDict) -> None:
        """Before a forward of ``model`` on ``mb``: under routing replay the actor's routers replay ``mb``'s
        ``ROUTED_EXPERTS`` (laid out like :meth:`_inputs`), or, under R2 before its routes exist (the old-log-prob
        pass), record their own. Other models, and the LoRA base as the reference, route as usual."""
        replay = self.route_replay
        if replay is None or model is not self.model or replay.paused:
            if replay is not None:
                replay.off()
            return
        if ROUTED_EXPERTS in mb.keys():
            lengths = (mb[PROMPT_LENGTHS] + mb[RESPONSE_LENGTHS]).cpu()
            flat = routes_for_inputs(mb[ROUTED_EXPERTS], lengths, packed=self.cfg.use_dynamic_batch_size)
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

    def _models(self) -> list[torch.nn.Module]:
        return [self.model, *self.frozen.values(), *([self.critic] if self.critic is not None else [])]

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

    def dp_info(self) -> tuple[int, int]:
        """Every rank is a data-parallel shard (FSDP shards parameters, not data)."""
        return self.rank, self.world_size

    def dp_group(self) -> dist.ProcessGroup | None:
        return self.group

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
            logs[ACTOR.writes] = old
        return TensorDict(logs, batch_size=td.batch_size)

    def _log_probs_of(self, model: torch.nn.Module, context: Any, td: TensorDict) -> torch.Tensor:
        """[B, T] float32 log-probs of ``model`` (under ``context()``) on this rank's shard ``td``."""
        parts, groups = self._parts_and_groups(td, log_probs=True)
        outputs = []
        with self._step_scope():
            for mb, real in self._balanced(parts):
                with context():
                    log_probs = self._micro_log_probs(model, mb)
                if real:
                    outputs.append(log_probs.float())
        return in_row_order(torch.cat(outputs).cpu(), groups)

    def _micro_log_probs(self, model: torch.nn.Module, mb: TensorDict) -> torch.Tensor:
        if loss_in_head(model) and NUCLEUS_IDS not in mb.keys():
            hidden, weight, targets = self._response_hidden(model, mb)
            log_probs, _ = linear_logprobs_entropy(
                hidden, weight, targets, temperature=self.temperature, with_entropy=False
            )
            return log_probs.view(mb[RESPONSE_TOKENS].shape)
        return self._forward(model, mb, with_entropy=False)[0]

    def _global_normalizer(self, parts: list[TensorDict]) -> Normalizer:
        norm = sum(
            Normalizer.of(
                mb[keys.MASK].to(self.device),
                seq_counts=mb[keys.SEQ_COUNTS].to(self.device) if keys.SEQ_COUNTS in mb.keys() else None,
            )
            for mb in parts
        )
        return norm.reduce(self.group)

    def _optimizer_step(self, model: torch.nn.Module | None = None, optimizer: Any = None) -> float:
        """Clip the gradients of ``model`` (the actor by default) and step ``optimizer`` (its own); the norm."""
        model, optimizer = model or self.model, optimizer or self.optimizer
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.cfg.clip_grad)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def _reduce_metrics(self, sums: dict[str, float], maxes: dict[str, float]) -> dict[str, float]:
        if self.group is not None:
            sums, maxes = self._all_reduce(sums, dist.ReduceOp.SUM), self._all_reduce(maxes, dist.ReduceOp.MAX)
        return {**sums, **maxes}

    def _all_reduce(self, values: dict[str, float], op: dist.ReduceOp) -> dict[str, float]:
        names = sorted(values)
        t = torch.tensor([values[k] for k in names], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op, group=self.group)
        return dict(zip(names, t.tolist(), strict=True))

    def train(
        self, td: TensorDict, *, per_step_rows: int | Sequence[int], rollout_id: int | None = None
    ) -> dict[str, float]:
        """Optimizer steps over this rank's shard ``td``: ``per_step_rows`` consecutive rows per step (or, a list,
        each step's own count).

        ``td`` carries the contract's ``mask``, ``advantages``, ``old_log_probs``, ``rollout_log_probs`` and, with a
        reference model, ``ref_log_probs``. Returns the global batches' metrics over the steps (token means
        averaged, maxima the largest of any step: ``runtime.train.metrics``), plus ``grad_norm`` and ``num_steps``.
        """
        self._check_resident()
        if self.route_replay is not None and ROUTED_EXPERTS not in td.keys():
            raise ValueError(
                "routing replay: the shard has no routed_experts (R3: from the engine; R2: from compute_log_probs)"
            )
        n = td.batch_size[0]
        if isinstance(per_step_rows, int):
            if n % per_step_rows:
                raise ValueError(f"shard of {n} rows is not a whole number of steps of {per_step_rows} rows")
            per_step_rows = [per_step_rows] * (n // per_step_rows)
        if sum(per_step_rows) != n:
            raise ValueError(f"steps of {list(per_step_rows)} rows do not add up to the shard's {n} rows")
        totals: dict[str, float] = {}
        steps = len(per_step_rows)
        bounds = [0, *itertools.accumulate(per_step_rows)]
        lora.set_dropout(self.model, active=True)
        try:
            for step in range(steps):
                self._call_hook(
                    "custom_megatron_before_train_step_hook_path", rollout_id, step, self.model, self.optimizer, None
                )
                self._train_step(td[bounds[step] : bounds[step + 1]], steps, totals)
        finally:
            lora.set_dropout(self.model, active=False)
        totals["num_steps"] = steps
        return totals

    def _train_step(self, td: TensorDict, steps: int, totals: dict[str, float]) -> None:
        """One optimizer step over ``td``; folds its metrics into ``totals`` (``runtime.train.metrics.add_step``)."""
        parts = self._micro_batches(td)
        norm = self._global_normalizer(parts)
        pending: list[dict[str, Any]] = []
        with self._step_scope():
            for mb, real in self._balanced(parts):
                batch = mb.to(self.device).clone(recurse=False)
                loss_type = self.hooks.loss_type
                reducer = self._hook.get("custom_pg_loss_reducer_function_path")
                tis = self._hook.get("custom_tis_function_path")
                if loss_type == "sft_loss":
                    loss = self._sft_loss(batch, norm, mode=self.loss_cfg.loss_agg_mode)
                    metrics = {"loss": loss.detach()}
                elif loss_type == "custom_loss":
                    loss, metrics = self._custom_loss(batch, norm)
                elif loss_in_head(self.model) and reducer is None and tis is None and NUCLEUS_IDS not in mb.keys():
                    hidden, weight, targets = self._response_hidden(self.model, mb)
                    loss, metrics = linear_rl_loss(
                        hidden,
                        weight,
                        targets,
                        batch,
                        self.loss_cfg,
                        norm=norm,
                        temperature=self.temperature,
                        seq_lengths=_host_lengths(mb),
                    )
                else:
                    log_probs, entropy = self._forward(self.model, mb, with_entropy=True)
                    batch.set(keys.LOG_PROBS, log_probs)
                    batch.set(keys.ENTROPY, entropy)
                    pg_reduce = None if reducer is None else self._pg_reduce(reducer, batch, norm)
                    mismatch = None if tis is None else self._mismatch(tis, batch)
                    loss, metrics = rl_loss(batch, self.loss_cfg, norm=norm, pg_reduce=pg_reduce, mismatch=mismatch)
                self._backward(loss, real=real)
                if real:
                    # Read after the loop: a float() here would wait for each micro-batch's kernels.
                    pending.append({name: (v.detach() if torch.is_tensor(v) else v) for name, v in metrics.items()})
        step_metrics = self._reduce_metrics(*sums_and_maxima(pending))
        step_metrics["grad_norm"] = self._optimizer_step()
        add_step(totals, step_metrics, steps=steps)

    def train_critic(self, td: TensorDict, *, per_step_rows: int) -> dict[str, float]:
        """Optimizer steps of the critic over this rank's shard ``td``, ``per_step_rows`` rows each, on slime's value
        loss (:func:`rlcore.losses.critic_loss` with ``--value-clip`` and the job's aggregation).

        ``td`` carries ``mask``, ``old_values`` (the critic's values before these steps) and ``returns`` (the
        targets). Returns ``critic/``-prefixed metrics averaged over the steps (``value_loss``, ``value_clipfrac``,
        ``values_mean``, ``grad_norm``, ``num_steps``), the same on every rank.
        """
        self._check_resident()
        if self.critic is None:
            raise RuntimeError("train_critic: this trainer runs no critic (--advantage-estimator ppo)")
        n = td.batch_size[0]
        if n % per_step_rows:
            raise ValueError(f"shard of {n} rows is not a whole number of steps of {per_step_rows} rows")
        steps = n // per_step_rows
        totals: dict[str, float] = {}
        for step in range(steps):
            parts = self._micro_batches(td[step * per_step_rows : (step + 1) * per_step_rows])
            norm = self._global_normalizer(parts)
            pending: list[dict[str, Any]] = []
            with self._step_scope():
                for mb, real in self._balanced(parts):
                    batch = mb.to(self.device).clone(recurse=False)
                    batch.set(keys.VALUES, self._values(mb))
                    loss, metrics = critic_loss(
                        batch, clip=self.loss_cfg.value_clip, loss_agg_mode=self.loss_cfg.loss_agg_mode, norm=norm
                    )
                    self._backward(loss, real=real)
                    if real:  # read after the loop, as the actor's step does: no wait per micro-batch
                        pending.append({name: v.detach() if torch.is_tensor(v) else v for name, v in metrics.items()})
            step_metrics = self._reduce_metrics(*sums_and_maxima(pending))
            step_metrics["grad_norm"] = self._optimizer_step(self.critic, self.critic_optimizer)
            add_step(totals, step_metrics, steps=steps)
        totals["num_steps"] = steps
        return {f"critic/{name}": value for name, value in totals.items()}

    def sft_train(self, td: TensorDict) -> dict[str, float]:
        """One supervised step on (prompt, response) rows: the negative log-likelihood of the response tokens."""
        self._check_resident()
        parts = self._micro_batches(td)
        norm = self._global_normalizer(parts)
        total = 0.0
        with self._step_scope():
            for mb, real in self._balanced(parts):
                # The same loss as --loss-type sft_loss (a token mean, as slime's SFT scripts aggregate).
                loss = self._sft_loss(mb.to(self.device), norm, mode="token_mean")
                self._backward(loss, real=real)
                total += float(loss) if real else 0.0
        metrics = self._reduce_metrics({"sft_loss": total}, {})
        metrics["grad_norm"] = self._optimizer_step()
        return metrics

    @torch.no_grad()
    def update_reference(self) -> None:
        """Copy the actor's parameters and buffers into the reference model (the same layout, FSDP shards included)."""
        if self.base_is_reference:
            raise RuntimeError("update_reference: under LoRA the reference is the frozen base model")
        if keys.REF_LOG_PROBS not in self.frozen:
            raise RuntimeError("update_reference: this trainer runs no reference model (--use-kl-loss / --kl-coef)")
        reference = self.frozen[keys.REF_LOG_PROBS]
        for target, source in zip(reference.state_dict().values(), self.model.state_dict().values(), strict=True):
            target.copy_(source)

    def reset_optimizer(self) -> None:
        """Drop the actor's optimizer state, and the critic's (slime resets each model's by the same flag)."""
        self.optimizer.state.clear()
        if self.critic_optimizer is not None:
            self.critic_optimizer.state.clear()

    def get_rng_state(self) -> dict[str, Any]:
        return rng_state(self.device)

    def set_rng_state(self, state: dict[str, Any]) -> None:
        restore_rng_state(state, self.device)

    def shutdown(self) -> None:
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group()
            self.group = None
