"""The errors ``rlcore-run`` turns into a one-line message and an exit status instead of a traceback.

Input errors found before anything starts (flags, data, hook paths, checkpoints) are ``ConfigError``, ``DataError``
and ``HookError``: exit 2. A :class:`JobError` stops a job that started, for a reason the user must fix (a hook that
raised, a reward that keeps failing, a filter that keeps nothing, a save that failed): exit 1, after the last
completed step is saved when ``--save`` is set.
"""

from __future__ import annotations


class JobError(RuntimeError):
    """A running job stops for a reason the user must fix; the message is the whole report (no traceback)."""


class JobInterrupted(JobError):
    """SIGTERM or Ctrl-C (SIGINT) stopped the job; ``rlcore-run`` saves the last completed step under ``--save`` and
    exits 128 + the signal's number."""

    def __init__(self, signum: int):
        import signal

        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")
