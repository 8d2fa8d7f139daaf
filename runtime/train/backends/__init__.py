"""Training backends by ``--train-backend`` name (the protocol is :class:`runtime.train.backends.base.TrainBackend`).

A new backend is one module with a class implementing the protocol plus one line in :data:`TRAIN_BACKENDS`. Classes
are named by import path and imported on first use, so this module stays light (the config reads its names) and a
backend's heavy dependencies (megatron-core) load only in jobs that pick it.
"""

from __future__ import annotations

import importlib
from typing import Any

TRAIN_BACKENDS: dict[str, str] = {
    "torch": "runtime.train.backends.torch_backend:TorchTrainer",
    "megatron": "runtime.train.backends.megatron_backend:MegatronTrainer",
}


# Each backend's options module: its ``OWN_FIELDS`` (the flags only it reads; refused under another backend) and what
# it can do, each a module constant the config and the weight sync read (absent: no): ``REPLAYS_TOP_P_NUCLEI``,
# ``READS_TORCH_DIST``, ``WEIGHTS_FROM_RANK0``. Light: the config imports it to validate, without the backend's
# dependencies.
TRAIN_BACKEND_OPTIONS: dict[str, str] = {
    "torch": "runtime.train.backends.torch_options",
    "megatron": "runtime.train.backends.megatron_options",
}


def backend_options(name: str) -> Any:
    """The options module of ``--train-backend name`` (see :data:`TRAIN_BACKEND_OPTIONS`)."""
    return importlib.import_module(TRAIN_BACKEND_OPTIONS[name])


def backend_class(name: str) -> type[Any]:
    """The class registered as ``--train-backend name``; ``ValueError`` naming the choices for an unknown name."""
    if name not in TRAIN_BACKENDS:
        raise ValueError(f"--train-backend {name!r} is not one of {', '.join(TRAIN_BACKENDS)}")
    module, _, attr = TRAIN_BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


__all__ = ["TRAIN_BACKENDS", "TRAIN_BACKEND_OPTIONS", "backend_class", "backend_options"]
