"""How a trainer combines the loss's metrics: over micro-batches and ranks within an optimizer step, then over steps.

Token means (``rl_loss``'s metrics of a micro-batch are its share of the global batch's token mean) add up over
micro-batches and data-parallel ranks; maxima over tokens combine by max. Which metrics are maxima is declared where
they are made (``rlcore.losses.MAX_METRICS``), not read off their names. Over the optimizer steps of one rollout,
means are averaged and maxima stay maxima, so ``ratio_max`` is the largest ratio any step saw, not a mean of per-step
maxima.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from rlcore.losses import MAX_METRICS


def is_max_metric(name: str) -> bool:
    """Whether ``name`` is a maximum over tokens (``rlcore.losses.MAX_METRICS``): it combines by max, not by sum."""
    return name in MAX_METRICS


def sums_and_maxima(micro_batches: Iterable[Mapping[str, object]]) -> tuple[dict[str, float], dict[str, float]]:
    """``(sums, maxima)`` of the metrics of one step's micro-batches (values: numbers or 0-dim tensors): maxima by
    max, everything else summed. Each still needs its reduction over data-parallel ranks (SUM and MAX)."""
    sums: dict[str, float] = {}
    maxima: dict[str, float] = {}
    for metrics in micro_batches:
        for name, value in metrics.items():
            value = float(value)
            if is_max_metric(name):
                maxima[name] = max(maxima.get(name, -math.inf), value)
            else:
                sums[name] = sums.get(name, 0.0) + value
    return sums, maxima


def add_step(totals: dict[str, float], step_metrics: Mapping[str, float], *, steps: int) -> None:
    """Fold one of ``steps`` optimizer steps' metrics into ``totals``: means over the steps, maxima as maxima."""
    for name, value in step_metrics.items():
        if is_max_metric(name):
            totals[name] = max(totals.get(name, -math.inf), value)
        else:
            totals[name] = totals.get(name, 0.0) + value / steps
