"""Routed experts through SGLang's HTTP API: the client asks with ``return_routed_experts`` and decodes
``meta_info["routed_experts"]`` (base64 int32 ``[len(tokens) - 1, num_hidden_layers, topk]``); the fake server
answers as SGLang 0.5.23 does (only when started with ``--enable-return-routed-experts``)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from transformers import AutoModelForCausalLM

from runtime.cluster.engines import server_args
from runtime.config import from_dict, validate
from runtime.demo import task
from runtime.demo.tiny_model import make_preset_model
from runtime.engines import sglang_api
from runtime.engines.base import SamplingParams
from runtime.engines.launcher import server_argv
from runtime.engines.routes import moe_routers, routes_from_base64, routes_to_base64
from runtime.engines.sglang_engine import SGLangEngine
from tests.fake_sglang import FakeSGLangServer

API = sglang_api.load()
SHAPES = st.tuples(st.integers(0, 5), st.integers(1, 4), st.integers(1, 3))


@settings(max_examples=30, deadline=None)
@given(arrays(np.int32, SHAPES, elements=st.integers(0, 383)))
def test_base64_routes_round_trip(routes):
    # Catches: a dtype other than int32 on the wire (verl's uint8 breaks above 256 experts), Fortran order.
    rows, layers, topk = routes.shape
    assert np.array_equal(routes_from_base64(routes_to_base64(routes), rows=rows, layers=layers, topk=topk), routes)
    with pytest.raises(ValueError, match=r"\[len\(tokens\) - 1 = "):
        routes_from_base64(routes_to_base64(routes), rows=rows + 1, layers=layers, topk=topk)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    path = make_preset_model("tiny-qwen3-moe", tmp_path_factory.mktemp("moe"), alphabet=task.ALPHABET, seed=0)
    model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(3)
    with torch.no_grad():
        for _, router in moe_routers(model):
            router.weight.normal_(0.0, 1.0)  # distinct expert scores (default init nearly ties them)
    model.save_pretrained(path)
    return str(path)


def test_sglang_client_decodes_the_servers_routes(moe_path):
    # Catches: return_routed_experts not sent, the routes decoded against the output alone (no prompt rows) or
    # reshaped with the wrong layer/top-k split, and the flag sent when replay is off.
    plain = AutoModelForCausalLM.from_pretrained(moe_path)
    prompts = [[5, 9, 7, 11], [6, 8]]
    with FakeSGLangServer(moe_path, enable_return_routed_experts=True) as server:
        engine = SGLangEngine(base_url=server.url, seed=0, hf_checkpoint=moe_path)
        try:
            gens = engine.generate(prompts, SamplingParams(max_new_tokens=4, return_routed_experts=True))
            without = engine.generate(prompts, SamplingParams(max_new_tokens=2))
        finally:
            engine.close()
    seen = {}
    for prompt, gen in zip(prompts, gens, strict=True):
        tokens = prompt + gen.token_ids
        routes = gen.extra["routed_experts"]
        assert routes.dtype == np.int32 and routes.shape == (len(tokens) - 1, 2, 2)
        seen.clear()
        handles = [
            r.register_forward_hook(lambda m, a, out, layer=layer: seen.__setitem__(layer, out[2]))
            for layer, r in moe_routers(plain)
        ]
        with torch.no_grad():
            plain(torch.tensor([tokens[:-1]]))
        for h in handles:
            h.remove()
        for layer, experts in seen.items():
            assert np.array_equal(np.sort(routes[:, layer], -1), np.sort(experts.numpy(), -1))
    assert all("routed_experts" not in g.extra for g in without)


def test_a_server_started_without_the_flag_is_named(moe_path):
    # Catches: a server that ignores return_routed_experts (SGLang without --enable-return-routed-experts answers
    # without the field) turning into samples with no routes far from the cause.
    with FakeSGLangServer(moe_path) as server:
        engine = SGLangEngine(base_url=server.url, seed=0, hf_checkpoint=moe_path)
        try:
            with pytest.raises(ValueError, match="--enable-return-routed-experts"):
                engine.generate([[5, 6]], SamplingParams(max_new_tokens=2, return_routed_experts=True))
        finally:
            engine.close()


@pytest.mark.skipif(API is None, reason="sglang is not installed (pip install --no-deps sglang==0.5.23)")
@pytest.mark.parametrize("replay", [True, False])
def test_the_server_command_line_asks_for_routes_under_rollout_routing_replay(moe_path, tmp_path, replay):
    # Catches: the launcher dropping --enable-return-routed-experts (SGLang then answers without routes and every
    # sample is refused at the batch), the flag spelled as a field SGLang 0.5.23's ServerArgs lacks, and the flag
    # set on a job that never replays (SGLang then keeps a route buffer per token for nothing).
    assert "enable_return_routed_experts" in API.ServerArgs.__struct_fields__
    cfg = validate(
        from_dict(
            None,
            hf_checkpoint=moe_path,
            output_dir=str(tmp_path / "out"),
            rollout_max_response_len=8,
            rollout_batch_size=2,
            n_samples_per_prompt=2,
            num_rollout=1,
            actor_num_gpus_per_node=1,
            use_rollout_routing_replay=replay,
        )
    )
    argv = server_argv(
        "python -m sglang.launch_server",
        model_path=moe_path,
        host="h",
        port=1,
        tp_size=1,
        seed=0,
        server_args=server_args(cfg),
    )
    assert ("--enable-return-routed-experts" in argv) is replay
    parser = argparse.ArgumentParser()
    API.ServerArgs.add_cli_args(parser)
    assert parser.parse_args(argv[3:]).enable_return_routed_experts is replay
