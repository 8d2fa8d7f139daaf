"""pass@k of grouped samples (slime's ``--log-passrate``): the unbiased estimator of Chen et al. (2021).

For a prompt with ``n`` samples of which ``c`` are correct (reward exactly 1, as slime counts), pass@k is the chance
that ``k`` samples drawn without replacement hold at least one correct one: ``1 - C(n - c, k) / C(n, k)``. It is
logged for k = 1, 2, 4, ... up to the group size, averaged over the prompts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from runtime.rollout.filters import reward_value
from runtime.rollout.sample import Sample


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with ``n`` samples, ``c`` of them correct (``1 <= k <= n``)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def passrate_metrics(samples: Sequence[Sample], *, prefix: str, reward_key: str | None = None) -> dict[str, float]:
    """``{prefix}/pass@k`` for k = 1, 2, 4, ... up to the smallest group's size, averaged over the groups
    (``group_index``); empty for groups of one."""
    groups: dict[object, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.group_index, []).append(sample)
    if not groups:
        return {}
    size = min(len(g) for g in groups.values())
    counts = [(len(g), sum(reward_value(s, reward_key) == 1 for s in g)) for g in groups.values()]
    metrics = {}
    k = 1
    while k <= size and size > 1:
        metrics[f"{prefix}/pass@{k}"] = sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)
        k *= 2
    return metrics
