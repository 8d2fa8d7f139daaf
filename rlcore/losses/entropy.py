"""Entropy bonus, per token."""

from torch import Tensor

from rlcore._checks import check_tensor
from rlcore.losses._common import zero_masked


def entropy_bonus(entropy: Tensor, *, coef: float = 1.0, mask: Tensor | None = None) -> Tensor:
    """Per-token loss ``-coef * entropy``: minimising it raises the policy's entropy (slime's ``--entropy-coef``).

    Args:
        entropy: [...] entropy of the policy's next-token distribution at each position.
        coef: weight of the bonus.
        mask: [...] bool, valid tokens, or ``None``; with it ``entropy`` must be finite where it is True and
            masked positions, whatever they hold, give 0 and gradient 0.

    Returns:
        [...] ``-coef * entropy`` in float32 (float64 for float64 inputs).
    """
    check_tensor("entropy", entropy, floating=True)
    if not isinstance(coef, int | float):
        raise TypeError(f"coef must be a number, got {type(coef).__name__}")
    (entropy,) = zero_masked(mask, entropy=entropy)
    return -float(coef) * entropy
