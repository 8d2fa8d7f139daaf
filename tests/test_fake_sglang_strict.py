"""The fake SGLang server is held to SGLang's own request classes: a field SGLang does not know fails."""

from __future__ import annotations

import dataclasses

import httpx
import pytest
from fake_sglang import (
    ABORT_FIELDS,
    BEGIN_UPDATE_FIELDS,
    CONTINUE_FIELDS,
    END_UPDATE_FIELDS,
    GENERATE_FIELDS,
    LOAD_LORA_FIELDS,
    MEMORY_FIELDS,
    PAUSE_FIELDS,
    PAUSE_MODES,
    SAMPLING_FIELDS,
    UNLOAD_LORA_FIELDS,
    UPDATE_FROM_DISK_FIELDS,
    UPDATE_FROM_TENSOR_FIELDS,
    FakeSGLangServer,
    pause_modes,
    weight_version_spans,
)
from hypothesis import given, settings
from hypothesis import strategies as st

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
        (PAUSE_FIELDS, "PauseGenerationReqInput"),
        (CONTINUE_FIELDS, "ContinueGenerationReqInput"),
        (BEGIN_UPDATE_FIELDS, "BeginWeightUpdateReqInput"),
        (END_UPDATE_FIELDS, "EndWeightUpdateReqInput"),
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


@needs_sglang
def test_the_pause_modes_are_sglangs():
    from runtime.engines.sglang_engine import PAUSE_MODE
    from runtime.engines.sglang_engine import PAUSE_MODES as ENGINE_MODES

    assert pause_modes() == PAUSE_MODES == ENGINE_MODES and PAUSE_MODE in PAUSE_MODES


@needs_sglang
@settings(max_examples=300, deadline=None)
@given(
    events=st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 8)), max_size=4),
    current=st.sampled_from("abc"),
    tokens=st.integers(0, 8),
)
def test_the_fakes_weight_version_spans_are_sglangs(events, current, tokens):
    from sglang.srt.utils.weight_versions import (
        WeightVersionEvent,
        add_weight_versions_to_meta_info,
        compute_weight_version_spans,
    )

    events = sorted(events, key=lambda e: e[1])  # recorded as the tokens grow
    meta: dict = {}
    spans = compute_weight_version_spans([WeightVersionEvent(v, n) for v, n in events], current, tokens)
    add_weight_versions_to_meta_info(meta, spans, tokens)
    assert weight_version_spans(events, current, tokens) == meta["weight_versions"]


GOOD = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}, "return_logprob": True}


@pytest.mark.parametrize(
    ("path", "body", "what"),
    [
        ("/generate", {**GOOD, "temprature": 0.5}, "temprature"),
        ("/generate", {**GOOD, "sampling_params": {"max_new_tokens": 1, "temprature": 0.5}}, "temprature"),
        ("/update_weights_from_disk", {"model_path": "/x", "weight_versoin": "1"}, "weight_versoin"),
        ("/release_memory_occupation", {"tag": ["weights"]}, "tag"),
        ("/abort_request", {"abort": True}, "abort"),
        ("/pause_generation", {"mdoe": "retract"}, "mdoe"),
        ("/begin_weight_update", {"selectr": "all"}, "selectr"),
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


@needs_sglang
@pytest.mark.parametrize(
    ("seed", "ok"),
    [(0, True), (-(2**63), True), (2**63 - 1, True), (2**63, False), (1.5, False), ("7", False)],
)
def test_sampling_seed_is_checked_by_sglangs_own_sampling_params(server, seed, ok):
    """SGLang 0.5.23 takes sampling_seed as an int in [-2**63, 2**63 - 1]: its contract gate refuses what is no
    integer, and SamplingParams.verify() (which the fake applies too) what is out of range, 2**63 among them."""
    sampling = {"max_new_tokens": 1, "sampling_seed": seed}
    try:
        API.SamplingParams(**sampling).verify(64)
        sglang_accepts = True
    except (TypeError, ValueError):
        sglang_accepts = False
    assert sglang_accepts == ok
    response = httpx.post(server.url + "/generate", json={**GOOD, "sampling_params": sampling}, timeout=30)
    assert (response.status_code == 200) == ok, response.text
    if seed == 2**63:
        assert API.generate_contract_error({**GOOD, "sampling_params": sampling}) is None
        assert "sampling_seed must be in [-2**63, 2**63 - 1]" in response.text


def test_equal_sampling_seeds_sample_alike_and_others_differ(server):
    def sample(seed):
        body = {**GOOD, "sampling_params": {"max_new_tokens": 8, "temperature": 1.5, "sampling_seed": seed}}
        response = httpx.post(server.url + "/generate", json=body, timeout=30)
        assert response.status_code == 200, response.text
        return response.json()["output_ids"]

    assert sample(11) == sample(11)
    assert len({tuple(sample(s)) for s in range(20, 26)}) > 1
