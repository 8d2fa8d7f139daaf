"""Helpers of the test suite: the order that lets test modules share a Ray (tests/conftest.py), a test file rerun in
Triton's interpreter, and a killed Ray actor waited for."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Hashable, Sequence
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
