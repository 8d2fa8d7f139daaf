"""Collectives that run on a device the process group's backend serves, whatever device the tensor is on.

A data-parallel group under NCCL reduces CUDA tensors only, while the math here often holds its small statistics on
the CPU (a shard's advantages come back from the log-prob forward as CPU tensors): all-reducing one of those over
NCCL fails (``No backend type associated with device type cpu``). :func:`all_reduce` moves the tensor to the
current CUDA device for the reduction when the backend serves no CPU tensors and back afterwards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

# The device types each torch.distributed backend reduces tensors of.
BACKEND_DEVICES: dict[str, tuple[str, ...]] = {
    "gloo": ("cpu", "cuda"),
    "nccl": ("cuda",),
    "mpi": ("cpu", "cuda"),
}


def served_devices(group: dist.ProcessGroup) -> tuple[str, ...]:
    """The device types ``group``'s backend reduces; a device-qualified backend (``"cpu:gloo,cuda:nccl"``) serves
    the devices it names."""
    backend = str(dist.get_backend(group))
    if ":" in backend:
        return tuple(part.split(":", 1)[0] for part in backend.split(","))
    if backend not in BACKEND_DEVICES:
        raise ValueError(f"process group backend {backend!r} is not one of {', '.join(BACKEND_DEVICES)}")
    return BACKEND_DEVICES[backend]


def reduce_device(group: dist.ProcessGroup, tensor: Tensor) -> torch.device:
    """Where a collective of ``tensor`` over ``group`` runs: its own device when the backend serves it, else the
    current CUDA device (NCCL and a CPU tensor)."""
    served = served_devices(group)
    if tensor.device.type in served:
        return tensor.device
    if "cuda" in served:
        return torch.device("cuda", torch.cuda.current_device())
    raise ValueError(f"process group backend {dist.get_backend(group)!r} reduces no {tensor.device.type} tensors")


def all_reduce(tensor: Tensor, *, group: dist.ProcessGroup | None, op: dist.ReduceOp = dist.ReduceOp.SUM) -> Tensor:
    """``tensor`` reduced with ``op`` over ``group`` (itself without one), as a new tensor on ``tensor``'s device;
    the input is not modified. Not differentiable (the result is detached)."""
    if group is None:
        return tensor.detach().clone()
    device = reduce_device(group, tensor)
    out = tensor.detach().to(device, copy=True)
    dist.all_reduce(out, op=op, group=group)
    return out.to(tensor.device)
