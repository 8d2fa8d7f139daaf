"""The ``resources`` section of the config: processes and devices (trainers, engines, colocation), read by the job's
plan and placement (``runtime.cluster.plan``, ``runtime.cluster.placement``) and the colocation rules
(``runtime.colocation``). Torch-free: ``runtime.config`` composes :class:`ResourceConfig` into
:class:`~runtime.config.Config`; :func:`local_gpus` counts this machine's GPUs without importing torch."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from runtime.option_fields import bounded, described, slime


@dataclass(frozen=True)
class ResourceConfig:
    """Processes and devices. On a CPU-only machine a "gpu" is a process (a CPU slot)."""

    colocate: bool = field(
        default=False,
        metadata=described(
            "trainer and engine share devices, offloading in turns",
            slime=slime(
                "cluster",
                False,
                differs="the embedded engine offloads only when trainer and "
                "engine do not fit their GPU together (auto)",
            ),
        ),
    )
    actor_num_nodes: int = field(
        default=1,
        metadata=bounded(
            gt=0,
            help="nodes for the trainer",
            slime=slime(
                "cluster",
                1,
                differs="above 1 only when rlcore-run joins a Ray cluster "
                "(RAY_ADDRESS); its own Ray is one node on 127.0.0.1",
            ),
        ),
    )
    actor_num_gpus_per_node: int = field(
        default=8,
        metadata=bounded(
            gt=0,
            help="trainer processes per node (GPUs, or CPU slots)",
            slime=slime("cluster", 8, note="built-in job: 1 (on a CPU a GPU is a process)"),
        ),
    )
    rollout_num_gpus: int | None = field(
        default=None,
        metadata=bounded(
            gt=0,
            help="rollout engine devices in all (or CPU slots); unset: the trainers' (--actor-num-nodes x "
            "--actor-num-gpus-per-node) under --colocate, as slime derives it, else one engine's "
            "(--rollout-num-gpus-per-engine), where slime needs it given",
            slime=slime(
                "cluster",
                None,
                differs="unset: the trainers' GPUs under --colocate (slime's rule), else "
                "one engine's (slime needs it given); with --rollout-external-engine-addrs one engine's per server "
                "(slime asks each server for its GPUs)",
            ),
        ),
    )
    num_gpus_per_node: int = field(
        default=8,
        metadata=bounded(
            gt=0,
            help="GPUs per node for the rollout engines: launched SGLang server i gets --random-seed --seed + i x "
            "this (slime's), and one engine may not span more (multi-node servers are not built)",
            slime=slime(
                "cluster",
                8,
                note="launched server i gets --random-seed --seed + i x this; an engine "
                "wider than it (a multi-node server) is refused",
            ),
        ),
    )

    @property
    def num_trainer_procs(self) -> int:
        """Data-parallel trainer processes: ``actor_num_nodes * actor_num_gpus_per_node``."""
        return self.actor_num_nodes * self.actor_num_gpus_per_node


# One folder per NVIDIA GPU the driver has.
NVIDIA_GPUS_DIR = "/proc/driver/nvidia/gpus"


def local_gpus() -> int:
    """NVIDIA devices this process sees (the built-in job runs on this machine alone): the driver's GPUs, as many as
    ``CUDA_VISIBLE_DEVICES`` leaves. Read without torch, which the front end does not import (torch's own count
    initialises CUDA's runtime for it)."""
    try:
        present = len(os.listdir(NVIDIA_GPUS_DIR))
    except OSError:
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return present
    # CUDA takes the listed devices up to the first that is no device (empty, or negative as in "-1").
    listed = 0
    for entry in visible.split(","):
        if not entry.strip() or entry.strip().startswith("-"):
            break
        listed += 1
    return min(present, listed)
