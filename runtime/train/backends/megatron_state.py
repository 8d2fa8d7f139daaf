"""The ``megatron`` backend's ``torch_dist`` checkpoints of a trainer: its sharded state (model, optimizer
moments, LR schedule), save and load, and the optimizer state that megatron-core's distributed optimizer cannot load
by itself without Apex or Transformer Engine."""

from __future__ import annotations

import os
from typing import Any

import torch

from runtime.train.backends import megatron_checkpoint as mck
from runtime.train.backends import megatron_critic as mcritic
from runtime.train.backends.megatron_build import _read_hf_config


def start_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's starting state (zero moments, step 0) for every parameter of ``optimizer`` that has none yet."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            slot = optimizer.state[p]
            if not slot:
                slot["step"] = torch.zeros((), dtype=torch.float32)
                slot["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                slot["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def load_distributed_optimizer(distributed: Any, state: dict[str, Any]) -> None:
    """Load a Megatron ``DistributedOptimizer``'s torch_dist state (:data:`OPTIMIZER_SHARDING`) into ``distributed``.

    megatron-core 0.16.1 with torch's Adam (no Apex or Transformer Engine, as on our GPU hosts) cannot do this in
    ``load_state_dict``: it sets Adam's per-parameter ``step`` from the param groups, then copies every state entry,
    ``step`` included, from the loaded moments, which have none (a ``KeyError``). So the common part (param groups,
    step) goes through ``load_state_dict``, and the moments and main weights are copied with ``step`` set aside. It
    also gives every parameter the same ``step`` tensor, which torch's foreach Adam would then advance once per
    parameter: each gets its own copy."""
    param_state = state.pop("param_state")
    sharding = state.pop("param_state_sharding_type")
    if sharding != OPTIMIZER_SHARDING["distrib_optim_sharding_type"]:
        raise ValueError(f"the checkpoint's distributed optimizer state is {sharding!r}, not {OPTIMIZER_SHARDING}")
    distributed.load_state_dict(state)
    inner = distributed.optimizer
    steps = {p: inner.state[p].pop("step") for group in inner.param_groups for p in group["params"]}
    try:
        distributed.load_parameter_state_from_fully_reshardable(param_state)
    finally:
        for p, step in steps.items():
            inner.state[p]["step"] = step.clone()


# How the distributed optimizer's state is laid out in a torch_dist checkpoint (megatron-core's metadata).
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}


class MegatronState:
    """Checkpoints of :class:`~runtime.train.backends.megatron_backend.MegatronTrainer` (methods of the trainer;
    every rank writes and reads its shards)."""

    def _sharded_state(self, *, with_optimizer: bool, is_loading: bool) -> dict[str, Any]:
        """The actor's sharded state dict (megatron-core's ``ShardedTensor`` s, whole-tensor names and shapes): the
        model, and the optimizer's moments under ``optimizer.state.*`` unless ``with_optimizer`` is False; the LR
        schedule, the Megatron-LM ``args`` and the HF config go to ``common.pt``."""
        model_sd = self._module(self.model).sharded_state_dict()
        state: dict[str, Any] = {
            "model": model_sd,
            "checkpoint_version": 3.0,
            "args": mck.model_args(self.shape, tp_size=self.tp, pp_size=self.pp, padded_vocab_size=self.padded_vocab),
            "hf_config": _read_hf_config(self.model_path),
        }
        if with_optimizer:
            state["opt_param_scheduler"] = self.scheduler.state_dict()
            if self.cpu:
                state["optimizer"] = self._cpu_optimizer_state(model_sd)
            else:
                # fully_reshardable: the canonical per-parameter state, so a checkpoint loads at another TP/PP/DP
                # layout (megatron-core 0.16 refuses its old default, fully_sharded_model_space, at save). An actor
                # that has not stepped yet (critic-only steps) gets AdamW's starting state first: megatron-core's
                # state_dict asserts one shared step count, and at load it builds the state it loads into from it.
                self._start_optimizer_state()
                state["optimizer"] = self.optimizer.sharded_state_dict(
                    model_sd, is_loading=is_loading, metadata=OPTIMIZER_SHARDING
                )
        return state

    def _cpu_optimizer_state(self, model_sd: dict[str, Any], optimizer: Any = None) -> dict[str, Any]:
        """The CPU AdamW's state (``optimizer``, the actor's by default) as shards of the parameters' layout
        (Megatron's ``optimizer.state.exp_avg.*`` names), its step count once (``common_step``). Parameters without
        state yet get zero moments at step 0, which is what AdamW starts from."""
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        optimizer = self.optimizer if optimizer is None else optimizer
        params = [p for group in optimizer.param_groups for p in group["params"]]
        start_adam_state(optimizer)
        state = optimizer.state_dict()
        step = max((float(slot["step"]) for slot in state["state"].values()), default=0.0)
        optim_state_to_sharding_state(
            state, get_param_id_to_sharded_param_map(model_sd, params), exclude_keys=("step",)
        )
        state["common_step"] = step
        return state

    def save(self, path: str, *, with_optimizer: bool = True) -> None:
        """A Megatron ``torch_dist`` checkpoint in the folder ``path`` (megatron-core's ``dist_checkpointing``; every
        rank writes its shards, DP replicas once): the model, the optimizer's state and the LR schedule (unless
        ``with_optimizer`` is False), and beside it each rank's RNG state (``rng_rank{r}.pt``). It loads at another
        TP/PP layout, and slime's ``convert_torch_dist_to_hf.py`` reads it."""
        with self._shims():
            mck.save_sharded(self._sharded_state(with_optimizer=with_optimizer, is_loading=False), path)
            if self.critic is not None:
                self.critic.save(os.path.join(path, mcritic.CRITIC_DIR), with_optimizer=with_optimizer)
        torch.save(self.get_rng_state(), os.path.join(path, f"rng_rank{self.rank}.pt"))

    def save_model(self, path: str) -> None:
        """The actor's weights alone as a ``torch_dist`` folder (no optimizer, no RNG): the converter's output."""
        with self._shims():
            mck.save_sharded(self._sharded_state(with_optimizer=False, is_loading=False), path)

    def load(self, path: str) -> None:
        """Restore a ``torch_dist`` checkpoint: :meth:`save`'s folder, a Megatron-LM save root (its
        ``latest_checkpointed_iteration.txt``) or one of slime's. The optimizer and LR schedule come back when the
        checkpoint has them (otherwise they keep their state), the RNG when this rank's file is there."""
        from megatron.core import dist_checkpointing

        folder = mck.find_checkpoint(path)
        if folder is None:
            raise ValueError(f"{path} is no Megatron torch_dist checkpoint (no metadata.json, no {mck.TRACKER})")
        saved = dist_checkpointing.load_tensors_metadata(str(folder))
        with_optimizer = any(mck.is_optimizer_key(key) for key in saved)
        with self._shims():
            state = mck.load_sharded(
                self._sharded_state(with_optimizer=with_optimizer, is_loading=True),
                folder,
                vocab_size=self.shape.vocab_size,
            )
            self._module(self.model).load_state_dict(state["model"], strict=True)
            if with_optimizer:
                self._load_optimizer(state["optimizer"])
                if "opt_param_scheduler" in state:
                    self.scheduler.load_state_dict(state["opt_param_scheduler"])
            elif not self.cpu:
                self.optimizer.reload_model_params()  # the float32 main weights from the loaded ones
            if self.critic is not None:
                self.critic.load(os.path.join(folder, mcritic.CRITIC_DIR))
        rng_path = os.path.join(folder, f"rng_rank{self.rank}.pt")
        if os.path.exists(rng_path):
            self.set_rng_state(torch.load(rng_path, weights_only=False))

    def _start_optimizer_state(self, optimizer: Any = None) -> None:
        """Give every main-weight shard of an optimizer (the actor's by default) that has not stepped yet AdamW's
        starting state (zero moments, step 0). Megatron's distributed optimizer builds the state dict it loads into
        from its current one, and without Apex or Transformer Engine (torch's Adam) it requires one step count shared
        by all parameters."""
        optimizer = self.optimizer if optimizer is None else optimizer
        for distributed in getattr(optimizer, "chained_optimizers", [optimizer]):
            start_adam_state(distributed.optimizer)

    def _load_optimizer(self, state: dict[str, Any], optimizer: Any = None) -> None:
        """Load ``state`` (:meth:`_sharded_state`'s optimizer part) into ``optimizer``, the actor's by default."""
        optimizer = self.optimizer if optimizer is None else optimizer
        if not self.cpu:
            chained = getattr(optimizer, "chained_optimizers", [optimizer])
            parts = [state] if len(chained) == 1 else [v for _, v in sorted(state.items())]
            for distributed, part in zip(chained, parts, strict=True):
                load_distributed_optimizer(distributed, part)
            return
        step = torch.tensor(float(state.pop("common_step")), dtype=torch.float32)
        for slot in state["state"].values():
            slot["step"] = step.clone()
        optimizer.load_state_dict(state)
