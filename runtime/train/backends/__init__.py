"""Training backends behind :class:`runtime.train.backends.base.TrainBackend`; ``torch`` (HF model, FSDP2) first."""

from runtime.train.backends.base import TrainBackend

__all__ = ["TrainBackend"]
