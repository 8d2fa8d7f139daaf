"""``Sample``: one prompt's rollout, with slime's field names so that slime hooks run unchanged."""

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
    """

    class Status(enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"

    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    status: Sample.Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    weight_versions: list[str] = field(default_factory=list)
    # The id of the sample's conversation: every turn of a multi-turn sample goes to the same SGLang server (the
    # router's routing key), so the server's prefix cache holds the conversation so far.
    session_id: str | None = None

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length
