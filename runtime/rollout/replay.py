"""Debug and replay (slime's ``--save-debug-rollout-data`` / ``--load-debug-rollout-data``): each step's rollout
saved to a file, and a rollout source that replays those files instead of generating, so that training can be
bisected from rollout without any engine (``--debug-train-only``).

A file is ``torch.save({"rollout_id": step, "samples": [sample as a dict, ...]})`` at ``path.format(rollout_id=step)``,
as slime writes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from runtime.rollout.generation import sample_metrics
from runtime.rollout.sample import Sample
from runtime.rollout.source import Rollout


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
