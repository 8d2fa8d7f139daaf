"""KL estimators between the current policy and a reference, per token (Schulman's k1, k2, k3)."""

import torch
from torch import Tensor

from rlcore._checks import check_choice, check_same_shape, check_tensor
from rlcore.losses._common import upcast

KL_KINDS = ("k1", "k2", "k3", "low_var_kl")


def approx_kl(log_probs: Tensor, ref_log_probs: Tensor, *, kind: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi.

    Args:
        log_probs: [...] log pi(a) of the sampled tokens.
        ref_log_probs: [...] log pi_ref(a) of the same tokens.
        kind: ``k1`` (log r, unbiased, can be negative), ``k2`` ((log r)^2 / 2), ``k3``
            (r' - 1 - log r' with r' = pi_ref / pi: unbiased and >= 0), or ``low_var_kl``
            (k3 clamped to [-10, 10], as slime and verl do).

    Returns:
        [...] tensor of the same shape in float32 (float64 for float64 inputs). As in slime, the gradient
        flows through ``log_probs`` only by autograd of the formula; the caller chooses where to detach.
    """
    check_tensor("log_probs", log_probs, floating=True)
    check_tensor("ref_log_probs", ref_log_probs, floating=True)
    check_same_shape(log_probs=log_probs, ref_log_probs=ref_log_probs)
    check_choice("kind", kind, KL_KINDS)
    log_ratio = upcast(log_probs) - upcast(ref_log_probs)
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    k3 = torch.expm1(-log_ratio) + log_ratio
    if kind == "low_var_kl":
        return k3.clamp(-10.0, 10.0)
    return k3
