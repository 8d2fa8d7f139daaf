"""Helpers of the test suite: the order that lets test modules share a Ray (tests/conftest.py), a test file rerun in
Triton's interpreter, a killed Ray actor waited for, and the two gloo ranks that the Megatron tests share."""

from __future__ import annotations

import atexit
import importlib.util
import multiprocessing
import os
import queue
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def ray_module_order(keys: Sequence[Hashable | None]) -> tuple[list[int], list[bool]]:
    """The order to run test modules in, and which of them hand their Ray on to the next.

    ``keys[i]`` is the Ray module ``i`` asks for (a sortable key of its resources), or None for a module that takes
    no shared Ray. Returns ``order``, the module indices to run in turn: first every module without a key, in their
    given order; then the modules with one, grouped by key (so each key's Ray starts once), in their given order within
    a group. And ``hand_on``, by module index: whether the module after it in ``order`` asks for the same Ray."""
    order = sorted(range(len(keys)), key=lambda i: (keys[i] is not None, keys[i] or ()))
    hand_on = [False] * len(keys)
    for here, after in zip(order, order[1:], strict=False):
        hand_on[here] = keys[here] is not None and keys[here] == keys[after]
    return order, hand_on


def ranks_first(
    order: list[int], keys: Sequence[Hashable | None], pooled: Sequence[bool]
) -> tuple[list[int], list[bool]]:
    """``ray_module_order``'s ``order`` with the modules that take the shared gloo ranks (``pooled[i]``) and no Ray
    moved to the front, together and in their order, so the ranks start once for them; the Ray groups keep their
    order and contiguity. Returns the order and, by module index, whether the next module in it takes the ranks too
    (the ranks are handed on rather than stopped)."""
    order = sorted(order, key=lambda i: (keys[i] is not None, keys[i] is None and not pooled[i]))
    hand_on = [False] * len(keys)
    for here, after in zip(order, order[1:], strict=False):
        hand_on[here] = pooled[here] and pooled[after]
    return order, hand_on


def interpreter_workers() -> int:
    """pytest-xdist workers for an interpreted rerun: one per usable core, at most 4. The interpreter runs each
    program instance in Python on one core, so on a 2-core machine two workers take about half the wall time. One
    (no xdist) where pytest-xdist (the dev extra) is not installed: the same cases, serially."""
    if importlib.util.find_spec("xdist") is None:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores, 4)


def run_interpreted(test_file: str, *, expect_passed: int | None = None, select: str | None = None, timeout: int):
    """Run ``tests/<test_file>`` in a fresh process with TRITON_INTERPRET=1 (Triton fixes interpreter-or-compiler when
    it is imported, so setting it in this process would come too late), its cases spread over
    ``interpreter_workers()`` pytest-xdist workers. Asserts the run passed, skipped and deselected nothing (or, under
    ``select``, a ``-k`` expression, passed exactly ``expect_passed``), and returns the summary line."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(TESTS / test_file)]
    if select is not None:
        command += ["-k", select]
    workers = interpreter_workers()
    if workers > 1:
        command += ["-p", "xdist", "-n", str(workers), "--dist", "worksteal"]
    result = subprocess.run(command, cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, result.stdout[-2000:]
    if select is None:
        assert "deselected" not in summary, result.stdout[-2000:]
    if expect_passed is not None:
        assert summary.split(" passed")[0].split()[-1] == str(expect_passed), summary
    return summary


def kill_and_wait_gone(actor, *, timeout_s: float = 60.0) -> None:
    """``ray.kill`` the actor and return once calls to it fail: ray.kill returns before the process is gone, and a
    call right after may still be answered by it. Fails the test if the actor still answers after ``timeout_s``."""
    import ray

    ray.kill(actor)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError(f"the killed actor still answered after {timeout_s} s")


# ---------------------------------------------------------------- gloo ranks shared between tests
# Each Megatron two-rank test used to spawn two fresh interpreters (torch.multiprocessing.spawn), each importing torch,
# transformers and megatron-core before its first line: about 10 s a test on a loaded 2-core machine, for a few
# seconds of work. A RankPool keeps its ranks' interpreters between tests; each task still builds and tears down its
# own process group, parallel state and model, as it did in a fresh process.


def _reset_distributed() -> None:
    """What a task leaves behind that the next task's setup would trip on: a default process group (a failed task
    may not reach its ``destroy_process_group``) and megatron-core's parallel state."""
    torch_distributed = sys.modules.get("torch.distributed")
    if torch_distributed is not None and torch_distributed.is_available() and torch_distributed.is_initialized():
        torch_distributed.destroy_process_group()
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None:
        parallel_state.destroy_model_parallel()


def _serve(rank: int, tasks: multiprocessing.Queue, results: multiprocessing.Queue) -> None:
    """A rank's loop: run ``fn(rank, *args)`` for each task, answer ``(rank, None)`` or ``(rank, traceback)``."""
    while (task := tasks.get()) is not None:
        fn, args = task
        try:
            fn(rank, *args)
        except BaseException:  # noqa: BLE001 - the test fails on it in the parent, with this rank's traceback
            results.put((rank, traceback.format_exc()))
            return  # a failed rank's state is unknown: the pool is closed and the next task gets fresh ranks
        try:
            _reset_distributed()
        except BaseException:  # noqa: BLE001
            results.put((rank, "resetting the rank after its task failed:\n" + traceback.format_exc()))
            return
        results.put((rank, None))


class RankPool:
    """``nprocs`` interpreters (the spawn start method, as torch.multiprocessing.spawn) that run a test's per-rank
    function: ``pool.run(fn, *args)`` calls ``fn(rank, *args)`` on every rank at once and returns when all have, as
    ``torch.multiprocessing.spawn(fn, args, nprocs, join=True)`` did. A rank that raises, dies or outlasts
    ``timeout_s`` fails the call with its traceback (or exit code), and the ranks are stopped: a broken rank's state
    is never handed to the next task, which starts fresh ranks. ``fn`` and ``args`` are pickled to the ranks (``fn`` a
    module-level function)."""

    def __init__(self, nprocs: int) -> None:
        self.nprocs = nprocs
        self._procs: list = []
        self._start()

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._tasks = [context.Queue() for _ in range(self.nprocs)]
        self._results = context.Queue()
        # Not daemonic: a rank's task may start processes of its own (megatron-core's checkpoint writer starts a
        # multiprocessing Manager), which daemonic processes may not. close() stops them, at the latest when this
        # interpreter exits: atexit runs this later registration before multiprocessing's own exit hook, which would
        # otherwise wait for them.
        self._procs = [
            context.Process(target=_serve, args=(rank, self._tasks[rank], self._results), daemon=False)
            for rank in range(self.nprocs)
        ]
        for proc in self._procs:
            proc.start()
        atexit.register(self.close)

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(proc.is_alive() for proc in self._procs)

    def run(self, fn: Callable[..., None], *args, timeout_s: float = 900.0) -> None:
        if not self.alive:
            self.close()
            self._start()
        for tasks in self._tasks:
            tasks.put((fn, args))
        done: dict[int, str | None] = {}
        deadline = time.monotonic() + timeout_s
        while len(done) < self.nprocs:
            try:
                rank, error = self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, proc in enumerate(self._procs) if r not in done and not proc.is_alive()]
                late = time.monotonic() > deadline
                if dead or late:
                    self.close()
                    what = [f"rank {r} exited with code {self._procs[r].exitcode}" for r in dead]
                    what += [f"ranks {sorted(set(range(self.nprocs)) - set(done))} ran past {timeout_s} s"] * late
                    raise AssertionError(f"{fn.__name__}: {'; '.join(what)}") from None
                continue
            done[rank] = error
            if error is not None:  # the other ranks may wait on it in a collective: the pool goes
                self.close()
                raise AssertionError(f"rank {rank} of {fn.__name__} raised:\n{error}")

    def close(self) -> None:
        """Stop the ranks (a rank stuck in a collective is killed)."""
        for proc, tasks in zip(self._procs, self._tasks, strict=True):
            if proc.is_alive():
                tasks.put(None)
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
