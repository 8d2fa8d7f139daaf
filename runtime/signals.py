"""SIGTERM and Ctrl-C (SIGINT) stop a job cleanly: the driver raises ``JobInterrupted``, the last completed step is
saved under ``--save`` (``runtime.faults.LastStep``) and ``rlcore-run`` exits 128 + the signal's number.

A signal that arrives while a step trains (the trainers hold weights past the last completed step) waits for that step
to complete, so the step that is saved is the one the trainers hold; a second signal stops at once.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

from runtime.errors import JobInterrupted

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """The driver's stop-signal handler and its one deferred signal."""

    def __init__(self) -> None:
        self.deferring = False
        self.pending: int | None = None

    def handle(self, signum: int, frame: object) -> None:
        if self.deferring and self.pending is None:
            self.pending = signum
            name = signal.Signals(signum).name
            print(f"rlcore-run: {name}: stopping once the step in training completes (again: now)", file=sys.stderr)
            return
        raise JobInterrupted(signum)

    def defer(self) -> None:
        """A step trains: a signal now waits for :meth:`release`."""
        self.deferring = True

    def release(self) -> None:
        """The step completed: a signal that waited stops the job now."""
        self.deferring = False
        if self.pending is not None:
            signum, self.pending = self.pending, None
            raise JobInterrupted(signum)

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopSignals]:
        """Handle :data:`STOP_SIGNALS` while the context is open (in the main thread only: Python delivers signals
        there), then restore the handlers that were there before (Ray's own, or the default)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        before = {signum: signal.signal(signum, self.handle) for signum in STOP_SIGNALS}
        try:
            yield self
        finally:
            for signum, handler in before.items():
                signal.signal(signum, handler)
