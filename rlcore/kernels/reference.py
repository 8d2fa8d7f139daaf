"""Plain torch versions of the kernels' operations, the ones the kernels are tested against.

They materialise everything ([N, V] log-probabilities and probabilities) and compute in the input's dtype promoted
to at least float32, so float64 inputs give a float64 reference. Differentiable through ordinary autograd.
"""

import torch
from torch import Tensor


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
