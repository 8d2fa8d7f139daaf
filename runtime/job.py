"""The wiring of one attempt at a job: :func:`build_job` checks the user's input, starts Ray and every part the loop
drives (trainers, engines, weight sync, rollout source, logger), resumes from ``--load`` and returns a :class:`Job`.

Model, data, reward and hooks are checked first, so everything that can fail on user input fails before Ray starts.
Every part started is registered on the caller's ``ExitStack`` as it starts, so it is released in reverse order
however the job ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch

from runtime.cluster import checkpoint
from runtime.cluster.engines import EngineGroup
from runtime.cluster.placement import create_placement
from runtime.cluster.ray_init import init_ray
from runtime.cluster.trainers import TrainerGroup
from runtime.cluster.weight_sync import WeightSync, check_weights_equal, disk_options, make_weight_sync
from runtime.colocation import EngineMemory, Offload
from runtime.config import Config, dump_yaml, to_dict, top_p_replay
from runtime.engines.base import SamplingParams
from runtime.engines.registry import engine_kind
from runtime.evaluation import EvalSet, eval_hub, evaluate
from runtime.faults import LastStep
from runtime.job_data import job_data_source, prepare_model_and_data, resolve_num_rollout
from runtime.logger import LEDGER_FILE, METRICS_FILE, MetricsLogger, WandbOptions, repair_rows, tensorboard_dir
from runtime.progress import ProgressBar
from runtime.rollout import RolloutContext
from runtime.rollout.filters import load_filter
from runtime.rollout.plugins import HookSource, JobData, RolloutHooks, evaluate_with, load_rollout_hooks
from runtime.rollout.replay import ReplaySource
from runtime.rollout.rewards import RewardHub
from runtime.rollout.source import SCHEDULES, EventLoopThread, RolloutSettings
from runtime.signals import StopSignals
from runtime.train.algo import advantage_config, check_supported, loss_config, model_roles, role_paths
from runtime.train.driver import sft_warmup
from runtime.train.hooks import train_hooks


@dataclass
class Evaluation:
    """The job's evaluation after a step: the ``--eval-function-path`` function (slime's default: the rollout
    function) or the built-in evaluation over ``evals``; ``--custom-eval-rollout-log-function-path`` may replace its
    metrics. ``enabled``: the job evaluates every ``--eval-interval`` steps."""

    cfg: Config
    runner: EventLoopThread
    ctx: RolloutContext
    hooks: RolloutHooks
    data_source: Any
    evals: list[EvalSet]
    enabled: bool

    def __call__(self, step: int) -> dict[str, float]:
        """The evaluation's metrics after ``step`` steps."""
        if self.hooks.eval_fn is not None:
            data, metrics = evaluate_with(self.runner, self.ctx, self.hooks.eval_fn, self.data_source, step)
        else:
            metrics, data = self.runner.run(
                evaluate(self.ctx, self.evals, self.cfg, custom_generate=self.hooks.custom_generate)
            )
        if self.hooks.eval_log is not None and self.hooks.eval_log(step, self.cfg, data, dict(metrics)):
            return {}
        return metrics

    def due(self, done: int) -> bool:
        """Whether the job evaluates after ``done`` steps: every ``--eval-interval`` steps and after the last."""
        return self.enabled and (done % self.cfg.eval.eval_interval == 0 or done == self.cfg.rollout.num_rollout)


@dataclass
class Job:
    """What the loop drives: the resolved config (``--num-rollout`` set), the parts started, the step it starts at,
    and the loop's own state across steps."""

    cfg: Config
    out: Path
    tokenizer: Any
    dataset: Any
    adv_cfg: Any
    hooks: RolloutHooks
    hub: RewardHub
    trainers: TrainerGroup
    engines: EngineGroup
    weights: WeightSync
    source: Any
    evaluation: Evaluation
    logger: MetricsLogger
    bar: ProgressBar
    offload: Offload
    engine_memory: EngineMemory
    last: LastStep
    start: int
    # Engines that take weights while they generate, one rollout ahead and nothing offloaded: the sync does not
    # wait for the rollout in flight (runtime.cluster.weight_sync.DistributedSync.stage).
    staged_sync: bool
    # Engines that pause their generation around a weight update (SGLang), weights changed in place, one rollout
    # ahead and nothing offloaded: the sync pauses the rollout in flight instead of waiting for it, which goes on with
    # the new weights (runtime.cluster.engines.EngineGroup.generation_paused).
    paused_sync: bool = False
    # Each step's share of samples whose reward failed (runtime.faults.check_reward_errors).
    reward_error_rates: list[float] = dataclasses.field(default_factory=list)


def build_job(
    cfg: Config, *, cleanup: contextlib.ExitStack, signals: StopSignals | None = None, progress: bool = True
) -> Job:
    """Check ``cfg``'s model, data, reward and hooks, start Ray and the job's parts (each released by ``cleanup``),
    restore ``--load`` and push the starting weights; the returned job's rollout source has started."""
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
    cleanup.callback(hub.close)
    # No engines, no evaluation with --debug-train-only (as slime).
    evals = [] if cfg.debug.train_only else [EvalSet(d, prompts, eval_hub(cfg, d)) for d, prompts in eval_sets or []]
    for e in evals:
        cleanup.callback(e.hub.close)
    r = cfg.rollout
    filter_fn = load_filter(r.dynamic_sampling_filter_path) if r.dynamic_sampling_filter_path else None
    hooks = load_rollout_hooks(cfg)

    init_ray(cfg)  # kept across trainer restarts; runtime.loop.run shuts it down
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
        custom_generate=hooks.custom_generate,
        rewards=hub,
        # slime's per-sample SGLang seeds, from --rollout-seed (see RolloutContext).
        sampling_seed=cfg.data.rollout_seed if engine_kind(r.rollout_engine).sampling_seeds else None,
    )
    feed, data_source = job_data_source(cfg, dataset, hooks)
    job_data = JobData(feed, data_source)
    source = rollout_source(
        cfg, runner=runner, ctx=ctx, hub=hub, hooks=hooks, feed=feed, data_source=data_source, filter_fn=filter_fn
    )
    cleanup.callback(source.close)
    evaluation = Evaluation(
        cfg,
        runner,
        ctx,
        hooks,
        data_source,
        evals,
        enabled=cfg.eval.eval_interval is not None and not cfg.debug.train_only and bool(evals or hooks.eval_fn),
    )

    start = resume(cfg, trainers=trainers, engines=engines, job_data=job_data, tokenizer=tokenizer)
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
    logger = metrics_logger(cfg, out, start)
    cleanup.callback(logger.close)
    if logger.repaired and logger.repaired["dropped_unreadable"]:
        print(f"{out / METRICS_FILE}: dropped {logger.repaired['dropped_unreadable']} unreadable (torn) lines")
    bar = ProgressBar(r.num_rollout, start, enabled=progress)
    cleanup.callback(bar.close)
    # --offload-rollout / --offload-train (both on with --colocate): engines release their memory after each
    # rollout and take back their weights before a sync, their caches before the next rollout; the trainers
    # are offloaded while the engines generate.
    offload = Offload(cfg, trainers, engines)
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
    return Job(
        cfg=cfg,
        out=out,
        tokenizer=tokenizer,
        dataset=dataset,
        adv_cfg=adv_cfg,
        hooks=hooks,
        hub=hub,
        trainers=trainers,
        engines=engines,
        weights=weights,
        source=source,
        evaluation=evaluation,
        logger=logger,
        bar=bar,
        offload=offload,
        engine_memory=EngineMemory(engines),
        last=last,
        start=start,
        staged_sync=(
            getattr(weights, "can_stage", False)
            and hasattr(source, "defer")
            and getattr(source, "lookahead", 0) == 1
            and not (offload.train or offload.rollout)
        ),
        paused_sync=(
            getattr(engines.kind, "pauses_generation", False)
            and getattr(weights, "updates_in_place", False)
            and getattr(source, "lookahead", 0) == 1
            and not (offload.train or offload.rollout)
        ),
    )


def rollout_source(
    cfg: Config,
    *,
    runner: EventLoopThread,
    ctx: RolloutContext,
    hub: RewardHub,
    hooks: RolloutHooks,
    feed: Any,
    data_source: Any,
    filter_fn: Any = None,
) -> Any:
    """Where the job's rollouts come from: saved rollouts (``--load-debug-rollout-data``), slime's
    ``--rollout-function-path`` function, or the built-in rollout on ``--rollout-schedule`` (``filter_fn``: the
    loaded ``--dynamic-sampling-filter-path``)."""
    r = cfg.rollout
    if cfg.debug.load_debug_rollout_data is not None:
        d = cfg.debug
        return ReplaySource(
            d.load_debug_rollout_data, subsample=d.load_debug_rollout_data_subsample, reward_key=hub.reward_key
        )
    if hooks.rollout_fn is not None:
        return HookSource(
            runner,
            ctx,
            hooks.rollout_fn,
            data_source,
            num_rollout=r.num_rollout,
            lookahead=1 if r.rollout_schedule == "one_step" else 0,
        )
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
    return SCHEDULES[r.rollout_schedule](
        runner,
        feed,
        ctx,
        hub,
        settings,
        filter_fn=filter_fn,
        custom_generate=hooks.custom_generate,
        sample_filter=hooks.sample_filter,
        all_samples_process=(hooks.all_samples_process, data_source) if hooks.all_samples_process else None,
    )


def resume(cfg: Config, *, trainers: TrainerGroup, engines: EngineGroup, job_data: JobData, tokenizer: Any) -> int:
    """The step the job starts at: a job checkpoint's under ``--load`` (restored into the trainers, engines and
    data), else 0 after the optional SFT warm-up; slime's ``--start-rollout-id`` wins over both."""
    start = 0
    if cfg.ckpt.load is not None and checkpoint.is_job_checkpoint(cfg.ckpt.load):
        start = checkpoint.load(cfg.ckpt.load, trainers=trainers, engines=engines, feed=job_data)
        job_data.on_load(start)
    elif cfg.train.sft_warmup_steps:
        sft_warmup(cfg, trainers, tokenizer)
    if cfg.ckpt.start_rollout_id is not None:
        start = cfg.ckpt.start_rollout_id
    return start


def metrics_logger(cfg: Config, out: Path, start: int) -> MetricsLogger:
    """The job's metrics log (``metrics.jsonl``, TensorBoard, W&B) resumed at ``start``."""
    lg = cfg.log
    return MetricsLogger(
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


def sampling_params(cfg: Config) -> SamplingParams:
    """The training rollout's sampling settings (``--rollout-max-response-len``, ``--rollout-temperature`` ...)."""
    r = cfg.rollout
    return SamplingParams(
        max_new_tokens=r.rollout_max_response_len,
        temperature=r.rollout_temperature,
        top_p=r.rollout_top_p,
        top_k=r.rollout_top_k,
        stop_token_ids=tuple(r.rollout_stop_token_ids or ()),
        stop=tuple(r.rollout_stop or ()),
        return_top_p_token_ids=top_p_replay(cfg),
        return_routed_experts=cfg.algo.use_rollout_routing_replay,
    )


def axis_step(cfg: Config, step: int) -> int:
    """The x-axis value of rollout ``step`` in W&B and TensorBoard: the step itself, or with slime's
    ``--wandb-always-use-train-step`` the optimizer steps before it (``step x samples per rollout / global batch``)."""
    if not cfg.log.wandb_always_use_train_step:
        return step
    r = cfg.rollout
    return step * r.rollout_batch_size * r.n_samples_per_prompt // cfg.train.global_batch_size
