"""The reward hub: built-in rule-based rewards and custom reward functions with slime's signatures.

A custom function (``--custom-rm-path``) is one of

- per sample: ``[async] def reward_func(args, sample: Sample, **kwargs) -> float``
- batched: ``[async] def reward_func(args, samples: list[Sample], **kwargs) -> list[float]``

told apart by the second parameter (named ``samples``, or annotated as a list / sequence), or declared batched by
``--group-rm``. A batched function is called once per group with ``--group-rm`` (as slime), once per sampling round
without it. ``--rm-type`` names a built-in type instead (``runtime.rollout.rm_hub``: slime's ``deepscaler``, ``dapo``,
``f1``, ``gpqa``, ``random``, ``remote_rm`` and the ``boxed_`` prefix, plus ``math`` and ``exact_match``). A dict
reward is stored whole in ``sample.reward``; the scalar that trains is its ``--reward-key`` entry (``score`` when the
flag is unset; ``--eval-reward-key`` for evaluation).

Every call, sync or async, runs in a worker process (an async one on an event loop of its own there), at most
``max_workers`` at a time, so that no call, not even an ``async def`` that blocks (``time.sleep``, a synchronous HTTP
client), can stall the rollout's event loop or outlive ``--reward-timeout``: a call past its timeout is killed with its
worker (SIGTERM, then SIGKILL), and a fresh worker takes its place. The workers are forked from the hub's process on
its first call (the function, ``args`` and every module loaded so far come with the fork, nothing is re-imported), so
a function keeps module-level state per worker, not across workers; the sample it is given is a copy, and what it
sets on it is copied back. A function that needs to run in the hub's own process (it calls Ray, or shares state
between calls) says so with ``fn.isolation = "thread"``; ``random`` (one seeded generator) and ``remote_rm`` (HTTP with
its own timeouts) run there too. There, every call has a thread of its own (an async one on its own event loop in
that thread); a timed-out thread cannot be killed from Python and runs on until the function returns, keeping its
slot until then, so at most ``max_workers`` threads of a hub are ever alive.

A call that raises (anything: ``sys.exit()`` and ``KeyboardInterrupt`` included), returns something that is not a
finite number, ends its worker, or runs past ``--reward-timeout`` gives reward 0 and is counted (``reward/errors``,
``reward/timeouts`` in ``pop_metrics()``); the job goes on (``--max-reward-error-rate`` bounds how long, in the loop).
The timeout of a call counts from the moment it starts, not from when it began waiting for one of the
``max_workers`` slots; a batched function has one deadline for its batch. ``remote_rm`` times its own requests
(``--reward-timeout`` per attempt, with retries).

A hung reward costs about one ``--reward-timeout`` a step and leaves nothing behind. The calls of one ``score`` share
a progress deadline: a call still waiting for a slot when no call has finished for ``--reward-timeout`` seconds is
not started and counts as a timeout. A function that hangs on every call therefore costs one timeout a step (not
one per ``max_workers`` samples), and one that hangs now and then loses only the calls that hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import logging
import math
import multiprocessing
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import pebble

from runtime.config import RewardConfig
from runtime.hooks import load_function
from runtime.rollout.rm_hub import RULE_REWARDS, RandomReward, RemoteRewardModel, boxed
from runtime.rollout.sample import Sample

logger = logging.getLogger(__name__)

BUILTIN_TASK_REWARD = "runtime.demo.task:reward"


class _DropTimeoutDisabledNotice(logging.Filter):
    """math-verify warns on every call that its own (SIGALRM) timeout is off; the hub times calls instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


@functools.cache
def _answer_extraction() -> list[Any]:
    from math_verify import LatexExtractionConfig

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_DropTimeoutDisabledNotice())

    # Only a \boxed{} answer (or an explicit "final answer is" anchor) counts: a stray number in the
    # reasoning must not score.
    return [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)]


def math_reward(args: Any, sample: Sample, **kwargs: Any) -> float:
    """1.0 if the response's ``\\boxed{}`` answer equals the label mathematically (math-verify), else 0.0.

    The label may be a number, an expression (``"\\frac{1}{2}"``, ``"0.5"``) or LaTeX. A label math-verify
    cannot parse raises ``ValueError`` (counted as a reward error by the hub).
    """
    from math_verify import parse, verify

    # parsing_timeout/timeout_seconds use SIGALRM, which only works in the main thread; the hub times calls itself.
    if sample.label is None or not str(sample.label).strip():
        raise ValueError(f"math reward: sample {sample.index} has no label")
    extraction = _answer_extraction()
    label = str(sample.label).strip()
    # A bare label is read as one LaTeX expression: unwrapped, math-verify would take "1+x" for its first number.
    gold = parse(f"${label}$", parsing_timeout=None) if "$" not in label and "\\boxed" not in label else []
    gold = gold or parse(label, parsing_timeout=None)
    if not gold:
        raise ValueError(f"math reward: label {sample.label!r} of sample {sample.index} is not a math answer")
    answer = parse(sample.response, extraction_config=extraction, parsing_timeout=None)
    if not answer:
        return 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=None) else 0.0


def exact_match_reward(args: Any, sample: Sample, **kwargs: Any) -> float:
    """1.0 if the response equals the label after stripping surrounding whitespace, else 0.0."""
    if sample.label is None:
        raise ValueError(f"exact_match reward: sample {sample.index} has no label")
    return 1.0 if sample.response.strip() == str(sample.label).strip() else 0.0


_RULES: dict[str, Callable[..., Any]] = {"math": math_reward, "exact_match": exact_match_reward, **RULE_REWARDS}
RM_NAMES = ("builtin", *_RULES, "random", "remote_rm")


# The label types a built-in reward can score, for those that read the label as text: a float64 column (314.0) is
# "314.0" to them and never equals an answer of "314". Rewards not listed take any label (math-verify, dapo and gpqa
# read numbers as numbers; custom and remote rewards decide for themselves).
TEXT_LABEL_TYPES: tuple[type, ...] = (str, int)
LABEL_TYPES: dict[str, tuple[type, ...]] = {"exact_match": TEXT_LABEL_TYPES, "f1": TEXT_LABEL_TYPES}


def check_label_types(labels: Sequence[Any], cfg: RewardConfig, *, label_key: str | None, source: str) -> None:
    """Raise ``DataError`` (one line: the column, the type, the reward) when ``labels`` hold a type the reward
    ``cfg`` names cannot score (``LABEL_TYPES``); nothing for a custom reward (``--custom-rm-path``)."""
    from runtime.rollout.data import DataError

    if cfg.custom_rm_path is not None or label_key is None:
        return
    accepted = LABEL_TYPES.get(cfg.rm_type.removeprefix("boxed_"))
    if accepted is None:
        return
    bad = [
        label for label in labels if label is not None and (isinstance(label, bool) or not isinstance(label, accepted))
    ]
    if bad:
        kinds = ", ".join(sorted({type(label).__name__ for label in bad}))
        raise DataError(
            f"--label-key {label_key}: {source} holds {len(bad)} {kinds} labels (first: {bad[0]!r}), which --rm-type "
            f"{cfg.rm_type} compares with the response as text and can never match: store the column as "
            f"{' or '.join(t.__name__ for t in accepted)} (or use --rm-type math)"
        )


def is_batched(fn: Callable[..., Any]) -> bool:
    """Whether a reward function takes a list of samples (slime's group RM) rather than one sample.

    An explicit ``fn.batched = True/False`` attribute wins; otherwise the second parameter decides: named
    ``samples``, or annotated ``list[...]`` / ``Sequence[...]``.
    """
    explicit = getattr(fn, "batched", None)
    if isinstance(explicit, bool):
        return explicit
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2:
        raise TypeError(
            f"reward function {getattr(fn, '__name__', fn)!r} must take (args, sample) or (args, samples), "
            f"got parameters {[p.name for p in params]}"
        )
    second = positional[1]
    if second.name == "samples":
        return True
    annotation = second.annotation
    text = annotation if isinstance(annotation, str) else repr(annotation)
    return text.replace("typing.", "").startswith(("list", "List", "Sequence", "collections.abc.Sequence"))


def _is_async(fn: Callable[..., Any]) -> bool:
    # A callable object with ``async def __call__`` is async too.
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


ISOLATIONS = ("process", "thread")
# Where the built-in types run. In worker processes: those that call math-verify (sympy), which can run away on an
# adversarial answer. In the hub's process: the string rules, bounded and cheap (a worker's fork would cost more
# than they do); random, whose one seeded generator would repeat itself in every worker; remote_rm, which bounds and
# retries its own HTTP requests.
BUILTIN_ISOLATION: dict[str, str] = {
    "math": "process",
    "deepscaler": "process",
    "dapo": "process",
    "builtin": "thread",
    "exact_match": "thread",
    "f1": "thread",
    "gpqa": "thread",
    "random": "thread",
    "remote_rm": "thread",
}


def _load_math_verify() -> None:
    # In the hub's process before the workers fork, so that they inherit math-verify (and sympy) loaded instead of
    # each importing it on its first call (seconds of CPU apiece).
    import math_verify  # noqa: F401

    _answer_extraction()


# What a built-in type loads before its workers fork.
_WARM_UP: dict[str, Callable[[], None]] = {name: _load_math_verify for name in ("math", "deepscaler", "dapo")}


def reward_isolation(fn: Callable[..., Any], rm_type: str | None = None) -> str:
    """Where a reward function's calls run: ``"process"`` (killable; every custom function unless it says otherwise)
    or ``"thread"`` (the hub's own process), from ``fn.isolation`` when set, else ``BUILTIN_ISOLATION[rm_type]``."""
    explicit = getattr(fn, "isolation", None)
    if explicit is not None:
        if explicit not in ISOLATIONS:
            name = getattr(fn, "__name__", type(fn).__name__)
            raise ValueError(f"reward function {name!r}: isolation must be one of {ISOLATIONS}, got {explicit!r}")
        return explicit
    return "process" if rm_type is None else BUILTIN_ISOLATION[rm_type.removeprefix("boxed_")]


def _as_reward(value: Any, key: str | None = None) -> tuple[float, float | dict[str, Any]]:
    """``(scalar reward, what to store in sample.reward)``; raises ``ValueError`` for anything else. The scalar of a
    dict reward is its ``key`` entry (``score`` when None)."""
    stored = value
    if isinstance(value, dict):
        key = key or "score"
        if key not in value:
            raise ValueError(f"a dict reward needs a {key!r} entry (--reward-key), got keys {sorted(value)}")
        value = value[key]
    if hasattr(value, "item") and not isinstance(value, bool | int | float):
        value = value.item()  # numpy / torch scalars
    if not isinstance(value, bool | int | float):
        raise ValueError(f"reward must be a number, got {type(value).__name__} {value!r:.80}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"reward must be finite, got {value}")
    return value, stored if isinstance(stored, dict) else value


def _resolve(cfg: RewardConfig, *, seed: int = 0, remote_backoff_s: float = 1.0) -> tuple[str, Callable[..., Any]]:
    if cfg.custom_rm_path is not None:
        return cfg.custom_rm_path, load_function(cfg.custom_rm_path)
    if cfg.rm_type == "builtin":
        return BUILTIN_TASK_REWARD, load_function(BUILTIN_TASK_REWARD)
    base = cfg.rm_type.removeprefix("boxed_")
    if base == "remote_rm":
        fn: Callable[..., Any] = RemoteRewardModel(
            cfg.rm_url or "", timeout=cfg.reward_timeout, backoff_s=remote_backoff_s, proxy=cfg.http_proxy
        )
    elif base == "random":
        fn = RandomReward(seed)
    elif base in _RULES:
        fn = _RULES[base]
    else:
        raise ValueError(f"cfg.rm_type must be one of {', '.join(RM_NAMES)} (or boxed_<type>), got {cfg.rm_type!r}")
    return cfg.rm_type, boxed(fn) if cfg.rm_type.startswith("boxed_") else fn


class RewardHub:
    """Scores samples with the function ``cfg`` names; never raises for a failing reward function.

    ``cfg.custom_rm_path`` wins over ``cfg.rm_type`` (as in slime). ``args`` is passed through to the
    reward function as its first argument (slime passes its argparse namespace; rlcore passes the ``Config``).
    """

    def __init__(
        self,
        cfg: RewardConfig,
        args: Any = None,
        *,
        max_workers: int = 8,
        evaluation: bool = False,
        seed: int = 0,
        remote_backoff_s: float = 1.0,
    ):
        if not isinstance(cfg, RewardConfig):
            raise TypeError(f"cfg must be a runtime.config.RewardConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.args = args
        self._resolve_kwargs = {"seed": seed, "remote_backoff_s": remote_backoff_s}
        self.name, self.fn = _resolve(cfg, **self._resolve_kwargs)
        # The scalar of a dict reward: --reward-key (--eval-reward-key, falling back to it, for evaluation).
        self.reward_key = (cfg.eval_reward_key or cfg.reward_key) if evaluation else cfg.reward_key
        # slime's --group-rm says a custom function takes a group's samples; a built-in type scores one at a time.
        self.batched = (cfg.group_rm and cfg.custom_rm_path is not None) or is_batched(self.fn)
        self.is_async = _is_async(self.fn)
        self.isolation = reward_isolation(self.fn, None if cfg.custom_rm_path is not None else cfg.rm_type)
        # remote_rm bounds each HTTP attempt by --reward-timeout itself, so that it can retry.
        self._timeout = None if isinstance(self.fn, RemoteRewardModel) else cfg.reward_timeout
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers must be a positive int, got {max_workers!r}")
        self._max_workers = max_workers
        self._init_slots()
        self._workers = self._worker_pool()
        self._metrics = self._zero_metrics()

    def _init_slots(self) -> None:
        # Running calls of the current event loop (one per loop: a loop may run a fresh asyncio.run per step) and
        # timed-out calls whose threads still run, of any loop; together at most max_workers.
        self._lock = threading.Lock()
        self._free: asyncio.Condition | None = None
        self._free_loop: asyncio.AbstractEventLoop | None = None
        self._active = self._stuck = 0

    @staticmethod
    def _zero_metrics() -> dict[str, float]:
        return {"reward/errors": 0, "reward/timeouts": 0, "reward/num_scored": 0, "reward/time": 0.0}

    def pop_metrics(self) -> dict[str, float]:
        """Counters since the last call: errors, timeouts, samples scored, seconds spent scoring (and failed HTTP
        attempts of ``remote_rm``)."""
        metrics, self._metrics = self._metrics, self._zero_metrics()
        if isinstance(self.fn, RemoteRewardModel):
            metrics["reward/remote_failures"] = self.fn.pop_failures()
        return metrics

    def close(self) -> None:
        """Stop the worker processes (a later ``score`` forks fresh ones); threads of timed-out calls of a
        ``"thread"`` hub finish on their own."""
        with self._lock:
            self._free = self._free_loop = None
        if self._workers is not None:
            self._workers.close()

    async def score(self, samples: Sequence[Sample]) -> list[float]:
        """Score ``samples``, set each ``sample.reward``, and return the scalar rewards (0.0 where scoring failed)."""
        samples = list(samples)
        if not all(isinstance(s, Sample) for s in samples):
            kinds = sorted({type(s).__name__ for s in samples})
            raise TypeError(f"samples must be a list of runtime.rollout.sample.Sample, got {kinds}")
        if not samples:
            return []
        start = time.perf_counter()
        progress = _Progress()
        if self.batched and self.cfg.group_rm:
            # slime's --group-rm: the batched function sees one prompt's group per call.
            groups: dict[Any, list[int]] = {}
            for i, sample in enumerate(samples):
                groups.setdefault(sample.group_index, []).append(i)
            results: list[Any] = [None] * len(samples)
            scored = await asyncio.gather(
                *(self._score_batched([samples[i] for i in rows], progress) for rows in groups.values())
            )
            for rows, group_results in zip(groups.values(), scored, strict=True):
                for i, result in zip(rows, group_results, strict=True):
                    results[i] = result
        elif self.batched:
            results = await self._score_batched(samples, progress)
        else:
            results = await asyncio.gather(*(self._score_one(sample, progress) for sample in samples))
        rewards = []
        for sample, (value, stored) in zip(samples, results, strict=True):
            sample.reward = stored
            rewards.append(value)
        self._metrics["reward/num_scored"] += len(samples)
        self._metrics["reward/time"] += time.perf_counter() - start
        return rewards

    async def _score_one(self, sample: Sample, progress: _Progress) -> tuple[float, float | dict[str, Any]]:
        value = await self._guarded(sample, count=1, what=f"sample {sample.index}", progress=progress)
        if value is _FAILED:
            return 0.0, 0.0
        try:
            return _as_reward(value, self.reward_key)
        except ValueError as err:
            self._record_error(err, f"sample {sample.index}", count=1)
            return 0.0, 0.0

    async def _score_batched(
        self, samples: list[Sample], progress: _Progress
    ) -> list[tuple[float, float | dict[str, Any]]]:
        n = len(samples)
        failed = [(0.0, 0.0)] * n
        values = await self._guarded(samples, count=n, what=f"{n} samples", progress=progress)
        if values is _FAILED:
            return failed
        if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != n:
            size = len(values) if isinstance(values, Sequence) else type(values).__name__
            self._record_error(ValueError(f"batched reward returned {size} values for {n} samples"), "batch", count=n)
            return failed
        results = []
        for sample, value in zip(samples, values, strict=True):
            try:
                results.append(_as_reward(value, self.reward_key))
            except ValueError as err:
                self._record_error(err, f"sample {sample.index}", count=1)
                results.append((0.0, 0.0))
        return results

    async def _guarded(self, payload: Any, *, count: int, what: str, progress: _Progress) -> Any:
        """Call the function on ``payload`` (a sample, or a list of them) under the timeout; ``_FAILED`` (counted,
        logged) if it raises, times out, or is not started because no call of this ``score`` finished for
        ``--reward-timeout`` seconds."""
        if not await self._acquire(progress):
            self._metrics["reward/timeouts"] += count
            logger.warning(
                "reward %s: no call finished in %.1fs (%d still running past --reward-timeout): %s not scored, "
                "reward 0",
                self.name,
                self.cfg.reward_timeout,
                self._stuck,
                what,
            )
            return _FAILED
        try:
            if self._workers is not None:
                result, err = await self._workers.call(payload, self._timeout)
            else:
                result, err = await self._call_in_thread(functools.partial(self.fn, self.args, payload))
        except TimeoutError:
            self._metrics["reward/timeouts"] += count
            logger.warning("reward %s timed out after %.1fs on %s: reward 0", self.name, self.cfg.reward_timeout, what)
            return _FAILED
        else:
            progress.mark()  # before the slot is given back: a call waiting for it sees the deadline moved
        finally:
            await self._release()
        if err is not None:
            self._record_error(err, what, count=count)
            return _FAILED
        return result

    async def _call_in_thread(self, call: Callable[[], Any]) -> tuple[Any, Exception | None]:
        """``(result, None)`` or ``(None, error)`` of ``call`` in a thread of its own; ``TimeoutError`` past the
        timeout, the thread then keeping its slot until it returns."""
        ticket = _Ticket()

        async def attempt() -> tuple[Any, Exception | None]:
            # User exceptions are caught here, inside the timeout, so that a TimeoutError the function raises
            # itself is an error and not mistaken for the hub's timeout.
            try:
                return await _in_thread(functools.partial(_call_to_end, call), ticket, self._thread_done), None
            except Exception as err:  # any failure of user code becomes reward 0, never a crash
                return None, err

        try:
            return await asyncio.wait_for(attempt(), timeout=self._timeout)
        finally:
            with self._lock:
                # A thread still running keeps its slot until it returns (see the module docstring).
                ticket.abandoned = not ticket.finished
                self._stuck += ticket.abandoned

    async def _acquire(self, progress: _Progress) -> bool:
        """Take a slot; False when none frees up before no call of this ``score`` has finished for the timeout."""
        free = self._get_free()
        async with free:
            waited = False
            while waited or self._active + self._stuck >= self._max_workers:
                # A slot freed by a call that timed out (a killed worker) does not move the deadline either.
                remaining = None if self._timeout is None else progress.last + self._timeout - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                if self._active + self._stuck < self._max_workers:
                    break
                waited = True
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(free.wait(), remaining)
            self._active += 1
        return True

    async def _release(self) -> None:
        free = self._get_free()
        async with free:
            self._active -= 1
            free.notify()

    def _thread_done(self, ticket: _Ticket) -> None:
        """Called by a reward thread as it ends: an abandoned (timed-out) call gives its slot back now."""
        with self._lock:
            ticket.finished = True
            if not ticket.abandoned:
                return
            self._stuck -= 1
            loop, free = self._free_loop, self._free
        if loop is None or free is None:
            return

        async def wake() -> None:
            async with free:
                free.notify()

        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the next one reads the counts afresh
            loop.call_soon_threadsafe(lambda: loop.create_task(wake()))

    def _record_error(self, err: Exception, what: str, *, count: int) -> None:
        first = self._metrics["reward/errors"] == 0
        self._metrics["reward/errors"] += count
        # The first error of each logging window carries its traceback; later ones one line each.
        logger.warning(
            "reward %s failed on %s (%s: %s): reward 0",
            self.name,
            what,
            type(err).__name__,
            err,
            exc_info=err if first else None,
        )

    def _get_free(self) -> asyncio.Condition:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._free is None or self._free_loop is not loop:
                # Calls of an earlier loop have ended or timed out (those still running are counted in _stuck).
                self._free, self._free_loop, self._active = asyncio.Condition(), loop, 0
            return self._free

    def __getstate__(self) -> dict[str, Any]:
        # A hub may be shipped to a Ray actor: the function is re-imported there by path (a hook loaded
        # from a file is not importable by module name) and the slots start empty there.
        state = dict(self.__dict__)
        for name in ("fn", "_lock", "_free", "_free_loop", "_active", "_stuck", "_workers"):
            del state[name]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_slots()
        _, self.fn = _resolve(self.cfg, **self._resolve_kwargs)
        self._workers = self._worker_pool()

    def _worker_pool(self) -> _WorkerPool | None:
        if self.isolation != "process":
            return None
        builtin = self.cfg.custom_rm_path is None
        warm_up = _WARM_UP.get(self.cfg.rm_type.removeprefix("boxed_")) if builtin else None
        return _WorkerPool(self.fn, self.args, self._max_workers, warm_up=warm_up)


_FAILED = object()


class _Progress:
    """When a call of one ``score`` last finished (returned or raised): the start of the shared deadline."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    def mark(self) -> None:
        self.last = time.monotonic()


@dataclasses.dataclass
class _Ticket:
    """One reward thread: whether it has ended and whether its caller timed out (abandoned it)."""

    finished: bool = False
    abandoned: bool = False


class RewardCallExit(Exception):
    """A reward call that raised ``SystemExit``, ``KeyboardInterrupt`` or another ``BaseException``: counted as an
    error like any other, so that it neither ends the rollout's thread (the job would wait for it forever) nor the
    job. Made from the exception, or (unpickled from a worker) from its message."""

    def __init__(self, err: BaseException | str):
        message = err if isinstance(err, str) else f"raised {type(err).__name__}({', '.join(map(repr, err.args))})"
        super().__init__(message)


class RewardWorkerDied(Exception):
    """A reward call whose worker process ended under it (``os._exit``, a crash, a kill from outside)."""


class _WorkerPool:
    """Reward calls in worker processes forked from this one (``pebble.ProcessPool``) on the first call: a call past
    its timeout is killed with its worker, which a fresh fork replaces, so nothing of it is left running."""

    def __init__(self, fn: Callable[..., Any], args: Any, workers: int, *, warm_up: Callable[[], None] | None = None):
        self._fn, self._args, self._workers, self._warm_up = fn, args, workers, warm_up
        self._pool: pebble.ProcessPool | None = None
        self._stop: weakref.finalize | None = None
        self._lock = threading.Lock()

    def _get(self) -> pebble.ProcessPool:
        with self._lock:
            if self._pool is None:
                if self._warm_up is not None:
                    self._warm_up()
                # Forked, not spawned: a worker starts in milliseconds with every module and the function already
                # loaded (a spawned one would re-import them, about a second of CPU each, and needs picklable
                # functions). A worker only runs the reward function and never touches the parent's threads' state.
                self._pool = pebble.ProcessPool(
                    max_workers=self._workers,
                    initializer=_worker_init,
                    initargs=(self._fn, self._args),
                    context=multiprocessing.get_context("fork"),
                )
                # A hub dropped without close() (a test's, a caller's) stops its workers when it is collected.
                self._stop = weakref.finalize(self, _stop_pool, self._pool)
            return self._pool

    async def call(self, payload: Any, timeout: float | None) -> tuple[Any, Exception | None]:
        """``(result, None)`` or ``(None, error)`` of the function on ``payload``; ``TimeoutError`` past ``timeout``
        seconds from the call's start in its worker, once that worker is killed. What the function set on the
        sample(s) of ``payload`` is copied back onto them."""
        future = self._get().schedule(_worker_call, args=(payload,), timeout=timeout)
        try:
            result, err, returned = await asyncio.wrap_future(future)
        except pebble.ProcessExpired as died:
            return None, RewardWorkerDied(f"its worker process ended with exit code {died.exitcode}")
        except (pickle.PicklingError, TypeError, AttributeError) as err:  # the payload could not reach the worker
            return None, err
        if returned is not None:
            for mine, theirs in zip(payload if isinstance(payload, list) else [payload], returned, strict=True):
                mine.__dict__.update(theirs.__dict__)
        return result, err

    def close(self) -> None:
        with self._lock:
            pool, stop, self._pool, self._stop = self._pool, self._stop, None, None
        if pool is not None and stop is not None:
            stop()  # _stop_pool(pool), once


def _stop_pool(pool: pebble.ProcessPool) -> None:
    """End ``pool``'s workers (stop() only marks it stopped; join() ends them) and its threads."""
    pool.stop()
    pool.join(timeout=10)


# The function and args of this worker process, set by _worker_init as it starts.
_WORKER: tuple[Callable[..., Any], Any] | None = None


def _worker_init(fn: Callable[..., Any], args: Any) -> None:
    global _WORKER
    _WORKER = fn, args


def _worker_call(payload: Any) -> tuple[Any, Exception | None, list[Any] | None]:
    """In a worker: ``(result, None, samples as the function left them)`` or ``(None, error, None)``; an error is
    returned, never raised, so that the parent tells the function's own ``TimeoutError`` from the pool's, and a
    ``SystemExit`` does not end the worker."""
    assert _WORKER is not None, "a reward worker runs only after _worker_init"
    fn, args = _WORKER
    try:
        result = _call_to_end(functools.partial(fn, args, payload))
    except Exception as err:
        return None, _portable(err), None
    except BaseException as err:  # sys.exit() and the like
        return None, RewardCallExit(err), None
    return result, None, payload if isinstance(payload, list) else [payload]


def _portable(err: Exception) -> Exception:
    """``err``, or a ``RuntimeError`` naming it when it cannot be pickled back to the parent."""
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")
    return err


def reward_error_rate(metrics: dict[str, float]) -> float:
    """The fraction of the scored samples whose reward call failed or timed out, from a step's ``reward/*`` metrics
    (``RewardHub.pop_metrics``); 0 when nothing was scored."""
    scored = metrics.get("reward/num_scored", 0)
    return (metrics.get("reward/errors", 0) + metrics.get("reward/timeouts", 0)) / scored if scored else 0.0


def _call_to_end(call: Callable[[], Any]) -> Any:
    """``call()``, and if that is awaitable (an async function), its result on an event loop of this thread."""
    result = call()
    if not inspect.isawaitable(result):
        return result

    async def wait() -> Any:
        return await result

    return asyncio.run(wait())


async def _in_thread(call: Callable[[], Any], ticket: _Ticket, done: Callable[[_Ticket], None]) -> Any:
    """Run ``call`` in a new daemon thread and await its result; the thread starts at once (no pool queue), calls
    ``done(ticket)`` as it ends, and an abandoned (timed-out) call does not keep the process alive at exit."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, err: BaseException | None) -> None:
        if future.done():  # the caller timed out and moved on
            return
        if err is not None:
            future.set_exception(err)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, err = call(), None
        except Exception as exc:  # handed to the awaiting coroutine, which decides
            result, err = None, exc
        except BaseException as exc:  # sys.exit() and the like: re-raised in the event loop, they would end it
            result, err = None, RewardCallExit(exc)
        finally:
            done(ticket)
        try:
            loop.call_soon_threadsafe(settle, result, err)
        except RuntimeError:  # the event loop closed while this call ran past its timeout
            pass

    threading.Thread(target=run, name="reward", daemon=True).start()
    return await future
