"""The embedded rollout engine: transformers generation with a KV cache, batched with left padding.

Why not transformers' continuous batching (``generate_batch``, which can return log-probs)? On the CPU it cannot
start: its paged KV cache sizes itself from free device memory, which it reads as 0 there (transformers 5.17:
"Memory footprint ... is more than available memory 0", even with ``num_blocks`` and ``max_batch_tokens`` given).
The batched ``generate`` works on every device, and at the sizes this engine is for (CPU runs, tests, single-GPU
debugging) the padding it wastes is small; SGLang is the engine for throughput.

Per-token rollout log-probs are ``log_softmax(logits / temperature)`` of the sampled token over the whole vocabulary,
taken from the raw logits (a logits processor that runs before temperature, top-k and top-p and holds one step's
logits at a time) *before* top-k and top-p truncation: what SGLang reports and what the
trainer recomputes, so that ``--use-tis`` compares like with like. Sampling itself still draws from the truncated
distribution. The model's own ``generation_config.json`` is set aside at load: transformers fills every field a call
leaves unset from it (``min_p``, ``top_h``, repetition penalties, minimum lengths, ...), which would sample from a
distribution the job never asked for; every such processor is forced off here. The model's eos ids (tokenizer and
``generation_config.json``, which may list several, as Llama-3 and Qwen do) always end a response.

Partial rollout needs :meth:`HFEngine.abort` to cut a running ``generate`` short from another thread (the engine
actor runs ``abort`` in a concurrency group of its own, ``runtime.cluster.engines``): a stopping criterion reads an
abort counter after every decoding step, and the cut call returns the tokens sampled so far with their log-probs and
``finish_reason="abort"``.

Weights arrive in buckets of HF-named tensors (:meth:`HFEngine.load_weights`) or as a HF folder
(:meth:`HFEngine.update_weights_from_disk`); :class:`WeightUpdate` checks names and shapes of each bucket and, at the
end of an update, that every weight of the model was loaded, so that a partial load fails instead of leaving stale
weights behind.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from runtime.engines import weight_transfer
from runtime.engines.base import Generation, SamplingParams, check_generate_args


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
    return torch.device(device)


class WeightUpdate:
    """The weights one update has loaded so far, checked against a model's own names and shapes.

    ``model`` may live on the ``meta`` device (only its names and shapes are read). Its ``state_dict`` names are the
    HF names buckets use; weights that are one tensor under several names (tied ``lm_head`` and embeddings) count as
    one, and a bucket may hold them under any of their names.
    """

    def __init__(self, model: torch.nn.Module):
        self.weights: dict[str, torch.Tensor] = model.state_dict(keep_vars=True)
        first_name: dict[int, str] = {}
        # The first name of a tied group (the input embeddings, for lm_head) stands for the whole group.
        self.canonical = {name: first_name.setdefault(id(t), name) for name, t in self.weights.items()}
        self.loaded: set[str] = set()

    def check(self, shapes: dict[str, tuple[int, ...]], *, what: str) -> None:
        """Raise ``ValueError`` unless every name of ``shapes`` is a weight of the model with that shape."""
        unknown = sorted(set(shapes) - set(self.weights))
        if unknown:
            raise ValueError(f"{what} names weights the model does not have: {some_names(unknown)}")
        for name, shape in shapes.items():
            if tuple(shape) != tuple(self.weights[name].shape):
                raise ValueError(
                    f"{what}: {name} has shape {list(shape)}, the model's is {list(self.weights[name].shape)}"
                )

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


def _abort_criteria(is_aborted: Callable[[], bool]):
    """A ``StoppingCriteriaList`` that ends every row once ``is_aborted()`` (checked after each decoding step)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class AbortRequested(StoppingCriteria):
        def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
            return torch.full((input_ids.shape[0],), is_aborted(), dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([AbortRequested()])


class _LogProbRecorder:
    """A logits processor that records ``log_softmax(logits / T)`` of each sampled token, one step late.

    Called with the raw logits of step t (transformers applies custom processors before temperature, top-k and
    top-p), it keeps them until step t + 1, whose ``input_ids`` end with the token sampled at t; :meth:`finish` takes
    the last step's from the final sequences. Only one step's ``[B, V]`` logits are held, where ``output_logits``
    kept every step's (``B x T x V`` float32, copied again to stack them).
    """

    def __init__(self, temperature: float):
        self.scale = 1.0 / temperature
        self.pending: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def _take(self, tokens: torch.Tensor) -> None:
        # The same float32 arithmetic as the trainer's log-probs (rlcore.kernels: logits.float() * (1 / T)).
        log_probs = torch.log_softmax(self.pending.float() * self.scale, dim=-1)
        self.steps.append(log_probs.gather(-1, tokens[:, None]).squeeze(-1))
        self.pending = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.pending is not None:
            self._take(input_ids[:, -1])
        self.pending = scores.clone()
        return scores

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """``[B, steps]`` log-probs of ``new_tokens`` (the generated columns)."""
        if self.pending is not None:
            self._take(new_tokens[:, -1])
        if len(self.steps) != new_tokens.shape[1]:
            raise RuntimeError(f"recorded {len(self.steps)} decoding steps for {new_tokens.shape[1]} new tokens")
        if not self.steps:
            return torch.zeros(new_tokens.shape, dtype=torch.float32, device=new_tokens.device)
        return torch.stack(self.steps, dim=1)


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


def _neutral_generation_config(params: SamplingParams, *, eos: list[int], pad: int):
    from transformers import GenerationConfig

    # Every field that switches on a logits processor is given its "off" value, not left None: transformers fills
    # None fields from the model's generation config, and a user's checkpoint may set any of them.
    return GenerationConfig(
        do_sample=True,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=0 if params.top_k == -1 else params.top_k,
        max_new_tokens=params.max_new_tokens,
        # min_length stays unset (transformers warns when both are set): min_new_tokens takes precedence over it.
        min_new_tokens=0,
        min_p=0.0,
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        encoder_no_repeat_ngram_size=0,
        encoder_repetition_penalty=1.0,
        length_penalty=1.0,
        guidance_scale=1.0,
        num_beams=1,
        num_return_sequences=1,
        renormalize_logits=False,
        remove_invalid_values=False,
        eos_token_id=eos,
        pad_token_id=pad,
        return_dict_in_generate=True,
        output_logits=False,
        output_scores=False,
        use_cache=True,
    )


MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def _memory_tags(tags: list[str] | None) -> set[str]:
    if tags is None:
        return set(MEMORY_TAGS)
    if not isinstance(tags, list) or not tags or any(t not in MEMORY_TAGS for t in tags):
        raise ValueError(f"tags must be None or a non-empty list drawn from {MEMORY_TAGS}, got {tags!r}")
    return set(tags)


class HFEngine:
    """A causal LM from a HF folder that samples responses with per-token log-probs (see :class:`RolloutEngine`).

    Runs in its own Ray actor process (``runtime.cluster``); sampling uses the process's torch RNG, seeded here and
    saved/restored with :meth:`get_rng_state` / :meth:`set_rng_state` so that a resumed job samples alike.
    """

    def __init__(self, model_path: str, *, seed: int, device: str = "auto", dtype: str = "auto"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = pick_device(device)
        torch.manual_seed(seed)
        if dtype == "auto":
            dtype = "bfloat16" if self.device.type == "cuda" and torch.cuda.is_bf16_supported() else "float32"
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        self.model.to(self.device).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_path)
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
        SGLang); its log-probs are the untruncated ``log_softmax(logits / temperature)`` of each sampled token.
        :meth:`abort` ends the call after the decoding step it lands in: the rows still running return the tokens
        sampled so far with ``finish_reason="abort"``, the finished ones keep ``"stop"`` or ``"length"``.
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
        recorder = _LogProbRecorder(params.temperature)
        out = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            generation_config=_neutral_generation_config(params, eos=stop, pad=self.pad_token_id),
            logits_processor=[recorder],
            stopping_criteria=_abort_criteria(lambda: self._abort_epoch != epoch),
        )
        # One column per decoding step; rows that finished early are padded after their stop.
        new_tokens = out.sequences[:, width:]
        steps = new_tokens.shape[1]
        log_probs = recorder.finish(new_tokens)
        is_stop = torch.isin(new_tokens, torch.tensor(stop, device=new_tokens.device))
        # A response ends at its first stop token (kept); what follows is the padding of finished rows.
        first_stop = torch.where(is_stop.any(1), is_stop.int().argmax(1), steps)
        # Rows without a stop token ran every step: to max_new_tokens, or cut short by an abort.
        unstopped = "length" if steps == params.max_new_tokens else "abort"
        results = []
        for end, tokens, lps in zip(first_stop.tolist(), new_tokens, log_probs, strict=True):
            finished = end < steps
            n = end + 1 if finished else end
            results.append(
                Generation(
                    token_ids=tokens[:n].tolist(),
                    log_probs=lps[:n].tolist(),
                    finish_reason="stop" if finished else unstopped,
                    weight_version=version,
                )
            )
        return results

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
            self.weight_update.weights[name].data.copy_(value)
        self.weight_update.add(bucket)
        if weight_version is not None:
            self.weight_update.finish()
            self._weight_version = weight_version

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
    ) -> None:
        """Receive one bucket broadcast by the trainer and load it as :meth:`load_weights` does (SGLang's
        ``/update_weights_from_distributed``)."""
        if group_name not in self._weight_groups:
            raise ValueError(f"no weight-update group {group_name!r}: call init_weights_update_group first")
        device = self.device if self.device.type == "cuda" else "cpu"
        bucket = weight_transfer.receive_bucket(self._weight_groups[group_name], names, dtypes, shapes, device=device)
        self.load_weights(bucket, weight_version=weight_version)

    def destroy_weights_update_group(self, group_name: str = weight_transfer.DEFAULT_GROUP) -> None:
        if group_name in self._weight_groups:
            weight_transfer.destroy_group(self._weight_groups.pop(group_name))

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        """The first ``truncate_size`` rows of weight ``name`` as nested lists (SGLang's ``/get_weights_by_name``)."""
        return self.model.get_parameter(name).detach().float().cpu().tolist()[:truncate_size]

    def tp_size(self) -> int:
        """Ranks the engine takes in a weight-update group (one: the embedded engine is one process)."""
        return 1

    def weight_version(self) -> int:
        return self._weight_version

    def weight_dtype(self) -> str:
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The engine's current weights on the CPU (used by tests to check a weight sync)."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Give device memory back: all of it, or the ``tags`` among ``weights``, ``kv_cache``, ``cuda_graph`` (as
        SGLang's; only ``weights`` holds memory between calls here: the model moves to the CPU)."""
        tags = _memory_tags(tags)
        if "weights" in tags and "weights" not in self._released_tags and self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self._released_tags |= tags
        self.released = True

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Take back what :meth:`release_memory` gave (all, or ``tags``); generates again once nothing is released."""
        tags = _memory_tags(tags)
        if "weights" in tags and "weights" in self._released_tags and self.device.type == "cuda":
            self.model.to(self.device)
        self._released_tags -= tags
        self.released = bool(self._released_tags)

    def get_rng_state(self) -> dict[str, Any]:
        return rng_state(self.device)

    def set_rng_state(self, state: dict[str, Any]) -> None:
        restore_rng_state(state, self.device)

    def health(self) -> bool:
        """Whether :meth:`generate` can run now: not released, not closed."""
        return not (self.released or self.closed)

    def close(self) -> None:
        """Nothing outside the process to give back; the engine reports itself unhealthy from now on."""
        self.closed = True


def check_weight_version(weight_version: object) -> None:
    """A weight version is an int (not a bool)."""
    if isinstance(weight_version, bool) or not isinstance(weight_version, int):
        raise TypeError(f"weight_version must be an int, got {type(weight_version).__name__}")
