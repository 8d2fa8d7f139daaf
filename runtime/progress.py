"""The job's progress bar: a rich bar with each step's line printed above it."""

from __future__ import annotations


class ProgressBar:
    """A rich progress bar with the step line printed above it (plain lines when disabled or not a terminal)."""

    def __init__(self, total: int, start: int, *, enabled: bool):
        self._progress = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]rlcore-run"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                transient=False,
            )
            self._task = self._progress.add_task("train", total=total, completed=start)
            self._progress.start()

    def advance(self, line: str) -> None:
        if self._progress is None:
            print(line, flush=True)
            return
        self._progress.console.print(line, highlight=False)
        self._progress.advance(self._task)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
