"""Routing replay's routes under the embedded engine's ``--engine-compile`` (``torch.compile`` of the decode step):
the compiled step records the experts the eager loop records, also when a call that asked for no routes (an
evaluation's) compiled the step first. dynamo does not guard on module hooks
(``torch._dynamo.config.skip_nnmodule_hook_guards``): route hooks put on after the compile would never run in the
compiled step, which left every response row of the routes 0 (runtime.engines.routes.install_route_hooks).

The engine compiles on CUDA only (``HFEngine.compile``); the decode loop compiles on any device, so on the CPU the
engine's flag is turned on after construction. The default case compiles with dynamo's ``eager`` backend: dynamo's
graph capture and guards, which decide whether the hooks run, without inductor's C++ code generation, which takes
about a minute on a 2-core CPU; the inductor case (``-m slow``) also runs the route buffers' writes as inductor
compiles them. On a GPU: ``tests/test_routes_compile_cuda.py`` (inductor and the CUDA graph)."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from runtime.demo import task
from runtime.demo.tiny_model import make_preset_model
from runtime.engines.base import SamplingParams
from runtime.engines.hf_engine import HFEngine
from runtime.engines.routes import moe_routers

MAX_NEW_TOKENS = 4


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    """tiny-qwen3-moe with its routers drawn wide (transformers' default init nearly ties every expert, so a
    rounding difference between the compiled and the eager step could flip a choice)."""
    path = make_preset_model("tiny-qwen3-moe", tmp_path_factory.mktemp("moe"), alphabet=task.ALPHABET, seed=0)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        for key, p in model.named_parameters():
            if key.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
    model.save_pretrained(path)
    return str(path)


def evaluation_then_rollout(path: str, *, compile: bool, device: str) -> tuple[HFEngine, list]:
    """An engine's plain call (as an evaluation makes: no routes asked), then a call that asks for routes (a rollout
    under ``--use-rollout-routing-replay``): ``(engine, generations of the second call)``. float32, so that the
    compiled and the eager step round alike to well within the routers' margins."""
    engine = HFEngine(path, seed=0, device=device, dtype="float32")
    engine.compile = compile
    tokenizer = AutoTokenizer.from_pretrained(path)
    records = task.make_records(2, seed=2)
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in records for _ in range(2)]  # groups of two samples
    engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW_TOKENS))
    return engine, engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW_TOKENS, return_routed_experts=True))


def assert_compiled_routes_equal_eager(path: str, *, device: str) -> None:
    eager_engine, eager = evaluation_then_rollout(path, compile=False, device=device)
    engine, compiled = evaluation_then_rollout(path, compile=True, device=device)
    assert getattr(engine.model, "_rlcore_compiled", None) is not None  # the step did run compiled
    assert getattr(eager_engine.model, "_rlcore_compiled", None) is None
    # One recording hook per router: installed before the compile, not again when routes were asked.
    assert all(len(router._forward_hooks) == 1 for _, router in moe_routers(engine.model))
    decoded = 0
    for want, got in zip(eager, compiled, strict=True):
        assert got.token_ids == want.token_ids
        want_routes, got_routes = (torch.as_tensor(g.extra["routed_experts"]) for g in (want, got))
        assert got_routes.shape == want_routes.shape and got_routes.dtype == torch.int32
        # The set of experts is the contract (the top-k order is each kernel's own).
        assert torch.equal(got_routes.sort(-1).values, want_routes.sort(-1).values)
        decoded += len(got.token_ids) - 1
    # The decoding steps' rows (the compiled ones) are among those compared: each sample's last len - 1 rows.
    assert decoded > 0


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_the_compiled_step_records_the_eager_routes_after_a_call_without_routes(moe_path, backend, monkeypatch):
    # Catches: the route hooks put on only when routes are first asked for, after the step was compiled (every
    # decoding step's row 0), and hooks put on twice (each expert written twice per step, a Python call wasted).
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
    assert_compiled_routes_equal_eager(moe_path, device="cpu")
