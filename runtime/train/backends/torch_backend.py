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

This module is the trainer's construction (process group, models, optimizers) and state (the old actor, the
reference's update, RNG); its forward passes and log-prob passes are ``torch_forward``'s (with MoE routing replay
through ``torch_replay``), its optimizer steps ``torch_step``'s, the models it trains are built and wrapped (LoRA,
recompute, compile, FSDP2, the critic's value head) by ``torch_models``, slime's loss hooks adapted to its
micro-batches by ``torch_loss_hooks``, its weights sent out and checkpoints written by ``torch_export`` (through
``torch_checkpoint``), its memory released while colocated by ``torch_offload``, and its micro-batches cut by
``runtime.train.packing``. The trainer composes them as mixins; every name this module had still imports from it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from rlcore import keys
from rlcore.losses import LossConfig
from runtime.cluster.loopback import confine_collectives, is_loopback, rendezvous_store
from runtime.config import TrainConfig
from runtime.engines.hf_engine import pick_device, restore_rng_state, rng_state
from runtime.train.backends import lora
from runtime.train.backends.stateless_adam import StatelessAdamW
from runtime.train.backends.torch_export import TorchExport
from runtime.train.backends.torch_forward import ROLLOUT_ENTROPY, TorchForward, _identity  # noqa: F401
from runtime.train.backends.torch_loss_hooks import TorchLossHooks
from runtime.train.backends.torch_models import load_model, uses_bf16
from runtime.train.backends.torch_offload import TorchOffload
from runtime.train.backends.torch_replay import RouteReplay
from runtime.train.backends.torch_step import TorchStep, _host_lengths  # noqa: F401
from runtime.train.hooks import TrainHooks
from runtime.train.offload import HostOffload
from runtime.train.packing import micro_batches  # noqa: F401
from runtime.train.roles import ACTOR, CRITIC, REFERENCE, TEACHER, ModelRole

# The noqa names above: ROLLOUT_ENTROPY, _identity and _host_lengths moved with the methods that read them, and
# megatron_forward reads micro_batches from here; they all still import from this module.

# The roles this backend builds a model for; others are refused by name at construction.
SUPPORTED_ROLES = (ACTOR, REFERENCE, TEACHER, CRITIC)


class TorchTrainer(TorchForward, TorchStep, TorchLossHooks, TorchExport, TorchOffload):
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
        # Under --keep-old-actor R2 records in the pass that swaps the old actor's weights into this model.
        self.route_replay = RouteReplay(self.model) if self.hooks.routing_replay else None
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

    def _models(self) -> list[torch.nn.Module]:
        return [self.model, *self.frozen.values(), *([self.critic] if self.critic is not None else [])]

    def dp_info(self) -> tuple[int, int]:
        """Every rank is a data-parallel shard (FSDP shards parameters, not data)."""
        return self.rank, self.world_size

    def dp_group(self) -> dist.ProcessGroup | None:
        return self.group

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
