"""The embedded rollout engine: a HF causal LM decoding a left-padded batch over its own KV cache.

Decoding is :func:`runtime.engines.decode.decode`: prefill (once per group of samples of one prompt), then one token
per step for every running row (at most ``--engine-max-running-requests``; groups whose rows have all stopped are
refilled with waiting prompts), the step's forward and sampling replayed as CUDA graphs on the GPU, sampling as it
goes from each prompt's own seeded stream. transformers' ``generate`` cost
about 100 ms of Python and launches per step at a Qwen3-0.6B shape; its continuous batching (``generate_batch``)
cannot start on the CPU (its paged cache sizes itself from free device memory, which it reads as 0 there). SGLang is
the engine for throughput; this one serves CPU runs, tests and one-GPU jobs.

Per-token rollout log-probs are ``log_softmax(logits / temperature)`` of the sampled token over the whole vocabulary,
*before* top-k and top-p truncation, taken at the step the token is drawn (one step's ``[B, V]`` logits at a time):
what SGLang reports and what the trainer recomputes, so that ``--use-tis`` compares like with like. Sampling itself
draws from the truncated distribution. Under top-p replay (``SamplingParams.return_top_p_token_ids``) the engine
reports each token's nucleus in slime's layout and the token's log-prob renormalised over it instead. The model's
own ``generation_config.json`` plays no part: only temperature, top-k, top-p, the stop ids and the length limit
shape a draw. The model's eos ids (tokenizer and
``generation_config.json``, which may list several, as Llama-3 and Qwen do) always end a response.

Partial rollout needs :meth:`HFEngine.abort` to cut a running ``generate`` short from another thread (the engine
actor runs ``abort`` in a concurrency group of its own, ``runtime.cluster.engines``): the decode loop reads an abort
counter after every step, and the cut call returns the tokens sampled so far with their log-probs and
``finish_reason="abort"``.

Weights arrive in buckets of HF-named tensors (:meth:`HFEngine.load_weights`) or as a HF folder
(:meth:`HFEngine.update_weights_from_disk`); :class:`WeightUpdate` checks names and shapes of each bucket and, at the
end of an update, that every weight of the model was loaded, so that a partial load fails instead of leaving stale
weights behind.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from runtime.engines import weight_transfer
from runtime.engines.base import (
    Generation,
    SamplingParams,
    check_generate_args,
    sampling_seed,
    stop_string_end,
)
from runtime.engines.checkpoint_layout import CheckpointLayout
from runtime.engines.decode import ATTENTION, decode, register_attention
from runtime.engines.fused import fuse_model
from runtime.engines.routes import moe_routers


def rng_state(device: torch.device) -> dict[str, Any]:
    """torch's CPU generator state, and ``device``'s when it is a GPU: what a checkpoint needs to sample alike."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def load_untied_state_dict(model: torch.nn.Module, state_dict: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Load ``state_dict`` into ``model`` (``strict=False``); return the keys that do not fit, ``(missing,
    unexpected)``. Tied weights (lm_head = embeddings) may be absent from one side without losing anything, so they
    are not counted as missing."""
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    return [k for k in missing if k not in tied], list(unexpected)


def pick_device(device: str = "auto") -> torch.device:
    """``auto``: the CUDA device Ray (or the user) made visible, else the CPU."""
    if device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    chosen = torch.device(device)
    if chosen.type == "cuda" and chosen.index is None:
        return torch.device("cuda", torch.cuda.current_device())  # an index: torch.cuda.set_device needs one
    return chosen


class WeightUpdate:
    """The weights one update has loaded so far, checked against a model's own names and shapes.

    ``model`` may live on the ``meta`` device (only its names and shapes are read). Buckets use the checkpoint's names
    (:class:`runtime.engines.checkpoint_layout.CheckpointLayout`): the model's ``state_dict`` names, except that an MoE
    model's fused experts come one tensor per expert and projection. Weights that are one tensor under several names
    (tied ``lm_head`` and embeddings) count as one, and a bucket may hold them under any of their names.
    """

    def __init__(self, model: torch.nn.Module):
        self.tensors: dict[str, torch.Tensor] = model.state_dict(keep_vars=True)
        self.layout = CheckpointLayout(model, shapes={name: tuple(t.shape) for name, t in self.tensors.items()})
        first_name: dict[int, str] = {}
        # The first name of a tied group (the input embeddings, for lm_head) stands for the whole group.
        self.canonical = {
            name: first_name.setdefault(id(self.tensors[slot.model_name]), name) if slot.index is None else name
            for name, slot in self.layout.slots.items()
        }
        self.loaded: set[str] = set()

    def target(self, name: str) -> torch.Tensor:
        """The model's tensor (or part of one) that checkpoint weight ``name`` is loaded into."""
        return self.layout.target(self.tensors, name)

    def check(self, shapes: dict[str, tuple[int, ...]], *, what: str) -> None:
        """Raise ``ValueError`` unless every name of ``shapes`` is a weight of the model with that shape."""
        slots = self.layout.slots
        unknown = sorted(set(shapes) - set(slots))
        if unknown:
            raise ValueError(f"{what} names weights the model does not have: {some_names(unknown)}")
        for name, shape in shapes.items():
            if tuple(shape) != slots[name].shape:
                raise ValueError(f"{what}: {name} has shape {list(shape)}, the model's is {list(slots[name].shape)}")

    def add(self, names: Iterable[str]) -> None:
        self.loaded.update(self.canonical[n] for n in names)

    def finish(self) -> None:
        """Raise ``ValueError`` if a weight was not loaded since the last finished update; start the next one."""
        loaded, self.loaded = self.loaded, set()
        self.require_complete(loaded, what="weight update (the weights loaded since the last one)")

    def require_complete(self, names: Iterable[str], *, what: str) -> None:
        """Raise ``ValueError`` unless ``names`` cover every weight of the model (tied ones under any name)."""
        missing = sorted(set(self.canonical.values()) - {self.canonical[n] for n in names})
        if missing:
            raise ValueError(
                f"{what} incomplete: {len(missing)} of {len(set(self.canonical.values()))} weights missing: "
                f"{some_names(missing)}"
            )

    def names_of(self, name: str) -> list[str]:
        """Every name of the weight ``name`` (several for tied weights)."""
        return [n for n, c in self.canonical.items() if c == self.canonical[name]]


def bucket_shapes(bucket: object) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor of ``bucket``, which must be a dict from names to tensors."""
    if not isinstance(bucket, dict):
        raise TypeError(f"bucket must be a dict of tensors, got {type(bucket).__name__}")
    for name, value in bucket.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"bucket[{name!r}] must be a torch.Tensor, got {type(value).__name__}")
    return {name: tuple(value.shape) for name, value in bucket.items()}


def some_names(names: list[str], k: int = 5) -> str:
    """The first ``k`` of ``names`` for an error message, and how many more there are."""
    return ", ".join(names[:k]) + (f" and {len(names) - k} more" if len(names) > k else "")


def safetensors_files(folder: str | Path) -> list[Path]:
    """The weight files of a HF folder: those ``model.safetensors.index.json`` maps to if it exists, else every
    ``*.safetensors`` file."""
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"{str(root)!r} is not a folder")
    index = root / "model.safetensors.index.json"
    if index.is_file():
        files = [root / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{index} maps weights to files that are not there: {some_names(absent)}")
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {str(root)!r}")
    return files


def eos_token_ids(tokenizer_eos: int | None, generation_config_eos: int | list[int] | None) -> list[int]:
    """The union of the tokenizer's eos and the model's ``generation_config.eos_token_id`` (an int or a list)."""
    ids = [] if tokenizer_eos is None else [tokenizer_eos]
    if isinstance(generation_config_eos, int):
        ids.append(generation_config_eos)
    elif generation_config_eos is not None:
        ids.extend(generation_config_eos)
    return sorted(set(ids))


def bare_generation_config(*, eos: list[int], pad: int):
    """A ``GenerationConfig`` with only eos and pad set: what transformers fills unset call fields from."""
    from transformers import GenerationConfig

    return GenerationConfig(eos_token_id=eos, pad_token_id=pad)


MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def _memory_tags(tags: list[str] | None) -> set[str]:
    if tags is None:
        return set(MEMORY_TAGS)
    if not isinstance(tags, list) or not tags or any(t not in MEMORY_TAGS for t in tags):
        raise ValueError(f"tags must be None or a non-empty list drawn from {MEMORY_TAGS}, got {tags!r}")
    return set(tags)


class HFEngine:
    """A causal LM from a HF folder that samples responses with per-token log-probs (see :class:`RolloutEngine`).

    Runs in its own Ray actor process (``runtime.cluster``). Each prompt draws from its own stream, seeded with
    :func:`runtime.engines.base.sampling_seed` of ``seed``, the number of generate calls so far and its index in the
    call (as the SGLang adapter seeds its requests); :meth:`get_rng_state` / :meth:`set_rng_state` save and restore
    that count, so that a resumed job samples alike. ``max_running_requests`` (``--engine-max-running-requests``;
    default: every prompt of a call at once) bounds the rows decoded together: the KV cache holds that many, and rows
    that stop are refilled with waiting prompts (:func:`runtime.engines.decode.decode`); a prompt's draws do not
    depend on it (in float32 on the CPU the tokens are the same for any value). ``kv_cache_tokens``
    (``--engine-kv-cache-tokens``; default: room for every running row's longest response) bounds the paged KV cache
    (:class:`runtime.engines.decode.DecodeCache`): groups wait for pages, and the group started last is preempted
    and starts over when the running rows run short.
    """

    def __init__(
        self,
        model_path: str,
        *,
        seed: int,
        device: str = "auto",
        dtype: str = "auto",
        cuda_graph: bool = True,
        compile: bool = False,
        max_running_requests: int | None = None,
        fused: bool = True,
        kv_cache_tokens: int | None = None,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        n = max_running_requests
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"max_running_requests must be None or an int >= 1, got {max_running_requests!r}")
        t = kv_cache_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise ValueError(f"kv_cache_tokens must be None or an int >= 1, got {kv_cache_tokens!r}")
        self.kv_cache_tokens = kv_cache_tokens
        self.device = pick_device(device)
        torch.manual_seed(seed)
        self.seed, self._generate_calls = seed, 0
        self.max_running_requests = max_running_requests
        if dtype == "auto":
            dtype = "bfloat16" if self.device.type == "cuda" and torch.cuda.is_bf16_supported() else "float32"
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        self.model.to(self.device).eval()
        register_attention()
        self.model.set_attn_implementation(ATTENTION)
        self.cuda_graph = self.device.type == "cuda" and cuda_graph
        self.compile = self.device.type == "cuda" and compile
        if self.cuda_graph and self.model.dtype != torch.bfloat16 and any(True for _ in moe_routers(self.model)):
            # torch's grouped_mm computes bf16 on the GPU; in other dtypes transformers' grouped experts copy the
            # group offsets to the host, which a CUDA graph cannot capture (2026-11-27, a float32 MoE preset on an
            # H200): such a model decodes without graphs. (transformers' batched-matmul experts would capture, but
            # gather each token's experts' weights: gigabytes a layer for a real model's prefill.)
            self.cuda_graph = False
        # A group's samples (equal runs of one prompt) share its prefill and cached keys; the decode attention is
        # runtime.engines.decode_attention's default for the device; checks lag one block on the GPU (decode's
        # lagged_checks). Benchmarks turn these.
        self.share_prompts, self.attention_kernel, self.lagged_checks = True, None, None
        # On a GPU the Llama/Qwen norms, MLP and rotary run as fused Triton kernels with the HF modules' rounding
        # (runtime.engines.fused): a decoding step of a small model is bound by its kernel count.
        self.fused = self.device.type == "cuda" and fused and fuse_model(self.model) > 0
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids(tokenizer.eos_token_id, self.model.generation_config.eos_token_id)
        if not self.eos_token_ids:
            raise ValueError(
                f"{model_path!r} names no eos token (tokenizer or generation_config.json): the engine "
                "cannot tell where to stop"
            )
        self.eos_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else self.eos_token_ids[0]
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_id
        self.model.generation_config = bare_generation_config(eos=self.eos_token_ids, pad=self.pad_token_id)
        self.weight_update = WeightUpdate(self.model)
        self._weight_version = 0
        self._weight_groups: dict[str, Any] = {}
        # Weights received while generating (stage_weights_from_distributed), loaded by commit_staged_weights.
        self._staged: dict[str, torch.Tensor] = {}
        self._staged_version: int | None = None
        self._released_tags: set[str] = set()
        self.released = False
        self.closed = False
        # abort() bumps the epoch; a generate call stops once the epoch differs from the one it started under.
        self._abort_epoch = 0
        self._abort_lock = threading.Lock()

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams | dict[str, Any]) -> list[Generation]:
        """One response per prompt; ``prompts`` is a list of non-empty token-id lists.

        A response ends at the model's eos ids or any of ``params.stop_token_ids`` (they add to the eos, as in
        SGLang), or at the first token after which its text holds one of ``params.stop`` (kept, as SGLang keeps it
        with ``no_stop_trim``; :func:`runtime.engines.base.stop_string_end`); its log-probs are the untruncated
        ``log_softmax(logits / temperature)`` of each sampled token.
        :meth:`abort` ends the call after the decoding step it lands in: the rows still running return the tokens
        sampled so far with ``finish_reason="abort"``, the finished ones keep ``"stop"`` or ``"length"``, and the
        prompts still waiting for a slot (``max_running_requests``) return no tokens with ``"abort"``.
        """
        params = check_generate_args(prompts, params, released=self.released)
        epoch, version = self._abort_epoch, self._weight_version
        stop = sorted({*self.eos_token_ids, *params.stop_token_ids})
        width = max(len(ids) for ids in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, ids in enumerate(prompts):
            input_ids[i, width - len(ids) :] = torch.tensor(ids)
            attention_mask[i, width - len(ids) :] = 1
        seeds = [sampling_seed(self.seed, self._generate_calls, i) for i in range(len(prompts))]
        self._generate_calls += 1
        decoded = decode(
            self.model,
            input_ids.to(self.device),
            attention_mask.to(self.device),
            max_new_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            stop_ids=stop,
            pad_id=self.pad_token_id,
            seeds=seeds,
            max_running=self.max_running_requests,
            is_aborted=lambda: self._abort_epoch != epoch,
            cuda_graph=self.cuda_graph,
            compile=self.compile,
            min_new_tokens=params.min_new_tokens,
            stopped=self._stop_string_check(params.stop) if params.stop else None,
            nucleus=params.return_top_p_token_ids,
            share_prompts=self.share_prompts,
            kernel=self.attention_kernel,
            kv_tokens=self.kv_cache_tokens,
            lagged_checks=self.lagged_checks,
            record_routes=params.return_routed_experts,
        )
        results = []
        rows = zip(decoded.tokens, decoded.log_probs, decoded.finish, strict=True)
        for row, (tokens, lps, finish) in enumerate(rows):
            ids = tokens.tolist()
            # Stop strings are checked every few decoding steps: the response ends at the first token after which
            # its text holds one.
            at_string = stop_string_end(ids, params.stop, self._decode)
            n = len(ids) if at_string is None else at_string
            extra = {} if decoded.nucleus is None else top_p_token_data(decoded.nucleus[row][:n])
            if decoded.routes is not None and decoded.routes[row] is not None:
                extra["routed_experts"] = decoded.routes[row][: len(prompts[row]) + n - 1]
            results.append(
                Generation(
                    token_ids=ids[:n],
                    log_probs=lps[:n].tolist(),
                    finish_reason="stop" if at_string is not None else finish,
                    weight_version=version,
                    extra=extra,
                )
            )
        return results

    def _stop_string_check(self, stops: tuple[str, ...]):
        """For :func:`decode`: which of the running rows' responses so far hold one of ``stops`` in their text.
        It only lets those rows stop early; where each response ends is found after decoding."""

        def stopped(rows: list[list[int]]) -> list[bool]:
            return [any(stop in self._decode(row) for stop in stops) for row in rows]

        return stopped

    def _decode(self, token_ids: list[int]) -> str:
        """A response's text as SGLang matches stop strings against it (special tokens kept)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def abort(self) -> None:
        """End every running :meth:`generate` call after its current decoding step (safe from another thread); a
        call that starts later is not affected."""
        with self._abort_lock:
            self._abort_epoch += 1

    @torch.no_grad()
    def load_weights(self, bucket: dict[str, torch.Tensor], *, weight_version: int | None = None) -> None:
        """Copy a bucket of HF-named tensors into the model in place (converted to the model's dtype and device).

        A bucket is a part of the model; tied weights come once, under either name. With ``weight_version`` (the last
        bucket of an update) every weight of the model must have been loaded since the previous update, else
        ``ValueError`` names what is missing (the version stays; the buckets already copied stay too, so the update
        must be sent again); the engine then samples as ``weight_version``. A bucket with an unknown name or a wrong
        shape raises ``ValueError`` before anything of it is copied.
        """
        if weight_version is not None:
            check_weight_version(weight_version)
        self.weight_update.check(bucket_shapes(bucket), what="load_weights bucket")
        for name, value in bucket.items():
            self.weight_update.target(name).copy_(value)
        self.weight_update.add(bucket)
        if weight_version is not None:
            self.weight_update.finish()
            self._weight_version = weight_version

    @torch.no_grad()
    def update_weights_from_tensor(self, payload: bytes, *, weight_version: int | None = None) -> None:
        """Load one bucket that a colocated trainer shares as handles to its memory
        (:func:`weight_transfer.serialize_named_tensors`): copied into the model before this returns, as
        :meth:`load_weights` copies a bucket."""
        bucket = dict(weight_transfer.deserialize_named_tensors(payload))
        try:
            self.load_weights(bucket, weight_version=weight_version)
        finally:
            del bucket  # the trainer's memory: let its handles go at once

    def update_weights_from_disk(self, path: str, *, weight_version: int) -> None:
        """Load every weight of the HF folder ``path`` (safetensors, sharded or not) and take ``weight_version``."""
        from safetensors.torch import load_file

        check_weight_version(weight_version)
        files = safetensors_files(path)
        self.weight_update.loaded = set()
        for f in files:
            self.load_weights(load_file(str(f)))
        self.load_weights({}, weight_version=weight_version)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = weight_transfer.DEFAULT_GROUP,
        backend: str = "gloo",
    ) -> None:
        """Join the trainer's weight-update group as rank ``rank_offset`` (SGLang's ``/init_weights_update_group``)."""
        if group_name in self._weight_groups:
            raise ValueError(f"weight-update group {group_name!r} already exists")
        self._weight_groups[group_name] = weight_transfer.init_weights_update_group(
            master_address=master_address,
            master_port=master_port,
            rank=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
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
        """Receive one bucket broadcast by the trainer and load it as :meth:`load_weights` does (SGLang's
        ``/update_weights_from_distributed``; ``load_format="flattened_bucket"``: the bucket as one flat buffer)."""
        bucket = self._receive_bucket(names, dtypes, shapes, group_name, load_format)
        self.load_weights(bucket, weight_version=weight_version)
        if weight_version is not None:
            # A whole update (a restarted engine's rejoin) supersedes weights staged before it.
            self._staged, self._staged_version = {}, None

    def _receive_bucket(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str, load_format: str | None
    ) -> dict[str, torch.Tensor]:
        """One bucket broadcast by the trainer over the weight-update group ``group_name``, on this engine's device."""
        if group_name not in self._weight_groups:
            raise ValueError(f"no weight-update group {group_name!r}: call init_weights_update_group first")
        device = self.device if self.device.type == "cuda" else "cpu"
        group = self._weight_groups[group_name]
        return weight_transfer.receive_bucket(group, names, dtypes, shapes, device=device, load_format=load_format)

    def stage_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        *,
        group_name: str = weight_transfer.DEFAULT_GROUP,
        weight_version: int | None = None,
        load_format: str | None = None,
    ) -> None:
        """Receive one bucket as :meth:`update_weights_from_distributed` does, into a second buffer: the model keeps
        sampling with its current weights (this runs beside ``generate``) until :meth:`commit_staged_weights`."""
        bucket = self._receive_bucket(names, dtypes, shapes, group_name, load_format)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # received before the trainer is told so
        self._staged.update(bucket)
        if weight_version is not None:
            self._staged_version = weight_version

    def commit_staged_weights(self) -> int | None:
        """Load the weights staged since the last commit (between two ``generate`` calls: it runs in their queue);
        returns the version they carry, None when nothing was staged (a restarted engine got its weights whole)."""
        if not self._staged:
            return None
        bucket, version = self._staged, self._staged_version
        self._staged, self._staged_version = {}, None
        self.load_weights(bucket, weight_version=version)
        return version

    def destroy_weights_update_group(self, group_name: str = weight_transfer.DEFAULT_GROUP) -> None:
        if group_name in self._weight_groups:
            weight_transfer.destroy_group(self._weight_groups.pop(group_name))

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        """The first ``truncate_size`` rows of weight ``name`` as nested lists (SGLang's ``/get_weights_by_name``)."""
        return self.weight_update.target(name).detach().float().cpu().tolist()[:truncate_size]

    def tp_size(self) -> int:
        """Ranks the engine takes in a weight-update group (one: the embedded engine is one process)."""
        return 1

    def weight_version(self) -> int:
        return self._weight_version

    def weight_dtype(self) -> str:
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The engine's current weights on the CPU in the checkpoint's names (used by tests to check a weight sync)."""
        weights = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        return self.weight_update.layout.state_dict(weights)

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Give device memory back: all of it, or the ``tags`` among ``weights``, ``kv_cache``, ``cuda_graph`` (as
        SGLang's). Only ``weights`` holds memory between calls here (the model moves to the CPU); the KV cache and
        the graph live for one call, and releasing them returns the blocks the allocator kept to the device."""
        tags = _memory_tags(tags)
        if "weights" in tags and "weights" not in self._released_tags and self.device.type == "cuda":
            # Merged projections (runtime.engines.fused) hold the weights the parameters view: drop them first, so
            # that moving the parameters frees the device memory.
            fuse_model(self.model, on=False)
            self.model.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._released_tags |= tags
        self.released = True

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Take back what :meth:`release_memory` gave (all, or ``tags``); generates again once nothing is released."""
        tags = _memory_tags(tags)
        if "weights" in tags and "weights" in self._released_tags and self.device.type == "cuda":
            self.model.to(self.device)
            if self.fused:
                fuse_model(self.model)
        self._released_tags -= tags
        self.released = bool(self._released_tags)

    def device_memory(self) -> dict[str, int] | None:
        """The peak of reserved GPU memory of this engine's process and its device's total (bytes); None on the
        CPU. The colocated job reads it to decide whether offloading is needed (``runtime.colocation.Offload``)."""
        if self.device.type != "cuda":
            return None
        return {
            "peak": torch.cuda.max_memory_reserved(self.device),
            "total": torch.cuda.get_device_properties(self.device).total_memory,
        }

    def get_rng_state(self) -> dict[str, Any]:
        """torch's generators and the count of generate calls (which, with the seed, gives each prompt's stream)."""
        return {**rng_state(self.device), "seed": self.seed, "generate_calls": self._generate_calls}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        restore_rng_state(state, self.device)
        self.seed = state.get("seed", self.seed)
        self._generate_calls = state.get("generate_calls", self._generate_calls)

    def health(self) -> bool:
        """Whether :meth:`generate` can run now: not released, not closed."""
        return not (self.released or self.closed)

    def close(self) -> None:
        """Nothing outside the process to give back; the engine reports itself unhealthy from now on."""
        self.closed = True


def top_p_token_data(nucleus: list[list[int]]) -> dict[str, list[int]]:
    """slime's layout of a response's nuclei (one id list per token): ``top_p_token_ids``, every nucleus one after
    another, and ``top_p_token_offsets``, where each starts (one more than there are tokens)."""
    offsets = [0]
    for ids in nucleus:
        offsets.append(offsets[-1] + len(ids))
    return {"top_p_token_ids": [i for ids in nucleus for i in ids], "top_p_token_offsets": offsets}


def check_weight_version(weight_version: object) -> None:
    """A weight version is an int (not a bool)."""
    if isinstance(weight_version, bool) or not isinstance(weight_version, int):
        raise TypeError(f"weight_version must be an int, got {type(weight_version).__name__}")
