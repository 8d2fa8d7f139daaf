"""The embedded rollout engine: transformers generation with a KV cache, batched with left padding.

Why not transformers' continuous batching (``generate_batch``, which can return log-probs)? On the CPU it cannot
start: its paged KV cache sizes itself from free device memory, which it reads as 0 there (transformers 5.17:
"Memory footprint ... is more than available memory 0", even with ``num_blocks`` and ``max_batch_tokens`` given).
The batched ``generate`` works on every device, and at the sizes this engine is for (CPU runs, tests, single-GPU
debugging) the padding it wastes is small; SGLang is the engine for throughput.

Per-token rollout log-probs are ``log_softmax(logits / temperature)`` of the sampled token over the whole vocabulary,
taken from the raw logits (``output_logits``) *before* top-k and top-p truncation: what SGLang reports and what the
trainer recomputes, so that ``--use-tis`` compares like with like. Sampling itself still draws from the truncated
distribution. The model's own ``generation_config.json`` is set aside at load: transformers fills every field a call
leaves unset from it (``min_p``, ``top_h``, repetition penalties, minimum lengths, ...), which would sample from a
distribution the job never asked for; every such processor is forced off here. The model's eos ids (tokenizer and
``generation_config.json``, which may list several, as Llama-3 and Qwen do) always end a response.
"""

from __future__ import annotations

from typing import Any

import torch

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
        output_logits=True,
        output_scores=False,
        use_cache=True,
    )


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
        self.weight_version = 0
        self.released = False

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams | dict[str, Any]) -> list[Generation]:
        """One response per prompt; ``prompts`` is a list of non-empty token-id lists.

        A response ends at the model's eos ids or any of ``params.stop_token_ids`` (they add to the eos, as in
        SGLang); its log-probs are the untruncated ``log_softmax(logits / temperature)`` of each sampled token.
        """
        params = check_generate_args(prompts, params, released=self.released)
        stop = sorted({*self.eos_token_ids, *params.stop_token_ids})
        width = max(len(ids) for ids in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, ids in enumerate(prompts):
            input_ids[i, width - len(ids) :] = torch.tensor(ids)
            attention_mask[i, width - len(ids) :] = 1
        out = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            generation_config=_neutral_generation_config(params, eos=stop, pad=self.pad_token_id),
        )
        new_tokens = out.sequences[:, width:]
        # The same float32 arithmetic as the trainer's log-probs (rlcore.kernels: logits.float() * (1 / T)).
        logits = torch.stack(out.logits, dim=1).float() * (1.0 / params.temperature)
        log_probs = torch.log_softmax(logits, dim=-1).gather(-1, new_tokens[..., None]).squeeze(-1)
        is_stop = torch.isin(new_tokens, torch.tensor(stop, device=new_tokens.device))
        # A response ends at its first stop token (kept); what follows is the padding of finished rows.
        first_stop = torch.where(is_stop.any(1), is_stop.int().argmax(1), new_tokens.shape[1])
        results = []
        for end, tokens, lps in zip(first_stop.tolist(), new_tokens, log_probs, strict=True):
            finished = end < new_tokens.shape[1]
            n = end + 1 if finished else end
            results.append(
                Generation(
                    token_ids=tokens[:n].tolist(),
                    log_probs=lps[:n].tolist(),
                    finish_reason="stop" if finished else "length",
                    weight_version=self.weight_version,
                )
            )
        return results

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Copy the trainer's full state dict into the model (tied weights may appear under either name)."""
        missing, unexpected = load_untied_state_dict(self.model, state_dict)
        if missing or unexpected:
            raise ValueError(
                f"update_weights: state dict does not fit the model (missing {missing}, unexpected {unexpected})"
            )
        self.weight_version = version

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The engine's current weights on the CPU (used by tests to check a weight sync)."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def release_memory(self) -> None:
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self.released = True

    def resume_memory(self) -> None:
        if self.device.type == "cuda":
            self.model.to(self.device)
        self.released = False

    def get_rng_state(self) -> dict[str, Any]:
        return rng_state(self.device)

    def set_rng_state(self, state: dict[str, Any]) -> None:
        restore_rng_state(state, self.device)

    def ping(self) -> int:
        return self.weight_version
