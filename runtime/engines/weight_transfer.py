"""Weights over a ``torch.distributed`` group: both ends of SGLang's ``update_weights_from_distributed`` protocol.

The trainer (rank 0) and every engine rank join one process group of their own, outside any default group, made the
way SGLang 0.5.23 makes it (``sglang.srt.utils.common.init_custom_process_group``: a TCP rendezvous at the trainer's
``master_address:master_port``, a ``PrefixStore`` named after the group, ``_new_process_group_helper``), so the
trainer side here interoperates with a real SGLang server. A weight update is then a series of buckets: the trainer
tells every engine the bucket's ``names`` / ``dtypes`` / ``shapes`` (SGLang's ``UpdateWeightsFromDistributedReqInput``)
and broadcasts each tensor from rank 0, in that order; each engine allocates the tensors, receives them and loads
them. NCCL on GPUs, gloo on the CPU (where the tests run it for real).

The embedded engine (``runtime.engines.hf_engine.HFEngine``) and the test's fake SGLang server receive with
:func:`receive_bucket`; the trainer sends with :func:`send_bucket`.
"""

from __future__ import annotations

from collections.abc import Sequence
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


def init_weights_update_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP,
    backend: str = "nccl",
    timeout: float = 600.0,
) -> Any:
    """Join the weight-update group as ``rank`` of ``world_size`` (rank 0, the trainer, hosts the rendezvous);
    blocks until every rank has joined. Returns the process group."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    wait = timedelta(seconds=timeout)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=wait))
    store.set_timeout(wait)
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), PrefixStore(group_name, store), group_name=group_name, timeout=wait
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_group(group: Any) -> None:
    torch.distributed.destroy_process_group(group)


def bucket_meta(bucket: dict[str, torch.Tensor]) -> tuple[list[str], list[str], list[list[int]]]:
    """``names``, ``dtypes``, ``shapes`` of a bucket, in its order (the fields of SGLang's request)."""
    names = list(bucket)
    return names, [dtype_name(bucket[n].dtype) for n in names], [list(bucket[n].shape) for n in names]


def send_bucket(group: Any, bucket: dict[str, torch.Tensor], *, device: torch.device | str = "cpu") -> int:
    """Broadcast every tensor of ``bucket`` from rank 0 (the caller), in order; returns the bytes sent."""
    sent = 0
    handles = []
    for tensor in bucket.values():
        t = tensor.to(device).contiguous()
        handles.append(torch.distributed.broadcast(t, src=0, group=group, async_op=True))
        sent += t.nbytes
    for handle in handles:
        handle.wait()
    return sent


def receive_bucket(
    group: Any,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    *,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Receive the tensors rank 0 broadcasts for one bucket (described by ``names`` / ``dtypes`` / ``shapes``)."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}")
    out = {}
    handles = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        t = torch.empty(list(shape), dtype=parse_dtype(dtype), device=device)
        handles.append(torch.distributed.broadcast(t, src=0, group=group, async_op=True))
        out[name] = t
    for handle in handles:
        handle.wait()
    return out
