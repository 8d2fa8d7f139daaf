"""A stand-in for an SGLang server, for tests only: SGLang itself cannot run here (no GPU, and its kernel wheel
alone is over 500 MB), so this serves the same native HTTP endpoints with the same JSON shapes as SGLang 0.5.23 (read
from that release's ``srt/entrypoints/http_server.py``, ``srt/managers/io_struct.py``, ``tokenizer_manager.py`` and
``scheduler.py``) and really generates with a transformers model.

What it reproduces, because the adapter depends on it:

- ``/generate`` takes ``input_ids`` (one prompt, or a list of prompts answered by a list), ``sampling_params`` (one
  object for all prompts, or one per prompt) and the logprob fields; it samples with temperature, top-k and top-p
  (top-k/top-p truncate and renormalise the tempered distribution) and reports SGLang's default log-probs:
  ``log_softmax(logits / temperature)`` over the whole vocabulary, taken before the truncation (plain
  ``log_softmax(logits)`` for greedy, temperature 0). A response ends at the model's eos (unless ``ignore_eos``) or any
  of ``stop_token_ids``, or after the token that puts one of the ``stop`` strings into the decoded tail of its output
  (a window of the longest stop string's token count plus one); the stop token is trimmed from ``output_ids`` and
  ``text`` unless ``no_stop_trim``, but always kept in ``output_token_logprobs``, and a stop string from ``text``
  only, as in SGLang. With ``logprob_start_len`` k >= 0 it also reports ``input_token_logprobs`` of the prompt from
  position k (the first log-prob None, the rest of the raw logits, no temperature: SGLang's); ``max_new_tokens`` 0
  scores the prompt alone (a teacher server for on-policy distillation).
- Unknown request fields (top level or in ``sampling_params``) and wrongly typed ones are refused with HTTP 400 and
  SGLang's error body, the way its dataclass/pydantic parsing refuses them, so adapter mistakes fail loudly.
- ``/update_weights_from_disk`` loads the safetensors of an HF folder into the live model as SGLang's model classes
  do: the names it holds (``model.safetensors.index.json``'s files if there is one), ``lm_head.weight`` skipped when
  the embeddings are tied, unknown names skipped, missing ones left as they were; a shape mismatch fails the update
  (HTTP 400, the old weights kept). The memory-occupation endpoints switch a "released" state in which ``/generate``
  is refused (a released SGLang has no weights or KV cache).
- ``/abort_request`` (``rid`` or ``abort_all``) ends the requests of every ``/generate`` call in flight; each still
  answers, with HTTP 200: a running request with the tokens decoded so far plus the one of the step the abort lands
  in, and ``finish_reason`` ``{"type": "abort", "message": "Aborted", "status_code": null, "err_type": null}``; a
  request still queued (the fake runs a batch's prompts one after another, so the later ones wait) with no tokens and
  ``{"type": "abort", "message": "Abort in waiting queue"}``. As in SGLang, ``rid`` must be the exact id of a request
  in flight and then aborts every request whose id starts with it; an empty ``rid`` without ``abort_all`` does
  nothing.
- ``/pause_generation`` (``PauseGenerationReqInput.mode``: ``abort``, ``retract`` or ``in_place``) and
  ``/continue_generation``, as SGLang 0.5.23's tokenizer manager and scheduler do them: while paused, new
  ``/generate`` requests wait (``is_pause``); ``abort`` aborts every request in flight (each answers what it has) and
  answers once they all have; ``retract`` and ``in_place`` stop the decoding loop where it is (the scheduler runs no
  batch), ``retract`` dropping each running request's KV cache, recomputed from its prompt and the tokens it has so
  far with the weights of the moment it runs again, ``in_place`` keeping it (the tokens sampled after a weight update
  then attend to keys and values of the old weights). ``/health_generate`` cannot generate while paused: it waits for
  ``/continue_generation`` and answers 503 after SGLang's 20 s.
- Weight updates as SGLang 0.5.23 orders them: ``/update_weights_from_distributed`` and ``/update_weights_from_tensor``
  are refused outside a weight-update session (``/begin_weight_update`` ... ``/end_weight_update``). An update (the
  session's two calls included) while generation is not paused takes the model-update lock as its writer: it waits
  until every ``/generate`` in flight has answered, and requests that come meanwhile wait behind it; while paused it
  runs at once. After loading, the cache is flushed (``flush_cache``, on by default), which fails the update call
  (the weights are loaded all the same) while a request is running: a request paused ``in_place`` is, a retracted
  one waits and does not count while paused. A new weight version is recorded on every live request that has tokens,
  and each answer's ``meta_info.weight_versions`` lists the spans of its tokens by the version that sampled them
  (SGLang's ``compute_weight_version_spans``), ``weight_version`` the last span's.
- ``/model_info`` and ``/server_info`` (and their deprecated ``/get_*`` aliases) report ``model_path``,
  ``weight_version`` and the launch ``dtype``; there is no ``/get_weight_version`` (0.5.23 has none).

- LoRA, when launched with ``--enable-lora`` (else loading is refused, as SGLang refuses it): ``/load_lora_adapter``
  (``lora_name``, ``lora_path``: a peft adapter folder) applies the adapter to the current base weights,
  ``/unload_lora_adapter`` (``lora_name``) drops it, both answering SGLang's ``{"success", "error_message",
  "loaded_adapters"}`` (HTTP 400 on failure: a name already loaded or unknown, an unreadable folder); ``/generate``'s
  ``lora_path`` (one name for the batch, or one per prompt) generates with that adapter, an unknown name is refused.

A test can hold decoding where it wants it (``hold_at``, ``hold_file``, ``hold_after``; ``FAKE_SGLANG_HOLD_AT``,
``FAKE_SGLANG_HOLD_FILE`` and ``FAKE_SGLANG_HOLD_AFTER`` for a launched server): every request after the first
``hold_after`` (counted per prompt) that has sampled ``hold_at`` tokens waits, before its next decoding step, while the
file ``hold_file`` exists, or without a file until the server's weight version changes. ``/server_info`` reports the
ids of the requests held (``internal_states[0]["held"]``), so a test knows, without timing, that a generation is in
flight; a weight sync that waited for held requests to finish would never return.

Not reproduced: text prompts (the fake has no chat template or tokenizer round trip), streaming, multimodal inputs,
sessions, the OpenAI-compatible routes and the router. Sampling runs prompt by prompt on the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from runtime.engines import sglang_api, weight_transfer

# Field names of SGLang's GenerateReqInput that this fake accepts; any other name is refused like an unknown field.
GENERATE_FIELDS = {
    "text", "input_ids", "input_embeds", "sampling_params", "rid", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs", "stream", "log_metrics",
    "return_hidden_states", "lora_path", "custom_logit_processor", "session_params", "priority", "bootstrap_host",
    "bootstrap_port", "bootstrap_room", "data_parallel_rank", "image_data", "audio_data", "video_data", "modalities",
    "return_routed_experts",
}  # fmt: skip
# Field names of SGLang's SamplingParams.
SAMPLING_FIELDS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "custom_params", "stream_interval", "logit_bias", "sampling_seed",
}  # fmt: skip
# Fields every request struct has from SGLang's BaseReq.
BASE_REQ_FIELDS = {"rid", "http_worker_ipc"}
# Fields of UpdateWeightFromDiskReqInput.
UPDATE_FROM_DISK_FIELDS = BASE_REQ_FIELDS | {
    "model_path", "load_format", "abort_all_requests", "weight_version", "is_async", "torch_empty_cache",
    "keep_pause", "recapture_cuda_graph", "token_step", "flush_cache", "manifest",
}  # fmt: skip
INIT_GROUP_FIELDS = BASE_REQ_FIELDS | {
    "master_address", "master_port", "rank_offset", "world_size", "group_name", "backend",
}  # fmt: skip
UPDATE_FROM_DISTRIBUTED_FIELDS = BASE_REQ_FIELDS | {
    "names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests", "weight_version", "load_format",
    "selector", "torch_empty_cache",
}  # fmt: skip
UPDATE_FROM_TENSOR_FIELDS = BASE_REQ_FIELDS | {
    "serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests", "weight_version", "selector",
    "torch_empty_cache",
}  # fmt: skip
DESTROY_GROUP_FIELDS = BASE_REQ_FIELDS | {"group_name"}
PAUSE_FIELDS = BASE_REQ_FIELDS | {"mode"}
CONTINUE_FIELDS = BASE_REQ_FIELDS | {"torch_empty_cache"}
BEGIN_UPDATE_FIELDS = BASE_REQ_FIELDS | {"selector"}
END_UPDATE_FIELDS = BASE_REQ_FIELDS
# PauseGenerationReqInput.mode's values (read from SGLang's class where it imports) and its default.
PAUSE_MODES = ("abort", "retract", "in_place")
# SGLang's HEALTH_CHECK_TIMEOUT: /health_generate answers 503 when no token came back within it.
HEALTH_CHECK_TIMEOUT_S = 20.0
NO_SESSION = "{} must run between begin_weight_update() and end_weight_update()"
NOT_FLUSHED = (
    "Weights were updated, but the cache was not flushed because requests are still running or queued. Retract or "
    "finish them, then call /flush_cache."
)
# Fields of LoadLoRAAdapterReqInput and UnloadLoRAAdapterReqInput.
LOAD_LORA_FIELDS = BASE_REQ_FIELDS | {"lora_name", "lora_path", "pinned", "lora_id"}
UNLOAD_LORA_FIELDS = BASE_REQ_FIELDS | {"lora_name", "lora_id"}
GET_WEIGHTS_FIELDS = BASE_REQ_FIELDS | {"name", "truncate_size"}
MEMORY_TAGS = {"weights", "kv_cache", "cuda_graph"}
MEMORY_FIELDS = BASE_REQ_FIELDS | {"tags"}
ABORT_FIELDS = BASE_REQ_FIELDS | {"abort_all", "finished_reason", "abort_message", "weight_versions"}
# FINISH_ABORT().to_json() (a running request cut by /abort_request) and the tokenizer manager's answer for a request
# aborted while still queued.
ABORT_RUNNING = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORT_QUEUED = {"type": "abort", "message": "Abort in waiting queue"}
# Values of these sampling fields change sampling in ways the fake does not implement: refused unless neutral.
NEUTRAL_SAMPLING = {
    "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "min_new_tokens": 0, "n": 1, "stop_regex": None, "json_schema": None, "regex": None, "ebnf": None,
    "structural_tag": None, "logit_bias": None, "custom_params": None,
}  # fmt: skip
_SAMPLING_EPS = 1e-6


# Fields the SGLang router adds to every /generate body it forwards; SGLang's own parse drops them.
ROUTER_ADDED_FIELDS = {"model"}


def request_fields(what: str, fallback: set[str]) -> set[str]:
    """The field names of SGLang's request class ``what`` (``sglang.srt.managers.io_struct``) where SGLang imports,
    else the hand-written ``fallback`` (which ``tests/test_fake_sglang_strict.py`` checks against the real class)."""
    api = sglang_api.load()
    if api is None:
        return fallback
    cls = getattr(api.io_struct, what)
    if hasattr(cls, "__struct_fields__"):
        names = set(cls.__struct_fields__)
    else:
        names = {f.name for f in dataclasses.fields(cls)}
    return names | ROUTER_ADDED_FIELDS if what == "GenerateReqInput" else names


def pause_modes() -> tuple[str, ...]:
    """The values of ``PauseGenerationReqInput.mode`` (its ``Literal``, where SGLang imports; else :data:`PAUSE_MODES`,
    which ``tests/test_fake_sglang_strict.py`` checks against it)."""
    api = sglang_api.load()
    if api is None:
        return PAUSE_MODES
    import typing

    return typing.get_args(typing.get_type_hints(api.io_struct.PauseGenerationReqInput)["mode"])


def weight_version_spans(events: list[tuple[str, int]], current: str, num_tokens: int) -> list[dict[str, Any]]:
    """SGLang's ``meta_info.weight_versions`` of a request: ``events`` holds ``(old version, tokens it had)`` for each
    weight update while the request was live; the spans ``{"version", "start", "end"}`` cover its ``num_tokens``
    output tokens by the version that sampled them (``compute_weight_version_spans`` and
    ``add_weight_versions_to_meta_info`` of SGLang 0.5.23: an update before the first token leaves no span)."""
    spans: list[dict[str, Any]] = []
    for version, end in [*events, (current, num_tokens)]:
        end = min(end, num_tokens)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return [span for span in spans if span["start"] < num_tokens or span["start"] == 0]


@dataclasses.dataclass
class _LiveRequest:
    """What the scheduler keeps of a request that is decoding: its token count, whether a ``retract`` pause dropped
    its KV cache, and the weight updates it lived through (``(old version, tokens it had)``)."""

    tokens: int = 0
    retracted: bool = False
    retractions: int = 0
    events: list[tuple[str, int]] = dataclasses.field(default_factory=list)


class BadRequest(ValueError):
    """A request SGLang would refuse with HTTP 400."""


def _validation_error(message: str) -> web.Response:
    # SGLang turns request-validation errors into HTTP 400 with an OpenAI-style error object.
    body = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
    return web.json_response(body, status=400)


def _failure(message: str) -> web.Response:
    # The weight-update routes answer {"success", "message"}, with HTTP 400 on failure.
    return web.json_response({"success": False, "message": message}, status=400)


def _handler_error(message: str) -> web.Response:
    # Errors raised while serving a parsed request come back as {"error": {"message": ...}}.
    return web.json_response({"error": {"message": message}}, status=400)


def _check_fields(obj: Any, allowed: set[str], what: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise BadRequest(f"{what} must be a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise BadRequest(f"{what}: unexpected keyword argument(s) {unknown}")
    return obj


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise BadRequest(f"{name} has {len(value)} entries for a batch of {n}")
        return value
    return [value] * n


class _Sampling:
    """One request's validated sampling settings (SGLang's defaults where the request leaves a field out)."""

    def __init__(self, raw: Any, *, vocab_size: int):
        raw = _check_fields(raw if raw is not None else {}, SAMPLING_FIELDS, "sampling_params")
        for name, neutral in NEUTRAL_SAMPLING.items():
            if raw.get(name, neutral) not in (neutral, None):
                raise BadRequest(f"sampling_params.{name}={raw[name]!r} is not supported by the fake server")
        self.max_new_tokens = raw.get("max_new_tokens", 128)
        self.temperature = raw.get("temperature", 1.0)
        self.top_p = raw.get("top_p", 1.0)
        self.top_k = raw.get("top_k", -1)
        self.ignore_eos = raw.get("ignore_eos", False)
        self.no_stop_trim = raw.get("no_stop_trim", False)
        self.skip_special_tokens = raw.get("skip_special_tokens", True)
        self.sampling_seed = raw.get("sampling_seed")
        stop = raw.get("stop_token_ids") or []
        # SGLang's SamplingParams takes one stop string or a list of them.
        stop_strs = raw.get("stop")
        stop_strs = [] if stop_strs is None else [stop_strs] if isinstance(stop_strs, str) else stop_strs
        if not isinstance(stop_strs, list) or not all(isinstance(x, str) for x in stop_strs):
            raise BadRequest(f"stop must be a string or a list of strings, got {raw.get('stop')!r}")
        self.stop_strs = stop_strs
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise BadRequest(f"max_new_tokens must be at least 0, got {self.max_new_tokens!r}.")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise BadRequest(f"temperature must be a non-negative finite number, got {self.temperature!r}.")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise BadRequest(f"top_p must be in (0, 1], got {self.top_p!r}.")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {self.top_k!r}.")
        for name in ("ignore_eos", "no_stop_trim", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise BadRequest(f"sampling_params.{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(stop, list) or not all(_is_int(t) and 0 <= t < vocab_size for t in stop):
            raise BadRequest(f"stop_token_ids must be a list of token ids below {vocab_size}, got {stop!r}")
        if self.sampling_seed is not None and not _is_int(self.sampling_seed):
            raise BadRequest(f"sampling_seed must be an int, got {self.sampling_seed!r}")
        api = sglang_api.load()
        if api is not None:
            # SGLang's own check of a request's sampling parameters (the scheduler's, before it queues the request).
            try:
                api.SamplingParams(**raw).verify(vocab_size)
            except (TypeError, ValueError) as e:
                raise BadRequest(str(e)) from e
        self.stop_token_ids = set(stop)
        self.greedy = self.temperature < _SAMPLING_EPS


class FakeSGLangServer:
    """An HTTP server on ``host:port`` (port 0: a free one) in a background thread, serving a HF model folder.

    ``startup_delay`` seconds of ``503`` from the health routes mimic a server still loading; ``token_delay`` slows
    each decoding step so that a test can abort a running request; ``hold_at``, ``hold_file`` and ``hold_after``
    hold decoding (see the module docstring). Use as a context manager; ``url`` is the base URL.
    ``requests`` counts requests per path; ``released`` and ``weight_version`` expose the server's state to tests.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        seed: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        startup_delay: float = 0.0,
        token_delay: float = 0.0,
        enable_lora: bool = False,
        enable_return_routed_experts: bool = False,
        hold_at: int | None = None,
        hold_file: str | Path | None = None,
        hold_after: int = 0,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = str(model_path)
        # As if launched with --dtype float32: /server_info reports it, and the model computes in it.
        self.dtype = "float32"
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.vocab_size = self.model.config.vocab_size
        self.eos_token_ids = {self.tokenizer.eos_token_id}
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        self.host, self.port = host, port
        self.startup_delay, self.token_delay = startup_delay, token_delay
        self.weight_version = "default"
        # --enable-lora, and the loaded adapters by name: (folder, the base model with the adapter merged in).
        self.enable_lora = enable_lora
        # --enable-return-routed-experts: a request's return_routed_experts gets meta_info["routed_experts"] (SGLang's
        # base64 of int32 [prompt + output tokens - 1, num_hidden_layers, topk]); without it the field is absent.
        self.enable_return_routed_experts = enable_return_routed_experts
        self.adapters: dict[str, tuple[str, Any]] = {}
        # The flags it was launched with (main()), reported by /server_info as SGLang reports its ServerArgs.
        self.launch_args: dict[str, Any] = {}
        # Weight-update groups by name, and [bytes, tensors] of each bucket received over them.
        self.weight_groups: dict[str, Any] = {}
        self.received_buckets: list[int] = []
        self.released_tags: set[str] = set()
        self.requests: dict[str, int] = {}
        # Request ids of the /generate calls in flight (running or queued), and those of them aborted.
        self._running: set[str] = set()
        # The most /generate requests in flight at once, and the sampling_seed of every request (None: none sent).
        self.peak_running = 0
        self.sampling_seeds: list[int | None] = []
        self._aborted: set[str] = set()
        self._model_lock = threading.Lock()
        # /pause_generation's mode while paused (None: not paused). The scheduler runs batches unless a retract or
        # in_place pause stopped it; the requests decoding now, by id; /generate calls past the pause gate (readers of
        # the model-update lock) and weight updates waiting for them (its writer); the open weight-update session.
        self.pause_mode: str | None = None
        self.pauses: list[str] = []
        self._scheduling = threading.Event()
        self._scheduling.set()
        self._live: dict[str, _LiveRequest] = {}
        self._state_lock = threading.Lock()
        self._generating = 0
        self._updates_waiting = 0
        self._gate: asyncio.Condition | None = None
        self.weight_session = False
        self.hold_at, self.hold_file = hold_at, None if hold_file is None else Path(hold_file)
        self.hold_after = hold_after
        self.held: set[str] = set()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started_at = 0.0
        self._request_counter = 0

    # -- lifecycle ------------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> FakeSGLangServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> FakeSGLangServer:
        # SGLang's request classes, imported before serving (a first import on the event loop would stall it).
        sglang_api.load()
        self._thread = threading.Thread(target=self._serve, name="fake-sglang", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("fake SGLang server did not start within 30 s")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            self._loop = self._thread = None

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._gate = asyncio.Condition()
        app = web.Application(middlewares=[self._count])
        app.add_routes(
            [
                web.get("/health", self._health),
                web.get("/health_generate", self._health),
                web.get("/model_info", self._model_info),
                web.get("/get_model_info", self._model_info),
                web.get("/server_info", self._server_info),
                web.get("/get_server_info", self._server_info),
                web.post("/generate", self._generate),
                web.put("/generate", self._generate),
                web.get("/flush_cache", self._flush_cache),
                web.post("/flush_cache", self._flush_cache),
                web.post("/update_weights_from_disk", self._update_weights_from_disk),
                web.get("/release_memory_occupation", self._release),
                web.post("/release_memory_occupation", self._release),
                web.get("/resume_memory_occupation", self._resume),
                web.post("/resume_memory_occupation", self._resume),
                web.post("/abort_request", self._abort),
                web.post("/init_weights_update_group", self._init_weights_update_group),
                web.post("/update_weights_from_distributed", self._update_weights_from_distributed),
                web.post("/update_weights_from_tensor", self._update_weights_from_tensor),
                web.post("/destroy_weights_update_group", self._destroy_weights_update_group),
                web.post("/load_lora_adapter", self._load_lora_adapter),
                web.post("/unload_lora_adapter", self._unload_lora_adapter),
                web.get("/get_weights_by_name", self._get_weights_by_name),
                web.post("/get_weights_by_name", self._get_weights_by_name),
                web.post("/pause_generation", self._pause_generation),
                web.post("/continue_generation", self._continue_generation),
                web.post("/begin_weight_update", self._begin_weight_update),
                web.post("/end_weight_update", self._end_weight_update),
            ]
        )
        runner = web.AppRunner(app, access_log=None)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, self.host, self.port)
        loop.run_until_complete(site.start())
        self.port = runner.addresses[0][1]
        self._started_at = time.monotonic()
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

    @web.middleware
    async def _count(self, request: web.Request, handler):
        self.requests[request.path] = self.requests.get(request.path, 0) + 1
        return await handler(request)

    # -- routes ---------------------------------------------------------------------------------------------------

    async def _json_body(self, request: web.Request, allowed: set[str], what: str) -> dict[str, Any]:
        if not request.can_read_body:
            return {}
        try:
            body = await request.json()
        except ValueError as e:
            raise BadRequest(f"{what}: body is not JSON ({e})") from e
        body = _check_fields({} if body is None else body, request_fields(what, allowed), what)
        api = sglang_api.load()
        if what == "GenerateReqInput" and api is not None:
            # SGLang's own schema gate of /generate (the same check its HTTP server makes before anything else).
            problem = api.generate_contract_error(body)
            if problem is not None:
                raise BadRequest(problem)
        return body

    async def _health(self, request: web.Request) -> web.Response:
        if time.monotonic() - self._started_at < self.startup_delay:
            return web.Response(status=503)
        if request.path == "/health_generate":
            # Its one-token request waits at the pause gate like any other; no token within the timeout is a 503.
            async with self._gate:
                try:
                    await asyncio.wait_for(
                        self._gate.wait_for(lambda: self.pause_mode is None), HEALTH_CHECK_TIMEOUT_S
                    )
                except TimeoutError:
                    return web.Response(status=503)
        return web.Response(status=200)

    async def _model_info(self, request: web.Request) -> web.Response:
        config = self.model.config
        return web.json_response(
            {
                "model_path": self.model_path,
                "served_model_name": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.weight_version,
                "load_format": "auto",
                "reasoning_parser": None,
                "tool_call_parser": None,
                "disaggregation_mode": "null",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": config.model_type,
                "architectures": config.architectures,
            }
        )

    async def _server_info(self, request: web.Request) -> web.Response:
        # A few of the launch arguments SGLang reports (all of them, resolved), and the scheduler's numbers.
        return web.json_response(
            {
                **self.launch_args,
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "dtype": self.dtype,
                "random_seed": self.seed,
                "enable_memory_saver": True,
                "launch_command": f"sglang.launch_server --model-path {self.model_path} --dtype {self.dtype}",
                "status": "ready",
                "max_total_num_tokens": 4096,
                # SGLang's scheduler reports free-form internal state here; the fake reports its request counts.
                "internal_states": [
                    {
                        "requests": dict(self.requests),
                        "received_buckets": list(self.received_buckets),
                        "peak_running_requests": self.peak_running,
                        "sampling_seeds": list(self.sampling_seeds),
                        "held": sorted(self.held),
                        "pauses": list(self.pauses),
                    }
                ],
                "version": "0.5.23",
                "frontend": "python",
            }
        )

    async def _flush_cache(self, request: web.Request) -> web.Response:
        # SGLang refuses to flush while requests are running or waiting.
        if not self._flushable():
            return web.Response(text="Flush cache failed.\n", status=400)
        text = (
            "Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n"
        )
        return web.Response(text=text, status=200)

    async def _release(self, request: web.Request) -> web.Response:
        return await self._memory(request, release=True)

    async def _resume(self, request: web.Request) -> web.Response:
        return await self._memory(request, release=False)

    async def _memory(self, request: web.Request, *, release: bool) -> web.Response:
        try:
            what = f"{'Release' if release else 'Resume'}MemoryOccupationReqInput"
            body = await self._json_body(request, MEMORY_FIELDS, what)
            tags = body.get("tags")
            if tags is not None and (not isinstance(tags, list) or not set(tags) <= MEMORY_TAGS):
                raise BadRequest(f"tags must be null or a list drawn from {sorted(MEMORY_TAGS)}, got {tags!r}")
        except BadRequest as e:
            return _validation_error(str(e))
        if tags is None:
            # No tags: every region that can be released (resumed) now; refused only when there is none.
            tags = set(MEMORY_TAGS) - self.released_tags if release else set(self.released_tags)
            clash = set(MEMORY_TAGS) if not tags else set()
        else:
            tags = set(tags)
            clash = tags & self.released_tags if release else tags - self.released_tags
        if clash:
            return _handler_error(f"memory of {sorted(clash)} is already {'released' if release else 'resumed'}")
        self.released_tags = self.released_tags | tags if release else self.released_tags - tags
        return web.json_response(None)

    @property
    def released(self) -> bool:
        """Whether any memory is released (a server without its weights or KV cache cannot generate)."""
        return bool(self.released_tags)

    async def _abort(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request, ABORT_FIELDS, "AbortReq")
        except BadRequest as e:
            return _validation_error(str(e))
        rid = body.get("rid") or ""
        if body.get("abort_all"):
            self._aborted |= self._running
        elif rid in self._running:
            # The tokenizer manager forwards an id it knows; the scheduler aborts every request it prefixes.
            self._aborted |= {r for r in self._running if r.startswith(rid)}
        return web.Response(status=200)

    async def _pause_generation(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request, PAUSE_FIELDS, "PauseGenerationReqInput")
            mode = body.get("mode", "abort")
            if mode not in pause_modes():
                raise BadRequest(f"mode: Input should be {' or '.join(repr(m) for m in pause_modes())}, got {mode!r}")
        except BadRequest as e:
            return _validation_error(str(e))
        async with self._gate:
            self.pause_mode = mode
            self.pauses.append(mode)
        if mode == "abort":
            # The tokenizer manager aborts everything in flight and answers once no request holds the lock.
            self._aborted |= self._running
            async with self._gate:
                await self._gate.wait_for(lambda: self._generating == 0)
        else:
            await asyncio.get_running_loop().run_in_executor(None, self._stop_scheduling, mode == "retract")
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    def _stop_scheduling(self, retract: bool) -> None:
        """The scheduler stops between two decoding steps (under the model lock, which a step holds); ``retract``
        frees the KV cache of every running request, which goes back to the waiting queue."""
        with self._model_lock, self._state_lock:
            self._scheduling.clear()
            if retract:
                for live in self._live.values():
                    live.retracted = live.tokens > 0  # (one without tokens is waiting for its prefill)

    async def _continue_generation(self, request: web.Request) -> web.Response:
        try:
            await self._json_body(request, CONTINUE_FIELDS, "ContinueGenerationReqInput")
        except BadRequest as e:
            return _validation_error(str(e))
        async with self._gate:
            self.pause_mode = None
            self._scheduling.set()
            self._gate.notify_all()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    @contextlib.asynccontextmanager
    async def _model_update(self):
        """SGLang's model-update lock around a weight update: taken as its writer (the update waits until every
        ``/generate`` in flight has answered, and new ones wait behind it) unless generation is paused, when the
        update runs at once."""
        async with self._gate:
            writer = self.pause_mode is None
            if writer:
                self._updates_waiting += 1
                await self._gate.wait_for(lambda: self._generating == 0)
        try:
            yield
        finally:
            if writer:
                async with self._gate:
                    self._updates_waiting -= 1
                    self._gate.notify_all()

    def _flushable(self) -> bool:
        """Whether SGLang's cache flush runs now: nothing running or queued; while paused, queued (and retracted)
        requests do not count, a request paused in place does."""
        with self._state_lock:
            if self.pause_mode is None or self._scheduling.is_set():
                return not self._running
            return all(live.retracted or not live.tokens for live in self._live.values())

    def _set_weight_version(self, version: str | None) -> None:
        """Take ``version`` (None: keep the current one), noting the change on every live request with tokens."""
        if version is None or version == self.weight_version:
            return
        with self._state_lock:
            for live in self._live.values():
                if live.tokens:
                    live.events.append((self.weight_version, live.tokens))
            self.weight_version = version

    def _flushed_after_update(self, body: dict[str, Any]) -> bool:
        """The cache flush that ends a successful update (``flush_cache``, True by default)."""
        return not body.get("flush_cache", True) or self._flushable()

    async def _begin_weight_update(self, request: web.Request) -> web.Response:
        try:
            await self._json_body(request, BEGIN_UPDATE_FIELDS, "BeginWeightUpdateReqInput")
        except BadRequest as e:
            return _validation_error(str(e))
        async with self._model_update():
            if self.weight_session:
                return _failure("a weight-update session is already open; call end_weight_update() first")
            self.weight_session = True
        return web.json_response({"success": True, "message": "Success"})

    async def _end_weight_update(self, request: web.Request) -> web.Response:
        try:
            await self._json_body(request, END_UPDATE_FIELDS, "EndWeightUpdateReqInput")
        except BadRequest as e:
            return _validation_error(str(e))
        async with self._model_update():
            if not self.weight_session:
                return _failure("no weight-update session is open; call begin_weight_update() first")
            self.weight_session = False
        return web.json_response({"success": True, "message": "Success"})

    async def _init_weights_update_group(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request, INIT_GROUP_FIELDS, "InitWeightsUpdateGroupReqInput")
            for name, kind in (
                ("master_address", str),
                ("master_port", int),
                ("rank_offset", int),
                ("world_size", int),
            ):
                if not isinstance(body.get(name), kind) or isinstance(body.get(name), bool):
                    raise BadRequest(f"{name} must be a {kind.__name__}, got {body.get(name)!r}")
        except BadRequest as e:
            return _validation_error(str(e))
        group_name = body.get("group_name", weight_transfer.DEFAULT_GROUP)
        if group_name in self.weight_groups:
            return _failure(f"Failed to initialize custom process group: {group_name!r} already exists.")
        try:
            # One rank: the fake is one process (tensor-parallel size 1).
            self.weight_groups[group_name] = await asyncio.get_running_loop().run_in_executor(
                None,
                lambda: weight_transfer.init_weights_update_group(
                    master_address=body["master_address"],
                    master_port=body["master_port"],
                    rank=body["rank_offset"],
                    world_size=body["world_size"],
                    group_name=group_name,
                    backend=body.get("backend", "nccl"),
                    timeout=60.0,
                ),
            )
        except (RuntimeError, ValueError) as e:
            return _failure(f"Failed to initialize custom process group: {e}.")
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def _update_weights_from_distributed(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(
                request, UPDATE_FROM_DISTRIBUTED_FIELDS, "UpdateWeightsFromDistributedReqInput"
            )
            names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
            if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
                raise BadRequest("names, dtypes and shapes must be lists")
            version = body.get("weight_version")
            if version is not None and not isinstance(version, str):
                raise BadRequest(f"weight_version must be a string or null, got {version!r}")
            load_format = body.get("load_format")
            if load_format not in weight_transfer.LOAD_FORMATS:
                raise BadRequest(f"load_format must be None or 'flattened_bucket' here, got {load_format!r}")
        except BadRequest as e:
            return _validation_error(str(e))
        async with self._model_update():
            if not self.weight_session:
                return _failure(NO_SESSION.format("update_weights_from_distributed"))
            group = self.weight_groups.get(body.get("group_name", weight_transfer.DEFAULT_GROUP))
            if group is None:
                return _failure("Failed to update parameter online: the weight-update group is not initialized.")
            # The broadcast is received in full before the bucket is checked: every rank must take part in it.
            # SGLang 0.5.23 receives a "flattened_bucket" as one uint8 buffer of the tensors' bytes back to back
            # (FlattenedTensorBucket.empty: an empty bucket or an unaligned tensor is refused before the broadcast).
            try:
                bucket = await asyncio.get_running_loop().run_in_executor(
                    None,
                    lambda: weight_transfer.receive_bucket(group, names, dtypes, shapes, load_format=load_format),
                )
            except ValueError as e:
                return _failure(f"Failed to update parameter online: {e}.")
            try:
                self._load_state(bucket)
            except ValueError as e:
                return _failure(f"Failed to update parameter online: {e}")
            self.received_buckets.append([sum(t.nbytes for t in bucket.values()), len(bucket)])
            self._set_weight_version(version)
            if not self._flushed_after_update(body):
                return _failure(NOT_FLUSHED)
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    async def _update_weights_from_tensor(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request, UPDATE_FROM_TENSOR_FIELDS, "UpdateWeightsFromTensorReqInput")
            payloads = body.get("serialized_named_tensors")
            if not (isinstance(payloads, list) and payloads and all(isinstance(p, str) for p in payloads)):
                raise BadRequest("serialized_named_tensors must be a non-empty list of base64 strings")
            if body.get("load_format") is not None:
                raise BadRequest(f"this fake loads load_format None only, got {body['load_format']!r}")
            version = body.get("weight_version")
            if version is not None and not isinstance(version, str):
                raise BadRequest(f"weight_version must be a string or null, got {version!r}")
        except BadRequest as e:
            return _validation_error(str(e))
        tp_size = int(self.launch_args.get("tp_size", 1))
        if len(payloads) != tp_size:
            return _failure(f"Failed to update weights: {len(payloads)} payloads for tp_size {tp_size}.")
        async with self._model_update():
            if not self.weight_session:
                return _failure(NO_SESSION.format("update_weights_from_tensor"))
            try:
                # Rank 0's payload (with tp_size 1, the only one): handles to the trainer's memory, copied here.
                bucket = {name: t.clone() for name, t in weight_transfer.deserialize_named_tensors(payloads[0])}
                self._load_state(bucket)
            except ValueError as e:
                return _failure(f"Failed to update weights: {e}")
            self.received_buckets.append([sum(t.nbytes for t in bucket.values()), len(bucket)])
            self._set_weight_version(version)
            if not self._flushed_after_update(body):
                return _failure(NOT_FLUSHED)
        return web.json_response({"success": True, "message": "Succeeded to update model weights."})

    async def _destroy_weights_update_group(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request, DESTROY_GROUP_FIELDS, "DestroyWeightsUpdateGroupReqInput")
        except BadRequest as e:
            return _validation_error(str(e))
        group = self.weight_groups.pop(body.get("group_name", weight_transfer.DEFAULT_GROUP), None)
        if group is None:
            return _failure("Failed to destroy custom process group: it does not exist.")
        weight_transfer.destroy_group(group)
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def _get_weights_by_name(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request, GET_WEIGHTS_FIELDS, "GetWeightsByNameReqInput")
        except BadRequest as e:
            return _validation_error(str(e))
        try:
            parameter = self.model.get_parameter(body.get("name", ""))
        except AttributeError:
            return _handler_error("Get parameter by name failed")
        return web.json_response(parameter.detach().float().tolist()[: body.get("truncate_size", 100)])

    async def _update_weights_from_disk(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request, UPDATE_FROM_DISK_FIELDS, "UpdateWeightFromDiskReqInput")
            if not isinstance(body.get("model_path"), str):
                raise BadRequest(f"model_path must be a string, got {body.get('model_path')!r}")
            version = body.get("weight_version")
            if version is not None and not isinstance(version, str):
                raise BadRequest(f"weight_version must be a string or null, got {version!r}")
        except BadRequest as e:
            return _validation_error(str(e))
        async with self._model_update():
            try:
                self._load_weights(Path(body["model_path"]))
            except (OSError, ValueError, RuntimeError) as e:
                return web.json_response({"success": False, "message": str(e), "num_paused_requests": 0}, status=400)
            self._set_weight_version(version)
            if not self._flushed_after_update(body):
                answer = {"success": False, "message": NOT_FLUSHED, "num_paused_requests": 0}
                return web.json_response(answer, status=400)
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})

    async def _generate(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request, GENERATE_FIELDS, "GenerateReqInput")
            jobs, single = self._parse_generate(body)
        except BadRequest as e:
            return _validation_error(str(e))
        if self.released:
            return _handler_error("the server's memory is released: call /resume_memory_occupation first")
        loop = asyncio.get_running_loop()
        rids = {job["rid"] for job in jobs}
        async with self._gate:
            # The tokenizer manager: a request waits while generation is paused, then holds the model-update lock as
            # a reader until it answers (a weight update waiting for the lock goes first).
            await self._gate.wait_for(lambda: self.pause_mode is None)
            await self._gate.wait_for(lambda: self._updates_waiting == 0)
            self._generating += 1
        try:
            # SGLang queues a batch's requests together: all are in flight (abortable) until the last one answers.
            self._running |= rids
            self.peak_running = max(self.peak_running, len(self._running))
            self.sampling_seeds += [job["sampling"].sampling_seed for job in jobs]
            try:
                outputs = [await loop.run_in_executor(None, self._generate_one, job) for job in jobs]
            finally:
                self._running -= rids
                self._aborted -= rids
        finally:
            async with self._gate:
                self._generating -= 1
                self._gate.notify_all()
        return web.json_response(outputs[0] if single else outputs)

    # -- LoRA -----------------------------------------------------------------------------------------------------

    def _lora_answer(self, error: str | None = None) -> web.Response:
        loaded = {name: folder for name, (folder, _) in self.adapters.items()}
        body = {"success": error is None, "error_message": error, "loaded_adapters": loaded}
        return web.json_response(body, status=200 if error is None else 400)

    async def _load_lora_adapter(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request, LOAD_LORA_FIELDS, "LoadLoRAAdapterReqInput")
        except BadRequest as e:
            return _validation_error(str(e))
        name, folder = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not isinstance(folder, str):
            return _validation_error("lora_name and lora_path must be strings")
        if not self.enable_lora:
            return self._lora_answer("LoRA is not enabled: launch the server with --enable-lora")
        if name in self.adapters:
            return self._lora_answer(f"The LoRA adapter {name!r} is already loaded")
        loop = asyncio.get_running_loop()
        try:
            merged = await loop.run_in_executor(None, self._merged_with, folder)
        except (OSError, ValueError, RuntimeError) as e:
            return self._lora_answer(f"failed to load the LoRA adapter {name!r} from {folder!r}: {e}")
        self.adapters[name] = (folder, merged)
        return self._lora_answer()

    def _merged_with(self, folder: str) -> Any:
        import copy

        from peft import PeftModel

        with self._model_lock:
            base = copy.deepcopy(self.model)
        return PeftModel.from_pretrained(base, folder).merge_and_unload().eval()

    async def _unload_lora_adapter(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request, UNLOAD_LORA_FIELDS, "UnloadLoRAAdapterReqInput")
        except BadRequest as e:
            return _validation_error(str(e))
        name = body.get("lora_name")
        if name not in self.adapters:
            return self._lora_answer(f"The LoRA adapter {name!r} is not loaded")
        del self.adapters[name]
        return self._lora_answer()

    # -- generation -----------------------------------------------------------------------------------------------

    def _parse_generate(self, body: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
        if body.get("text") is not None or body.get("input_embeds") is not None:
            raise BadRequest("the fake server takes input_ids only")
        if body.get("stream"):
            raise BadRequest("the fake server does not stream")
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids:
            raise BadRequest(f"input_ids must be a non-empty list of ints or of int lists, got {str(ids)[:80]}")
        single = not isinstance(ids[0], list)
        prompts = [ids] if single else ids
        for i, p in enumerate(prompts):
            if not isinstance(p, list) or not p or not all(_is_int(t) and 0 <= t < self.vocab_size for t in p):
                raise BadRequest(f"input_ids[{i}] must be a non-empty list of token ids below {self.vocab_size}")
        n = len(prompts)
        params = _per_prompt(body.get("sampling_params"), n, "sampling_params")
        return_logprob = _per_prompt(body.get("return_logprob", False), n, "return_logprob")
        start_len = _per_prompt(body.get("logprob_start_len", -1), n, "logprob_start_len")
        rid = body.get("rid")
        if isinstance(rid, list):
            rids = _per_prompt(rid, n, "rid")
        elif isinstance(rid, str):
            # One id for a batch is a prefix: SGLang numbers the prompts after it.
            rids = [rid] if single else [f"{rid}_{i}" for i in range(n)]
        elif rid is None:
            rids = [None] * n
        else:
            raise BadRequest(f"rid must be a string or a list of strings, got {rid!r}")
        if not isinstance(body.get("return_text_in_logprobs", False), bool):
            raise BadRequest("return_text_in_logprobs must be a bool")
        adapters = _per_prompt(body.get("lora_path"), n, "lora_path")
        for name in adapters:
            if name is not None and name not in self.adapters:
                raise BadRequest(f"The LoRA adapter {name!r} is not loaded (loaded: {sorted(self.adapters)})")
        jobs = []
        for i in range(n):
            if not isinstance(return_logprob[i], (bool, type(None))):
                raise BadRequest(f"return_logprob must be a bool, got {return_logprob[i]!r}")
            if not _is_int(start_len[i]) or not -1 <= start_len[i] < len(prompts[i]):
                raise BadRequest(
                    f"logprob_start_len must be -1 (output log-probs only) or a prompt position below "
                    f"{len(prompts[i])}, got {start_len[i]!r}"
                )
            self._request_counter += 1
            jobs.append(
                {
                    "prompt": prompts[i],
                    "sampling": _Sampling(params[i], vocab_size=self.vocab_size),
                    "return_logprob": bool(return_logprob[i]),
                    "logprob_start_len": start_len[i],
                    "text_in_logprobs": body.get("return_text_in_logprobs", False),
                    "rid": rids[i] or f"fake-{self._request_counter}",
                    "ordinal": self._request_counter,
                    "routes": bool(body.get("return_routed_experts", False)) and self.enable_return_routed_experts,
                    "model": self.model if adapters[i] is None else self.adapters[adapters[i]][1],
                }
            )
        return jobs, single

    @torch.no_grad()
    def _generate_one(self, job: dict[str, Any]) -> dict[str, Any]:
        s: _Sampling = job["sampling"]
        start = time.perf_counter()
        generator = torch.Generator().manual_seed(s.sampling_seed) if s.sampling_seed is not None else self.generator
        stops = set() if s.ignore_eos else s.stop_token_ids | self.eos_token_ids
        rid = job["rid"]
        if rid in self._aborted:
            return self._queued_abort_output(job, start)
        tokens: list[int] = []
        log_probs: list[float] = []
        finish: dict[str, Any] = {"type": "length", "length": s.max_new_tokens}
        live = _LiveRequest()
        with self._state_lock:
            self._live[rid] = live
        try:
            with _RouteCapture(job["model"], enabled=job["routes"]) as routes:
                model = job["model"]
                out = self._step(model, job["prompt"], live, routes)
                prompt_log_probs = self._input_token_logprobs(job, out.logits[0])
                for _ in range(s.max_new_tokens):
                    logits = out.logits[0, -1].float()
                    token, log_prob = self._sample(logits, s, generator)
                    tokens.append(token)
                    log_probs.append(log_prob)
                    live.tokens = len(tokens)
                    # SGLang's Req.update_finish_state: an abort (to_finish) wins over a stop token or the length.
                    if rid in self._aborted:
                        finish = dict(ABORT_RUNNING)
                        break
                    if token in stops:
                        finish = {"type": "stop", "matched": token}
                        break
                    if len(tokens) == s.max_new_tokens:
                        break
                    # SGLang's Req._check_str_based_finish: a stop string in the decoded tail of the output ends the
                    # request after the token that completed it (the tokens stay in output_ids).
                    if s.stop_strs:
                        window = max(len(self.tokenizer.encode(x, add_special_tokens=False)) for x in s.stop_strs) + 1
                        tail = self.tokenizer.decode(tokens[-window:])
                        matched = next((x for x in s.stop_strs if x in tail), None)
                        if matched is not None:
                            finish = {"type": "stop", "matched": matched}
                            break
                    if self.token_delay:
                        time.sleep(self.token_delay)
                    self._hold(job, len(tokens))
                    out = self._step(model, job["prompt"] + tokens, live, routes, past=out.past_key_values)
        finally:
            with self._state_lock:
                self._live.pop(rid, None)
        trim = finish["type"] == "stop" and not s.no_stop_trim
        # A matched stop string is trimmed from the text only; a matched stop token from the ids and the text.
        output_ids = tokens[:-1] if trim and not isinstance(finish["matched"], str) else tokens
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(job["prompt"]),
            "num_retractions": live.retractions,
            "e2e_latency": time.perf_counter() - start,
            "reasoning_tokens": 0,
            "completion_tokens": len(tokens),
            "cached_tokens": 0,
        }
        with self._state_lock:
            spans = weight_version_spans(live.events, self.weight_version, len(tokens))
        meta.update(weight_versions=spans, weight_version=spans[-1]["version"])
        if job["return_logprob"]:
            texts = [self.tokenizer.decode([t]) if job["text_in_logprobs"] else None for t in tokens]
            meta["output_token_logprobs"] = [[lp, t, x] for lp, t, x in zip(log_probs, tokens, texts, strict=True)]
            if prompt_log_probs is not None:
                meta["input_token_logprobs"] = prompt_log_probs
        if job["routes"]:
            meta["routed_experts"] = routes.base64()
        text = self.tokenizer.decode(output_ids, skip_special_tokens=s.skip_special_tokens)
        if trim and isinstance(finish["matched"], str) and finish["matched"] in text:
            text = text[: text.index(finish["matched"])]
        return {"text": text, "output_ids": output_ids, "meta_info": meta}

    def _step(self, model: Any, ids: list[int], live: _LiveRequest, routes: _RouteCapture, *, past: Any = None) -> Any:
        """One forward pass of a request: the prefill of ``ids`` (``past`` None), or the decoding step of its last
        token. It waits while a pause stops the scheduler; a request retracted meanwhile is prefilled again, its
        prompt and every token it has, with the weights of now (its old KV cache is gone)."""
        while True:
            self._scheduling.wait()
            with self._model_lock:
                if not self._scheduling.is_set():
                    continue
                if live.retracted:
                    live.retracted, live.retractions, past = False, live.retractions + 1, None
                    routes.restart()
                if past is None:
                    return model(input_ids=torch.tensor([ids]), use_cache=True)
                return model(input_ids=torch.tensor([ids[-1:]]), past_key_values=past, use_cache=True)

    def _hold(self, job: dict[str, Any], tokens: int) -> None:
        """A test's hold (see the module docstring): after ``hold_at`` tokens, wait while ``hold_file`` exists, or
        without one until the weight version changes."""
        if tokens != self.hold_at or job["ordinal"] <= self.hold_after:
            return
        version, rid = self.weight_version, job["rid"]
        with self._state_lock:
            self.held.add(rid)
        try:
            while self.hold_file.exists() if self.hold_file is not None else self.weight_version == version:
                time.sleep(0.01)
        finally:
            with self._state_lock:
                self.held.discard(rid)

    def _input_token_logprobs(self, job: dict[str, Any], logits: torch.Tensor) -> list[list[Any]] | None:
        """SGLang's ``meta_info.input_token_logprobs`` for ``logprob_start_len`` k >= 0: ``[logprob, id, text]`` of
        each prompt token from position k, the first one's log-prob None (SGLang's scheduler puts None there and drops
        the prediction after the prompt), the others ``log_softmax`` of the raw logits (SGLang applies no temperature
        to input log-probs). ``logits``: ``[P, V]`` of the prompt."""
        start = job["logprob_start_len"]
        if not job["return_logprob"] or start < 0:
            return None
        prompt = job["prompt"]
        full = torch.log_softmax(logits.float(), -1)
        values: list[float | None] = [None] + [float(full[i - 1, prompt[i]]) for i in range(start + 1, len(prompt))]
        texts = [self.tokenizer.decode([t]) if job["text_in_logprobs"] else None for t in prompt[start:]]
        return [[v, t, x] for v, t, x in zip(values, prompt[start:], texts, strict=True)]

    def _queued_abort_output(self, job: dict[str, Any], start: float) -> dict[str, Any]:
        """The tokenizer manager's answer for a request aborted before it ran (``_handle_abort_req``)."""
        meta: dict[str, Any] = {
            "id": job["rid"],
            "finish_reason": dict(ABORT_QUEUED),
            "weight_version": self.weight_version,
            "e2e_latency": time.perf_counter() - start,
            "weight_versions": weight_version_spans([], self.weight_version, 0),
        }
        if job["return_logprob"]:
            meta["output_token_logprobs"] = []
        meta["completion_tokens"] = 0
        return {"text": "", "output_ids": [], "meta_info": meta}

    @staticmethod
    def _sample(logits: torch.Tensor, s: _Sampling, generator: torch.Generator) -> tuple[int, float]:
        if s.greedy:
            token = int(torch.argmax(logits))
            return token, float(torch.log_softmax(logits, -1)[token])
        scaled = logits / s.temperature
        probs = torch.softmax(scaled, -1)
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing the threshold included), then top_k.
        drop = (sorted_probs.cumsum(-1) - sorted_probs) > s.top_p
        if s.top_k != -1:
            drop[s.top_k :] = True
        kept = sorted_probs.masked_fill(drop, 0.0)
        token = int(order[torch.multinomial(kept / kept.sum(), 1, generator=generator)])
        return token, float(torch.log_softmax(scaled, -1)[token])

    def _load_weights(self, folder: Path) -> None:
        from safetensors.torch import load_file

        if not folder.is_dir():
            raise ValueError(f"Failed to get weights iterator: {str(folder)!r} is not a folder.")
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            files = [folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        else:
            files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"Failed to get weights iterator: no safetensors weights in {str(folder)!r}.")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        self._load_state(state)

    def _load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load named tensors as SGLang's model classes do: ``lm_head.weight`` skipped when tied, unknown names
        skipped, missing ones kept; a shape mismatch loads nothing (``ValueError``)."""
        if self.model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        own = self.model.state_dict()
        state = {k: v for k, v in state.items() if k in own}
        bad = {k: (list(v.shape), list(own[k].shape)) for k, v in state.items() if v.shape != own[k].shape}
        if bad:
            raise ValueError(
                f"Failed to update weights: shape mismatch (loaded, model's) {bad}.\nRolling back to original weights."
            )
        with self._model_lock:
            self.model.load_state_dict(state, strict=False)


class _RouteCapture:
    """The experts every MoE router of ``model`` chose for each token fed through it (the prompt's forward, then one
    token per step: the last sampled token is never fed, so it has no row), as SGLang's routed-experts capturer
    keeps them: ``[tokens, num_hidden_layers, topk]`` int32, a dense layer's rows 0."""

    def __init__(self, model: Any, *, enabled: bool):
        self.model, self.enabled, self.rows, self.handles = model, enabled, [], []

    def __enter__(self) -> _RouteCapture:
        if self.enabled:
            from runtime.engines.routes import moe_routers, routes_shape

            self.layers, self.topk = routes_shape(self.model.config)
            routers = list(moe_routers(self.model))
            self.first = routers[0][0]
            self.handles = [
                router.register_forward_hook(lambda module, args, out, layer=layer: self._keep(layer, out[2]))
                for layer, router in routers
            ]
        return self

    def restart(self) -> None:
        """Forget the rows so far: a retracted request is prefilled again, its every token fed once more."""
        self.rows = []

    def _keep(self, layer: int, experts: torch.Tensor) -> None:
        if layer == self.first:
            self.rows.append(torch.zeros(experts.shape[0], self.layers, self.topk, dtype=torch.int32))
        self.rows[-1][:, layer] = experts.to(torch.int32)

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()

    def base64(self) -> str:
        from runtime.engines.routes import routes_to_base64

        return routes_to_base64(torch.cat(self.rows))


def main(argv: list[str] | None = None) -> None:
    """Serve like ``python -m sglang.launch_server``: SGLang 0.5.23's own flags (from the generated list, so an
    unknown flag fails as in SGLang), of which the fake uses ``--model-path``, ``--host``, ``--port`` and
    ``--random-seed``; runs until SIGTERM. This is what the launcher tests start as ``--sglang-server-command``."""
    from runtime.engines import sglang_flags

    parser = argparse.ArgumentParser(prog="fake_sglang")
    sglang_flags.add_passthrough_flags(parser, "server", prefixed=False)
    args = parser.parse_args(argv)
    server = FakeSGLangServer(
        args.model_path,
        seed=getattr(args, "random_seed", None) or 0,
        host=getattr(args, "host", "127.0.0.1"),
        port=getattr(args, "port", 30000),
        # A test of request concurrency slows decoding so that requests overlap.
        token_delay=float(os.environ.get("FAKE_SGLANG_TOKEN_DELAY", "0")),
        # A test of a weight sync mid-rollout holds decoding (see the module docstring).
        hold_at=int(os.environ["FAKE_SGLANG_HOLD_AT"]) if "FAKE_SGLANG_HOLD_AT" in os.environ else None,
        hold_file=os.environ.get("FAKE_SGLANG_HOLD_FILE"),
        hold_after=int(os.environ.get("FAKE_SGLANG_HOLD_AFTER", "0")),
        enable_lora=bool(getattr(args, "enable_lora", False)),
        enable_return_routed_experts=bool(getattr(args, "enable_return_routed_experts", False)),
    )
    server.launch_args = vars(args)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server.start()
    print(f"fake SGLang server ready at {server.url}", flush=True)
    stop.wait()
    server.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
