"""Training backends by ``--train-backend`` name (the protocol is :class:`runtime.train.backends.base.TrainBackend`).

A new backend is its class (implementing the protocol) and its options module (its flags and what it can do), plus
one line in :data:`TRAIN_BACKENDS` naming both. Both are named by import path and imported on first use, so this
module stays light (the config reads its names) and a backend's heavy dependencies (megatron-core) load only in jobs
that pick it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runtime.option_fields import registry_view


@dataclass(frozen=True)
class Backend:
    """One training backend: ``cls``, its class as ``module:Class``; ``options``, its options module."""

    cls: str
    options: str


TRAIN_BACKENDS: dict[str, Backend] = {
    "torch": Backend("runtime.train.backends.torch_backend:TorchTrainer", "runtime.train.backends.torch_options"),
    "megatron": Backend(
        "runtime.train.backends.megatron_backend:MegatronTrainer", "runtime.train.backends.megatron_options"
    ),
}


# Each backend's options module (its ``Backend.options``, read live from :data:`TRAIN_BACKENDS`): its ``OWN_FIELDS``
# (the flags only it reads; refused under another backend) and what it can do, each a module constant the config and
# the weight sync read (absent: no): ``REPLAYS_TOP_P_NUCLEI``, ``READS_TORCH_DIST``, ``WEIGHTS_FROM_RANK0``. Light: the
# config imports it to validate, without the backend's dependencies.
TRAIN_BACKEND_OPTIONS: Mapping[str, str] = registry_view(TRAIN_BACKENDS, "options")


def backend_options(name: str) -> Any:
    """The options module of ``--train-backend name`` (its ``Backend.options``)."""
    return importlib.import_module(TRAIN_BACKEND_OPTIONS[name])


def backend_class(name: str) -> type[Any]:
    """The class registered as ``--train-backend name``; ``ValueError`` naming the choices for an unknown name."""
    if name not in TRAIN_BACKENDS:
        raise ValueError(f"--train-backend {name!r} is not one of {', '.join(TRAIN_BACKENDS)}")
    module, _, attr = TRAIN_BACKENDS[name].cls.partition(":")
    return getattr(importlib.import_module(module), attr)


__all__ = ["TRAIN_BACKENDS", "TRAIN_BACKEND_OPTIONS", "Backend", "backend_class", "backend_options"]
