"""Weight sync: ``push(version)`` moves the trainers' weights into every engine.

The trainer side is one backend method, ``TrainBackend.weight_buckets``: HF names, the engines' dtype, tied weights
once, in buckets of ``--update-weight-buffer-size`` bytes. Each way of moving them is one class here and one entry
in :data:`WEIGHT_SYNCS`; an engine kind names its default in its registry entry (``runtime.engines.registry``):

- ``object_store``: each bucket is put in Ray's object store once by trainer rank 0 and loaded by every engine
  (``RolloutEngine.load_weights``), one bucket at a time, so no process holds more than a bucket beyond its model.
- ``disk``: trainer rank 0 writes an HF folder of safetensors (a file per bucket, with their index and the
  checkpoint's config and tokenizer files) and every engine loads it (``update_weights_from_disk``); SGLang servers
  read it through ``/update_weights_from_disk``, so the folder must be on a file system they see.

NCCL broadcast and CUDA IPC (SGLang's ``update_weights_from_distributed`` / ``update_weights_from_tensor``) plug in
here as two more entries.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


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


WEIGHT_SYNCS: dict[str, type[Any]] = {"object_store": ObjectStoreSync, "disk": DiskSync}


def make_weight_sync(trainers: Any, engines: Any, *, bucket_bytes: int, kind: str | None = None) -> WeightSync:
    """The weight sync for ``engines`` (their registry default, or ``kind``)."""
    kind = kind or engines.weight_sync_kind
    if kind not in WEIGHT_SYNCS:
        raise ValueError(f"weight sync {kind!r} is not one of {', '.join(WEIGHT_SYNCS)}")
    return WEIGHT_SYNCS[kind](trainers, engines, bucket_bytes=bucket_bytes)
