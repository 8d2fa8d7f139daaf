"""The training-backend protocol: everything the runtime asks of one trainer rank.

Every method is called on all ranks at once (they may run collectives). Batches are TensorDicts of the batch contract
plus ``runtime.train.batch``'s sequence keys, this rank's shard only (:func:`runtime.train.step.train_rollout` cuts
the shard by :meth:`TrainBackend.dp_info`). Backends are listed in :data:`runtime.train.backends.TRAIN_BACKENDS`
(``--train-backend``); the loop never names one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from tensordict import TensorDict


@runtime_checkable
class TrainBackend(Protocol):
    def dp_info(self) -> tuple[int, int]:
        """``(dp_rank, dp_size)``: this rank's data-parallel shard and the number of shards. Ranks that split one
        model (tensor or pipeline parallel) report the same ``dp_rank`` and get the same shard."""
        ...

    def dp_group(self) -> Any:
        """The data-parallel ``torch.distributed`` process group (None with one shard): global moments (whitening)
        and metric reductions run over it."""
        ...

    def compute_log_probs(self, td: TensorDict) -> TensorDict:
        """What every role's forward writes on shard ``td`` (the actor's ``old_log_probs``, the reference's
        ``ref_log_probs``, ...), [B, T] float32 each, under the current weights."""
        ...

    def train(
        self, td: TensorDict, *, per_step_rows: int | Sequence[int], rollout_id: int | None = None
    ) -> dict[str, float]:
        """Optimizer steps over ``td``, ``per_step_rows`` rows each (one count per step when they differ: rollouts
        split into several rows); metrics of the global batches (the same on every rank). ``rollout_id`` (the job's
        step) reaches slime's before-train-step hook."""
        ...

    def train_critic(self, td: TensorDict, *, per_step_rows: int) -> dict[str, float]:
        """Critic optimizer steps over ``td`` (``mask``, ``old_values``, ``returns``), ``per_step_rows`` rows each, on
        the value loss; ``critic/`` metrics of the global batches (the same on every rank). Only for a backend built
        with the critic role (slime's ``ppo``)."""
        ...

    def sft_train(self, td: TensorDict) -> dict[str, float]:
        """One supervised step on the responses of ``td``."""
        ...

    def weight_buckets(
        self, *, dtype: torch.dtype, bucket_bytes: int, device: str = "cpu"
    ) -> Iterator[dict[str, torch.Tensor]]:
        """The actor's weights for the engines: HF names, ``dtype``, tied weights once, in buckets of about
        ``bucket_bytes`` (a tensor larger than that is a bucket of its own), on the CPU (``device="cpu"``) or where
        the model computes (``device="model"``, for handles to GPU memory). A collective: every rank iterates it to
        the end; on the CPU only rank 0 yields buckets, on the model's device every rank yields the whole weights
        (each hands them to the engine colocated on its own device)."""
        ...

    def save(self, path: str, *, with_optimizer: bool = True) -> None:
        """Model, optimizer and RNG state into the folder ``path`` (every rank writes its part); without the
        optimizer's state when ``with_optimizer`` is False (slime's ``--no-save-optim``)."""
        ...

    def load(self, path: str) -> None:
        """Restore what :meth:`save` wrote (the optimizer keeps its state when the checkpoint has none)."""
        ...

    def save_hf(self, path: str) -> None:
        """A HF folder that ``AutoModelForCausalLM.from_pretrained`` loads (written by rank 0)."""
        ...

    def update_reference(self) -> None:
        """Copy the actor's current weights into the reference role (slime's ``--ref-update-interval``)."""
        ...

    def advance_old_actor(self) -> None:
        """After a weight sync, with ``--keep-old-actor``: the weights the old log-probs are computed with become
        those the engines had until this sync, and the current ones are kept as the engines' (slime's queue)."""
        ...

    def reset_optimizer(self) -> None:
        """Drop the optimizer's state, its moments and step counts (slime's ``--reset-optimizer-states``)."""
        ...

    def release_memory(self) -> dict[str, float] | None:
        """Give device memory back (colocated with an engine) until :meth:`resume_memory`; the offload metrics
        (``runtime.train.offload.METRICS``: what moved and how long it took), or None."""
        ...

    def resume_memory(self) -> dict[str, float] | None:
        """Take the memory back; ``perf/offload_train_resume_time``, or None."""
        ...

    def get_rng_state(self) -> Any: ...

    def set_rng_state(self, state: Any) -> None: ...

    def shutdown(self) -> None:
        """Leave the process group; the rank is not used again."""
        ...


def check_bucket_request(*, bucket_bytes: int, device: str) -> None:
    """``ValueError`` naming the argument of :meth:`TrainBackend.weight_buckets` that no backend can serve."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    if device not in ("cpu", "model"):
        raise ValueError(f"device must be 'cpu' or 'model', got {device!r}")


def in_buckets(tensors: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """``(name, tensor)`` pairs in their order, in buckets filled up to ``bucket_bytes`` (``nbytes`` summed): a
    tensor that would overflow a non-empty bucket starts the next one, so only a tensor larger than ``bucket_bytes``
    on its own makes a bucket larger than that. Each bucket is yielded once full, before the next tensor is asked
    for."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in tensors:
        if bucket and size + tensor.nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = tensor
        size += tensor.nbytes
    if bucket:
        yield bucket
