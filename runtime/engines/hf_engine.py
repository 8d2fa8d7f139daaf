"""The embedded rollout engine: transformers generation with a KV cache, batched with left padding.

Why not transformers' continuous batching (``generate_batch``, which can return log-probs)? On the CPU it cannot
start: its paged KV cache sizes itself from free device memory, which it reads as 0 there (transformers 5.17:
"Memory footprint ... is more than available memory 0", even with ``num_blocks`` and ``max_batch_tokens`` given).
The batched ``generate`` works on every device, and at the sizes this engine is for (CPU runs, tests, single-GPU
debugging) the padding it wastes is small; SGLang is the engine for throughput.

Per-token rollout log-probs come from the *processed* scores (``output_scores``): the logits after temperature,
top-k and top-p, i.e. the distribution the token was actually drawn from. Every other logits processor a model's
``generation_config.json`` could switch on (repetition penalty, n-gram bans, minimum lengths, ...) is forced off,
so that these log-probs and the trainer's agree up to numerics at the same weights.
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


def pick_device(device: str = "auto") -> torch.device:
    """``auto``: the CUDA device Ray (or the user) made visible, else the CPU."""
    if device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


def _neutral_generation_config(params: SamplingParams, *, eos: list[int], pad: int):
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=True,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=0 if params.top_k == -1 else params.top_k,
        max_new_tokens=params.max_new_tokens,
        min_new_tokens=0,
        min_p=None,
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        encoder_repetition_penalty=1.0,
        length_penalty=1.0,
        num_beams=1,
        num_return_sequences=1,
        renormalize_logits=False,
        bad_words_ids=None,
        suppress_tokens=None,
        begin_suppress_tokens=None,
        forced_bos_token_id=None,
        forced_eos_token_id=None,
        eos_token_id=eos,
        pad_token_id=pad,
        return_dict_in_generate=True,
        output_scores=True,
        use_cache=True,
    )


class HFEngine:
    """A causal LM from a HF folder that samples responses with per-token log-probs (see :class:`RolloutEngine`).

    Runs in its own Ray actor process (``runtime.placement``); sampling uses the process's torch RNG, seeded here
    and saved/restored with :meth:`get_rng_state` / :meth:`set_rng_state` so that a resumed job samples alike.
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
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if self.eos_token_id is None:
            raise ValueError(f"the tokenizer of {model_path!r} has no eos token; the engine cannot tell where to stop")
        self.weight_version = 0
        self.released = False

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams | dict[str, Any]) -> list[Generation]:
        """One response per prompt; ``prompts`` is a list of non-empty token-id lists."""
        params = check_generate_args(prompts, params, released=self.released)
        stop = list(params.stop_token_ids) or [self.eos_token_id]
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
        scores = torch.stack(out.scores, dim=1).float()
        log_probs = torch.log_softmax(scores, dim=-1).gather(-1, new_tokens[..., None]).squeeze(-1)
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
        missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        tied = set(getattr(self.model, "_tied_weights_keys", None) or {})
        missing = [k for k in missing if k not in tied]
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
