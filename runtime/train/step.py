"""One rollout's training on one trainer rank: its shard, the log-probs it needs, its advantages, the optimizer steps.

This is what makes a step one trip: the driver hands every rank the same rollout batch (one object ref) with the
sequence-level advantages already in it (:func:`rlcore.advantages.sequence_advantages`, computed over the whole
batch because a shard can split a group); each rank cuts its own shard, recomputes old and reference log-probs,
adds the per-token terms (KL in the reward, whitening over the data-parallel group) and trains. Nothing returns to
the driver but metrics.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from tensordict import TensorDict

from rlcore import keys
from rlcore.advantages import AdvantageConfig, compute
from runtime.train.backends.base import TrainBackend
from runtime.train.batch import shard_rows


def _global_mean(x: torch.Tensor, mask: torch.Tensor, group: dist.ProcessGroup | None) -> float:
    stats = torch.stack([x[mask].sum().double(), mask.sum().double()])
    if group is not None:
        dist.all_reduce(stats, group=group)
    return float(stats[0] / stats[1].clamp(min=1))


def _global_abs_mean(x: torch.Tensor, mask: torch.Tensor, group: dist.ProcessGroup | None) -> float:
    return _global_mean(x.abs(), mask, group)


def train_rollout(
    backend: TrainBackend,
    batch: TensorDict,
    *,
    global_batch_size: int,
    adv_cfg: AdvantageConfig,
    use_rollout_log_probs: bool = False,
) -> dict[str, float]:
    """Train ``backend`` on its shard of the whole rollout ``batch``; return the step's metrics (every rank alike).

    ``use_rollout_log_probs`` (slime's ``--use-rollout-logprobs``): the engine's log-probs stand for the old ones
    in the advantages and the policy ratio, instead of the trainer's recompute.

    ``batch`` holds the batch contract's rollout keys plus ``sequence_advantages`` for estimators with a group
    baseline. Metrics: the backend's training metrics plus ``advantage_abs_mean`` over the valid tokens of the
    whole batch.
    """
    dp_rank, dp_size = backend.dp_info()
    group = backend.dp_group()
    shard = batch[
        shard_rows(batch.batch_size[0], global_batch_size=global_batch_size, dp_rank=dp_rank, dp_size=dp_size)
    ]
    shard.update(backend.compute_log_probs(shard))
    if use_rollout_log_probs:
        shard.set(keys.OLD_LOG_PROBS, shard[keys.ROLLOUT_LOG_PROBS])
    shard = compute(shard, adv_cfg, group=group)
    metrics = backend.train(shard, per_step_rows=global_batch_size // dp_size)
    metrics["advantage_abs_mean"] = _global_abs_mean(shard[keys.ADVANTAGES], shard[keys.MASK], group)
    if adv_cfg.opd_kl_coef > 0:
        # slime's opd_reverse_kl: the student's log-prob minus the teacher's, over the valid tokens (its mean).
        reverse_kl = shard[keys.OLD_LOG_PROBS] - shard[keys.TEACHER_LOG_PROBS]
        metrics["opd_reverse_kl"] = _global_mean(reverse_kl, shard[keys.MASK], group)
    return metrics
