"""rlcore: the pure functional core of RL post-training for LLMs.

Advantages (:mod:`rlcore.advantages`), KL estimators and losses (:mod:`rlcore.losses`) and fused
log-prob/entropy kernels (:mod:`rlcore.kernels`). Tensors and TensorDicts in, tensors and
TensorDicts out; no I/O, no global state.
"""

from rlcore import keys

__all__ = ["keys"]
__version__ = "0.1.0"
