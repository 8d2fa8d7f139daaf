"""The rollout engines' health monitor (slime's ``--use-fault-tolerance`` group of flags, same meanings).

A thread checks every engine's :meth:`RolloutEngine.health` in turn, every ``--rollout-health-check-interval``
seconds; an engine that answers False, raises, or does not answer within ``--rollout-health-check-timeout`` seconds is
reported to ``on_unhealthy`` (the engine group kills and restarts it). Checking pauses while the engines' memory is
released (a released engine cannot generate, so it reports itself unhealthy) and, after every resume, waits
``--rollout-health-check-first-wait`` seconds first, as slime's ``RolloutHealthMonitor`` does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import ray

# How often a paused monitor looks whether it was resumed or stopped.
PAUSED_POLL_S = 0.2


class HealthMonitor:
    """Checks ``engines()`` (index -> actor, the live ones) and reports ``(index, actor, reason)`` to ``on_unhealthy``.

    Starts paused; :meth:`resume` starts checking, :meth:`pause` stops it until the next resume, :meth:`stop` ends
    the thread.
    """

    def __init__(
        self,
        engines: Callable[[], dict[int, Any]],
        on_unhealthy: Callable[[int, Any, str], None],
        *,
        interval: float,
        timeout: float,
        first_wait: float,
    ):
        self._engines, self._on_unhealthy = engines, on_unhealthy
        self.interval, self.timeout, self.first_wait = interval, timeout, first_wait
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._paused.set()
        self._resumed_at = 0  # bumped by every resume: a check started before a pause and resume is not trusted
        self.checks = 0
        self._thread = threading.Thread(target=self._loop, name="rlcore-engine-health", daemon=True)
        self._thread.start()

    def pause(self) -> None:
        self._paused.set()

    def resume(self) -> None:
        if self._paused.is_set():
            self._resumed_at += 1
            self._paused.clear()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout + PAUSED_POLL_S + 5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self._paused.is_set():
                self._stop.wait(PAUSED_POLL_S)
                continue
            epoch = self._resumed_at
            if self.first_wait and self._stop.wait(self.first_wait):
                return
            while not self._stop.is_set() and not self._paused.is_set() and epoch == self._resumed_at:
                self.check_all(epoch)
                self._stop.wait(self.interval)

    def check_all(self, epoch: int | None = None) -> None:
        """One round of checks: each live engine's health, reported unhealthy unless checking was paused meanwhile."""
        for index, actor in self._engines().items():
            if self._stop.is_set() or self._paused.is_set():
                return
            reason = self.check(actor)
            self.checks += 1
            still_checking = not self._paused.is_set() and (epoch is None or epoch == self._resumed_at)
            if reason is not None and still_checking:
                self._on_unhealthy(index, actor, reason)

    def check(self, actor: Any) -> str | None:
        """Why ``actor`` is unhealthy, or None when it answered True in time."""
        try:
            healthy = ray.get(actor.health.remote(), timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            return f"no answer to a health check in --rollout-health-check-timeout {self.timeout:g} s"
        except ray.exceptions.RayTaskError as err:  # the engine's own error (Ray's first line names only the call)
            return f"the health check failed ({first_line(err.cause or err)})"
        except ray.exceptions.RayError as err:
            return f"the health check failed ({first_line(err)})"
        return None if healthy else "the health check answered unhealthy"


def first_line(err: BaseException) -> str:
    """``err`` as one line: its type and the first line of its message (Ray's errors run over many lines)."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__
