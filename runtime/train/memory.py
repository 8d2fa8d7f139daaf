"""slime's CUDA memory snapshots in the trainer processes (``--record-memory-history``).

The CUDA caching allocator records every allocation with its stack from the trainer's start; the history is dumped as
a pickle that https://pytorch.org/memory_viz reads, once after rollout ``--memory-snapshot-num-steps - 1`` has trained
(recording stops then) and whenever the allocator runs out of memory. One file per rank, in
``--memory-snapshot-dir``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

# Allocations kept in the history (slime's setting).
MAX_ENTRIES = 1_000_000


class MemoryHistory:
    """The allocator history of this process: started on construction, dumped by :meth:`step` and on OOM."""

    def __init__(self, folder: str, *, rank: int, num_steps: int | None):
        if not torch.cuda.is_available():
            raise RuntimeError("--record-memory-history records the CUDA allocator: this trainer has no CUDA device")
        self.folder, self.rank, self.num_steps = folder, rank, num_steps
        os.makedirs(folder, exist_ok=True)
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="all")
        self.recording = True
        torch._C._cuda_attach_out_of_memory_observer(self._on_oom)

    def path(self, what: str) -> str:
        return os.path.join(self.folder, f"memory_snapshot_time{time.time():.0f}_rank{self.rank}_{what}.pickle")

    def _on_oom(self, device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        torch.cuda.memory._dump_snapshot(self.path("oom"))

    def step(self, rollout_id: int) -> str | None:
        """After rollout ``rollout_id`` trained: the snapshot's path if this is the last recorded step, else None."""
        if not self.recording or self.num_steps is None or rollout_id != self.num_steps - 1:
            return None
        path = self.path(f"step{rollout_id}")
        torch.cuda.memory._dump_snapshot(path)
        torch.cuda.memory._record_memory_history(enabled=None)
        self.recording = False
        return path


def memory_history(options: Any, *, rank: int) -> MemoryHistory | None:
    """The process's :class:`MemoryHistory` when ``options`` (the job's ``DebugConfig``) asks for one."""
    if not options.record_memory_history or "train_overall" not in options.profile_target:
        return None
    return MemoryHistory(options.memory_snapshot_dir, rank=rank, num_steps=options.memory_snapshot_num_steps)
