"""Rollout engines by ``--rollout-engine`` name: what each needs from the cluster and how to build one.

A new engine is its class (implementing :class:`runtime.engines.base.RolloutEngine`) and its options module (its
flags and what it can do, as ``runtime.engines.sglang_options``), plus one entry in :data:`ROLLOUT_ENGINES` naming
both. The engine group (``runtime.cluster.engines``), the weight sync and the config read these entries; they never
name an engine class.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from runtime.option_fields import registry_view


@dataclass(frozen=True)
class EngineKind:
    """How to run one kind of engine.

    ``cls``: the class, as an import path. ``options``: its options module (:data:`ROLLOUT_ENGINE_OPTIONS`), as an
    import path. ``bundles_per_engine``: how many device bundles of the job's placement
    group each engine takes (an embedded engine one; a launched SGLang server ``--rollout-num-gpus-per-engine``; a
    server that already runs none). ``launches``: whether the engine group starts a server per engine
    (``runtime.cluster.engines``) and hands its URL to the constructor as ``base_url``.
    ``weight_sync``: the :data:`runtime.cluster.weight_sync.WEIGHT_SYNCS` entry that reaches it, given the config and
    whether the job's devices are GPUs.
    ``count``: how many engines the config asks for. ``kwargs``: the constructor's arguments for engine ``index``.
    ``restartable``: whether a dead engine is restarted (``--use-fault-tolerance``): an embedded engine by building its
    actor again; an SGLang engine by launching its server again through its launcher (an external server: once it
    answers again), then building its actor (``runtime.cluster.engines``).
    """

    cls: str
    options: str
    bundles_per_engine: Callable[[Any], int]
    launches: Callable[[Any], bool]
    weight_sync: Callable[[Any, bool], str]
    count: Callable[[Any], int]
    kwargs: Callable[[Any, str, int], dict[str, Any]]
    restartable: bool = False
    # Whether the engine group starts a router in front of the engines (SGLang's, ``runtime.cluster.engines``) and
    # sends each request through it.
    router: bool = False
    # Whether each request carries its own sampling seed (slime's per-sample SGLang seeds from ``--rollout-seed``); an
    # engine without it draws from seeded streams of its own.
    sampling_seeds: bool = False
    # Whether an engine holds a fixed fraction of its GPU's memory (an SGLang server's static pool), so that sharing
    # devices with the trainers (``--colocate``) needs the offloads.
    fixed_memory: bool = False
    # Whether the engine receives a weight broadcast while it generates (``stage_weights_from_distributed``) and
    # swaps it in between two rollouts (``commit_staged_weights``): one-step async then syncs without draining.
    stages_weights: bool = False
    # Whether the engine pauses its generation around a weight update and goes on after it with the new weights
    # (``pause_generation`` / ``continue_generation``, as slime pauses SGLang): one-step async then syncs without
    # waiting for the rollout in flight, whose responses are sampled by the old weights up to the sync and by the new
    # ones after it.
    pauses_generation: bool = False

    def load(self) -> type[Any]:
        module, _, attr = self.cls.partition(":")
        return getattr(importlib.import_module(module), attr)


def sglang_urls(cfg: Any) -> list[str]:
    """The base URLs of running servers: ``--rollout-external-engine-addrs`` or its alias ``--sglang-url`` (comma- or
    space-separated; ``host:port`` gets ``http://``)."""
    text = cfg.sglang.rollout_external_engine_addrs or cfg.rollout.sglang_url or ""
    addrs = text.replace(",", " ").split()
    return [a if a.startswith(("http://", "https://")) else f"http://{a}" for a in addrs]


def _sglang_engines(cfg: Any) -> int:
    external = sglang_urls(cfg)
    return len(external) if external else cfg.resources.rollout_num_gpus // cfg.sglang.rollout_num_gpus_per_engine


def _colocated_sync(cfg: Any) -> str | None:
    """Under ``--colocate``: ``ipc``, or ``disk`` where ipc is not built (an SGLang engine of several GPUs, whose
    ranks each need their own trainer's handles; several processes of a backend whose rank 0 alone sends, its options'
    ``WEIGHTS_FROM_RANK0``: the Megatron backend's)."""
    if not cfg.resources.colocate:
        return None
    from runtime.train.backends import backend_options

    several_gpus = cfg.rollout.rollout_engine == "sglang" and cfg.sglang.rollout_num_gpus_per_engine > 1
    from_rank0 = getattr(backend_options(cfg.train.train_backend), "WEIGHTS_FROM_RANK0", False)
    return "disk" if several_gpus or (from_rank0 and cfg.resources.num_trainer_procs > 1) else "ipc"


def _split_sync(use_gpu: bool) -> str:
    """Engines on devices of their own: a bucketed NCCL broadcast from the trainer's GPU memory on GPUs (link speed,
    no host copy); on the CPU Ray's object store, which moves a bucket through shared memory in one copy where gloo's
    broadcast crosses TCP loopback."""
    return "nccl" if use_gpu else "object_store"


ROLLOUT_ENGINES: dict[str, EngineKind] = {
    "hf": EngineKind(
        cls="runtime.engines.hf_engine:HFEngine",
        options="runtime.engines.hf_options",
        bundles_per_engine=lambda cfg: 1,
        launches=lambda cfg: False,
        weight_sync=lambda cfg, use_gpu: (
            cfg.sglang.update_weight_transport or _colocated_sync(cfg) or _split_sync(use_gpu)
        ),
        count=lambda cfg: cfg.resources.rollout_num_gpus,
        kwargs=lambda cfg, model_path, i: {
            "model_path": model_path,
            "seed": cfg.seed + 1000 * i,
            "compile": cfg.rollout.engine_compile,
            "max_running_requests": cfg.rollout.engine_max_running_requests,
            "kv_cache_tokens": cfg.rollout.engine_kv_cache_tokens,
        },
        restartable=True,
        stages_weights=True,
    ),
    "sglang": EngineKind(
        cls="runtime.engines.sglang_engine:SGLangEngine",
        options="runtime.engines.sglang_options",
        bundles_per_engine=lambda cfg: 0 if sglang_urls(cfg) else cfg.sglang.rollout_num_gpus_per_engine,
        launches=lambda cfg: not sglang_urls(cfg),
        weight_sync=lambda cfg, use_gpu: cfg.sglang.update_weight_transport or _colocated_sync(cfg) or "nccl",
        count=_sglang_engines,
        kwargs=lambda cfg, model_path, i: {
            **({"base_url": sglang_urls(cfg)[i]} if sglang_urls(cfg) else {}),
            "seed": cfg.seed + 1000 * i,
            "hf_checkpoint": model_path,
        },
        restartable=True,
        pauses_generation=True,
        router=True,
        sampling_seeds=True,
        fixed_memory=True,
    ),
}


# Each engine's options module (its ``EngineKind.options``, read live from :data:`ROLLOUT_ENGINES`): ``OPTIONS``
# (config section -> the dataclass of its fields there), ``OWN_FIELDS`` (the flags only it reads; refused under
# another engine), what it can do (``REPORTS_TOP_P_NUCLEI``) and, when it has rules, ``check(problems, cfg)``. Light:
# the config imports them to build its sections, without the engine's dependencies.
ROLLOUT_ENGINE_OPTIONS: Mapping[str, str] = registry_view(ROLLOUT_ENGINES, "options")


def engine_options(name: str) -> Any:
    """The options module of ``--rollout-engine name`` (its ``EngineKind.options``)."""
    return importlib.import_module(ROLLOUT_ENGINE_OPTIONS[name])


def engine_kind(name: str) -> EngineKind:
    if name not in ROLLOUT_ENGINES:
        raise ValueError(f"--rollout-engine {name!r} is not one of {', '.join(ROLLOUT_ENGINES)}")
    return ROLLOUT_ENGINES[name]
