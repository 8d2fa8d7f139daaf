"""``Sample``: one prompt's rollout, with slime's field names so that slime hooks run unchanged.

The fields, ``Status``'s values, ``SpecInfo`` / ``PrefixCacheInfo`` and the helpers hooks call
(``get_reward_value``, ``effective_response_length``, ``append_response_tokens``, ``to_dict`` / ``from_dict``) follow
slime's ``slime/utils/types.py``. ``rollout_top_p_token_ids`` / ``_offsets`` (top-p replay) are slime's layout: the
nucleus of response token ``i`` is ``ids[offsets[i]:offsets[i + 1]]``. ``rollout_routed_experts`` (routing replay)
is slime's layout too: ``[len(tokens) - 1, num_layers, topk]`` integer expert ids (numpy or torch; int16 or wider),
row ``s`` the experts that routed token ``s`` in each decoder layer. The fields of slime's that need model parts
rlcore lacks (multimodal inputs) are kept so that hooks may set them, and are not read.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    """A prompt and, once generated, its response.

    ``tokens`` holds prompt and response token ids together; the last ``response_length`` of them
    are the response. ``loss_mask`` and ``rollout_log_probs`` have one entry per response token
    (``loss_mask`` 0 on tool output in multi-turn rollouts). ``reward`` is a float, or a dict when a
    reward model returns several fields.

    ``rollout_id``: samples that one generation split into several (a custom generate function returning a list)
    share it, so that the loss averages over the rollout's tokens once instead of over each piece (slime's
    ``rollout_mask_sums``); None: the sample is a rollout of its own. ``remove_sample`` (set by
    ``--rollout-sample-filter-path``): the sample's tokens leave the loss, the sample still counts in its
    denominators.
    """

    class Status(enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        # A recoverable failure (a tool call or an external API that failed): the sample may hold partial output.
        FAILED = "failed"

    @dataclass
    class SpecInfo:
        """Speculative-decoding counts of a sample (filled by engines that report them)."""

        spec_accept_token_num: int = 0
        spec_draft_token_num: int = 0
        spec_verify_ct: int = 0
        completion_token_num: int = 0

        @property
        def spec_accept_rate(self) -> float:
            return self.spec_accept_token_num / self.spec_draft_token_num if self.spec_draft_token_num > 0 else 0.0

        @property
        def spec_accept_length(self) -> float:
            return self.completion_token_num / self.spec_verify_ct if self.spec_verify_ct > 0 else 0.0

        def add(self, meta_info: dict) -> None:
            self.spec_accept_token_num += meta_info.get("spec_accept_token_num", 0)
            self.spec_draft_token_num += meta_info.get("spec_draft_token_num", 0)
            self.spec_verify_ct += meta_info.get("spec_verify_ct", 0)
            self.completion_token_num += meta_info.get("completion_tokens", 0)

        def to_dict(self) -> dict[str, int]:
            return dict(vars(self))

        @staticmethod
        def from_dict(data: dict) -> Sample.SpecInfo:
            return Sample.SpecInfo(**{k: data.get(k, 0) for k in Sample.SpecInfo.__dataclass_fields__})

    @dataclass
    class PrefixCacheInfo:
        """Prompt tokens an engine found in its prefix cache, of all prompt tokens sent."""

        cached_tokens: int = 0
        total_prompt_tokens: int = 0

        @property
        def prefix_cache_hit_rate(self) -> float:
            return self.cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens > 0 else 0.0

        def add(self, meta_info: dict) -> None:
            self.cached_tokens += meta_info.get("cached_tokens", 0)
            self.total_prompt_tokens += meta_info.get("prompt_tokens", 0)

        def to_dict(self) -> dict[str, int]:
            return dict(vars(self))

        @staticmethod
        def from_dict(data: dict) -> Sample.PrefixCacheInfo:
            return Sample.PrefixCacheInfo(**{k: data.get(k, 0) for k in Sample.PrefixCacheInfo.__dataclass_fields__})

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: list[int] | None = None
    rollout_top_p_token_offsets: list[int] | None = None
    rollout_routed_experts: Any = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    status: Sample.Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict | None = None
    # The id of the sample's conversation: every turn of a multi-turn sample goes to the same SGLang server (the
    # router's routing key), so the server's prefix cache holds the conversation so far.
    session_id: str | None = None
    non_generation_time: float = 0.0
    spec_info: Sample.SpecInfo = field(default_factory=SpecInfo)
    prefix_cache_info: Sample.PrefixCacheInfo = field(default_factory=PrefixCacheInfo)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def effective_response_length(self) -> int:
        """Response tokens in the loss (``sum(loss_mask)``; the whole response without a mask)."""
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def get_reward_value(self, args: Any) -> Any:
        """The reward, or its ``args.reward_key`` entry when the key is set (slime's accessor)."""
        key = getattr(args, "reward_key", None)
        return self.reward if not key else self.reward[key]

    def append_response_tokens(
        self,
        args: Any = None,
        *,
        tokens: list[int] | None = None,
        log_probs: list[float] | None = None,
        trainable: bool = True,
        meta_info: dict | None = None,
        text: str | None = None,
        update_terminal_info: bool = True,
    ) -> None:
        """Append response tokens, keeping ``loss_mask`` and ``rollout_log_probs`` aligned with the response.

        Model-generated tokens (``trainable=True``) come with their log-probs; tool or environment output
        (``trainable=False``) gets loss-mask 0 and log-prob 0. ``meta_info``'s ``finish_reason`` (SGLang's
        ``{"type": "stop" | "length" | "abort"}``) sets ``status`` when ``update_terminal_info``.
        """
        tokens = [int(t) for t in (tokens or [])]
        log_probs = None if log_probs is None else [float(x) for x in log_probs]
        if log_probs is not None and len(log_probs) != len(tokens):
            raise ValueError(f"log_probs length {len(log_probs)} != tokens length {len(tokens)}")
        if tokens and trainable and log_probs is None:
            raise ValueError("trainable response tokens need their rollout log-probs (log_probs=...)")
        if tokens and not trainable:
            if log_probs is not None:
                raise ValueError("tool (trainable=False) tokens take no rollout log-probs")
            log_probs = [0.0] * len(tokens)
        if text is not None:
            self.response += text
        before = self.response_length
        if tokens:
            self.tokens = list(self.tokens) + tokens
            self.response_length += len(tokens)
            self.loss_mask = (list(self.loss_mask) if self.loss_mask is not None else [1] * before) + [
                1 if trainable else 0
            ] * len(tokens)
        if log_probs is not None:
            if self.rollout_log_probs is None:
                if trainable and before:
                    raise ValueError("cannot append trainable log-probs to a sample whose earlier response has none")
                self.rollout_log_probs = [0.0] * before
            self.rollout_log_probs = list(self.rollout_log_probs) + log_probs
        if meta_info is not None:
            self.spec_info.add(meta_info)
            self.prefix_cache_info.add(meta_info)
            finish = meta_info.get("finish_reason")
            if update_terminal_info and finish is not None:
                kind = finish.get("type") if isinstance(finish, dict) else finish
                self.status = _STATUS_OF_FINISH.get(kind, self.status)

    def to_dict(self) -> dict[str, Any]:
        value = self.__dict__.copy()
        value["status"] = self.status.value
        value["spec_info"] = self.spec_info.to_dict()
        value["prefix_cache_info"] = self.prefix_cache_info.to_dict()
        return value

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Sample:
        data = dict(data)
        data["status"] = Sample.Status(data.get("status", "pending"))
        data["spec_info"] = Sample.SpecInfo.from_dict(data.get("spec_info", {}))
        data["prefix_cache_info"] = Sample.PrefixCacheInfo.from_dict(data.get("prefix_cache_info", {}))
        names = set(Sample.__dataclass_fields__)
        sample = Sample(**{k: v for k, v in data.items() if k in names})
        for key, value in data.items():
            if key not in names:
                setattr(sample, key, value)
        return sample


_STATUS_OF_FINISH = {
    "stop": Sample.Status.COMPLETED,
    "length": Sample.Status.TRUNCATED,
    "abort": Sample.Status.ABORTED,
}
