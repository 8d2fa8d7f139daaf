"""Supervised fine-tuning: the negative log-likelihood of the target tokens, per token."""

from torch import Tensor

from rlcore._checks import check_tensor
from rlcore.losses._common import zero_masked


def sft_loss(log_probs: Tensor, *, mask: Tensor | None = None) -> Tensor:
    """Per-token negative log-likelihood ``-log_probs`` (slime's ``sft_loss``), to be aggregated over valid tokens.

    Args:
        log_probs: [...] log-probs of the target tokens under the policy being trained.
        mask: [...] bool, valid tokens, or ``None``; with it ``log_probs`` must be finite where it is True and
            masked positions, whatever they hold, give 0 and gradient 0.

    Returns:
        [...] ``-log_probs`` in float32 (float64 for float64 inputs).
    """
    check_tensor("log_probs", log_probs, floating=True)
    (log_probs,) = zero_masked(mask, log_probs=log_probs)
    return -log_probs
