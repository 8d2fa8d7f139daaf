"""The training-backend protocol: what the loop asks of one data-parallel trainer rank.

Every method is called on all ranks at once (they may run collectives). Batches are TensorDicts of the batch
contract plus ``runtime.train.batch``'s sequence keys; this rank's shard only. The ``torch`` backend
(:class:`runtime.train.backends.torch_backend.TorchTrainer`) implements it; a Megatron backend plugs in behind the same
methods.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from tensordict import TensorDict


@runtime_checkable
class TrainBackend(Protocol):
    def compute_log_probs(self, td: TensorDict) -> TensorDict:
        """``old_log_probs`` (and ``ref_log_probs`` with a reference model), [B, T] float32, for shard ``td``."""
        ...

    def train(self, td: TensorDict, *, per_step_rows: int) -> dict[str, float]:
        """Optimizer steps over ``td``, ``per_step_rows`` rows each; metrics of the global batches."""
        ...

    def sft_train(self, td: TensorDict) -> dict[str, float]:
        """One supervised step on the responses of ``td``."""
        ...

    def get_weights(self) -> dict[str, Any] | None:
        """The full state dict on the CPU on rank 0 (None elsewhere), for the engines."""
        ...

    def save(self, path: str) -> None: ...

    def load(self, path: str) -> None: ...

    def save_hf(self, path: str) -> None:
        """A HF folder that ``AutoModelForCausalLM.from_pretrained`` loads."""
        ...

    def release_memory(self) -> None: ...

    def resume_memory(self) -> None: ...
