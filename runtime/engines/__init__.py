"""Rollout engines: the protocol the loop drives, and the embedded transformers engine for CPU and small runs."""

from runtime.engines.base import Generation, RolloutEngine, SamplingParams
from runtime.engines.hf_engine import HFEngine

__all__ = ["Generation", "HFEngine", "RolloutEngine", "SamplingParams"]
