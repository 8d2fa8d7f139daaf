"""A rollout engine that drives an SGLang server over its native HTTP API (see :class:`RolloutEngine`).

The server is SGLang's own process (``python -m sglang.launch_server``, see :func:`sglang_launch_command`), started
on a GPU machine by a Ray actor or by hand; this adapter only speaks HTTP to it, so it runs anywhere and imports
nothing from SGLang. The endpoints and JSON shapes follow SGLang 0.5.x (the line slime pins):

- ``POST /generate`` with ``input_ids`` (a list of prompts: one request for the whole batch), one
  ``sampling_params`` object for all of them, ``return_logprob`` and ``logprob_start_len=-1`` (log-probs of output
  tokens only). Each output's ``meta_info.output_token_logprobs`` holds ``[logprob, token_id, text-or-null]`` per
  sampled token and ``meta_info.finish_reason`` is ``{"type": "stop" | "length" | "abort", ...}``.
- ``POST /update_weights_from_disk`` (``model_path``, ``weight_version`` as a string), ``POST
  /release_memory_occupation`` / ``POST /resume_memory_occupation`` (optional ``tags``: ``weights``, ``kv_cache``,
  ``cuda_graph``; the server must run with ``--enable-memory-saver``), ``POST /flush_cache``, ``POST /abort_request``,
  ``GET /health_generate``, ``GET /get_model_info``, ``GET /get_weight_version``.

What callers should know:

- SGLang's per-token log-probs are ``log_softmax(logits / temperature)`` over the whole vocabulary, *before* top-k and
  top-p truncation, like the embedded engine's and the trainer's.
- The model's eos token always ends a response; ``stop_token_ids`` add to it rather than replace it (as in the
  embedded engine).
- The stop token is kept in ``token_ids`` (``no_stop_trim``), as in the embedded engine.

Weights go through the file system: :meth:`SGLangEngine.update_weights` writes the state dict as safetensors into an
HF folder (the checkpoint's config and tokenizer files copied beside it) that the server must be able to read, then
calls ``/update_weights_from_disk``. SGLang also has GPU paths that skip the disk:
``/update_weights_from_tensor`` (CUDA IPC handles of tensors on the same node) and ``/init_weights_update_group`` +
``/update_weights_from_distributed`` (an NCCL group between trainer and server, the trainer broadcasting each
tensor); slime uses those. They need GPUs on both sides and are not implemented here.

Reproducible sampling: with ``seed`` set, every prompt carries its own ``sampling_seed`` derived from the seed, the
number of ``generate`` calls so far and its index in the batch; :meth:`SGLangEngine.get_rng_state` /
:meth:`SGLangEngine.set_rng_state` save and restore that counter, so a resumed job sends the same seeds. SGLang
applies ``sampling_seed`` in its deterministic-inference mode (``--enable-deterministic-inference``, see
:func:`sglang_launch_command`); otherwise the server's own generator decides and the seeds only label requests.

Retries: only connection failures (nothing reached the server) are retried, with exponential backoff; a request that
reached the server is never sent twice, because generation and weight loads are not idempotent.
"""

from __future__ import annotations

import math
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from runtime.engines.base import Generation, SamplingParams, check_generate_args

FINISH_REASONS = ("stop", "length", "abort")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
WEIGHTS_FILE = "model.safetensors"
# Files of an HF folder that hold weights: never copied from the original checkpoint next to new weights.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


class SGLangHTTPError(RuntimeError):
    """The server answered with an HTTP error; carries the status code and the server's own message."""

    def __init__(self, method: str, url: str, status_code: int, message: str):
        self.method, self.url, self.status_code, self.message = method, url, status_code, message
        super().__init__(f"SGLang {method} {url} failed with HTTP {status_code}: {message}")


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
    return out


def sampling_seed(seed: int, call: int, index: int) -> int:
    """The ``sampling_seed`` (in ``[0, 2**31)``) of prompt ``index`` in the ``call``-th generate call.

    numpy's ``SeedSequence`` mixes the three, so that neighbouring prompts and calls get unrelated seeds.
    """
    return int(np.random.SeedSequence([seed, call, index]).generate_state(1, dtype=np.uint32)[0]) >> 1


def parse_weight_version(value: Any) -> int | None:
    """SGLang keeps the weight version as a string; rlcore's versions are ints (``None`` for any other string)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return None


def generation_from_sglang(output: dict[str, Any], *, weight_version: int) -> Generation:
    """A :class:`Generation` from one element of ``/generate``'s answer (sent with ``return_logprob``).

    Token ids and log-probs come from ``meta_info.output_token_logprobs``; ``output_ids``, when the server sends it,
    must agree with them. ``weight_version`` is used when the server does not report a numeric one.
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
    return Generation(
        token_ids=token_ids,
        log_probs=log_probs,
        finish_reason=kind,
        weight_version=weight_version if version is None else version,
        extra={"rid": meta.get("id"), "text": output.get("text"), "finish": finish},
    )


def save_hf_weights(state_dict: dict[str, Any], folder: str | Path, *, config_source: str | Path) -> Path:
    """Write ``state_dict`` as ``model.safetensors`` in ``folder`` with the non-weight files of ``config_source``.

    ``config_source`` is an HF checkpoint folder (its config, generation config and tokenizer files are copied, its
    weight files are not). Tensors are moved to the CPU and made contiguous; tensors that share storage (tied
    embeddings) are written as separate copies, since safetensors stores no aliases. Returns ``folder``.
    """
    import torch
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
    for f in source.iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name not in _WEIGHT_INDEXES:
            shutil.copy2(f, out / f.name)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out


def sglang_launch_command(
    model_path: str,
    *,
    host: str = "127.0.0.1",
    port: int = 30000,
    tp_size: int = 1,
    mem_fraction_static: float | None = None,
    seed: int = 0,
    enable_memory_saver: bool = False,
    deterministic: bool = False,
    weight_version: int = 0,
    python: str = sys.executable,
    extra_args: tuple[str, ...] = (),
) -> list[str]:
    """The ``python -m sglang.launch_server`` command line for one server, as an argv list.

    Meant for a Ray actor that owns ``tp_size`` GPUs to ``subprocess.Popen`` on a GPU machine, then build an
    :class:`SGLangEngine` on ``http://{host}:{port}`` (which waits until the server answers). It cannot run on a
    machine without SGLang and a GPU, so rlcore's CPU tests only check the command it builds.
    ``enable_memory_saver`` is needed for :meth:`SGLangEngine.release_memory` to free anything (``--colocate``);
    ``mem_fraction_static`` is the share of GPU memory for weights and KV cache (SGLang picks one when ``None``);
    ``deterministic`` turns on SGLang's deterministic inference, which honours per-request ``sampling_seed``.
    """
    if not isinstance(model_path, str) or not model_path:
        raise ValueError(f"model_path must be a non-empty string, got {model_path!r}")
    for name, value, low in (("port", port, 1), ("tp_size", tp_size, 1), ("seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if port > 65535:
        raise ValueError(f"port must be <= 65535, got {port}")
    if mem_fraction_static is not None and not 0 < mem_fraction_static < 1:
        raise ValueError(f"mem_fraction_static must be in (0, 1), got {mem_fraction_static}")
    cmd = [
        python, "-m", "sglang.launch_server",
        "--model-path", model_path,
        "--host", host,
        "--port", str(port),
        "--tp-size", str(tp_size),
        "--random-seed", str(seed),
        "--weight-version", str(weight_version),
    ]  # fmt: skip
    if mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(mem_fraction_static)]
    if enable_memory_saver:
        cmd.append("--enable-memory-saver")
    if deterministic:
        cmd.append("--enable-deterministic-inference")
    return cmd + list(extra_args)


class SGLangEngine:
    """The :class:`RolloutEngine` protocol over an SGLang server's HTTP API (see the module docstring).

    ``timeout`` bounds one request (a whole batch's generation); ``max_retries`` and ``retry_backoff`` (seconds,
    doubled per retry) apply to connection failures only. With ``wait_healthy`` the constructor polls
    ``/health_generate`` until the server answers 200 or ``startup_timeout`` passes. ``weights_dir`` is where
    :meth:`update_weights` writes HF folders (a fresh temporary folder by default; it must be readable by the server,
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
        self.weight_version = 0
        self.released = False
        self._owns_weights_dir = weights_dir is None
        self.weights_dir = Path(weights_dir or tempfile.mkdtemp(prefix="rlcore-sglang-weights-"))
        self._hf_checkpoint = Path(hf_checkpoint) if hf_checkpoint is not None else None
        self._last_weights: Path | None = None
        if wait_healthy:
            self.wait_healthy(startup_timeout)

    # -- HTTP ---------------------------------------------------------------------------------------------------

    def _request(self, method: str, path: str, payload: dict[str, Any] | None = None) -> httpx.Response:
        for attempt in range(self.max_retries + 1):
            try:
                response = self.client.request(method, path, json=payload)
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

    def _post(self, path: str, payload: dict[str, Any] | None = None) -> Any:
        response = self._request("POST", path, {} if payload is None else payload)
        return _json_or_text(response)

    def _get(self, path: str) -> Any:
        return _json_or_text(self._request("GET", path))

    # -- server state -------------------------------------------------------------------------------------------

    def health(self) -> bool:
        """Whether ``/health_generate`` answers 200 now (one attempt, no retries)."""
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
        return self._get("/get_model_info")

    def server_weight_version(self) -> str | None:
        return self._get("/get_weight_version").get("weight_version")

    def flush_cache(self) -> None:
        """Drop the prefix cache (refused by the server while requests run)."""
        self._post("/flush_cache")

    def abort(self, rid: str | None = None) -> None:
        """Abort one request by id (``Generation.extra["rid"]``), or every running request when ``rid`` is None."""
        self._post("/abort_request", {"abort_all": True} if rid is None else {"rid": rid})

    # -- RolloutEngine --------------------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | dict[str, Any]) -> list[Generation]:
        """One response per prompt, all in one ``/generate`` request; ``prompts`` is a list of non-empty id lists."""
        params = check_generate_args(prompts, params, released=self.released)
        batch = uuid.uuid4().hex
        sampling: dict[str, Any] | list[dict[str, Any]] = sampling_params_to_sglang(params)
        if self.seed is not None:
            sampling = [
                {**sampling, "sampling_seed": sampling_seed(self.seed, self.generate_calls, i)}
                for i in range(len(prompts))
            ]
        self.generate_calls += 1
        outputs = self._post(
            "/generate",
            {
                "input_ids": prompts,
                "sampling_params": sampling,
                "return_logprob": True,
                "logprob_start_len": -1,
                "rid": [f"rlcore-{batch}-{i}" for i in range(len(prompts))],
            },
        )
        if not isinstance(outputs, list) or len(outputs) != len(prompts):
            got = len(outputs) if isinstance(outputs, list) else type(outputs).__name__
            raise ValueError(f"/generate answered {got} outputs for {len(prompts)} prompts")
        return [generation_from_sglang(o, weight_version=self.weight_version) for o in outputs]

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Write the state dict as an HF folder under ``weights_dir`` and have the server load it from disk."""
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version must be an int, got {type(version).__name__}")
        folder = save_hf_weights(
            state_dict,
            tempfile.mkdtemp(prefix=f"v{version}-", dir=self.weights_dir),
            config_source=self._config_source(),
        )
        try:
            self._post("/update_weights_from_disk", {"model_path": str(folder), "weight_version": str(version)})
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        # The load is synchronous, so the previous folder is no longer read by the server.
        if self._last_weights is not None:
            shutil.rmtree(self._last_weights, ignore_errors=True)
        self._last_weights = folder
        self.weight_version = version

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Free the server's GPU memory: all of it, or the ``tags`` among ``weights``, ``kv_cache``, ``cuda_graph``."""
        self.flush_cache()
        self._post("/release_memory_occupation", _tags_payload(tags))
        self.released = True

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self._post("/resume_memory_occupation", _tags_payload(tags))
        self.released = False

    def get_rng_state(self) -> dict[str, Any]:
        """What decides the next ``sampling_seed``s (the server's own generator cannot be read over HTTP)."""
        return {"seed": self.seed, "generate_calls": self.generate_calls}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or set(state) != {"seed", "generate_calls"}:
            raise ValueError(f"state must be a dict from get_rng_state, got {state!r:.200}")
        self.seed, self.generate_calls = state["seed"], state["generate_calls"]

    def ping(self) -> int:
        return self.weight_version

    def close(self) -> None:
        """Close the HTTP client and delete the weight folders this engine wrote (the server keeps running)."""
        self.client.close()
        if self._owns_weights_dir:
            shutil.rmtree(self.weights_dir, ignore_errors=True)

    def _config_source(self) -> Path:
        if self._hf_checkpoint is None:
            self._hf_checkpoint = Path(self.model_info()["model_path"])
        return self._hf_checkpoint


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
