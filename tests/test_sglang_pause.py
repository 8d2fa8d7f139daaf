"""Pausing an SGLang server's generation around a weight update (SGLang 0.5.23's ``/pause_generation`` and
``/continue_generation``, as slime pauses), against the fake server (``tests/fake_sglang.py``): what each mode does to
a request in flight, its weight-version spans, and the weight-update session and lock every update goes through.

A request is held in flight deterministically: the fake holds decoding after ``HOLD_AT`` tokens while a file exists,
and reports which requests it holds; nothing here waits on wall-clock luck. Log-probs are compared with a float64
forward pass of the tiny models (the fake computes in float32: ``atol=1e-5``, as in ``tests/test_sglang_engine.py``).
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch
from fake_sglang import NOT_FLUSHED, FakeSGLangServer, weight_version_spans
from transformers import AutoModelForCausalLM

from runtime.engines import SamplingParams
from runtime.engines.sglang_engine import PAUSE_MODE, SGLangEngine, SGLangHTTPError

PROMPT = [1, 5, 6, 7]
HOLD_AT, LENGTH = 3, 8
# Greedy (top_k=1) so that the path is the models'; the log-probs stay those of the tempered distribution.
GREEDY = SamplingParams(max_new_tokens=LENGTH, top_k=1)


@pytest.fixture
def held(tiny_checkpoints, tmp_path):
    """A fake server on model A that holds decoding after HOLD_AT tokens while ``hold`` exists, and an engine."""
    hold = tmp_path / "hold"
    hold.touch()
    with FakeSGLangServer(tiny_checkpoints[0], hold_at=HOLD_AT, hold_file=hold) as srv:
        eng = SGLangEngine(srv.url, timeout=60)
        yield srv, eng, hold
        hold.unlink(missing_ok=True)
        eng.close()


def _start(eng, srv, prompts=(PROMPT,)):
    """Generate ``prompts`` in a thread; return it and its result list once every request is held."""
    result: list = []
    worker = threading.Thread(target=lambda: result.extend(eng.generate([list(p) for p in prompts], GREEDY)))
    worker.start()
    _until(lambda: len(srv.held) == len(prompts), "the requests to be held")
    return worker, result


def _until(condition, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@torch.no_grad()
def greedy(model, prompt, n, *, past=None, fed=None):
    """``n`` greedy tokens after ``prompt`` and each one's log-prob (temperature 1); with ``past`` (the cache of
    ``fed`` tokens), decoding goes on from that cache instead of a fresh prefill."""
    ids, lps = [], []
    if past is None:
        out = model(torch.tensor([prompt]), use_cache=True)
    else:
        out = model(torch.tensor([prompt[len(fed) :]]), past_key_values=past, use_cache=True)
    for _ in range(n):
        logits = torch.log_softmax(out.logits[0, -1], -1)
        token = int(logits.argmax())
        ids.append(token)
        lps.append(float(logits[token]))
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return ids, lps


def _close(got, want):
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), atol=1e-5, rtol=0
    )


def test_a_retract_pause_lets_the_update_in_at_once_and_the_request_goes_on_with_the_new_weights(
    held, tiny_models_float64, tiny_checkpoints
):
    srv, eng, hold = held
    worker, result = _start(eng, srv)
    assert PAUSE_MODE == "retract"
    eng.pause_generation()
    # The update runs while the request is still decoding (held mid-way): the pause let it past the lock.
    eng.update_weights_from_disk(str(tiny_checkpoints[1]), weight_version=1)
    assert srv.weight_version == "1" and srv.held and srv._running
    eng.continue_generation()
    hold.unlink()
    worker.join(60)
    (g,) = result
    first, first_lps = greedy(tiny_models_float64[0], PROMPT, HOLD_AT)
    # Retracted: the rest is model B's, prefilled again over the prompt and the tokens so far (no old KV left).
    rest, rest_lps = greedy(tiny_models_float64[1], PROMPT + first, LENGTH - HOLD_AT)
    assert g.token_ids == first + rest and g.finish_reason == "length"
    _close(g.log_probs, first_lps + rest_lps)
    assert g.extra["weight_versions"] == [
        {"version": "default", "start": 0, "end": HOLD_AT},
        {"version": "1", "start": HOLD_AT, "end": LENGTH},
    ]
    assert g.extra["versions"] == [0, 1] and g.weight_version == 1
    assert srv.pauses == ["retract"]


def test_an_in_place_pause_keeps_the_old_kv_cache_and_fails_the_updates_flush(
    held, tiny_models_float64, tiny_checkpoints
):
    srv, eng, hold = held
    worker, result = _start(eng, srv)
    eng.pause_generation("in_place")
    # SGLang flushes the cache after an update, which a request paused in place (still running) makes fail.
    with pytest.raises(SGLangHTTPError, match="cache was not flushed") as err:
        eng.update_weights_from_disk(str(tiny_checkpoints[1]), weight_version=1)
    assert err.value.message == NOT_FLUSHED and srv.weight_version == "1"  # (the weights are loaded all the same)
    eng.continue_generation()
    hold.unlink()
    worker.join(60)
    (g,) = result
    first, first_lps = greedy(tiny_models_float64[0], PROMPT, HOLD_AT)
    # The cache of model A over the prompt and the tokens fed so far (the last sampled one is fed next, by B).
    fed = PROMPT + first[:-1]
    with torch.no_grad():
        past = tiny_models_float64[0](torch.tensor([fed]), use_cache=True).past_key_values
    rest, rest_lps = greedy(tiny_models_float64[1], PROMPT + first, LENGTH - HOLD_AT, past=past, fed=fed)
    assert g.token_ids == first + rest
    _close(g.log_probs, first_lps + rest_lps)
    # Mixed: not model B's log-probs of those tokens (B over the whole sequence, as a retract would give).
    with torch.no_grad():
        logits = tiny_models_float64[1](torch.tensor([PROMPT + first + rest])).logits[0, len(PROMPT + first) - 1 : -1]
    fresh = torch.log_softmax(logits, -1).gather(-1, torch.tensor(rest)[:, None]).squeeze(-1)
    assert (fresh - torch.tensor(rest_lps)).abs().max() > 1e-3


def test_an_abort_pause_cuts_the_request_off_and_holds_new_ones_until_generation_continues(held, tiny_models_float64):
    srv, eng, hold = held
    worker, result = _start(eng, srv)
    hold.unlink()  # (the abort ends it at its next step)
    eng.pause_generation("abort")  # answers once nothing is in flight
    worker.join(60)
    (cut,) = result
    assert cut.finish_reason == "abort" and HOLD_AT <= len(cut.token_ids) < LENGTH
    later: list = []
    waiting = threading.Thread(target=lambda: later.extend(eng.generate([PROMPT], GREEDY)))
    waiting.start()
    _until(lambda: srv.requests.get("/generate", 0) == 2, "the second request to arrive")
    waiting.join(0.5)
    assert waiting.is_alive() and not srv._running  # it waits at the pause, not in the scheduler
    eng.continue_generation()
    waiting.join(60)
    assert later[0].token_ids == greedy(tiny_models_float64[0], PROMPT, LENGTH)[0]


def test_an_update_without_a_pause_waits_for_the_requests_in_flight(held, tiny_checkpoints):
    srv, eng, hold = held
    worker, result = _start(eng, srv)
    update = threading.Thread(target=lambda: eng.update_weights_from_disk(str(tiny_checkpoints[1]), weight_version=1))
    update.start()
    _until(lambda: srv._updates_waiting == 1, "the update to wait for the lock")
    assert srv.weight_version == "default"  # held back behind the request, which still decodes
    hold.unlink()
    worker.join(60)
    update.join(60)
    assert srv.weight_version == "1"
    (g,) = result
    assert g.extra["versions"] == [0] and len(g.token_ids) == LENGTH


def test_updates_from_a_group_or_handles_need_a_weight_update_session(held):
    srv, eng, _ = held
    body = {"serialized_named_tensors": ["eA=="], "weight_version": "1"}
    refused = httpx.post(srv.url + "/update_weights_from_tensor", json=body, timeout=30)
    assert refused.status_code == 400 and "between begin_weight_update() and end_weight_update()" in refused.text
    assert httpx.post(srv.url + "/end_weight_update", json={}, timeout=30).status_code == 400
    assert httpx.post(srv.url + "/begin_weight_update", json={}, timeout=30).status_code == 200
    twice = httpx.post(srv.url + "/begin_weight_update", json={}, timeout=30)
    assert twice.status_code == 400 and "already open" in twice.text
    assert httpx.post(srv.url + "/end_weight_update", json={}, timeout=30).json() == {
        "success": True,
        "message": "Success",
    }
    bad = httpx.post(srv.url + "/pause_generation", json={"mode": "sleep"}, timeout=30)
    assert bad.status_code == 400 and "sleep" in bad.text
    with pytest.raises(ValueError, match="mode must be one of"):
        eng.pause_generation("sleep")


def test_the_engine_opens_a_session_per_update_and_closes_it_when_a_bucket_fails(held, tiny_checkpoints):
    from runtime.engines import weight_transfer

    srv, eng, _ = held
    state = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[1]).state_dict()
    names = [n for n in state if n != "lm_head.weight"]
    begun = srv.requests.get("/begin_weight_update", 0)
    for part, version in ((names[:3], None), (names[3:], 4)):
        assert srv.weight_session == (version is not None)  # open from the first bucket on
        payload = weight_transfer.serialize_named_tensors([(n, state[n]) for n in part])
        eng.update_weights_from_tensor(payload, weight_version=version)
    assert not srv.weight_session and srv.requests["/begin_weight_update"] == begun + 1
    assert srv.weight_version == "4"
    wrong = {names[0]: torch.zeros(3, 3)}
    with pytest.raises(SGLangHTTPError, match="shape mismatch"):
        eng.update_weights_from_tensor(weight_transfer.serialize_named_tensors(list(wrong.items())))
    assert not srv.weight_session  # closed: the next update opens its own


@pytest.mark.parametrize(
    ("events", "tokens", "want"),
    [
        ([], 0, [("v0", 0, 0)]),
        ([], 5, [("v0", 0, 5)]),
        ([("v1", 2)], 5, [("v1", 0, 2), ("v0", 2, 5)]),
        ([("v1", 2), ("v1", 4)], 5, [("v1", 0, 4), ("v0", 4, 5)]),
        ([("v1", 2), ("v2", 2)], 5, [("v1", 0, 2), ("v0", 2, 5)]),
        ([("v1", 5)], 5, [("v1", 0, 5)]),
    ],
)
def test_weight_version_spans_follow_sglangs(events, tokens, want):
    got = weight_version_spans(events, "v0", tokens)
    assert got == [{"version": v, "start": a, "end": b} for v, a, b in want]
