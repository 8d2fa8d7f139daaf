"""The rollout-engine protocol: what the loop needs from an inference engine, whichever one it is.

An engine turns prompt token ids into sampled response token ids with the log-probability of each sampled token
under ``log_softmax(logits / temperature)`` over the whole vocabulary, *before* top-k/top-p truncation (sampling
uses the truncated distribution; the log-probs are what SGLang reports and the trainer recomputes, so that
truncated importance sampling compares like with like), takes new weights from the trainer,
and gives its device memory back between rollouts when it shares a device with the trainer (``--colocate``).
The embedded engine (:class:`runtime.engines.HFEngine`) implements it on transformers; an SGLang engine plugs in
behind the same methods.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one generate call (slime's names: ``--rollout-temperature`` and friends).

    ``top_k=-1`` is off; ``stop_token_ids`` end a response in addition to the model's eos ids; ``stop`` strings end it
    at the first token whose decoded response contains one (slime's ``--rollout-stop``; the tokens are kept, as SGLang
    keeps them with ``no_stop_trim``); ``min_new_tokens`` keeps the eos and stop ids from being sampled before that
    many tokens (slime's ``--eval-min-new-tokens``; the log-probs are then those of the constrained distribution).
    ``return_top_p_token_ids`` (top-p nucleus replay, the name of slime's SGLang ``custom_params`` switch): the engine
    reports each token's nucleus (``Generation.extra``'s ``top_p_token_ids`` / ``top_p_token_offsets``, slime's
    layout) and the log-prob of each token over it, renormalised. ``return_routed_experts`` (SGLang's request field,
    routing replay): the engine reports the experts that routed every token (``Generation.extra["routed_experts"]``,
    ``[len(prompt) + len(token_ids) - 1, num_layers, topk]`` int32: :mod:`runtime.engines.routes`).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    min_new_tokens: int = 0
    return_top_p_token_ids: bool = False
    return_routed_experts: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise TypeError(f"max_new_tokens must be an int, got {type(self.max_new_tokens).__name__}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not isinstance(self.stop, tuple) or not all(isinstance(x, str) and x for x in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        if (
            isinstance(self.min_new_tokens, bool)
            or not isinstance(self.min_new_tokens, int)
            or self.min_new_tokens < 0
        ):
            raise ValueError(f"min_new_tokens must be an int >= 0, got {self.min_new_tokens!r}")

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> SamplingParams:
        """The inverse of :meth:`to_dict` (``stop_token_ids`` and ``stop`` may be any sequence, as the lists it
        writes; ``custom_params``' ``return_top_p_token_ids``, slime's, sets that field)."""
        sequences = {key: tuple(params.get(key, ())) for key in ("stop_token_ids", "stop")}
        params = dict(params)
        custom = params.pop("custom_params", None) or {}
        if "return_top_p_token_ids" in custom:
            params["return_top_p_token_ids"] = bool(custom["return_top_p_token_ids"])
        return cls(**{**params, **sequences})

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop_token_ids": list(self.stop_token_ids),
            "stop": list(self.stop),
            "min_new_tokens": self.min_new_tokens,
            # slime's sampling params ask its patched SGLang for the nucleus this way.
            **({"custom_params": {"return_top_p_token_ids": True}} if self.return_top_p_token_ids else {}),
            **({"return_routed_experts": True} if self.return_routed_experts else {}),
        }


def stop_string_end(token_ids: list[int], stops: tuple[str, ...], decode: Callable[[list[int]], str]) -> int | None:
    """The length of the shortest prefix of ``token_ids`` whose decoded text (``decode``) contains one of ``stops``,
    None when the whole does not: where a response with stop strings ends (SGLang ends a request at the first token
    after which a stop string appears in its text). Containment grows with the prefix, so a bisection finds it."""
    if not stops or not any(stop in decode(token_ids) for stop in stops):
        return None
    lo, hi = 1, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if any(stop in decode(token_ids[:mid]) for stop in stops):
            hi = mid
        else:
            lo = mid + 1
    return lo


def sampling_seed(seed: int, call: int, index: int) -> int:
    """The ``sampling_seed`` (in ``[0, 2**31)``) of prompt ``index`` in the ``call``-th generate call.

    numpy's ``SeedSequence`` mixes the three, so that neighbouring prompts and calls get unrelated seeds.
    """
    return int(np.random.SeedSequence([seed, call, index]).generate_state(1, dtype=np.uint32)[0]) >> 1


@dataclass
class Generation:
    """One sampled response: its token ids, the log-prob of each, and why it ended.

    ``finish_reason`` is ``"stop"`` (a stop token was sampled; it is the last of ``token_ids``), ``"length"``
    (``max_new_tokens`` reached) or ``"abort"`` (the engine cut the request off, e.g. SGLang's ``/abort_request``:
    the response is not the policy's, and the rollout drops the sample's whole group).
    """

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    weight_version: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def check_generate_args(prompts: object, params: SamplingParams | dict[str, Any], *, released: bool) -> SamplingParams:
    """The checks every engine's ``generate`` makes; returns ``params`` as ``SamplingParams`` (Ray may pass a dict)."""
    if isinstance(params, dict):
        params = SamplingParams.from_dict(params)
    if released:
        raise RuntimeError("generate called on a released engine: call resume_memory() first")
    if not isinstance(prompts, list) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of token-id lists, got {type(prompts).__name__}")
    for i, ids in enumerate(prompts):
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise ValueError(f"prompts[{i}] must be a non-empty list of ints, got {ids!r:.80}")
    return params


@runtime_checkable
class RolloutEngine(Protocol):
    """One inference engine, as the runtime drives it (a Ray actor; every method is called through ``.remote``).

    Weight versions: an engine starts at version 0 (the checkpoint it loaded) and takes the version of each weight
    update; every :class:`Generation` carries the version it was sampled with, and a generation that spans an
    update (partial rollout) is cut at the update with :meth:`abort` first, so one generation never mixes versions.
    """

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Sample one response per prompt (token ids in, token ids and per-token log-probs out)."""
        ...

    def load_weights(self, bucket: dict[str, Any], *, weight_version: int | None = None) -> None:
        """Load one bucket of HF-named tensors (a part of the model, tied weights once); ``weight_version`` is given
        with the last bucket of an update and becomes the engine's version once that bucket is loaded."""
        ...

    def update_weights_from_disk(self, path: str, *, weight_version: int) -> None:
        """Load a whole HF folder of safetensors written by the trainer and take ``weight_version``."""
        ...

    def update_weights_from_tensor(self, payload: bytes, *, weight_version: int | None = None) -> None:
        """Load one bucket a colocated trainer shares as handles to its memory
        (``runtime.engines.weight_transfer.serialize_named_tensors``; SGLang's ``/update_weights_from_tensor``),
        copying it before returning; ``weight_version`` as in :meth:`load_weights`."""
        ...

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        """Join the trainer's weight-update group (``torch.distributed``; the trainer is rank 0 and hosts the
        rendezvous at ``master_address:master_port``) as ranks ``rank_offset`` .. ``rank_offset + tp_size() - 1``;
        blocks until every rank has joined (SGLang's ``/init_weights_update_group``)."""
        ...

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        *,
        group_name: str = "weight_update_group",
        weight_version: int | None = None,
        load_format: str | None = None,
    ) -> None:
        """Receive one bucket that rank 0 broadcasts over the group, tensor by tensor in ``names`` order (or as one
        flat buffer of their bytes under ``load_format="flattened_bucket"``, SGLang's), and load it as
        :meth:`load_weights` loads a bucket (``weight_version`` with the last bucket of an update)."""
        ...

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        """Leave the weight-update group."""
        ...

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        """The first ``truncate_size`` rows of weight ``name`` as nested lists of floats (SGLang's
        ``/get_weights_by_name``; ``--check-weight-update-equal`` compares them with the trainer's)."""
        ...

    def tp_size(self) -> int:
        """The engine's ranks in a weight-update group (its tensor-parallel size)."""
        ...

    def weight_version(self) -> int:
        """The version of the weights the engine samples with now."""
        ...

    def weight_dtype(self) -> str:
        """The torch dtype name the engine holds its weights in (``"bfloat16"``, ``"float32"``): what a weight sync
        sends, so that nothing is converted twice."""
        ...

    def abort(self) -> None:
        """End every running :meth:`generate` call early: each returns what it has sampled so far, with
        ``finish_reason="abort"`` (partial rollout resumes such samples after a weight update)."""
        ...

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Give device memory back until :meth:`resume_memory`: all of it, or the ``tags`` among ``weights``,
        ``kv_cache``, ``cuda_graph`` (SGLang's). The engine generates again once every released tag is resumed."""
        ...

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Take device memory again: all of it, or ``tags`` (weights before a weight sync, the caches before
        generating)."""
        ...

    def get_rng_state(self) -> Any:
        """What a checkpoint needs so that a resumed job samples alike."""
        ...

    def set_rng_state(self, state: Any) -> None: ...

    def health(self) -> bool:
        """Whether the engine can generate now (SGLang's ``/health_generate``)."""
        ...

    def close(self) -> None:
        """Release what the engine holds outside its process (temporary folders, connections)."""
        ...
