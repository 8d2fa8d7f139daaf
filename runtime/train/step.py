"""One rollout's training on one trainer rank: its shard, the log-probs it needs, its advantages, the optimizer steps.

This is what makes a step one trip: the driver hands every rank the same rollout batch (one object ref) with the
sequence-level advantages already in it (:func:`rlcore.advantages.sequence_advantages`, computed over the whole
batch because a shard can split a group); each rank cuts its own shard, recomputes old and reference log-probs,
adds the per-token terms (KL in the reward, whitening over the data-parallel group) and trains. Nothing returns to
the driver but metrics.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
from tensordict import TensorDict

from rlcore import keys
from rlcore.advantages import AdvantageConfig, compute, whiten
from rlcore.distributed import all_reduce
from runtime.hooks import Hook
from runtime.train.backends.base import TrainBackend
from runtime.train.batch import (
    PROMPT_LENGTHS,
    RESPONSE_LENGTHS,
    RESPONSE_TOKENS,
    ROLLOUT_INDEX,
    TOKENS,
    shard_rollouts,
    shard_rows,
)
from runtime.train.hooks import TrainHooks, apply_rollout_data, kl_rows, rollout_data_view

# What a model's forward reads from a batch: the sequences and where each response sits.
_MODEL_INPUT_KEYS = (TOKENS, PROMPT_LENGTHS, RESPONSE_LENGTHS, RESPONSE_TOKENS)


def _global_mean(x: torch.Tensor, mask: torch.Tensor, group: dist.ProcessGroup | None) -> float:
    stats = all_reduce(torch.stack([x[mask].sum().double(), mask.sum().double()]), group=group)
    return float(stats[0] / stats[1].clamp(min=1))


def _global_abs_mean(x: torch.Tensor, mask: torch.Tensor, group: dist.ProcessGroup | None) -> float:
    return _global_mean(x.abs(), mask, group)


QUARTERS = (25, 50, 75, 100)


def correct_sample_sums(
    rewards: torch.Tensor,
    response_lengths: torch.Tensor,
    log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    max_response_len: int,
) -> torch.Tensor:
    """slime's ``--log-correct-samples`` counts over the correct samples (reward exactly 1) of a shard, to be summed
    over ranks: ``[6]`` float64, how many of their response lengths fall in each quarter of ``max_response_len``
    (``(0, 25%]``, ``(25%, 50%]``, ``(50%, 75%]``, ``(75%, max]``), how many there are, and the sum of their token
    means of ``-log_probs`` over ``mask``. rewards and response_lengths ``[B]``, log_probs and mask ``[B, T]``."""
    correct = rewards == 1
    cuts = torch.tensor([max_response_len * q / 100 for q in QUARTERS[:-1]] + [max_response_len], dtype=torch.float64)
    quarter = torch.searchsorted(cuts, response_lengths[correct].double(), right=False)
    counts = torch.bincount(quarter.clamp(max=len(QUARTERS)), minlength=len(QUARTERS) + 1)[: len(QUARTERS)]
    m = mask[correct]
    nll = torch.where(m, -log_probs[correct].double(), 0.0).sum(-1) / m.sum(-1).clamp(min=1)
    return torch.cat([counts.double(), torch.tensor([float(correct.sum()), float(nll.sum())], dtype=torch.float64)])


def correct_sample_metrics(sums: torch.Tensor) -> dict[str, float]:
    """The metrics of :func:`correct_sample_sums` summed over ranks: ``rollout/correct_length/p25`` .. ``p100``, the
    fraction of correct samples in each quarter (slime's names), and ``rollout/correct_entropy``, their mean token
    mean of ``-log_prob`` (0 when none is correct)."""
    n = float(sums[len(QUARTERS)])
    out = {f"rollout/correct_length/p{q}": float(sums[i]) / (n + 1e-9) for i, q in enumerate(QUARTERS)}
    out["rollout/correct_entropy"] = float(sums[len(QUARTERS) + 1]) / n if n else 0.0
    return out


def train_rollout(
    backend: TrainBackend,
    batch: TensorDict,
    *,
    global_batch_size: int,
    adv_cfg: AdvantageConfig,
    use_rollout_log_probs: bool = False,
    train_actor: bool = True,
    rollout_id: int | None = None,
    hooks: TrainHooks | None = None,
    resolved: dict[str, Hook] | None = None,
) -> dict[str, float]:
    """Train ``backend`` on its shard of the whole rollout ``batch``; return the step's metrics (every rank alike).

    ``global_batch_size`` counts rollouts: when a custom generate function split rollouts into several rows
    (``ROLLOUT_INDEX``), each optimizer step takes that many whole rollouts, whatever their rows.

    ``use_rollout_log_probs`` (slime's ``--use-rollout-logprobs``): the engine's log-probs stand for the old ones
    in the advantages and the policy ratio, instead of the trainer's recompute.

    With a critic (the backend's forward writes ``values``; slime's ``ppo``) the critic trains first, as slime's
    critic group does: its values before the update are the actor's GAE baseline and the old values of the value
    loss, and its targets are the GAE returns of the rewards alone (slime's critic runs with ``--kl-coef`` 0 and
    without distillation). ``train_actor`` False (slime's ``--num-critic-only-steps``) trains the critic only.

    ``batch`` holds the batch contract's rollout keys plus ``sequence_advantages`` for estimators with a group
    baseline. Metrics: the backend's training metrics plus ``advantage_abs_mean`` over the valid tokens of the
    whole batch, and ``perf/log_probs_time``, this rank's seconds in the old/reference log-prob forward.

    slime's trainer-side hooks (``hooks``, imported as ``resolved``): ``--custom-advantage-function-path`` computes
    the advantages in place of ``adv_cfg``'s estimator (whitened after it under ``--normalize-advantages``), and
    ``--rollout-data-postprocess-path`` sees (and may rewrite) the shard's advantages and loss masks before the
    optimizer steps; with ``--loss-type sft_loss`` or ``--disable-compute-advantages-and-returns`` no advantages
    are computed (and for SFT no log-probs).
    """
    hooks = hooks or TrainHooks()
    resolved = resolved or {}
    dp_rank, dp_size = backend.dp_info()
    group = backend.dp_group()
    n = batch.batch_size[0]
    if ROLLOUT_INDEX in batch.keys() and n and int(batch[ROLLOUT_INDEX].max()) + 1 != n:
        # Rollouts split into several rows: steps and shards hold whole rollouts, so their row counts vary.
        rows, per_step_rows = shard_rollouts(
            batch[ROLLOUT_INDEX], global_batch_size=global_batch_size, dp_rank=dp_rank, dp_size=dp_size
        )
    else:
        rows = shard_rows(n, global_batch_size=global_batch_size, dp_rank=dp_rank, dp_size=dp_size)
        per_step_rows = global_batch_size // dp_size
    shard = batch[rows]
    log_probs_time = None
    if hooks.loss_type != "sft_loss":
        start = time.perf_counter()
        shard.update(backend.compute_log_probs(shard))  # (CPU tensors back: the device has finished)
        log_probs_time = time.perf_counter() - start
        if use_rollout_log_probs:
            shard.set(keys.OLD_LOG_PROBS, shard[keys.ROLLOUT_LOG_PROBS])
    custom_advantages = resolved.get("custom_advantage_function_path")
    if custom_advantages is not None:
        data = rollout_data_view(shard)
        data["kl"] = kl_rows(shard, kl_coef=adv_cfg.kl_coef, kl_kind=adv_cfg.kl_kind)
        custom_advantages(hooks.args, data)
        shard = apply_rollout_data(custom_advantages, shard, data, names=("advantages", "returns"))
        if adv_cfg.whiten:
            shard.set(keys.ADVANTAGES, whiten(shard[keys.ADVANTAGES], shard[keys.MASK], group=group))
    elif hooks.compute_advantages:
        shard = compute(shard, adv_cfg, group=group)
    postprocess = resolved.get("rollout_data_postprocess_path")
    if postprocess is not None:
        data = rollout_data_view(shard)
        postprocess(hooks.args, rollout_id, data)
        names = tuple(n for n in ("advantages", "returns") if n in data) + ("loss_masks",)
        shard = apply_rollout_data(postprocess, shard, data, names=names)
    metrics: dict[str, float] = {}
    if keys.VALUES in shard.keys():
        metrics.update(backend.train_critic(critic_targets(shard, adv_cfg), per_step_rows=per_step_rows))
    if train_actor:
        metrics.update(backend.train(shard, per_step_rows=per_step_rows, rollout_id=rollout_id))
    if log_probs_time is not None:
        metrics["perf/log_probs_time"] = log_probs_time
    if keys.ADVANTAGES in shard.keys():
        metrics["advantage_abs_mean"] = _global_abs_mean(shard[keys.ADVANTAGES], shard[keys.MASK], group)
    if getattr(hooks.args, "log_correct_samples", False) and keys.OLD_LOG_PROBS in shard.keys():
        sums = correct_sample_sums(
            shard[keys.REWARDS],
            shard[RESPONSE_LENGTHS],
            shard[keys.OLD_LOG_PROBS],
            shard[keys.MASK],
            max_response_len=hooks.args.rollout_max_response_len,
        )
        metrics.update(correct_sample_metrics(all_reduce(sums, group=group)))
    if adv_cfg.opd_kl_coef > 0:
        # slime's opd_reverse_kl: the student's log-prob minus the teacher's, over the valid tokens (its mean).
        reverse_kl = shard[keys.OLD_LOG_PROBS] - shard[keys.TEACHER_LOG_PROBS]
        metrics["opd_reverse_kl"] = _global_mean(reverse_kl, shard[keys.MASK], group)
    return metrics


def critic_targets(shard: TensorDict, adv_cfg: AdvantageConfig) -> TensorDict:
    """What the critic trains on: ``mask``, ``old_values`` (the critic's ``values`` of ``shard``) and ``returns``,
    the GAE returns of the rewards without the KL penalty or distillation (as slime's critic computes them)."""
    reward_only = dataclasses.replace(adv_cfg, kl_coef=0.0, opd_kl_coef=0.0, whiten=False)
    targets = compute(
        shard.select(keys.MASK, keys.REWARDS, keys.VALUES, *_MODEL_INPUT_KEYS, strict=False), reward_only
    )
    targets.set(keys.OLD_VALUES, targets.pop(keys.VALUES))
    targets.pop(keys.ADVANTAGES)
    return targets
