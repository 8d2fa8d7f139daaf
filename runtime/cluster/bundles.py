"""Which bundles a job reserves and which of them the trainers and engines take: Ray-free, so that ``rlcore-run
--dry-run`` prints the plan without importing Ray (``runtime.cluster.placement`` reserves it)."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.config import Config
from runtime.engines.registry import engine_kind


@dataclass(frozen=True)
class BundlePlan:
    """How many bundles to reserve and which the trainers and engines take; ``share`` is each actor's part."""

    n_bundles: int
    trainer_bundles: list[int]
    engine_bundles: list[int]
    share: float


def plan_bundles(cfg: Config) -> BundlePlan:
    """The bundles ``cfg`` needs: the trainers', and ``bundles_per_engine`` for each engine (engine ``e`` takes
    ``engine_bundles[e * per : (e + 1) * per]``). Servers that already run (``--rollout-external-engine-addrs``)
    reserve none."""
    res = cfg.resources
    # The debug modes run one side only: --debug-rollout-only no trainers, --debug-train-only no engines.
    trainers = 0 if cfg.debug.debug_rollout_only else res.num_trainer_procs
    kind = engine_kind(cfg.rollout.rollout_engine)
    # --debug-train-only runs no engine.
    engines = 0 if cfg.debug.train_only else kind.count(cfg) * kind.bundles_per_engine(cfg)
    shared = res.colocate and engines > 0
    n_bundles = max(trainers, engines) if shared else trainers + engines
    engine_bundles = list(range(engines)) if shared else [trainers + e for e in range(engines)]
    return BundlePlan(n_bundles, list(range(trainers)), engine_bundles, 0.5 if shared else 1.0)
