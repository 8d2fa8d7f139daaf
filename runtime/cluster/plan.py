"""The placement a job gets on N GPUs when it names no placement beyond the GPU count.

Three plans use every GPU of a host (``docs/runtime.md``, "Default placement on N GPUs"):

- ``colocated_dp``: the trainer data-parallel over all N GPUs and an engine colocated on each (verl's hybrid engine):
  rollout, log-probs and training each spread over N devices, weights cross by CUDA IPC, nothing overlaps;
- ``split_async``: half the GPUs train (data-parallel), the other half generate, one step apart
  (``--rollout-schedule one_step``): the step costs the longer of rollout and training plus an NCCL weight sync;
- ``one_trainer_async``: one GPU trains, the other N - 1 generate, one step apart (on two GPUs it is
  ``split_async``).

:func:`plan_for` picks from :data:`PLAN_BY_GPUS`, the plan ``tools/bench_scale.py`` measured fastest at each GPU
count (issue 26's job, Qwen3-0.6B, 8 prompts x 8 samples x 512 tokens, medians of steps 2-3); a count it has no entry
for takes the entry of the largest count below it. One GPU colocates (there is nothing to split).

- Two GPUs (two H100s, 2026-11-27, a76d515): one GPU 3.70 s a step; ``colocated_dp`` 4.50 s, its DP=2 train step
  slower than one GPU's; ``split_async`` 1.97 s, 0.53x one GPU's step.
- Four GPUs (four H200s, 2026-11-27, 35335e8): ``one_trainer_async`` 1.58 s, ``split_async`` 1.78 s, against
  ``split_async`` on two of the same GPUs 2.09 s. A second trainer gains nothing at this batch (train 1.35 s at DP=2
  against 1.38 s on one GPU) and its sync gathers FSDP shards (0.22 s against 0.06 s), while a third engine shortens
  the rollout (1.65 s against 1.83 s). ``colocated_dp`` on four GPUs was not measured (its run was cut off): its step
  is the sum of rollout, log-probs, training and sync, and the rollout alone took 1.65 s on three engines (2.10 s on
  one: decoding is bound by its 512 sequential steps more than by the batch), so four colocated engines would leave
  no room under 1.58 s for the rest.

Any placement flag (:data:`PLACEMENT_FLAGS`) means the user chose, and nothing is changed. ``--dry-run`` prints the
plan and this rule (:func:`describe`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# Flags that choose a placement or a schedule: any of them given, the job runs as they say.
PLACEMENT_FLAGS = (
    "colocate",
    "rollout_num_gpus",
    "rollout_num_gpus_per_engine",
    "rollout_schedule",
    "actor_num_nodes",
    "rollout_external_engine_addrs",
    "sglang_url",
    "debug_rollout_only",
    "debug_train_only",
    "load_debug_rollout_data",
)


@dataclass(frozen=True)
class Plan:
    """A default placement: its flag settings for ``gpus`` GPUs, and one line that says what it does."""

    settings: Callable[[int], dict[str, Any]]
    summary: str


PLANS: dict[str, Plan] = {
    "colocated_dp": Plan(
        settings=lambda gpus: {"colocate": True, "actor_num_gpus_per_node": gpus},
        summary="trainer data-parallel over every GPU, an engine colocated on each (CUDA IPC sync, in turns)",
    ),
    "split_async": Plan(
        settings=lambda gpus: {
            "actor_num_gpus_per_node": gpus // 2,
            "rollout_num_gpus": gpus - gpus // 2,
            "rollout_schedule": "one_step",
        },
        summary="half the GPUs train, half generate, one step apart (NCCL sync)",
    ),
    "one_trainer_async": Plan(
        settings=lambda gpus: {
            "actor_num_gpus_per_node": 1,
            "rollout_num_gpus": gpus - 1,
            "rollout_schedule": "one_step",
        },
        summary="one GPU trains, the others generate, one step apart (NCCL sync)",
    ),
}
# GPU count -> the plan measured fastest there (see the module docstring); other counts take the largest entry below.
PLAN_BY_GPUS: dict[int, str] = {1: "colocated_dp", 2: "split_async", 4: "one_trainer_async"}


def plan_for(gpus: int) -> str:
    """The default plan's name on ``gpus`` GPUs (at least 1)."""
    if gpus < 1:
        raise ValueError(f"a plan needs at least one GPU, got {gpus}")
    return PLAN_BY_GPUS[max(n for n in PLAN_BY_GPUS if n <= gpus)]


def default_placement(given: Mapping[str, Any], *, gpus: int) -> dict[str, Any]:
    """The flag settings of the default plan (:func:`plan_for`) for a job that sets the flags ``given`` on ``gpus``
    GPUs: none when there is no GPU or any of :data:`PLACEMENT_FLAGS` is given, even off (``--no-colocate``);
    ``actor_num_gpus_per_node`` given counts the GPUs."""
    if gpus < 1 or any(given.get(flag) is not None for flag in PLACEMENT_FLAGS):
        return {}
    n = given.get("actor_num_gpus_per_node") or gpus
    return PLANS[plan_for(n)].settings(n)


def describe(cfg: Any) -> str:
    """The plan ``cfg`` runs, in one line, and the default rule."""
    res, schedule = cfg.resources, cfg.rollout.rollout_schedule
    trainers, engines = res.num_trainer_procs, res.rollout_num_gpus
    shape = (
        f"{trainers} trainer(s) with an engine colocated on each"
        if res.colocate
        else f"{trainers} trainer device(s) + {engines} engine device(s), schedule {schedule}"
    )
    rule = "; ".join(f"{n} GPU(s): {name}" for n, name in sorted(PLAN_BY_GPUS.items()))
    return (
        f"{shape}. Default with no placement flag, by GPU count ({rule}; more GPUs take the largest count below), "
        "measured fastest (runtime/cluster/plan.py, docs/runtime.md)"
    )
