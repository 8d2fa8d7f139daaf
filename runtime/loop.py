"""The training loop of ``rlcore-run``: rollout, train, weight sync, log, eval, save.

Read :func:`run` top to bottom: that is the whole job. It drives seams, never implementations: trainers by model
role (``--train-backend``), engines (``--rollout-engine``), a weight sync (the engines' default) and a rollout
source (``--rollout-schedule``: sync, one-step or fully async).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch

from rlcore import keys
from rlcore.advantages import sequence_advantages
from runtime import demo
from runtime.cluster import checkpoint
from runtime.cluster.engines import EngineGroup
from runtime.cluster.loopback import RAY_ADDRESS_ENV, confine_ray
from runtime.cluster.placement import create_placement
from runtime.cluster.trainers import TrainerDied, TrainerGroup
from runtime.cluster.weight_sync import check_weights_equal, disk_options, make_weight_sync
from runtime.config import (
    Config,
    ConfigError,
    DataConfig,
    EvalDataset,
    dump_yaml,
    eval_datasets,
    resolve_eval_dataset,
    teacher_from_samples,
    to_dict,
    top_p_replay,
)
from runtime.engines.base import SamplingParams
from runtime.errors import JobError
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
from runtime.rollout import (
    RolloutContext,
    expand_groups,
    generate_groups,
    multi_turn_metrics,
    reward_category_metrics,
    sample_metrics,
)
from runtime.rollout.data import PromptDataset
from runtime.rollout.filters import load_filter, reward_value
from runtime.rollout.passrate import passrate_metrics
from runtime.rollout.plugins import (
    BufferedPromptSource,
    DataSourceFeed,
    HookSource,
    JobData,
    RolloutHooks,
    evaluate_with,
    load_rollout_hooks,
)
from runtime.rollout.replay import ReplaySource, save_rollout_data
from runtime.rollout.rewards import RewardHub, check_label_types, reward_error_rate
from runtime.rollout.sample import Sample
from runtime.rollout.source import SCHEDULES, EventLoopThread, PromptFeed, RolloutSettings
from runtime.signals import StopSignals
from runtime.slime_compat import num_rollout_of_epochs, train_iters
from runtime.train.algo import (
    advantage_config,
    check_supported,
    loss_config,
    model_roles,
    needs_rollout_log_probs,
    role_paths,
)
from runtime.train.batch import PROMPT_LENGTHS, RESPONSE_LENGTHS, ROLLOUT_INDEX, balanced_order, build_batch
from runtime.train.hooks import train_hooks

# Skipped data rows printed at start (the rest are counted).
MAX_REPORTED_ROWS = 10


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
        _init_ray(cfg)  # kept across trainer restarts; run() shuts it down
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


def axis_step(cfg: Config, step: int) -> int:
    """The x-axis value of rollout ``step`` in W&B and TensorBoard: the step itself, or with slime's
    ``--wandb-always-use-train-step`` the optimizer steps before it (``step x samples per rollout / global batch``)."""
    if not cfg.log.wandb_always_use_train_step:
        return step
    r = cfg.rollout
    return step * r.rollout_batch_size * r.n_samples_per_prompt // cfg.train.global_batch_size


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


def job_data_source(cfg: Config, dataset: Any, hooks: RolloutHooks) -> tuple[Any, Any]:
    """``(feed, data_source)``: the built-in rollout's prompt feed and the data source that rollout functions and
    slime's hooks are handed: ``--data-source-path``'s class built as ``cls(args)`` (the feed draws from it), or the
    prompt data with a buffer over the feed (the buffer alone with ``--disable-rollout-global-dataset``)."""
    if hooks.data_source_cls is not None:
        if cfg.ckpt.load is not None and checkpoint.is_job_checkpoint(cfg.ckpt.load):
            # slime's data sources read their state from args.load/rollout/...: the checkpoint root, also when
            # --load names one step's folder.
            root = checkpoint.resolve(cfg.ckpt.load).parent
            cfg = dataclasses.replace(cfg, ckpt=dataclasses.replace(cfg.ckpt, load=str(root)))
        data_source = hooks.data_source_cls(cfg)
        for method in ("get_samples", "add_samples", "save", "load", "__len__"):
            if not callable(getattr(data_source, method, None)):
                raise hooks.data_source_cls.bad_result(f"built an object without {method}() (slime's DataSource)")
        return DataSourceFeed(data_source, dataset), data_source
    feed = PromptFeed(dataset)
    source = BufferedPromptSource(
        None if cfg.data.disable_rollout_global_dataset else feed,
        cfg,
        n_samples=cfg.rollout.n_samples_per_prompt,
        buffer_filter=hooks.buffer_filter,
    )
    return feed, source


def rollout_batch(cfg: Config, samples: list[Sample], tokenizer: Any, adv_cfg: Any, hooks: RolloutHooks | None) -> Any:
    """The train batch of ``samples`` with its sequence advantages. slime's hooks: ``--custom-convert-samples-to-
    train-data-path`` builds the train data itself (its ``rewards`` are final: no group normalisation follows);
    ``--custom-reward-post-process-path`` gives ``(raw_rewards, rewards)`` in place of the group normalisation."""
    pad = tokenizer.pad_token_id
    need_lps = needs_rollout_log_probs(cfg)
    if cfg.algo.disable_compute_advantages_and_returns or cfg.algo.loss_type == "sft_loss":
        adv_cfg = None  # (SFT, custom losses: no advantages)
    if hooks is not None and hooks.convert_samples is not None:
        data = hooks.convert_samples(cfg, samples)
        batch = build_batch(
            samples_from_train_data(hooks.convert_samples, data, samples),
            pad_token_id=pad,
            require_rollout_log_probs=need_lps,
            top_p_replay=top_p_replay(cfg),
            teacher_log_probs=teacher_from_samples(cfg),
        )
        return (
            batch
            if adv_cfg is None
            else sequence_advantages(batch, dataclasses.replace(adv_cfg, group_normalize=False))
        )
    post_processed = None
    if adv_cfg is not None and hooks is not None and hooks.reward_post_process is not None:
        # Before the batch is built: a post-process may set sample fields the batch reads (slime's OPD pair sets
        # teacher_log_probs there).
        post_processed = hooks.reward_post_process(cfg, samples)
        out = post_processed
        if not (isinstance(out, tuple | list) and len(out) == 2 and len(out[1]) == len(samples)):
            raise hooks.reward_post_process.wrong_type(out, f"(raw_rewards, rewards) with {len(samples)} rewards each")
    batch = build_batch(
        samples,
        pad_token_id=pad,
        require_rollout_log_probs=need_lps,
        reward_key=cfg.reward.reward_key,
        top_p_replay=top_p_replay(cfg),
        teacher_log_probs=teacher_from_samples(cfg),
    )
    if adv_cfg is None:
        return batch
    if post_processed is not None:
        batch.set(keys.REWARDS, torch.tensor([float(x) for x in post_processed[1]], dtype=torch.float32))
        return sequence_advantages(batch, dataclasses.replace(adv_cfg, group_normalize=False))
    return sequence_advantages(batch, adv_cfg)


def samples_from_train_data(hook: Any, data: Any, samples: list[Sample]) -> list[Sample]:
    """Samples holding what a slime train-data dict says (``tokens``, ``response_lengths``, ``rewards``, and when
    given ``loss_masks``, ``rollout_log_probs``, ``rollout_ids``); rows keep their sample's group when they are as
    many as the samples."""
    required = ("tokens", "response_lengths", "rewards")
    if not isinstance(data, dict) or any(k not in data for k in required):
        raise hook.wrong_type(data, f"a dict with {', '.join(required)} (slime's train data)")
    n = len(data["tokens"])
    out = []
    for i in range(n):
        s = Sample(
            tokens=[int(t) for t in data["tokens"][i]],
            response_length=int(data["response_lengths"][i]),
            reward=float(data["rewards"][i]),
            group_index=samples[i].group_index if n == len(samples) else i,
            index=samples[i].index if n == len(samples) else i,
        )
        if "loss_masks" in data:
            s.loss_mask = [int(m) for m in data["loss_masks"][i]]
        if "rollout_log_probs" in data:
            s.rollout_log_probs = [float(x) for x in data["rollout_log_probs"][i]]
        if "rollout_ids" in data:
            s.rollout_id = int(data["rollout_ids"][i])
        out.append(s)
    return out


def train_step(
    cfg: Config, trainers: TrainerGroup, rollout: Any, tokenizer: Any, adv_cfg: Any, hooks: RolloutHooks | None = None
) -> dict[str, float]:
    """One step's training on ``rollout``: its batch, the trainers' optimizer steps, then slime's per-step extras
    (optimizer reset, reference refresh, the batch saved for debugging); returns the metrics."""
    batch = rollout_batch(cfg, rollout.samples, tokenizer, adv_cfg, hooks)
    if cfg.data.balance_data and int(batch[ROLLOUT_INDEX].max()) + 1 == batch.batch_size[0]:
        # (Rows of rollouts split by a custom generate function keep their order: steps are cut by rollout.)
        lengths = (batch[PROMPT_LENGTHS] + batch[RESPONSE_LENGTHS]).tolist()
        dp_size = cfg.resources.num_trainer_procs
        batch = batch[balanced_order(lengths, global_batch_size=cfg.train.global_batch_size, dp_size=dp_size)]
    if cfg.debug.train_data_path is not None:
        path = Path(cfg.debug.train_data_path.format(rollout_id=rollout.step))
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"rollout_id": rollout.step, "batch": batch.to_dict()}, path)
    # slime's --num-critic-only-steps: the first rollouts train the critic alone (ppo).
    train_actor = rollout.step >= cfg.algo.num_critic_only_steps
    metrics = train_metrics(
        trainers.train_rollout(
            batch,
            global_batch_size=cfg.train.global_batch_size,
            adv_cfg=adv_cfg,
            use_rollout_log_probs=cfg.algo.use_rollout_logprobs,
            train_actor=train_actor,
            rollout_id=rollout.step,
        )
    )
    done = rollout.step + 1
    if cfg.algo.reset_optimizer_states:
        trainers.call("reset_optimizer")
    if train_actor and cfg.algo.ref_update_interval is not None and done % cfg.algo.ref_update_interval == 0:
        trainers.call("update_reference")
    return metrics


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


@dataclass
class EvalSet:
    """One evaluation dataset of the job: its resolved settings, its prompts and the reward hub that scores them."""

    dataset: EvalDataset
    prompts: list[Sample]
    hub: RewardHub

    @property
    def params(self) -> SamplingParams:
        d = self.dataset
        return SamplingParams(
            max_new_tokens=d.max_response_len,
            temperature=d.temperature,
            top_p=d.top_p,
            top_k=d.top_k,
            stop_token_ids=d.stop_token_ids,
            stop=d.stop,
            min_new_tokens=d.min_new_tokens or 0,
        )


def eval_hub_config(cfg: Config, dataset: EvalDataset) -> Any:
    """The reward settings of an evaluation dataset: its own ``rm_type`` / ``custom_rm_path`` where it sets them."""
    return dataclasses.replace(
        cfg.reward,
        rm_type=dataset.rm_type or cfg.reward.rm_type,
        custom_rm_path=dataset.custom_rm_path or cfg.reward.custom_rm_path,
    )


def eval_hub(cfg: Config, dataset: EvalDataset) -> RewardHub:
    """The reward hub of an evaluation dataset (:func:`eval_hub_config`), scoring ``--eval-reward-key``."""
    return RewardHub(eval_hub_config(cfg, dataset), args=cfg, seed=cfg.seed, evaluation=True)


def resolve_num_rollout(cfg: Config, dataset_size: int) -> Config:
    """``cfg`` with ``--num-rollout`` set: as given, or slime's ``--num-epoch`` x whole rollouts per pass; and
    ``--lr-decay-iters``, when unset, derived from it as slime does (runtime.slime_compat.train_iters)."""
    r, t = cfg.rollout, cfg.train
    if r.num_rollout is not None:
        return cfg
    if dataset_size // r.rollout_batch_size == 0:
        raise ConfigError(
            [
                f"--num-epoch: the prompt data holds {dataset_size} prompts, fewer than --rollout-batch-size "
                f"{r.rollout_batch_size}: set --num-rollout"
            ]
        )
    num_rollout = num_rollout_of_epochs(
        num_epoch=r.num_epoch, dataset_size=dataset_size, rollout_batch_size=r.rollout_batch_size
    )
    sizes = dict(rollout_batch_size=r.rollout_batch_size, n_samples_per_prompt=r.n_samples_per_prompt)
    decay = t.lr_decay_iters or train_iters(num_rollout=num_rollout, global_batch_size=t.global_batch_size, **sizes)
    return dataclasses.replace(
        cfg,
        rollout=dataclasses.replace(r, num_rollout=num_rollout),
        train=dataclasses.replace(t, lr_decay_iters=decay),
    )


def eval_data_config(cfg: Config, dataset: EvalDataset) -> DataConfig:
    """How an evaluation dataset's rows are read: its keys, template and prompt limit."""
    return dataclasses.replace(
        cfg.data,
        input_key=dataset.input_key,
        label_key=dataset.label_key,
        tool_key=dataset.tool_key,
        metadata_key=dataset.metadata_key,
        apply_chat_template=dataset.apply_chat_template,
        apply_chat_template_kwargs=dict(dataset.apply_chat_template_kwargs),
        rollout_max_prompt_len=dataset.max_prompt_len,
    )


def prepare_model_and_data(
    cfg: Config,
) -> tuple[str, Any, PromptDataset, list[tuple[EvalDataset, list[Sample]]] | None]:
    """The model folder, its tokenizer, the prompt dataset and the evaluation datasets with their prompts (None
    without eval).

    Without ``--hf-checkpoint`` the demo's tiny model is built into ``output_dir/base_model`` and loaded from there
    like any checkpoint; without ``--prompt-data`` the prompts are the demo task's. What was dropped or skipped is
    printed (``PromptDataset.report``); a prompt that does not fit the model's context is a bad row (``--on-bad-row``:
    refused, or dropped and counted with the over-long ones). Data errors, and a ``--max-tokens-per-gpu`` too small
    for the longest prompt plus ``--rollout-max-response-len``, raise here, before Ray starts.
    """
    from transformers import AutoTokenizer

    model_path = cfg.model.hf_checkpoint or demo.base_model(cfg.output_dir, seed=cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    context = model_context(model_path)
    eval_sets: list[tuple[EvalDataset, PromptDataset]] = []
    has_eval_data = cfg.eval.eval_prompt_data is not None or cfg.eval.eval_config is not None
    if cfg.data.prompt_data is None:
        dataset, demo_eval = demo.prompt_datasets(tokenizer, cfg.data, seed=cfg.seed)
        if cfg.eval.eval_interval is not None and not has_eval_data:
            eval_sets.append((resolve_eval_dataset(cfg, {"name": "builtin", "path": ""}), demo_eval))
    else:
        dataset = PromptDataset(
            cfg.data.prompt_data,
            tokenizer,
            cfg.data,
            seed=cfg.data.rollout_seed,
            max_context=context,
            messages=cfg.algo.loss_type == "sft_loss",
        )
    if cfg.eval.eval_interval is not None and has_eval_data:
        for d in eval_datasets(cfg):
            config = eval_data_config(cfg, d)
            eval_sets.append(
                (d, PromptDataset(d.path, tokenizer, config, seed=cfg.data.rollout_seed, max_context=context))
            )
    datasets = (dataset, *(ds for _, ds in eval_sets))
    check_label_types(dataset.labels(), cfg.reward, label_key=cfg.data.label_key, source=dataset.source)
    for d, ds in eval_sets:
        check_label_types(ds.labels(), eval_hub_config(cfg, d), label_key=d.label_key, source=ds.source)
    for ds in datasets:
        print("\n".join(ds.report(max_rows=MAX_REPORTED_ROWS)), flush=True)
    budget = cfg.train.max_tokens_per_gpu
    if budget is not None:
        longest = max(ds.max_prompt_tokens for ds in datasets)
        need = longest + max([cfg.rollout.rollout_max_response_len] + [d.max_response_len for d, _ in eval_sets])
        if budget < need:
            raise ConfigError(
                [
                    f"--max-tokens-per-gpu {budget} cannot hold the longest sample: a prompt of {longest} tokens + "
                    f"--rollout-max-response-len {cfg.rollout.rollout_max_response_len} = {need} (raise the budget, "
                    "or drop long prompts with --rollout-max-prompt-len)"
                ]
            )
    evals = []
    for d, ds in eval_sets:
        prompts = ds.next_batch(len(ds))
        for sample in prompts:
            sample.metadata = {**sample.metadata, **d.metadata_overrides}
        evals.append((d, prompts))
    return model_path, tokenizer, dataset, evals or None


def model_context(model_path: str) -> int | None:
    """The model's context length in tokens (``max_position_embeddings`` of its text config), None if it has none."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "max_position_embeddings", None)


def sft_warmup(cfg: Config, trainers: TrainerGroup, tokenizer: Any) -> list[float]:
    """Optional SFT steps on the demo task's format examples (digits of the right length, drawn at random)."""
    losses = []
    for step in range(cfg.train.sft_warmup_steps):
        samples = demo.sft_warmup_samples(tokenizer, cfg.train.global_batch_size, seed=cfg.seed + 7919 * (step + 1))
        losses.append(trainers.sft_train(build_batch(samples, pad_token_id=tokenizer.pad_token_id))["sft_loss"])
    print(f"SFT warm-up: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return losses


def train_metrics(raw: dict[str, float]) -> dict[str, float]:
    """The trainers' ``rl_loss`` metrics under ``train/`` (the critic's under ``train/critic/``); ``train/kl`` is the
    KL to the reference model when one is kept, else the KL between the sampling and the updated policy (slime's
    ppo_kl); absent on a step that trains the critic only. Timings (``perf/...``) and rollout statistics
    (``rollout/...``) keep their names."""
    out = {
        name if name.startswith(("perf/", "rollout/")) else f"train/{name}": value
        for name, value in raw.items()
        if name != "advantage_abs_mean"
    }
    kl = raw.get("approx_kl_ref", raw.get("approx_kl_old"))
    if kl is not None:  # (SFT and custom losses have none)
        out["train/kl"] = kl
    if "advantage_abs_mean" in raw:
        out["rollout/advantage_abs_mean"] = raw["advantage_abs_mean"]
    return out


def usable_cpus() -> int:
    """The cores this process may run on (its affinity mask, e.g. under ``taskset`` or a cpuset), not the host's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _init_ray(cfg: Config) -> bool:
    """Start a local Ray (or join the cluster ``RAY_ADDRESS`` names) if none is running; returns whether this call
    started it."""
    if ray.is_initialized():
        return False
    if os.environ.get(RAY_ADDRESS_ENV):
        # A Ray cluster of several nodes, started by the user: joined as it is (its listeners are its own).
        ray.init(address=os.environ[RAY_ADDRESS_ENV], log_to_driver=False)
        return True
    res = cfg.resources
    slots = res.num_trainer_procs + (0 if res.colocate else res.rollout_num_gpus)
    # A single-node job: every Ray listener on 127.0.0.1 (runtime.cluster.loopback; token authentication, Ray's
    # default for a cluster ray.init starts, stays on for its gRPC servers as well).
    confine_ray()
    # On a CPU-only machine a slot is a logical CPU: the job's actors take turns, so slots may exceed cores.
    ray.init(num_cpus=max(usable_cpus(), slots), include_dashboard=False, log_to_driver=False)
    return True


def fit_together(
    trainers: list[dict[str, int] | None], engines: list[dict[str, int] | None], *, fraction: float
) -> bool:
    """Whether each trainer rank's and its colocated engine's (same index) peaks of reserved GPU memory fit within
    ``fraction`` of their device together; False when any side does not report (None) or the counts differ."""
    if len(trainers) != len(engines) or not trainers or None in trainers or None in engines:
        return False
    return all(t["peak"] + e["peak"] <= fraction * t["total"] for t, e in zip(trainers, engines, strict=True))


class Offload:
    """Whether colocated trainers and engines take turns on their devices this step (``--offload-train`` /
    ``--offload-rollout``).

    Given, each flag holds for the whole job. Unset under ``--colocate`` it is ``auto`` (a difference from slime,
    which always offloads when colocated): the first step offloads both sides, then each side's peak of reserved
    GPU memory is read, and if a trainer's and its engine's peaks fit their device together (within
    ``FIT_FRACTION`` of it) nothing moves again. Engines that do not report their memory (SGLang servers, which hold
    a fixed fraction of their GPU) and CPU jobs keep offloading as slime does.
    """

    FIT_FRACTION = 0.9

    def __init__(self, cfg: Config, trainers: Any, engines: Any):
        s, colocate = cfg.sglang, cfg.resources.colocate
        self.train = colocate if s.offload_train is None else s.offload_train
        self.rollout = colocate if s.offload_rollout is None else s.offload_rollout
        self.auto = colocate and s.offload_train is None and s.offload_rollout is None
        self.trainers, self.engines = trainers, engines

    def after_step(self, first: bool) -> None:
        """After the job's first step: decide ``auto`` (see the class docstring)."""
        if not (self.auto and first and self.trainers.actors and self.engines.actors):
            return
        self.auto = False
        trainers, engines = self.trainers.device_memory(), self.engines.device_memory()
        if fit_together(trainers, engines, fraction=self.FIT_FRACTION):
            self.train = self.rollout = False
            t, e = trainers[0], engines[0]
            print(
                f"colocated trainer ({t['peak'] / 2**30:.1f} GiB at its peak) and engine ({e['peak'] / 2**30:.1f} "
                f"GiB) fit their device ({t['total'] / 2**30:.0f} GiB) together: nothing is offloaded from now on "
                "(--offload-train / --offload-rollout force it)",
                flush=True,
            )


class EngineMemory:
    """Which memory tags the engines have released, so that each is resumed once, and in slime's order."""

    TAGS = ("weights", "kv_cache", "cuda_graph")

    def __init__(self, engines: EngineGroup):
        self.engines = engines
        self.released: set[str] = set()

    def release(self) -> None:
        self.engines.release_memory(list(self.TAGS))
        self.released = set(self.TAGS)

    def resume(self, tags: list[str] | None = None) -> None:
        """Resume ``tags`` (all by default) among those released; nothing if none is."""
        wanted = [t for t in (tags or self.TAGS) if t in self.released]
        if wanted:
            self.engines.resume_memory(wanted)
            self.released -= set(wanted)


async def evaluate(
    ctx: RolloutContext, evals: list[EvalSet], cfg: Config, *, custom_generate: Any = None
) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """Reward statistics over the evaluation prompts (each dataset's samples per prompt, sampling settings and
    reward), no filter, no training: ``eval/{name}/*`` per dataset and ``eval/*`` over all of them; and slime's eval
    data, ``{name: {"rewards", "truncated", "samples"}}`` (for ``--custom-eval-rollout-log-function-path``).

    Responses come from the same generation path as training rollouts: ``custom_generate`` (the
    ``--custom-generate-function-path`` hook) when given, the engines' batched generate otherwise.
    """
    metrics: dict[str, float] = {}
    data: dict[str, dict[str, Any]] = {}
    every: list[Sample] = []
    aborted_groups = errors = 0
    for e in evals:
        name, key = e.dataset.name, e.hub.reward_key
        groups = expand_groups(e.prompts, e.dataset.n_samples_per_eval_prompt, first_group=0)
        # Aborted groups are left out of the score, as the rollout leaves them out of training.
        whole, aborted = await generate_groups(ctx, groups, e.params, custom_generate)
        samples = [s for g in whole for s in g]
        await e.hub.score(samples)
        errors += e.hub.pop_metrics()["reward/errors"]
        data[name] = {
            "rewards": [reward_value(x, key) for x in samples],
            "truncated": [x.status == Sample.Status.TRUNCATED for x in samples],
            "samples": samples,
        }
        if samples:
            metrics.update(sample_metrics(samples, prefix=f"eval/{name}", reward_key=key))
            if cfg.log.log_passrate:
                metrics.update(passrate_metrics(samples, prefix=f"eval/{name}", reward_key=key))
        every += samples
        aborted_groups += len(aborted)
    if every:
        # Every dataset's hub reads the same --eval-reward-key.
        metrics.update(sample_metrics(every, prefix="eval", reward_key=evals[0].hub.reward_key))
    metrics["eval/reward_errors"] = errors
    metrics["eval/groups_aborted"] = aborted_groups
    return metrics, data


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
