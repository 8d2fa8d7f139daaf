"""The rollout schedules' own options (``--rollout-schedule``, :data:`runtime.rollout.source.SCHEDULES`) and their
rules, beside them: torch-free, so the config checks a job before anything starts. A schedule with fields of its own
declares them in a dataclass here; ``runtime.config`` composes them into its ``rollout`` section
(``cfg.rollout.max_staleness``), refuses them under another schedule, and runs the chosen schedule's ``check``.
(``--colocate``'s rule on the schedule is with the other colocate rules, on the composed config:
``runtime.config.checks``.)"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

from runtime.option_fields import bounded, described, own_fields, slime


@dataclass(frozen=True)
class FullyAsyncOptions:
    """The fully-async schedule's settings: admission control and partial rollouts."""

    OWN = "a setting of the fully-async schedule (--fully-async)"

    max_staleness: int = field(
        default=1,
        metadata=bounded(
            ge=0,
            help="ours, fully_async: a group admitted at weight version v is trained by step v + N "
            "(admission control)",
        ),
    )
    partial_rollout: bool = field(
        default=False,
        metadata=described(
            "fully_async: cut generations off at a weight update and resume them with the new weights",
            slime=slime("rollout", False, differs="needs --fully-async (ours), where generations cross syncs"),
        ),
    )
    mask_offpolicy_in_partial_rollout: bool = field(
        default=False,
        metadata=described(
            "partial rollout: tokens sampled before the weight update leave the loss", slime=slime("rollout", False)
        ),
    )


def _check_fully_async(problems: list[str], cfg: Any) -> None:
    """Staleness against the sync interval; partial rollouts of the default generation only."""
    r = cfg.rollout
    if r.max_staleness < r.update_weights_interval - 1:
        problems.append(
            f"--max-staleness {r.max_staleness} must be >= --update-weights-interval {r.update_weights_interval} - 1: "
            "between two weight syncs the engines sample with one version for that many steps"
        )
    if r.partial_rollout and r.custom_generate_function_path:
        problems.append(
            "--partial-rollout continues the default generation; it cannot resume a --custom-generate-function-path"
        )
    if r.mask_offpolicy_in_partial_rollout and not r.partial_rollout:
        problems.append("--mask-offpolicy-in-partial-rollout needs --partial-rollout")


def _schedule(options: tuple[type, ...] = (), check: Any = None) -> types.SimpleNamespace:
    """A schedule's options, shaped as a plug-in's options module (``OPTIONS``, ``OWN_FIELDS``, ``check``)."""
    return types.SimpleNamespace(
        OPTIONS={"rollout": options[0]} if options else {}, OWN_FIELDS=own_fields(*options), check=check
    )


# Each --rollout-schedule's options (the names are runtime.rollout.source.SCHEDULES').
SCHEDULE_OPTIONS: dict[str, types.SimpleNamespace] = {
    "sync": _schedule(),
    "one_step": _schedule(),
    "fully_async": _schedule((FullyAsyncOptions,), _check_fully_async),
}


def schedule_options(name: str) -> types.SimpleNamespace:
    """The options of ``--rollout-schedule name`` (see :data:`SCHEDULE_OPTIONS`)."""
    return SCHEDULE_OPTIONS[name]
