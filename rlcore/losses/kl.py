"""KL estimators between the current policy and a reference, per token (Schulman's k1, k2, k3)."""

import torch
from torch import Tensor

from rlcore._checks import check_choice, check_same_shape, check_tensor
from rlcore.loss_config import KL_KINDS
from rlcore.losses._common import zero_masked


def approx_kl(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    *,
    kind: str = "k3",
    importance_ratio: Tensor | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi.

    Args:
        log_probs: [...] log pi(a) of the sampled tokens.
        ref_log_probs: [...] log pi_ref(a) of the same tokens.
        kind: ``k1`` (log r, unbiased, can be negative), ``k2`` ((log r)^2 / 2), ``k3``
            (r' - 1 - log r' with r' = pi_ref / pi: unbiased and >= 0), or ``low_var_kl``
            (k3 clamped to [-10, 10], as slime and verl do).
        importance_ratio: [...] or ``None``: multiplies the estimate, ``pi / pi_old`` for the unbiased KL of
            DeepSeek-V3.2 (slime's ``--use-unbiased-kl``). As in slime's ``compute_approx_kl``, ``low_var_kl``
            clamps the weighted estimate, after the multiplication.
        mask: [...] bool, valid tokens, or ``None``. With it the inputs must be finite where it is True and the
            others may hold anything, NaN included: they are zeroed first, so the estimate is 0 and
            ``log_probs`` gets gradient 0 there. Without it a NaN input gives NaN at its own position only.

    Returns:
        [...] tensor of the same shape in float32 (float64 for float64 inputs). As in slime, the gradient
        flows through ``log_probs`` (and ``importance_ratio``) only by autograd of the formula; the caller
        chooses where to detach.
    """
    check_tensor("log_probs", log_probs, floating=True)
    check_tensor("ref_log_probs", ref_log_probs, floating=True)
    inputs = {"log_probs": log_probs, "ref_log_probs": ref_log_probs}
    if importance_ratio is not None:
        inputs["importance_ratio"] = check_tensor("importance_ratio", importance_ratio, floating=True)
    check_same_shape(**inputs)
    check_choice("kind", kind, KL_KINDS)
    log_probs, ref_log_probs, *weight = zero_masked(mask, **inputs)
    log_ratio = log_probs - ref_log_probs
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio.square()
    else:
        kl = torch.expm1(-log_ratio) + log_ratio
    if weight:
        kl = kl * weight[0]
    if kind == "low_var_kl":
        kl = kl.clamp(-10.0, 10.0)
    return kl
