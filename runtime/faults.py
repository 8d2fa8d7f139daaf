"""How a job survives faults and stops cleanly: the config that rebuilds it after a trainer dies
(``--max-trainer-restarts``), its last completed step saved when a ``JobError`` or a stop signal ends it, and the
stop on a reward that keeps failing."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from runtime.cluster import checkpoint
from runtime.cluster.trainers import TrainerDied
from runtime.config import Config
from runtime.errors import JobError
from runtime.signals import StopSignals


def restart_config(cfg: Config, err: TrainerDied, *, restarts: int) -> tuple[Config, int]:
    """The config that rebuilds the job after ``err`` (restart number ``restarts + 1``) and the step it resumes at; a
    ``JobError`` when there is nothing to restart from or the restarts are used up."""
    limit, save = cfg.fault.max_trainer_restarts, cfg.ckpt.save
    if save is None:
        raise JobError(f"{err}: the job stops (with --save, up to --max-trainer-restarts {limit} restarts resume it)")
    if restarts >= limit:
        raise JobError(
            f"{err}: the job stops, --max-trainer-restarts {limit} restarts used (resume with --load {save})"
        )
    try:
        folder = checkpoint.resolve(save)
    except FileNotFoundError:
        folder = None  # died before the first save: from where the job started
    load = save if folder is not None else cfg.ckpt.load
    try:
        # A --load that is no rlcore checkpoint (a Megatron one the actor starts from, or a folder that does not
        # exist yet or is empty: slime starts afresh) restarts at step 0.
        fresh = load is None or (
            folder is None
            and (
                checkpoint.starts_fresh(load)
                or checkpoint.actor_start(
                    backend=cfg.train.train_backend,
                    load=load,
                    ref_load=cfg.ckpt.ref_load,
                    ref_ckpt_step=cfg.ckpt.ref_ckpt_step,
                )
                is not None
            )
        )
        step = 0 if fresh else checkpoint.verify(folder if folder is not None else checkpoint.resolve(load))
    except (checkpoint.CheckpointError, FileNotFoundError) as bad:
        raise JobError(f"{err}: the job stops, its checkpoint cannot be restored ({bad})") from None
    print(
        f"rlcore-run: {err}; restart {restarts + 1} of --max-trainer-restarts {limit}: the job is rebuilt from "
        + (f"{folder} (step {step})" if folder is not None else f"step {step}"),
        flush=True,
    )
    return dataclasses.replace(cfg, ckpt=dataclasses.replace(cfg.ckpt, load=load)), step


class LastStep:
    """The job's last completed step (trained, logged, committed) and whether it is saved.

    ``on_exit`` (an ``ExitStack`` exit callback) saves it under ``--save`` when a ``JobError`` stops the job (also
    ``JobInterrupted``: SIGTERM or Ctrl-C, which ``signals`` holds back while a step trains) and it is not saved yet,
    so the user can fix the cause and ``--load`` it; not when the trainers already hold a later, uncommitted step,
    nor when saving is what failed.
    """

    def __init__(
        self,
        root: str | None,
        start: int,
        *,
        trainers: Any,
        engines: Any,
        feed: Any,
        with_optimizer: bool = True,
        on_save: Any = None,
        signals: StopSignals | None = None,
    ):
        self.root, self.start, self.with_optimizer, self.on_save = root, start, with_optimizer, on_save
        self.signals = signals
        self.completed = self.saved = start
        self.trained_ahead = False
        self._state = {"trainers": trainers, "engines": engines, "feed": feed}

    def training(self) -> None:
        self.trained_ahead = True
        if self.signals is not None:
            self.signals.defer()

    def complete(self, step: int) -> None:
        self.completed, self.trained_ahead = step, False
        if self.signals is not None:
            self.signals.release()  # a stop signal that waited for this step raises JobInterrupted now

    def save(self) -> Path:
        folder = checkpoint.save(self.root, self.completed, with_optimizer=self.with_optimizer, **self._state)
        if self.on_save is not None:
            self.on_save(self.completed)
        self.saved = self.completed
        return folder

    def on_exit(self, exc_type: Any, err: BaseException | None, tb: Any) -> bool:
        keep = self.root is not None and self.completed not in (self.start, self.saved) and not self.trained_ahead
        # Not after a trainer died: the trainers cannot save, and the restart resumes from the last checkpoint.
        if keep and isinstance(err, JobError) and not isinstance(err, (checkpoint.SaveError, TrainerDied)):
            try:
                folder = self.save()
                print(f"rlcore-run: saved step {self.completed} to {folder}; resume with --load {self.root}")
            except checkpoint.SaveError as save_err:
                print(f"rlcore-run: {save_err}", file=sys.stderr)
        return False


def check_reward_errors(rates: list[float], cfg: Config, *, reward: str) -> None:
    """Raise ``JobError`` when the last ``--max-reward-error-steps`` steps' reward error rates (``rates``, one per
    step so far) all exceed ``--max-reward-error-rate``: a reward that keeps failing would train on zeros."""
    limit, steps = cfg.reward.max_reward_error_rate, cfg.reward.max_reward_error_steps
    last = rates[-steps:]
    if len(last) == steps and all(rate > limit for rate in last):
        shown = ", ".join(f"{rate:.0%}" for rate in last)
        raise JobError(
            f"reward {reward}: {shown} of the samples' rewards failed or timed out in the last {steps} steps, over "
            f"--max-reward-error-rate {limit} for --max-reward-error-steps {steps}: the job stops (the log holds "
            "each step's first reward error with its traceback)"
        )
