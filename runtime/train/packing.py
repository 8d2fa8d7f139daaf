"""Micro-batches and model inputs: padded rows, or sequences packed by real tokens (slime's
``--use-dynamic-batch-size``).

Packed, a micro-batch's sequences are concatenated into one row with no padding; position ids restart at 0 for each
sequence, and transformers reads the restarts as sequence boundaries (``masking_utils.find_packed_sequence_indices``):
the attention mask it builds (SDPA, eager or ``flex_attention``) is causal within each sequence and never crosses
one. Every model input layout comes with ``picks``: for response token ``t`` of row ``i``, the flat position (over
the input's rows x width) of the hidden state that predicts it, so the response-aligned ``[b, T]`` tensors of the
batch contract come out the same whatever the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from runtime.train.batch import PROMPT_LENGTHS, RESPONSE_LENGTHS

if TYPE_CHECKING:
    from tensordict import TensorDict

    from runtime.config import TrainConfig


@dataclass(frozen=True)
class ModelInputs:
    """What a causal LM reads for one micro-batch of ``b`` samples, and where its response predictions sit.

    ``input_ids`` [rows, width] int64; ``attention_mask`` [rows, width] int64 (padded) or None (packed);
    ``position_ids`` [rows, width] int64 (packed) or None (the model's own ``arange``); ``picks`` [b, T] int64,
    indices into the flattened ``rows x width`` positions. Packed, ``cu_seq_lens`` int32 [b + 1] (the sequences'
    cumulative token counts) and ``max_length`` (the longest sequence) are given to the model as transformers'
    varlen keywords, which ``--attn-implementation varlen`` (``runtime.train.attention``) reads and others ignore.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    picks: torch.Tensor
    cu_seq_lens: torch.Tensor | None = None
    max_length: int | None = None

    def model_kwargs(self) -> dict[str, torch.Tensor | int]:
        kwargs: dict[str, torch.Tensor | int] = {"input_ids": self.input_ids}
        if self.attention_mask is not None:
            kwargs["attention_mask"] = self.attention_mask
        if self.position_ids is not None:
            kwargs["position_ids"] = self.position_ids
        if self.cu_seq_lens is not None and self.max_length is not None:
            kwargs.update(
                cu_seq_lens_q=self.cu_seq_lens,
                cu_seq_lens_k=self.cu_seq_lens,
                max_length_q=self.max_length,
                max_length_k=self.max_length,
            )
        return kwargs

    def to(self, device: torch.device) -> ModelInputs:
        """The same inputs on ``device``."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return ModelInputs(
            move(self.input_ids),
            move(self.attention_mask),
            move(self.position_ids),
            move(self.picks),
            move(self.cu_seq_lens),
            self.max_length,
        )


def _check(tokens: torch.Tensor, prompt_lengths: torch.Tensor, lengths: torch.Tensor, horizon: int) -> None:
    if tokens.dim() != 2 or prompt_lengths.shape != (tokens.shape[0],) or lengths.shape != (tokens.shape[0],):
        raise ValueError(
            f"tokens must be [b, L] with prompt_lengths and lengths [b], got {tuple(tokens.shape)}, "
            f"{tuple(prompt_lengths.shape)} and {tuple(lengths.shape)}"
        )
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1, got {horizon}")
    if bool((prompt_lengths < 1).any()) or bool((lengths <= prompt_lengths).any()):
        raise ValueError("every row needs 1 <= prompt_length < length (a response after at least one prompt token)")
    if int(lengths.max()) > tokens.shape[1]:
        raise ValueError(f"a length of {int(lengths.max())} is over the tokens' width {tokens.shape[1]}")


def padded_inputs(
    tokens: torch.Tensor, prompt_lengths: torch.Tensor, lengths: torch.Tensor, *, horizon: int
) -> ModelInputs:
    """Right-padded rows cut to the longest sequence: ``input_ids`` [b, max(lengths)] with an attention mask.

    ``tokens`` [b, L] int64 (each row's sequence then padding), ``prompt_lengths`` and ``lengths`` [b] int64 (prompt
    tokens, and prompt + response tokens), ``horizon`` the response width ``T`` of the batch contract.
    """
    _check(tokens, prompt_lengths, lengths, horizon)
    width = int(lengths.max())
    offsets = torch.arange(horizon, device=tokens.device)
    attention_mask = (torch.arange(width, device=tokens.device)[None, :] < lengths[:, None]).long()
    # Response token t sits at prompt_length + t and is predicted from the position before it; positions past a
    # row's response are masked out of every loss, so any in-range index does.
    within = (prompt_lengths[:, None] - 1 + offsets).clamp(max=width - 1)
    picks = torch.arange(tokens.shape[0], device=tokens.device)[:, None] * width + within
    return ModelInputs(tokens[:, :width], attention_mask, None, picks)


def packed_inputs(
    tokens: torch.Tensor, prompt_lengths: torch.Tensor, lengths: torch.Tensor, *, horizon: int
) -> ModelInputs:
    """The ``b`` sequences concatenated into one row of ``sum(lengths)`` tokens, position ids restarting at 0 for
    each; arguments as :func:`padded_inputs`."""
    _check(tokens, prompt_lengths, lengths, horizon)
    device = tokens.device
    host = lengths.tolist()
    total = sum(host)
    starts = torch.cumsum(lengths, 0) - lengths
    row = torch.repeat_interleave(torch.arange(tokens.shape[0], device=device), lengths, output_size=total)
    position_ids = torch.arange(total, device=device) - starts[row]
    input_ids = tokens[row, position_ids]
    offsets = torch.arange(horizon, device=device)
    within = torch.minimum(prompt_lengths[:, None] - 1 + offsets, lengths[:, None] - 1)
    cu_seq_lens = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)
    return ModelInputs(input_ids[None], None, position_ids[None], starts[:, None] + within, cu_seq_lens, max(host))


def min_micro_batches(lengths: list[int], *, max_tokens: int) -> int:
    """How many micro-batches of at most ``max_tokens`` real tokens first fit in row order makes of rows of
    ``lengths`` tokens (slime's ``get_minimum_num_micro_batch_size``). A row longer than ``max_tokens`` raises."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    for i, length in enumerate(lengths):
        if length > max_tokens:
            raise ValueError(f"sample {i} has {length} tokens, over --max-tokens-per-gpu {max_tokens}")
    first_fit: list[int] = []
    for length in lengths:
        for j, load in enumerate(first_fit):
            if load + length <= max_tokens:
                first_fit[j] += length
                break
        else:
            first_fit.append(length)
    return len(first_fit)


def pack_by_tokens(lengths: list[int], *, max_tokens: int, at_least: int = 1) -> list[list[int]]:
    """Partition rows of ``lengths`` tokens into micro-batches of at most ``max_tokens`` real tokens each.

    As slime's dynamic batch size: the number of micro-batches is :func:`min_micro_batches`, raised to ``at_least``
    (what the other data-parallel ranks need; never more than one per row), and the rows are then spread over that
    many so their token counts are balanced (longest first, each to the least-loaded micro-batch it fits; a row that
    fits none opens another). Returns row indices, ascending within each micro-batch, micro-batches ordered by their
    first row. A row longer than ``max_tokens`` raises.
    """
    if at_least < 1:
        raise ValueError(f"at_least must be >= 1, got {at_least}")
    count = max(min_micro_batches(lengths, max_tokens=max_tokens), min(at_least, len(lengths)))
    loads = [0] * count
    bins: list[list[int]] = [[] for _ in range(count)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [j for j in range(len(bins)) if loads[j] + lengths[i] <= max_tokens]
        if not fits:
            bins.append([])
            loads.append(0)
            fits = [len(bins) - 1]
        j = min(fits, key=lambda j: (loads[j], j))
        bins[j].append(i)
        loads[j] += lengths[i]
    return sorted((sorted(b) for b in bins if b), key=lambda b: b[0])


def token_budget(cfg: TrainConfig, *, log_probs: bool) -> int | None:
    """A micro-batch's token budget: ``--max-tokens-per-gpu``, or for a log-prob pass (``log_probs``, no gradient)
    ``--log-probs-max-tokens-per-gpu`` where set."""
    if log_probs and cfg.log_probs_max_tokens_per_gpu is not None:
        return cfg.log_probs_max_tokens_per_gpu
    return cfg.max_tokens_per_gpu


def in_row_order(values: torch.Tensor, groups: list[list[int]] | None) -> torch.Tensor:
    """``values``, the rows of micro-batches ``groups`` (row indices each, as :func:`pack_by_tokens` gives them)
    concatenated, back in the order of the rows they index; ``None`` groups: already in order."""
    if groups is None:
        return values
    order = torch.tensor([i for rows in groups for i in rows], dtype=torch.int64, device=values.device)
    return torch.empty_like(values).index_copy_(0, order, values)


def micro_batches(td: TensorDict, *, micro_batch_size: int, max_tokens: int | None) -> list[TensorDict]:
    """Cut ``td`` (rows in order) into micro-batches.

    With ``max_tokens`` rows are packed greedily while ``rows x longest sequence`` stays within the budget (the
    padded size the forward pass really costs); otherwise ``micro_batch_size`` rows each.
    """
    n = td.batch_size[0]
    if max_tokens is None:
        return [td[i : i + micro_batch_size] for i in range(0, n, micro_batch_size)]
    lengths = (td[PROMPT_LENGTHS] + td[RESPONSE_LENGTHS]).tolist()
    out, start, longest = [], 0, 0
    for i, length in enumerate(lengths):
        if length > max_tokens:
            raise ValueError(f"sample {i} has {length} tokens, over --max-tokens-per-gpu {max_tokens}")
        longest_with = max(longest, length)
        if i > start and (i - start + 1) * longest_with > max_tokens:
            out.append(td[start:i])
            start, longest_with = i, length
        longest = longest_with
    out.append(td[start:n])
    return out
