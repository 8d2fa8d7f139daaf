"""Plain torch versions of the kernels' operations, the ones the kernels are tested against.

They materialise everything ([N, V] log-probabilities and probabilities) and compute in the input's dtype promoted
to at least float32, so float64 inputs give a float64 reference. Differentiable through ordinary autograd.
"""

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from rlcore import keys
from rlcore._checks import masked_fill_zero
from rlcore.losses import LossConfig, Normalizer, aggregate, mismatch_weights, rl_loss


def logprobs_entropy(
    logits: Tensor, targets: Tensor, *, temperature: float = 1.0, with_entropy: bool = True
) -> tuple[Tensor, Tensor | None]:
    """``log_softmax(logits / T)`` at ``targets`` and the entropy of ``softmax(logits / T)``.

    Args:
        logits: [N, V] full-vocabulary logits (any floating dtype).
        targets: [N] integer ids in ``[0, V)``.

    Returns:
        ``(log_probs [N], entropy [N] or None)`` in ``logits``' dtype promoted to at least float32.
    """
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    log_p = torch.log_softmax(z, dim=-1)
    log_probs = log_p.gather(-1, targets.long()[:, None]).squeeze(-1)
    if not with_entropy:
        return log_probs, None
    p = log_p.exp()
    # 0 * log 0 = 0: columns with no probability add nothing. Masking log_p (not the product) keeps the gradient
    # finite there too.
    entropy = -(p * torch.where(p > 0, log_p, torch.zeros((), dtype=p.dtype))).sum(dim=-1)
    return log_probs, entropy


def linear_logprobs_entropy(
    hidden: Tensor, weight: Tensor, targets: Tensor, *, temperature: float = 1.0, with_entropy: bool = True
) -> tuple[Tensor, Tensor | None]:
    """:func:`logprobs_entropy` of ``hidden [N, H] @ weight [V, H]^T`` (the logits are materialised)."""
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    logits = hidden.to(dtype) @ weight.to(dtype).T
    return logprobs_entropy(logits, targets, temperature=temperature, with_entropy=with_entropy)


def linear_rl_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    td: TensorDictBase,
    cfg: LossConfig,
    *,
    norm: Normalizer | None = None,
    temperature: float = 1.0,
    cispo_eps_clip: float | None = None,
) -> tuple[Tensor, TensorDict]:
    """``rl_loss`` on :func:`linear_logprobs_entropy` of the materialised logits, by autograd: what
    ``rlcore.kernels.linear_rl_loss`` is tested against (give float64 ``hidden`` and ``weight`` for a float64
    reference; ``td``'s tensors are used as they are).

    ``cispo_eps_clip`` adds CISPO's lower truncation, which ``rl_loss`` does not have yet: the policy term is swapped
    for ``-sg(clamp(ratio, 1 - cispo_eps_clip, 1 + eps_high)) * A * log_probs`` under the same mismatch weights and
    aggregation. Returns ``(loss, metrics)`` as ``rl_loss``.
    """
    log_probs, entropy = linear_logprobs_entropy(hidden, weight, targets, temperature=temperature)
    mask = td.get(keys.MASK)
    full = td.clone(recurse=False)
    full.set(keys.LOG_PROBS, log_probs.view(mask.shape))
    full.set(keys.ENTROPY, entropy.view(mask.shape))
    loss, metrics = rl_loss(full, cfg, norm=norm)
    if cispo_eps_clip is None:
        return loss, metrics
    norm = Normalizer.of(mask) if norm is None else norm
    lp = masked_fill_zero(full.get(keys.LOG_PROBS), mask)
    old = masked_fill_zero(td.get(keys.OLD_LOG_PROBS).to(lp.dtype), mask)
    advantages = masked_fill_zero(td.get(keys.ADVANTAGES).to(lp.dtype), mask)
    ratio = torch.exp(lp - old).detach()
    eps_high = cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high
    one_sided = -ratio.clamp(max=1.0 + eps_high) * advantages * lp
    two_sided = -ratio.clamp(min=1.0 - cispo_eps_clip, max=1.0 + eps_high) * advantages * lp
    keep = mask
    if cfg.use_tis:
        rollout = masked_fill_zero(td.get(keys.ROLLOUT_LOG_PROBS).to(lp.dtype), mask)
        weights, keep = mismatch_weights(
            old, rollout, mask, mode=cfg.tis_mode, level=cfg.tis_level, low=cfg.tis_clip_low, high=cfg.tis_clip
        )
        one_sided, two_sided = one_sided * weights, two_sided * weights
    swap = aggregate(masked_fill_zero(two_sided - one_sided, keep), mask, mode=cfg.loss_agg_mode, norm=norm)
    return loss + swap, metrics
