"""Token-level estimators: GAE, REINFORCE++ returns and on-policy distillation."""

import torch
from torch import Tensor

from rlcore._checks import masked_fill_zero
from rlcore.advantages._checks import (
    check_non_negative,
    check_rewards,
    check_token_mask,
    check_token_tensor,
    check_unit_interval,
    compute_dtype,
)
from rlcore.advantages._scan import compact, compaction_index, discounted_reverse_cumsum, expand


def gae(
    token_rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0, lam: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al., 2016) over the valid tokens of each response.

    ``delta_t = r_t + gamma * V_{t'} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t'}``, where ``t'`` is the next
    *valid* token after ``t``: masked positions (padding, and tool output in the middle of a multi-turn response)
    are skipped entirely, as verl does for multi-turn rollouts, and the value after the last valid token is 0.
    Rewards and values at masked positions are ignored (they may be NaN). Vectorised: valid tokens are packed to
    the left and the reverse scan is a blocked matmul (see :mod:`rlcore.advantages._scan`), no loop over tokens.

    slime's ``chunked_gae`` scans every position of the response; it has no holes in its masks at this point, so
    the results agree whenever the mask is a prefix.

    Args:
        token_rewards: [B, T] floating, the reward of each token (for RLHF: the sequence reward on the last valid
            token, minus a KL penalty per token).
        values: [B, T] floating, the critic's value of the state before each token.
        mask: [B, T] bool, the tokens the scan runs over.
        gamma: discount in [0, 1].
        lam: GAE lambda in [0, 1].

    Returns:
        ``(advantages, returns)``, each [B, T] in the promoted dtype of the inputs (at least float32), with
        ``returns = advantages + values`` on valid tokens and 0 at masked positions.
    """
    check_token_mask(mask)
    check_token_tensor("token_rewards", token_rewards, mask)
    check_token_tensor("values", values, mask)
    gamma = check_unit_interval("gamma", gamma)
    lam = check_unit_interval("lam", lam)
    dtype = compute_dtype(token_rewards, values)

    index = compaction_index(mask)
    packed_rewards = compact(token_rewards.to(dtype), index)
    packed_values = compact(values.to(dtype), index)
    # Packed positions past the last valid token hold 0, so the next value of the last valid token is 0.
    next_values = torch.nn.functional.pad(packed_values[:, 1:], (0, 1))
    deltas = packed_rewards + gamma * next_values - packed_values
    packed_advantages = discounted_reverse_cumsum(deltas, discount=gamma * lam)
    return expand(packed_advantages, index), expand(packed_advantages + packed_values, index)


def reinforce_plus_plus(rewards: Tensor, kl: Tensor, mask: Tensor, *, kl_coef: float, gamma: float = 1.0) -> Tensor:
    """REINFORCE++ returns (Hu, 2025): discounted sums of token rewards ``-kl_coef * kl`` plus the sample reward.

    As slime's ``get_reinforce_plus_plus_returns``: each valid token gets the reward ``-kl_coef * kl_t`` and the last
    valid token also gets the sample's scalar reward; the result is ``G_t = sum_{s >= t} gamma^(s - t) r_s``. slime
    then uses ``G`` as the advantage (whitened by ``normalize_advantages``).

    Deliberate difference: the discount runs over valid tokens only, as :func:`gae` does, so tool-output tokens in
    the middle of a multi-turn response do not discount the reward (slime counts every position). With the default
    ``gamma=1`` the two agree. A sample with no valid token gets all zeros.

    Args:
        rewards: [B] floating, one scalar reward per sample.
        kl: [B, T] floating, a per-token KL estimate to the reference policy.
        mask: [B, T] bool.
        kl_coef: the KL penalty coefficient, >= 0.
        gamma: discount in [0, 1].

    Returns:
        [B, T] returns in the promoted dtype of the inputs (at least float32), 0 at masked positions.
    """
    check_token_mask(mask)
    check_rewards(rewards, batch=mask.shape[0])
    check_token_tensor("kl", kl, mask)
    kl_coef = check_non_negative("kl_coef", kl_coef)
    gamma = check_unit_interval("gamma", gamma)
    dtype = compute_dtype(rewards, kl)

    index = compaction_index(mask)
    packed = compact(-kl_coef * kl.to(dtype), index)
    num_valid = mask.sum(dim=1)
    last = (num_valid - 1).clamp(min=0)[:, None]
    packed = packed.scatter_add(1, last, torch.where(num_valid > 0, rewards.to(dtype), 0.0)[:, None])
    return expand(discounted_reverse_cumsum(packed, discount=gamma), index)


def distillation(teacher_log_probs: Tensor, log_probs: Tensor, mask: Tensor) -> Tensor:
    """On-policy distillation advantage: the negative reverse KL per sampled token, ``log pi_T - log pi``.

    The student samples, the teacher scores the same tokens, and each token is rewarded by how much more likely the
    teacher finds it (Agarwal et al., 2024; Thinking Machines' on-policy distillation, discount 0). This is the
    term slime's ``apply_opd_kl_to_advantages`` adds with coefficient ``opd_kl_coef`` (default 1).

    Args:
        teacher_log_probs: [B, T] floating, the teacher's log-probs of the sampled tokens.
        log_probs: [B, T] floating, the student's (sampling policy's) log-probs of the same tokens.
        mask: [B, T] bool.

    Returns:
        [B, T] in the promoted dtype (at least float32), 0 at masked positions.
    """
    check_token_mask(mask)
    check_token_tensor("teacher_log_probs", teacher_log_probs, mask)
    check_token_tensor("log_probs", log_probs, mask)
    dtype = compute_dtype(teacher_log_probs, log_probs)
    return masked_fill_zero(teacher_log_probs.to(dtype) - log_probs.to(dtype), mask)
