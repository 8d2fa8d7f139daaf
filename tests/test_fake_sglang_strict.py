"""The fake SGLang server is held to SGLang's own request classes: a field SGLang does not know fails."""

from __future__ import annotations

import dataclasses

import httpx
import pytest
from fake_sglang import (
    ABORT_FIELDS,
    GENERATE_FIELDS,
    LOAD_LORA_FIELDS,
    MEMORY_FIELDS,
    SAMPLING_FIELDS,
    UNLOAD_LORA_FIELDS,
    UPDATE_FROM_DISK_FIELDS,
    UPDATE_FROM_TENSOR_FIELDS,
    FakeSGLangServer,
)

from runtime.demo import task
from runtime.demo.tiny_model import make_tiny_model
from runtime.engines import sglang_api

API = sglang_api.load()
needs_sglang = pytest.mark.skipif(API is None, reason="sglang is not installed (the dev extra; see the Makefile)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("tiny"), alphabet=task.ALPHABET, seed=0)
    with FakeSGLangServer(path) as srv:
        yield srv


def _fields(cls):
    return (
        set(cls.__struct_fields__) if hasattr(cls, "__struct_fields__") else {f.name for f in dataclasses.fields(cls)}
    )


@needs_sglang
@pytest.mark.parametrize(
    ("hand", "cls"),
    [
        (GENERATE_FIELDS, "GenerateReqInput"),
        (UPDATE_FROM_DISK_FIELDS, "UpdateWeightFromDiskReqInput"),
        (UPDATE_FROM_TENSOR_FIELDS, "UpdateWeightsFromTensorReqInput"),
        (MEMORY_FIELDS, "ReleaseMemoryOccupationReqInput"),
        (MEMORY_FIELDS, "ResumeMemoryOccupationReqInput"),
        (ABORT_FIELDS, "AbortReq"),
        (LOAD_LORA_FIELDS, "LoadLoRAAdapterReqInput"),
        (UNLOAD_LORA_FIELDS, "UnloadLoRAAdapterReqInput"),
    ],
)
def test_the_fakes_fallback_field_lists_hold_only_sglangs_fields(hand, cls):
    # Without SGLang installed the fake checks these hand-written lists; each must be a subset of the real class.
    assert hand <= _fields(getattr(API.io_struct, cls)), hand - _fields(getattr(API.io_struct, cls))


@needs_sglang
def test_the_fakes_sampling_fields_are_those_sglangs_contract_accepts():
    base = {"input_ids": [1, 2], "sampling_params": {}}
    for name in SAMPLING_FIELDS:
        value = {"stop": None, "stop_token_ids": [1], "logit_bias": None, "custom_params": None}.get(name, 1)
        assert "unknown field" not in str(API.generate_contract_error({**base, "sampling_params": {name: value}}))


GOOD = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}, "return_logprob": True}


@pytest.mark.parametrize(
    ("path", "body", "what"),
    [
        ("/generate", {**GOOD, "temprature": 0.5}, "temprature"),
        ("/generate", {**GOOD, "sampling_params": {"max_new_tokens": 1, "temprature": 0.5}}, "temprature"),
        ("/update_weights_from_disk", {"model_path": "/x", "weight_versoin": "1"}, "weight_versoin"),
        ("/release_memory_occupation", {"tag": ["weights"]}, "tag"),
        ("/abort_request", {"abort": True}, "abort"),
    ],
)
def test_a_field_sglang_does_not_know_fails(server, path, body, what):
    response = httpx.post(server.url + path, json=body, timeout=30)
    assert response.status_code == 400 and what in response.text


@needs_sglang
def test_sglangs_own_generate_contract_is_applied(server):
    response = httpx.post(server.url + "/generate", json={**GOOD, "return_logprob": "yes"}, timeout=30)
    assert response.status_code == 400 and "BoolOrList" in response.text


def test_the_fields_the_router_adds_are_accepted(server):
    # sglang-router 0.3.2 forwards /generate with these fields added (model is dropped by SGLang's own parse).
    body = {**GOOD, "model": "m", "background": False, "no_logs": False, "return_bytes": False}
    if API is None:
        body = {**GOOD, "model": "m"}
    response = httpx.post(server.url + "/generate", json=body, timeout=30)
    assert response.status_code == 200, response.text
