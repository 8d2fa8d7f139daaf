"""The ``debug`` section of the config: slime's debug and replay modes (save and replay rollouts and training batches,
train-only and rollout-only jobs, the CUDA allocator's memory history), read by the loop and the job
(``runtime.loop``, ``runtime.job``), the replay functions (``runtime.rollout.replay``) and the memory recorder
(``runtime.train.memory``). Torch-free: ``runtime.config`` composes :class:`DebugConfig` into
:class:`~runtime.config.Config`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from runtime.option_fields import described, slime

# slime's forge rollout function (--load-forge-rollout-data), by slime's path and ours.
FORGE_ROLLOUT_PATHS = ("slime.rollout.forge_load.generate_rollout", "runtime.rollout.replay.forge_rollout")


@dataclass(frozen=True)
class DebugConfig:
    """slime's debug and replay modes: how to bisect train against rollout problems."""

    save_debug_rollout_data: str | None = field(
        default=None,
        metadata=described(
            "save each step's rollout samples to this path formatted with {rollout_id}",
            slime=slime("debug", None, note="evaluation rollouts are not saved"),
        ),
    )
    load_debug_rollout_data: str | None = field(
        default=None,
        metadata=described(
            "replay saved rollouts (path formatted with {rollout_id}) instead of generating; no engines",
            slime=slime("mode", None),
        ),
    )
    load_debug_rollout_data_subsample: float | None = field(
        default=None,
        metadata=described("replay about this fraction of each saved rollout, in (0, 1]", slime=slime("debug", None)),
    )
    load_forge_rollout_data: str | None = field(
        default=None,
        metadata=described(
            "the saved rollout (a path, or formatted with {rollout_id}; missing steps fall back to 0) that "
            "--rollout-function-path slime.rollout.forge_load.generate_rollout returns; engines stay live",
            slime=slime(
                "debug",
                None,
                note="read by --rollout-function-path slime.rollout.forge_load.generate_rollout (engines stay live)",
            ),
        ),
    )
    save_debug_train_data: str | None = field(
        default=None,
        metadata=described(
            "save each step's training batch to this path formatted with {rollout_id}",
            slime=slime("debug", None, differs="one file per step: the whole batch, from the driver"),
        ),
    )
    dump_details: str | None = field(
        default=None,
        metadata=described(
            "a folder: sets --save-debug-rollout-data DIR/rollout_data/{rollout_id}.pt and "
            "--save-debug-train-data DIR/train_data/{rollout_id}.pt",
            slime=slime("debug", None),
        ),
    )
    debug_rollout_only: bool = field(
        default=False, metadata=described("generate and score rollouts only: no trainers", slime=slime("mode", False))
    )
    record_memory_history: bool = field(
        default=False,
        metadata=described(
            "record the trainers' CUDA allocator history; dump it at a step and on OOM (memory_viz pickles)",
            slime=slime("megatron (reset by slime)", False, note="the trainers' CUDA allocator; needs CUDA"),
        ),
    )
    memory_snapshot_dir: str = field(
        default=".", metadata=described("folder of the memory snapshots", slime=slime("debug", "."))
    )
    memory_snapshot_num_steps: int | None = field(
        default=None,
        metadata=described(
            "dump the snapshot after this many rollouts trained (unset: on OOM only)", slime=slime("debug", None)
        ),
    )
    memory_recorder: Literal["torch", "memray"] = field(
        default="torch",
        metadata=described(
            "torch: the CUDA allocator's history (memray is not built)",
            slime=slime("debug", "torch", differs="torch only (memray is not a dependency)"),
        ),
    )
    profile_target: list[str] = field(
        default_factory=lambda: ["train_overall"],
        metadata=described(
            "what is profiled: train_overall (the memory history; the others need Megatron's profiler)",
            slime=slime(
                "debug",
                ["train_overall"],
                differs="train_overall only (train_actor / "
                "train_log_probs are Megatron's --use-pytorch-profiler targets)",
            ),
        ),
    )
    debug_train_only: bool = field(
        default=False,
        metadata=described(
            "train only, on --load-debug-rollout-data: no engines, no evaluation",
            slime=slime("mode", False, differs="needs --load-debug-rollout-data"),
        ),
    )

    @property
    def rollout_data_path(self) -> str | None:
        """Where rollouts are saved: ``--save-debug-rollout-data``, or ``--dump-details``' folder."""
        if self.save_debug_rollout_data is None and self.dump_details is not None:
            return os.path.join(self.dump_details, "rollout_data", "{rollout_id}.pt")
        return self.save_debug_rollout_data

    @property
    def train_data_path(self) -> str | None:
        """Where training batches are saved: ``--save-debug-train-data``, or ``--dump-details``' folder."""
        if self.save_debug_train_data is None and self.dump_details is not None:
            return os.path.join(self.dump_details, "train_data", "{rollout_id}.pt")
        return self.save_debug_train_data

    @property
    def train_only(self) -> bool:
        """No engines: ``--debug-train-only``, which ``--load-debug-rollout-data`` implies (as in slime)."""
        return self.debug_train_only or self.load_debug_rollout_data is not None
