"""Weights over a ``torch.distributed`` group: both ends of SGLang's ``update_weights_from_distributed`` protocol.

The trainer (rank 0) and every engine rank join one process group of their own, outside any default group, made the
way SGLang 0.5.23 makes it (``sglang.srt.utils.common.init_custom_process_group``: a TCP rendezvous at the trainer's
``master_address:master_port``, a ``PrefixStore`` named after the group, ``_new_process_group_helper``), so the
trainer side here interoperates with a real SGLang server. A weight update is then a series of buckets: the trainer
tells every engine the bucket's ``names`` / ``dtypes`` / ``shapes`` (SGLang's ``UpdateWeightsFromDistributedReqInput``)
and broadcasts it from rank 0: under ``load_format="flattened_bucket"`` (:data:`FLAT`, what the trainers send) as one
``uint8`` buffer of the tensors' bytes back to back, which each engine receives whole and unpacks as views; without
it, each tensor in that order. NCCL on GPUs, gloo on the CPU (where the tests run it for real).

The embedded engine (``runtime.engines.hf_engine.HFEngine``) and the test's fake SGLang server receive with
:func:`receive_bucket`; the trainer sends with :func:`send_bucket`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

DEFAULT_GROUP = "weight_update_group"
BACKENDS = ("nccl", "gloo")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the form SGLang's request carries)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


# How long forming a weight-update group waits for its members. Every member is up when formation starts (the
# engines answer before they are asked to join), so joining takes seconds; a member that died meanwhile fails the
# formation after this, and the engine group restarts it and forms the group again.
JOIN_TIMEOUT_S = 60.0


def init_weights_update_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP,
    backend: str = "nccl",
    timeout: float = 600.0,
    join_timeout: float = JOIN_TIMEOUT_S,
) -> Any:
    """Join the weight-update group as ``rank`` of ``world_size`` (rank 0, the trainer, hosts the rendezvous);
    blocks until every rank has joined, for ``join_timeout`` seconds at most (a member that died before joining
    fails the formation then, not after the group's ``timeout``, which bounds its operations). Returns the process
    group."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    wait, join = timedelta(seconds=timeout), timedelta(seconds=min(join_timeout, timeout))
    url = f"tcp://{master_address}:{master_port}"
    try:
        store, rank, world_size = next(rendezvous(url, rank, world_size, timeout=join))
        # Forming the group waits on the store for every member's address: bounded by the join timeout too.
        store.set_timeout(join)
        group, _ = _new_process_group_helper(
            world_size, rank, [], Backend(backend), PrefixStore(group_name, store), group_name=group_name, timeout=wait
        )
    except (RuntimeError, TimeoutError) as err:  # torch's DistStoreError is a RuntimeError
        raise TimeoutError(
            f"weight-update group {group_name!r} ({url}, {world_size} members): rank {rank} gave up after "
            f"waiting {join.total_seconds():g} s for the others to join ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''})"
        ) from err
    store.set_timeout(wait)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_group(group: Any) -> None:
    torch.distributed.destroy_process_group(group)


def bucket_meta(bucket: dict[str, torch.Tensor]) -> tuple[list[str], list[str], list[list[int]]]:
    """``names``, ``dtypes``, ``shapes`` of a bucket, in its order (the fields of SGLang's request)."""
    names = list(bucket)
    return names, [dtype_name(bucket[n].dtype) for n in names], [list(bucket[n].shape) for n in names]


class SendAborted(RuntimeError):
    """A broadcast was given up because a receiver failed (see :func:`send_bucket`); its group is unusable."""


def abort_group(group: Any) -> None:
    """Abort ``group``'s communicators, best effort (NCCL unblocks its pending operations this way; gloo's abort does
    not, so a gloo operation that waits on a hung peer is left behind until the group's timeout)."""
    try:
        group.abort()
    except Exception:  # noqa: BLE001  (a group already broken may refuse; nothing more can be done with it)
        pass


# SGLang's ``load_format`` for a bucket sent as one flat buffer (``UpdateWeightsFromDistributedReqInput.load_format``;
# ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorBucket``): the bucket's tensors' bytes back to back, in its
# order, with no padding, broadcast as one ``uint8`` tensor. One collective per bucket instead of one per tensor.
FLAT = "flattened_bucket"
# How a bucket crosses: ``load_format`` -> whether it goes as one flat buffer.
LOAD_FORMATS: dict[str | None, bool] = {None: False, FLAT: True}


def _flat_of(load_format: str | None) -> bool:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)}, got {load_format!r}")
    return LOAD_FORMATS[load_format]


def flat_layout(
    names: Sequence[str], dtypes: Sequence[str | torch.dtype], shapes: Sequence[Sequence[int]]
) -> tuple[list[tuple[str, torch.dtype, torch.Size, int, int]], int]:
    """Where each tensor of a flat bucket lies: ``[(name, dtype, shape, first byte, end byte)]`` and the total bytes.
    As SGLang's receiver does, refuses an empty bucket and a tensor whose offset is not a multiple of its element
    size (its bytes could not be viewed as its dtype in place)."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}")
    if not names:
        raise ValueError("a flat bucket needs at least one tensor")
    layout, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        dtype = dtype if isinstance(dtype, torch.dtype) else parse_dtype(dtype)
        shape = torch.Size(shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"tensor {name!r} of a flat bucket has a negative dimension: {list(shape)}")
        if offset % dtype.itemsize:
            raise ValueError(
                f"tensor {name!r} of a flat bucket starts at byte {offset}, not a multiple of {dtype}'s size"
            )
        end = offset + shape.numel() * dtype.itemsize
        layout.append((name, dtype, shape, offset, end))
        offset = end
    return layout, offset


def pack_bucket(bucket: dict[str, torch.Tensor], *, device: torch.device | str = "cpu") -> torch.Tensor:
    """``bucket``'s tensors as one flat ``uint8`` buffer on ``device`` (:data:`FLAT`'s layout): each copied once into
    its place, from wherever it lies."""
    layout, total = flat_layout(*bucket_meta(bucket))
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    for name, dtype, shape, start, end in layout:
        flat[start:end].view(dtype).view(shape).copy_(bucket[name])
    return flat


def unpack_bucket(
    flat: torch.Tensor, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
) -> dict[str, torch.Tensor]:
    """The tensors of a flat bucket as views of ``flat`` (no copy): the inverse of :func:`pack_bucket`."""
    layout, total = flat_layout(names, dtypes, shapes)
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() != total:
        raise ValueError(f"a flat bucket of these tensors is {total} uint8 bytes, got {flat.dtype} {list(flat.shape)}")
    return {name: flat[start:end].view(dtype).view(shape) for name, dtype, shape, start, end in layout}


@dataclass
class Sending:
    """A bucket's broadcasts in flight (:func:`start_bucket`): their handles and the tensors they send, held here
    until :func:`finish_bucket` (a flat buffer packed for the send has no other owner)."""

    handles: list[Any]
    tensors: list[torch.Tensor]


def start_bucket(
    group: Any, bucket: dict[str, torch.Tensor], *, device: torch.device | str = "cpu", load_format: str | None = None
) -> Sending:
    """Enqueue the broadcast of ``bucket`` from rank 0 (the caller) and return at once (:func:`finish_bucket` waits
    on it): as one flat buffer under ``load_format=FLAT`` (packed on ``device``), else every tensor in order, one
    already on ``device`` sent from where it lies (no copy); the caller keeps ``bucket`` alive until then. Aborts
    the group when an enqueue fails."""
    flat = _flat_of(load_format)
    try:
        if flat:
            tensors = [pack_bucket(bucket, device=device)]
        else:
            tensors = [
                t if t.device == torch.device(device) and t.is_contiguous() else t.to(device).contiguous()
                for t in bucket.values()
            ]
        handles = [torch.distributed.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
    except BaseException:
        abort_group(group)
        raise
    return Sending(handles, tensors)


def finish_bucket(
    group: Any, sending: Sending, *, failed: Callable[[], str | None] | None = None, poll_s: float = 0.01
) -> None:
    """Wait for the broadcasts ``sending`` of :func:`start_bucket`. ``failed`` (polled every ``poll_s`` seconds while
    they run) says why they cannot complete, e.g. that a receiver's call failed or its process died: the group is
    then aborted and :class:`SendAborted` raised at once, instead of waiting for the group's timeout (a collective
    with a dead peer never completes under NCCL). A broadcast that fails by itself aborts the group too, so that no
    live receiver waits on it. Either way the group must not be used again."""
    handles = sending.handles
    try:
        if failed is not None:
            while not all(h.is_completed() for h in handles):
                reason = failed()
                if reason is not None:
                    raise SendAborted(f"the weight broadcast was aborted: {reason}")
                time.sleep(poll_s)
        for handle in handles:
            handle.wait()
    except BaseException:
        abort_group(group)
        raise


def send_bucket(
    group: Any,
    bucket: dict[str, torch.Tensor],
    *,
    device: torch.device | str = "cpu",
    failed: Callable[[], str | None] | None = None,
    poll_s: float = 0.01,
    load_format: str | None = None,
) -> int:
    """Broadcast ``bucket`` from rank 0 (the caller) and wait until it is sent (:func:`start_bucket` then
    :func:`finish_bucket`); returns the bytes sent."""
    sending = start_bucket(group, bucket, device=device, load_format=load_format)
    finish_bucket(group, sending, failed=failed, poll_s=poll_s)
    return sum(t.nbytes for t in bucket.values())


def receive_bucket(
    group: Any,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    *,
    device: torch.device | str = "cpu",
    load_format: str | None = None,
) -> dict[str, torch.Tensor]:
    """Receive the tensors rank 0 broadcasts for one bucket (described by ``names`` / ``dtypes`` / ``shapes``): one
    flat buffer under ``load_format=FLAT``, its tensors views of it, else one broadcast per tensor."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}")
    if _flat_of(load_format):
        _, total = flat_layout(names, dtypes, shapes)
        flat = torch.empty(total, dtype=torch.uint8, device=device)
        torch.distributed.broadcast(flat, src=0, group=group)
        return unpack_bucket(flat, names, dtypes, shapes)
    out = {}
    handles = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        t = torch.empty(list(shape), dtype=parse_dtype(dtype), device=device)
        handles.append(torch.distributed.broadcast(t, src=0, group=group, async_op=True))
        out[name] = t
    for handle in handles:
        handle.wait()
    return out


# ---- Tensors by handle: SGLang's ``update_weights_from_tensor`` -------------------------------------------------
#
# A colocated engine shares the trainer's device, so a bucket crosses as handles to the trainer's own memory, not as
# bytes: CUDA IPC handles for GPU tensors, shared-memory files for CPU ones (torch's ``ForkingPickler`` reductions,
# as SGLang's ``MultiprocessingSerializer`` uses them). The receiver copies the tensors into its model before it
# answers, and the sender keeps the bucket alive until then. Over HTTP SGLang takes each rank's payload base64-coded.


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> bytes:
    """``[(name, tensor), ...]`` -> bytes holding handles to the tensors' memory (not their data).

    CPU tensors are shared through named shared-memory files (torch's ``file_system`` strategy, set for this
    process), which any process of the machine can open; GPU tensors through CUDA IPC handles.
    """
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)

    torch.multiprocessing.set_sharing_strategy("file_system")
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump([(name, t.detach()) for name, t in named])
    return buffer.getvalue()


def deserialize_named_tensors(payload: bytes | str) -> list[tuple[str, torch.Tensor]]:
    """The inverse of :func:`serialize_named_tensors` (``str``: its base64 form, as SGLang's HTTP route takes it)."""
    import base64
    import pickle

    import torch.multiprocessing  # noqa: F401  (registers the reductions' rebuild functions)

    if isinstance(payload, str):
        payload = base64.b64decode(payload)
    named = pickle.loads(payload)
    if not isinstance(named, list) or not all(
        isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)
        for item in named
    ):
        raise ValueError("a serialized weight bucket must be a list of (name, tensor) pairs")
    return named
