"""Weight sync: ``push(version)`` moves the trainers' weights into every engine.

The trainer side is one backend method, ``TrainBackend.weight_buckets``: HF names, the engines' dtype, tied weights
once, in buckets of ``--update-weight-buffer-size`` bytes. Each way of moving them is one class here and one entry
in :data:`WEIGHT_SYNCS`; an engine kind names its default in its registry entry (``runtime.engines.registry``):

- ``object_store``: each bucket is put in Ray's object store once by trainer rank 0 and loaded by every engine
  (``RolloutEngine.load_weights``), one bucket at a time, so no process holds more than a bucket beyond its model.
- ``disk``: trainer rank 0 writes an HF folder of safetensors (a file per bucket, with their index and the
  checkpoint's config and tokenizer files) and every engine loads it (``update_weights_from_disk``); SGLang servers
  read it through ``/update_weights_from_disk``, so the folder must be on a file system they see.

- ``nccl``: trainer rank 0 and every engine join one ``torch.distributed`` group (SGLang's
  ``init_weights_update_group``, once), then each bucket is one ``update_weights_from_distributed`` call per engine
  while rank 0 broadcasts its tensors (``runtime.engines.weight_transfer``); NCCL when the trainer has a GPU, gloo on
  the CPU. SGLang servers and the embedded engine both receive this way.

CUDA IPC (SGLang's ``update_weights_from_tensor``, for colocated engines) would plug in here as one more entry.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import ray

from runtime.engines import weight_transfer


@runtime_checkable
class WeightSync(Protocol):
    def push(self, version: int) -> None:
        """Load the trainers' current weights into every engine; afterwards every engine samples with ``version``."""
        ...

    def close(self) -> None:
        """Free what the sync holds (folders, groups)."""
        ...


class ObjectStoreSync:
    """Buckets through Ray's object store (see the module docstring)."""

    def __init__(self, trainers: Any, engines: Any, *, bucket_bytes: int):
        self.trainers, self.engines, self.bucket_bytes = trainers, engines, bucket_bytes
        self.dtype = engines.weight_dtype()
        self.bytes_sent = 0

    def push(self, version: int) -> None:
        self.bytes_sent = self.trainers.push_buckets(
            self.engines.actors, version=version, dtype=self.dtype, bucket_bytes=self.bucket_bytes
        )

    def close(self) -> None:
        pass


class DiskSync:
    """An HF folder of safetensors written by the trainers, loaded by every engine (see the module docstring).

    ``folder`` defaults to a fresh temporary folder, removed by :meth:`close`; each push overwrites it.
    """

    def __init__(self, trainers: Any, engines: Any, *, bucket_bytes: int, folder: str | None = None):
        self.trainers, self.engines, self.bucket_bytes = trainers, engines, bucket_bytes
        self.dtype = engines.weight_dtype()
        self._owned = folder is None
        self.root = Path(folder or tempfile.mkdtemp(prefix="rlcore-weights-"))

    def push(self, version: int) -> None:
        path = self.trainers.write_weights(
            str(self.root / "weights"), dtype=self.dtype, bucket_bytes=self.bucket_bytes
        )
        self.engines.update_weights_from_disk(path, weight_version=version)

    def close(self) -> None:
        if self._owned:
            shutil.rmtree(self.root, ignore_errors=True)


class NoSync:
    """No engines or no trainers (the debug modes): there is nothing to move."""

    def __init__(self, trainers: Any, engines: Any, *, bucket_bytes: int):
        pass

    def push(self, version: int) -> None:
        pass

    def close(self) -> None:
        pass


class DistributedSync:
    """Buckets broadcast over a weight-update group (see the module docstring). ``bucket_sizes`` holds the bytes of
    each bucket of the last push."""

    def __init__(
        self, trainers: Any, engines: Any, *, bucket_bytes: int, group_name: str = weight_transfer.DEFAULT_GROUP
    ):
        self.trainers, self.engines, self.bucket_bytes, self.group_name = trainers, engines, bucket_bytes, group_name
        self.dtype = engines.weight_dtype()
        self.bucket_sizes: list[int] = []
        self.bytes_sent = 0
        host, port, self.backend = trainers.weight_group_address()
        ranks = engines.tp_sizes()
        world_size = 1 + sum(ranks)
        offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
        joins = [
            a.init_weights_update_group.remote(
                host, port, offset, world_size, group_name=group_name, backend=self.backend
            )
            for a, offset in zip(engines.actors, offsets, strict=True)
        ]
        trainer = trainers.init_weight_group(
            master_address=host, master_port=port, world_size=world_size, group_name=group_name, backend=self.backend
        )
        ray.get([trainer, *joins])

    def push(self, version: int) -> None:
        self.bucket_sizes = self.trainers.broadcast_buckets(
            self.engines.actors,
            version=version,
            dtype=self.dtype,
            bucket_bytes=self.bucket_bytes,
            group_name=self.group_name,
        )
        self.bytes_sent = sum(self.bucket_sizes)

    def close(self) -> None:
        # Best effort: this also runs while a failed job unwinds.
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get([a.destroy_weights_update_group.remote(self.group_name) for a in self.engines.actors])
        with contextlib.suppress(ray.exceptions.RayError):
            self.trainers.destroy_weight_group()


WEIGHT_SYNCS: dict[str, type[Any]] = {"object_store": ObjectStoreSync, "disk": DiskSync, "nccl": DistributedSync}


def check_weights_equal(trainers: Any, engines: Any, *, truncate_size: int = 4) -> int:
    """``--check-weight-update-equal``: every engine holds the trainer's weights, in the engines' dtype.

    Compares the first ``truncate_size`` rows of every weight (what ``get_weights_by_name`` returns, as SGLang's
    route of that name does) exactly; raises ``RuntimeError`` naming the first weight and engine that differ.
    Returns the number of weights compared.
    """
    import torch

    dtype = getattr(torch, engines.weight_dtype())
    expected = trainers.get_weights()
    for name, value in expected.items():
        want = value.to(dtype).float()[:truncate_size]
        got = ray.get([a.get_weights_by_name.remote(name, truncate_size) for a in engines.actors])
        for index, rows in enumerate(got):
            if not torch.equal(torch.tensor(rows, dtype=torch.float32).reshape(want.shape), want):
                raise RuntimeError(
                    f"--check-weight-update-equal: engine {index}'s {name} differs from the trainer's after the "
                    f"weight sync (first rows: engine {rows!r:.200}, trainer {want.tolist()!r:.200})"
                )
    return len(expected)


def make_weight_sync(trainers: Any, engines: Any, *, bucket_bytes: int, kind: str | None = None) -> WeightSync:
    """The weight sync for ``engines`` (their registry default, or ``kind``)."""
    if not (trainers.actors and engines.actors):
        return NoSync(trainers, engines, bucket_bytes=bucket_bytes)  # a debug mode runs one side only
    kind = kind or engines.weight_sync_kind
    if kind not in WEIGHT_SYNCS:
        raise ValueError(f"weight sync {kind!r} is not one of {', '.join(WEIGHT_SYNCS)}")
    return WEIGHT_SYNCS[kind](trainers, engines, bucket_bytes=bucket_bytes)
