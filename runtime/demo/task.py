"""The built-in verifiable task of the default job: copy or reverse a short digit string.

A prompt reads ``c314=`` (copy: answer ``314``) or ``r314=`` (reverse: answer ``413``). The reward gives partial
credit: the fraction of answer positions holding the right digit, over the longer of the answer and the response, so
that a response of the wrong length loses credit too. A tiny random-init model starts near chance (one digit in ten)
and GRPO has to discover the position-wise mapping from the reward alone.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from runtime.rollout.sample import Sample

DIGITS = "0123456789"
OPS = {"c": "copy", "r": "reverse", "u": "count_up"}
ALPHABET = DIGITS + "".join(OPS) + "="


@dataclass(frozen=True)
class TaskSpec:
    """Which strings the task draws: digit strings of ``min_len..max_len`` characters, operations from ``ops``."""

    min_len: int = 3
    max_len: int = 3
    ops: str = "c"

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got min_len={self.min_len}, max_len={self.max_len}")
        unknown = set(self.ops) - set(OPS)
        if not self.ops or unknown:
            raise ValueError(f"ops must be a non-empty string over {sorted(OPS)}, got {self.ops!r}")


def answer(op: str, digits: str) -> str:
    """The correct response to operation ``op`` on ``digits``."""
    if op == "c":
        return digits
    if op == "r":
        return digits[::-1]
    if op == "u":
        start = int(digits[0])
        return "".join(str((start + k) % 10) for k in range(1, len(digits) + 1))
    raise ValueError(f"op must be one of {sorted(OPS)}, got {op!r}")


def make_records(n: int, *, seed: int, spec: TaskSpec | None = None) -> list[dict[str, Any]]:
    """``n`` prompt records ``{"prompt", "label", "metadata"}`` drawn with ``seed``."""
    spec = spec or TaskSpec()
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        op = rng.choice(spec.ops)
        digits = "".join(rng.choice(DIGITS) for _ in range(rng.randint(spec.min_len, spec.max_len)))
        records.append({"prompt": f"{op}{digits}=", "label": answer(op, digits), "metadata": {"op": OPS[op]}})
    return records


def format_examples(n: int, *, seed: int, spec: TaskSpec | None = None) -> list[tuple[str, str]]:
    """``n`` (prompt, response) pairs that show the answer *format* only: digits of the right length, drawn at random.

    Used for the optional SFT warm-up: the model learns to answer with digits and stop, but no more than chance
    about which digits, so the rise in reward afterwards is the RL's doing.
    """
    rng = random.Random(seed)
    return [
        (rec["prompt"], "".join(rng.choice(DIGITS) for _ in rec["label"]))
        for rec in make_records(n, seed=seed + 1, spec=spec)
    ]


def score(response: str, label: str) -> float:
    """Fraction of positions where ``response`` matches ``label``, over the longer of the two; in [0, 1]."""
    response = response.strip()
    width = max(len(response), len(label))
    if width == 0:
        return 1.0
    return sum(a == b for a, b in zip(response, label, strict=False)) / width


def reward(args: Any, sample: Sample) -> float:
    """Rule-based reward of the built-in task (slime's per-sample reward signature, sync)."""
    if not isinstance(sample.label, str):
        raise TypeError(f"sample.label must be the answer string, got {type(sample.label).__name__}")
    return score(sample.response, sample.label)
