"""The ``megatron`` backend's training steps: the RL and SFT losses over the global batch's
:class:`~rlcore.losses.Normalizer`, the optimizer step (gradient reduction over DP and experts, clipping, the LR
schedule) and the step's metrics reduced over DP ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from rlcore import keys
from rlcore.losses import Normalizer, aggregate, rl_loss, sft_loss
from runtime.train.backends import megatron_moe as mmoe
from runtime.train.metrics import add_step, sums_and_maxima


def sums_over_tensor_parallel(name: str, param: torch.nn.Parameter, *, config: Any) -> bool:
    """Whether the gradient of the TP-replicated parameter ``name`` is a share to be summed over the tensor-parallel
    ranks, as megatron-core 0.16.1's ``finalize_model_grads`` (``_allreduce_non_tensor_model_parallel_grads``) decides
    on GPUs: under ``config.sequence_parallel`` a parameter marked ``sequence_parallel`` (it saw this rank's chunk of
    the sequence: the norms between sublayers, the routers, row-parallel biases), and under ``config.qk_layernorm``
    the per-head QK-norms (each rank normalises its own heads with the shared weight)."""
    chunk = bool(config.sequence_parallel and getattr(param, "sequence_parallel", False))
    return chunk or bool(config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name))


class MegatronSteps:
    """The training steps of :class:`~runtime.train.backends.megatron_backend.MegatronTrainer` (methods of the
    trainer)."""

    def _global_normalizer(self, parts: list[TensorDict]) -> Normalizer:
        norm = sum(Normalizer.of(mb[keys.MASK].to(self.device)) for mb in parts)
        return norm.reduce(self.dp_group())

    def _rl_loss(self, norm: Normalizer) -> Any:
        def loss_fn(logits: torch.Tensor, mb: TensorDict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            log_probs, entropy = self._response_log_probs(logits, mb, with_entropy=True)
            batch = mb.to(self.device, non_blocking=False).clone(recurse=False)
            batch.set(keys.LOG_PROBS, log_probs)
            batch.set(keys.ENTROPY, entropy)
            loss, metrics = rl_loss(batch, self.loss_cfg, norm=norm)
            return loss, {name: value.detach() for name, value in metrics.items()}

        return loss_fn

    def train_critic(self, td: TensorDict, *, per_step_rows: int) -> dict[str, float]:
        """Optimizer steps of the critic over this rank's shard ``td`` (:meth:`MegatronCritic.train`)."""
        self._check_resident()
        if self.critic is None:
            raise RuntimeError("train_critic: this trainer runs no critic (--advantage-estimator ppo)")
        with self._shims():
            return self.critic.train(td, per_step_rows=per_step_rows)

    def advance_old_actor(self) -> None:
        """Not built for this backend: ``--keep-old-actor`` is refused at validation."""
        raise RuntimeError("advance_old_actor: --keep-old-actor is built for the torch backend only")

    def train(self, td: TensorDict, *, per_step_rows: int, rollout_id: int | None = None) -> dict[str, float]:
        """Optimizer steps over this rank's shard ``td``, ``per_step_rows`` rows each; metrics of the global batches
        (token means summed over micro-batches and DP ranks, maxima as maxima), ``grad_norm``, ``lr`` and
        ``num_steps``. Rollouts split into rows of varying counts per step (a custom generate function's fan-out)
        are not built here: ``per_step_rows`` must be one count."""
        self._check_resident()
        if not isinstance(per_step_rows, int):
            raise ValueError(
                "--train-backend megatron: rollouts split into several samples (a custom generate function "
                "returning lists) are built for the torch backend only"
            )
        n = td.batch_size[0]
        if n % per_step_rows:
            raise ValueError(f"shard of {n} rows is not a whole number of steps of {per_step_rows} rows")
        steps = n // per_step_rows
        totals: dict[str, float] = {}
        with self._shims(), self._replay_pass("train"):
            for step in range(steps):
                self._call_hook(
                    "custom_megatron_before_train_step_hook_path",
                    rollout_id,
                    step,
                    self.model,
                    self.optimizer,
                    self.scheduler,
                )
                part = td[step * per_step_rows : (step + 1) * per_step_rows]
                parts = self._micro_batches(part)
                norm = self._global_normalizer(parts)
                if self.hooks.loss_type == "sft_loss":  # slime's --loss-type sft_loss
                    loss_fn = self._sft_loss(norm, mode=self.loss_cfg.loss_agg_mode)
                else:
                    loss_fn = self._rl_loss(norm)
                add_step(totals, self._step(parts, loss_fn), steps=steps)
        totals["num_steps"] = steps
        return totals

    def _step(self, parts: list[TensorDict], loss_fn: Any) -> dict[str, float]:
        """One optimizer step over micro-batches ``parts`` with ``loss_fn``; the step's reduced metrics."""
        self._zero_grad()
        moe_aux = self.shape.moe is not None and self.cfg.moe_aux_loss_coeff > 0
        if moe_aux:
            mmoe.clear_aux_loss()
        sums, maxes = sums_and_maxima(self._train_run(self.model, parts, loss_fn))
        if moe_aux:
            sums["moe_aux_loss"] = self._moe_aux_loss(len(parts))
        out = {**self._all_reduce(sums, dist.ReduceOp.SUM), **self._all_reduce(maxes, dist.ReduceOp.MAX)}
        out["grad_norm"] = self._optimizer_step()
        out["lr"] = float(self.optimizer.param_groups[0]["lr"])
        return out

    def _train_run(
        self, model: torch.nn.Module, parts: list[TensorDict], loss_fn: Any
    ) -> list[dict[str, torch.Tensor]]:
        """:meth:`_run` with the backward, ``model`` (the actor or the critic) in training mode for it: Megatron
        recomputes activations (--recompute-granularity) in training mode only; with no dropout the forward is the
        same in either mode."""
        model.train()
        try:
            return self._run(model, parts, forward_only=False, loss_fn=loss_fn)
        finally:
            model.eval()

    def _moe_aux_loss(self, micro_batches: int) -> float:
        """This rank's share of the step's ``moe_aux_loss`` metric, a sum like the loss's token means: the balancing
        loss the step added (:func:`megatron_moe.recorded_aux_loss`: --moe-aux-loss-coeff x the sum over MoE layers of
        the micro-batches' mean) over the data-parallel size, so that the sum over DP ranks is their mean
        (``global_aux_loss``: as it is, each rank's value a share of the global batch's loss)."""
        groups = [self.ps.get_tensor_and_context_parallel_group(), self.ps.get_pipeline_model_parallel_group()]
        value = mmoe.recorded_aux_loss(
            self.cfg.moe_aux_loss_coeff, micro_batches=micro_batches, groups=groups, device=self.device
        )
        kind = self.cfg.moe_router_load_balancing_type
        return mmoe.aux_loss_metric_share(kind, float(value), dp_size=self.dp_size)

    def _all_reduce(self, values: dict[str, float], op: dist.ReduceOp) -> dict[str, float]:
        group = self.dp_group()
        if group is None or not values:
            return values
        names = sorted(values)
        t = torch.tensor([values[k] for k in names], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op, group=group)
        return dict(zip(names, t.tolist(), strict=True))

    def _zero_grad(self, model: torch.nn.Module | None = None, optimizer: Any = None) -> None:
        """Zero the gradients of ``model`` and ``optimizer`` (the actor's by default)."""
        model = self.model if model is None else model
        optimizer = self.optimizer if optimizer is None else optimizer
        if self.cpu:
            optimizer.zero_grad(set_to_none=True)
        else:
            model.zero_grad_buffer()
            optimizer.zero_grad()

    def _optimizer_step(
        self, model: torch.nn.Module | None = None, optimizer: Any = None, scheduler: Any = None
    ) -> float:
        """Reduce, clip and apply the gradients of ``model`` with ``optimizer`` and ``scheduler`` (the actor's by
        default); the gradient norm before clipping."""
        model = self.model if model is None else model
        optimizer = self.optimizer if optimizer is None else optimizer
        scheduler = self.scheduler if scheduler is None else scheduler
        if not self.cpu:
            from megatron.core.distributed import finalize_model_grads

            finalize_model_grads([model])
            _, grad_norm, _ = optimizer.step()
            scheduler.step(increment=1)
            return float(grad_norm)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        group = self.dp_group()
        config = self._module(model).config
        # An expert's gradient holds every rank's tokens routed to it (the dispatcher's backward sends them home):
        # its replicas are the expert-data-parallel group's, the ranks that hold the same experts (fewer than DP by
        # EP; the TP ranks too, whose sequence chunks reach whole experts under sequence parallelism). Megatron's
        # DDP sums there and scales by 1 / DP alike.
        expert_group = self.ps.get_expert_data_parallel_group()
        for name, p in named:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if getattr(p, "shared_embedding", False) and self.pp > 1:
                # Tied embeddings over stages: the first stage's embedding and the last stage's copy of it as the
                # output layer take the sum of both gradients (finalize_model_grads' word-embedding all-reduce).
                dist.all_reduce(p.grad, group=self.ps.get_embedding_group())
            if self.tp > 1 and sums_over_tensor_parallel(name, p, config=config):
                dist.all_reduce(p.grad, group=self.tp_group)
            replicas = expert_group if mmoe.is_expert(name) else group
            if replicas is not None and dist.get_world_size(replicas) > 1:
                dist.all_reduce(p.grad, group=replicas)
            if group is not None:
                # The mean over DP ranks, as Megatron's DDP takes it: each rank's loss was scaled by the DP size.
                p.grad.div_(self.dp_size)
        grad_norm = self._grad_norm(params, experts={id(p) for n, p in named if mmoe.is_expert(n)})
        if self.cfg.clip_grad > 0 and grad_norm > self.cfg.clip_grad:
            for p in params:
                p.grad.mul_(self.cfg.clip_grad / (grad_norm + 1e-6))
        optimizer.step()
        scheduler.step(increment=1)
        if self.shape.moe is not None and self.shape.moe.expert_bias:
            # The routers' expert-bias step towards balanced loads, which finalize_model_grads takes on GPUs.
            mmoe.update_expert_bias(self._module(model))
        elif self.shape.moe is not None:
            mmoe.reset_step_counts(self._module(model))  # global_aux_loss's running counts, as on GPUs
        return grad_norm

    def _grad_norm(
        self, params: list[torch.nn.Parameter], *, experts: frozenset[int] | set[int] = frozenset()
    ) -> float:
        """The global gradient norm: TP shards counted once each, TP-replicated tensors (norms) once, and the
        experts (``experts``: their ids; whole on each TP rank) of every expert-parallel rank once each."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        square = torch.zeros((), dtype=torch.float64, device=self.device)
        expert_square = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in params:
            if id(p) in experts:
                expert_square += p.grad.double().pow(2).sum()
            elif param_is_not_tensor_parallel_duplicate(p) and not getattr(p, "shared", False):
                # (A tied output layer's copy on the last stage is counted once, on the first: Megatron's norm.)
                square += p.grad.double().pow(2).sum()
        if self.world_size > 1:
            dist.all_reduce(square, group=self.ps.get_model_parallel_group())
            if self.shape.moe is not None:
                # Every rank of a MoE model, also a pipeline stage of dense layers only (no experts of its own, 0),
                # which would otherwise leave the stages with experts waiting in this all-reduce.
                dist.all_reduce(expert_square, group=self.ps.get_expert_tensor_model_pipeline_parallel_group())
        return float((square + expert_square).sqrt())

    def sft_train(self, td: TensorDict) -> dict[str, float]:
        """One supervised step: the negative log-likelihood of the response tokens."""
        self._check_resident()
        parts = self._micro_batches(td)
        with self._shims():
            metrics = self._step(parts, self._sft_loss(self._global_normalizer(parts), mode="token_mean"))
        return {"sft_loss": metrics["loss"], "grad_norm": metrics["grad_norm"]}

    def _sft_loss(self, norm: Normalizer, *, mode: str) -> Any:
        """The NLL of the loss-masked response tokens, aggregated with ``mode`` over the global batch's ``norm``."""

        def loss_fn(logits: torch.Tensor, mb: TensorDict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            log_probs, _ = self._response_log_probs(logits, mb, with_entropy=False)
            mask = mb[keys.MASK].to(self.device)
            loss = aggregate(sft_loss(log_probs, mask=mask), mask, mode=mode, norm=norm)
            return loss, {"loss": loss.detach()}

        return loss_fn


__all__ = ["MegatronSteps", "sums_over_tensor_parallel"]
