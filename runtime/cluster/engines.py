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

**Fault tolerance** (``--use-fault-tolerance``, on by default; slime's flags and meanings, see
``runtime.cluster.health``): an engine whose process dies, or that fails a health check (and is then killed), is
restarted at once from its registry entry, takes the trainers' current weights (``rejoin``, wired by the weight sync)
and only then takes requests again. Meanwhile its requests go to the live engines, or, when none is live, wait for
the restart: no request is dropped. A group call (weights, memory, RNG) that meets a dead engine waits for its
restart and runs again on it. ``pop_metrics`` counts restarts and re-dispatched requests. Without it a dead engine
stops the job with one line (:class:`EngineDied`). An engine with a server (SGLang) leaves the router, its server is
launched again by its launcher (an external server: waited for until it answers), and it joins the router again
once it holds the weights; a request the router gives up on is sent again once a server is live.

Engine calls run one at a time, except the control calls (``abort``, ``health``, ``weight_version``), which have a
concurrency group of their own so that :meth:`EngineGroup.abort` reaches an engine while it generates; the router
client runs up to ``--sglang-server-concurrency`` x the engines requests at once (slime's bound; at most
:data:`ROUTER_CLIENT_THREADS`), the rollout's requests waiting their turn.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import ray

from runtime.cluster.health import HealthMonitor, first_line
from runtime.cluster.placement import Placement
from runtime.config import Config
from runtime.engines import launcher
from runtime.engines.base import Generation, SamplingParams
from runtime.engines.registry import EngineKind, engine_kind
from runtime.errors import JobError
from runtime.train.backends import lora

T = TypeVar("T")

CONTROL_METHODS = ("abort", "health", "weight_version")
# Run beside generate, one at a time: a weight broadcast received into a second buffer while the engine samples.
STAGING_METHODS = ("stage_weights_from_distributed",)
# The most threads of the router client (each waits on one HTTP request): a Ray actor starts them all at once.
ROUTER_CLIENT_THREADS = 1024
# Times a group call is run again after an engine died under it (each time on the restarted engines).
MAX_GROUP_CALL_TRIES = 3
# Times a request through the router is sent again after the router gave up on it (each time once a server is live).
MAX_ROUTED_TRIES = 4
# Seconds a relaunched server's leftover process gets to end after SIGTERM before SIGKILL.
SERVER_STOP_GRACE_S = 5.0
# How often a dead external server is asked whether it answers again.
EXTERNAL_POLL_S = 1.0
FT_FLAG = "--use-fault-tolerance"


class EngineDied(JobError):
    """A rollout engine died and the job cannot go on without it (fault tolerance off, or its restart failed)."""


def _server_side(err: ray.exceptions.RayTaskError) -> bool:
    """Whether a failed request through the router failed on the servers' side (an HTTP 5xx answer, or no
    connection), not because of the request itself."""
    cause = getattr(err, "cause", None)
    return isinstance(cause, ConnectionError) or getattr(cause, "status_code", 0) >= 500


def engine_died(err: BaseException) -> bool:
    """Whether ``err`` (from a call on an engine actor) says the actor's process is gone, not that the call raised."""
    return isinstance(err, ray.exceptions.RayActorError) and not isinstance(err, ray.exceptions.RayTaskError)


def engine_actor_class(cls: type[Any]) -> Any:
    """``cls`` as a Ray actor class whose :data:`CONTROL_METHODS` and :data:`STAGING_METHODS` run beside its other
    calls (each in a concurrency group of its own)."""

    def in_group(name: str, group: str) -> Any:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return getattr(cls, name)(self, *args, **kwargs)

        method.__name__ = name
        return ray.method(concurrency_group=group)(method)

    methods = {name: in_group(name, "control") for name in CONTROL_METHODS}
    methods.update({name: in_group(name, "staging") for name in STAGING_METHODS if hasattr(cls, name)})
    actor_cls = type(cls.__name__, (cls,), methods)
    return ray.remote(concurrency_groups={"control": 2, "staging": 1})(actor_cls)


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


def lora_server_args(cfg: Config) -> dict[str, Any]:
    """The SGLang server flags ``--update-weight-transport lora_adapter`` needs (``--sglang-*`` values win): LoRA on,
    the adapters' rank, and their target modules (peft's ``all-linear`` is SGLang's ``all``)."""
    if cfg.sglang.update_weight_transport != "lora_adapter":
        return {}
    targets = lora.parse_target_modules(cfg.train.lora_target_modules)
    return {
        "enable_lora": True,
        "max_lora_rank": cfg.train.lora_rank,
        "lora_target_modules": ["all"] if targets == "all-linear" else list(targets),
    }


def server_args(cfg: Config) -> dict[str, Any]:
    """The SGLang server flags of every launched server (``--sglang-*`` values win): LoRA's, and under
    ``--use-rollout-routing-replay`` ``--enable-return-routed-experts`` so that the servers report each token's experts
    (slime's engine sets it too)."""
    replay = {"enable_return_routed_experts": True} if cfg.algo.use_rollout_routing_replay else {}
    return {**lora_server_args(cfg), **replay, **cfg.sglang.sglang_args}


class EngineGroup:
    """The rollout engines: the servers, and where requests go (see the module docstring)."""

    def __init__(self, cfg: Config, placement: Placement, model_path: str):
        self.kind: EngineKind = engine_kind(cfg.rollout.rollout_engine)
        self.weight_sync_kind = self.kind.weight_sync(cfg, placement.use_gpu)
        remote_cls = engine_actor_class(self.kind.load())
        n = 0 if cfg.debug.train_only else self.kind.count(cfg)  # --debug-train-only runs no engine
        per = self.kind.bundles_per_engine(cfg)
        self.launchers: list[Any] = []
        # Per launched server: its launcher's actor options and command line (a restart launches it again).
        self._server_specs: list[tuple[dict[str, Any], dict[str, str], list[str]]] = []
        self.router_launcher: Any = None
        self.router: Any = None
        self.router_url: str | None = None
        self.actors = []
        self._specs: list[tuple[dict[str, Any], dict[str, Any]]] = []  # (actor options, constructor kwargs)
        self._remote_cls = remote_cls
        f = cfg.fault
        launches = self.kind.launches(cfg)
        self.fault_tolerant = f.use_fault_tolerance and self.kind.restartable
        self.check_timeout = f.rollout_health_check_timeout
        self.startup_timeout = cfg.sglang.sglang_server_startup_timeout
        # The servers' base URLs (engines that drive a server over HTTP; None for an embedded engine).
        self.server_urls: list[str | None] = []
        # Set by the weight sync: loads the trainers' current weights into restarted engines ({index: new actor}).
        self.rejoin: Callable[[dict[int, Any]], None] | None = None
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._restarts: dict[int, concurrent.futures.Future] = {}
        self._released_tags: list[str] | None = None
        self.monitor: HealthMonitor | None = None
        # slime's bound on requests through the router: --sglang-server-concurrency per engine.
        self.request_limit = cfg.sglang.sglang_server_concurrency * max(n, 1)
        self._request_slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        try:
            urls = self._launch_servers(cfg, placement, model_path, n, per) if launches else None
            for i in range(n):
                kwargs = self.kind.kwargs(cfg, model_path, i)
                if urls is not None:
                    kwargs["base_url"] = urls[i]
                self.server_urls.append(kwargs.get("base_url"))
                # An engine that drives a server over HTTP needs no device of its own: the server holds it.
                opts = placement.options(placement.engine_bundles[i]) if per and urls is None else {"num_cpus": 0}
                self._specs.append((opts, kwargs))
                self.actors.append(remote_cls.options(**opts).remote(**kwargs))
            if self.kind.router:
                self._start_router(cfg, remote_cls, model_path, [ray.get(a.url.remote()) for a in self.actors])
        except BaseException:
            self.shutdown()
            raise
        self._next_engine = 0
        if self.fault_tolerant and self.actors:
            # Health checks start once every engine is built: a check waits behind the constructor (the model load).
            ray.get([a.weight_version.remote() for a in self.actors])
            self.monitor = HealthMonitor(
                self.live_engines,
                self._engine_failed,
                interval=f.rollout_health_check_interval,
                timeout=f.rollout_health_check_timeout,
                first_wait=f.rollout_health_check_first_wait,
            )
            self.monitor.resume()

    # ------------------------------------------------------------------ fault tolerance

    def live_engines(self) -> dict[int, Any]:
        """The engines that take requests now (index -> actor): all but those being restarted."""
        with self._lock:
            return {i: a for i, a in enumerate(self.actors) if i not in self._restarts}

    def _engine_failed(self, index: int, actor: Any, reason: str) -> None:
        """Engine ``index`` (``actor``) died or is unhealthy: kill it and restart it (stop the job without fault
        tolerance). A second report of the same death does nothing."""
        if not self.fault_tolerant:
            hint = (
                f"{FT_FLAG} restarts dead engines and re-dispatches their requests"
                if self.kind.restartable
                else "restarting this kind of engine is not built yet"
            )
            raise EngineDied(
                f"rollout engine {index} ({self.kind.cls.rpartition(':')[2]}) {reason}: the job stops ({hint})"
            )
        with self._lock:
            if self.actors[index] is not actor or index in self._restarts:
                return
            future: concurrent.futures.Future = concurrent.futures.Future()
            self._restarts[index] = future
        print(f"rlcore-run: rollout engine {index} {reason}; restarting it", flush=True)
        with contextlib.suppress(ray.exceptions.RayError):
            ray.kill(actor, no_restart=True)
        threading.Thread(
            target=self._restart, args=(index, future), name=f"rlcore-restart-{index}", daemon=True
        ).start()

    def _restart(self, index: int, future: concurrent.futures.Future) -> None:
        """Build engine ``index`` again, load the trainers' weights into it, then let it take requests.

        An engine with a server: the server leaves the router first; a server launched here is launched again (a
        new port) by its launcher, an external one is waited for until it answers again (up to
        ``--sglang-server-startup-timeout``); the new server joins the router once it holds the weights.
        """
        try:
            opts, kwargs = self._specs[index]
            url = self.server_urls[index]
            if url is not None and self.router_url is not None:
                with contextlib.suppress(Exception):  # best effort: a router drops a dead worker by itself too
                    launcher.remove_router_worker(self.router_url, url, timeout=self.check_timeout)
            if index < len(self._server_specs):
                url = self._relaunch(index)
                kwargs = {**kwargs, "base_url": url}
                self._specs[index] = (opts, kwargs)
            elif url is not None:
                self._wait_external(index, url)
            actor = self._remote_cls.options(**opts).remote(**kwargs)
            ray.get(actor.weight_version.remote())  # built
            if self.rejoin is not None:
                self.rejoin({index: actor})
            if self._released_tags is not None:
                ray.get(actor.release_memory.remote(self._released_tags))
            if url is not None and self.router_url is not None:
                launcher.add_router_workers(self.router_url, [url])
        except BaseException as err:
            future.set_exception(err)
            return
        with self._lock:
            self.actors[index] = actor
            self.server_urls[index] = url
            del self._restarts[index]
            self.counts["restarts"] += 1
        print(f"rlcore-run: rollout engine {index} restarted" + (f" (server {url})" if url else ""), flush=True)
        future.set_result(actor)

    def _relaunch(self, index: int) -> str:
        """Stop what is left of engine ``index``'s server and launch it again (a new launcher on the same bundle if
        the old one died too); its new base URL."""
        launcher_opts, env, argv = self._server_specs[index]
        la = self.launchers[index]
        try:
            ray.get(la.stop.remote(grace=SERVER_STOP_GRACE_S))
        except ray.exceptions.RayActorError:
            la = ray.remote(launcher.ProcessLauncher).options(**launcher_opts).remote(env=env)
            self.launchers[index] = la
        return ray.get(la.start.remote(argv, health_path="/health_generate", timeout=self.startup_timeout))

    def _wait_external(self, index: int, url: str) -> None:
        """Wait until the external server of engine ``index`` answers again; :class:`EngineDied` after
        ``--sglang-server-startup-timeout`` seconds (it is not ours to relaunch)."""
        deadline = time.monotonic() + self.startup_timeout
        while not launcher.server_alive(url, timeout=self.check_timeout):
            if time.monotonic() >= deadline:
                raise EngineDied(
                    f"rollout engine {index}'s server {url} (--rollout-external-engine-addrs) did not answer again "
                    f"within --sglang-server-startup-timeout {self.startup_timeout:g} s: the job stops"
                )
            time.sleep(EXTERNAL_POLL_S)

    def _restarted(self, index: int, future: concurrent.futures.Future, timeout: float | None = None) -> Any:
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise
        except EngineDied:
            raise
        except Exception as err:
            raise EngineDied(f"rollout engine {index} died and could not be restarted ({first_line(err)})") from err

    def wait_restarts(self) -> list[Any]:
        """Wait until no engine is being restarted; every engine's actor, in index order."""
        while True:
            with self._lock:
                pending = dict(self._restarts)
            if not pending:
                with self._lock:
                    return list(self.actors)
            for index, future in pending.items():
                self._restarted(index, future)

    def find_dead(self, actors: Sequence[Any]) -> dict[int, str]:
        """Which of ``actors`` (all the engines, in index order) do not answer a control call, or whose server does
        not answer at all: index -> why."""
        refs = [a.weight_version.remote() for a in actors]
        ray.wait(refs, num_returns=len(refs), timeout=self.check_timeout)
        dead = {}
        for index, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.GetTimeoutError:
                dead[index] = f"did not answer in --rollout-health-check-timeout {self.check_timeout:g} s"
            except ray.exceptions.RayError as err:
                if engine_died(err):
                    dead[index] = f"died ({first_line(err)})"
        return {**dead, **self._dead_servers(exclude=set(dead))}

    def _dead_servers(self, exclude: set[int] = frozenset()) -> dict[int, str]:
        """Engines whose server (``server_urls``) does not answer at all: index -> why."""
        dead = {}
        for index, url in enumerate(list(self.server_urls)):
            if url is not None and index not in exclude and not launcher.server_alive(url, timeout=self.check_timeout):
                dead[index] = f"its server {url} does not answer"
        return dead

    def on_all(self, fn: Callable[[list[Any]], T], *, what: str) -> T:
        """``fn(actors)`` with every engine's actor; when it fails because an engine died (restarted meanwhile),
        once more with the restarted engines, up to :data:`MAX_GROUP_CALL_TRIES` times."""
        for _ in range(MAX_GROUP_CALL_TRIES):
            actors = self.wait_restarts()
            try:
                return fn(actors)
            except ray.exceptions.RayError:
                dead = self.find_dead(actors)
                if not dead:
                    raise
                for index, reason in dead.items():
                    self._engine_failed(index, actors[index], f"{reason} during {what}")
        raise EngineDied(f"rollout engines kept dying during {what} ({MAX_GROUP_CALL_TRIES} tries)")

    async def _live_actor(self, preferred: int) -> tuple[int, Any]:
        """Engine ``preferred`` when it is live, else the next live one, else (none live) ``preferred`` once it is
        restarted."""
        with self._lock:
            n = len(self.actors)
            for k in range(n):
                index = (preferred + k) % n
                if index not in self._restarts:
                    return index, self.actors[index]
            future = self._restarts[preferred]
        return preferred, await asyncio.wrap_future(future)

    async def _generate_on(self, preferred: int, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """``generate`` on engine ``preferred``; when the engine dies under it, again on a live engine."""
        while True:
            index, actor = await self._live_actor(preferred)
            try:
                return await actor.generate.remote(prompts, params)
            except ray.exceptions.RayActorError as err:
                if not engine_died(err):
                    raise
                self._engine_failed(index, actor, f"died during generate ({first_line(err)})")
                with self._lock:
                    self.counts["redispatched_requests"] += len(prompts)

    async def _generate_routed(
        self, prompt: list[int], params: SamplingParams, key: str | None, seed: int | None = None
    ) -> list[Generation]:
        """One prompt through the router. The router retries a request on another server itself; when it gives up
        (a server error: every server it tried is gone), the servers are checked at once, the dead ones restarted
        (or, without fault tolerance, the job stops), and the request is sent again once a server is live."""
        async with self._slots():
            return await self._generate_routed_now(prompt, params, key, seed)

    def _slots(self) -> asyncio.Semaphore:
        """The semaphore of :attr:`request_limit` requests, one per event loop (a job has one; tests run several)."""
        loop = asyncio.get_running_loop()
        if self._request_slots is None or self._request_slots[0] is not loop:
            self._request_slots = (loop, asyncio.Semaphore(self.request_limit))
        return self._request_slots[1]

    async def _generate_routed_now(
        self, prompt: list[int], params: SamplingParams, key: str | None, seed: int | None
    ) -> list[Generation]:
        seeds = None if seed is None else [seed]
        for _ in range(MAX_ROUTED_TRIES):
            try:
                return await self.router.generate.remote([prompt], params, routing_key=key, sampling_seeds=seeds)
            except ray.exceptions.RayTaskError as err:
                if not _server_side(err):
                    raise
                failure = err
            why = first_line(getattr(failure, "cause", None) or failure)
            dead = await asyncio.to_thread(self._fail_dead_servers, f"failed a request ({why})")
            if not dead and not self._restarts:
                raise failure  # no server is dead: the error is the request's own
            await self._until_one_live()
            with self._lock:
                self.counts["redispatched_requests"] += 1
        raise EngineDied(f"rollout engines kept dying under a request ({MAX_ROUTED_TRIES} tries)")

    def _fail_dead_servers(self, what: str) -> dict[int, str]:
        """Report every live engine whose server does not answer (see :meth:`_engine_failed`); those found."""
        live = self.live_engines()
        dead = self._dead_servers(exclude=set(range(len(self.actors))) - set(live))
        for index, reason in dead.items():
            self._engine_failed(index, live[index], f"{reason}: the router {what}")
        return dead

    async def _until_one_live(self) -> None:
        """Return once some engine takes requests (waiting for a restart while none does)."""
        while True:
            with self._lock:
                if len(self._restarts) < len(self.actors):
                    return
                index, future = next(iter(self._restarts.items()))
            try:
                await asyncio.wrap_future(future)
            except Exception:
                self._restarted(index, future)  # raises EngineDied

    def pop_metrics(self) -> dict[str, float]:
        """Restarts and re-dispatched requests since the last call (``engines/*``)."""
        with self._lock:
            counts, self.counts = self.counts, Counter()
        return {
            "engines/restarts": counts["restarts"],
            "engines/redispatched_requests": counts["redispatched_requests"],
        }

    # ------------------------------------------------------------------ requests

    def _launch_servers(self, cfg: Config, placement: Placement, model_path: str, n: int, per: int) -> list[str]:
        """Start one server per engine, each by a launcher on the engine's first bundle; their base URLs."""
        s = cfg.sglang
        pending = []
        for i in range(n):
            bundles = placement.engine_bundles[i * per : (i + 1) * per]
            env = {"CUDA_VISIBLE_DEVICES": ",".join(_gpu_ids(placement, bundles))} if placement.use_gpu else {}
            launcher_opts = placement.options(bundles[0])
            actor = ray.remote(launcher.ProcessLauncher).options(**launcher_opts).remote(env=env)
            self.launchers.append(actor)
            argv = launcher.server_argv(
                s.sglang_server_command,
                model_path=model_path,
                host="{host}",
                port="{port}",
                tp_size=s.rollout_num_gpus_per_engine,
                # slime's seeds: engine i's server starts at --seed + i x --num-gpus-per-node.
                seed=cfg.seed + i * cfg.resources.num_gpus_per_node,
                server_args=server_args(cfg),
            )
            self._server_specs.append((launcher_opts, env, argv))
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
                # A free metrics port unless given: the router's fixed default collides with a second job's router.
                # Metrics bind where the router does (its default is 0.0.0.0: every interface).
                router_args={
                    "prometheus_port": launcher.free_port(),
                    "prometheus_host": "{host}",
                    **(s.router_args or {}),
                },
            )
            self.router_url = ray.get(
                self.router_launcher.start.remote(argv, health_path="/health", timeout=s.sglang_server_startup_timeout)
            )
        # A thread per request in flight, up to ROUTER_CLIENT_THREADS (generate_async's requests are bounded here).
        threads = min(self.request_limit, ROUTER_CLIENT_THREADS)
        self.router = remote_cls.options(num_cpus=0, max_concurrency=threads).remote(
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
        return [
            self.actors[e].generate.remote(list(prompts[lo:hi]), params) for e, lo, hi in self._chunks(len(prompts))
        ]

    def _chunks(self, n_prompts: int) -> list[tuple[int, int, int]]:
        """``assign_chunks`` over the engines: from engine 0 for a batch, round-robin for calls of fewer prompts."""
        n = len(self.actors)
        if n_prompts >= n:
            return assign_chunks(n_prompts, n)
        chunks = assign_chunks(n_prompts, n, start=self._next_engine)
        self._next_engine = (self._next_engine + len(chunks)) % n
        return chunks

    async def generate(
        self,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        *,
        session_ids: Sequence[str | None] | None = None,
        sampling_seeds: Sequence[int] | None = None,
    ) -> list[Generation]:
        """``generate_async``'s calls, awaited; an engine that dies under a call is handled as the module docstring
        says (its requests go to a live engine, or wait for its restart). Through the router each prompt's
        ``sampling_seeds`` entry is its SGLang ``sampling_seed``; engines without a router draw their own seeds
        (``SGLangEngine``'s per-call counter, part of the checkpointed RNG state)."""
        if self.router is not None:
            for name, values in (("session_ids", session_ids), ("sampling_seeds", sampling_seeds)):
                if values is not None and len(values) != len(prompts):
                    raise ValueError(f"{name} has {len(values)} entries for {len(prompts)} prompts")
            keys = session_ids or [None] * len(prompts)
            seeds = sampling_seeds or [None] * len(prompts)
            outs = await asyncio.gather(
                *(
                    self._generate_routed(list(p), params, k, seed)
                    for p, k, seed in zip(prompts, keys, seeds, strict=True)
                )
            )
        elif not self.actors:
            outs = [await ref for ref in self.generate_async(prompts, params, session_ids=session_ids)]
        else:
            outs = await asyncio.gather(
                *(self._generate_on(e, list(prompts[lo:hi]), params) for e, lo, hi in self._chunks(len(prompts)))
            )
        return [g for out in outs for g in out]

    def _all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self.on_all(
            lambda actors: ray.get([getattr(a, method).remote(*args, **kwargs) for a in actors]), what=method
        )

    def update_weights_from_disk(self, path: str, *, weight_version: int) -> None:
        self._all("update_weights_from_disk", path, weight_version=weight_version)

    def load_lora_adapter(self, path: str, *, weight_version: int) -> None:
        """Every engine (SGLang's) loads the peft adapter folder ``path`` and generates with it, through the router
        too."""
        self._all("load_lora_adapter", path, weight_version=weight_version)
        if self.router is not None:
            ray.get(self.router.use_lora_adapter.remote(weight_version))

    def tp_sizes(self) -> list[int]:
        """Each engine's ranks in a weight-update group (its tensor-parallel size)."""
        return self._all("tp_size")

    def weight_versions(self) -> list[int]:
        return self._all("weight_version")

    def weight_dtype(self) -> str:
        """The dtype the engines hold their weights in (they are built alike, so engine 0 answers for all)."""
        return self.on_all(lambda actors: ray.get(actors[0].weight_dtype.remote()), what="weight_dtype")

    def abort(self) -> None:
        """Cut every running generation short (each returns its partial response, ``finish_reason="abort"``)."""
        self._all("abort")

    @contextlib.contextmanager
    def generation_paused(self) -> Iterator[None]:
        """Every engine's generation paused for the block (``pause_generation``, then ``continue_generation``; the
        engine kind must pause, see ``EngineKind.pauses_generation``): requests in flight stop where they are and new
        ones wait, nothing is lost, and they go on after it with the engines' weights of then. No health checks run
        meanwhile (a paused server cannot generate its check's token)."""
        if self.monitor is not None:
            self.monitor.pause()
        self._all("pause_generation")
        try:
            yield
        finally:
            self._all("continue_generation")
            if self.monitor is not None and self._released_tags is None:
                self.monitor.resume()

    def get_weights(self, index: int = 0) -> dict[str, Any]:
        """Engine ``index``'s weights (embedded engines only; tests compare them with the trainer's)."""
        return ray.get(self.actors[index].get_weights.remote())

    def get_rng_state(self) -> list[Any]:
        return self._all("get_rng_state")

    def set_rng_state(self, states: list[Any]) -> None:
        self.on_all(
            lambda actors: ray.get([a.set_rng_state.remote(s) for a, s in zip(actors, states, strict=True)]),
            what="set_rng_state",
        )

    def release_memory(self, tags: list[str] | None = None) -> None:
        # A released engine cannot generate, so it reports itself unhealthy: no checks until the resume.
        if self.monitor is not None:
            self.monitor.pause()
        self._all("release_memory", tags)
        self._released_tags = sorted(
            set(self._released_tags or []) | set(tags or ["weights", "kv_cache", "cuda_graph"])
        )

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self._all("resume_memory", tags)
        left = sorted(set(self._released_tags or []) - set(tags or ["weights", "kv_cache", "cuda_graph"]))
        self._released_tags = left or None
        if self.monitor is not None and self._released_tags is None:
            self.monitor.resume()

    def health(self) -> list[bool]:
        return self._all("health")

    def device_memory(self) -> list[dict[str, int] | None]:
        """Each engine's peak reserved GPU memory and device total (``HFEngine.device_memory``); None for an engine
        that does not report it (an SGLang server holds a fixed fraction of its GPU) or runs on the CPU."""
        if not hasattr(self.kind.load(), "device_memory"):
            return [None] * len(self.actors)
        return self._all("device_memory")

    def shutdown(self) -> None:
        """Close the engines, stop the router and the servers this group launched (best effort: this also runs while
        a failed job unwinds)."""
        if self.monitor is not None:
            self.monitor.stop()
        for future in list(self._restarts.values()):
            with contextlib.suppress(Exception):
                ray.kill(future.result(timeout=self.check_timeout))
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
