"""The engine group: the rollout engine actors of ``--rollout-engine``, driven as one.

Engines are built from their registry entry (``runtime.engines.registry``): the group never names an engine class.
Engine calls run one at a time, except the control calls (``abort``, ``health``, ``weight_version``), which have a
concurrency group of their own so that :meth:`EngineGroup.abort` reaches an engine while it generates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import ray

from runtime.cluster.placement import Placement
from runtime.config import Config
from runtime.engines.base import Generation, SamplingParams
from runtime.engines.registry import EngineKind, engine_kind

CONTROL_METHODS = ("abort", "health", "weight_version")


def engine_actor_class(cls: type[Any]) -> Any:
    """``cls`` as a Ray actor class whose :data:`CONTROL_METHODS` run beside its other calls."""

    def control(name: str) -> Any:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return getattr(cls, name)(self, *args, **kwargs)

        method.__name__ = name
        return ray.method(concurrency_group="control")(method)

    actor_cls = type(cls.__name__, (cls,), {name: control(name) for name in CONTROL_METHODS})
    return ray.remote(concurrency_groups={"control": 2})(actor_cls)


def assign_chunks(n_prompts: int, n_engines: int, *, start: int = 0) -> list[tuple[int, int, int]]:
    """``(engine, lo, hi)`` per non-empty chunk: prompts ``[lo, hi)`` go to ``engine``, chunk ``i`` to engine
    ``(start + i) % n_engines``.

    Prompts are split into ``min(n_prompts, n_engines)`` contiguous chunks of near-equal size. Rotating ``start``
    between calls spreads calls of fewer prompts than engines (custom and multi-turn generate functions send one
    prompt per call) over all engines instead of piling them onto engine 0.
    """
    if n_prompts < 1 or n_engines < 1:
        raise ValueError(f"n_prompts and n_engines must be >= 1, got {n_prompts} and {n_engines}")
    chunk = -(-n_prompts // n_engines)
    out = []
    for i in range(n_engines):
        lo, hi = i * chunk, min((i + 1) * chunk, n_prompts)
        if lo < hi:
            out.append(((start + i) % n_engines, lo, hi))
    return out


class EngineGroup:
    """The rollout engine actors; prompts are spread over them in contiguous chunks (see :func:`assign_chunks`)."""

    def __init__(self, cfg: Config, placement: Placement, model_path: str):
        self.kind: EngineKind = engine_kind(cfg.rollout.rollout_engine)
        remote_cls = engine_actor_class(self.kind.load())
        n = 0 if cfg.debug.train_only else self.kind.count(cfg)  # --debug-train-only runs no engine
        self.actors = []
        for i in range(n):
            # Engines without a bundle are HTTP clients of servers that own their devices: they need no CPU slot.
            opts = placement.options(placement.engine_bundles[i]) if self.kind.uses_bundles else {"num_cpus": 0}
            self.actors.append(remote_cls.options(**opts).remote(**self.kind.kwargs(cfg, model_path, i)))
        self._next_engine = 0

    def rewind(self) -> None:
        """Send the next call of fewer prompts than engines to engine 0 again.

        The rollout calls it at the start of every round, so that which engine (and so which engine's RNG) serves
        which request depends only on the order of calls within the round, as it must for a resumed job to sample
        alike (the position is not checkpointed).
        """
        self._next_engine = 0

    def generate_async(self, prompts: Sequence[list[int]], params: SamplingParams) -> list[ray.ObjectRef]:
        """One ``generate`` call per chunk of ``prompts``, in prompt order.

        A batch of at least as many prompts as engines uses every engine, from engine 0. A smaller call (custom and
        multi-turn generate functions send one prompt per call) starts where the previous small call stopped, so
        such calls go round-robin over the engines.
        """
        n = len(self.actors)
        if len(prompts) >= n:
            chunks = assign_chunks(len(prompts), n)
        else:
            chunks = assign_chunks(len(prompts), n, start=self._next_engine)
            self._next_engine = (self._next_engine + len(chunks)) % n
        return [self.actors[e].generate.remote(list(prompts[lo:hi]), params) for e, lo, hi in chunks]

    async def generate(self, prompts: Sequence[list[int]], params: SamplingParams) -> list[Generation]:
        outs = [await ref for ref in self.generate_async(prompts, params)]
        return [g for out in outs for g in out]

    def _all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return ray.get([getattr(a, method).remote(*args, **kwargs) for a in self.actors])

    def update_weights_from_disk(self, path: str, *, weight_version: int) -> None:
        self._all("update_weights_from_disk", path, weight_version=weight_version)

    def weight_versions(self) -> list[int]:
        return self._all("weight_version")

    def weight_dtype(self) -> str:
        """The dtype the engines hold their weights in (they are built alike, so engine 0 answers for all)."""
        return ray.get(self.actors[0].weight_dtype.remote())

    def abort(self) -> None:
        """Cut every running generation short (each returns its partial response, ``finish_reason="abort"``)."""
        self._all("abort")

    def get_weights(self, index: int = 0) -> dict[str, Any]:
        """Engine ``index``'s weights (embedded engines only; tests compare them with the trainer's)."""
        return ray.get(self.actors[index].get_weights.remote())

    def get_rng_state(self) -> list[Any]:
        return self._all("get_rng_state")

    def set_rng_state(self, states: list[Any]) -> None:
        ray.get([a.set_rng_state.remote(s) for a, s in zip(self.actors, states, strict=True)])

    def release_memory(self) -> None:
        self._all("release_memory")

    def resume_memory(self) -> None:
        self._all("resume_memory")

    def health(self) -> list[bool]:
        return self._all("health")

    def shutdown(self) -> None:
        # Best effort, as for the trainers: an SGLang client deletes its weight folders on close.
        with contextlib.suppress(ray.exceptions.RayError):
            self._all("close")
        for a in self.actors:
            ray.kill(a)
