"""From scored ``Sample``s to the rollout batch of the batch contract, and back to per-trainer shards.

The batch holds the contract's response-aligned keys (``rlcore.keys``: ``mask``, ``rollout_log_probs``,
``rewards``, ``group_ids``) plus what the training backend needs to run the model: the whole sequences
(``TOKENS``, right-padded) and where each response starts (``PROMPT_LENGTHS``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict

from rlcore import keys
from rlcore.kernels import pad_nucleus
from runtime.rollout.filters import reward_value
from runtime.rollout.sample import Sample

TOKENS = "tokens"
PROMPT_LENGTHS = "prompt_lengths"
RESPONSE_LENGTHS = "response_lengths"
RESPONSE_TOKENS = "response_tokens"
# [B] int64: the rollout each row belongs to, numbered 0, 1, ... in order of first appearance; the rows of one rollout
# (a custom generate function's fan-out) are consecutive. Optimizer steps and data-parallel shards are cut by rollout.
ROLLOUT_INDEX = "rollout_index"
# [B, T, K] int32: each response token's top-p nucleus, padded with -1 (slime's rollout_top_p_token_ids/_offsets,
# laid out by rlcore.kernels.pad_nucleus); present only under top-p replay, where every log-prob is taken over it.
NUCLEUS_IDS = "rollout_top_p_token_ids"
# [B, L, layers, topk] int32: the experts that routed each token of TOKENS (row s: token s) in every decoder layer,
# from the rollout engine (slime's rollout_routed_experts); present only under routing replay. The layer axis is the
# model's decoder layers, as SGLang reports them (a dense layer's rows are unused). The last token's row (the engine
# never feeds it) and padding rows hold the distinct dummy experts 0..topk-1.
ROUTED_EXPERTS = "routed_experts"


def build_batch(
    samples: Sequence[Sample],
    *,
    pad_token_id: int,
    require_rollout_log_probs: bool = False,
    reward_key: str | None = None,
    top_p_replay: bool = False,
    teacher_log_probs: bool = False,
    routed_experts: bool | None = None,
) -> TensorDict:
    """The rollout batch of ``samples`` (each generated and scored), ``batch_size=[B]``.

    Shapes: ``TOKENS`` [B, L] int64 (prompt then response, right-padded with ``pad_token_id``), ``PROMPT_LENGTHS``
    and ``RESPONSE_LENGTHS`` [B] int64, ``RESPONSE_TOKENS`` [B, T] int64, ``mask`` [B, T] bool (the sample's
    ``loss_mask`` over its response, False on padding), ``rollout_log_probs`` [B, T] float32 (0 where unknown),
    ``rewards`` [B] float32, ``group_ids`` [B] int64 (``Sample.group_index``), ``ROLLOUT_INDEX`` [B] int64, and
    ``seq_token_counts`` / ``seq_counts`` [B] int64 (``rlcore.keys``): the valid tokens of each row's whole rollout
    (slime's ``rollout_mask_sums``) and 1 on the first row of each rollout.

    Rows sharing a ``Sample.rollout_id`` (not None) are one rollout (a custom generate function's fan-out); a sample
    without one is a rollout of its own. A sample with ``remove_sample`` set (``--rollout-sample-filter-path``) has an
    all-False ``mask``: it leaves the loss and still counts as a sequence in the denominators, as in slime.

    ``require_rollout_log_probs`` (set it when ``--use-tis`` is on): a sample without ``rollout_log_probs`` raises
    instead of getting zeros, which the importance weights would silently read as probability 1.

    ``top_p_replay`` (``--rollout-top-p`` below 1): ``NUCLEUS_IDS`` [B, T, K] from each sample's
    ``rollout_top_p_token_ids`` / ``rollout_top_p_token_offsets`` (slime's layout: ``response_length + 1`` offsets);
    a sample without them raises.

    ``teacher_log_probs`` (``--opd-type sglang``): ``teacher_log_probs`` [B, T] float32 from each sample's
    ``teacher_log_probs`` (0 on padding); a sample without them raises.

    ``routed_experts`` (``--use-rollout-routing-replay``): ``ROUTED_EXPERTS`` [B, L, layers, topk] int32 from each
    sample's ``rollout_routed_experts`` ([len(tokens) - 1, layers, topk], slime's layout); True: a sample without them
    raises; None: added when every sample has them; False: never added.
    """
    if not samples:
        raise ValueError("samples must hold at least one Sample, got none")
    width = max(len(s.tokens) for s in samples)
    horizon = max(max(s.response_length for s in samples), 1)
    n = len(samples)
    tokens = torch.full((n, width), pad_token_id, dtype=torch.long)
    response_tokens = torch.full((n, horizon), pad_token_id, dtype=torch.long)
    mask = torch.zeros((n, horizon), dtype=torch.bool)
    rollout_log_probs = torch.zeros((n, horizon), dtype=torch.float32)
    for i, s in enumerate(samples):
        if s.group_index is None:
            raise ValueError(f"sample {i} (index {s.index}) has no group_index; the loop sets it per prompt")
        if not 0 < s.response_length <= len(s.tokens) - 1:
            raise ValueError(
                f"sample {i} (index {s.index}): response_length {s.response_length} must be in [1, "
                f"len(tokens) - 1 = {len(s.tokens) - 1}] (a response needs a prompt token before it)"
            )
        r = s.response_length
        tokens[i, : len(s.tokens)] = torch.tensor(s.tokens)
        response_tokens[i, :r] = torch.tensor(s.tokens[-r:])
        loss_mask = s.loss_mask if s.loss_mask is not None else [1] * r
        if len(loss_mask) != r:
            raise ValueError(f"sample {i} (index {s.index}): loss_mask has {len(loss_mask)} entries, response {r}")
        if not s.remove_sample:
            mask[i, :r] = torch.tensor(loss_mask, dtype=torch.bool)
        if s.rollout_log_probs is None and require_rollout_log_probs:
            raise ValueError(
                f"sample {i} (index {s.index}) has no rollout_log_probs, which --use-tis needs: a custom generate "
                "function must set sample.rollout_log_probs (one per response token)"
            )
        if s.rollout_log_probs is not None:
            if len(s.rollout_log_probs) != r:
                raise ValueError(
                    f"sample {i} (index {s.index}): rollout_log_probs has {len(s.rollout_log_probs)} entries, "
                    f"response {r}"
                )
            rollout_log_probs[i, :r] = torch.tensor(s.rollout_log_probs, dtype=torch.float32)
    rollout_index = rollout_indices(samples)
    nuclei = [_nucleus(i, s) for i, s in enumerate(samples)] if top_p_replay else []
    row_tokens = mask.sum(-1)
    rollout_tokens = torch.zeros(int(rollout_index.max()) + 1, dtype=torch.long).index_add_(
        0, rollout_index, row_tokens
    )
    first = torch.ones(n, dtype=torch.long)
    first[1:] = (rollout_index[1:] != rollout_index[:-1]).long()
    extra = {}
    if teacher_log_probs:
        extra[keys.TEACHER_LOG_PROBS] = torch.zeros((n, horizon), dtype=torch.float32)
        for i, s in enumerate(samples):
            values = s.teacher_log_probs
            if values is None or len(values) != s.response_length:
                raise ValueError(
                    f"sample {i} (index {s.index}) has {'no' if values is None else len(values)} teacher_log_probs "
                    f"for its {s.response_length} response tokens, which --opd-type sglang needs: the reward "
                    "function (slime.rollout.on_policy_distillation.reward_func) sets them from the teacher server; "
                    "see reward/errors if it failed"
                )
            extra[keys.TEACHER_LOG_PROBS][i, : s.response_length] = torch.as_tensor(values, dtype=torch.float32)
    if routed_experts or (routed_experts is None and all(s.rollout_routed_experts is not None for s in samples)):
        extra[ROUTED_EXPERTS] = routes_of(samples, width=width)
    if nuclei:
        width = max(max(x.shape[1] for x in nuclei), 1)
        extra[NUCLEUS_IDS] = torch.full((n, horizon, width), -1, dtype=torch.int32)
        for i, x in enumerate(nuclei):
            extra[NUCLEUS_IDS][i, : x.shape[0], : x.shape[1]] = x
    return TensorDict(
        {
            **extra,
            TOKENS: tokens,
            ROLLOUT_INDEX: rollout_index,
            keys.SEQ_TOKEN_COUNTS: rollout_tokens[rollout_index],
            keys.SEQ_COUNTS: first,
            PROMPT_LENGTHS: torch.tensor([s.prompt_length for s in samples]),
            RESPONSE_LENGTHS: torch.tensor([s.response_length for s in samples]),
            RESPONSE_TOKENS: response_tokens,
            keys.MASK: mask,
            keys.ROLLOUT_LOG_PROBS: rollout_log_probs,
            keys.REWARDS: torch.tensor([reward_value(s, reward_key) for s in samples], dtype=torch.float32),
            keys.GROUP_IDS: torch.tensor([s.group_index for s in samples], dtype=torch.long),
        },
        batch_size=[n],
    )


def dummy_routes(rows: int, layers: int, topk: int) -> torch.Tensor:
    """``[rows, layers, topk]`` int32 rows of the distinct dummy experts ``0..topk-1``: what the last token and
    padding route to under replay (any valid, distinct ids do: those tokens' outputs never reach a loss)."""
    return torch.arange(topk, dtype=torch.int32).expand(rows, layers, topk).clone()


def routes_of(samples: Sequence[Sample], *, width: int) -> torch.Tensor:
    """``ROUTED_EXPERTS`` [B, width, layers, topk] int32 of ``samples`` (see :func:`build_batch`): row ``s`` of sample
    ``i`` the experts of its token ``s``; its last token's row and the padding after it :func:`dummy_routes`."""
    shape = None
    routes = []
    for i, s in enumerate(samples):
        if s.rollout_routed_experts is None:
            raise ValueError(
                f"sample {i} (index {s.index}) has no rollout_routed_experts, which --use-rollout-routing-replay "
                "needs: the engine reports them when asked (SGLang's return_routed_experts); a custom generate "
                "function must set them ([len(tokens) - 1, num_layers, topk] expert ids)"
            )
        x = torch.as_tensor(s.rollout_routed_experts)
        if x.dtype.is_floating_point or x.dtype == torch.bool or x.dim() != 3 or x.shape[0] != len(s.tokens) - 1:
            raise ValueError(
                f"sample {i} (index {s.index}): rollout_routed_experts must be integer [len(tokens) - 1 = "
                f"{len(s.tokens) - 1}, num_layers, topk], got {x.dtype} {list(x.shape)}"
            )
        if shape is not None and x.shape[1:] != shape:
            raise ValueError(
                f"sample {i} (index {s.index}): rollout_routed_experts has [layers, topk] {list(x.shape[1:])}, "
                f"sample 0 {list(shape)}"
            )
        if x.numel() and int(x.min()) < 0:
            raise ValueError(f"sample {i} (index {s.index}): rollout_routed_experts holds a negative expert id")
        shape = x.shape[1:]
        routes.append(x)
    layers, topk = shape
    out = dummy_routes(len(samples) * width, layers, topk).view(len(samples), width, layers, topk)
    for i, x in enumerate(routes):
        out[i, : x.shape[0]] = x.to(torch.int32)
    return out


def _nucleus(i: int, s: Sample) -> torch.Tensor:
    """Sample ``s``'s nuclei ``[response_length, K]`` (:func:`rlcore.kernels.pad_nucleus`)."""
    ids, offsets = s.rollout_top_p_token_ids, s.rollout_top_p_token_offsets
    if ids is None or offsets is None:
        raise ValueError(
            f"sample {i} (index {s.index}) has no rollout_top_p_token_ids/_offsets, which top-p replay "
            "(--rollout-top-p below 1) needs: the embedded engine reports them; a custom generate function must "
            "set them (runtime.rollout.apply_generation does), or add --no-rollout-top-p-replay"
        )
    if len(offsets) != s.response_length + 1:
        raise ValueError(
            f"sample {i} (index {s.index}): rollout_top_p_token_offsets has {len(offsets)} entries, response_length "
            f"+ 1 = {s.response_length + 1} expected"
        )
    return pad_nucleus(torch.as_tensor(ids, dtype=torch.long), torch.as_tensor(offsets, dtype=torch.long))


def rollout_indices(samples: Sequence[Sample]) -> torch.Tensor:
    """[B] int64: each sample's rollout, numbered in order of first appearance (see :func:`build_batch`). Raises when
    the samples of one rollout are not consecutive."""
    numbers: dict[Any, int] = {}
    out = []
    for i, s in enumerate(samples):
        key = ("own", i) if s.rollout_id is None else ("id", s.rollout_id)
        if key in numbers and numbers[key] != len(numbers) - 1:
            raise ValueError(
                f"sample {i} (index {s.index}) has rollout_id {s.rollout_id}, whose other samples are not next to it: "
                "the samples of one rollout must be consecutive"
            )
        out.append(numbers.setdefault(key, len(numbers)))
    return torch.tensor(out, dtype=torch.long)


def shard_rollouts(
    rollout_index: torch.Tensor, *, global_batch_size: int, dp_rank: int, dp_size: int
) -> tuple[torch.Tensor, list[int]]:
    """Rank ``dp_rank``'s rows of a batch whose rows belong to rollouts (``ROLLOUT_INDEX``), and its rows per optimizer
    step: as slime, each step holds ``global_batch_size`` rollouts (with all their rows) and each rank
    ``global_batch_size / dp_size`` of them; with one row per rollout this is :func:`shard_rows`."""
    rollouts = int(rollout_index.max()) + 1 if rollout_index.numel() else 0
    chosen = shard_rows(rollouts, global_batch_size=global_batch_size, dp_rank=dp_rank, dp_size=dp_size)
    per_rank = global_batch_size // dp_size
    rows, step_rows = [], []
    for step in range(len(chosen) // per_rank):
        mine = torch.isin(rollout_index, chosen[step * per_rank : (step + 1) * per_rank]).nonzero().squeeze(1)
        rows.append(mine)
        step_rows.append(len(mine))
    return (torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)), step_rows


def shard_rows(n: int, *, global_batch_size: int, dp_rank: int, dp_size: int) -> torch.Tensor:
    """Row indices of rank ``dp_rank``'s shard of an ``n``-row batch.

    The batch is consumed in optimizer steps of ``global_batch_size`` consecutive samples; rank ``r`` gets the
    ``r``-th slice of every step, so each shard is ``num_steps x (global_batch_size / dp_size)`` rows in step order.
    """
    if n % global_batch_size or global_batch_size % dp_size:
        raise ValueError(
            f"batch of {n} samples must split into global batches of {global_batch_size}, each divisible by "
            f"dp_size {dp_size}"
        )
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
    per_rank = global_batch_size // dp_size
    return torch.arange(n).view(n // global_batch_size, dp_size, per_rank)[:, dp_rank].reshape(-1)


def balanced_order(lengths: Sequence[int], *, global_batch_size: int, dp_size: int) -> torch.Tensor:
    """A row order (a permutation of ``range(len(lengths))``) under which :func:`shard_rows` gives every rank about
    the same number of tokens in each optimizer step (slime's ``--balance-data``).

    Rows stay in their optimizer step (the loss of each step is unchanged; it is split-invariant over ranks); within a
    step, the longest rows go first, each to the rank with the fewest tokens that still has room (greedy, where slime
    uses Karmarkar-Karp).
    """
    n = len(lengths)
    if n % global_batch_size or global_batch_size % dp_size:
        raise ValueError(
            f"batch of {n} samples must split into global batches of {global_batch_size}, each divisible by "
            f"dp_size {dp_size}"
        )
    per_rank = global_batch_size // dp_size
    order: list[int] = []
    for start in range(0, n, global_batch_size):
        rows = sorted(range(start, start + global_batch_size), key=lambda i: -lengths[i])
        slices: list[list[int]] = [[] for _ in range(dp_size)]
        totals = [0] * dp_size
        for i in rows:
            rank = min((r for r in range(dp_size) if len(slices[r]) < per_rank), key=lambda r: totals[r])
            slices[rank].append(i)
            totals[rank] += lengths[i]
        order += [i for rank_rows in slices for i in rank_rows]
    return torch.tensor(order, dtype=torch.long)


def shard_for_ranks(td: TensorDict, *, global_batch_size: int, world_size: int) -> list[TensorDict]:
    """Every rank's shard of a rollout batch (:func:`shard_rows`); :func:`merge_shards` inverts it."""
    n = td.batch_size[0]
    return [
        td[shard_rows(n, global_batch_size=global_batch_size, dp_rank=r, dp_size=world_size)]
        for r in range(world_size)
    ]


def merge_shards(shards: Sequence[TensorDict], *, global_batch_size: int) -> TensorDict:
    """Reassemble what :func:`shard_for_ranks` split (rows back in batch order)."""
    world_size = len(shards)
    per_rank = global_batch_size // world_size
    steps = shards[0].batch_size[0] // per_rank
    pieces = [shards[r][s * per_rank : (s + 1) * per_rank] for s in range(steps) for r in range(world_size)]
    return torch.cat(pieces, dim=0)
