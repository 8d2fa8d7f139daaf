"""The ``torch`` training backend: a transformers causal LM trained with AdamW, sharded with FSDP2 across processes.

One :class:`TorchTrainer` runs per data-parallel rank (a Ray actor, see ``runtime.cluster.placement``). Ranks form a
``torch.distributed`` group (gloo on the CPU, NCCL on GPUs) and the model's decoder layers and root are wrapped with
``torch.distributed.fsdp.fully_shard``; with one rank the model is used as is.

The loss of an optimizer step is the loss of its whole global batch: every micro-batch is aggregated with a
:class:`rlcore.losses.Normalizer` of the global batch (summed over micro-batches and reduced over ranks), so its
gradients add up to the global batch's (FSDP averages over ranks, so each rank scales its loss by the world size).
Log-probs and entropies come from :func:`rlcore.kernels.logprobs_entropy` at the rollout temperature. On one
process, with the LM head a plain linear layer, the LM head is never applied to all positions: the model body gives
the final hidden states, the response positions are picked from them, and :func:`rlcore.kernels.linear_rl_loss`
computes the loss inside the LM head (:func:`rlcore.kernels.linear_logprobs_entropy` for the old and reference
recompute). Under FSDP2 (root-level parameters are unsharded only inside the root module's forward) and with a LoRA
adapter on the LM head, the full logits of each micro-batch are still materialised.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.constants import default_pg_timeout

from rlcore import keys
from rlcore.kernels import linear_logprobs_entropy, linear_rl_loss, logprobs_entropy
from rlcore.losses import LossConfig, Normalizer, aggregate, rl_loss, sft_loss
from runtime.cluster.loopback import confine_collectives, is_loopback, rendezvous_store
from runtime.config import TrainConfig
from runtime.engines.hf_engine import load_untied_state_dict, pick_device, restore_rng_state, rng_state
from runtime.train.backends import lora
from runtime.train.batch import PROMPT_LENGTHS, RESPONSE_LENGTHS, RESPONSE_TOKENS, TOKENS
from runtime.train.roles import ACTOR, REFERENCE, TEACHER, ModelRole

# The roles this backend builds a model for; others (the critic) are refused by name at construction.
SUPPORTED_ROLES = (ACTOR, REFERENCE, TEACHER)


def _is_max_metric(name: str) -> bool:
    """rl_loss's maxima over tokens (``*_max``) combine over micro-batches and ranks by max; its means by sum."""
    return name.endswith("_max")


def micro_batches(td: TensorDict, *, micro_batch_size: int, max_tokens: int | None) -> list[TensorDict]:
    """Cut ``td`` (rows in order) into micro-batches.

    With ``max_tokens`` rows are packed greedily while ``rows x longest sequence`` stays within the budget (the
    padded size the forward pass really costs); otherwise ``micro_batch_size`` rows each.
    """
    n = td.batch_size[0]
    if max_tokens is None:
        return [td[i : i + micro_batch_size] for i in range(0, n, micro_batch_size)]
    lengths = (td[PROMPT_LENGTHS] + td[RESPONSE_LENGTHS]).tolist()
    out, start, longest = [], 0, 0
    for i, length in enumerate(lengths):
        if length > max_tokens:
            raise ValueError(f"sample {i} has {length} tokens, over --max-tokens-per-gpu {max_tokens}")
        longest_with = max(longest, length)
        if i > start and (i - start + 1) * longest_with > max_tokens:
            out.append(td[start:i])
            start, longest_with = i, length
        longest = longest_with
    out.append(td[start:n])
    return out


def _uses_bf16(setting: str, device: torch.device) -> bool:
    if setting == "true":
        return True
    if setting == "false":
        return False
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def _trained_only_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Frozen parameters (a LoRA run's base model) are not checkpointed: they are the --hf-checkpoint's. strict=False
    # lets set_state_dict leave them as they are.
    return StateDictOptions(ignore_frozen_params=True, strict=False)


_TRAINED_ONLY = _trained_only_options()


class TorchTrainer:
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
    ):
        from transformers import AutoModelForCausalLM

        unsupported = [role.name for role in roles if role not in SUPPORTED_ROLES]
        if unsupported or ACTOR not in roles:
            raise ValueError(
                f"the torch backend runs the roles {[r.name for r in SUPPORTED_ROLES]} (the actor always); "
                f"asked for {[r.name for r in roles]}"
            )
        self.cfg = train_cfg
        self.loss_cfg = loss_cfg
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
        self.bf16 = _uses_bf16(train_cfg.bf16, self.device)
        self.model = self._load(AutoModelForCausalLM, trainable=True)
        self.lora = lora.is_lora(self.model)
        paths = dict(role_paths or {})
        # Frozen roles by the key they write (the reference's ref_log_probs). Under LoRA the reference is the actor
        # with its adapters disabled, not a second copy (unless --ref-load names another model).
        self.base_is_reference = self.lora and REFERENCE in roles and REFERENCE.name not in paths
        self.frozen = {
            role.writes: self._load(AutoModelForCausalLM, trainable=False, path=paths.get(role.name))
            for role in roles
            if role != ACTOR and not (self.base_is_reference and role == REFERENCE)
        }
        for role in roles:
            other = self.frozen.get(role.writes)
            if role != ACTOR and other is not None and other.config.vocab_size != self.model.config.vocab_size:
                raise ValueError(
                    f"the {role.name} model {paths.get(role.name, model_path)!r} has a vocabulary of "
                    f"{other.config.vocab_size}, the actor {self.model.config.vocab_size}: they must share a tokenizer"
                )
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=train_cfg.lr,
            weight_decay=train_cfg.weight_decay,
        )
        self.released = False

    def _load(self, auto_cls: Any, *, trainable: bool, path: str | None = None) -> torch.nn.Module:
        model = auto_cls.from_pretrained(path or self.model_path, dtype=torch.float32)
        if not trainable:
            model.requires_grad_(False)
        elif self.cfg.lora_rank > 0:
            # The adapters' random init must be the same on every rank (FSDP2 keeps each rank's own part of its own
            # tensor): drawn on the CPU from the job's seed, not the rank's stream.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                model = lora.wrap_lora(
                    model,
                    rank=self.cfg.lora_rank,
                    alpha=self.cfg.lora_alpha,
                    dropout=self.cfg.lora_dropout,
                    target_modules=self.cfg.lora_target_modules,
                )
        model.to(self.device)
        if self.world_size > 1:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if self.bf16 else None
            kwargs = {"mp_policy": mp} if mp is not None else {}
            block_names = set(getattr(model, "_no_split_modules", None) or ())
            for module in model.modules():
                if type(module).__name__ in block_names:
                    fully_shard(module, **kwargs)
            fully_shard(model, **kwargs)
        # Training stays in eval mode: dropout on in train() but off when old log-probs are recomputed would make
        # the on-policy ratio differ from 1 (RL trainers disable dropout for the same reason).
        model.eval()
        return model

    def _autocast(self):
        if self.bf16 and self.world_size == 1:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def _backward(self, loss: torch.Tensor, *, real: bool) -> None:
        # Each rank's loss is its share of the global batch's loss (a global Normalizer), so gradients must add up
        # over ranks; FSDP averages them (and gloo has no pre-scaled sum), hence the factor world_size.
        (loss * (self.world_size if real else 0.0)).backward()

    def _forward(self, model: torch.nn.Module, mb: TensorDict, *, with_entropy: bool) -> tuple[torch.Tensor, Any]:
        """Response-aligned ``(log_probs [b, T], entropy [b, T] or None)`` of ``model`` on micro-batch ``mb``."""
        mb = mb.to(self.device)
        seq_lens = mb[PROMPT_LENGTHS] + mb[RESPONSE_LENGTHS]
        width = int(seq_lens.max())
        tokens = mb[TOKENS][:, :width]
        attention_mask = torch.arange(width, device=self.device)[None, :] < seq_lens[:, None]
        with self._autocast():
            logits = model(input_ids=tokens, attention_mask=attention_mask.long(), use_cache=False).logits
        response = mb[RESPONSE_TOKENS]
        horizon = response.shape[1]
        # Response token t of a row sits at prompt_length + t and is predicted from the position before it.
        positions = (mb[PROMPT_LENGTHS][:, None] - 1 + torch.arange(horizon, device=self.device)).clamp(max=width - 1)
        picked = logits.gather(1, positions[..., None].expand(-1, -1, logits.shape[-1]))
        log_probs, entropy = logprobs_entropy(
            picked.reshape(-1, logits.shape[-1]),
            response.reshape(-1),
            temperature=self.temperature,
            with_entropy=with_entropy,
            # ``picked`` is a fresh copy nothing else reads (gather's backward does not need its output), so the
            # backward may write d(logits) into it instead of allocating another [b * T, V] buffer.
            inplace_backward=True,
        )
        shape = response.shape
        return log_probs.view(shape), (entropy.view(shape) if entropy is not None else None)

    def _fused_head(self, model: torch.nn.Module) -> bool:
        """Whether the loss runs inside ``model``'s LM head: one process (the head's weight is a plain tensor here)
        and a plain linear head (a LoRA-wrapped head's weight alone is not the layer)."""
        return self.world_size == 1 and isinstance(model.get_output_embeddings(), torch.nn.Linear)

    def _response_hidden(
        self, model: torch.nn.Module, mb: TensorDict
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(hidden [b * T, H], lm_head weight [V, H], targets [b * T])``: the final hidden states at the positions
        that predict the response tokens, the LM head's weight in their dtype (under bf16 autocast a bf16 copy per
        micro-batch, through which the gradient reaches the float32 weight), and the response tokens."""
        mb = mb.to(self.device)
        seq_lens = mb[PROMPT_LENGTHS] + mb[RESPONSE_LENGTHS]
        width = int(seq_lens.max())
        tokens = mb[TOKENS][:, :width]
        attention_mask = torch.arange(width, device=self.device)[None, :] < seq_lens[:, None]
        with self._autocast():
            body = model.get_decoder()(input_ids=tokens, attention_mask=attention_mask.long(), use_cache=False)
        hidden = body.last_hidden_state
        response = mb[RESPONSE_TOKENS]
        # Response token t of a row sits at prompt_length + t and is predicted from the position before it.
        offsets = torch.arange(response.shape[1], device=self.device)
        positions = (mb[PROMPT_LENGTHS][:, None] - 1 + offsets).clamp(max=width - 1)
        picked = hidden.gather(1, positions[..., None].expand(-1, -1, hidden.shape[-1]))
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        weight = model.get_output_embeddings().weight
        return picked.reshape(-1, hidden.shape[-1]).to(dtype), weight.to(dtype), response.reshape(-1)

    def _balanced(self, parts: list[TensorDict]) -> Iterator[tuple[TensorDict, bool]]:
        """Yield ``(micro_batch, real)``; under FSDP every rank runs as many passes (extra ones are not real)."""
        count = len(parts)
        if self.group is not None:
            n = torch.tensor([count], device=self.device)
            dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.group)
            count = int(n)
        for i in range(count):
            yield (parts[i], True) if i < len(parts) else (parts[-1], False)

    def _micro_batches(self, td: TensorDict) -> list[TensorDict]:
        per_rank = self.cfg.micro_batch_size
        return micro_batches(td, micro_batch_size=per_rank, max_tokens=self.cfg.max_tokens_per_gpu)

    def dp_info(self) -> tuple[int, int]:
        """Every rank is a data-parallel shard (FSDP shards parameters, not data)."""
        return self.rank, self.world_size

    def dp_group(self) -> dist.ProcessGroup | None:
        return self.group

    @torch.no_grad()
    def compute_log_probs(self, td: TensorDict) -> TensorDict:
        """``old_log_probs`` (the actor's current weights) and what each frozen role writes (``ref_log_probs`` for the
        reference), [B, T] float32 each, for this rank's shard ``td``."""
        self._check_resident()
        models = {ACTOR.writes: (self.model, nullcontext), **{k: (m, nullcontext) for k, m in self.frozen.items()}}
        if self.base_is_reference:
            models[REFERENCE.writes] = (self.model, lambda: lora.base_only(self.model))
        out: dict[str, list[torch.Tensor]] = {key: [] for key in models}
        for mb, real in self._balanced(self._micro_batches(td)):
            for key, (model, context) in models.items():
                with context():
                    if self._fused_head(model):
                        hidden, weight, targets = self._response_hidden(model, mb)
                        log_probs, _ = linear_logprobs_entropy(
                            hidden, weight, targets, temperature=self.temperature, with_entropy=False
                        )
                        log_probs = log_probs.view(mb[RESPONSE_TOKENS].shape)
                    else:
                        log_probs, _ = self._forward(model, mb, with_entropy=False)
                if real:
                    out[key].append(log_probs.float().cpu())
        return TensorDict({k: torch.cat(v) for k, v in out.items()}, batch_size=td.batch_size)

    def _global_normalizer(self, parts: list[TensorDict]) -> Normalizer:
        norm = sum(Normalizer.of(mb[keys.MASK].to(self.device)) for mb in parts)
        return norm.reduce(self.group)

    def _optimizer_step(self) -> float:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_grad)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
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

    def train(self, td: TensorDict, *, per_step_rows: int) -> dict[str, float]:
        """Optimizer steps over this rank's shard ``td``: ``per_step_rows`` consecutive rows per step.

        ``td`` carries the contract's ``mask``, ``advantages``, ``old_log_probs``, ``rollout_log_probs`` and, with a
        reference model, ``ref_log_probs``. Returns metrics averaged over the steps (token means of the global
        batches, maxima as maxima), plus ``grad_norm`` and ``num_steps``.
        """
        self._check_resident()
        n = td.batch_size[0]
        if n % per_step_rows:
            raise ValueError(f"shard of {n} rows is not a whole number of steps of {per_step_rows} rows")
        totals: dict[str, float] = {}
        steps = n // per_step_rows
        lora.set_dropout(self.model, active=True)
        try:
            for step in range(steps):
                self._train_step(td[step * per_step_rows : (step + 1) * per_step_rows], steps, totals)
        finally:
            lora.set_dropout(self.model, active=False)
        totals["num_steps"] = steps
        return totals

    def _train_step(self, td: TensorDict, steps: int, totals: dict[str, float]) -> None:
        """One optimizer step over ``td``; adds its metrics divided by ``steps`` into ``totals``."""
        parts = self._micro_batches(td)
        norm = self._global_normalizer(parts)
        sums: dict[str, float] = {}
        maxes: dict[str, float] = {}
        for mb, real in self._balanced(parts):
            batch = mb.to(self.device).clone(recurse=False)
            if self._fused_head(self.model):
                hidden, weight, targets = self._response_hidden(self.model, mb)
                loss, metrics = linear_rl_loss(
                    hidden, weight, targets, batch, self.loss_cfg, norm=norm, temperature=self.temperature
                )
            else:
                log_probs, entropy = self._forward(self.model, mb, with_entropy=True)
                batch.set(keys.LOG_PROBS, log_probs)
                batch.set(keys.ENTROPY, entropy)
                loss, metrics = rl_loss(batch, self.loss_cfg, norm=norm)
            self._backward(loss, real=real)
            if real:
                for name, value in metrics.items():
                    value = float(value)
                    if _is_max_metric(name):
                        maxes[name] = max(maxes.get(name, -math.inf), value)
                    else:
                        sums[name] = sums.get(name, 0.0) + value
        step_metrics = self._reduce_metrics(sums, maxes)
        step_metrics["grad_norm"] = self._optimizer_step()
        for name, value in step_metrics.items():
            totals[name] = totals.get(name, 0.0) + value / steps

    def sft_train(self, td: TensorDict) -> dict[str, float]:
        """One supervised step on (prompt, response) rows: the negative log-likelihood of the response tokens."""
        self._check_resident()
        parts = self._micro_batches(td)
        norm = self._global_normalizer(parts)
        total = 0.0
        for mb, real in self._balanced(parts):
            log_probs, _ = self._forward(self.model, mb, with_entropy=False)
            mask = mb[keys.MASK].to(self.device)
            loss = aggregate(sft_loss(log_probs), mask, mode="token_mean", norm=norm)
            self._backward(loss, real=real)
            total += float(loss) if real else 0.0
        metrics = self._reduce_metrics({"sft_loss": total}, {})
        metrics["grad_norm"] = self._optimizer_step()
        return metrics

    def weight_buckets(self, *, dtype: torch.dtype, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        """HF-named weights in ``dtype`` on the CPU, tied weights once, in buckets of about ``bucket_bytes``.

        Each FSDP-sharded tensor is gathered on its own (``full_tensor``, a collective every rank runs in the same
        order), so no rank ever holds more than one full tensor plus the bucket being filled. Rank 0 yields. Under
        LoRA each adapted weight is sent merged (``W + scaling * B @ A``).
        """
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self._check_resident()
        bucket: dict[str, torch.Tensor] = {}
        size = 0
        # Under LoRA the adapters go out merged into their base weights, under the base model's names.
        for name, value in lora.merged_weights(self.model):
            if self.rank != 0:
                continue
            tensor = value.to("cpu", dtype=dtype, copy=True)
            if bucket and size + tensor.nbytes > bucket_bytes:
                yield bucket
                bucket, size = {}, 0
            bucket[name] = tensor
            size += tensor.nbytes
        if bucket:
            yield bucket

    def get_weights(self) -> dict[str, torch.Tensor] | None:
        """The full float32 weights on the CPU on rank 0 (tied weights once), None on other ranks (a collective)."""
        weights: dict[str, torch.Tensor] = {}
        for bucket in self.weight_buckets(dtype=torch.float32, bucket_bytes=1 << 62):
            weights.update(bucket)
        return weights if self.rank == 0 else None

    def save(self, path: str, *, with_optimizer: bool = True) -> None:
        """Trained parameters and (unless ``with_optimizer`` is False) the optimizer state, sharded with
        torch.distributed.checkpoint, into the folder ``path``. Frozen parameters are left out: under LoRA the
        checkpoint holds the adapters only."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_TRAINED_ONLY)
        model_sd = self._trained_entries(model_sd)
        state = {"model": model_sd, "optim": optim_sd} if with_optimizer else {"model": model_sd}
        dcp.save(state, checkpoint_id=path)
        torch.save(self.get_rng_state(), os.path.join(path, f"rng_rank{self.rank}.pt"))

    def load(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_TRAINED_ONLY)
        model_sd = self._trained_entries(model_sd)
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        if any(key.startswith("optim") for key in saved):
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
                options=_TRAINED_ONLY,
            )
        else:  # saved with --no-save-optim: the optimizer starts afresh (or keeps what it has)
            state = {"model": model_sd}
            dcp.load(state, checkpoint_id=path)
            set_model_state_dict(self.model, state["model"], options=_TRAINED_ONLY)
        rng_path = os.path.join(path, f"rng_rank{self.rank}.pt")
        if os.path.exists(rng_path):
            self.set_rng_state(torch.load(rng_path, weights_only=False))

    def _trained_entries(self, model_sd: dict[str, Any]) -> dict[str, Any]:
        """Under LoRA, the adapters' entries only (a frozen weight tied to another, the LM head, would still be
        listed); otherwise the whole state dict."""
        if not self.lora:
            return model_sd
        trained = {name for name, p in self.model.named_parameters() if p.requires_grad}
        return {name: value for name, value in model_sd.items() if name in trained}

    def save_hf(self, path: str) -> None:
        """Write a HF folder (config, safetensors weights, tokenizer) that ``from_pretrained`` loads (rank 0).

        Under LoRA the adapters are merged in (``--lora-export merged``), or the folder is a peft adapter over
        ``--hf-checkpoint`` (``--lora-export adapter``) that ``peft.PeftModel.from_pretrained`` loads."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        if self.lora and self.cfg.lora_export == "adapter":
            adapter = lora.adapter_state_dict(self.model)
            if self.rank == 0:
                self.model.save_pretrained(path, state_dict=adapter)
                AutoTokenizer.from_pretrained(self.model_path).save_pretrained(path)
            return
        weights = self.get_weights()
        if self.rank != 0:
            return
        config = AutoConfig.from_pretrained(self.model_path)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # A key mismatch would silently leave random weights in the saved model.
        missing, unexpected = load_untied_state_dict(model, weights)
        if missing or unexpected:
            raise RuntimeError(
                f"save_hf: the trained weights do not match {self.model_path}'s architecture: missing "
                f"{missing[:5]}{' ...' if len(missing) > 5 else ''} ({len(missing)}), unexpected "
                f"{unexpected[:5]} ({len(unexpected)})"
            )
        model.save_pretrained(path)
        AutoTokenizer.from_pretrained(self.model_path).save_pretrained(path)

    def release_memory(self) -> None:
        """On a GPU, move model and optimizer state to the CPU (colocated with an engine); a no-op on the CPU."""
        if self.device.type == "cuda":
            self._move(torch.device("cpu"))
            torch.cuda.empty_cache()
        self.released = True

    def resume_memory(self) -> None:
        if self.device.type == "cuda":
            self._move(self.device)
        self.released = False

    def _move(self, device: torch.device) -> None:
        self.model.to(device)
        for model in self.frozen.values():
            model.to(device)
        for state in self.optimizer.state.values():
            for name, value in state.items():
                if torch.is_tensor(value):
                    state[name] = value.to(device)

    def _check_resident(self) -> None:
        if self.released:
            raise RuntimeError("trainer memory is released: call resume_memory() first")

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
        self.optimizer.state.clear()

    def get_rng_state(self) -> dict[str, Any]:
        return rng_state(self.device)

    def set_rng_state(self, state: dict[str, Any]) -> None:
        restore_rng_state(state, self.device)

    def shutdown(self) -> None:
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group()
            self.group = None
