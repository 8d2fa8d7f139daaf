"""Rollout engines by ``--rollout-engine`` name: what each needs from the cluster and how to build one.

A new engine is one module with a class implementing :class:`runtime.engines.base.RolloutEngine` plus one entry in
:data:`ROLLOUT_ENGINES`. The engine group (``runtime.cluster.engines``) and the weight sync read these entries; they
never name an engine class.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineKind:
    """How to run one kind of engine.

    ``cls``: the class, as an import path. ``uses_bundles``: whether each engine takes a device bundle of the job's
    placement group (an embedded engine does; an SGLang client does not: its server owns the GPUs).
    ``weight_sync``: the :data:`runtime.cluster.weight_sync.WEIGHT_SYNCS` entry that reaches it.
    ``count``: how many engines the config asks for. ``kwargs``: the constructor's arguments for engine ``index``.
    """

    cls: str
    uses_bundles: bool
    weight_sync: str
    count: Callable[[Any], int]
    kwargs: Callable[[Any, str, int], dict[str, Any]]

    def load(self) -> type[Any]:
        module, _, attr = self.cls.partition(":")
        return getattr(importlib.import_module(module), attr)


def sglang_urls(cfg: Any) -> list[str]:
    """The base URLs of ``--sglang-url`` (comma-separated)."""
    return [url for url in (cfg.rollout.sglang_url or "").split(",") if url]


ROLLOUT_ENGINES: dict[str, EngineKind] = {
    "hf": EngineKind(
        cls="runtime.engines.hf_engine:HFEngine",
        uses_bundles=True,
        weight_sync="object_store",
        count=lambda cfg: cfg.resources.rollout_num_gpus,
        kwargs=lambda cfg, model_path, i: {"model_path": model_path, "seed": cfg.seed + 1000 * i},
    ),
    "sglang": EngineKind(
        cls="runtime.engines.sglang_engine:SGLangEngine",
        uses_bundles=False,
        weight_sync="disk",
        count=lambda cfg: len(sglang_urls(cfg)),
        kwargs=lambda cfg, model_path, i: {
            "base_url": sglang_urls(cfg)[i],
            "seed": cfg.seed + 1000 * i,
            "hf_checkpoint": model_path,
        },
    ),
}


def engine_kind(name: str) -> EngineKind:
    if name not in ROLLOUT_ENGINES:
        raise ValueError(f"--rollout-engine {name!r} is not one of {', '.join(ROLLOUT_ENGINES)}")
    return ROLLOUT_ENGINES[name]
