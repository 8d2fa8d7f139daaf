"""Weight sync: ``push(version)`` moves the trainers' weights into every engine.

The trainer side is one backend method, ``TrainBackend.weight_buckets``: HF names, the engines' dtype, tied weights
once, in buckets of ``--update-weight-buffer-size`` bytes. Each way of moving them is one class here and one entry
in :data:`WEIGHT_SYNCS`; an engine kind names its default in its registry entry (``runtime.engines.registry``):

- ``object_store``: each bucket is put in Ray's object store once by trainer rank 0 and loaded by every engine
  (``RolloutEngine.load_weights``), one bucket at a time, so no process holds more than a bucket beyond its model.
- ``disk``: trainer rank 0 writes an HF folder of safetensors (a file per bucket, with their index and the
  checkpoint's config and tokenizer files) and every engine loads it (``update_weights_from_disk``); SGLang servers
  read it through ``/update_weights_from_disk``, so the folder must be on a file system they see. As slime does:
  one folder per sync, ``weight_v<version, 6 digits>`` under ``--update-weight-disk-dir``, deleted once the engines
  loaded it unless ``--update-weight-disk-keep-files``, and ``--custom-update-weight-post-write-path`` called between
  the write and the load.

- ``nccl``: trainer rank 0 and every engine join one ``torch.distributed`` group (SGLang's
  ``init_weights_update_group``, once), then each bucket is one ``update_weights_from_distributed`` call per engine
  while rank 0 broadcasts it as one flat buffer of its tensors' bytes (SGLang's ``load_format="flattened_bucket"``;
  ``runtime.engines.weight_transfer``), which the engines unpack as views; NCCL when the trainer has a GPU, gloo on
  the CPU. SGLang servers and the embedded engine both receive this way.

- ``ipc``: for engines colocated with trainer rank 0 (the default under ``--colocate``). Each bucket stays where
  the trainer computes, in the engines' dtype, and crosses as handles to its memory (CUDA IPC on a GPU, shared-memory
  files on the CPU; SGLang's ``update_weights_from_tensor``), so no weight passes through host memory or a socket;
  the trainer keeps a bucket alive until every engine has copied it.

- ``lora_adapter``: under ``--lora-rank`` with SGLang engines, trainer rank 0 writes the adapters as a peft folder
  and every server loads it as a LoRA adapter (``/load_lora_adapter``) over its unchanged base weights; requests name
  it (``lora_path``). Only the adapters cross, not merged weights.

Under one-step async, engines that pause their generation (SGLang: ``EngineKind.pauses_generation``) take a push of
any kind but ``lora_adapter`` without the rollout in flight being waited for: the loop pauses every engine's generation
around the push (``EngineGroup.generation_paused``; SGLang's ``/pause_generation`` in ``retract`` mode, then
``/continue_generation``), and the requests in flight go on with the new weights (``updates_in_place``).

An engine that dies during a push is restarted by the engine group and the push runs again (``EngineGroup.on_all``);
over NCCL/gloo the trainer aborts the broadcast as soon as a receiver fails (``weight_transfer.send_bucket``) rather
than waiting for the collective's timeout.
A restarted engine takes the trainers' weights before it serves (``rejoin``, labelled with the trainers' version
``TrainerGroup.version``): one engine by the object store or the disk; over NCCL the group is formed again with the new
engine and every engine receives the weights.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import ray

from runtime.engines import weight_transfer
from runtime.hooks import resolve_hook


@runtime_checkable
class WeightSync(Protocol):
    # ``updates_in_place`` (a class attribute, False where absent): a push changes the weights the engines sample with,
    # so a generation paused around it (``EngineGroup.generation_paused``) goes on with the new ones. Not so for
    # ``lora_adapter``, whose requests each name the adapter they run with.

    def push(self, version: int) -> None:
        """Load the trainers' current weights into every engine; afterwards every engine samples with ``version``."""
        ...

    def rejoin(self, replacements: dict[int, Any]) -> None:
        """Load the trainers' current weights into restarted engines (``{index: new actor}``), before they serve."""
        ...

    def close(self) -> None:
        """Free what the sync holds (folders, groups)."""
        ...


class ObjectStoreSync:
    """Buckets through Ray's object store (see the module docstring)."""

    updates_in_place = True

    def __init__(self, trainers: Any, engines: Any, *, bucket_bytes: int):
        self.trainers, self.engines, self.bucket_bytes = trainers, engines, bucket_bytes
        self.dtype = engines.weight_dtype()
        self.bytes_sent = 0

    def push(self, version: int) -> None:
        self.bytes_sent = self.engines.on_all(lambda actors: self._push(actors, version), what="the weight sync")

    def _push(self, actors: list[Any], version: int) -> int:
        return self.trainers.push_buckets(actors, version=version, dtype=self.dtype, bucket_bytes=self.bucket_bytes)

    def rejoin(self, replacements: dict[int, Any]) -> None:
        self._push(list(replacements.values()), self.trainers.version)

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class DiskOptions:
    """slime's settings of disk sync: ``folder`` (``--update-weight-disk-dir``; None: a temporary folder, removed at
    the end), ``keep_files`` (``--update-weight-disk-keep-files``) and ``post_write``
    (``--custom-update-weight-post-write-path`` with slime's ``args`` bound: ``post_write(version_dir,
    rollout_engines)``, the engines as their actors)."""

    folder: str | None = None
    keep_files: bool = False
    post_write: Callable[[str, list[Any]], Any] | None = None


def disk_options(cfg: Any) -> DiskOptions:
    """The job's :class:`DiskOptions`, from its ``--update-weight-disk-*`` flags and post-write hook."""
    s = cfg.sglang
    post_write = None
    if s.custom_update_weight_post_write_path is not None:
        hook = resolve_hook("--custom-update-weight-post-write-path", s.custom_update_weight_post_write_path)
        post_write = functools.partial(hook, cfg)
    return DiskOptions(
        folder=s.update_weight_disk_dir, keep_files=s.update_weight_disk_keep_files, post_write=post_write
    )


class DiskSync:
    """An HF folder of safetensors per sync written by the trainers, loaded by every engine (see the module
    docstring)."""

    updates_in_place = True

    def __init__(self, trainers: Any, engines: Any, *, bucket_bytes: int, disk: DiskOptions | None = None):
        self.trainers, self.engines, self.bucket_bytes = trainers, engines, bucket_bytes
        self.options = disk or DiskOptions()
        self.dtype = engines.weight_dtype()
        self._owned = self.options.folder is None
        self.root = Path(self.options.folder or tempfile.mkdtemp(prefix="rlcore-weights-"))

    def version_dir(self, version: int) -> Path:
        """The folder of ``version``'s weights (slime's name)."""
        return self.root / f"weight_v{version:06d}"

    def push(self, version: int) -> None:
        self._load(lambda path: self.engines.update_weights_from_disk(path, weight_version=version), version)

    def _load(self, load: Callable[[str], Any], version: int) -> None:
        folder = self.version_dir(version)
        path = self.trainers.write_weights(str(folder), dtype=self.dtype, bucket_bytes=self.bucket_bytes)
        try:
            if self.options.post_write is not None:
                self.options.post_write(path, list(self.engines.actors))
            load(path)
        finally:
            if not self.options.keep_files:
                shutil.rmtree(folder, ignore_errors=True)

    def rejoin(self, replacements: dict[int, Any]) -> None:
        version = self.trainers.version
        actors = list(replacements.values())
        self._load(
            lambda path: ray.get([a.update_weights_from_disk.remote(path, weight_version=version) for a in actors]),
            version,
        )

    def close(self) -> None:
        if self._owned and not self.options.keep_files:
            shutil.rmtree(self.root, ignore_errors=True)


class LoraAdapterSync:
    """The trainers' LoRA adapters as a peft folder, loaded by every SGLang engine as an adapter over its base weights
    (``SGLangEngine.load_lora_adapter``: SGLang's ``/load_lora_adapter``, then ``lora_path`` in each ``/generate``).

    Each push writes ``v{version}/`` under ``folder`` (a fresh temporary folder by default, removed by :meth:`close`)
    and removes the folder two versions back, so the one an engine still serves from stays until it is replaced.

    A restarted engine rejoins with the adapter the others serve (the last push's, not the trainers' newer weights):
    the router names one adapter in every request, so every server must hold that one. Before the first push the
    engines serve the base weights and a restarted one needs nothing.
    """

    updates_in_place = False  # each request names its adapter: one paused around a push keeps the old one

    def __init__(self, trainers: Any, engines: Any, *, bucket_bytes: int, folder: str | None = None):
        self.trainers, self.engines = trainers, engines
        self._owned = folder is None
        self.root = Path(folder or tempfile.mkdtemp(prefix="rlcore-lora-"))
        self._served: tuple[str, int] | None = None

    def push(self, version: int) -> None:
        path = self.trainers.write_lora_adapter(str(self.root / f"v{version}"))
        self.engines.load_lora_adapter(path, weight_version=version)
        self._served = (path, version)
        shutil.rmtree(self.root / f"v{version - 2}", ignore_errors=True)

    def rejoin(self, replacements: dict[int, Any]) -> None:
        if self._served is None:
            return
        path, version = self._served
        ray.get([a.load_lora_adapter.remote(path, weight_version=version) for a in replacements.values()])

    def close(self) -> None:
        if self._owned:
            shutil.rmtree(self.root, ignore_errors=True)


class IpcSync:
    """Buckets as handles to the trainer's memory, for colocated engines (see the module docstring)."""

    updates_in_place = True

    def __init__(self, trainers: Any, engines: Any, *, bucket_bytes: int):
        self.trainers, self.engines, self.bucket_bytes = trainers, engines, bucket_bytes
        self.dtype = engines.weight_dtype()
        self.bytes_sent = 0

    def push(self, version: int) -> None:
        self.bytes_sent = self.engines.on_all(lambda actors: self._push(actors, version), what="the weight sync")

    def _push(self, actors: list[Any], version: int) -> int:
        return self.trainers.share_buckets(actors, version=version, dtype=self.dtype, bucket_bytes=self.bucket_bytes)

    def rejoin(self, replacements: dict[int, Any]) -> None:
        self._push(list(replacements.values()), self.trainers.version)

    def close(self) -> None:
        pass


class NoSync:
    """No engines or no trainers (the debug modes): there is nothing to move."""

    def __init__(self, trainers: Any, engines: Any, *, bucket_bytes: int):
        pass

    def push(self, version: int) -> None:
        pass

    def rejoin(self, replacements: dict[int, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class DistributedSync:
    """Buckets broadcast over a weight-update group (see the module docstring). ``bucket_sizes`` holds the bytes of
    each bucket of the last push."""

    updates_in_place = True

    def __init__(
        self, trainers: Any, engines: Any, *, bucket_bytes: int, group_name: str = weight_transfer.DEFAULT_GROUP
    ):
        self.trainers, self.engines, self.bucket_bytes, self.group_name = trainers, engines, bucket_bytes, group_name
        self._base_name, self._formed = group_name, 0
        self.dtype = engines.weight_dtype()
        self.bucket_sizes: list[int] = []
        self.bytes_sent = 0
        # One broadcast at a time: a restarted engine's rejoin runs in the engine group's restart thread.
        self._lock = threading.RLock()
        self._broken = False  # a broadcast failed: the group must be formed again
        self._join(list(engines.actors))

    def _join(self, actors: list[Any]) -> None:
        """Form the weight-update group of trainer rank 0 and ``actors``. A group formed again gets a new name: an
        aborted one may not have left (a gloo operation stuck on a hung peer keeps it), and names must be unique."""
        self._formed += 1
        self.group_name = self._base_name if self._formed == 1 else f"{self._base_name}-{self._formed}"
        host, port, self.backend = self.trainers.weight_group_address()
        ranks = ray.get([a.tp_size.remote() for a in actors])
        world_size = 1 + sum(ranks)
        offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
        joins = [
            a.init_weights_update_group.remote(
                host, port, offset, world_size, group_name=self.group_name, backend=self.backend
            )
            for a, offset in zip(actors, offsets, strict=True)
        ]
        trainer = self.trainers.init_weight_group(
            master_address=host,
            master_port=port,
            world_size=world_size,
            group_name=self.group_name,
            backend=self.backend,
        )
        # An engine that dies before joining fails the formation at once (the engine group restarts it and forms the
        # group again); the trainer's side gives up within weight_transfer.JOIN_TIMEOUT_S.
        pending = joins
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            ray.get(ready)
        ray.get(trainer)
        self.members = actors
        self._pushed: int | None = None

    def push(self, version: int) -> None:
        # An engine that dies mid-broadcast fails it at once (the trainer aborts the group, see
        # ``weight_transfer.send_bucket``); it is restarted, rejoins, and the push runs again.
        self.engines.on_all(lambda actors: self._broadcast(actors, version), what="the weight sync")

    @property
    def can_stage(self) -> bool:
        """Whether the engines take a broadcast while they generate (:meth:`stage`, then :meth:`commit`)."""
        kind = getattr(self.engines, "kind", None)
        return bool(getattr(kind, "stages_weights", False))

    def stage(self, version: int) -> None:
        """Broadcast ``version`` into every engine's second buffer while it goes on sampling with the weights it has
        (one-step async: the rollout in flight is not waited on); :meth:`commit` swaps them in."""
        self.engines.on_all(
            lambda actors: self._broadcast(actors, version, method="stage_weights_from_distributed"),
            what="the weight sync",
        )

    def commit(self) -> None:
        """Swap the staged weights in, between two rollouts (each engine's swap waits behind its generate calls)."""
        self.engines.on_all(
            lambda actors: ray.get([a.commit_staged_weights.remote() for a in actors]), what="the weight swap"
        )

    def _broadcast(self, actors: list[Any], version: int, method: str = "update_weights_from_distributed") -> None:
        with self._lock:
            if actors == self.members and self._pushed == version and not self._broken:
                return  # a restart's rejoin already sent this version to every engine
            if actors != self.members or self._broken:  # a restarted engine, or an aborted broadcast
                self._leave()
                self._join(actors)
            self._broken, self._pushed = True, None
            self.bucket_sizes = self.trainers.broadcast_buckets(
                actors,
                version=version,
                dtype=self.dtype,
                bucket_bytes=self.bucket_bytes,
                group_name=self.group_name,
                method=method,
            )
            self._broken, self._pushed = False, version
            self.bytes_sent = sum(self.bucket_sizes)

    def rejoin(self, replacements: dict[int, Any]) -> None:
        # A group has a fixed world: it is formed again with the new engines, and all take the weights.
        with self._lock:
            actors = [replacements.get(i, a) for i, a in enumerate(self.members)]
            self._broadcast(actors, self.trainers.version)

    def _leave(self) -> None:
        # Best effort: a dead member cannot leave, and this also runs while a failed job unwinds.
        with contextlib.suppress(ray.exceptions.RayError):
            ray.wait(
                [a.destroy_weights_update_group.remote(self.group_name) for a in self.members],
                num_returns=len(self.members),
                timeout=30,
            )
        with contextlib.suppress(ray.exceptions.RayError):
            self.trainers.destroy_weight_group()

    def close(self) -> None:
        self._leave()


WEIGHT_SYNCS: dict[str, type[Any]] = {
    "object_store": ObjectStoreSync,
    "disk": DiskSync,
    "nccl": DistributedSync,
    "ipc": IpcSync,
    "lora_adapter": LoraAdapterSync,
}


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


def make_weight_sync(
    trainers: Any, engines: Any, *, bucket_bytes: int, kind: str | None = None, disk: DiskOptions | None = None
) -> WeightSync:
    """The weight sync for ``engines`` (their registry default, or ``kind``); ``disk`` configures disk sync."""
    if not (trainers.actors and engines.actors):
        return NoSync(trainers, engines, bucket_bytes=bucket_bytes)  # a debug mode runs one side only
    kind = kind or engines.weight_sync_kind
    if kind not in WEIGHT_SYNCS:
        raise ValueError(f"weight sync {kind!r} is not one of {', '.join(WEIGHT_SYNCS)}")
    options = {"disk": disk} if kind == "disk" else {}
    sync = WEIGHT_SYNCS[kind](trainers, engines, bucket_bytes=bucket_bytes, **options)
    lock = getattr(trainers, "weights_lock", None)

    def rejoin(replacements: dict[int, Any]) -> None:
        # Under the trainers' weights lock: the weights and ``trainers.version`` change together (the loop trains
        # under it), so a restart while the trainers train (--async) labels the weights it loads honestly.
        with lock if lock is not None else contextlib.nullcontext():
            sync.rejoin(replacements)

    engines.rejoin = rejoin
    return sync
