"""Rollout engines: the protocol the loop drives, the embedded transformers engine for CPU and small runs, and the
HTTP client of running SGLang servers.

The names load on first use (PEP 562), so that reading the engine registry (``runtime.engines.registry``) or the
SGLang flag table does not import torch: ``rlcore-run --help`` and ``--dry-run`` stay fast.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Generation": "runtime.engines.base",
    "RolloutEngine": "runtime.engines.base",
    "SamplingParams": "runtime.engines.base",
    "HFEngine": "runtime.engines.hf_engine",
    "SGLangEngine": "runtime.engines.sglang_engine",
}

__all__ = ["Generation", "HFEngine", "RolloutEngine", "SGLangEngine", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
