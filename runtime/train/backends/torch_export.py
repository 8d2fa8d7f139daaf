"""The ``torch`` backend's weights out and checkpoints: HF-named weights in buckets for weight sync (LoRA merged,
experts one tensor each), whole for ``get_weights``, a HF folder or a peft adapter, and the DCP checkpoint of the
trainer (``torch_checkpoint``) with each rank's RNG state."""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from runtime.engines.checkpoint_layout import CheckpointLayout
from runtime.train.backends import lora
from runtime.train.backends.base import check_bucket_request, in_buckets
from runtime.train.backends.torch_checkpoint import load_state, save_state, write_hf_folder


class TorchExport:
    """The weights out and checkpoints of :class:`~runtime.train.backends.torch_backend.TorchTrainer` (methods of
    the trainer; collectives, run on every rank)."""

    def weight_buckets(
        self, *, dtype: torch.dtype, bucket_bytes: int, device: str = "cpu"
    ) -> Iterator[dict[str, torch.Tensor]]:
        """HF-named weights in ``dtype``, tied weights once, in buckets of about ``bucket_bytes``, on the CPU or (with
        ``device="model"``) on the model's device, where every rank yields them (see ``TrainBackend``). The names are
        the checkpoint's: an MoE model's fused experts go out one tensor per expert and projection.

        Each FSDP-sharded tensor is gathered on its own (``full_tensor``, a collective every rank runs in the same
        order), so no rank ever holds more than one full tensor plus the bucket being filled. Rank 0 yields. Under
        LoRA each adapted weight is sent merged (``W + scaling * B @ A``).
        """
        check_bucket_request(bucket_bytes=bucket_bytes, device=device)
        self._check_resident()
        # Under LoRA the adapters go out merged into their base weights, under the base model's names; an MoE model's
        # fused experts go out one tensor per expert and projection, under the checkpoint's names (the layout SGLang
        # and the embedded engine load: runtime.engines.checkpoint_layout).
        layout = CheckpointLayout(self.model, shapes={})

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for model_name, value in lora.merged_weights(self.model):
                if self.rank != 0 and device == "cpu":
                    continue
                whole = value.to("cpu" if device == "cpu" else value.device, dtype=dtype, copy=True)
                yield from layout.to_checkpoint(model_name, whole)

        yield from in_buckets(tensors(), bucket_bytes=bucket_bytes)

    def get_weights(self) -> dict[str, torch.Tensor] | None:
        """The full float32 weights on the CPU on rank 0 (tied weights once; checkpoint names, experts one by one),
        None on other ranks (a collective)."""
        weights: dict[str, torch.Tensor] = {}
        for bucket in self.weight_buckets(dtype=torch.float32, bucket_bytes=1 << 62):
            weights.update(bucket)
        return weights if self.rank == 0 else None

    def save(self, path: str, *, with_optimizer: bool = True) -> None:
        """Trained parameters and (unless ``with_optimizer`` is False) the optimizer state, sharded with
        torch.distributed.checkpoint, into the folder ``path`` (``torch_checkpoint.save_state``), and this rank's
        RNG state. Frozen parameters are left out: under LoRA the checkpoint holds the adapters only."""
        save_state(
            path,
            model=self.model,
            optimizer=self.optimizer,
            critic=self.critic,
            critic_optimizer=self.critic_optimizer,
            with_optimizer=with_optimizer,
            lora_only=self.lora,
        )
        torch.save(self.get_rng_state(), os.path.join(path, f"rng_rank{self.rank}.pt"))

    def load(self, path: str) -> None:
        load_state(
            path,
            model=self.model,
            optimizer=self.optimizer,
            critic=self.critic,
            critic_optimizer=self.critic_optimizer,
            lora_only=self.lora,
        )
        if self.old_actor is not None:
            # As slime loads its old actor from --load: the queue starts again from the loaded weights.
            self.old_actor, self.rollout_actor = self._actor_copy(), self._actor_copy()
        rng_path = os.path.join(path, f"rng_rank{self.rank}.pt")
        if os.path.exists(rng_path):
            self.set_rng_state(torch.load(rng_path, weights_only=False))

    def write_lora_adapter(self, path: str) -> str | None:
        """Write the adapters as a peft folder (``adapter_config.json``, ``adapter_model.safetensors``) that peft and
        SGLang's ``/load_lora_adapter`` load over the base checkpoint; every rank calls it (the adapters are gathered),
        rank 0 writes and returns ``path``."""
        if not self.lora:
            raise RuntimeError("write_lora_adapter: this trainer trains no LoRA adapters (--lora-rank 0)")
        adapter = lora.adapter_state_dict(self.model)
        if self.rank != 0:
            return None
        self.model.save_pretrained(path, state_dict=adapter)
        return path

    def save_hf(self, path: str) -> None:
        """Write a HF folder (config, safetensors weights, tokenizer) that ``from_pretrained`` loads (rank 0).

        Under LoRA the adapters are merged in (``--lora-export merged``), or the folder is a peft adapter over
        ``--hf-checkpoint`` (``--lora-export adapter``) that ``peft.PeftModel.from_pretrained`` loads."""
        from transformers import AutoTokenizer

        if self.lora and self.cfg.lora_export == "adapter":
            if self.write_lora_adapter(path) is not None:
                AutoTokenizer.from_pretrained(self.model_path).save_pretrained(path)
            return
        weights = self.get_weights()
        if self.rank == 0:
            write_hf_folder(path, weights, model_path=self.model_path)
