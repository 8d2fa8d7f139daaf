"""Rollout engines: the protocol the loop drives, the embedded transformers engine for CPU and small runs, and the
HTTP client of running SGLang servers."""

from runtime.engines.base import Generation, RolloutEngine, SamplingParams
from runtime.engines.hf_engine import HFEngine
from runtime.engines.sglang_engine import SGLangEngine

__all__ = ["Generation", "HFEngine", "RolloutEngine", "SGLangEngine", "SamplingParams"]
