"""Routing replay's routes under ``--engine-compile`` on a GPU: the embedded engine's decode step compiled by inductor
records the experts the eager loop records, also when a call without routes compiled it first (the CPU's case:
tests/test_routes_compile.py). float32, in which a MoE model decodes without CUDA graphs (transformers' grouped
experts copy offsets to the host outside bf16). Skipped without CUDA (``pytest -q tests/test_routes_compile_cuda.py``
on a GPU machine)."""

import pytest
import torch
from test_routes_compile import assert_compiled_routes_equal_eager, moe_path  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_the_compiled_cuda_graph_records_the_eager_routes_after_a_call_without_routes(moe_path):  # noqa: F811
    from runtime.engines.hf_engine import HFEngine

    assert not HFEngine(moe_path, seed=0, device="cuda", dtype="float32").cuda_graph  # no graph can capture it
    assert_compiled_routes_equal_eager(moe_path, device="cuda")
