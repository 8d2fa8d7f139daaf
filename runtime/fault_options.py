"""The ``fault`` section of the config: what a job survives (a dead or unhealthy rollout engine, slime's
fault-tolerance flags), read by :mod:`runtime.faults` and ``runtime.cluster.health``. Torch-free:
``runtime.config`` composes :class:`FaultConfig` into :class:`~runtime.config.Config` and checks it before
anything starts."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.option_fields import bounded, described, slime


@dataclass(frozen=True)
class FaultConfig:
    """What a job survives: a dead or unhealthy rollout engine (slime's fault-tolerance group, on by default here)
    and a dead trainer process (ours)."""

    use_fault_tolerance: bool = field(
        default=True,
        metadata=described(
            "check the rollout engines' health, re-dispatch a dead engine's requests to live ones, restart it and "
            "re-push the weights (on by default, unlike slime; --no-use-fault-tolerance: a dead engine stops the job)",
            slime=slime(
                "fault_tolerance",
                False,
                differs="on by default (--no-use-fault-tolerance is slime's "
                "default); a dead engine's requests go to live engines at once and it is restarted at once, not at "
                "the next weight update",
            ),
        ),
    )
    rollout_health_check_interval: float = field(
        default=30.0,
        metadata=bounded(
            gt=0, help="seconds between two health checks of every engine", slime=slime("fault_tolerance", 30.0)
        ),
    )
    rollout_health_check_timeout: float = field(
        default=30.0,
        metadata=bounded(
            gt=0,
            help="seconds an engine may take to answer a health check before it is restarted",
            slime=slime("fault_tolerance", 30.0),
        ),
    )
    rollout_health_check_first_wait: float = field(
        default=0.0,
        metadata=bounded(
            ge=0,
            help="seconds of grace after the engines are (re)started or resumed before checking",
            slime=slime("fault_tolerance", 0.0),
        ),
    )
    max_trainer_restarts: int = field(
        default=2,
        metadata=bounded(
            ge=0,
            help="ours: times a dead trainer process is survived by rebuilding the job from the latest --save "
            "checkpoint",
        ),
    )
