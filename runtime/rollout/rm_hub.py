"""slime's built-in reward types (``--rm-type``), written for rlcore: each is ``fn(args, sample) -> float | dict``.

- ``math``: the response's ``\\boxed{}`` answer against the label, judged by math-verify (``runtime.rollout.rewards``).
- ``deepscaler``: the solution after ``</think>`` (or ``###Response``; neither: 0), its last ``\\boxed{}`` answer
  against the label (a boxed label is unboxed first): 1 or 0.
- ``dapo``: the last ``Answer: ...`` line of the response's last 300 characters against the label (an integer, as in
  DAPO's data): ``{"score": 1.0 or -1.0, "acc": bool, "pred": str}``.
- ``f1``: the token F1 of response and label after lower-casing and removing punctuation, articles and extra spaces
  (a yes/no/noanswer on either side must match exactly).
- ``gpqa``: the multiple-choice letter the response settles on (after ``</think>``) against the label's letter (a
  letter, an index, or the text of one of ``metadata["choices"]``; ``metadata["correct_letter"]`` wins); without a
  letter, whether the correct choice's text appears in the response: 1 or 0.
- ``random``: 0 or 1 at random (a seeded generator per hub).
- ``remote_rm``: ``POST --rm-url`` with ``{"prompt", "response", "label"}``; the JSON answer is the reward. Each
  attempt has ``--reward-timeout`` seconds; a failed attempt is retried (10 tries, exponential backoff, as slime)
  and counted (``reward/remote_failures``); when every try fails the reward is 0 and counted as an error. With
  ``--http-proxy`` the requests go through that proxy.
- A ``boxed_`` prefix (``boxed_f1``, ...) scores the last ``\\boxed{}`` content of the response instead of the whole.

Answers are compared with math-verify where slime uses its own string normalisation (``dapo``, ``deepscaler``), so
equal values in different spellings agree (``0.5`` and ``\\frac{1}{2}``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import string
from collections import Counter
from collections.abc import Callable
from typing import Any

from runtime.rollout.sample import Sample

logger = logging.getLogger(__name__)


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced; None if there is
    none or it is not closed."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    open_at = text.find("{", start)
    if open_at < 0:
        # "\boxed 5": the token after a space.
        rest = text[start:].split(None, 2)
        return rest[1].rstrip("$.") if len(rest) > 1 and text[start:].startswith("\\boxed ") else None
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i]
    return None


def same_math_answer(answer: str, label: Any) -> bool:
    """Whether ``answer`` and ``label`` are the same math answer: equal text after trimming, or equal for
    math-verify."""
    from math_verify import parse, verify

    answer, gold = str(answer).strip(), str(label).strip()
    if not answer or not gold:
        return False
    if answer == gold:
        return True

    def read(text: str) -> list[Any]:
        return parse(f"${text}$", parsing_timeout=None) or parse(text, parsing_timeout=None)

    parsed_gold, parsed_answer = read(gold), read(answer)
    return bool(parsed_gold and parsed_answer and verify(parsed_gold, parsed_answer, timeout_seconds=None))


def deepscaler_reward(args: Any, sample: Sample, **kwargs: Any) -> float:
    response = sample.response
    if "</think>" in response:
        solution = response.split("</think>")[-1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0.0
    answer = last_boxed(solution)
    label = sample.label
    if answer is None or label is None or str(label) == "":
        return 0.0
    gold = last_boxed(str(label)) if "\\boxed" in str(label) else str(label)
    return 1.0 if gold is not None and same_math_answer(answer, gold) else 0.0


_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|boxed)\{([^{}]*)\}")


def _dapo_normalise(text: str) -> str:
    text = text.split("=")[-1].strip()
    previous = None
    while previous != text:  # unwrap nested \text{...}, \boxed{...}
        previous, text = text, _WRAPPERS.sub(r"\1", text)
    text = text.replace("$", "").replace("\\!", "").replace(" ", "").rstrip(".")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text


def dapo_reward(args: Any, sample: Sample, **kwargs: Any) -> dict[str, Any]:
    tail = sample.response[-300:]
    matches = _ANSWER_LINE.findall(tail)
    pred = _dapo_normalise(matches[-1]) if matches else "[INVALID]"
    label = _dapo_normalise(str(sample.label))
    try:
        label = str(int(float(label)))  # DAPO's labels are integers
    except ValueError:
        pass
    correct = matches != [] and (pred == label or same_math_answer(pred, label))
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


def _f1_words(text: str) -> list[str]:
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return text.split()


def f1_reward(args: Any, sample: Sample, **kwargs: Any) -> float:
    if sample.label is None:
        raise ValueError(f"f1 reward: sample {sample.index} has no label")
    prediction, truth = _f1_words(sample.response), _f1_words(str(sample.label))
    special = {"yes", "no", "noanswer"}
    if (" ".join(prediction) in special or " ".join(truth) in special) and prediction != truth:
        return 0.0
    common = sum((Counter(prediction) & Counter(truth)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(prediction), common / len(truth)
    return 2 * precision * recall / (precision + recall)


_LETTER_PATTERNS = (
    re.compile(r"(?:answer|option|choice)\s*(?:is|:)?\s*\(?([A-Z])\b", re.I),
    re.compile(r"\b([A-Z])\)?\s+is\s+(?:the\s+)?correct", re.I),
)


def _plain(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def gpqa_reward(args: Any, sample: Sample, **kwargs: Any) -> float:
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    choices = metadata.get("choices")
    choices = list(choices.values()) if isinstance(choices, dict) else list(choices or [])
    letters = [str(c).upper() for c in metadata.get("valid_letters") or string.ascii_uppercase[: len(choices) or 10]]
    correct = metadata.get("correct_letter")
    correct = correct.strip().upper() if isinstance(correct, str) else None
    label = sample.label
    if correct is None and isinstance(label, str) and label.strip().upper() in letters and len(label.strip()) == 1:
        correct = label.strip().upper()
    elif correct is None and isinstance(label, int | float) and not isinstance(label, bool):
        correct = letters[int(label)] if 0 <= int(label) < len(letters) else None
    elif correct is None and isinstance(label, str):
        matching = [i for i, choice in enumerate(choices) if _plain(str(choice)) == _plain(label)]
        correct = letters[matching[0]] if matching and matching[0] < len(letters) else None
    text = sample.response.rsplit("</think>", 1)[-1]
    picked = None
    for pattern in _LETTER_PATTERNS:
        found = [m.upper() for m in pattern.findall(text) if m.upper() in letters]
        if found:
            picked = found[0]
            break
    if picked is None:
        standalone = [m for m in re.findall(r"\b([A-Z])\b", text) if m in letters]
        picked = standalone[-1] if standalone else None
    if picked is not None and correct is not None:
        return 1.0 if picked == correct else 0.0
    targets = []
    if correct is not None and letters.index(correct) < len(choices):
        targets.append(str(choices[letters.index(correct)]))
    if isinstance(label, str):
        targets.append(label)
    haystack = _plain(text)
    return 1.0 if any(_plain(t) and _plain(t) in haystack for t in targets) else 0.0


class RandomReward:
    """0 or 1 at random, from a seeded generator (slime's ``random`` type, for plumbing tests)."""

    def __init__(self, seed: int):
        self._rng = random.Random(seed)

    def __call__(self, args: Any, sample: Sample, **kwargs: Any) -> float:
        return float(self._rng.randint(0, 1))


def boxed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` scoring the last ``\\boxed{}`` content of the response (empty when there is none)."""

    def score_boxed(args: Any, sample: Sample, **kwargs: Any) -> Any:
        inner = Sample(**{**sample.__dict__, "response": last_boxed(sample.response) or ""})
        return fn(args, inner, **kwargs)

    score_boxed.__name__ = f"boxed_{getattr(fn, '__name__', type(fn).__name__)}"
    return score_boxed


class RemoteRewardModel:
    """``--rm-type remote_rm``: an HTTP reward server at ``url`` (slime's payload and retries).

    Each attempt is one ``POST url`` of ``{"prompt", "response", "label"}`` with ``timeout`` seconds; a failed attempt
    (connection error, timeout, HTTP error status, a body that is not JSON) is counted in ``failures`` and retried
    after ``min(backoff_s * 2**attempt, 30)`` seconds (plus up to ``backoff_s`` of jitter), ``max_retries`` tries in
    all; the last failure raises (the hub scores 0 and counts an error).
    """

    def __init__(
        self, url: str, *, timeout: float, max_retries: int = 10, backoff_s: float = 1.0, proxy: str | None = None
    ):
        if not url:
            raise ValueError("--rm-type remote_rm needs --rm-url")
        self.url, self.timeout, self.max_retries, self.backoff_s = url, timeout, max_retries, backoff_s
        self.proxy = proxy
        self.failures = 0

    async def __call__(self, args: Any, sample: Sample, **kwargs: Any) -> Any:
        return await self.post({"prompt": sample.prompt, "response": sample.response, "label": sample.label})

    async def post(self, payload: dict[str, Any]) -> Any:
        """``POST url`` of ``payload`` with the retries above; the JSON answer."""
        import httpx

        async with httpx.AsyncClient(timeout=self.timeout, proxy=self.proxy) as client:
            for attempt in range(self.max_retries):
                try:
                    response = await client.post(self.url, json=payload)
                    response.raise_for_status()
                    return response.json()
                except (httpx.HTTPError, ValueError) as err:
                    self.failures += 1
                    if attempt + 1 >= self.max_retries:
                        raise RuntimeError(
                            f"remote_rm {self.url}: {self.max_retries} tries failed, last: {err}"
                        ) from err
                    delay = min(self.backoff_s * 2**attempt, 30.0) + random.random() * self.backoff_s
                    logger.info("remote_rm %s: %s, retry %d in %.2fs", self.url, err, attempt + 1, delay)
                    await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    def pop_failures(self) -> int:
        failures, self.failures = self.failures, 0
        return failures


# Rule-based types by name (remote_rm and random are built by the hub: they carry state).
RULE_REWARDS: dict[str, Callable[..., Any]] = {
    "deepscaler": deepscaler_reward,
    "dapo": dapo_reward,
    "f1": f1_reward,
    "gpqa": gpqa_reward,
}
