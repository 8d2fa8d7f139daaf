"""Prompt data: JSONL and Parquet prompt sets, chat templating, length filtering, per-epoch shuffling, resumption.

Rows are read with the keys the ``--input-key`` / ``--label-key`` / ``--metadata-key`` flags name. Nothing is
dropped silently: over-long prompts are counted in ``num_dropped_long``, malformed rows either stop the load with
their file and line number (``on_bad_row="fail"``) or are counted and listed in ``bad_rows`` (``"skip"``).
"""

from __future__ import annotations

import codecs
import copy
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.config import DataConfig
from runtime.rollout.sample import Sample


class DataError(ValueError):
    """A prompt file or row that cannot be used; the message names the file and line (or row)."""


@dataclass(frozen=True)
class _Prompt:
    text: str
    tokens: list[int]
    label: Any
    metadata: dict[str, Any]


def _iter_jsonl(path: str) -> Iterator[tuple[int, Any, str | None]]:
    """Yield ``(line number, row, error)``; blank lines are not rows. Each line is decoded on its own, so a line that
    is not UTF-8 is one bad row."""
    with open(path, "rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            if line_no == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]  # files saved by some editors start with a byte-order mark
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield (
                    line_no,
                    None,
                    f"not valid UTF-8 (byte 0x{raw[err.start]:02x} at byte {err.start + 1} of the line)",
                )
                continue
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line), None
            except json.JSONDecodeError as err:
                yield line_no, None, f"invalid JSON ({err.msg} at column {err.colno})"


def _iter_parquet(path: str) -> Iterator[tuple[int, Any, str | None]]:
    """Yield ``(row number from 1, row, None)``, reading record batches so large files stay out of memory."""
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises several types for a file that is not Parquet
        raise DataError(f"{path}: cannot read as Parquet ({type(err).__name__}: {err})") from err
    row_no = 0
    for batch in reader.iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            row_no += 1
            yield row_no, row, None


def _check_prompt(prompt: Any, key: str) -> str | None:
    if isinstance(prompt, str):
        return None if prompt.strip() else f"key {key!r} holds an empty prompt"
    if isinstance(prompt, list) and prompt:
        for i, message in enumerate(prompt):
            if not (
                isinstance(message, Mapping)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                return f"key {key!r}: message {i} must be a dict with string 'role' and 'content', got {message!r:.80}"
        return None
    return f"key {key!r} must be a string or a non-empty list of chat messages, got {type(prompt).__name__}"


def _parse_metadata(value: Any, key: str) -> tuple[dict[str, Any] | None, str | None]:
    if value is None:
        return {}, None
    if isinstance(value, str):
        # Parquet exports often store the metadata dict as a JSON string.
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None, f"key {key!r} is a string that is not a JSON object"
    if not isinstance(value, Mapping):
        return None, f"key {key!r} must be a dict (or a JSON object string), got {type(value).__name__}"
    return dict(value), None


class PromptDataset:
    """Prompts from a ``.jsonl`` or ``.parquet`` file, served in seeded per-epoch orders.

    ``next_batch(n)`` returns ``n`` fresh prompt ``Sample``s (``prompt``, ``tokens`` = the prompt's token ids,
    ``label``, ``metadata``, ``index`` = the prompt's position in the dataset), running into the next epoch (and
    its new order) when one ends. ``state_dict()`` / ``load_state_dict()`` save and restore the position, so a
    resumed job continues with exactly the prompts it would have seen.

    With ``cfg.apply_chat_template`` each prompt (a string becomes one user message) is rendered by
    ``tokenizer.apply_chat_template(..., add_generation_prompt=True)`` and tokenized without extra special
    tokens; otherwise the text is tokenized as the tokenizer does by default. ``tokenizer`` may be None only
    when neither templating nor ``rollout_max_prompt_len`` needs it (``tokens`` are then empty).

    ``max_context`` (the model's context length, in tokens) bounds every prompt: one that leaves no room for a
    response is a bad row under ``cfg.on_bad_row`` (``fail`` stops the load naming its line; ``skip`` drops it and
    counts it in ``num_dropped_long``, like a prompt over ``rollout_max_prompt_len``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        tokenizer: Any,
        cfg: DataConfig,
        *,
        seed: int,
        max_context: int | None = None,
        messages: bool = False,
    ):
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise DataError(f"prompt file {os.path.abspath(path)!r} does not exist")
        if path.endswith(".jsonl"):
            rows: Iterable[tuple[int, Any, str | None]] = _iter_jsonl(path)
            where = "line"
        elif path.endswith(".parquet"):
            rows = _iter_parquet(path)
            where = "row"
        else:
            raise DataError(f"prompt file {path!r} must end in .jsonl or .parquet")
        self._init(
            rows, tokenizer, cfg, seed=seed, source=path, where=where, max_context=max_context, messages=messages
        )

    @classmethod
    def from_records(
        cls,
        records: Iterable[Mapping[str, Any]],
        tokenizer: Any,
        cfg: DataConfig,
        seed: int,
        *,
        messages: bool = False,
    ) -> PromptDataset:
        """A dataset of in-memory rows (dicts keyed as the flags say); rows are numbered from 1 in errors."""
        self = cls.__new__(cls)
        rows = ((i, record, None) for i, record in enumerate(records, start=1))
        self._init(rows, tokenizer, cfg, seed=seed, source="<records>", where="record", messages=messages)
        return self

    def _init(
        self,
        rows: Iterable[tuple[int, Any, str | None]],
        tokenizer: Any,
        cfg: DataConfig,
        *,
        seed: int,
        source: str,
        where: str,
        max_context: int | None = None,
        messages: bool = False,
    ) -> None:
        if not isinstance(cfg, DataConfig):
            raise TypeError(f"cfg must be a runtime.config.DataConfig, got {type(cfg).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        needs_tokenizer = cfg.apply_chat_template or cfg.rollout_max_prompt_len is not None
        if tokenizer is None and needs_tokenizer:
            raise ValueError("tokenizer is None, but --apply-chat-template or --rollout-max-prompt-len needs one")
        if cfg.apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise DataError(f"--apply-chat-template: the tokenizer of {source!r} prompts has no chat_template")
        self.cfg = cfg
        # SFT data (--loss-type sft_loss): a chat-message prompt is kept as the conversation itself (the SFT rollout
        # tokenizes it with its loss masks), with no prompt tokens, and its row's tools go to metadata["tools"].
        self.messages = messages
        self.seed = seed
        self.source = source
        self.where = where
        self.max_context = max_context
        self.bad_rows: list[tuple[int, str]] = []
        self.num_dropped_long = 0

        texts: list[str] = []
        pending: list[tuple[int, Any, dict[str, Any]]] = []
        for line_no, row, error in rows:
            text, label, metadata, error = self._parse_row(row, error, tokenizer)
            if error is not None:
                self._bad_row(line_no, error)
                continue
            texts.append(text)
            pending.append((line_no, label, metadata))
        token_ids = self._tokenize(tokenizer, texts)

        self._prompts: list[_Prompt] = []
        for text, tokens, (line_no, label, metadata) in zip(texts, token_ids, pending, strict=True):
            if cfg.rollout_max_prompt_len is not None and len(tokens) > cfg.rollout_max_prompt_len:
                self.num_dropped_long += 1
                continue
            if max_context is not None and tokenizer is not None and len(tokens) >= max_context:
                self._refuse(
                    line_no,
                    f"a prompt of {len(tokens)} tokens leaves no room for a response in the model's context of "
                    f"{max_context} tokens",
                )
                # Skipped, it counts with the prompts over --rollout-max-prompt-len, not as a malformed row.
                self.num_dropped_long += 1
                continue
            self._prompts.append(_Prompt(text=text, tokens=tokens, label=label, metadata=metadata))
        if not self._prompts:
            raise DataError(
                f"{source}: no usable prompts ({self.num_bad_rows} malformed rows, {self.num_dropped_long} "
                f"longer than --rollout-max-prompt-len {cfg.rollout_max_prompt_len})"
            )
        self.epoch = 0
        self.offset = 0
        self._order = self._epoch_order(0)

    def labels(self) -> list[Any]:
        """Every usable prompt's label (as read: ``--label-key``'s value, None without the flag), in file order."""
        return [prompt.label for prompt in self._prompts]

    def _parse_row(self, row: Any, error: str | None, tokenizer: Any) -> tuple[Any, Any, Any, str | None]:
        """``(text, label, metadata, None)`` for a good row, ``(None, None, None, reason)`` for a bad one."""
        cfg = self.cfg
        if error is not None:
            return None, None, None, error
        if not isinstance(row, Mapping):
            return None, None, None, f"row must be an object/dict, got {type(row).__name__}"
        for key in (cfg.input_key, cfg.label_key):
            if key is not None and key not in row:
                return None, None, None, f"missing key {key!r} (has {sorted(map(str, row))})"
        prompt = row[cfg.input_key]
        error = _check_prompt(prompt, cfg.input_key)
        if error is not None:
            return None, None, None, error
        metadata, error = _parse_metadata(row.get(cfg.metadata_key), cfg.metadata_key)
        if error is not None:
            return None, None, None, error
        if self.messages and isinstance(prompt, list):
            label = None if cfg.label_key is None else copy.deepcopy(row[cfg.label_key])
            if row.get(cfg.tool_key) is not None:
                metadata = {**(metadata or {}), "tools": copy.deepcopy(row[cfg.tool_key])}
            return copy.deepcopy(prompt), label, metadata, None
        if cfg.apply_chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            # slime passes the row's tools (--tool-key) and --apply-chat-template-kwargs to the template.
            kwargs = dict(cfg.apply_chat_template_kwargs)
            if row.get(cfg.tool_key) is not None:
                kwargs["tools"] = row[cfg.tool_key]
            try:
                text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
            except Exception as err:  # a template may raise anything (jinja errors, its own raise_exception)
                return None, None, None, f"chat template failed ({type(err).__name__}: {err})"
        elif isinstance(prompt, list):
            return None, None, None, f"key {cfg.input_key!r} holds chat messages; pass --apply-chat-template"
        else:
            text = prompt
        label = None if cfg.label_key is None else copy.deepcopy(row[cfg.label_key])
        return text, label, metadata, None

    def _tokenize(self, tokenizer: Any, texts: list[str]) -> list[list[int]]:
        strings = [t for t in texts if isinstance(t, str)]
        if tokenizer is None or not strings:
            return [[] for _ in texts]
        # A rendered chat template already holds the special tokens the model expects.
        encoded = iter(tokenizer(strings, add_special_tokens=not self.cfg.apply_chat_template)["input_ids"])
        # (SFT conversations, kept as messages, have no prompt tokens.)
        return [list(next(encoded)) if isinstance(t, str) else [] for t in texts]

    def _refuse(self, line_no: int, reason: str) -> None:
        """Under ``--on-bad-row fail``, raise ``DataError`` naming the file, line and reason."""
        if self.cfg.on_bad_row == "fail":
            raise DataError(f"{self.source} {self.where} {line_no}: {reason} (--on-bad-row skip skips such rows)")

    def _bad_row(self, line_no: int, reason: str) -> None:
        self._refuse(line_no, reason)
        self.bad_rows.append((line_no, reason))

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.cfg.rollout_shuffle:
            return np.arange(len(self._prompts))
        # The order depends on (seed, epoch) only, so a resumed run regenerates it exactly.
        return np.random.default_rng([self.seed, epoch]).permutation(len(self._prompts))

    @property
    def num_bad_rows(self) -> int:
        return len(self.bad_rows)

    def __len__(self) -> int:
        return len(self._prompts)

    def stats(self) -> dict[str, int]:
        """Counts for the job log: prompts kept, dropped as too long, skipped as malformed."""
        return {
            "data/num_prompts": len(self._prompts),
            "data/num_dropped_long": self.num_dropped_long,
            "data/num_bad_rows": self.num_bad_rows,
        }

    @property
    def max_prompt_tokens(self) -> int:
        """The longest kept prompt, in tokens (0 without a tokenizer)."""
        return max(len(p.tokens) for p in self._prompts)

    def report(self, *, max_rows: int = 10) -> list[str]:
        """Lines for the job log: the counts of :meth:`stats`, then each skipped row (the first ``max_rows``, then
        how many more) with its reason."""
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 0:
            raise ValueError(f"max_rows must be an int >= 0, got {max_rows!r}")
        lines = [
            f"{self.source}: {len(self._prompts)} prompts; {self.num_dropped_long} dropped as longer than "
            f"--rollout-max-prompt-len {self.cfg.rollout_max_prompt_len}"
            + (f" or the model's context of {self.max_context} tokens" if self.max_context is not None else "")
            + f"; {self.num_bad_rows} malformed rows skipped"
        ]
        lines += [f"  skipped {self.where} {line_no}: {reason}" for line_no, reason in self.bad_rows[:max_rows]]
        if self.num_bad_rows > max_rows:
            lines.append(f"  ... and {self.num_bad_rows - max_rows} more skipped rows")
        return lines

    def next_batch(self, n: int) -> list[Sample]:
        """The next ``n`` prompts as new ``Sample``s, crossing into the next epoch (reshuffled) as needed."""
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"n must be a positive int, got {n!r}")
        batch = []
        for _ in range(n):
            if self.offset == len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._epoch_order(self.epoch)
            index = int(self._order[self.offset])
            self.offset += 1
            prompt = self._prompts[index]
            batch.append(
                Sample(
                    index=index,
                    prompt=prompt.text,
                    tokens=list(prompt.tokens),
                    label=copy.deepcopy(prompt.label),
                    metadata=copy.deepcopy(prompt.metadata),
                )
            )
        return batch

    def state_dict(self) -> dict[str, int]:
        """The position (epoch, offset into its order) plus what must match on resume (seed, prompt count)."""
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "num_prompts": len(self._prompts)}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restore a position from ``state_dict()``; raises ``DataError`` if the data or seed changed."""
        missing = {"epoch", "offset", "seed", "num_prompts"} - set(state)
        if missing:
            raise DataError(f"data state is missing {sorted(missing)}")
        if state["num_prompts"] != len(self._prompts) or state["seed"] != self.seed:
            raise DataError(
                f"cannot resume: the checkpoint saw {state['num_prompts']} prompts with seed {state['seed']}, "
                f"this dataset has {len(self._prompts)} prompts with seed {self.seed}"
            )
        if not 0 <= state["offset"] <= len(self._prompts) or state["epoch"] < 0:
            raise DataError(f"data state has an invalid position: epoch {state['epoch']}, offset {state['offset']}")
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self._order = self._epoch_order(self.epoch)
