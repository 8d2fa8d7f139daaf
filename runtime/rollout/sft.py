"""SFT mode: slime's ``sft_rollout`` (``--rollout-function-path runtime.rollout.sft.generate_rollout``, or slime's
own path ``slime.rollout.sft_rollout.generate_rollout``) with ``--loss-type sft_loss``.

Nothing is generated: each prompt of the data is a whole conversation (a chat-message list under ``--input-key``,
with its row's tools), tokenized with the model's chat template. The tokens the model must learn, the assistant
turns' content and end-of-turn tokens, get ``loss_mask`` 1; system, user and tool turns and each assistant turn's
header get 0; a message with ``"step_loss_mask": 0`` is left out of the loss too. The sample's response starts at
the first trained token.

``--loss-mask-type`` picks how the conversation is cut into turns:

- ``qwen``, ``qwen3``, ``qwen3_5`` (slime's names; any chat template with the prefix property): the conversation is
  rendered turn by turn, and the tokens each message adds to the rendering of the ones before it are that message's
  (for an assistant turn, less the generation prompt the template puts before it). A template under which a longer
  conversation does not extend a shorter one's rendering (one that rewrites earlier turns, e.g. drops past
  ``<think>`` blocks) is refused with a message naming the flag;
- ``distill_qwen``: the first message rendered as the prompt (with the generation prompt) and the last message's
  content, tokenized as is, as the one trained response.
"""

from __future__ import annotations

from typing import Any

from runtime.rollout.sample import Sample

LOSS_MASK_TYPES = ("qwen", "qwen3", "qwen3_5", "distill_qwen")


def _ids(tokenizer: Any, messages: list[dict], *, tools: Any, generation_prompt: bool = False) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=generation_prompt, tools=tools, return_dict=False
    )
    return list(out["input_ids"] if isinstance(out, dict) else out)


class MultiTurnLossMaskGenerator:
    """Token ids and per-token loss masks of chat conversations (slime's class of this name, our own method)."""

    def __init__(self, tokenizer: Any, tokenizer_type: str = "qwen"):
        if tokenizer_type not in LOSS_MASK_TYPES:
            raise ValueError(f"--loss-mask-type must be one of {', '.join(LOSS_MASK_TYPES)}, got {tokenizer_type!r}")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("--loss-type sft_loss: the tokenizer has no chat_template to render conversations with")
        self.tokenizer, self.tokenizer_type = tokenizer, tokenizer_type

    @staticmethod
    def get_response_lengths(loss_masks: list[list[int]]) -> list[int]:
        """Each mask's length from its first 1 to its end (0 without one)."""
        return [len(m) - m.index(1) if 1 in m else 0 for m in loss_masks]

    def get_loss_mask(self, messages: list[dict], tools: Any = None) -> tuple[list[int], list[int]]:
        """``(token_ids, loss_mask)`` of the whole conversation, one mask entry per token."""
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"an SFT sample's prompt must be a non-empty list of chat messages, got {messages!r:.80}")
        if self.tokenizer_type == "distill_qwen":
            return self._distill(messages, tools)
        return self._by_prefix(messages, tools)

    def _by_prefix(self, messages: list[dict], tools: Any) -> tuple[list[int], list[int]]:
        ids: list[int] = []
        mask: list[int] = []
        for i, message in enumerate(messages):
            upto = _ids(self.tokenizer, messages[: i + 1], tools=tools)
            if upto[: len(ids)] != ids:
                raise ValueError(
                    f"--loss-mask-type {self.tokenizer_type}: the chat template renders message {i} by rewriting the "
                    "ones before it (the conversation so far is not a prefix of the longer one), so turns cannot be "
                    "masked one by one; try --loss-mask-type distill_qwen for single-turn data"
                )
            added = upto[len(ids) :]
            trained = message.get("role") == "assistant" and message.get("step_loss_mask", 1) == 1
            if trained:
                header = _ids(self.tokenizer, messages[:i], tools=tools, generation_prompt=True) if i else []
                skip = len(header) - len(ids) if header[: len(ids)] == ids else 0
                mask += [0] * skip + [1] * (len(added) - skip)
            else:
                mask += [0] * len(added)
            ids = upto
        return ids, mask

    def _distill(self, messages: list[dict], tools: Any) -> tuple[list[int], list[int]]:
        prompt = self.tokenizer.apply_chat_template(
            messages[:1], tokenize=False, add_generation_prompt=True, tools=tools
        )
        prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        response_ids = self.tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"]
        trained = 1 if messages[-1].get("step_loss_mask", 1) == 1 else 0
        return list(prompt_ids) + list(response_ids), [0] * len(prompt_ids) + [trained] * len(response_ids)


def sft_sample(sample: Sample, generator: MultiTurnLossMaskGenerator) -> Sample:
    """``sample`` (its ``prompt`` a conversation, ``metadata["tools"]`` its tools) as an SFT sample: the whole
    conversation's tokens, the response from the first trained token, its loss mask, reward 0."""
    tokens, mask = generator.get_loss_mask(sample.prompt, tools=sample.metadata.get("tools"))
    response_length = generator.get_response_lengths([mask])[0]
    if response_length == 0 or response_length >= len(tokens):
        raise ValueError(
            f"SFT sample {sample.index}: no trained token after a first untrained one (its conversation needs an "
            "assistant turn after the first message)"
        )
    sample.tokens, sample.response_length = tokens, response_length
    sample.loss_mask = mask[-response_length:]
    sample.reward = 0.0
    sample.status = Sample.Status.COMPLETED
    return sample


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> list[list[Sample]]:
    """slime's ``sft_rollout.generate_rollout``: ``--rollout-batch-size`` conversations from ``data_source`` as SFT
    samples (one per group), tokenized with the job's tokenizer and ``--loss-mask-type``."""
    if evaluation:
        raise ValueError(
            "the SFT rollout has no evaluation: leave --eval-interval unset, or give --eval-function-path"
        )
    from runtime.rollout.plugins import rollout_tokenizer

    generator = MultiTurnLossMaskGenerator(rollout_tokenizer(), tokenizer_type=args.loss_mask_type)
    groups = data_source.get_samples(args.rollout_batch_size)
    return [[sft_sample(s, generator) for s in group] for group in groups]
