"""Fused log-probability and entropy kernels: from logits, from hidden states x LM head, vocab-parallel; and the RL
loss fused into the LM head (:func:`linear_rl_loss`); log-probs renormalised over a rollout's top-p nucleus
(:mod:`rlcore.kernels.nucleus`).

CUDA tensors run Triton kernels; CPU tensors run a chunked torch implementation, except under
``TRITON_INTERPRET=1``, where they run the Triton kernels in Triton's interpreter (how CI tests them).
:mod:`rlcore.kernels.reference` holds the plain torch versions the kernels are tested against.
"""

from rlcore.kernels import reference
from rlcore.kernels.fused_loss import linear_rl_loss
from rlcore.kernels.linear import linear_logprobs_entropy
from rlcore.kernels.logprobs import logprobs_entropy
from rlcore.kernels.nucleus import nucleus_log_probs, nucleus_mask, pad_nucleus

__all__ = [
    "linear_logprobs_entropy",
    "linear_rl_loss",
    "logprobs_entropy",
    "nucleus_log_probs",
    "nucleus_mask",
    "pad_nucleus",
    "reference",
]
