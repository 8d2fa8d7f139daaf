"""Dynamic-sampling filters with slime's signature: ``fn(args, samples, **kwargs) -> DynamicFilterOutput``.

A filter sees one prompt's group of scored samples and says whether the group goes into the training batch
(DAPO's dynamic sampling drops groups whose rewards are all equal: they carry no GRPO signal). The loop keeps
generating groups until ``--rollout-batch-size`` of them pass, so the batch stays full.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from runtime.hooks import Hook, resolve_hook
from runtime.rollout.sample import Sample


@dataclass
class DynamicFilterOutput:
    """A filter's verdict on a group: ``keep``, and when dropped a short ``reason`` that the loop counts."""

    keep: bool
    reason: str | None = None


def reward_value(sample: Sample, key: str | None = None) -> float:
    """The scalar reward of a scored sample: a dict reward's ``key`` entry (``--reward-key``; None: ``"score"``)."""
    reward = sample.reward
    if isinstance(reward, dict):
        key = key or "score"
        if key not in reward:
            raise ValueError(f"sample {sample.index}: dict reward has no {key!r} entry (keys {sorted(reward)})")
        reward = reward[key]
    if reward is None:
        raise ValueError(f"sample {sample.index} has no reward yet; filters run after scoring")
    return float(reward)


def check_reward_nonzero_std(args: Any, samples: Sequence[Sample], **kwargs: Any) -> DynamicFilterOutput:
    """Keep a group whose rewards are not all equal: their unbiased (n - 1) standard deviation is above 1e-6, as in
    slime's filter (``torch.std`` in float64)."""
    if not samples:
        raise ValueError("samples must hold at least one sample of the group, got an empty list")
    key = args.get("reward_key") if isinstance(args, dict) else getattr(args, "reward_key", None)
    rewards = [reward_value(sample, key) for sample in samples]
    keep = len(rewards) > 1 and statistics.stdev(rewards) > 1e-6
    if keep:
        return DynamicFilterOutput(keep=True)
    # The reason names the shared value so that all-correct and all-wrong groups are counted apart.
    return DynamicFilterOutput(keep=False, reason=f"zero_std_{round(rewards[0], 1)}")


FilterFn = Callable[..., DynamicFilterOutput]


FILTER_FLAG = "--dynamic-sampling-filter-path"


class FilterHook(Hook):
    """A filter loaded from its hook flag: a result that is not a verdict is a ``HookFailure`` naming the flag and
    the function (slime's own ``DynamicFilterOutput``, or anything with a bool ``keep``, is one)."""

    def __call__(self, args: Any, samples: Sequence[Sample], **kwargs: Any) -> DynamicFilterOutput:
        out = super().__call__(args, samples, **kwargs)
        if isinstance(out, DynamicFilterOutput):
            return out
        keep = getattr(out, "keep", None)
        # slime's own filter returns a 0-dim torch bool tensor; numpy bools come from numpy-based filters.
        if hasattr(keep, "item"):
            keep = keep.item()
        if not isinstance(keep, bool):
            raise self.wrong_type(out, "DynamicFilterOutput(keep: bool, reason)")
        return DynamicFilterOutput(keep=keep, reason=getattr(out, "reason", None))


def load_filter(path: str, *, flag: str = FILTER_FLAG) -> FilterHook:
    """Load a filter by hook path (``module:function``, ``module.function`` or ``file.py:function``) for ``flag``.

    Raises ``HookError`` when it cannot be loaded; calling it raises ``HookFailure`` when the filter raises or
    returns something that is not a verdict.
    """
    hook = resolve_hook(flag, path)
    return FilterHook(hook.flag, hook.path, hook.fn)


def filter_groups(
    filter_fn: FilterFn | None, args: Any, groups: Sequence[Sequence[Sample]]
) -> tuple[list[list[Sample]], Counter[str]]:
    """Split scored groups into those the filter keeps (in order) and a count of drop reasons.

    With ``filter_fn`` None every group is kept. A drop without a reason is counted as ``"filtered"``.
    The over-sampling loop calls this once per sampling round until it has ``--rollout-batch-size`` groups.
    """
    kept: list[list[Sample]] = []
    dropped: Counter[str] = Counter()
    for group in groups:
        out = DynamicFilterOutput(keep=True) if filter_fn is None else filter_fn(args, list(group))
        if out.keep:
            kept.append(list(group))
        else:
            dropped[out.reason or "filtered"] += 1
    return kept, dropped
