"""Per-token policy-gradient losses: PPO clip (clip-higher, dual clip), GSPO and CISPO.

Each returns ``(loss, clipped)``: the per-token loss to minimise (before aggregation) and a bool tensor
saying where clipping took the token's gradient away (PPO, GSPO) or truncated its weight (CISPO).
"""

import torch
from torch import Tensor

from rlcore._checks import check_mask, check_same_shape, check_tensor, masked_fill_zero
from rlcore.losses._common import upcast, zero_masked


def _check_policy_inputs(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor) -> None:
    check_tensor("log_probs", log_probs, floating=True)
    check_tensor("old_log_probs", old_log_probs, floating=True)
    check_tensor("advantages", advantages, floating=True)
    check_same_shape(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages)


def _check_eps(name: str, value: float) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
        raise ValueError(f"{name} must be a non-negative number, got {value!r}")
    return float(value)


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, *, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) and where the clipped branch is the larger one."""
    unclipped = -advantages * ratio
    clipped_branch = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return torch.maximum(unclipped, clipped_branch), clipped_branch > unclipped


def ppo_clip(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    *,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    dual_clip: float | None = None,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO's clipped surrogate per token, with DAPO's clip-higher and the dual clip of Ye et al. (2019).

    ``r = exp(log_probs - old_log_probs)``; the loss is ``max(-A r, -A clip(r, 1 - eps_clip, 1 + eps_clip_high))``
    and, with ``dual_clip = c``, ``min(that, -c A)`` where ``A < 0``, exactly as slime's ``compute_policy_loss``.

    Args:
        log_probs: [...] current policy log-probs (the gradient flows through these).
        old_log_probs: [...] log-probs of the policy that sampled the tokens.
        advantages: [...] per-token advantages.
        eps_clip: lower clip range, ``r >= 1 - eps_clip``.
        eps_clip_high: upper clip range ``r <= 1 + eps_clip_high``; ``None`` means ``eps_clip``.
        dual_clip: ``c > 1`` bounds the loss of negative-advantage tokens by ``-c A``; ``None`` turns it off.
        mask: [...] bool, valid tokens, or ``None``. With it the inputs must be finite where it is True and the
            others may hold anything, NaN included: they are zeroed first, so ``loss`` and ``clipped`` are 0 /
            False there and ``log_probs`` gets gradient 0 there. Without it the function is purely elementwise
            and a NaN input gives a NaN loss, and a NaN gradient, at its own position only.

    Returns:
        ``(loss, clipped)``, both [...]: the per-token loss (float32, float64 for float64 inputs) and a bool
        tensor, True where clipping zeroed the token's gradient. Unlike slime's ``pg_clipfrac``, which only
        counts the PPO clip, ``clipped`` also counts tokens held by the dual clip, since those get no
        gradient either.
    """
    _check_policy_inputs(log_probs, old_log_probs, advantages)
    eps_low = _check_eps("eps_clip", eps_clip)
    eps_high = eps_low if eps_clip_high is None else _check_eps("eps_clip_high", eps_clip_high)
    if dual_clip is not None and not (isinstance(dual_clip, int | float) and dual_clip > 1.0):
        raise ValueError(f"dual_clip must be a number > 1 (or None), got {dual_clip!r}")
    log_probs, old_log_probs, advantages = zero_masked(
        mask, log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages
    )
    ratio = torch.exp(log_probs - old_log_probs)
    loss, clipped = _clipped_surrogate(ratio, advantages, eps_low=eps_low, eps_high=eps_high)
    if dual_clip is not None:
        dual_bound = -float(dual_clip) * advantages
        held = (advantages < 0) & (dual_bound < loss)
        loss = torch.where(held, dual_bound, loss)
        clipped = clipped | held
    return loss, clipped


def sequence_log_ratio(log_probs: Tensor, old_log_probs: Tensor, mask: Tensor) -> Tensor:
    """[B] mean over each sample's valid tokens of ``log_probs - old_log_probs`` (0 for a sample with none)."""
    diff = masked_fill_zero(upcast(log_probs) - upcast(old_log_probs), mask)
    return diff.sum(-1) / mask.sum(-1).clamp_min(1)


def gspo(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
) -> tuple[Tensor, Tensor]:
    """GSPO (Zheng et al., 2025) in its GSPO-token form, per token.

    The sequence ratio ``s_i = exp(mean over valid t of (log_probs - old_log_probs))`` replaces PPO's token
    ratio. Each token uses ``r_it = sg(s_i) * exp(log_probs_it - sg(log_probs_it))``: its value is ``s_i``
    and ``d r_it / d log_probs_it = s_i``, so with per-token advantages the gradient can differ per token.
    With one advantage per sequence and ``seq_mean_token_mean`` aggregation the gradient equals that of
    slime's GSPO, which differentiates ``s_i`` itself (every token gets ``s_i / |y_i|``).
    Clipping is PPO's, on ``s_i``: GSPO's ranges are small (the paper uses 3e-4 / 4e-4).

    Args:
        log_probs: [B, T] current policy log-probs.
        old_log_probs: [B, T] log-probs of the sampling policy.
        advantages: [B, T] per-token advantages (usually one value broadcast over each sample).
        mask: [B, T] bool, valid tokens; the sequence mean runs over these only.
        eps_clip: lower clip range on ``s_i``.
        eps_clip_high: upper clip range; ``None`` means ``eps_clip``.

    Returns:
        ``(loss, clipped)``, both [B, T]: per-token loss (0 at masked positions, whose values, NaN included,
        never reach the result or its gradient) and a bool tensor, True at valid tokens whose sequence ratio
        was clipped on the advantage's side.
    """
    _check_policy_inputs(log_probs, old_log_probs, advantages)
    check_tensor("log_probs", log_probs, ndim=2)
    check_mask(mask, like=log_probs)  # required here: zero_masked would take None for "no mask"
    log_probs, old_log_probs, advantages = zero_masked(
        mask, log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages
    )
    eps_low = _check_eps("eps_clip", eps_clip)
    eps_high = eps_low if eps_clip_high is None else _check_eps("eps_clip_high", eps_clip_high)
    seq_ratio = torch.exp(sequence_log_ratio(log_probs, old_log_probs, mask)).detach()
    token_ratio = seq_ratio[:, None] * torch.exp(log_probs - log_probs.detach())
    loss, clipped = _clipped_surrogate(token_ratio, advantages, eps_low=eps_low, eps_high=eps_high)
    return masked_fill_zero(loss, mask), clipped & mask


def cispo(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    *,
    eps_clip_high: float,
    eps_clip: float | None = None,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4-5) per token: ``-sg(clamp(r, 1 - eps_clip, 1 + eps_clip_high)) * A *
    log_probs``.

    The importance weight is truncated under stop-gradient, so, unlike PPO, a clipped token keeps its
    gradient ``-clamp(r, ...) * A``. With ``eps_clip=None`` there is no lower bound (the paper's form); with a
    number the weight is also held at ``1 - eps_clip`` from below, as slime's ``compute_cispo_loss`` does.

    Args:
        log_probs: [...] current policy log-probs.
        old_log_probs: [...] log-probs of the sampling policy.
        advantages: [...] per-token advantages.
        eps_clip_high: upper truncation ``r <= 1 + eps_clip_high``.
        eps_clip: lower truncation ``r >= 1 - eps_clip``, or ``None`` for none.
        mask: [...] bool, valid tokens, or ``None``; as in ``ppo_clip``: masked positions are zeroed first and get
            loss 0, ``clipped`` False and gradient 0 whatever they hold.

    Returns:
        ``(loss, clipped)``, both [...]: the per-token loss (its value is a surrogate, its gradient is the
        point) and a bool tensor, True where the weight was truncated.
    """
    _check_policy_inputs(log_probs, old_log_probs, advantages)
    eps_high = _check_eps("eps_clip_high", eps_clip_high)
    low = None if eps_clip is None else 1.0 - _check_eps("eps_clip", eps_clip)
    log_probs, old_log_probs, advantages = zero_masked(
        mask, log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages
    )
    ratio = torch.exp(log_probs - old_log_probs).detach()
    weight = ratio.clamp(min=low, max=1.0 + eps_high)
    clipped = ratio > 1.0 + eps_high
    if low is not None:
        clipped = clipped | (ratio < low)
    return -weight * advantages * log_probs, clipped


def opsm_keep(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, *, delta: float) -> Tensor:
    """Off-policy sequence masking (slime's ``--use-opsm``): which tokens keep their policy loss.

    A token is dropped when its advantage is negative and its sequence has drifted from the sampling policy:
    ``mean over valid t of (old_log_probs - log_probs) > delta`` (a sequence-level KL(old || new) estimate).

    Args:
        log_probs: [B, T] current policy log-probs (read without gradient).
        old_log_probs: [B, T] log-probs of the sampling policy.
        advantages: [B, T] per-token advantages.
        mask: [B, T] bool, valid tokens.
        delta: the threshold, >= 0.

    Returns:
        [B, T] bool: True where the token keeps its loss (always False at masked positions).
    """
    _check_policy_inputs(log_probs, old_log_probs, advantages)
    check_tensor("log_probs", log_probs, ndim=2)
    check_mask(mask, like=log_probs)
    threshold = _check_eps("delta", delta)
    log_probs, old_log_probs, advantages = zero_masked(
        mask, log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages
    )
    seq_kl = -sequence_log_ratio(log_probs.detach(), old_log_probs.detach(), mask)
    drop = (advantages < 0) & (seq_kl > threshold)[:, None]
    return mask & ~drop
