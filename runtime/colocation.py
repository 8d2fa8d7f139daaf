"""Colocated trainers and engines taking turns on their GPUs: whether they offload this step (``--offload-train`` /
``--offload-rollout``, or ``auto``) and which engine memory tags are released, so each is resumed once."""

from __future__ import annotations

from typing import Any

from runtime.cluster.engines import EngineGroup
from runtime.config import Config


def fit_together(
    trainers: list[dict[str, int] | None], engines: list[dict[str, int] | None], *, fraction: float
) -> bool:
    """Whether each trainer rank's and its colocated engine's (same index) peaks of reserved GPU memory fit within
    ``fraction`` of their device together; False when any side does not report (None) or the counts differ."""
    if len(trainers) != len(engines) or not trainers or None in trainers or None in engines:
        return False
    return all(t["peak"] + e["peak"] <= fraction * t["total"] for t, e in zip(trainers, engines, strict=True))


class Offload:
    """Whether colocated trainers and engines take turns on their devices this step (``--offload-train`` /
    ``--offload-rollout``).

    Given, each flag holds for the whole job. Unset under ``--colocate`` it is ``auto`` (a difference from slime,
    which always offloads when colocated): the first step offloads both sides, then each side's peak of reserved
    GPU memory is read, and if a trainer's and its engine's peaks fit their device together (within
    ``FIT_FRACTION`` of it) nothing moves again. Engines that do not report their memory (SGLang servers, which hold
    a fixed fraction of their GPU) and CPU jobs keep offloading as slime does.
    """

    FIT_FRACTION = 0.9

    def __init__(self, cfg: Config, trainers: Any, engines: Any):
        s, colocate = cfg.sglang, cfg.resources.colocate
        self.train = colocate if s.offload_train is None else s.offload_train
        self.rollout = colocate if s.offload_rollout is None else s.offload_rollout
        self.auto = colocate and s.offload_train is None and s.offload_rollout is None
        self.trainers, self.engines = trainers, engines

    def after_step(self, first: bool) -> None:
        """After the job's first step: decide ``auto`` (see the class docstring)."""
        if not (self.auto and first and self.trainers.actors and self.engines.actors):
            return
        self.auto = False
        trainers, engines = self.trainers.device_memory(), self.engines.device_memory()
        if fit_together(trainers, engines, fraction=self.FIT_FRACTION):
            self.train = self.rollout = False
            t, e = trainers[0], engines[0]
            print(
                f"colocated trainer ({t['peak'] / 2**30:.1f} GiB at its peak) and engine ({e['peak'] / 2**30:.1f} "
                f"GiB) fit their device ({t['total'] / 2**30:.0f} GiB) together: nothing is offloaded from now on "
                "(--offload-train / --offload-rollout force it)",
                flush=True,
            )


class EngineMemory:
    """Which memory tags the engines have released, so that each is resumed once, and in slime's order."""

    TAGS = ("weights", "kv_cache", "cuda_graph")

    def __init__(self, engines: EngineGroup):
        self.engines = engines
        self.released: set[str] = set()

    def release(self) -> None:
        self.engines.release_memory(list(self.TAGS))
        self.released = set(self.TAGS)

    def resume(self, tags: list[str] | None = None) -> None:
        """Resume ``tags`` (all by default) among those released; nothing if none is."""
        wanted = [t for t in (tags or self.TAGS) if t in self.released]
        if wanted:
            self.engines.resume_memory(wanted)
            self.released -= set(wanted)
