"""The training loop of ``rlcore-run``: rollout, train, weight sync, log, eval, save.

Read :func:`run` top to bottom: that is the whole job. It drives seams, never implementations: trainers by model
role (``--train-backend``), engines (``--rollout-engine``), a weight sync (the engines' default) and a rollout
source (``--rollout-schedule``: sync, one-step or fully async).
"""

from __future__ import annotations

import contextlib
import os
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
from runtime.cluster.placement import create_placement
from runtime.cluster.trainers import TrainerGroup
from runtime.cluster.weight_sync import check_weights_equal, make_weight_sync
from runtime.config import Config, ConfigError, dump_yaml, to_dict
from runtime.engines.base import SamplingParams
from runtime.hooks import load_function
from runtime.logger import (
    LEDGER_FILE,
    METRICS_FILE,
    REWARD_PLOT,
    MetricsLogger,
    append_ledger,
    format_step_line,
    plot_rewards,
)
from runtime.rollout import RolloutContext, expand_groups, generate_groups, sample_metrics
from runtime.rollout.data import PromptDataset
from runtime.rollout.filters import load_filter
from runtime.rollout.rewards import RewardHub
from runtime.rollout.sample import Sample
from runtime.rollout.source import SCHEDULES, EventLoopThread, PromptFeed, RolloutSettings
from runtime.train.algo import advantage_config, check_supported, loss_config, model_roles
from runtime.train.batch import build_batch

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
    adv_cfg, gbs = advantage_config(cfg), cfg.train.global_batch_size
    model_path, tokenizer, dataset, eval_prompts = prepare_model_and_data(cfg)
    hub = RewardHub(cfg.reward, args=cfg)
    r = cfg.rollout
    filter_fn = load_filter(r.dynamic_sampling_filter_path) if r.dynamic_sampling_filter_path else None
    custom_generate = load_function(r.custom_generate_function_path) if r.custom_generate_function_path else None
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
        if _init_ray(cfg):
            cleanup.callback(ray.shutdown)
        placement = create_placement(cfg)
        cleanup.callback(ray.util.remove_placement_group, placement.group)
        trainers = TrainerGroup(
            placement,
            backend=cfg.train.train_backend,
            model_path=model_path,
            roles=model_roles(cfg),
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
        source = SCHEDULES[r.rollout_schedule](
            runner, feed, ctx, hub, settings, filter_fn=filter_fn, custom_generate=custom_generate
        )
        cleanup.callback(source.close)

        start = 0
        if cfg.ckpt.load is not None:
            start = checkpoint.load(cfg.ckpt.load, trainers=trainers, engines=engines, feed=feed)
        elif cfg.train.sft_warmup_steps:
            sft_warmup(cfg, trainers, tokenizer)
        weights.push(start)
        if cfg.sglang.check_weight_update_equal:
            check_weights_equal(trainers, engines)
        if start == 0:
            (out / LEDGER_FILE).unlink(missing_ok=True)
        logger = MetricsLogger(
            out,
            use_tensorboard=cfg.log.use_tensorboard,
            use_wandb=cfg.log.use_wandb,
            wandb_project=cfg.log.wandb_project,
            config=to_dict(cfg),
            resume=start > 0,
        )
        cleanup.callback(logger.close)
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
        for step in range(start, r.num_rollout):
            step_start = time.perf_counter()
            # The data counts go to the first logged step (they do not change during the job).
            metrics: dict[str, float] = dataset.stats() if step == start else {}

            # 1. Rollout: this step's scored, filtered groups (generated now, or while earlier steps trained).
            if offload_train:
                trainers.release_memory()
            engine_memory.resume()
            rollout = source.get(step)
            metrics.update(rollout.metrics)
            metrics["perf/rollout_wait_time"] = time.perf_counter() - step_start
            if offload_rollout:
                engine_memory.release()
            if offload_train:
                trainers.resume_memory()

            # 2. Train: the batch goes to the trainers once, with the group baselines computed over all of it; the
            # trainers recompute old/reference log-probs, add the per-token advantage terms and step the optimizer.
            t = time.perf_counter()
            batch = build_batch(
                rollout.samples, pad_token_id=tokenizer.pad_token_id, require_rollout_log_probs=cfg.algo.use_tis
            )
            metrics.update(
                train_metrics(
                    trainers.train_rollout(sequence_advantages(batch, adv_cfg), global_batch_size=gbs, adv_cfg=adv_cfg)
                )
            )
            metrics["perf/train_time"] = time.perf_counter() - t
            done = step + 1

            # 3. Weight sync every --update-weights-interval steps: the engines sample with the weights just trained.
            if done % r.update_weights_interval == 0 or done == r.num_rollout:
                t = time.perf_counter()
                source.pause()
                engine_memory.resume(["weights"])
                weights.push(done)
                source.resume(done)
                metrics["perf/weight_sync_time"] = time.perf_counter() - t

            # 4. Evaluation, logging, the ledger of prompts, checkpoints.
            if eval_prompts is not None and (done % cfg.eval.eval_interval == 0 or done == r.num_rollout):
                metrics.update(runner.run(evaluate(ctx, hub, eval_prompts, cfg, custom_generate=custom_generate)))
            metrics["perf/step_time"] = time.perf_counter() - step_start
            logger.log(step, metrics)
            source.commit(rollout)
            append_ledger(out, step, {"trained": rollout.trained_indices, **rollout.outcomes})
            history.append({"step": step, **metrics})
            bar.advance(format_step_line(done, r.num_rollout, metrics))
            if cfg.ckpt.save is not None and (
                (cfg.ckpt.save_interval is not None and done % cfg.ckpt.save_interval == 0) or done == r.num_rollout
            ):
                checkpoint.save(cfg.ckpt.save, done, trainers=trainers, engines=engines, feed=feed)

        source.close()
        trainers.save_hf(str(out / "final_model"))
    plot_rewards(out / METRICS_FILE, out / REWARD_PLOT)
    return RunResult(output_dir=out, final_step=r.num_rollout, history=history)


def sampling_params(cfg: Config) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(
        max_new_tokens=r.rollout_max_response_len,
        temperature=r.rollout_temperature,
        top_p=r.rollout_top_p,
        top_k=r.rollout_top_k,
    )


def prepare_model_and_data(cfg: Config) -> tuple[str, Any, PromptDataset, list[Sample] | None]:
    """The model folder, its tokenizer, the prompt dataset and the evaluation prompts (None without eval).

    Without ``--hf-checkpoint`` the demo's tiny model is built into ``output_dir/base_model`` and loaded from there
    like any checkpoint; without ``--prompt-data`` the prompts are the demo task's. What was dropped or skipped is
    printed (``PromptDataset.report``). Data errors, and a ``--max-tokens-per-gpu`` too small for the longest
    prompt plus ``--rollout-max-response-len``, raise here, before Ray starts.
    """
    from transformers import AutoTokenizer

    model_path = cfg.model.hf_checkpoint or demo.base_model(cfg.output_dir, seed=cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    eval_set = None
    if cfg.data.prompt_data is None:
        dataset, demo_eval = demo.prompt_datasets(tokenizer, cfg.data, seed=cfg.seed)
        if cfg.eval.eval_interval is not None and cfg.eval.eval_prompt_data is None:
            eval_set = demo_eval
    else:
        dataset = PromptDataset(cfg.data.prompt_data, tokenizer, cfg.data, seed=cfg.seed)
    if cfg.eval.eval_interval is not None and cfg.eval.eval_prompt_data is not None:
        eval_set = PromptDataset(cfg.eval.eval_prompt_data, tokenizer, cfg.data, seed=cfg.seed)
    datasets = (dataset,) if eval_set is None else (dataset, eval_set)
    for ds in datasets:
        print("\n".join(ds.report(max_rows=MAX_REPORTED_ROWS)), flush=True)
    budget = cfg.train.max_tokens_per_gpu
    if budget is not None:
        longest = max(ds.max_prompt_tokens for ds in datasets)
        need = longest + cfg.rollout.rollout_max_response_len
        if budget < need:
            raise ConfigError(
                [
                    f"--max-tokens-per-gpu {budget} cannot hold the longest sample: a prompt of {longest} tokens + "
                    f"--rollout-max-response-len {cfg.rollout.rollout_max_response_len} = {need} (raise the budget, "
                    "or drop long prompts with --rollout-max-prompt-len)"
                ]
            )
    eval_prompts = eval_set.next_batch(len(eval_set)) if eval_set is not None else None
    return model_path, tokenizer, dataset, eval_prompts


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


def _init_ray(cfg: Config) -> bool:
    """Start a local Ray if none is running; returns whether this call started it."""
    if ray.is_initialized():
        return False
    res = cfg.resources
    slots = res.num_trainer_procs + (0 if res.colocate else res.rollout_num_gpus)
    # On a CPU-only machine a slot is a logical CPU: the job's actors take turns, so slots may exceed cores.
    ray.init(num_cpus=max(os.cpu_count() or 1, slots), include_dashboard=False, log_to_driver=False)
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
    ctx: RolloutContext, hub: RewardHub, prompts: list[Sample], cfg: Config, *, custom_generate: Any = None
) -> dict[str, float]:
    """Mean reward over the evaluation prompts (``--n-samples-per-eval-prompt`` each), no filter, no training.

    Responses come from the same generation path as training rollouts: ``custom_generate`` (the
    ``--custom-generate-function-path`` hook) when given, the engines' batched generate otherwise.
    """
    groups = expand_groups(prompts, cfg.eval.n_samples_per_eval_prompt, first_group=0)
    # Aborted groups are left out of the score, as the rollout leaves them out of training.
    whole, aborted = await generate_groups(ctx, groups, sampling_params(cfg), custom_generate)
    samples = [s for g in whole for s in g]
    await hub.score(samples)
    errors = hub.pop_metrics()
    metrics = sample_metrics(samples, prefix="eval") if samples else {}
    metrics["eval/reward_errors"] = errors["reward/errors"]
    metrics["eval/groups_aborted"] = len(aborted)
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
