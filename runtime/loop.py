"""The training loop of ``rlcore-run``: rollout, rewards, advantages, train, weight sync, log, eval, save.

Read :func:`run` top to bottom: that is the whole job. Everything it calls is either ``rlcore`` math (advantages,
the loss inside the trainers) or a small runtime piece with one job (``rollout``, ``placement``, ``checkpoint``,
``logger``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from tensordict import TensorDict

from rlcore import keys
from rlcore.advantages import compute
from runtime import rollout
from runtime.cluster import checkpoint
from runtime.cluster.placement import EngineGroup, TrainerGroup, create_placement
from runtime.config import Config, ConfigError, dump_yaml, to_dict
from runtime.demo import task
from runtime.demo.tiny_model import make_tiny_model
from runtime.engines.base import SamplingParams
from runtime.hooks import load_function
from runtime.logger import METRICS_FILE, REWARD_PLOT, MetricsLogger, format_step_line, plot_rewards
from runtime.rollout import RolloutContext, collect_rollout, expand_groups, sample_metrics
from runtime.rollout.data import PromptDataset
from runtime.rollout.filters import load_filter
from runtime.rollout.rewards import RewardHub
from runtime.rollout.sample import Sample
from runtime.train.algo import advantage_config, check_supported, loss_config, needs_reference
from runtime.train.batch import build_batch

# The built-in task's prompt pool (draws of 3-digit strings: about 870 of the 1000 distinct prompts) and its
# evaluation prompts, drawn from the strings the pool missed so that evaluation measures generalisation.
BUILTIN_NUM_PROMPTS = 2048
BUILTIN_NUM_EVAL_PROMPTS = 64
# Skipped data rows printed at start (the rest are counted).
MAX_REPORTED_ROWS = 10


@dataclass
class RunResult:
    output_dir: Path
    final_step: int
    history: list[dict[str, Any]]


def prepare_model_and_data(cfg: Config) -> tuple[str, Any, PromptDataset, list[Sample] | None]:
    """The model folder, its tokenizer, the prompt dataset and the evaluation prompts (None without eval).

    Without ``--hf-checkpoint`` the tiny model is built into ``output_dir/base_model`` and loaded from there like
    any checkpoint; without ``--prompt-data`` the prompts are the built-in task's. What was dropped or skipped is
    printed (``PromptDataset.report``). Data errors, and a ``--max-tokens-per-gpu`` too small for the longest
    prompt plus ``--rollout-max-response-len``, raise here, before Ray starts.
    """
    from transformers import AutoTokenizer

    model_path = cfg.model.hf_checkpoint
    if model_path is None:
        model_path = str(make_tiny_model(Path(cfg.output_dir) / "base_model", alphabet=task.ALPHABET, seed=cfg.seed))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if cfg.data.prompt_data is None:
        records = task.make_records(BUILTIN_NUM_PROMPTS, seed=cfg.seed)
        dataset = PromptDataset.from_records(records, tokenizer, cfg.data, seed=cfg.seed)
    else:
        dataset = PromptDataset(cfg.data.prompt_data, tokenizer, cfg.data, seed=cfg.seed)
    eval_prompts = None
    if cfg.eval.eval_interval is not None:
        if cfg.eval.eval_prompt_data is not None:
            eval_set = PromptDataset(cfg.eval.eval_prompt_data, tokenizer, cfg.data, seed=cfg.seed)
        else:
            seen = {r["prompt"] for r in records}
            unseen = [
                r
                for r in task.make_records(16 * BUILTIN_NUM_EVAL_PROMPTS, seed=cfg.seed + 1)
                if r["prompt"] not in seen
            ]
            records = list({r["prompt"]: r for r in unseen}.values())[:BUILTIN_NUM_EVAL_PROMPTS]
            eval_set = PromptDataset.from_records(records, tokenizer, cfg.data, seed=cfg.seed)
        eval_prompts = eval_set.next_batch(len(eval_set))
    datasets = (dataset,) if eval_prompts is None else (dataset, eval_set)
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
    return model_path, tokenizer, dataset, eval_prompts


def sft_warmup(cfg: Config, trainers: TrainerGroup, tokenizer: Any) -> list[float]:
    """Optional SFT steps on the built-in task's format examples (digits of the right length, drawn at random)."""
    losses = []
    n = cfg.train.global_batch_size
    for step in range(cfg.train.sft_warmup_steps):
        samples = []
        for i, (prompt, response) in enumerate(task.format_examples(n, seed=cfg.seed + 7919 * (step + 1))):
            prompt_ids = tokenizer(prompt)["input_ids"]
            response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            samples.append(
                Sample(
                    group_index=i,
                    tokens=prompt_ids + response_ids,
                    response_length=len(response_ids),
                    reward=0.0,
                )
            )
        losses.append(trainers.sft_train(build_batch(samples, pad_token_id=tokenizer.pad_token_id))["sft_loss"])
    return losses


def train_metrics(raw: dict[str, float]) -> dict[str, float]:
    """The trainers' ``rl_loss`` metrics under ``train/``; ``train/kl`` is the KL to the reference model when one is
    kept, else the KL between the sampling and the updated policy (slime's ppo_kl)."""
    out = {f"train/{name}": value for name, value in raw.items()}
    out["train/kl"] = raw.get("approx_kl_ref", raw["approx_kl_old"])
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


def run(cfg: Config, *, progress: bool = True) -> RunResult:
    # Model, data, reward, hooks: everything that can fail on user input fails here, before Ray starts.
    check_supported(cfg)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    dump_yaml(cfg, out / "config.yaml")
    torch.manual_seed(cfg.seed)
    adv_cfg, loss_cfg = advantage_config(cfg), loss_config(cfg)
    model_path, tokenizer, dataset, eval_prompts = prepare_model_and_data(cfg)
    hub = RewardHub(cfg.reward, args=cfg)
    filter_fn = (
        load_filter(cfg.rollout.dynamic_sampling_filter_path) if cfg.rollout.dynamic_sampling_filter_path else None
    )
    custom_generate = (
        load_function(cfg.rollout.custom_generate_function_path) if cfg.rollout.custom_generate_function_path else None
    )
    params = SamplingParams(
        max_new_tokens=cfg.rollout.rollout_max_response_len,
        temperature=cfg.rollout.rollout_temperature,
        top_p=cfg.rollout.rollout_top_p,
        top_k=cfg.rollout.rollout_top_k,
    )
    gbs = cfg.train.global_batch_size

    # Actors, logger and bar are released in reverse order however the job ends.
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(hub.close)
        if _init_ray(cfg):
            cleanup.callback(ray.shutdown)
        placement = create_placement(cfg)
        cleanup.callback(ray.util.remove_placement_group, placement.group)
        trainers = TrainerGroup(
            placement,
            model_path,
            train_cfg=cfg.train,
            loss_cfg=loss_cfg,
            temperature=cfg.rollout.rollout_temperature,
            need_ref=needs_reference(cfg),
            seed=cfg.seed,
        )
        cleanup.callback(trainers.shutdown)
        sglang_urls = [url for url in (cfg.rollout.sglang_url or "").split(",") if url]
        engines = EngineGroup(placement, model_path, seed=cfg.seed, sglang_urls=sglang_urls)
        cleanup.callback(engines.shutdown)
        ctx = RolloutContext(engines=engines, tokenizer=tokenizer, args=cfg)

        start_step = 0
        if cfg.ckpt.load is not None:
            start_step = checkpoint.load(cfg.ckpt.load, trainers=trainers, engines=engines, dataset=dataset)
        elif cfg.train.sft_warmup_steps:
            sft_losses = sft_warmup(cfg, trainers, tokenizer)
            print(f"SFT warm-up: {len(sft_losses)} steps, loss {sft_losses[0]:.3f} -> {sft_losses[-1]:.3f}")
        engines.update_weights(trainers.weights_ref(), version=start_step)

        logger = MetricsLogger(
            out,
            use_tensorboard=cfg.log.use_tensorboard,
            use_wandb=cfg.log.use_wandb,
            wandb_project=cfg.log.wandb_project,
            config=to_dict(cfg),
            resume=start_step > 0,
        )
        cleanup.callback(logger.close)
        history: list[dict[str, Any]] = []
        bar = ProgressBar(cfg.rollout.num_rollout, start_step, enabled=progress)
        cleanup.callback(bar.close)
        for step in range(start_step, cfg.rollout.num_rollout):
            step_start = time.perf_counter()
            # The data counts go to the first logged step (they do not change during the job).
            metrics: dict[str, float] = dataset.stats() if step == start_step else {}

            # 1. Rollout: generate groups, score them, keep those the filter passes.
            if cfg.resources.colocate:
                trainers.release_memory()
                engines.resume_memory()
            samples, rollout_metrics = asyncio.run(
                collect_rollout(
                    ctx,
                    dataset.next_batch,
                    hub,
                    rollout_batch_size=cfg.rollout.rollout_batch_size,
                    n_samples=cfg.rollout.n_samples_per_prompt,
                    params=params,
                    over_sampling_batch_size=cfg.rollout.over_sampling_batch_size,
                    filter_fn=filter_fn,
                    custom_generate=custom_generate,
                )
            )
            metrics.update(rollout_metrics)
            metrics["perf/rollout_time"] = time.perf_counter() - step_start
            if cfg.resources.colocate:
                engines.release_memory()
                trainers.resume_memory()

            # 2. The batch, with the trainers' log-probs of the policy that sampled it (and of the reference).
            t = time.perf_counter()
            batch: TensorDict = build_batch(
                samples, pad_token_id=tokenizer.pad_token_id, require_rollout_log_probs=cfg.algo.use_tis
            )
            batch.update(trainers.compute_log_probs(batch, global_batch_size=gbs))
            metrics["perf/log_prob_time"] = time.perf_counter() - t

            # 3. Advantages (rlcore), 4. optimizer steps over global batches (rl_loss inside the trainers).
            batch = compute(batch, adv_cfg)
            t = time.perf_counter()
            metrics.update(train_metrics(trainers.train(batch, global_batch_size=gbs)))
            metrics["perf/train_time"] = time.perf_counter() - t
            metrics["rollout/advantage_abs_mean"] = float(batch[keys.ADVANTAGES].abs()[batch[keys.MASK]].mean())

            # 5. Weight sync: the engines sample the next rollout with the weights just trained.
            t = time.perf_counter()
            if cfg.resources.colocate:
                engines.resume_memory()
            engines.update_weights(trainers.weights_ref(), version=step + 1)
            metrics["perf/weight_sync_time"] = time.perf_counter() - t

            # 6. Evaluation, logging, checkpoints.
            done = step + 1
            if eval_prompts is not None and (done % cfg.eval.eval_interval == 0 or done == cfg.rollout.num_rollout):
                metrics.update(evaluate(ctx, hub, eval_prompts, cfg, params, custom_generate=custom_generate))
            metrics["perf/step_time"] = time.perf_counter() - step_start
            logger.log(step, metrics)
            history.append({"step": step, **metrics})
            bar.advance(format_step_line(done, cfg.rollout.num_rollout, metrics))
            if cfg.ckpt.save is not None and (
                (cfg.ckpt.save_interval is not None and done % cfg.ckpt.save_interval == 0)
                or done == cfg.rollout.num_rollout
            ):
                checkpoint.save(cfg.ckpt.save, done, trainers=trainers, engines=engines, dataset=dataset)

        trainers.save_hf(str(out / "final_model"))
    plot_rewards(out / METRICS_FILE, out / REWARD_PLOT)
    return RunResult(output_dir=out, final_step=cfg.rollout.num_rollout, history=history)


def evaluate(
    ctx: RolloutContext,
    hub: RewardHub,
    prompts: list[Sample],
    cfg: Config,
    params: SamplingParams,
    *,
    custom_generate: Any = None,
) -> dict[str, float]:
    """Mean reward over the evaluation prompts (``--n-samples-per-eval-prompt`` each), no filter, no training.

    Responses come from the same generation path as training rollouts: ``custom_generate`` (the
    ``--custom-generate-function-path`` hook) when given, the engines' batched generate otherwise.
    """
    groups = expand_groups(prompts, cfg.eval.n_samples_per_eval_prompt, first_group=0)

    async def go() -> tuple[list[Sample], int]:
        # Aborted groups are left out of the score, as the rollout leaves them out of training.
        whole, aborted = await rollout.generate_groups(ctx, groups, params, custom_generate)
        samples = [s for g in whole for s in g]
        await hub.score(samples)
        return samples, len(aborted)

    samples, num_aborted = asyncio.run(go())
    errors = hub.pop_metrics()
    metrics = sample_metrics(samples, prefix="eval") if samples else {}
    metrics["eval/reward_errors"] = errors["reward/errors"]
    metrics["eval/groups_aborted"] = num_aborted
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
