"""The ``megatron`` backend's forward passes: micro-batches (by rows, or by real tokens under
``--use-dynamic-batch-size``), the model's inputs, the vocab-parallel logits to response log-probs, and the runs over
micro-batches with or without Megatron's pipeline schedule."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from rlcore.kernels import logprobs_entropy
from runtime.train.backends import megatron_moe as mmoe
from runtime.train.backends.megatron_build import sequence_parallel
from runtime.train.backends.torch_backend import micro_batches
from runtime.train.batch import PROMPT_LENGTHS, RESPONSE_LENGTHS, RESPONSE_TOKENS, TOKENS
from runtime.train.packing import min_micro_batches, pack_by_tokens, token_budget


class MegatronForward:
    """Forward (and backward) runs of :class:`~runtime.train.backends.megatron_backend.MegatronTrainer` over
    micro-batches (methods of the trainer)."""

    def _logits(self, model: torch.nn.Module, mb: TensorDict) -> torch.Tensor:
        """``[b, width, V / TP]``: this rank's vocab shard of the logits of micro-batch ``mb`` (last stage only), in
        the model's dtype: under bf16 Megatron's ``Float16Module`` would copy them to float32, which
        :func:`rlcore.kernels.logprobs_entropy` does not need (it accumulates in float32)."""
        tokens, positions, mask = self._inputs(mb)
        extra = {"fp32_output": False} if self.bf16 else {}
        if self.shape.moe is not None:
            # The rows' right padding stays out of the routers' balancing loss and expert-bias counts.
            seq_lens = (mb[PROMPT_LENGTHS] + mb[RESPONSE_LENGTHS]).to(self.device)
            extra["padding_mask"] = mmoe.padding_mask(seq_lens, tokens.shape[1])
        self._replay_before(model, mb, tokens.shape[1])  # routing replay: the actor's routers take mb's routes
        output = model(input_ids=tokens, position_ids=positions, attention_mask=mask, **extra)
        self._replay_after(model, output, mb)
        return output

    def _inputs(self, mb: TensorDict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        seq_lens = mb[PROMPT_LENGTHS] + mb[RESPONSE_LENGTHS]
        width = int(seq_lens.max())
        if sequence_parallel(self.cfg) and width % self.tp:
            width += self.tp - width % self.tp  # the sequence splits evenly over TP ranks
        tokens = mb[TOKENS][:, :width].to(self.device)
        if tokens.shape[1] < width:
            tokens = torch.nn.functional.pad(tokens, (0, width - tokens.shape[1]))
        positions = torch.arange(width, device=self.device)[None, :].expand(tokens.shape[0], -1)
        from runtime.train.backends.megatron_attention import causal_attention_mask

        mask = causal_attention_mask(width, attention_backend=self.cfg.attention_backend, device=self.device)
        return tokens, positions, mask

    def _response_log_probs(
        self, logits: torch.Tensor, mb: TensorDict, *, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Response-aligned ``(log_probs [b, T], entropy [b, T] or None)`` from this rank's logits shard ``[b, width,
        V / TP]``: the kernel runs over every position of the logits in place (each response token the target at the
        position before it, any valid id elsewhere), and the response's positions are picked from its ``[b, width]``
        results. Picking the response's logits first would copy ``[b, T, V]`` of them forward and scatter their
        gradient into a zeroed ``[b, width, V]`` backward (on four H200s, Qwen3's 151936-token vocabulary at 8 x 4096
        tokens: 10 GB each way a micro-batch); the kernel's rows are independent, so the picked values are the
        same."""
        response = mb[RESPONSE_TOKENS].to(self.device)
        rows, width, local = logits.shape
        if response.shape[1] == 0:  # batches are at least one response token wide (runtime.train.batch); still
            empty = logits.new_zeros(rows, 0, dtype=torch.float32)
            return empty, (empty if with_entropy else None)
        offsets = torch.arange(response.shape[1], device=self.device)
        # Past a row's width a position is clamped to the last one: padding, masked downstream.
        positions = (mb[PROMPT_LENGTHS].to(self.device)[:, None] - 1 + offsets).clamp(max=width - 1)
        # Position p's target: response token p - (prompt length - 1) where there is one, else token 0.
        index = torch.arange(width, device=self.device) - positions[:, :1]
        inside = (index >= 0) & (index < response.shape[1])
        targets = torch.where(inside, response.gather(1, index.clamp(0, response.shape[1] - 1)), 0)
        start = self.tp_rank * local
        if start + local > self.shape.vocab_size:
            # Megatron's padded vocabulary rows are not tokens: they take no probability. Filled in place (a copy
            # would be as large as the logits) and through ``.data``, unseen by autograd: no backward reads the
            # padded columns' old values (the output layer's saves its input, not its logits), and under
            # --recompute-loss-function the checkpoint recomputes this function on its input, which a visible
            # in-place change would make a version error (the fill is idempotent, so the recompute is the same).
            logits.data[..., max(self.shape.vocab_size - start, 0) :] = float("-inf")
        log_probs, entropy = logprobs_entropy(
            logits.reshape(rows * width, local),
            targets.reshape(-1),
            temperature=self.temperature,
            with_entropy=with_entropy,
            group=self.tp_group,
        )
        log_probs = log_probs.view(rows, width).gather(1, positions)
        return log_probs, (entropy.view(rows, width).gather(1, positions) if entropy is not None else None)

    def _micro_batches(self, td: TensorDict, *, log_probs: bool = False) -> list[TensorDict]:
        """``td``'s rows in micro-batches, each right-padded to its own longest row by :meth:`_inputs`: grouped by
        real tokens with ``--use-dynamic-batch-size`` (:meth:`_token_groups`: rows regrouped), else consecutive rows
        by ``--micro-batch-size`` or the rows x longest budget (:func:`runtime.train.packing.token_budget`;
        ``log_probs``: a log-prob pass's)."""
        if self.cfg.use_dynamic_batch_size:
            return [td[torch.tensor(rows)] for rows in self._token_groups(td, log_probs=log_probs)]
        return micro_batches(
            td, micro_batch_size=self.cfg.micro_batch_size, max_tokens=token_budget(self.cfg, log_probs=log_probs)
        )

    def _log_prob_parts(self, td: TensorDict) -> tuple[list[TensorDict], list[list[int]] | None]:
        """The micro-batches of a no-gradient pass over ``td``, and their rows for
        :func:`runtime.train.packing.in_row_order` to undo ``--use-dynamic-batch-size``'s regrouping on their
        concatenated outputs (``None``: consecutive rows)."""
        if not self.cfg.use_dynamic_batch_size:
            return self._micro_batches(td, log_probs=True), None
        groups = self._token_groups(td, log_probs=True)
        return [td[torch.tensor(rows)] for rows in groups], groups

    def _token_groups(self, td: TensorDict, *, log_probs: bool) -> list[list[int]]:
        """Row indices of ``td``'s micro-batches under ``--use-dynamic-batch-size``, at most the budget's real tokens
        each (:func:`runtime.train.packing.pack_by_tokens`). As slime, every DP rank runs as many micro-batches: the
        most any rank needs (first fit), over which each rank balances its rows. A rank with fewer rows than that
        count (uneven shards of multi-row rollouts) runs one per row; that is harmless, since gradients are reduced
        once per step, in or after each rank's own last micro-batch (Megatron's DDP, bucket by bucket in the same
        order on every rank under --overlap-grad-reduce, and the CPU path alike), and the
        stages of one pipeline share their rows and so their count."""
        budget = token_budget(self.cfg, log_probs=log_probs)
        if budget is None:
            raise ValueError("--use-dynamic-batch-size groups micro-batches by --max-tokens-per-gpu: set it")
        lengths = (td[PROMPT_LENGTHS] + td[RESPONSE_LENGTHS]).tolist()
        count = self._dp_max(min_micro_batches(lengths, max_tokens=budget))
        while True:
            groups = pack_by_tokens(lengths, max_tokens=budget, at_least=count)
            # Balancing can open a micro-batch that first fit did not need: agree on the count again.
            most = self._dp_max(len(groups))
            if most == count:
                return groups
            count = most

    def _dp_max(self, value: int) -> int:
        group = self.dp_group()
        if group is None:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return int(t)

    def _run(
        self, model: torch.nn.Module, parts: list[TensorDict], *, forward_only: bool, loss_fn: Any = None
    ) -> list[dict[str, torch.Tensor]]:
        """Forward (and backward unless ``forward_only``) over micro-batches ``parts``; each micro-batch's outputs
        (``log_probs`` when ``loss_fn`` is None, else ``loss_fn``'s metrics) on every rank of the pipeline."""
        lockstep = self._lockstep(forward_only=forward_only)
        if lockstep is not None:
            most, least = self._dp_max(len(parts)), -self._dp_max(-len(parts))
            if most != least:
                flag, what = lockstep
                raise ValueError(
                    f"{flag}: the data-parallel ranks' shards split into {least} to {most} micro-batches; {what} "
                    "needs one count (give every rank as many rows, or --use-dynamic-batch-size, which agrees on the "
                    "count)"
                )
        if not forward_only and self.shape.moe is not None:
            # The balancing loss's gradient: the micro-batches' mean (Megatron's pipeline schedules set it so, into
            # this tensor, over stages).
            mmoe.set_aux_loss_scale(1.0 / len(parts), device=self.device)
        if self.pp == 1:
            results = []
            no_sync = getattr(model, "no_sync", contextlib.nullcontext)  # Megatron's DDP (GPUs, a trained model)
            for i, mb in enumerate(parts):
                with no_sync() if i < len(parts) - 1 else contextlib.nullcontext():
                    logits = self._logits(model, mb)
                    results.append(self._finish(logits, mb, forward_only=forward_only, loss_fn=loss_fn))
            return results
        return self._run_pipeline(model, parts, forward_only=forward_only, loss_fn=loss_fn)

    def _lockstep(self, *, forward_only: bool) -> tuple[str, str] | None:
        """``(the flag, what it runs)`` where every data-parallel rank must run as many micro-batches, each MoE
        layer's forward (and backward) holding a collective over them, which a rank with more would wait in forever:
        expert parallelism's token alltoall; global_aux_loss's token counts, all-reduced in each router's training
        forward. None where the ranks may differ."""
        if self.ep > 1:
            return f"--expert-model-parallel-size {self.ep}", "expert parallelism"
        balancing = self.cfg.moe_router_load_balancing_type
        spec = mmoe.AUX_LOSS_KINDS.get(balancing)
        counts_over_dp = spec is not None and spec.shares_over_dp and self.cfg.moe_aux_loss_coeff > 0
        if counts_over_dp and self.shape.moe is not None and self.dp_size > 1 and not forward_only:
            return f"--moe-router-load-balancing-type {balancing}", "its token count over the ranks"
        return None

    def _finish(
        self, logits: torch.Tensor, mb: TensorDict, *, forward_only: bool, loss_fn: Any
    ) -> dict[str, torch.Tensor]:
        if loss_fn is None:
            log_probs, _ = self._response_log_probs(logits, mb, with_entropy=False)
            return {"log_probs": log_probs.detach()}
        loss, metrics = self._loss(loss_fn, logits, mb)
        if not forward_only:
            # Each DP rank's loss is its share of the global batch's (a global Normalizer): gradients must add up
            # over DP ranks, and Megatron's DDP averages them (the CPU path too: _optimizer_step).
            (loss * self.dp_size).backward()
        return metrics

    def _run_pipeline(
        self, model: torch.nn.Module, parts: list[TensorDict], *, forward_only: bool, loss_fn: Any
    ) -> list[dict[str, torch.Tensor]]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        count = len(parts)

        def step(data: Iterator[TensorDict], chunk: torch.nn.Module) -> tuple[torch.Tensor, Any]:
            mb = next(data)
            output = self._logits(chunk, mb)

            def reduce(logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
                if loss_fn is None:
                    log_probs, _ = self._response_log_probs(logits, mb, with_entropy=False)
                    return logits.new_zeros(()), {"log_probs": log_probs.detach()}
                loss, metrics = self._loss(loss_fn, logits, mb)
                # The schedule divides by the micro-batch count; the loss is already this one's global share.
                return loss * count * self.dp_size, metrics

            return output, reduce

        width = max(int((mb[PROMPT_LENGTHS] + mb[RESPONSE_LENGTHS]).max()) for mb in parts)
        results = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter(parts),
            model=[model],
            num_microbatches=count,
            seq_length=width,
            micro_batch_size=max(mb.batch_size[0] for mb in parts),
            forward_only=forward_only,
        )
        return self._from_last_stage(results, parts, loss_fn)

    def _from_last_stage(
        self, results: list[dict[str, torch.Tensor]], parts: list[TensorDict], loss_fn: Any
    ) -> list[dict[str, torch.Tensor]]:
        """The last stage's per-micro-batch outputs, broadcast to every stage of the pipeline."""
        group = self.ps.get_pipeline_model_parallel_group()
        src = self.ps.get_pipeline_model_parallel_last_rank()
        out = []
        for i, mb in enumerate(parts):
            if loss_fn is None:
                value = results[i]["log_probs"] if self.last_stage else None
                buffer = value if value is not None else torch.empty(mb[RESPONSE_TOKENS].shape, device=self.device)
                dist.broadcast(buffer, src=src, group=group)
                out.append({"log_probs": buffer})
            else:
                names = sorted(results[i]) if self.last_stage else None
                holder = [names]
                dist.broadcast_object_list(holder, src=src, group=group)
                names = holder[0]
                values = (
                    torch.stack([results[i][n].float().reshape(()) for n in names])
                    if self.last_stage
                    else torch.empty(len(names), device=self.device)
                )
                dist.broadcast(values, src=src, group=group)
                out.append(dict(zip(names, values, strict=True)))
        return out

    def _loss(self, loss_fn: Any, logits: torch.Tensor, mb: TensorDict) -> tuple[torch.Tensor, Any]:
        """``loss_fn(logits, mb)``; with ``--recompute-loss-function`` under activation checkpointing (slime's), so
        that backward keeps only the logits and recomputes the loss's intermediates (the float32 softmax over the
        vocabulary among them): the same operations on the same inputs, so the same loss and gradients."""
        if not self.cfg.recompute_loss_function or not torch.is_grad_enabled():
            return loss_fn(logits, mb)
        from torch.utils.checkpoint import checkpoint

        return checkpoint(loss_fn, logits, mb, use_reentrant=False)
