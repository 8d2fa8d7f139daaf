"""Evaluation of the job's model on its evaluation datasets (``--eval-*``): each dataset's reading, sampling and
reward settings, and the reward statistics of one evaluation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from runtime.config import Config, DataConfig, EvalDataset
from runtime.engines.base import SamplingParams
from runtime.rollout import RolloutContext, expand_groups, generate_groups, sample_metrics
from runtime.rollout.filters import reward_value
from runtime.rollout.passrate import passrate_metrics
from runtime.rollout.rewards import RewardHub
from runtime.rollout.sample import Sample


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
