"""The ``torch`` backend's memory release while colocated with an engine: optimizer state and weights to the
host through :class:`runtime.train.offload.HostOffload` (one GPU) or ``.to()``, and back."""

from __future__ import annotations

import time

import torch

from runtime.train.offload import module_tensors, optimizer_tensors


class TorchOffload:
    """Memory release and resume of :class:`~runtime.train.backends.torch_backend.TorchTrainer` (methods of the
    trainer)."""

    def release_memory(self) -> dict[str, float]:
        """On a GPU, move optimizer state, then model weights, to the host (colocated with an engine): through
        :attr:`host_offload` (a :class:`runtime.train.offload.HostOffload`) when there is one, else with ``.to()``;
        a no-op on the CPU. Returns the offload metrics (``perf/offload_train_bytes``, ``perf/offload_train_time``;
        their reductions over ranks: ``runtime.train.offload.METRICS``)."""
        metrics: dict[str, float] = {}
        if self.host_offload is not None and not self.host_offload.offloaded:
            metrics = self.host_offload.offload(self._offload_tensors())
        elif self.device.type == "cuda" and self.host_offload is None:
            start = time.perf_counter()
            self._move(torch.device("cpu"))
            torch.cuda.empty_cache()
            metrics = {"perf/offload_train_time": time.perf_counter() - start}
        self.released = True
        return metrics

    def resume_memory(self) -> dict[str, float]:
        """Take back what :meth:`release_memory` moved; ``perf/offload_train_resume_time``."""
        metrics: dict[str, float] = {}
        if self.host_offload is not None:
            metrics = self.host_offload.resume()
        elif self.device.type == "cuda":
            start = time.perf_counter()
            self._move(self.device)
            metrics = {"perf/offload_train_resume_time": time.perf_counter() - start}
        self.released = False
        return metrics

    def _offload_tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        """``(kind, name, tensor)`` of everything :meth:`release_memory` moves: the optimizers' state, then the
        actor's, the frozen models' and the critic's weights."""
        optimizers = {"actor.": self.optimizer, "critic.": self.critic_optimizer}
        models = {"actor.": self.model, **{f"{k}.": m for k, m in self.frozen.items()}, "critic.": self.critic}
        return [
            *(
                ("optimizer", prefix + name, t)
                for prefix, opt in optimizers.items()
                if opt is not None
                for name, t in optimizer_tensors(opt)
            ),
            *(
                ("weights", prefix + name, t)
                for prefix, model in models.items()
                if model is not None
                for name, t in module_tensors(model)
            ),
        ]

    def _move(self, device: torch.device) -> None:
        self.model.to(device)
        for model in [*self.frozen.values(), *([self.critic] if self.critic is not None else [])]:
            model.to(device)
        for optimizer in (self.optimizer, self.critic_optimizer):
            for state in optimizer.state.values() if optimizer is not None else ():
                for name, value in state.items():
                    if torch.is_tensor(value):
                        state[name] = value.to(device)

    def _check_resident(self) -> None:
        if self.released:
            raise RuntimeError("trainer memory is released: call resume_memory() first")
