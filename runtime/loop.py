"""The training loop of ``rlcore-run``: rollout, train, weight sync, log, eval, save.

Read :func:`run` top to bottom: that is the whole job. It drives seams, never implementations: trainers by model
role (``--train-backend``), engines (``--rollout-engine``), a weight sync (the engines' default) and a rollout
source (``--rollout-schedule``: sync, one-step or fully async).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch

from runtime.cluster import checkpoint
from runtime.cluster.engines import EngineGroup
from runtime.cluster.placement import create_placement
from runtime.cluster.ray_init import init_ray
from runtime.cluster.trainers import TrainerDied, TrainerGroup
from runtime.cluster.weight_sync import check_weights_equal, disk_options, make_weight_sync
from runtime.colocation import EngineMemory, Offload
from runtime.config import (
    Config,
    dump_yaml,
    to_dict,
    top_p_replay,
)
from runtime.engines.base import SamplingParams
from runtime.errors import JobError
from runtime.evaluation import EvalSet, eval_hub, evaluate
from runtime.faults import LastStep, check_reward_errors, restart_config
from runtime.job_data import job_data_source, prepare_model_and_data, resolve_num_rollout
from runtime.logger import (
    LEDGER_FILE,
    METRICS_FILE,
    REWARD_PLOT,
    MetricsLogger,
    WandbOptions,
    append_ledger,
    format_step_line,
    plot_rewards,
    repair_rows,
    tensorboard_dir,
)
from runtime.progress import ProgressBar
from runtime.rollout import (
    RolloutContext,
    multi_turn_metrics,
    reward_category_metrics,
)
from runtime.rollout.filters import load_filter
from runtime.rollout.passrate import passrate_metrics
from runtime.rollout.plugins import (
    HookSource,
    JobData,
    evaluate_with,
    load_rollout_hooks,
)
from runtime.rollout.replay import ReplaySource, save_rollout_data
from runtime.rollout.rewards import RewardHub, reward_error_rate
from runtime.rollout.source import SCHEDULES, EventLoopThread, RolloutSettings
from runtime.signals import StopSignals
from runtime.train.algo import (
    advantage_config,
    check_supported,
    loss_config,
    model_roles,
    role_paths,
)
from runtime.train.driver import sft_warmup, train_step
from runtime.train.hooks import train_hooks


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
    # Model, data, reward, hooks: everything that can fail on user input fails here, before Ray starts.
    check_supported(cfg)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    dump_yaml(cfg, out / "config.yaml")
    torch.manual_seed(cfg.seed)
    adv_cfg = advantage_config(cfg)
    model_path, tokenizer, dataset, eval_sets = prepare_model_and_data(cfg)
    cfg = resolve_num_rollout(cfg, len(dataset))
    hub = RewardHub(cfg.reward, args=cfg, seed=cfg.seed)
    # No engines, no evaluation with --debug-train-only (as slime).
    evals = [] if cfg.debug.train_only else [EvalSet(d, prompts, eval_hub(cfg, d)) for d, prompts in eval_sets or []]
    r = cfg.rollout
    filter_fn = load_filter(r.dynamic_sampling_filter_path) if r.dynamic_sampling_filter_path else None
    hooks = load_rollout_hooks(cfg)
    custom_generate = hooks.custom_generate
    settings = RolloutSettings(
        rollout_batch_size=r.rollout_batch_size,
        n_samples=r.n_samples_per_prompt,
        # None only for slime's SFT (runtime.slime_compat.is_sft_job), whose rollout generates nothing.
        params=sampling_params(cfg) if r.rollout_max_response_len is not None else None,
        num_rollout=r.num_rollout,
        over_sampling_batch_size=r.over_sampling_batch_size,
        max_staleness=r.max_staleness,
        partial_rollout=r.partial_rollout,
        mask_offpolicy_in_partial_rollout=r.mask_offpolicy_in_partial_rollout,
    )

    # Everything started is released in reverse order however the job ends.
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(hub.close)
        for e in evals:
            cleanup.callback(e.hub.close)
        init_ray(cfg)  # kept across trainer restarts; run() shuts it down
        if signals is not None:  # over the handler ray.init may have set
            cleanup.enter_context(signals.installed())
        placement = create_placement(cfg)
        cleanup.callback(ray.util.remove_placement_group, placement.group)
        trainers = TrainerGroup(
            placement,
            backend=cfg.train.train_backend,
            model_path=model_path,
            env_vars=cfg.train.train_env_vars,
            debug=cfg.debug,
            roles=model_roles(cfg),
            role_paths=role_paths(cfg),
            train_cfg=cfg.train,
            loss_cfg=loss_config(cfg),
            temperature=r.rollout_temperature,
            seed=cfg.seed,
            hooks=train_hooks(cfg),
        )
        cleanup.callback(trainers.shutdown)
        engines = EngineGroup(cfg, placement, model_path)
        cleanup.callback(engines.shutdown)
        weights = make_weight_sync(trainers, engines, bucket_bytes=r.update_weight_buffer_size, disk=disk_options(cfg))
        cleanup.callback(weights.close)
        runner = EventLoopThread()
        cleanup.callback(runner.close)
        ctx = RolloutContext(
            engines=engines,
            tokenizer=tokenizer,
            args=cfg,
            sample_hooks=hooks.sample_hooks,
            custom_generate=custom_generate,
            rewards=hub,
            # slime's per-sample SGLang seeds, from --rollout-seed (see RolloutContext).
            sampling_seed=cfg.data.rollout_seed if cfg.rollout.rollout_engine == "sglang" else None,
        )
        feed, data_source = job_data_source(cfg, dataset, hooks)
        job_data = JobData(feed, data_source)
        if cfg.debug.load_debug_rollout_data is not None:
            d = cfg.debug
            source = ReplaySource(
                d.load_debug_rollout_data, subsample=d.load_debug_rollout_data_subsample, reward_key=hub.reward_key
            )
        elif hooks.rollout_fn is not None:
            source = HookSource(
                runner,
                ctx,
                hooks.rollout_fn,
                data_source,
                num_rollout=r.num_rollout,
                lookahead=1 if r.rollout_schedule == "one_step" else 0,
            )
        else:
            source = SCHEDULES[r.rollout_schedule](
                runner,
                feed,
                ctx,
                hub,
                settings,
                filter_fn=filter_fn,
                custom_generate=custom_generate,
                sample_filter=hooks.sample_filter,
                all_samples_process=(hooks.all_samples_process, data_source) if hooks.all_samples_process else None,
            )
        cleanup.callback(source.close)

        def run_evaluation(step: int) -> dict[str, float]:
            """Evaluation after ``step`` steps: the --eval-function-path function (slime's default: the rollout
            function) or the built-in evaluation; --custom-eval-rollout-log-function-path may replace its metrics."""
            if hooks.eval_fn is not None:
                data, metrics = evaluate_with(runner, ctx, hooks.eval_fn, data_source, step)
            else:
                metrics, data = runner.run(evaluate(ctx, evals, cfg, custom_generate=custom_generate))
            if hooks.eval_log is not None and hooks.eval_log(step, cfg, data, dict(metrics)):
                return {}
            return metrics

        evaluating = cfg.eval.eval_interval is not None and not cfg.debug.train_only and bool(evals or hooks.eval_fn)

        start = 0
        if cfg.ckpt.load is not None and checkpoint.is_job_checkpoint(cfg.ckpt.load):
            start = checkpoint.load(cfg.ckpt.load, trainers=trainers, engines=engines, feed=job_data)
            job_data.on_load(start)
        elif cfg.train.sft_warmup_steps:
            sft_warmup(cfg, trainers, tokenizer)
        if cfg.ckpt.start_rollout_id is not None:
            start = cfg.ckpt.start_rollout_id  # slime's --start-rollout-id wins over the checkpoint's step
        trainers.version = start
        weights.push(start)
        if cfg.train.keep_old_actor:
            trainers.call("advance_old_actor")
        if cfg.sglang.check_weight_update_equal:
            check_weights_equal(trainers, engines)
        if start == 0:
            (out / LEDGER_FILE).unlink(missing_ok=True)
        else:
            # Rows of the steps about to run again (written after the checkpoint) and a torn last line go.
            repair_rows(out / LEDGER_FILE, before_step=start)
        lg = cfg.log
        logger = MetricsLogger(
            out,
            use_tensorboard=lg.use_tensorboard,
            use_wandb=lg.use_wandb,
            config=to_dict(cfg),
            start_step=start,
            tensorboard_purge_step=axis_step(cfg, start),
            tensorboard_dir=tensorboard_dir(out, project=lg.tb_project_name, experiment=lg.tb_experiment_name),
            wandb_options=WandbOptions(
                project=lg.wandb_project,
                team=lg.wandb_team,
                group=lg.wandb_group,
                mode=lg.wandb_mode,
                dir=lg.wandb_dir,
                key=lg.wandb_key,
                host=lg.wandb_host,
                run_id=lg.wandb_run_id,
                random_suffix=not lg.disable_wandb_random_suffix,
            ),
        )
        cleanup.callback(logger.close)
        if logger.repaired and logger.repaired["dropped_unreadable"]:
            print(f"{out / METRICS_FILE}: dropped {logger.repaired['dropped_unreadable']} unreadable (torn) lines")
        bar = ProgressBar(r.num_rollout, start, enabled=progress)
        cleanup.callback(bar.close)
        # --offload-rollout / --offload-train (both on with --colocate): engines release their memory after each
        # rollout and take back their weights before a sync, their caches before the next rollout; the trainers
        # are offloaded while the engines generate.
        offload = Offload(cfg, trainers, engines)
        engine_memory = EngineMemory(engines)
        source.start(start)
        # On a JobError (a hook, a reward, a filter the user must fix) the last completed step is saved first.
        last = LastStep(
            cfg.ckpt.save,
            start,
            trainers=trainers,
            engines=engines,
            feed=job_data,
            with_optimizer=not cfg.ckpt.no_save_optim,
            on_save=job_data.on_save,
            signals=signals,
        )
        cleanup.push(last.on_exit)
        reward_error_rates: list[float] = []
        # Engines that take weights while they generate, one rollout ahead and nothing offloaded: the sync does not
        # wait for the rollout in flight (runtime.cluster.weight_sync.DistributedSync.stage).
        staged_sync = (
            getattr(weights, "can_stage", False)
            and hasattr(source, "defer")
            and getattr(source, "lookahead", 0) == 1
            and not (offload.train or offload.rollout)
        )
        for step in range(start, r.num_rollout):
            step_start = time.perf_counter()
            # The data counts go to the first logged step (they do not change during the job).
            metrics: dict[str, float] = dataset.stats() if step == start else {}
            if step == 0 and evaluating and not cfg.eval.skip_eval_before_train:
                # As slime: the starting model is evaluated too (logged with the first step's metrics, as "before").
                before = run_evaluation(step)
                metrics.update({f"{name}_before_train": value for name, value in before.items()})

            # 1. Rollout: this step's scored, filtered groups (generated now, or while earlier steps trained).
            moved = time.perf_counter()
            if offload.train:
                metrics.update(trainers.release_memory())
            engine_memory.resume()
            moved = time.perf_counter() - moved
            rollout = source.get(step)
            rollout_time = time.perf_counter() - step_start
            log_default = hooks.rollout_log is None or not hooks.rollout_log(
                step, cfg, rollout.samples, dict(rollout.metrics), rollout_time
            )
            if log_default:  # --custom-rollout-log-function-path returning True replaces the rollout's metrics
                metrics.update(rollout.metrics)
            if cfg.debug.rollout_data_path is not None:
                save_rollout_data(cfg.debug.rollout_data_path, step, rollout.samples)
            if cfg.log.log_passrate:
                metrics.update(passrate_metrics(rollout.samples, prefix="rollout", reward_key=hub.reward_key))
            if cfg.log.log_multi_turn:
                metrics.update(multi_turn_metrics(rollout.samples, max_response_len=r.rollout_max_response_len))
            if cfg.log.log_reward_category is not None:
                metrics.update(reward_category_metrics(rollout.samples, cfg.log.log_reward_category))
            metrics["perf/rollout_wait_time"] = rollout_time
            reward_error_rates.append(reward_error_rate(rollout.metrics))
            check_reward_errors(reward_error_rates, cfg, reward=hub.name)
            t = time.perf_counter()
            if offload.rollout:
                engine_memory.release()
            if offload.train:
                metrics.update(trainers.resume_memory())
            metrics["perf/offload_time"] = moved + time.perf_counter() - t
            metrics["perf/offloaded"] = float(offload.train or offload.rollout)

            # 2. Train: the batch goes to the trainers once, with the group baselines computed over all of it; the
            # trainers recompute old/reference log-probs, add the per-token advantage terms and step the optimizer.
            done = step + 1
            if not cfg.debug.debug_rollout_only:
                t = time.perf_counter()
                last.training()
                with trainers.weights_lock:  # a restarted engine takes the weights before or after, never between
                    metrics.update(train_step(cfg, trainers, rollout, tokenizer, adv_cfg, hooks=hooks))
                    trainers.version = done
                metrics["perf/train_time"] = time.perf_counter() - t

            # 3. Weight sync every --update-weights-interval steps: the engines sample with the weights just trained.
            if done % r.update_weights_interval == 0 or done == r.num_rollout:
                t = time.perf_counter()
                # The last step and an evaluated one need the new weights in the engines at once.
                evaluated = evaluating and done % cfg.eval.eval_interval == 0
                if staged_sync and done < r.num_rollout and not evaluated:
                    # One-step async: sent while the next rollout samples, swapped in before the one after.
                    weights.stage(done)
                    source.defer(weights.commit)
                else:
                    source.pause()
                    engine_memory.resume(["weights"])
                    weights.push(done)
                    source.resume(done)
                if cfg.train.keep_old_actor:
                    trainers.call("advance_old_actor")
                metrics["perf/weight_sync_time"] = time.perf_counter() - t

            # 4. Evaluation, logging, the ledger of prompts, checkpoints. A hook that fails in evaluation stops
            # the job once this step (trained) is logged and committed.
            eval_failure = None
            if evaluating and (done % cfg.eval.eval_interval == 0 or done == r.num_rollout):
                try:
                    metrics.update(run_evaluation(done))
                except JobError as err:
                    eval_failure = err
            metrics.update(engines.pop_metrics())
            offload.after_step(step == start)
            metrics["perf/step_time"] = time.perf_counter() - step_start
            logger.log(step, metrics, axis_step=axis_step(cfg, step))
            source.commit(rollout)
            append_ledger(out, step, {"trained": rollout.trained_indices, **rollout.outcomes})
            history.append({"step": step, **metrics})
            bar.advance(format_step_line(done, r.num_rollout, metrics))
            last.complete(done)
            if eval_failure is not None:
                raise eval_failure
            if (cfg.ckpt.save_interval is not None and done % cfg.ckpt.save_interval == 0) or done == r.num_rollout:
                if cfg.ckpt.save is not None:
                    last.save()
                if cfg.ckpt.save_hf is not None:
                    # slime's pattern: the rollout id is the 0-based step just trained.
                    trainers.save_hf(cfg.ckpt.save_hf.format(rollout_id=step))

        source.close()
        if not cfg.debug.debug_rollout_only:
            checkpoint.export_final(trainers, out / "final_model")  # atomic: no half-written final_model/
    plot_rewards(out / METRICS_FILE, out / REWARD_PLOT)
    return RunResult(output_dir=out, final_step=r.num_rollout, history=history)


def axis_step(cfg: Config, step: int) -> int:
    """The x-axis value of rollout ``step`` in W&B and TensorBoard: the step itself, or with slime's
    ``--wandb-always-use-train-step`` the optimizer steps before it (``step x samples per rollout / global batch``)."""
    if not cfg.log.wandb_always_use_train_step:
        return step
    r = cfg.rollout
    return step * r.rollout_batch_size * r.n_samples_per_prompt // cfg.train.global_batch_size


def sampling_params(cfg: Config) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(
        max_new_tokens=r.rollout_max_response_len,
        temperature=r.rollout_temperature,
        top_p=r.rollout_top_p,
        top_k=r.rollout_top_k,
        stop_token_ids=tuple(r.rollout_stop_token_ids or ()),
        stop=tuple(r.rollout_stop or ()),
        return_top_p_token_ids=top_p_replay(cfg),
    )
