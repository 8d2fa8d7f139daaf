"""The rules of the rollout schedules (``--rollout-schedule``, :data:`runtime.rollout.source.SCHEDULES`), beside them:
torch-free, so the config checks a job before anything starts. (``--colocate``'s rule on the schedule is with the
other colocate rules, on the composed config: ``runtime.config.checks``.)"""

from __future__ import annotations

from typing import Any


def check(problems: list[str], cfg: Any) -> None:
    """The schedule's settings: staleness against the sync interval, partial rollouts under fully_async only."""
    r = cfg.rollout
    if r.rollout_schedule == "fully_async" and r.max_staleness < r.update_weights_interval - 1:
        problems.append(
            f"--max-staleness {r.max_staleness} must be >= --update-weights-interval {r.update_weights_interval} - 1: "
            "between two weight syncs the engines sample with one version for that many steps"
        )
    if r.partial_rollout and r.rollout_schedule != "fully_async":
        problems.append("--partial-rollout resumes generations cut off at a weight update: it needs --fully-async")
    if r.partial_rollout and r.custom_generate_function_path:
        problems.append(
            "--partial-rollout continues the default generation; it cannot resume a --custom-generate-function-path"
        )
    if r.mask_offpolicy_in_partial_rollout and not r.partial_rollout:
        problems.append("--mask-offpolicy-in-partial-rollout needs --partial-rollout")
