"""A rollout engine that drives an SGLang server over its native HTTP API (see :class:`RolloutEngine`).

The server is SGLang's own process (``python -m sglang.launch_server``), started by the engine group's launcher
(``runtime.engines.launcher``) or by hand; this adapter only speaks HTTP to it, so it runs anywhere and imports
nothing from SGLang. The endpoints and JSON shapes follow SGLang 0.5.23 (``sglang/srt/entrypoints/http_server.py``
and ``managers/io_struct.py`` of that release):

- ``POST /generate`` with ``input_ids`` (a list of prompts: one request for the whole batch), one
  ``sampling_params`` object for all of them, ``return_logprob`` and ``logprob_start_len=-1`` (log-probs of output
  tokens only). Each output's ``meta_info.output_token_logprobs`` holds ``[logprob, token_id, text-or-null]`` per
  sampled token and ``meta_info.finish_reason`` is ``{"type": "stop" | "length" | "abort", ...}``.
- ``POST /abort_request`` (``AbortReq``: ``rid`` or ``abort_all``). An aborted request still answers its
  ``/generate`` call, with HTTP 200 and what it has: a running one the tokens decoded so far (one more decoding step
  runs after the abort lands), a queued one none, and ``finish_reason`` ``{"type": "abort", "message": ...}``.
- ``POST /update_weights_from_disk`` (``model_path``, ``weight_version`` as a string), ``POST
  /release_memory_occupation`` / ``POST /resume_memory_occupation`` (optional ``tags``: ``weights``, ``kv_cache``,
  ``cuda_graph``; the server must run with ``--enable-memory-saver``), ``POST /flush_cache``,
  ``GET /health_generate``, ``GET /model_info`` (``model_path``, ``weight_version``) and ``GET /server_info`` (the
  launch arguments, ``dtype`` among them). 0.5.23 has no ``/get_weight_version``; ``/get_model_info`` and
  ``/get_server_info`` are deprecated aliases that log a warning per call.

What callers should know:

- SGLang's per-token log-probs are ``log_softmax(logits / temperature)`` over the whole vocabulary, *before* top-k and
  top-p truncation, like the embedded engine's and the trainer's.
- The model's eos token always ends a response; ``stop_token_ids`` add to it rather than replace it (as in the
  embedded engine).
- The stop token is kept in ``token_ids`` (``no_stop_trim``), as in the embedded engine.

Weights reach the server two ways. Over a ``torch.distributed`` group (the default, ``--update-weight-transport
nccl``): :meth:`SGLangEngine.init_weights_update_group` has the server join the trainer's group once
(``/init_weights_update_group``), then each bucket is one ``/update_weights_from_distributed`` call (its names, dtypes
and shapes) while the trainer broadcasts the tensors (``runtime.engines.weight_transfer``; NCCL on GPUs, gloo on the
CPU). Through the file system (``--update-weight-transport disk``): :meth:`SGLangEngine.load_weights` collects the
buckets of an update and, at the last one, writes them as safetensors into an HF folder (the checkpoint's config and
tokenizer files copied beside it) that the server must be able to read, then calls ``/update_weights_from_disk``;
:meth:`SGLangEngine.update_weights_from_disk` has the server load a folder the trainer wrote. SGLang itself loads
whatever names a folder holds and silently keeps the old values of the others, and for tied embeddings it reads the
input embeddings and skips ``lm_head.weight``; so the adapter checks names, shapes and completeness against the
checkpoint's architecture (a ``meta``-device transformers model, no weights) and writes tied weights under each of
their names. SGLang's third path, ``/update_weights_from_tensor``, serves a colocated server:
:meth:`SGLangEngine.update_weights_from_tensor` posts a bucket shared as handles to the trainer's memory (CUDA IPC
on a GPU; ``runtime.engines.weight_transfer.serialize_named_tensors``), base64-coded, one copy per TP rank.

Weight-update sessions: SGLang 0.5.23 loads ``/update_weights_from_distributed`` and ``/update_weights_from_tensor``
only between ``/begin_weight_update`` and ``/end_weight_update``; the adapter opens a session at the first bucket of an
update and closes it after the last (the one that carries ``weight_version``), or when a bucket fails. An update, the
session's two calls included, waits until every request in flight has answered unless generation is paused, and the
cache flush that ends it fails the update while a request is running.

Pausing generation around a weight update (slime's ``pause_generation`` / ``continue_generation``): ``POST
/pause_generation`` (``PauseGenerationReqInput.mode``) and ``POST /continue_generation``. While paused, new requests
wait at the server, and an update runs at once. rlcore pauses in ``retract`` mode (:data:`PAUSE_MODE`): the running
requests go back to the waiting queue with their tokens and their KV cache freed, so the update's cache flush succeeds,
and when generation continues each is prefilled again (its prompt and the tokens it has) with the new weights, so
every token after the update is sampled, and its log-prob reported, by the new weights alone. ``in_place`` would keep
the old weights' KV cache (the tokens after the update then come from neither policy, and the update's flush fails
while they run); ``abort`` (slime's, SGLang's default) cuts the requests off and throws their work away unless the
rollout resumes them. ``meta_info.weight_versions`` then lists each response's spans of tokens by the version that
sampled them (``Generation.extra["weight_versions"]``; their versions in order in ``extra["versions"]``).

Reproducible sampling: with ``seed`` set, every prompt carries its own ``sampling_seed`` derived from the seed, the
number of ``generate`` calls so far and its index in the batch; :meth:`SGLangEngine.get_rng_state` /
:meth:`SGLangEngine.set_rng_state` save and restore that counter, so a resumed job sends the same seeds. SGLang
applies ``sampling_seed`` in its deterministic-inference mode (``--sglang-enable-deterministic-inference``); otherwise
the server's own generator decides and the seeds only label requests.

Retries: only connection failures (nothing reached the server) are retried, with exponential backoff; a request that
reached the server is never sent twice, because generation and weight loads are not idempotent.
"""

from __future__ import annotations

import base64
import json
import math
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from runtime.engines import weight_transfer
from runtime.engines.base import Generation, SamplingParams, check_generate_args, sampling_seed
from runtime.engines.hf_engine import (
    WeightUpdate,
    bucket_shapes,
    check_weight_version,
    safetensors_files,
    some_names,
)
from runtime.engines.routes import routes_from_base64, routes_shape

FINISH_REASONS = ("stop", "length", "abort")
# PauseGenerationReqInput.mode's values, and the one rlcore pauses with around a weight update (module docstring).
PAUSE_MODES = ("abort", "retract", "in_place")
PAUSE_MODE = "retract"
# The weight version SGLang reports before any update ("default": the weights it was launched with, rlcore's 0).
LAUNCH_VERSION = "default"
# The SGLang router's header for the key that its consistent-hashing and manual policies route by.
ROUTING_KEY_HEADER = "x-smg-routing-key"
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
WEIGHTS_FILE = "model.safetensors"
# Files of an HF folder that hold weights: never copied from the original checkpoint next to new weights.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# SGLang's --dtype choices (server_args' ``dtype``) and the torch dtype each names.
SGLANG_DTYPES = {
    "half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32", "float32": "float32",
}  # fmt: skip


class SGLangHTTPError(RuntimeError):
    """The server answered with an HTTP error; carries the status code and the server's own message."""

    def __init__(self, method: str, url: str, status_code: int, message: str):
        self.method, self.url, self.status_code, self.message = method, url, status_code, message
        super().__init__(f"SGLang {method} {url} failed with HTTP {status_code}: {message}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from its four fields (Ray pickles an actor's errors; the default would pass the text alone).
        return type(self), (self.method, self.url, self.status_code, self.message)


class SGLangConnectionError(ConnectionError):
    """The server could not be reached, retries included."""


def sampling_params_to_sglang(params: SamplingParams) -> dict[str, Any]:
    """SGLang's ``sampling_params`` object for ``params`` (same names; ``top_k=-1`` is SGLang's "off" too).

    ``no_stop_trim`` keeps the stop token in the output, like the embedded engine; ``skip_special_tokens=False`` keeps
    the returned text faithful to the token ids.
    """
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    out: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.stop:
        out["stop"] = list(params.stop)
    if params.min_new_tokens:
        out["min_new_tokens"] = params.min_new_tokens
    return out


def lora_adapter_name(weight_version: int) -> str:
    """The name SGLang servers hold the LoRA adapter of ``weight_version`` under (``lora_name``, ``lora_path``)."""
    return f"rlcore-v{weight_version}"


def parse_weight_version(value: Any) -> int | None:
    """SGLang keeps the weight version as a string; rlcore's versions are ints (``None`` for any other string)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return None


def generation_from_sglang(
    output: dict[str, Any],
    *,
    weight_version: int,
    prompt_length: int | None = None,
    routes_shape: tuple[int, int] | None = None,
) -> Generation:
    """A :class:`Generation` from one element of ``/generate``'s answer (sent with ``return_logprob``).

    Token ids and log-probs come from ``meta_info.output_token_logprobs``; ``output_ids``, when the server sends it,
    must agree with them. ``weight_version`` is used when the server does not report a numeric one.
    ``extra["versions"]`` holds the version of each span of ``meta_info.weight_versions``, in token order (SGLang's
    ``"default"``, the weights it was launched with, is 0). With
    ``routes_shape`` (``(num_hidden_layers, topk)``; the request sent ``return_routed_experts``)
    ``meta_info.routed_experts`` becomes ``extra["routed_experts"]``, ``[prompt_length + tokens - 1, layers, topk]``
    int32 (:mod:`runtime.engines.routes`).
    """
    if not isinstance(output, dict) or not isinstance(output.get("meta_info"), dict):
        raise ValueError(f"output must be a dict with a 'meta_info' dict, got {str(output)[:200]}")
    meta = output["meta_info"]
    triples = meta.get("output_token_logprobs")
    if not isinstance(triples, list):
        raise ValueError(
            f"meta_info has no output_token_logprobs list (was return_logprob sent?); keys: {sorted(meta)}"
        )
    try:
        log_probs = [float(t[0]) for t in triples]
        token_ids = [int(t[1]) for t in triples]
    except (TypeError, IndexError, ValueError) as e:
        raise ValueError(
            f"output_token_logprobs must hold [logprob, token_id, text] triples, got {triples[:3]!r}"
        ) from e
    if not all(math.isfinite(lp) for lp in log_probs):
        raise ValueError(f"output_token_logprobs holds non-finite log-probs: {log_probs}")
    output_ids = output.get("output_ids")
    if output_ids is not None and list(output_ids) != token_ids:
        raise ValueError(
            f"output_ids {list(output_ids)} and the token ids of output_token_logprobs {token_ids} differ "
            "(the stop token must not be trimmed: no_stop_trim=True)"
        )
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else None
    if kind not in FINISH_REASONS:
        raise ValueError(f"meta_info.finish_reason must be a dict with type in {FINISH_REASONS}, got {finish!r}")
    version = parse_weight_version(meta.get("weight_version"))
    version = weight_version if version is None else version
    spans = meta.get("weight_versions")
    versions = [version]
    if isinstance(spans, list) and spans:
        # A label that is no rlcore version (a server someone else updated) counts as the response's, as above.
        labels = [span.get("version") if isinstance(span, dict) else None for span in spans]
        parsed = [0 if x == LAUNCH_VERSION else parse_weight_version(x) for x in labels]
        versions = [version if v is None else v for v in parsed]
    routes = {}
    if routes_shape is not None:
        if "routed_experts" not in meta:
            raise ValueError(
                "meta_info has no routed_experts although the request sent return_routed_experts: start the server "
                "with --enable-return-routed-experts (rlcore's launcher does under --use-rollout-routing-replay)"
            )
        rows = prompt_length + len(token_ids) - 1
        routes["routed_experts"] = routes_from_base64(
            meta["routed_experts"], rows=rows, layers=routes_shape[0], topk=routes_shape[1]
        )
    return Generation(
        token_ids=token_ids,
        log_probs=log_probs,
        finish_reason=kind,
        weight_version=version,
        extra={
            "rid": meta.get("id"),
            "text": output.get("text"),
            "finish": finish,
            # SGLang 0.5.23's spans [{"version", "start", "end"}] of the versions the tokens were sampled with, and
            # those versions in token order (more than one when a weight update came while the request was live).
            "weight_versions": meta.get("weight_versions"),
            "versions": versions,
            **routes,
        },
    )


def sglang_weight_dtype(server_dtype: str, config: dict[str, Any]) -> str:
    """The dtype an SGLang server holds its weights in, from its ``--dtype`` and the checkpoint's ``config.json``.

    SGLang resolves ``"auto"`` (``configs/model_config.py``, ``_get_and_verify_dtype``): a float32 (or unstated)
    checkpoint is served in float16 (bfloat16 for Gemma models), any other in the checkpoint's own dtype.
    """
    if server_dtype != "auto":
        if server_dtype not in SGLANG_DTYPES:
            raise ValueError(f"unknown SGLang dtype {server_dtype!r}, expected 'auto' or one of {list(SGLANG_DTYPES)}")
        return SGLANG_DTYPES[server_dtype]
    config_dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    if config_dtype == "float32":
        return "bfloat16" if str(config.get("model_type", "")).startswith("gemma") else "float16"
    return str(config_dtype)


def copy_model_files(source: str | Path, folder: str | Path) -> None:
    """Copy the files of the HF folder ``source`` that describe the model (config, generation config, tokenizer)
    into ``folder``, leaving its weight files and their indexes behind."""
    for f in Path(source).iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name not in _WEIGHT_INDEXES:
            shutil.copy2(f, Path(folder) / f.name)


def save_hf_weights(state_dict: dict[str, Any], folder: str | Path, *, config_source: str | Path) -> Path:
    """Write ``state_dict`` as ``model.safetensors`` in ``folder`` with the non-weight files of ``config_source``.

    ``config_source`` is an HF checkpoint folder (its config, generation config and tokenizer files are copied, its
    weight files are not). Tensors are moved to the CPU and made contiguous; tensors that share storage (tied
    embeddings) are written as separate copies, since safetensors stores no aliases. Returns ``folder``.
    """
    from safetensors.torch import save_file

    source = Path(config_source)
    if not (source / "config.json").is_file():
        raise ValueError(f"config_source must be an HF folder with a config.json, got {str(source)!r}")
    if not isinstance(state_dict, dict) or not state_dict:
        raise ValueError(f"state_dict must be a non-empty dict of tensors, got {type(state_dict).__name__}")
    tensors: dict[str, torch.Tensor] = {}
    seen_storage: set[int] = set()
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] must be a torch.Tensor, got {type(value).__name__}")
        tensor = value.detach().to("cpu").contiguous()
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen_storage:
            tensor = tensor.clone()
        seen_storage.add(tensor.untyped_storage().data_ptr())
        tensors[name] = tensor
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    copy_model_files(source, out)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out


class SGLangEngine:
    """The :class:`RolloutEngine` protocol over an SGLang server's HTTP API (see the module docstring).

    ``timeout`` bounds one request (a whole batch's generation); ``max_retries`` and ``retry_backoff`` (seconds,
    doubled per retry) apply to connection failures only. With ``wait_healthy`` the constructor polls
    ``/health_generate`` until the server answers 200 or ``startup_timeout`` passes. ``weights_dir`` is where
    :meth:`load_weights` writes HF folders (a fresh temporary folder by default; it must be readable by the server,
    i.e. on a shared or the same file system); ``hf_checkpoint`` is the folder whose config and tokenizer files go
    with them (by default the server's own ``model_path`` at start, read from ``/get_model_info``). ``seed`` turns on
    per-prompt ``sampling_seed`` (see the module docstring).
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 600.0,
        max_retries: int = 5,
        retry_backoff: float = 0.5,
        wait_healthy: bool = True,
        startup_timeout: float = 600.0,
        weights_dir: str | Path | None = None,
        hf_checkpoint: str | Path | None = None,
        seed: int | None = None,
    ):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
        if retry_backoff < 0:
            raise ValueError(f"retry_backoff must be >= 0, got {retry_backoff}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"seed must be None or an int >= 0, got {seed!r}")
        self.seed = seed
        self.generate_calls = 0
        self.base_url = base_url.rstrip("/")
        self.max_retries = max_retries
        self.retry_backoff = retry_backoff
        self.client = httpx.Client(base_url=self.base_url, timeout=timeout)
        self._weight_version = 0
        self._weight_dtype: str | None = None
        self.released = False
        self._released_tags: set[str] = set()
        self.closed = False
        # The buckets of the update in progress, and the checkpoint's architecture they are checked against.
        self._pending: dict[str, Any] = {}
        self._update: WeightUpdate | None = None
        self._owns_weights_dir = weights_dir is None
        self.weights_dir = Path(weights_dir or tempfile.mkdtemp(prefix="rlcore-sglang-weights-"))
        self._hf_checkpoint = Path(hf_checkpoint) if hf_checkpoint is not None else None
        self._routes: tuple[int, int] | None = None
        self._last_weights: Path | None = None
        # The LoRA adapter the server holds for this engine (``load_lora_adapter``), named in every /generate.
        self.lora_name: str | None = None
        # Whether a weight-update session is open on the server (opened here), and whether generation is paused.
        self._session_open = False
        self.paused = False
        if wait_healthy:
            self.wait_healthy(startup_timeout)

    # -- HTTP ---------------------------------------------------------------------------------------------------

    def _request(
        self, method: str, path: str, payload: dict[str, Any] | None = None, headers: dict[str, str] | None = None
    ) -> httpx.Response:
        for attempt in range(self.max_retries + 1):
            try:
                response = self.client.request(method, path, json=payload, headers=headers)
                break
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                if attempt == self.max_retries:
                    raise SGLangConnectionError(
                        f"SGLang server at {self.base_url} unreachable for {method} {path} after "
                        f"{self.max_retries + 1} attempts: {e}"
                    ) from e
                time.sleep(self.retry_backoff * 2**attempt)
        if response.is_error:
            raise SGLangHTTPError(method, f"{self.base_url}{path}", response.status_code, _error_message(response))
        return response

    def _post(self, path: str, payload: dict[str, Any] | None = None, headers: dict[str, str] | None = None) -> Any:
        response = self._request("POST", path, {} if payload is None else payload, headers)
        return _json_or_text(response)

    def _get(self, path: str) -> Any:
        return _json_or_text(self._request("GET", path))

    # -- server state -------------------------------------------------------------------------------------------

    def health(self) -> bool:
        """Whether the server can generate now: ``/health_generate`` answers 200 (one attempt, no retries).

        A released or closed engine is not asked: ``/health_generate`` runs a one-token generation, which a server
        whose memory is released cannot do. It waits while generation is paused (the engine group checks no health
        then).
        """
        if self.released or self.closed:
            return False
        try:
            return self.client.get("/health_generate").status_code == 200
        except httpx.TransportError:
            return False

    def wait_healthy(self, timeout: float, *, poll: float = 0.2) -> None:
        """Block until ``/health_generate`` answers 200; ``TimeoutError`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while True:
            try:
                status = self.client.get("/health_generate").status_code
                if status == 200:
                    return
                last = f"HTTP {status}"
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() >= deadline:
                raise TimeoutError(f"SGLang server at {self.base_url} not healthy after {timeout:.1f}s ({last})")
            time.sleep(poll)

    def model_info(self) -> dict[str, Any]:
        return self._get("/model_info")

    def server_weight_version(self) -> str | None:
        """The server's own weight version (a string; ``"default"`` until a weight update sets one)."""
        return self.model_info().get("weight_version")

    def flush_cache(self) -> None:
        """Drop the prefix cache (refused by the server while requests run)."""
        self._post("/flush_cache")

    def abort(self, rid: str | None = None) -> None:
        """Abort every request of the server (``abort_all``), or the one with id ``rid`` (``Generation.extra["rid"]``).

        The cut :meth:`generate` calls return what they have, with ``finish_reason="abort"`` (see the module
        docstring). SGLang matches ``rid`` as a prefix of the running requests' ids once it knows that exact id.
        """
        self._post("/abort_request", {"abort_all": True} if rid is None else {"rid": rid})

    # -- RolloutEngine --------------------------------------------------------------------------------------------

    def url(self) -> str:
        """The server's base URL."""
        return self.base_url

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | dict[str, Any],
        *,
        routing_key: str | None = None,
        sampling_seeds: list[int] | None = None,
    ) -> list[Generation]:
        """One response per prompt, all in one ``/generate`` request; ``prompts`` is a list of non-empty id lists.

        ``routing_key`` goes along as the SGLang router's ``x-smg-routing-key`` header (a multi-turn session's id), so
        that the router's consistent-hashing or manual policy sends every turn of a session to one server.
        ``sampling_seeds`` (one int per prompt) are sent as each prompt's ``sampling_seed``, in place of the ones
        ``seed`` derives.
        """
        params = check_generate_args(prompts, params, released=self.released)
        if sampling_seeds is not None and (
            len(sampling_seeds) != len(prompts) or not all(_is_int(x) for x in sampling_seeds)
        ):
            raise ValueError(f"sampling_seeds must hold one int per prompt ({len(prompts)}), got {sampling_seeds!r}")
        batch = uuid.uuid4().hex
        sampling: dict[str, Any] | list[dict[str, Any]] = sampling_params_to_sglang(params)
        if sampling_seeds is not None:
            sampling = [{**sampling, "sampling_seed": int(x)} for x in sampling_seeds]
        elif self.seed is not None:
            sampling = [
                {**sampling, "sampling_seed": sampling_seed(self.seed, self.generate_calls, i)}
                for i in range(len(prompts))
            ]
        if isinstance(sampling, list) and len(sampling) == 1:
            # One prompt, one object: the SGLang router's schema takes no list of sampling_params.
            sampling = sampling[0]
        self.generate_calls += 1
        outputs = self._post(
            "/generate",
            {
                "input_ids": prompts,
                "sampling_params": sampling,
                "return_logprob": True,
                "logprob_start_len": -1,
                **({"return_routed_experts": True} if params.return_routed_experts else {}),
                # One id for the batch: SGLang numbers its prompts after it; the router takes only a string here.
                "rid": f"rlcore-{batch}",
                **({"lora_path": self.lora_name} if self.lora_name is not None else {}),
            },
            headers={ROUTING_KEY_HEADER: routing_key} if routing_key is not None else None,
        )
        if not isinstance(outputs, list) or len(outputs) != len(prompts):
            got = len(outputs) if isinstance(outputs, list) else type(outputs).__name__
            raise ValueError(f"/generate answered {got} outputs for {len(prompts)} prompts")
        shape = self._routes_shape() if params.return_routed_experts else None
        return [
            generation_from_sglang(o, weight_version=self._weight_version, prompt_length=len(p), routes_shape=shape)
            for o, p in zip(outputs, prompts, strict=True)
        ]

    def load_weights(self, bucket: dict[str, Any], *, weight_version: int | None = None) -> None:
        """Collect a bucket of HF-named tensors; with ``weight_version`` (the last bucket of an update), write the
        update as an HF folder under ``weights_dir`` and have the server load it (``/update_weights_from_disk``).

        Each bucket's names and shapes are checked against the checkpoint's architecture, and at the last bucket that
        every weight came (tied weights once, under either name), else ``ValueError``; nothing is sent then.
        """
        if weight_version is not None:
            check_weight_version(weight_version)
        update = self._weight_update()
        update.check(bucket_shapes(bucket), what="load_weights bucket")
        for name, value in bucket.items():
            # Every name of a tied weight: SGLang reads the one its model class loads (the input embeddings).
            for alias in update.names_of(name):
                self._pending[alias] = value.detach().to("cpu", copy=True)
        update.add(bucket)
        if weight_version is None:
            return
        pending, self._pending = self._pending, {}
        update.finish()
        folder = save_hf_weights(
            pending,
            tempfile.mkdtemp(prefix=f"v{weight_version}-", dir=self.weights_dir),
            config_source=self._config_source(),
        )
        self._load_from_disk(folder, weight_version, owned=True)

    def update_weights_from_disk(self, path: str, *, weight_version: int) -> None:
        """Have the server load the HF folder ``path`` (written by the trainer) and take ``weight_version``.

        When ``path`` is readable here, its safetensors headers are checked like :meth:`load_weights`'s buckets, and
        tied weights must be there under their first name (the one SGLang reads); a folder only the server's file
        system holds is the server's to check.
        """
        check_weight_version(weight_version)
        if Path(path).is_dir():
            self._check_folder(Path(path))
        self._load_from_disk(Path(path), weight_version, owned=False)

    def load_lora_adapter(self, path: str, *, weight_version: int) -> None:
        """Have the server load the peft adapter folder ``path`` (the trainer's, ``--update-weight-transport
        lora_adapter``) as ``rlcore-v{weight_version}`` (SGLang's ``/load_lora_adapter``), drop the adapter it replaces
        (``/unload_lora_adapter``) and generate with the new one from now on (``lora_path`` in ``/generate``).

        The server must run with ``--enable-lora`` (the launcher adds it with ``--max-lora-rank`` and
        ``--lora-target-modules``); the base weights stay the checkpoint's."""
        check_weight_version(weight_version)
        name = lora_adapter_name(weight_version)
        if self.lora_name in (None, name):
            # The same version again, or a restarted client of a server that may hold it already: replace it.
            try:
                self._post("/unload_lora_adapter", {"lora_name": name})
            except SGLangHTTPError as err:
                if err.status_code != 400:  # (400: not loaded, nothing to replace)
                    raise
            self.lora_name = None
        self._post("/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        previous, self.lora_name = self.lora_name, name
        if previous is not None:
            self._post("/unload_lora_adapter", {"lora_name": previous})
        self._weight_version = weight_version

    def use_lora_adapter(self, weight_version: int) -> None:
        """Send every later ``/generate`` with the adapter the servers loaded for ``weight_version`` (a client of the
        router, in front of servers that :meth:`load_lora_adapter` loaded), labelling its outputs with that version."""
        check_weight_version(weight_version)
        self.lora_name, self._weight_version = lora_adapter_name(weight_version), weight_version

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = weight_transfer.DEFAULT_GROUP,
        backend: str = "nccl",
    ) -> None:
        """Have the server join the trainer's weight-update group (``/init_weights_update_group``); its ranks are
        ``rank_offset`` to ``rank_offset + tp_size - 1``. Blocks until every rank has joined."""
        self._post(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        *,
        group_name: str = weight_transfer.DEFAULT_GROUP,
        weight_version: int | None = None,
        load_format: str | None = None,
    ) -> None:
        """Have the server receive one bucket the trainer broadcasts (``/update_weights_from_distributed``; under
        ``load_format="flattened_bucket"`` as one flat buffer); the call returns once the server has loaded it.
        ``weight_version`` (the last bucket) becomes its version."""
        payload: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name}
        if load_format is not None:
            payload["load_format"] = load_format
        if weight_version is not None:
            check_weight_version(weight_version)
            payload["weight_version"] = str(weight_version)
        self._in_session("/update_weights_from_distributed", payload, last=weight_version is not None)
        if weight_version is not None:
            self._weight_version = weight_version

    def update_weights_from_tensor(self, payload: bytes, *, weight_version: int | None = None) -> None:
        """Have a colocated server load one bucket shared as handles (``/update_weights_from_tensor``): SGLang takes
        one payload per tensor-parallel rank, base64-coded over HTTP; every rank gets the whole bucket and takes its
        shard. Returns once the server has loaded it."""
        coded = base64.b64encode(payload).decode("ascii")
        body: dict[str, Any] = {"serialized_named_tensors": [coded] * self.tp_size(), "flush_cache": True}
        if weight_version is not None:
            check_weight_version(weight_version)
            body["weight_version"] = str(weight_version)
        self._in_session("/update_weights_from_tensor", body, last=weight_version is not None)
        if weight_version is not None:
            self._weight_version = weight_version

    def _in_session(self, path: str, payload: dict[str, Any], *, last: bool) -> None:
        """Post one bucket of an update inside a weight-update session (see the module docstring): opened before the
        update's first bucket, closed after its ``last`` one or at once when a bucket fails."""
        if not self._session_open:
            self._post("/begin_weight_update", {})
            self._session_open = True
        try:
            self._post(path, payload)
        except BaseException:
            self._end_session(quietly=True)
            raise
        if last:
            self._end_session()

    def _end_session(self, *, quietly: bool = False) -> None:
        self._session_open = False
        try:
            self._post("/end_weight_update", {})
        except (SGLangHTTPError, SGLangConnectionError, httpx.HTTPError):
            if not quietly:  # (after a failed bucket the bucket's error is the one to raise)
                raise

    def pause_generation(self, mode: str = PAUSE_MODE) -> None:
        """Pause the server's generation (``/pause_generation``) before a weight update: in ``retract`` mode (the
        default, see the module docstring) the requests in flight stop where they are and new ones wait; nothing is
        lost. :meth:`continue_generation` goes on."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._post("/pause_generation", {"mode": mode})
        self.paused = True

    def continue_generation(self) -> None:
        """Let a paused server generate again (``/continue_generation``): paused requests go on with its weights."""
        self._post("/continue_generation", {})
        self.paused = False

    def destroy_weights_update_group(self, group_name: str = weight_transfer.DEFAULT_GROUP) -> None:
        self._post("/destroy_weights_update_group", {"group_name": group_name})

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        """The first ``truncate_size`` rows of the server's weight ``name`` (``/get_weights_by_name``)."""
        return self._post("/get_weights_by_name", {"name": name, "truncate_size": truncate_size})

    def tp_size(self) -> int:
        """The server's tensor-parallel size (its ranks in a weight-update group), from ``/server_info``."""
        return int(self._get("/server_info").get("tp_size", 1))

    def weight_version(self) -> int:
        return self._weight_version

    def weight_dtype(self) -> str:
        """The dtype the server holds its weights in (asked once; see :func:`sglang_weight_dtype`).

        SGLang reports only the ``--dtype`` it was launched with (``/server_info``; ``"auto"`` unless given), not the
        dtype it resolved; ``"auto"`` is resolved here from the checkpoint's ``config.json``, and taken as
        ``"bfloat16"`` when that file cannot be read from this machine (the dtype RL checkpoints ship in, which
        ``"auto"`` keeps).
        """
        if self._weight_dtype is None:
            server_dtype = self._get("/server_info").get("dtype", "auto")
            try:
                config = json.loads((self._config_source() / "config.json").read_text())
            except OSError:
                config = None
            if server_dtype == "auto" and config is None:
                self._weight_dtype = "bfloat16"
            else:
                self._weight_dtype = sglang_weight_dtype(server_dtype, config or {})
        return self._weight_dtype

    def _weight_update(self) -> WeightUpdate:
        """The checkpoint's weight names and shapes, from its config on the ``meta`` device (built once)."""
        if self._update is None:
            from transformers import AutoConfig, AutoModelForCausalLM

            config = AutoConfig.from_pretrained(self._config_source())
            with torch.device("meta"):
                self._update = WeightUpdate(AutoModelForCausalLM.from_config(config))
        return self._update

    def _check_folder(self, folder: Path) -> None:
        from safetensors import safe_open

        shapes: dict[str, tuple[int, ...]] = {}
        for f in safetensors_files(folder):
            with safe_open(str(f), "pt") as weights:
                shapes.update({k: tuple(weights.get_slice(k).get_shape()) for k in weights.keys()})
        update = self._weight_update()
        update.check(shapes, what=str(folder))
        update.require_complete(shapes, what=str(folder))
        unread = sorted({update.canonical[n] for n in shapes} - set(shapes))
        if unread:
            names = some_names(unread)
            raise ValueError(f"{folder} has tied weights only under a name SGLang skips; SGLang reads {names}")

    def _load_from_disk(self, folder: Path, weight_version: int, *, owned: bool) -> None:
        """``/update_weights_from_disk`` of ``folder``; an ``owned`` folder (written here) is deleted if refused."""
        try:
            self._post("/update_weights_from_disk", {"model_path": str(folder), "weight_version": str(weight_version)})
        except BaseException:
            if owned:
                shutil.rmtree(folder, ignore_errors=True)
            raise
        # The load is synchronous, so the previous folder written here is no longer read by the server.
        if self._last_weights is not None:
            shutil.rmtree(self._last_weights, ignore_errors=True)
        self._last_weights = folder if owned else None
        self._weight_version = weight_version

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Free the server's GPU memory: all of it, or the ``tags`` among ``weights``, ``kv_cache``, ``cuda_graph``
        (the server must run with ``--sglang-enable-memory-saver``). It generates again once every released tag is
        resumed."""
        self.flush_cache()
        self._post("/release_memory_occupation", _tags_payload(tags))
        self._released_tags |= set(tags or MEMORY_TAGS)
        self.released = True

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Take memory back: all of it, or ``tags`` (slime resumes ``weights`` before a weight sync, ``kv_cache``
        and ``cuda_graph`` before generating)."""
        self._post("/resume_memory_occupation", _tags_payload(tags))
        self._released_tags -= set(tags or MEMORY_TAGS)
        self.released = bool(self._released_tags)

    def get_rng_state(self) -> dict[str, Any]:
        """What decides the next ``sampling_seed``s (the server's own generator cannot be read over HTTP)."""
        return {"seed": self.seed, "generate_calls": self.generate_calls}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or set(state) != {"seed", "generate_calls"}:
            raise ValueError(f"state must be a dict from get_rng_state, got {state!r:.200}")
        self.seed, self.generate_calls = state["seed"], state["generate_calls"]

    def close(self) -> None:
        """Close the HTTP client and delete the weight folders this engine wrote (the server keeps running)."""
        self.closed = True
        self.client.close()
        if self._owns_weights_dir:
            shutil.rmtree(self.weights_dir, ignore_errors=True)

    def _routes_shape(self) -> tuple[int, int]:
        """``(num_hidden_layers, num_experts_per_tok)`` of the served checkpoint (routed experts' layout)."""
        if self._routes is None:
            self._routes = routes_shape(json.loads((self._config_source() / "config.json").read_text()))
        return self._routes

    def _config_source(self) -> Path:
        if self._hf_checkpoint is None:
            self._hf_checkpoint = Path(self.model_info()["model_path"])
        return self._hf_checkpoint


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _tags_payload(tags: list[str] | None) -> dict[str, Any]:
    if tags is None:
        return {}
    if not isinstance(tags, list) or not tags or any(t not in MEMORY_TAGS for t in tags):
        raise ValueError(f"tags must be None or a non-empty list drawn from {MEMORY_TAGS}, got {tags!r}")
    return {"tags": tags}


def _json_or_text(response: httpx.Response) -> Any:
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError:
        return response.text


def _error_message(response: httpx.Response) -> str:
    """The server's own words: SGLang answers ``{"error": {"message"}}``, ``{"message"}`` or plain text."""
    body = _json_or_text(response)
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in ("message", "detail"):
            if key in body:
                return str(body[key])
    return str(body).strip() if body else response.reason_phrase
