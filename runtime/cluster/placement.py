"""Ray placement: trainer and engine actors in one placement group, colocated or on separate devices.

A bundle is one device: ``{"GPU": 1, "CPU": 1}`` on a GPU cluster, ``{"CPU": 1}`` on a CPU-only machine (where
the ``*_num_gpus*`` flags count CPU slots). Trainer rank ``r`` takes bundle ``r``. Separate (the default), engine
``e`` takes bundle ``num_trainers + e``; with ``--colocate`` engine ``e`` shares bundle ``e`` with trainer ``e``,
each taking half of it, and the loop offloads one while the other works.

:class:`TrainerGroup` and :class:`EngineGroup` hide the fan-out: the loop calls one method and gets one result.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from tensordict import TensorDict

from runtime.config import Config
from runtime.engines.base import Generation, SamplingParams
from runtime.engines.hf_engine import HFEngine
from runtime.engines.sglang_engine import SGLangEngine
from runtime.train.backends.torch_backend import TorchTrainer
from runtime.train.batch import merge_shards, shard_for_ranks

# No progress bars from actors (the console shows the loop's own), and idle OpenMP threads sleep instead of spinning:
# trainer and engine take turns on the same cores, and a spinning idle actor would slow the working one.
_ACTOR_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_WAIT_POLICY": "PASSIVE",
}


@dataclass
class Placement:
    group: PlacementGroup
    use_gpu: bool
    trainer_bundles: list[int]
    engine_bundles: list[int]
    share: float
    threads: int

    def options(self, bundle: int) -> dict[str, Any]:
        opts: dict[str, Any] = {
            "num_cpus": self.share,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=bundle),
            "runtime_env": {"env_vars": {**_ACTOR_ENV, "OMP_NUM_THREADS": str(self.threads)}},
        }
        if self.use_gpu:
            opts["num_gpus"] = self.share
        return opts


@dataclass(frozen=True)
class BundlePlan:
    """How many bundles to reserve and which the trainers and engines take; ``share`` is each actor's part."""

    n_bundles: int
    trainer_bundles: list[int]
    engine_bundles: list[int]
    share: float


def plan_bundles(cfg: Config) -> BundlePlan:
    """The bundles ``cfg`` needs. With ``--rollout-engine sglang`` only the trainers' are reserved: the SGLang
    servers own their devices and the engine actors are HTTP clients that need none."""
    res = cfg.resources
    trainers = res.num_trainer_procs
    engines = 0 if cfg.rollout.rollout_engine == "sglang" else res.rollout_num_gpus
    shared = res.colocate and engines > 0
    n_bundles = max(trainers, engines) if shared else trainers + engines
    engine_bundles = list(range(engines)) if shared else [trainers + e for e in range(engines)]
    return BundlePlan(n_bundles, list(range(trainers)), engine_bundles, 0.5 if shared else 1.0)


def create_placement(cfg: Config, *, timeout_s: float = 120.0) -> Placement:
    """Reserve the bundles of :func:`plan_bundles` (waits up to ``timeout_s`` for the cluster to have them)."""
    plan = plan_bundles(cfg)
    use_gpu = ray.cluster_resources().get("GPU", 0) > 0
    bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
    group = placement_group([dict(bundle) for _ in range(plan.n_bundles)], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(
            f"Ray could not reserve {plan.n_bundles} bundles of {bundle} in {timeout_s:.0f}s (cluster has "
            f"{ray.cluster_resources()}); lower --actor-num-gpus-per-node / --rollout-num-gpus or use --colocate"
        )
    # Trainer and engines take turns (the loop is synchronous), so each may use every core of its share.
    cpus = int(ray.cluster_resources().get("CPU", 1))
    actors = max(len(plan.trainer_bundles), len(plan.engine_bundles), 1)
    threads = max(1, cpus // actors) if not use_gpu else 1
    return Placement(group, use_gpu, plan.trainer_bundles, plan.engine_bundles, plan.share, threads)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TrainerGroup:
    """The data-parallel trainer actors of the torch backend, driven as one."""

    def __init__(self, placement: Placement, model_path: str, **trainer_kwargs: Any):
        world_size = len(placement.trainer_bundles)
        port = free_port()
        remote_cls = ray.remote(TorchTrainer)
        self.actors = [
            remote_cls.options(**placement.options(bundle)).remote(
                model_path,
                rank=rank,
                world_size=world_size,
                master_addr="127.0.0.1",
                master_port=port,
                **trainer_kwargs,
            )
            for rank, bundle in enumerate(placement.trainer_bundles)
        ]
        self.world_size = world_size

    def _all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return ray.get([getattr(a, method).remote(*args, **kwargs) for a in self.actors])

    def compute_log_probs(self, td: TensorDict, *, global_batch_size: int) -> TensorDict:
        shards = shard_for_ranks(td, global_batch_size=global_batch_size, world_size=self.world_size)
        outs = ray.get([a.compute_log_probs.remote(s) for a, s in zip(self.actors, shards, strict=True)])
        return merge_shards(outs, global_batch_size=global_batch_size)

    def train(self, td: TensorDict, *, global_batch_size: int) -> dict[str, float]:
        shards = shard_for_ranks(td, global_batch_size=global_batch_size, world_size=self.world_size)
        per_step = global_batch_size // self.world_size
        outs = ray.get([a.train.remote(s, per_step_rows=per_step) for a, s in zip(self.actors, shards, strict=True)])
        return outs[0]

    def sft_train(self, td: TensorDict) -> dict[str, float]:
        shards = shard_for_ranks(td, global_batch_size=td.batch_size[0], world_size=self.world_size)
        return ray.get([a.sft_train.remote(s) for a, s in zip(self.actors, shards, strict=True)])[0]

    def weights_ref(self) -> ray.ObjectRef:
        """An object ref to the full state dict (every rank joins the gather; rank 0 holds the result)."""
        refs = [a.get_weights.remote() for a in self.actors]
        ray.wait(refs, num_returns=len(refs))
        return refs[0]

    def save(self, path: str) -> None:
        self._all("save", path)

    def load(self, path: str) -> None:
        self._all("load", path)

    def save_hf(self, path: str) -> None:
        self._all("save_hf", path)

    def release_memory(self) -> None:
        self._all("release_memory")

    def resume_memory(self) -> None:
        self._all("resume_memory")

    def shutdown(self) -> None:
        # Best effort: this runs while a failed job unwinds, when an actor may already be dead.
        with contextlib.suppress(ray.exceptions.RayError):
            self._all("shutdown")
        for a in self.actors:
            ray.kill(a)


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

    def __init__(self, placement: Placement, model_path: str, *, seed: int, sglang_urls: Sequence[str] = ()):
        self.http_clients = bool(sglang_urls)
        if sglang_urls:
            # The SGLang servers own their GPUs; these actors are HTTP clients, one per server.
            remote_cls = ray.remote(SGLangEngine)
            self.actors = [
                remote_cls.options(num_cpus=0).remote(url, seed=seed + 1000 * i, hf_checkpoint=model_path)
                for i, url in enumerate(sglang_urls)
            ]
        else:
            remote_cls = ray.remote(HFEngine)
            self.actors = [
                remote_cls.options(**placement.options(bundle)).remote(model_path, seed=seed + 1000 * i)
                for i, bundle in enumerate(placement.engine_bundles)
            ]
        self._next_engine = 0

    def rewind(self) -> None:
        """Send the next call of fewer prompts than engines to engine 0 again.

        The loop calls it at the start of every rollout, so that which engine (and so which engine's RNG) serves
        which request depends only on the order of calls within the rollout, as it must for a resumed job to sample
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

    def update_weights(self, weights: ray.ObjectRef, version: int) -> None:
        """Push the trainer's weights to every engine."""
        ray.get([a.update_weights.remote(weights, version) for a in self.actors])

    def get_weights(self, index: int = 0) -> dict[str, torch.Tensor]:
        return ray.get(self.actors[index].get_weights.remote())

    def get_rng_state(self) -> list[Any]:
        return ray.get([a.get_rng_state.remote() for a in self.actors])

    def set_rng_state(self, states: list[Any]) -> None:
        ray.get([a.set_rng_state.remote(s) for a, s in zip(self.actors, states, strict=True)])

    def release_memory(self) -> None:
        ray.get([a.release_memory.remote() for a in self.actors])

    def resume_memory(self) -> None:
        ray.get([a.resume_memory.remote() for a in self.actors])

    def shutdown(self) -> None:
        # Best effort, as for the trainers: an SGLang client deletes its weight folders on close.
        if self.http_clients:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get([a.close.remote() for a in self.actors])
        for a in self.actors:
            ray.kill(a)
