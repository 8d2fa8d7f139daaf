"""Supervised fine-tuning: the negative log-likelihood of the target tokens, per token."""

from torch import Tensor

from rlcore._checks import check_tensor
from rlcore.losses._common import upcast


def sft_loss(log_probs: Tensor) -> Tensor:
    """Per-token negative log-likelihood ``-log_probs`` (slime's ``sft_loss``), to be aggregated over valid tokens.

    Args:
        log_probs: [...] log-probs of the target tokens under the policy being trained.

    Returns:
        [...] ``-log_probs`` in float32 (float64 for float64 inputs).
    """
    check_tensor("log_probs", log_probs, floating=True)
    return -upcast(log_probs)
