"""Sequence-level estimators with group baselines (GRPO, Dr. GRPO, RLOO, REINFORCE++-baseline) and broadcasting.

Groups are given by ``group_ids`` holding arbitrary integers; groups may differ in size and need not be contiguous.
Group statistics are one ``index_add`` each over ``torch.unique(..., return_inverse=True)``: no loop over samples.
"""

import torch
from torch import Tensor

from rlcore._checks import check_tensor, masked_fill_zero
from rlcore.advantages._checks import (
    check_group_ids,
    check_non_negative,
    check_positive,
    check_rewards,
    check_token_mask,
    check_token_tensor,
    compute_dtype,
)


def _groups(group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(ids, inverse, counts)``: the distinct ids, each sample's group index into them, and each group's size."""
    ids, inverse = torch.unique(group_ids, return_inverse=True)
    return ids, inverse, torch.bincount(inverse, minlength=ids.numel())


def _group_sum(x: Tensor, inverse: Tensor, num_groups: int) -> Tensor:
    return x.new_zeros(num_groups).index_add_(0, inverse, x)


def _require_pairs(ids: Tensor, counts: Tensor, *, why: str) -> None:
    lonely = counts < 2
    if bool(lonely.any()):
        first = int(lonely.nonzero()[0])
        raise ValueError(
            f"group_ids: group {int(ids[first])} has {int(counts[first])} sample(s) but {why} needs at least 2 per "
            f"group ({int(lonely.sum())} of {ids.numel()} groups are too small)"
        )


def _centered(rewards: Tensor, inverse: Tensor, counts: Tensor) -> Tensor:
    mean = _group_sum(rewards, inverse, counts.numel()) / counts
    return rewards - mean[inverse]


def grpo(rewards: Tensor, group_ids: Tensor, *, std_normalize: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO advantage (Shao et al., 2024): each reward minus its group's mean, over the group's std when asked.

    Matches slime's group reward normalisation: ``(r - mean) / (std + eps)`` with ``std`` the unbiased sample
    standard deviation (``torch.std``). ``std_normalize=False`` is Dr. GRPO (Liu et al., 2025): mean-centred only.

    Args:
        rewards: [B] floating, one scalar reward per sample.
        group_ids: [B] integer, samples of the same prompt share an id; any values, groups of any sizes.
        std_normalize: divide by the group's std. A group of one sample then has no std and raises ``ValueError``
            (slime turns std normalisation off when ``n_samples_per_prompt`` is 1); without it, such a group gets 0.
        eps: added to the std, > 0: a group whose rewards are all equal has std 0 and centred rewards 0, and
            ``eps`` is what keeps its advantages at 0 instead of 0 / 0 = NaN (``ValueError`` for ``eps <= 0``,
            also with ``std_normalize=False``, so that a config is valid or not whatever the switch).

    Returns:
        [B] advantages in the promoted dtype (at least float32).
    """
    check_rewards(rewards)
    check_group_ids(group_ids, rewards)
    eps = check_positive("eps", eps)
    ids, inverse, counts = _groups(group_ids)
    centered = _centered(rewards.to(compute_dtype(rewards)), inverse, counts)
    if not std_normalize:
        return centered
    _require_pairs(ids, counts, why="grpo with std_normalize=True (the unbiased std)")
    std = (_group_sum(centered.square(), inverse, counts.numel()) / (counts - 1)).sqrt()
    return centered / (std[inverse] + eps)


def rloo(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """REINFORCE leave-one-out (Kool et al., 2019; Ahmadian et al., 2024): reward minus the mean of the others.

    ``r_i - (sum_{j != i} r_j) / (n - 1)``, computed as ``n / (n - 1) * (r_i - mean)``, which is the same number
    without the cancellation of ``sum - r_i``. slime has no RLOO estimator.

    Args:
        rewards: [B] floating.
        group_ids: [B] integer; every group needs at least 2 samples (else ``ValueError``).

    Returns:
        [B] advantages in the promoted dtype (at least float32); they sum to 0 within each group.
    """
    check_rewards(rewards)
    check_group_ids(group_ids, rewards)
    ids, inverse, counts = _groups(group_ids)
    _require_pairs(ids, counts, why="rloo (a leave-one-out baseline)")
    centered = _centered(rewards.to(compute_dtype(rewards)), inverse, counts)
    size = counts.to(centered.dtype)[inverse]
    return centered * (size / (size - 1))


def broadcast(seq_values: Tensor, mask: Tensor) -> Tensor:
    """Spread one value per sample over that sample's valid tokens.

    Args:
        seq_values: [B] floating; must be finite for every sample that has a valid token.
        mask: [B, T] bool.

    Returns:
        [B, T] of ``seq_values``' dtype: ``seq_values[b]`` where ``mask[b, t]``, else 0.
    """
    check_tensor("seq_values", seq_values, ndim=1, floating=True)
    check_token_mask(mask)
    if seq_values.shape[0] != mask.shape[0]:
        raise ValueError(f"seq_values has shape {tuple(seq_values.shape)} but mask has shape {tuple(mask.shape)}")
    spread = seq_values[:, None].expand(mask.shape)
    check_token_tensor("seq_values", spread, mask)
    return masked_fill_zero(spread, mask)


def reinforce_plus_plus_baseline(
    rewards: Tensor, group_ids: Tensor, kl: Tensor, mask: Tensor, *, kl_coef: float
) -> Tensor:
    """REINFORCE++-baseline (Hu et al., 2025): the reward minus its group mean on every token, minus ``kl_coef * kl``.

    As slime: the group mean is subtracted (no std division), the scalar is broadcast over the valid tokens and the
    per-token KL penalty is subtracted without discounting; the paper's global whitening is
    :func:`rlcore.advantages.whiten` (``AdvantageConfig(whiten=True)``, slime's ``--normalize-advantages``). As in
    slime, a group of one sample is allowed: its baseline is its own reward, so only the KL term remains.

    Args:
        rewards: [B] floating.
        group_ids: [B] integer.
        kl: [B, T] floating, a per-token KL estimate to the reference policy.
        mask: [B, T] bool.
        kl_coef: >= 0.

    Returns:
        [B, T] advantages in the promoted dtype (at least float32), 0 at masked positions.
    """
    check_token_mask(mask)
    check_rewards(rewards, batch=mask.shape[0])
    check_group_ids(group_ids, rewards)
    check_token_tensor("kl", kl, mask)
    kl_coef = check_non_negative("kl_coef", kl_coef)
    dtype = compute_dtype(rewards, kl)
    _, inverse, counts = _groups(group_ids)
    centered = _centered(rewards.to(dtype), inverse, counts)
    return masked_fill_zero(centered[:, None] - kl_coef * kl.to(dtype), mask)
