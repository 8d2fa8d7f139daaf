"""The ``megatron`` backend's weights out: HF-named full tensors gathered over TP and pipeline stages to rank 0,
in buckets for weight sync, whole for ``get_weights``, and an HF folder (``save_hf``)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from runtime.train.backends import megatron_moe as mmoe
from runtime.train.backends import megatron_weights as mw
from runtime.train.backends.base import check_bucket_request, in_buckets


class MegatronExport:
    """The weights out of :class:`~runtime.train.backends.megatron_backend.MegatronTrainer` (methods of the trainer;
    collectives, run on every rank)."""

    def _module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The ``GPTModel`` inside the DDP and Float16 wrappers."""
        while hasattr(model, "module"):
            model = model.module
        return model

    def _hf_tensors(
        self, model: torch.nn.Module, *, dtype: torch.dtype, on_cpu: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, full tensor in dtype)`` in one global order, gathered over TP, sent from each stage to global
        rank 0; yielded on rank 0 only, on the CPU or (``on_cpu=False``) on rank 0's device. A collective: every rank
        runs it to the end."""
        params = mmoe.model_tensors(self._module(model))
        tp_group = self.ps.get_tensor_model_parallel_group()
        for stage in range(self.pp):
            expected = mw.megatron_shapes(self.shape, tp_size=self.tp, pp_rank=stage, pp_size=self.pp, ep_size=self.ep)
            mine = stage == self.pp_rank
            src = self._global_rank(tp_rank=0, pp_rank=stage)
            for name, local_shape in expected.items():
                expert = mmoe.is_expert(name)
                if mine and expert:
                    # Each expert from its owning rank: the local experts of every EP rank, in EP-rank order (whole
                    # on every TP rank).
                    value = params[name].detach().to(dtype)
                    parts = [value]
                    if self.ep > 1:
                        parts = [torch.empty_like(value) for _ in range(self.ep)]
                        dist.all_gather(parts, value.contiguous(), group=self.ps.get_expert_model_parallel_group())
                elif expert:
                    parts = [torch.empty(local_shape, dtype=dtype, device="meta") for _ in range(self.ep)]
                elif mine:
                    value = params[name].detach().to(dtype)
                    if self.tp > 1:
                        parts = [torch.empty_like(value) for _ in range(self.tp)]
                        dist.all_gather(parts, value.contiguous(), group=tp_group)
                    else:
                        parts = [value]
                else:
                    parts = [torch.empty(local_shape, dtype=dtype, device="meta") for _ in range(self.tp)]
                for hf_name, tensor in mw.tensor_to_hf(name, parts, self.shape, pp_rank=stage, pp_size=self.pp):
                    if src == 0:
                        if self.rank == 0:
                            yield hf_name, tensor.to("cpu" if on_cpu else self.device, copy=True)
                        continue
                    if self.rank == src:
                        dist.send(tensor.contiguous(), dst=0)
                    elif self.rank == 0:
                        buffer = torch.empty(tensor.shape, dtype=dtype, device=self.device)
                        dist.recv(buffer, src=src)
                        yield hf_name, buffer.cpu() if on_cpu else buffer

    def _global_rank(self, *, tp_rank: int, pp_rank: int) -> int:
        """The global rank of (tp_rank, pp_rank) in data-parallel replica 0 (Megatron's order tp-cp-ep-dp-pp)."""
        return pp_rank * (self.world_size // self.pp) + tp_rank

    def weight_buckets(
        self, *, dtype: torch.dtype, bucket_bytes: int, device: str = "cpu"
    ) -> Iterator[dict[str, torch.Tensor]]:
        """HF-named weights in ``dtype``, tied weights once, in buckets of about ``bucket_bytes``: each tensor
        gathered over TP and sent from its stage on its own, so no rank holds more than one full tensor plus the
        bucket. Rank 0 yields, on the CPU or (``device="model"``) on its device; unlike the torch backend the other
        ranks yield nothing there, so ``ipc`` weight sync reaches one colocated engine (the config refuses more)."""
        check_bucket_request(bucket_bytes=bucket_bytes, device=device)
        self._check_resident()
        with self._shims():
            yield from in_buckets(
                self._hf_tensors(self.model, dtype=dtype, on_cpu=device == "cpu"), bucket_bytes=bucket_bytes
            )

    def get_weights(self) -> dict[str, torch.Tensor] | None:
        """The full float32 HF weights on the CPU on rank 0, None elsewhere (a collective)."""
        weights: dict[str, torch.Tensor] = {}
        for bucket in self.weight_buckets(dtype=torch.float32, bucket_bytes=1 << 62):
            weights.update(bucket)
        return weights if self.rank == 0 else None

    def save_hf(self, path: str) -> None:
        """A HF folder (config, safetensors, tokenizer) that ``from_pretrained`` loads, written by rank 0."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        from runtime.engines.checkpoint_layout import load_checkpoint_state_dict

        weights = self.get_weights()
        if self.rank != 0:
            return
        mw.check_hf_state(weights, self.shape, source="the exported weights")
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.model_path), dtype=torch.float32)
        # The weights are in the checkpoint's names (an MoE model's experts one tensor each), the model's fused.
        missing, unexpected = load_checkpoint_state_dict(model, weights)
        if missing or unexpected:
            raise RuntimeError(f"save_hf: missing {missing[:5]}, unexpected {unexpected[:5]}")
        model.save_pretrained(path)
        AutoTokenizer.from_pretrained(self.model_path).save_pretrained(path)
