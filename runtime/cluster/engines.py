"""The engine group: the rollout engines of ``--rollout-engine``, driven as one.

It has two parts. **The servers** (``actors``): one engine actor per engine, through which weights, memory and health
go to every engine directly. **Where requests go**: the same actors, prompts split over them in chunks (embedded
engines, and SGLang servers without a router), or one client of the SGLang router (``router``), which takes one
request per prompt and picks the server itself; a prompt's session id (multi-turn samples) goes along as the
router's routing key (``x-smg-routing-key``), so a consistent-hashing or manual policy keeps a session on one server.

Engines are built from their registry entry (``runtime.engines.registry``): the group never names an engine class.
When the entry ``launches`` servers, the group first starts one per engine, each by a
:class:`runtime.engines.launcher.ProcessLauncher` actor on the engine's first bundle of the job's placement group
(``--sglang-server-command`` plus the launcher's flags and the ``--sglang-*`` passthrough), then the SGLang router in
front of them (unless ``--sglang-router-ip`` names a running one, to which the servers are added). Everything it
started stops in :meth:`EngineGroup.shutdown`.

Engine calls run one at a time, except the control calls (``abort``, ``health``, ``weight_version``), which have a
concurrency group of their own so that :meth:`EngineGroup.abort` reaches an engine while it generates; the router
client runs up to :data:`ROUTER_CLIENT_CONCURRENCY` requests at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import ray

from runtime.cluster.placement import Placement
from runtime.config import Config
from runtime.engines import launcher
from runtime.engines.base import Generation, SamplingParams
from runtime.engines.registry import EngineKind, engine_kind

CONTROL_METHODS = ("abort", "health", "weight_version")
# Requests the router client has in flight at once (each a thread of the actor waiting on HTTP).
ROUTER_CLIENT_CONCURRENCY = 256


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


def _gpu_ids(placement: Placement, bundles: list[int]) -> list[str]:
    """The GPU ids Ray gives ``bundles`` of ``placement`` on their node, in bundle order (empty on a CPU cluster)."""
    if not placement.use_gpu:
        return []

    @ray.remote
    def gpu_ids() -> list[str]:
        return [str(g) for g in ray.get_gpu_ids()]

    return [g for b in bundles for g in ray.get(gpu_ids.options(**placement.options(b)).remote())]


class EngineGroup:
    """The rollout engines: the servers, and where requests go (see the module docstring)."""

    def __init__(self, cfg: Config, placement: Placement, model_path: str):
        self.kind: EngineKind = engine_kind(cfg.rollout.rollout_engine)
        self.weight_sync_kind = self.kind.weight_sync(cfg)
        remote_cls = engine_actor_class(self.kind.load())
        n = 0 if cfg.debug.train_only else self.kind.count(cfg)  # --debug-train-only runs no engine
        per = self.kind.bundles_per_engine(cfg)
        self.launchers: list[Any] = []
        self.router_launcher: Any = None
        self.router: Any = None
        self.router_url: str | None = None
        self.actors = []
        try:
            urls = self._launch_servers(cfg, placement, model_path, n, per) if self.kind.launches(cfg) else None
            for i in range(n):
                kwargs = self.kind.kwargs(cfg, model_path, i)
                if urls is not None:
                    kwargs["base_url"] = urls[i]
                # An engine that drives a server over HTTP needs no device of its own: the server holds it.
                opts = placement.options(placement.engine_bundles[i]) if per and urls is None else {"num_cpus": 0}
                self.actors.append(remote_cls.options(**opts).remote(**kwargs))
            if cfg.rollout.rollout_engine == "sglang":
                self._start_router(cfg, remote_cls, model_path, [ray.get(a.url.remote()) for a in self.actors])
        except BaseException:
            self.shutdown()
            raise
        self._next_engine = 0

    def _launch_servers(self, cfg: Config, placement: Placement, model_path: str, n: int, per: int) -> list[str]:
        """Start one server per engine, each by a launcher on the engine's first bundle; their base URLs."""
        s = cfg.sglang
        pending = []
        for i in range(n):
            bundles = placement.engine_bundles[i * per : (i + 1) * per]
            env = {"CUDA_VISIBLE_DEVICES": ",".join(_gpu_ids(placement, bundles))} if placement.use_gpu else {}
            actor = ray.remote(launcher.ProcessLauncher).options(**placement.options(bundles[0])).remote(env=env)
            self.launchers.append(actor)
            argv = launcher.server_argv(
                s.sglang_server_command,
                model_path=model_path,
                host="{host}",
                port="{port}",
                tp_size=s.rollout_num_gpus_per_engine,
                seed=cfg.seed + 1000 * i,
                server_args=s.sglang_args,
            )
            pending.append(
                actor.start.remote(argv, health_path="/health_generate", timeout=s.sglang_server_startup_timeout)
            )
        return ray.get(pending)

    def _start_router(self, cfg: Config, remote_cls: Any, model_path: str, urls: list[str]) -> None:
        """The router in front of ``urls`` (launched, or the running one of ``--sglang-router-ip``) and its client."""
        s = cfg.sglang
        if s.sglang_router_ip is not None:
            self.router_url = f"http://{s.sglang_router_ip}:{s.sglang_router_port}"
            launcher.add_router_workers(self.router_url, urls)
        else:
            self.router_launcher = ray.remote(launcher.ProcessLauncher).options(num_cpus=0).remote()
            argv = launcher.router_argv(
                urls,
                host="{host}",
                port="{port}",
                request_timeout_secs=s.sglang_router_request_timeout_secs,
                router_args=s.router_args,
            )
            self.router_url = ray.get(
                self.router_launcher.start.remote(argv, health_path="/health", timeout=s.sglang_server_startup_timeout)
            )
        self.router = remote_cls.options(num_cpus=0, max_concurrency=ROUTER_CLIENT_CONCURRENCY).remote(
            base_url=self.router_url, hf_checkpoint=model_path, seed=None
        )

    def rewind(self) -> None:
        """Send the next call of fewer prompts than engines to engine 0 again.

        The rollout calls it at the start of every round, so that which engine (and so which engine's RNG) serves
        which request depends only on the order of calls within the round, as it must for a resumed job to sample
        alike (the position is not checkpointed).
        """
        self._next_engine = 0

    def generate_async(
        self, prompts: Sequence[list[int]], params: SamplingParams, *, session_ids: Sequence[str | None] | None = None
    ) -> list[ray.ObjectRef]:
        """``generate`` calls for ``prompts``, in prompt order.

        Through the router: one call per prompt, with its session id (if any) as the routing key. Otherwise one call
        per chunk: a batch of at least as many prompts as engines uses every engine, from engine 0; a smaller call
        (custom and multi-turn generate functions send one prompt per call) starts where the previous small call
        stopped, so such calls go round-robin over the engines.
        """
        if session_ids is not None and len(session_ids) != len(prompts):
            raise ValueError(f"session_ids has {len(session_ids)} entries for {len(prompts)} prompts")
        if self.router is not None:
            keys = session_ids or [None] * len(prompts)
            return [
                self.router.generate.remote([list(p)], params, routing_key=k)
                for p, k in zip(prompts, keys, strict=True)
            ]
        n = len(self.actors)
        if len(prompts) >= n:
            chunks = assign_chunks(len(prompts), n)
        else:
            chunks = assign_chunks(len(prompts), n, start=self._next_engine)
            self._next_engine = (self._next_engine + len(chunks)) % n
        return [self.actors[e].generate.remote(list(prompts[lo:hi]), params) for e, lo, hi in chunks]

    async def generate(
        self, prompts: Sequence[list[int]], params: SamplingParams, *, session_ids: Sequence[str | None] | None = None
    ) -> list[Generation]:
        outs = [await ref for ref in self.generate_async(prompts, params, session_ids=session_ids)]
        return [g for out in outs for g in out]

    def _all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return ray.get([getattr(a, method).remote(*args, **kwargs) for a in self.actors])

    def update_weights_from_disk(self, path: str, *, weight_version: int) -> None:
        self._all("update_weights_from_disk", path, weight_version=weight_version)

    def tp_sizes(self) -> list[int]:
        """Each engine's ranks in a weight-update group (its tensor-parallel size)."""
        return self._all("tp_size")

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

    def release_memory(self, tags: list[str] | None = None) -> None:
        self._all("release_memory", tags)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self._all("resume_memory", tags)

    def health(self) -> list[bool]:
        return self._all("health")

    def shutdown(self) -> None:
        """Close the engines, stop the router and the servers this group launched (best effort: this also runs while
        a failed job unwinds)."""
        clients = self.actors + ([self.router] if self.router is not None else [])
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get([a.close.remote() for a in clients])
        for a in clients:
            ray.kill(a)
        launchers = self.launchers + ([self.router_launcher] if self.router_launcher is not None else [])
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get([la.stop.remote() for la in launchers])
        for la in launchers:
            ray.kill(la)
