"""Debug and replay (slime's ``--save-debug-rollout-data`` / ``--load-debug-rollout-data``): each step's rollout
saved to a file, and a rollout source that replays those files instead of generating, so that training can be
bisected from rollout without any engine (``--debug-train-only``).

A file is ``torch.save({"rollout_id": step, "samples": [sample as a dict, ...]})`` at ``path.format(rollout_id=step)``,
as slime writes it.

:func:`forge_rollout` is slime's ``slime.rollout.forge_load.generate_rollout`` (that path names it): a rollout
function (``--rollout-function-path``) that returns the samples of such a file, ``--load-forge-rollout-data``, while
everything else runs as usual (engines, weight syncs, offload): slime uses it to measure memory without generating.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from runtime.rollout.generation import sample_metrics
from runtime.rollout.plugins import RolloutFnEvalOutput, RolloutFnTrainOutput
from runtime.rollout.sample import Sample
from runtime.rollout.source import Rollout

logger = logging.getLogger(__name__)


def sample_to_dict(sample: Sample) -> dict[str, Any]:
    return sample.to_dict()


def sample_from_dict(data: dict[str, Any]) -> Sample:
    return Sample.from_dict({"status": Sample.Status.COMPLETED.value, **data})


def save_rollout_data(path_template: str, step: int, samples: list[Sample]) -> Path:
    """Write ``samples`` of step ``step`` to ``path_template.format(rollout_id=step)``; returns the path."""
    path = Path(path_template.format(rollout_id=step))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"rollout_id": step, "samples": [sample_to_dict(s) for s in samples]}, path)
    return path


def load_rollout_data(path_template: str, step: int, *, subsample: float | None = None) -> list[Sample]:
    """The samples :func:`save_rollout_data` wrote for ``step``; ``subsample`` keeps about that fraction of them,
    half from the front and half from the back (as slime's ``--load-debug-rollout-data-subsample``)."""
    path = Path(path_template.format(rollout_id=step))
    if not path.is_file():
        raise FileNotFoundError(f"--load-debug-rollout-data: no rollout data for step {step} at {str(path)!r}")
    samples = [sample_from_dict(d) for d in torch.load(path, weights_only=False)["samples"]]
    if subsample is not None:
        keep = int(len(samples) * subsample) // 2
        samples = samples[:keep] + samples[len(samples) - keep :]
    return samples


class ReplaySource:
    """A rollout source that reads each step's samples from the files of an earlier run (no engine involved)."""

    def __init__(self, path_template: str, *, subsample: float | None = None, reward_key: str | None = None):
        self.path_template, self.subsample, self.reward_key = path_template, subsample, reward_key

    def start(self, step: int) -> None:
        pass

    def get(self, step: int) -> Rollout:
        samples = load_rollout_data(self.path_template, step, subsample=self.subsample)
        metrics = {**sample_metrics(samples, reward_key=self.reward_key), "rollout/replayed_samples": len(samples)}
        return Rollout(step, samples, metrics)

    def pause(self) -> None:
        pass

    def resume(self, version: int) -> None:
        pass

    def commit(self, rollout: Rollout) -> None:
        pass

    def close(self) -> None:
        pass


def forge_path(template: str, rollout_id: int, *, evaluation: bool) -> Path | None:
    """The file slime's forge rollout reads for ``rollout_id``: ``template`` itself when it has no ``{rollout_id}``
    (every rollout replays it; evaluation replays nothing), else ``template.format(rollout_id=...)`` with
    ``eval_<id>`` for evaluation; a training rollout without its file falls back to rollout 0's. None when there is
    none."""
    if "{rollout_id}" not in template:
        return None if evaluation else Path(template)
    path = Path(template.format(rollout_id=f"eval_{rollout_id}" if evaluation else rollout_id))
    if path.is_file() or evaluation:
        return path if path.is_file() else None
    fallback = Path(template.format(rollout_id=0))
    if fallback.is_file():
        logger.info("forge rollout: %s missing, replaying %s", path, fallback)
        return fallback
    return None


def forge_rollout(
    args: Any, rollout_id: int, data_source: Any, evaluation: bool = False
) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """slime's ``forge_load.generate_rollout``: the saved samples of ``--load-forge-rollout-data``, in their groups
    (``group_index``), with their rewards; in evaluation the ``eval_<id>`` file's as the dataset ``forge_eval`` (or
    nothing)."""
    template = args.load_forge_rollout_data
    if not template:
        raise ValueError("slime.rollout.forge_load.generate_rollout needs --load-forge-rollout-data")
    path = forge_path(template, rollout_id, evaluation=evaluation)
    if evaluation:
        if path is None:
            return RolloutFnEvalOutput(data={})
        samples = [sample_from_dict(d) for d in torch.load(path, weights_only=False)["samples"]]
        key = args.eval_reward_key or args.reward_key
        rewards = [0.0 if s.reward is None else float(s.reward[key] if key else s.reward) for s in samples]
        truncated = [s.status == Sample.Status.TRUNCATED for s in samples]
        return RolloutFnEvalOutput(
            data={"forge_eval": {"rewards": rewards, "truncated": truncated, "samples": samples}}
        )
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"--load-forge-rollout-data {template!r}: no saved rollout for rollout {rollout_id} (nor rollout 0)"
        )
    groups: dict[Any, list[Sample]] = {}
    for d in torch.load(path, weights_only=False)["samples"]:
        sample = sample_from_dict(d)
        groups.setdefault(sample.group_index, []).append(sample)
    return RolloutFnTrainOutput(samples=list(groups.values()))
