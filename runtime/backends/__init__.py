"""Training backends behind :class:`runtime.backends.base.TrainBackend`; ``torch`` (HF model, FSDP2) is the first."""

from runtime.backends.base import TrainBackend

__all__ = ["TrainBackend"]
