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

from rlcore.advantages import sequence_advantages
from runtime import demo
from runtime.cluster import checkpoint
from runtime.cluster.engines import EngineGroup
from runtime.cluster.loopback import confine_ray
from runtime.cluster.placement import create_placement
from runtime.cluster.trainers import TrainerGroup
from runtime.cluster.weight_sync import check_weights_equal, make_weight_sync
from runtime.config import (
    Config,
    ConfigError,
    DataConfig,
    EvalDataset,
    dump_yaml,
    eval_datasets,
    flag,
    resolve_eval_dataset,
    to_dict,
)
from runtime.engines.base import SamplingParams
from runtime.errors import JobError
from runtime.hooks import resolve_hook
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
from runtime.rollout import RolloutContext, expand_groups, generate_groups, reward_category_metrics, sample_metrics
from runtime.rollout.data import PromptDataset
from runtime.rollout.filters import load_filter
from runtime.rollout.passrate import passrate_metrics
from runtime.rollout.replay import ReplaySource, save_rollout_data
from runtime.rollout.rewards import RewardHub, reward_error_rate
from runtime.rollout.sample import Sample
from runtime.rollout.source import SCHEDULES, EventLoopThread, PromptFeed, RolloutSettings
from runtime.train.algo import (
    advantage_config,
    check_supported,
    loss_config,
    model_roles,
    needs_rollout_log_probs,
    role_paths,
)
from runtime.train.batch import PROMPT_LENGTHS, RESPONSE_LENGTHS, balanced_order, build_batch

# Skipped data rows printed at start (the rest are counted).
MAX_REPORTED_ROWS = 10


@dataclass
class RunResult:
    output_dir: Path
    final_step: int
    history: list[dict[str, Any]]


def run(cfg: Config, *, progress: bool = True) -> RunResult:
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
    custom_generate = (
        resolve_hook(flag("custom_generate_function_path"), r.custom_generate_function_path)
        if r.custom_generate_function_path
        else None
    )
    settings = RolloutSettings(
        rollout_batch_size=r.rollout_batch_size,
        n_samples=r.n_samples_per_prompt,
        params=sampling_params(cfg),
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
        if _init_ray(cfg):
            cleanup.callback(ray.shutdown)
        placement = create_placement(cfg)
        cleanup.callback(ray.util.remove_placement_group, placement.group)
        trainers = TrainerGroup(
            placement,
            backend=cfg.train.train_backend,
            model_path=model_path,
            roles=model_roles(cfg),
            role_paths=role_paths(cfg),
            train_cfg=cfg.train,
            loss_cfg=loss_config(cfg),
            temperature=r.rollout_temperature,
            seed=cfg.seed,
        )
        cleanup.callback(trainers.shutdown)
        engines = EngineGroup(cfg, placement, model_path)
        cleanup.callback(engines.shutdown)
        weights = make_weight_sync(trainers, engines, bucket_bytes=r.update_weight_buffer_size)
        cleanup.callback(weights.close)
        runner = EventLoopThread()
        cleanup.callback(runner.close)
        ctx = RolloutContext(engines=engines, tokenizer=tokenizer, args=cfg)
        feed = PromptFeed(dataset)
        if cfg.debug.load_debug_rollout_data is not None:
            d = cfg.debug
            source = ReplaySource(
                d.load_debug_rollout_data, subsample=d.load_debug_rollout_data_subsample, reward_key=hub.reward_key
            )
        else:
            source = SCHEDULES[r.rollout_schedule](
                runner, feed, ctx, hub, settings, filter_fn=filter_fn, custom_generate=custom_generate
            )
        cleanup.callback(source.close)

        start = 0
        if cfg.ckpt.load is not None:
            start = checkpoint.load(cfg.ckpt.load, trainers=trainers, engines=engines, feed=feed)
        elif cfg.train.sft_warmup_steps:
            sft_warmup(cfg, trainers, tokenizer)
        if cfg.ckpt.start_rollout_id is not None:
            start = cfg.ckpt.start_rollout_id  # slime's --start-rollout-id wins over the checkpoint's step
        weights.push(start)
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
        history: list[dict[str, Any]] = []
        bar = ProgressBar(r.num_rollout, start, enabled=progress)
        cleanup.callback(bar.close)
        # --offload-rollout / --offload-train (both on with --colocate): engines release their memory after each
        # rollout and take back their weights before a sync, their caches before the next rollout; the trainers
        # are offloaded while the engines generate.
        offload_rollout = cfg.resources.colocate if cfg.sglang.offload_rollout is None else cfg.sglang.offload_rollout
        offload_train = cfg.resources.colocate if cfg.sglang.offload_train is None else cfg.sglang.offload_train
        engine_memory = EngineMemory(engines)
        source.start(start)
        # On a JobError (a hook, a reward, a filter the user must fix) the last completed step is saved first.
        last = LastStep(
            cfg.ckpt.save,
            start,
            trainers=trainers,
            engines=engines,
            feed=feed,
            with_optimizer=not cfg.ckpt.no_save_optim,
        )
        cleanup.push(last.on_exit)
        reward_error_rates: list[float] = []
        for step in range(start, r.num_rollout):
            step_start = time.perf_counter()
            # The data counts go to the first logged step (they do not change during the job).
            metrics: dict[str, float] = dataset.stats() if step == start else {}
            if step == 0 and evals and not cfg.eval.skip_eval_before_train:
                # As slime: the starting model is evaluated too (logged with the first step's metrics, as "before").
                before = runner.run(evaluate(ctx, evals, cfg, custom_generate=custom_generate))
                metrics.update({f"{name}_before_train": value for name, value in before.items()})

            # 1. Rollout: this step's scored, filtered groups (generated now, or while earlier steps trained).
            if offload_train:
                trainers.release_memory()
            engine_memory.resume()
            rollout = source.get(step)
            metrics.update(rollout.metrics)
            if cfg.debug.rollout_data_path is not None:
                save_rollout_data(cfg.debug.rollout_data_path, step, rollout.samples)
            if cfg.log.log_passrate:
                metrics.update(passrate_metrics(rollout.samples, prefix="rollout", reward_key=hub.reward_key))
            if cfg.log.log_reward_category is not None:
                metrics.update(reward_category_metrics(rollout.samples, cfg.log.log_reward_category))
            metrics["perf/rollout_wait_time"] = time.perf_counter() - step_start
            reward_error_rates.append(reward_error_rate(rollout.metrics))
            check_reward_errors(reward_error_rates, cfg, reward=hub.name)
            if offload_rollout:
                engine_memory.release()
            if offload_train:
                trainers.resume_memory()

            # 2. Train: the batch goes to the trainers once, with the group baselines computed over all of it; the
            # trainers recompute old/reference log-probs, add the per-token advantage terms and step the optimizer.
            done = step + 1
            if not cfg.debug.debug_rollout_only:
                t = time.perf_counter()
                last.training()
                metrics.update(train_step(cfg, trainers, rollout, tokenizer, adv_cfg))
                metrics["perf/train_time"] = time.perf_counter() - t

            # 3. Weight sync every --update-weights-interval steps: the engines sample with the weights just trained.
            if done % r.update_weights_interval == 0 or done == r.num_rollout:
                t = time.perf_counter()
                source.pause()
                engine_memory.resume(["weights"])
                weights.push(done)
                source.resume(done)
                metrics["perf/weight_sync_time"] = time.perf_counter() - t

            # 4. Evaluation, logging, the ledger of prompts, checkpoints. A hook that fails in evaluation stops
            # the job once this step (trained) is logged and committed.
            eval_failure = None
            if evals and (done % cfg.eval.eval_interval == 0 or done == r.num_rollout):
                try:
                    metrics.update(runner.run(evaluate(ctx, evals, cfg, custom_generate=custom_generate)))
                except JobError as err:
                    eval_failure = err
            metrics["perf/step_time"] = time.perf_counter() - step_start
            logger.log(step, metrics)
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
            trainers.save_hf(str(out / "final_model"))
    plot_rewards(out / METRICS_FILE, out / REWARD_PLOT)
    return RunResult(output_dir=out, final_step=r.num_rollout, history=history)


class LastStep:
    """The job's last completed step (trained, logged, committed) and whether it is saved.

    ``on_exit`` (an ``ExitStack`` exit callback) saves it under ``--save`` when a ``JobError`` stops the job and it
    is not saved yet, so the user can fix the cause and ``--load`` it; not when the trainers already hold a later,
    uncommitted step, nor when saving is what failed.
    """

    def __init__(
        self, root: str | None, start: int, *, trainers: Any, engines: Any, feed: Any, with_optimizer: bool = True
    ):
        self.root, self.start, self.with_optimizer = root, start, with_optimizer
        self.completed = self.saved = start
        self.trained_ahead = False
        self._state = {"trainers": trainers, "engines": engines, "feed": feed}

    def training(self) -> None:
        self.trained_ahead = True

    def complete(self, step: int) -> None:
        self.completed, self.trained_ahead = step, False

    def save(self) -> Path:
        folder = checkpoint.save(self.root, self.completed, with_optimizer=self.with_optimizer, **self._state)
        self.saved = self.completed
        return folder

    def on_exit(self, exc_type: Any, err: BaseException | None, tb: Any) -> bool:
        keep = self.root is not None and self.completed not in (self.start, self.saved) and not self.trained_ahead
        if keep and isinstance(err, JobError) and not isinstance(err, checkpoint.SaveError):
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


def train_step(cfg: Config, trainers: TrainerGroup, rollout: Any, tokenizer: Any, adv_cfg: Any) -> dict[str, float]:
    """One step's training on ``rollout``: its batch, the trainers' optimizer steps, then slime's per-step extras
    (optimizer reset, reference refresh, the batch saved for debugging); returns the metrics."""
    batch = build_batch(
        rollout.samples,
        pad_token_id=tokenizer.pad_token_id,
        require_rollout_log_probs=needs_rollout_log_probs(cfg),
        reward_key=cfg.reward.reward_key,
    )
    batch = sequence_advantages(batch, adv_cfg)
    if cfg.data.balance_data:
        lengths = (batch[PROMPT_LENGTHS] + batch[RESPONSE_LENGTHS]).tolist()
        dp_size = cfg.resources.num_trainer_procs
        batch = batch[balanced_order(lengths, global_batch_size=cfg.train.global_batch_size, dp_size=dp_size)]
    if cfg.debug.train_data_path is not None:
        path = Path(cfg.debug.train_data_path.format(rollout_id=rollout.step))
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"rollout_id": rollout.step, "batch": batch.to_dict()}, path)
    metrics = train_metrics(
        trainers.train_rollout(
            batch,
            global_batch_size=cfg.train.global_batch_size,
            adv_cfg=adv_cfg,
            use_rollout_log_probs=cfg.algo.use_rollout_logprobs,
        )
    )
    done = rollout.step + 1
    if cfg.algo.reset_optimizer_states:
        trainers.call("reset_optimizer")
    if cfg.algo.ref_update_interval is not None and done % cfg.algo.ref_update_interval == 0:
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
        )


def eval_hub(cfg: Config, dataset: EvalDataset) -> RewardHub:
    """The reward hub of an evaluation dataset: its own ``rm_type`` / ``custom_rm_path`` where it sets them, scoring
    ``--eval-reward-key``."""
    reward = dataclasses.replace(
        cfg.reward,
        rm_type=dataset.rm_type or cfg.reward.rm_type,
        custom_rm_path=dataset.custom_rm_path or cfg.reward.custom_rm_path,
    )
    return RewardHub(reward, args=cfg, seed=cfg.seed, evaluation=True)


def resolve_num_rollout(cfg: Config, dataset_size: int) -> Config:
    """``cfg`` with ``--num-rollout`` set: as given, or slime's ``--num-epoch`` x whole rollouts per pass."""
    r = cfg.rollout
    if r.num_rollout is not None:
        return cfg
    per_epoch = dataset_size // r.rollout_batch_size
    if per_epoch == 0:
        raise ConfigError(
            [
                f"--num-epoch: the prompt data holds {dataset_size} prompts, fewer than --rollout-batch-size "
                f"{r.rollout_batch_size}: set --num-rollout"
            ]
        )
    return dataclasses.replace(cfg, rollout=dataclasses.replace(r, num_rollout=per_epoch * r.num_epoch))


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
            cfg.data.prompt_data, tokenizer, cfg.data, seed=cfg.data.rollout_seed, max_context=context
        )
    if cfg.eval.eval_interval is not None and has_eval_data:
        for d in eval_datasets(cfg):
            config = eval_data_config(cfg, d)
            eval_sets.append(
                (d, PromptDataset(d.path, tokenizer, config, seed=cfg.data.rollout_seed, max_context=context))
            )
    datasets = (dataset, *(ds for _, ds in eval_sets))
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
    """The trainers' ``rl_loss`` metrics under ``train/``; ``train/kl`` is the KL to the reference model when one is
    kept, else the KL between the sampling and the updated policy (slime's ppo_kl)."""
    out = {f"train/{name}": value for name, value in raw.items() if name != "advantage_abs_mean"}
    out["train/kl"] = raw.get("approx_kl_ref", raw["approx_kl_old"])
    out["rollout/advantage_abs_mean"] = raw["advantage_abs_mean"]
    return out


def usable_cpus() -> int:
    """The cores this process may run on (its affinity mask, e.g. under ``taskset`` or a cpuset), not the host's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _init_ray(cfg: Config) -> bool:
    """Start a local Ray if none is running; returns whether this call started it."""
    if ray.is_initialized():
        return False
    res = cfg.resources
    slots = res.num_trainer_procs + (0 if res.colocate else res.rollout_num_gpus)
    # A single-node job: every Ray listener on 127.0.0.1 (runtime.cluster.loopback; token authentication, Ray's
    # default for a cluster ray.init starts, stays on for its gRPC servers as well).
    confine_ray()
    # On a CPU-only machine a slot is a logical CPU: the job's actors take turns, so slots may exceed cores.
    ray.init(num_cpus=max(usable_cpus(), slots), include_dashboard=False, log_to_driver=False)
    return True


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
) -> dict[str, float]:
    """Reward statistics over the evaluation prompts (each dataset's samples per prompt, sampling settings and
    reward), no filter, no training: ``eval/{name}/*`` per dataset and ``eval/*`` over all of them.

    Responses come from the same generation path as training rollouts: ``custom_generate`` (the
    ``--custom-generate-function-path`` hook) when given, the engines' batched generate otherwise.
    """
    metrics: dict[str, float] = {}
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
    return metrics


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
