"""The placement a job gets on N GPUs when it names no placement beyond the GPU count.

Two plans can use every GPU of a host (``docs/runtime.md``, "Default placement on N GPUs"):

- ``colocated_dp``: the trainer data-parallel over all N GPUs and an engine colocated on each (verl's hybrid engine):
  rollout, log-probs and training each spread over N devices, weights cross by CUDA IPC, nothing overlaps;
- ``split_async``: half the GPUs train, the other half generate, one step apart (``--rollout-schedule one_step``):
  the step costs the longer of rollout and training plus an NCCL weight sync.

:data:`DEFAULT_PLAN` is the faster one by the one-GPU breakdown of issue 26's job (Qwen3-0.6B, 8 prompts x 8 samples
x 512 tokens on one H100: rollout 3.85 s, train 1.58 s, IPC sync 0.07 s): spread over N GPUs colocated it costs about
(3.85 + 1.58) / N + sync, while split_async costs at least max(3.85 / (N / 2), 1.58 / (N / 2)) + an NCCL sync, twice
as much on the rollout-bound side. ``tools/bench_scale.py`` measures both; its GPU run is still to be made (the
figures in ``docs/runtime.md`` say what was measured), and the table entry flips if it says otherwise. Any placement
flag (:data:`PLACEMENT_FLAGS`) means the user chose, and nothing is changed. ``--dry-run`` prints the plan and this
rule (:func:`describe`).
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
}
# The faster by the one-GPU breakdown (see the module docstring); tools/bench_scale.py measures it.
DEFAULT_PLAN = "colocated_dp"


def default_placement(given: Mapping[str, Any], *, gpus: int) -> dict[str, Any]:
    """The flag settings of :data:`DEFAULT_PLAN` for a job that sets the flags ``given`` on ``gpus`` GPUs: none when
    there is no GPU or any of :data:`PLACEMENT_FLAGS` is given, even off (``--no-colocate``);
    ``actor_num_gpus_per_node`` given counts the GPUs."""
    if gpus < 1 or any(given.get(flag) is not None for flag in PLACEMENT_FLAGS):
        return {}
    n = given.get("actor_num_gpus_per_node") or gpus
    return PLANS[DEFAULT_PLAN].settings(n)


def describe(cfg: Any) -> str:
    """The plan ``cfg`` runs, in one line, and the default rule."""
    res, schedule = cfg.resources, cfg.rollout.rollout_schedule
    trainers, engines = res.num_trainer_procs, res.rollout_num_gpus
    shape = (
        f"{trainers} trainer(s) with an engine colocated on each"
        if res.colocate
        else f"{trainers} trainer device(s) + {engines} engine device(s), schedule {schedule}"
    )
    return (
        f"{shape}. Default on N GPUs with no placement flag: {DEFAULT_PLAN} ({PLANS[DEFAULT_PLAN].summary}), "
        "the faster by the one-GPU rollout/train breakdown (runtime/cluster/plan.py, docs/runtime.md)"
    )
