"""A colocated trainer's state off its GPU and back: optimizer state first, then weights, in buckets.

When the colocated job decides to offload (``--offload-train``, or ``auto`` once trainer and engine do not fit their
GPU together; ``runtime.colocation.Offload``), the engine has given back its KV cache and weights first, and the
trainer then moves its state out with :class:`HostOffload`:

- :func:`bucket_plan` orders the tensors (every optimizer tensor before every weight, each kind in its own order) and
  cuts them into buckets of at most ``bucket_bytes`` (a larger tensor is a bucket of its own);
- each bucket is copied into a host buffer of its own on a side stream, so the copies run while the host enqueues
  the next ones; the buffers are pinned (page-locked: the copies are DMA at full PCIe speed and asynchronous) and
  kept for the next offload while a bucket's tensors (names, dtypes, shapes) stay the same, so they are allocated
  once;
- once a bucket's copy is done its tensors point at their host copies (``tensor.data``; parameters and optimizer
  entries keep their identity, so the optimizer and the model see the same objects) and the GPU memory is freed;
- :meth:`HostOffload.resume` allocates the GPU tensors again and copies back on the side stream, in the same order.

On the CPU (tests) the same code runs with plain host buffers and no streams, so the path is tested end to end.
The metrics declare their reduction over trainer ranks here, where they are made (:data:`METRICS`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

# The order state leaves the GPU: the optimizer's first (it is not needed until the next optimizer step).
KINDS = ("optimizer", "weights")
DEFAULT_BUCKET_BYTES = 256 * 2**20
# Host-buffer offsets are rounded up to this, so that every view of a buffer is aligned for its dtype.
ALIGN = 64

# How each metric combines over trainer ranks: bytes add up, times are the slowest rank's.
METRICS = {
    "perf/offload_train_bytes": "sum",
    "perf/offload_train_time": "max",
    "perf/offload_train_resume_time": "max",
}
_REDUCE = {"sum": sum, "max": max}


@dataclass(frozen=True)
class Piece:
    """One tensor to move: its kind (one of :data:`KINDS`), a name for messages, its size in bytes."""

    kind: str
    name: str
    nbytes: int


def bucket_plan(pieces: Sequence[Piece], *, bucket_bytes: int) -> list[list[int]]:
    """The buckets (lists of indices into ``pieces``) in moving order.

    Every ``optimizer`` piece comes before every ``weights`` piece, each kind in its given order; a bucket holds
    consecutive pieces of one kind whose bytes add up to at most ``bucket_bytes``, closed when the next piece would
    not fit (a piece larger than ``bucket_bytes`` is a bucket of its own).
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be an int >= 1, got {bucket_bytes!r}")
    for p in pieces:
        if p.kind not in KINDS:
            raise ValueError(f"piece {p.name!r}: kind must be one of {KINDS}, got {p.kind!r}")
        if p.nbytes < 0:
            raise ValueError(f"piece {p.name!r}: nbytes must be >= 0, got {p.nbytes}")
    order = sorted(range(len(pieces)), key=lambda i: KINDS.index(pieces[i].kind))
    buckets: list[list[int]] = []
    size = 0
    for i in order:
        p = pieces[i]
        if buckets and pieces[buckets[-1][-1]].kind == p.kind and size + p.nbytes <= bucket_bytes:
            buckets[-1].append(i)
            size += p.nbytes
        else:
            buckets.append([i])
            size = p.nbytes
    return buckets


def reduce_over_ranks(per_rank: Iterable[dict[str, float] | None]) -> dict[str, float]:
    """Each rank's offload metrics combined as :data:`METRICS` declares (ranks that report none are skipped)."""
    reports = [r for r in per_rank if r]
    names = {name for r in reports for name in r}
    unknown = sorted(names - set(METRICS))
    if unknown:
        raise ValueError(f"offload metrics without a declared reduction: {unknown}")
    return {name: float(_REDUCE[METRICS[name]](r[name] for r in reports if name in r)) for name in sorted(names)}


def module_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A module's parameters and buffers, each tensor once (tied weights under their first name)."""
    seen: set[int] = set()
    out = []
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


def optimizer_tensors(optimizer: torch.optim.Optimizer, *, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """An optimizer's state tensors (AdamW's moments; its CPU step counts too, which then stay where they are)."""
    out = []
    for i, state in enumerate(optimizer.state.values()):
        for key, value in state.items():
            if torch.is_tensor(value):
                out.append((f"{prefix}state[{i}].{key}", value))
    return out


class HostOffload:
    """Moves tensors of a device to host buffers in buckets and back (see the module docstring).

    ``offload`` takes ``(kind, name, tensor)`` triples; the tensors keep their identity and only their ``.data``
    moves. Tensors that are not on ``device`` are left alone.
    """

    def __init__(self, device: torch.device, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        bucket_plan([], bucket_bytes=bucket_bytes)  # checks bucket_bytes
        self.device, self.bucket_bytes = torch.device(device), bucket_bytes
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._signatures: list[tuple] = []
        self._buffers: list[torch.Tensor] = []
        self._held: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # (tensor, its host view), moving order
        self.buffer_allocations = 0

    @property
    def offloaded(self) -> bool:
        return self._held is not None

    def offload(self, tensors: Iterable[tuple[str, str, torch.Tensor]]) -> dict[str, float]:
        """Move ``tensors`` to the host; ``{"perf/offload_train_bytes", "perf/offload_train_time"}``."""
        if self._held is not None:
            raise RuntimeError("HostOffload.offload: already offloaded; resume() first")
        start = time.perf_counter()
        items = [(kind, name, t) for kind, name, t in tensors if t.device == self.device]
        pieces = [Piece(kind, name, t.numel() * t.element_size()) for kind, name, t in items]
        plan = bucket_plan(pieces, bucket_bytes=self.bucket_bytes)
        self._ensure_buffers(plan, items)
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        views: dict[int, torch.Tensor] = {}
        events = []
        for buffer, bucket in zip(self._buffers, plan, strict=True):
            offset = 0
            with self._on_side():
                for i in bucket:
                    t = items[i][2]
                    nbytes = pieces[i].nbytes
                    view = buffer[offset : offset + nbytes].view(t.dtype).view(t.shape)
                    view.copy_(t.data, non_blocking=self.cuda)
                    views[i] = view
                    offset += _aligned(nbytes)
            events.append(self.stream.record_event() if self.cuda else None)
        held = []
        for event, bucket in zip(events, plan, strict=True):
            if event is not None:
                event.synchronize()
            for i in bucket:
                tensor = items[i][2]
                tensor.data = views[i]  # the device memory's last reference goes: it is freed
                held.append((tensor, views[i]))
        self._held = held
        if self.cuda:
            torch.cuda.empty_cache()
        return {
            "perf/offload_train_bytes": float(sum(p.nbytes for p in pieces)),
            "perf/offload_train_time": time.perf_counter() - start,
        }

    def resume(self) -> dict[str, float]:
        """Bring back what :meth:`offload` moved; ``{"perf/offload_train_resume_time"}`` (nothing when nothing is
        offloaded)."""
        if self._held is None:
            return {}
        start = time.perf_counter()
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for tensor, view in self._held:
            back = torch.empty(view.shape, dtype=view.dtype, device=self.device)
            with self._on_side():
                back.copy_(view, non_blocking=self.cuda)
            tensor.data = back
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            torch.cuda.current_stream(self.device).synchronize()
        self._held = None
        return {"perf/offload_train_resume_time": time.perf_counter() - start}

    def _on_side(self):
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def _ensure_buffers(self, plan: list[list[int]], items: list[tuple[str, str, torch.Tensor]]) -> None:
        """One host buffer per bucket; a bucket whose tensors (kinds, names, dtypes, shapes) are those of a bucket
        of the last offload keeps its buffer (buckets never mix kinds, so the weights' buffers outlive the optimizer
        state appearing after the first step)."""
        kept = dict(zip(self._signatures, self._buffers, strict=True))
        signatures = [
            tuple((items[i][0], items[i][1], items[i][2].dtype, tuple(items[i][2].shape)) for i in bucket)
            for bucket in plan
        ]
        buffers = []
        for signature, bucket in zip(signatures, plan, strict=True):
            buffer = kept.pop(signature, None)
            if buffer is None:
                size = sum(_aligned(items[i][2].numel() * items[i][2].element_size()) for i in bucket)
                buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.cuda)
                self.buffer_allocations += 1
            buffers.append(buffer)
        self._signatures, self._buffers = signatures, buffers


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN
