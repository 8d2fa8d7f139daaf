"""Ray for one job: a local Ray sized to the job (every listener on the loopback), or the cluster ``RAY_ADDRESS``
names."""

from __future__ import annotations

import os

import ray

from runtime.cluster.loopback import RAY_ADDRESS_ENV, confine_ray
from runtime.config import Config


def usable_cpus() -> int:
    """The cores this process may run on (its affinity mask, e.g. under ``taskset`` or a cpuset), not the host's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def init_ray(cfg: Config) -> bool:
    """Start a local Ray (or join the cluster ``RAY_ADDRESS`` names) if none is running; returns whether this call
    started it."""
    if ray.is_initialized():
        return False
    if os.environ.get(RAY_ADDRESS_ENV):
        # A Ray cluster of several nodes, started by the user: joined as it is (its listeners are its own).
        ray.init(address=os.environ[RAY_ADDRESS_ENV], log_to_driver=False)
        return True
    res = cfg.resources
    slots = res.num_trainer_procs + (0 if res.colocate else res.rollout_num_gpus)
    # A single-node job: every Ray listener on 127.0.0.1 (runtime.cluster.loopback; token authentication, Ray's
    # default for a cluster ray.init starts, stays on for its gRPC servers as well).
    confine_ray()
    # On a CPU-only machine a slot is a logical CPU: the job's actors take turns, so slots may exceed cores.
    ray.init(num_cpus=max(usable_cpus(), slots), include_dashboard=False, log_to_driver=False)
    return True
