"""The built-in demo job: a tiny model and a verifiable task, selected when the job names no model or prompts.

The job path knows the demo only as what it provides: a model folder (:func:`base_model`, built on first use and
loaded like any checkpoint), prompt datasets (:func:`prompt_datasets`), a reward (``--rm-type builtin``,
``runtime.demo.task:reward``) and the optional SFT warm-up examples (:func:`sft_warmup_samples`). Its tuned flag
values live in ``runtime.config.BUILTIN_JOB_DEFAULTS``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from runtime.demo import task
from runtime.demo.tiny_model import make_tiny_model
from runtime.rollout.data import PromptDataset
from runtime.rollout.sample import Sample

# The built-in task's prompt pool (draws of 3-digit strings: about 870 of the 1000 distinct prompts) and its
# evaluation prompts, drawn from the strings the pool missed so that evaluation measures generalisation.
NUM_PROMPTS = 2048
NUM_EVAL_PROMPTS = 64


def base_model(output_dir: str | Path, *, seed: int) -> str:
    """The tiny model, built into ``output_dir/base_model``; returns the folder."""
    return str(make_tiny_model(Path(output_dir) / "base_model", alphabet=task.ALPHABET, seed=seed))


def prompt_datasets(tokenizer: Any, data_cfg: Any, *, seed: int) -> tuple[PromptDataset, PromptDataset]:
    """``(train, eval)``: the task's prompt pool and evaluation prompts none of the pool's strings."""
    # The task's records have their own keys, whatever --input-key / --label-key say about prompt files.
    data_cfg = dataclasses.replace(data_cfg, input_key="prompt", label_key="label")
    records = task.make_records(NUM_PROMPTS, seed=seed)
    train = PromptDataset.from_records(records, tokenizer, data_cfg, seed=seed)
    seen = {r["prompt"] for r in records}
    unseen = [r for r in task.make_records(16 * NUM_EVAL_PROMPTS, seed=seed + 1) if r["prompt"] not in seen]
    eval_records = list({r["prompt"]: r for r in unseen}.values())[:NUM_EVAL_PROMPTS]
    return train, PromptDataset.from_records(eval_records, tokenizer, data_cfg, seed=seed)


def sft_warmup_samples(tokenizer: Any, n: int, *, seed: int) -> list[Sample]:
    """``n`` SFT samples of the task's answer format (digits of the right length, drawn at random)."""
    samples = []
    for i, (prompt, response) in enumerate(task.format_examples(n, seed=seed)):
        prompt_ids = tokenizer(prompt)["input_ids"]
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        samples.append(
            Sample(group_index=i, tokens=prompt_ids + response_ids, response_length=len(response_ids), reward=0.0)
        )
    return samples
