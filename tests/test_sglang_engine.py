"""The SGLang engine adapter against a fake SGLang server (``tests/fake_sglang.py``) that speaks SGLang's HTTP API and
generates with a real tiny transformers model; log-probs are checked against that model's float64 log-softmax."""

import socket
import threading
import time

import pytest
import torch
from fake_sglang import FakeSGLangServer
from transformers import AutoModelForCausalLM

from runtime.engines import RolloutEngine, SamplingParams
from runtime.engines.sglang_engine import (
    WEIGHTS_FILE,
    SGLangConnectionError,
    SGLangEngine,
    SGLangHTTPError,
    SGLangWeightsLost,
    generation_from_sglang,
    sampling_params_to_sglang,
    sampling_seed,
    save_hf_weights,
    sglang_weight_dtype,
)

PROMPTS = [[1, 5, 6, 7], [1, 4], [1, 13, 14, 5, 9]]


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
    with FakeSGLangServer(tiny_checkpoints[0], seed=0) as srv:
        yield srv


@pytest.fixture
def engine(server, tiny_checkpoints):
    eng = SGLangEngine(server.url, timeout=30, max_retries=2, retry_backoff=0.01, startup_timeout=10)
    yield eng
    # Put the server back as the other tests expect it: model A, memory resumed.
    if server.released:
        eng.resume_memory()
    if eng.weight_version() != 0:
        eng.update_weights_from_disk(str(tiny_checkpoints[0]), weight_version=0)
    eng.close()


@torch.no_grad()
def reference_log_probs(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature) of each response token over the whole vocabulary (SGLang's definition)."""
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


@torch.no_grad()
def greedy_path(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_engine_satisfies_rollout_protocol(engine):
    assert isinstance(engine, RolloutEngine)


@pytest.mark.parametrize("temperature", [0.6, 1.3])
def test_generate_log_probs_are_the_models_at_the_sampling_temperature(
    engine, server, tiny_models_float64, temperature
):
    eos = server.tokenizer.eos_token_id
    before = server.requests.get("/generate", 0)
    gens = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=temperature))
    assert server.requests["/generate"] == before + 1  # the whole batch in one request
    assert len(gens) == len(PROMPTS)
    for prompt, g in zip(PROMPTS, gens, strict=True):
        assert 1 <= len(g.token_ids) == len(g.log_probs) <= 6
        ref = reference_log_probs(tiny_models_float64[0], prompt, g.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(g.log_probs, dtype=torch.float64), ref, atol=1e-5, rtol=1e-5)
        assert eos not in g.token_ids[:-1]
        if g.finish_reason == "stop":
            assert g.token_ids[-1] == eos
        else:
            assert g.finish_reason == "length" and len(g.token_ids) == 6
        assert g.weight_version == 0 and g.extra["rid"]


def test_length_and_stop_finish_reasons_on_the_greedy_path(engine, tiny_models_float64):
    prompt, temperature = PROMPTS[2], 0.8
    path = greedy_path(tiny_models_float64[0], prompt, 5)
    assert 2 not in path  # eos would end the response before max_new_tokens
    # top_k=1 samples the argmax; the log-probs stay those of the full tempered distribution.
    g = engine.generate([prompt], SamplingParams(max_new_tokens=5, temperature=temperature, top_k=1))[0]
    assert g.finish_reason == "length" and g.token_ids == path
    torch.testing.assert_close(
        torch.tensor(g.log_probs, dtype=torch.float64),
        reference_log_probs(tiny_models_float64[0], prompt, path, temperature),
        atol=1e-5,
        rtol=1e-5,
    )
    assert all(lp < -1e-3 for lp in g.log_probs)  # not the truncated (top-1) distribution, whose log-probs are 0
    stop = path[0]
    g = engine.generate([prompt], SamplingParams(max_new_tokens=5, top_k=1, stop_token_ids=(stop,)))[0]
    assert g.finish_reason == "stop" and g.token_ids == path[: path.index(stop) + 1]
    assert g.extra["finish"] == {"type": "stop", "matched": stop}


def test_batched_generation_equals_one_prompt_at_a_time(engine):
    params = SamplingParams(max_new_tokens=4, temperature=0.9, top_k=1)
    batched = engine.generate(PROMPTS, params)
    for prompt, g in zip(PROMPTS, batched, strict=True):
        alone = engine.generate([prompt], params)[0]
        assert alone.token_ids == g.token_ids and alone.finish_reason == g.finish_reason
        torch.testing.assert_close(alone.log_probs, g.log_probs)


def test_weight_update_from_disk_switches_the_server_to_the_new_weights(
    engine, server, tiny_models_float64, tiny_checkpoints
):
    prompt, temperature = PROMPTS[0], 1.0
    params = SamplingParams(max_new_tokens=5, temperature=temperature)
    new_state = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[1]).state_dict()

    engine.load_weights(new_state, weight_version=7)
    assert server.weight_version == "7" and engine.server_weight_version() == "7" and engine.weight_version() == 7
    g = engine.generate([prompt], params)[0]
    assert g.weight_version == 7
    got = torch.tensor(g.log_probs, dtype=torch.float64)
    torch.testing.assert_close(
        got, reference_log_probs(tiny_models_float64[1], prompt, g.token_ids, temperature), atol=1e-5, rtol=0
    )
    # The check can fail: the old weights give other log-probs for the same tokens.
    assert (got - reference_log_probs(tiny_models_float64[0], prompt, g.token_ids, temperature)).abs().max() > 1e-2

    first = sorted(p for p in engine.weights_dir.iterdir())
    engine.load_weights(AutoModelForCausalLM.from_pretrained(tiny_checkpoints[0]).state_dict(), weight_version=8)
    g = engine.generate([prompt], params)[0]
    torch.testing.assert_close(
        torch.tensor(g.log_probs, dtype=torch.float64),
        reference_log_probs(tiny_models_float64[0], prompt, g.token_ids, temperature),
        atol=1e-5,
        rtol=0,
    )
    # Only the folder the server loaded last is kept.
    (current,) = engine.weights_dir.iterdir()
    assert current not in first and (current / WEIGHTS_FILE).is_file() and (current / "config.json").is_file()


def test_weight_update_from_tensor_handles_switches_the_server_to_the_new_weights(
    engine, server, tiny_models_float64, tiny_checkpoints
):
    from runtime.engines import weight_transfer

    prompt, temperature = PROMPTS[1], 1.0
    state = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[1]).state_dict()
    # Tied weights once, under the name SGLang reads; two buckets, the version with the last.
    names = [n for n in state if n != "lm_head.weight"]
    half = len(names) // 2
    received = len(server.received_buckets)
    for part, version in ((names[:half], None), (names[half:], 11)):
        payload = weight_transfer.serialize_named_tensors([(n, state[n]) for n in part])
        assert len(payload) < 64 * len(part) + 4096  # handles to the memory, not the tensors' bytes
        engine.update_weights_from_tensor(payload, weight_version=version)
    assert server.weight_version == "11" and engine.weight_version() == 11
    assert [n for _, n in server.received_buckets[received:]] == [half, len(names) - half]
    g = engine.generate([prompt], SamplingParams(max_new_tokens=5, temperature=temperature))[0]
    torch.testing.assert_close(
        torch.tensor(g.log_probs, dtype=torch.float64),
        reference_log_probs(tiny_models_float64[1], prompt, g.token_ids, temperature),
        atol=1e-5,
        rtol=0,
    )
    # Back to the first weights, so that the tests after this one see the model they expect.
    engine.load_weights(AutoModelForCausalLM.from_pretrained(tiny_checkpoints[0]).state_dict(), weight_version=12)


def test_weight_update_refused_by_the_server_raises_with_its_message(engine, server, tmp_path):
    # A folder the adapter cannot see is the server's to check; SGLang answers 400 with its message.
    server_version = server.weight_version
    with pytest.raises(SGLangHTTPError, match="Failed to get weights iterator") as err:
        engine.update_weights_from_disk(str(tmp_path / "on-the-server-only"), weight_version=5)
    assert err.value.status_code == 400 and "/update_weights_from_disk" in err.value.url
    assert engine.weight_version() == 0 and server.weight_version == server_version


def test_buckets_that_do_not_fit_the_checkpoint_are_refused_before_anything_is_sent(engine, server, tiny_checkpoints):
    state = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[1]).state_dict()
    before = server.requests.get("/update_weights_from_disk", 0)
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \[3\]"):
        engine.load_weights({"model.norm.weight": torch.ones(3)})
    with pytest.raises(ValueError, match="does not have: model.extra.weight"):
        engine.load_weights({"model.extra.weight": torch.ones(3)})
    partial = {k: v for k, v in state.items() if "layers.1." not in k}
    with pytest.raises(ValueError, match=r"9 of 20 weights missing: model.layers.1.input_layernorm.weight, .* 4 more"):
        engine.load_weights(partial, weight_version=5)
    assert server.requests.get("/update_weights_from_disk", 0) == before
    assert engine.weight_version() == 0 and not any(engine.weights_dir.iterdir())


def test_tied_weights_sent_as_lm_head_reach_the_embeddings_sglang_reads(engine, server, tiny_checkpoints):
    # SGLang skips lm_head.weight when embeddings are tied (as the fake does): the adapter writes both names.
    new = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[1]).state_dict()
    engine.load_weights({k: v for k, v in new.items() if k != "model.embed_tokens.weight"}, weight_version=3)
    (folder,) = engine.weights_dir.iterdir()
    from safetensors import safe_open

    with safe_open(str(folder / WEIGHTS_FILE), "pt") as f:
        assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(f.keys())
    for name, value in server.model.state_dict().items():
        torch.testing.assert_close(value, new[name], rtol=0, atol=0)


def test_a_folder_with_tied_weights_under_the_skipped_name_only_is_refused(engine, tiny_checkpoints, tmp_path):
    new = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[1]).state_dict()
    head_only = {k: v for k, v in new.items() if k != "model.embed_tokens.weight"}
    folder = save_hf_weights(head_only, tmp_path / "w", config_source=tiny_checkpoints[0])
    with pytest.raises(ValueError, match="SGLang reads model.embed_tokens.weight"):
        engine.update_weights_from_disk(str(folder), weight_version=4)
    assert engine.weight_version() == 0


def test_weight_dtype_resolves_sglangs_auto_like_sglang(engine):
    assert engine.weight_dtype() == "float32"  # the fake reports --dtype float32
    assert sglang_weight_dtype("half", {}) == "float16" and sglang_weight_dtype("float", {}) == "float32"
    assert sglang_weight_dtype("auto", {"dtype": "bfloat16", "model_type": "qwen2"}) == "bfloat16"
    assert sglang_weight_dtype("auto", {"torch_dtype": "float32", "model_type": "llama"}) == "float16"
    assert sglang_weight_dtype("auto", {"model_type": "gemma2"}) == "bfloat16"
    with pytest.raises(ValueError, match="unknown SGLang dtype"):
        sglang_weight_dtype("fp8", {})


def test_release_and_resume_memory(engine, server):
    params = SamplingParams(max_new_tokens=2)
    engine.release_memory()
    assert server.released
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.generate([[1, 4]], params)
    # The server itself refuses to generate without its memory, whoever asks.
    other = SGLangEngine(server.url, max_retries=0)
    with pytest.raises(SGLangHTTPError, match="released") as err:
        other.generate([[1, 4]], params)
    assert err.value.status_code == 400
    other.close()
    # Staged: a server with any region still released does not generate.
    engine.resume_memory(tags=["weights", "kv_cache"])
    assert server.released and server.released_tags == {"cuda_graph"}
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.generate([[1, 4]], params)
    engine.resume_memory(tags=["cuda_graph"])
    assert not server.released
    assert len(engine.generate([[1, 4]], params)) == 1
    with pytest.raises(ValueError, match="tags"):
        engine.release_memory(tags=["gpu"])
    assert not server.released


def test_http_errors_name_status_and_server_message_and_are_not_retried(engine, server):
    before = server.requests.get("/generate", 0)
    with pytest.raises(SGLangHTTPError, match="bogus_field") as err:
        engine._post("/generate", {"input_ids": [[1, 2]], "bogus_field": 1})
    assert err.value.status_code == 400 and "HTTP 400" in str(err.value)
    assert server.requests["/generate"] == before + 1
    with pytest.raises(SGLangHTTPError, match="temperature") as err:
        engine._post("/generate", {"input_ids": [1, 2], "sampling_params": {"temperature": -1.0}})
    with pytest.raises(SGLangHTTPError) as err:
        engine._get("/no_such_route")
    assert err.value.status_code == 404


def test_connection_errors_are_retried_until_the_server_is_up(tiny_checkpoints):
    port = free_port()
    srv = FakeSGLangServer(tiny_checkpoints[0], port=port)
    eng = SGLangEngine(f"http://127.0.0.1:{port}", wait_healthy=False, max_retries=10, retry_backoff=0.05)
    starter = threading.Timer(0.3, srv.start)
    starter.start()
    try:
        gens = eng.generate([[1, 4]], SamplingParams(max_new_tokens=2))
        assert len(gens) == 1 and srv.requests["/generate"] == 1
    finally:
        starter.join()
        srv.stop()
        eng.close()


def test_connection_errors_raise_after_the_last_retry():
    eng = SGLangEngine(f"http://127.0.0.1:{free_port()}", wait_healthy=False, max_retries=2, retry_backoff=0.02)
    start = time.monotonic()
    with pytest.raises(SGLangConnectionError, match="after 3 attempts"):
        eng.generate([[1, 4]], SamplingParams(max_new_tokens=2))
    assert time.monotonic() - start >= 0.02 + 0.04
    eng.close()


def test_start_waits_for_health_and_times_out_with_the_last_status(tiny_checkpoints):
    with FakeSGLangServer(tiny_checkpoints[0], startup_delay=0.5) as srv:
        with pytest.raises(TimeoutError, match="HTTP 503"):
            SGLangEngine(srv.url, startup_timeout=0.1)
        eng = SGLangEngine(srv.url, startup_timeout=10)
        assert eng.health() and time.monotonic() - srv._started_at >= 0.5
        eng.close()


def _generate_in_background(eng, prompts, params, srv):
    """Start ``eng.generate`` in a thread; return it and its result list once the server decodes."""
    result = []
    worker = threading.Thread(target=lambda: result.extend(eng.generate(prompts, params)))
    worker.start()
    deadline = time.monotonic() + 10
    while not srv._running and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    return worker, result


def test_abort_all_cuts_the_running_request_and_empties_the_queued_ones(tiny_checkpoints, tiny_models_float64):
    prompts = [PROMPTS[1], PROMPTS[0]]
    path = greedy_path(tiny_models_float64[0], prompts[0], 40)
    assert 2 not in path
    with FakeSGLangServer(tiny_checkpoints[0], token_delay=0.02) as srv:
        eng = SGLangEngine(srv.url)
        worker, result = _generate_in_background(eng, prompts, SamplingParams(max_new_tokens=40, top_k=1), srv)
        eng.abort()
        worker.join(30)
        assert eng.generate([PROMPTS[2]], SamplingParams(max_new_tokens=3)) != []  # the abort is over
        eng.close()
    running, queued = result
    assert running.finish_reason == "abort" and 0 < len(running.token_ids) < 40
    assert running.token_ids == path[: len(running.token_ids)] and len(running.log_probs) == len(running.token_ids)
    torch.testing.assert_close(
        torch.tensor(running.log_probs, dtype=torch.float64),
        reference_log_probs(tiny_models_float64[0], prompts[0], running.token_ids, 1.0),
        atol=1e-5,
        rtol=0,
    )
    assert running.extra["finish"] == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    assert (queued.token_ids, queued.log_probs, queued.finish_reason) == ([], [], "abort")
    assert queued.extra["finish"] == {"type": "abort", "message": "Abort in waiting queue"}


def test_abort_by_rid_ends_that_request_only(tiny_checkpoints):
    with FakeSGLangServer(tiny_checkpoints[0], token_delay=0.02) as srv:
        eng = SGLangEngine(srv.url)
        eng.abort(rid="nobody-runs-this")  # unknown ids (and aborts with nothing in flight) do nothing
        worker, result = _generate_in_background(eng, PROMPTS[:2], SamplingParams(max_new_tokens=20, top_k=1), srv)
        # One id for the batch: SGLang numbers its prompts "<id>_0", "<id>_1".
        (batch,) = {rid.rsplit("_", 1)[0] for rid in srv._running}
        eng.abort(rid=batch + "_")  # a prefix of both ids, but not an id the server knows: nothing happens
        time.sleep(0.1)
        assert not srv._aborted
        eng.abort(rid=batch + "_0")
        worker.join(30)
        eng.close()
    assert [g.finish_reason for g in result] == ["abort", "length"] and len(result[1].token_ids) == 20


def test_sampling_params_use_sglang_names():
    out = sampling_params_to_sglang(
        SamplingParams(max_new_tokens=9, temperature=0.7, top_p=0.9, stop_token_ids=(2, 5))
    )
    assert out == {
        "max_new_tokens": 9,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "stop_token_ids": [2, 5],
    }
    assert "stop_token_ids" not in sampling_params_to_sglang(SamplingParams(max_new_tokens=1))
    with pytest.raises(TypeError, match="SamplingParams"):
        sampling_params_to_sglang({"max_new_tokens": 1})


def test_a_trimmed_stop_token_is_caught(engine, tiny_models_float64):
    # What the adapter would get if it left SGLang's default no_stop_trim=False: output_ids without the stop token.
    prompt = PROMPTS[0]
    stop = greedy_path(tiny_models_float64[0], prompt, 1)[0]
    payload = {
        "input_ids": [prompt],
        "sampling_params": {"max_new_tokens": 3, "top_k": 1, "stop_token_ids": [stop]},
        "return_logprob": True,
    }
    (out,) = engine._post("/generate", payload)
    assert out["output_ids"] == [] and out["meta_info"]["output_token_logprobs"][0][1] == stop
    with pytest.raises(ValueError, match="no_stop_trim"):
        generation_from_sglang(out, weight_version=0)


def test_generation_from_sglang_checks_the_answer():
    meta = {
        "finish_reason": {"type": "length", "length": 2},
        "output_token_logprobs": [[-0.5, 4, None], [-1.5, 6, None]],
    }
    g = generation_from_sglang({"text": "", "meta_info": {**meta, "weight_version": "3"}}, weight_version=1)
    assert (g.token_ids, g.log_probs, g.finish_reason, g.weight_version) == ([4, 6], [-0.5, -1.5], "length", 3)
    assert (
        generation_from_sglang({"meta_info": {**meta, "weight_version": "default"}}, weight_version=1).weight_version
        == 1
    )
    with pytest.raises(ValueError, match="return_logprob"):
        generation_from_sglang({"meta_info": {"finish_reason": {"type": "stop"}}}, weight_version=0)
    with pytest.raises(ValueError, match="finish_reason"):
        generation_from_sglang({"meta_info": {**meta, "finish_reason": "stop"}}, weight_version=0)
    with pytest.raises(ValueError, match="triples"):
        generation_from_sglang({"meta_info": {**meta, "output_token_logprobs": [[-0.5]]}}, weight_version=0)


def test_saved_weights_are_an_hf_folder_transformers_loads(tmp_path, tiny_checkpoints):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[1])
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()  # tied: shared storage
    folder = save_hf_weights(state, tmp_path / "w", config_source=tiny_checkpoints[0])
    loaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert loaded.keys() == state.keys()
    for k, v in state.items():
        torch.testing.assert_close(loaded[k], v, rtol=0, atol=0)
    with pytest.raises(TypeError, match="lm_head.weight"):
        save_hf_weights({**state, "lm_head.weight": [1.0]}, tmp_path / "x", config_source=tiny_checkpoints[0])
    with pytest.raises(ValueError, match="config.json"):
        save_hf_weights(state, tmp_path / "y", config_source=tmp_path)


def test_seeded_sampling_resumes_with_the_saved_state(server):
    params = SamplingParams(max_new_tokens=6, temperature=1.5)
    eng = SGLangEngine(server.url, seed=11)
    state = eng.get_rng_state()
    first = [g.token_ids for g in eng.generate(PROMPTS, params)]
    second = [g.token_ids for g in eng.generate(PROMPTS, params)]
    assert first != second  # a new call draws new seeds
    resumed = SGLangEngine(server.url, seed=0)
    resumed.set_rng_state(state)
    assert [g.token_ids for g in resumed.generate(PROMPTS, params)] == first
    assert [g.token_ids for g in resumed.generate(PROMPTS, params)] == second
    with pytest.raises(ValueError, match="get_rng_state"):
        resumed.set_rng_state({"seed": 1})
    eng.close()
    resumed.close()


def test_explicit_sampling_seeds_replace_the_derived_ones(server):
    params = SamplingParams(max_new_tokens=6, temperature=1.5)
    eng = SGLangEngine(server.url, seed=11)
    plain = SGLangEngine(server.url)
    seeds = [5, 6, 5][: len(PROMPTS)]
    first = [g.token_ids for g in eng.generate(PROMPTS, params, sampling_seeds=seeds)]
    # The same seeds sample alike whatever the engine's own seed and call count.
    assert [g.token_ids for g in plain.generate(PROMPTS, params, sampling_seeds=seeds)] == first
    assert [g.token_ids for g in plain.generate(PROMPTS[:1], params, sampling_seeds=seeds[:1])] == first[:1]
    assert server.sampling_seeds[-1] == 5
    for bad in (seeds[:-1] or [1, 2], [1.5] * len(PROMPTS), [True] * len(PROMPTS)):
        with pytest.raises(ValueError, match="sampling_seeds must hold one int per prompt"):
            eng.generate(PROMPTS, params, sampling_seeds=bad)
    eng.close()
    plain.close()


def test_sampling_seeds_differ_across_prompts_and_calls():
    seeds = {sampling_seed(3, call, i) for call in range(20) for i in range(64)}
    assert len(seeds) == 20 * 64 and all(0 <= s < 2**31 for s in seeds)
    assert sampling_seed(3, 0, 0) != sampling_seed(4, 0, 0)


def test_an_http_error_survives_pickling_as_ray_sends_it():
    import pickle

    from runtime.engines.sglang_engine import SGLangHTTPError

    err = pickle.loads(pickle.dumps(SGLangHTTPError("POST", "http://h:1/generate", 503, "No available workers")))
    assert (err.method, err.url, err.status_code, err.message) == (
        "POST",
        "http://h:1/generate",
        503,
        "No available workers",
    )
    assert str(err) == "SGLang POST http://h:1/generate failed with HTTP 503: No available workers"


def test_a_server_restarted_in_place_after_an_update_fails_the_health_check_naming_both_versions(tiny_checkpoints):
    # An external server that restarts comes back on its port with its launch weights and answers every check of
    # liveness; only its weight version (/model_info) tells that it no longer holds what was loaded into it.
    port = free_port()
    with FakeSGLangServer(tiny_checkpoints[0], port=port) as srv:
        eng = SGLangEngine(srv.url, timeout=30, startup_timeout=10)
        assert eng.health()  # (before any update: the label it reports now, "default", is the one to keep)
    with FakeSGLangServer(tiny_checkpoints[0], port=port):
        assert eng.health()  # restarted before any update: it holds the weights it held
        eng.update_weights_from_disk(str(tiny_checkpoints[1]), weight_version=3)
        assert eng.health()
    with FakeSGLangServer(tiny_checkpoints[0], port=port) as srv:
        assert srv.weight_version == "default"
        with pytest.raises(SGLangWeightsLost) as err:
            eng.health()
        assert str(err.value) == (
            f"SGLang server http://127.0.0.1:{port} reports weight version 'default', not '3' (the one loaded into it "
            "last): it restarted with its launch weights, or another client updated it"
        )
        # Loading the weights again (what the engine group's restart does) makes it healthy.
        eng.update_weights_from_disk(str(tiny_checkpoints[1]), weight_version=3)
        assert eng.health()
    eng.close()


def test_a_health_check_while_an_update_moves_the_label_is_not_a_death(tiny_checkpoints, monkeypatch):
    # The health check runs beside the engine's other calls: one that lands after the server took the new version but
    # before the engine recorded it sees the labels differ, and must not call that a restart.
    with FakeSGLangServer(tiny_checkpoints[0]) as srv:
        eng = SGLangEngine(srv.url, timeout=30, startup_timeout=10)
        assert eng.health()
        post, seen = eng._post, []

        def post_then_check(path, payload):
            answer = post(path, payload)
            if path == "/update_weights_from_disk":
                seen.append((srv.weight_version, eng.weight_version(), eng.health()))
            return answer

        monkeypatch.setattr(eng, "_post", post_then_check)
        eng.update_weights_from_disk(str(tiny_checkpoints[1]), weight_version=4)
        assert seen == [("4", 0, True)]  # the server moved, the engine not yet: no death
        assert eng.health() and eng.weight_version() == 4
        eng.close()
