"""Entropy bonus, per token."""

from torch import Tensor

from rlcore._checks import check_tensor
from rlcore.losses._common import upcast


def entropy_bonus(entropy: Tensor, *, coef: float = 1.0) -> Tensor:
    """Per-token loss ``-coef * entropy``: minimising it raises the policy's entropy (slime's ``--entropy-coef``).

    Args:
        entropy: [...] entropy of the policy's next-token distribution at each position.
        coef: weight of the bonus.

    Returns:
        [...] ``-coef * entropy`` in float32 (float64 for float64 inputs).
    """
    check_tensor("entropy", entropy, floating=True)
    if not isinstance(coef, int | float):
        raise TypeError(f"coef must be a number, got {type(coef).__name__}")
    return -float(coef) * upcast(entropy)
