"""The training loop of ``rlcore-run``: rollout, train, weight sync, log, eval, save.

Read :func:`_run` top to bottom: that is the whole job. :func:`runtime.job.build_job` does the wiring; each step is
then :func:`rollout_step`, :func:`train`, :func:`sync_weights` and :func:`finish_step`. It drives seams, never
implementations: trainers by model role (``--train-backend``), engines (``--rollout-engine``), a weight sync (the
engines' default) and a rollout source (``--rollout-schedule``: sync, one-step or fully async). :func:`run` survives
a trainer that dies by building the job again (``runtime.faults.restart_config``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from runtime.cluster import checkpoint
from runtime.cluster.trainers import TrainerDied
from runtime.config import Config
from runtime.errors import JobError
from runtime.faults import check_reward_errors, restart_config
from runtime.job import Job, axis_step, build_job
from runtime.logger import METRICS_FILE, REWARD_PLOT, append_ledger, format_step_line, plot_rewards
from runtime.rollout import multi_turn_metrics, reward_category_metrics
from runtime.rollout.passrate import passrate_metrics
from runtime.rollout.replay import save_rollout_data
from runtime.rollout.rewards import reward_error_rate
from runtime.signals import StopSignals
from runtime.train.driver import train_step


@dataclass
class RunResult:
    output_dir: Path
    final_step: int
    history: list[dict[str, Any]]


def run(cfg: Config, *, progress: bool = True) -> RunResult:
    """Run the job; a trainer process that dies is survived as the module docstring of ``runtime.cluster.trainers``
    says: the job is rebuilt (Ray kept) from the latest ``--save`` checkpoint, as ``--load`` would, up to
    ``--max-trainer-restarts`` times."""
    had_ray = ray.is_initialized()
    restarts, history = 0, []
    signals = StopSignals()
    try:
        while True:
            try:
                with signals.installed():
                    return _run(cfg, progress=progress, history=history, signals=signals)
            except TrainerDied as err:
                cfg, resumed_at = restart_config(cfg, err, restarts=restarts)
                restarts += 1
                history[:] = [row for row in history if row["step"] < resumed_at]
    finally:
        if not had_ray and ray.is_initialized():
            ray.shutdown()


def _run(
    cfg: Config, *, progress: bool, history: list[dict[str, Any]], signals: StopSignals | None = None
) -> RunResult:
    """One attempt at the job; each step's metrics are appended to ``history`` as it is logged."""
    with contextlib.ExitStack() as cleanup:  # everything started is released in reverse order however the job ends
        job = build_job(cfg, cleanup=cleanup, signals=signals, progress=progress)
        cfg = job.cfg  # (--num-rollout resolved)
        for step in range(job.start, cfg.rollout.num_rollout):
            step_start = time.perf_counter()
            # The data counts go to the first logged step (they do not change during the job).
            metrics: dict[str, float] = job.dataset.stats() if step == job.start else {}
            if step == 0 and job.evaluation.enabled and not cfg.eval.skip_eval_before_train:
                # As slime: the starting model is evaluated too (logged with the first step's metrics, as "before").
                before = job.evaluation(step)
                metrics.update({f"{name}_before_train": value for name, value in before.items()})
            rollout = rollout_step(job, step, metrics, step_start=step_start)
            if not cfg.debug.debug_rollout_only:
                train(job, step, rollout, metrics)
            done = step + 1
            if done % cfg.rollout.update_weights_interval == 0 or done == cfg.rollout.num_rollout:
                sync_weights(job, done, metrics)
            finish_step(job, step, rollout, metrics, history=history, step_start=step_start)
        job.source.close()
        if not cfg.debug.debug_rollout_only:
            checkpoint.export_final(job.trainers, job.out / "final_model")  # atomic: no half-written final_model/
    plot_rewards(job.out / METRICS_FILE, job.out / REWARD_PLOT)
    return RunResult(output_dir=job.out, final_step=cfg.rollout.num_rollout, history=history)


def rollout_step(job: Job, step: int, metrics: dict[str, float], *, step_start: float) -> Any:
    """1. Rollout: step ``step``'s scored, filtered groups (generated now, or while earlier steps trained), with the
    trainers offloaded around the generation when they take turns with the engines; its metrics go to ``metrics``.
    Raises ``JobError`` when the reward keeps failing (``runtime.faults.check_reward_errors``)."""
    cfg, r = job.cfg, job.cfg.rollout
    moved = time.perf_counter()
    if job.offload.train:
        metrics.update(job.trainers.release_memory())
    job.engine_memory.resume()
    moved = time.perf_counter() - moved
    rollout = job.source.get(step)
    rollout_time = time.perf_counter() - step_start
    log_default = job.hooks.rollout_log is None or not job.hooks.rollout_log(
        step, cfg, rollout.samples, dict(rollout.metrics), rollout_time
    )
    if log_default:  # --custom-rollout-log-function-path returning True replaces the rollout's metrics
        metrics.update(rollout.metrics)
    if cfg.debug.rollout_data_path is not None:
        save_rollout_data(cfg.debug.rollout_data_path, step, rollout.samples)
    if cfg.log.log_passrate:
        metrics.update(passrate_metrics(rollout.samples, prefix="rollout", reward_key=job.hub.reward_key))
    if cfg.log.log_multi_turn:
        metrics.update(multi_turn_metrics(rollout.samples, max_response_len=r.rollout_max_response_len))
    if cfg.log.log_reward_category is not None:
        metrics.update(reward_category_metrics(rollout.samples, cfg.log.log_reward_category))
    metrics["perf/rollout_wait_time"] = rollout_time
    job.reward_error_rates.append(reward_error_rate(rollout.metrics))
    check_reward_errors(job.reward_error_rates, cfg, reward=job.hub.name)
    t = time.perf_counter()
    if job.offload.rollout:
        job.engine_memory.release()
    if job.offload.train:
        metrics.update(job.trainers.resume_memory())
    metrics["perf/offload_time"] = moved + time.perf_counter() - t
    metrics["perf/offloaded"] = float(job.offload.train or job.offload.rollout)
    return rollout


def train(job: Job, step: int, rollout: Any, metrics: dict[str, float]) -> None:
    """2. Train: the batch goes to the trainers once, with the group baselines computed over all of it; the trainers
    recompute old/reference log-probs, add the per-token advantage terms and step the optimizer."""
    t = time.perf_counter()
    job.last.training()
    with job.trainers.weights_lock:  # a restarted engine takes the weights before or after, never between
        metrics.update(train_step(job.cfg, job.trainers, rollout, job.tokenizer, job.adv_cfg, hooks=job.hooks))
        job.trainers.version = step + 1
    metrics["perf/train_time"] = time.perf_counter() - t


def sync_weights(job: Job, done: int, metrics: dict[str, float]) -> None:
    """3. Weight sync (every ``--update-weights-interval`` steps and after the last): the engines sample with the
    weights of ``done`` steps."""
    t = time.perf_counter()
    # The last step and an evaluated one need the new weights in the engines at once.
    if job.staged_sync and done < job.cfg.rollout.num_rollout and not job.evaluation.due(done):
        # One-step async: sent while the next rollout samples, swapped in before the one after.
        job.weights.stage(done)
        job.source.defer(job.weights.commit)
    elif job.paused_sync:
        # One-step async on engines that pause (SGLang): the rollout in flight stops where it is, takes the new
        # weights and goes on with them; the sync does not wait for it.
        with job.engines.generation_paused():
            job.weights.push(done)
    else:
        job.source.pause()
        job.engine_memory.resume(["weights"])
        job.weights.push(done)
        job.source.resume(done)
    if job.cfg.train.keep_old_actor:
        job.trainers.call("advance_old_actor")
    metrics["perf/weight_sync_time"] = time.perf_counter() - t


def finish_step(
    job: Job, step: int, rollout: Any, metrics: dict[str, float], *, history: list[dict[str, Any]], step_start: float
) -> None:
    """4. Evaluation, logging, the ledger of prompts, checkpoints. A hook that fails in evaluation stops the job once
    this step (trained) is logged and committed."""
    cfg, done = job.cfg, step + 1
    eval_failure = None
    if job.evaluation.due(done):
        try:
            metrics.update(job.evaluation(done))
        except JobError as err:
            eval_failure = err
    metrics.update(job.engines.pop_metrics())
    job.offload.after_step(step == job.start)
    metrics["perf/step_time"] = time.perf_counter() - step_start
    job.logger.log(step, metrics, axis_step=axis_step(cfg, step))
    job.source.commit(rollout)
    append_ledger(job.out, step, {"trained": rollout.trained_indices, **rollout.outcomes})
    history.append({"step": step, **metrics})
    job.bar.advance(format_step_line(done, cfg.rollout.num_rollout, metrics))
    job.last.complete(done)
    if eval_failure is not None:
        raise eval_failure
    if (cfg.ckpt.save_interval is not None and done % cfg.ckpt.save_interval == 0) or done == cfg.rollout.num_rollout:
        if cfg.ckpt.save is not None:
            job.last.save()
        if cfg.ckpt.save_hf is not None:
            # slime's pattern: the rollout id is the 0-based step just trained.
            job.trainers.save_hf(cfg.ckpt.save_hf.format(rollout_id=step))
