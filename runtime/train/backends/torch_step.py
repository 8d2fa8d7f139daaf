"""The optimizer steps of :class:`~runtime.train.backends.torch_backend.TorchTrainer` (methods of the trainer, as
a mixin): the loss of each micro-batch against the global batch's normalizer (slime's loss types, the fused loss in
the LM head), the backward with its float32 gradient sum, the clipped optimizer step and the metrics reduced over
ranks, for the actor (``train``), the critic (``train_critic``) and supervised steps (``sft_train``)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from rlcore import keys
from rlcore.kernels import linear_rl_loss
from rlcore.losses import Normalizer, critic_loss, rl_loss
from runtime.train.backends import lora
from runtime.train.backends.torch_models import loss_in_head
from runtime.train.batch import (
    NUCLEUS_IDS,
    ROUTED_EXPERTS,
)
from runtime.train.metrics import add_step, sums_and_maxima


def _host_lengths(mb: TensorDict) -> list[int] | None:
    """Each row's valid response tokens, counted where the micro-batch lives if that is the host (then the fused
    loss queues its work without waiting for the device); ``None`` for a batch already on the device."""
    mask = mb[keys.MASK]
    return mask.sum(-1).tolist() if mask.device.type == "cpu" else None


class TorchStep:
    """The trainer's optimizer steps: losses, backward, clipping and the step, metrics."""

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
