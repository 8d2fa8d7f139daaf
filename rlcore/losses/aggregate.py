"""Reduction of per-token losses to a scalar, split-invariant over micro-batches and data-parallel ranks.

The denominators come from a ``Normalizer`` of the whole global batch: each micro-batch's ``aggregate`` is its
share of the global loss, and the shares sum to exactly the loss of the global batch, whatever the split. slime's
aggregation is split-invariant too: by default it divides each sample's token sum by that sample's precomputed
token count and scales by the step's sample count (``seq_mean_token_mean`` here); with
``--calculate-per-token-loss`` Megatron divides by the step's total token count (``token_mean`` here).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from rlcore._checks import check_choice, check_finite_where, check_mask, check_tensor, masked_fill_zero
from rlcore.loss_config import AGG_MODES
from rlcore.losses._common import upcast

Count = int | Tensor


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool):
        raise TypeError(f"Normalizer.{name} must be an int or a 0-dim tensor, got bool")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"Normalizer.{name} must be >= 0, got {value}")
    elif isinstance(value, Tensor):
        if value.dim() != 0:
            raise ValueError(f"Normalizer.{name} must be a 0-dim tensor, got shape {tuple(value.shape)}")
    else:
        raise TypeError(f"Normalizer.{name} must be an int or a 0-dim tensor, got {type(value).__name__}")


@dataclass(frozen=True)
class Normalizer:
    """Denominators of the aggregation modes, for a whole global batch.

    Attributes:
        num_tokens: valid tokens (``token_mean``).
        num_seqs: samples, i.e. rows of the batch (the ``seq_mean_*`` modes), those with no valid token
            included: they add 0 to the numerator, and the denominator stays a property of the batch's shape,
            so Dr. GRPO's ``num_seqs x max_len`` is the constant normaliser it is meant to be.
        max_len: the ``T`` of Dr. GRPO's ``seq_mean_token_sum_norm``.

    Build one per micro-batch with ``Normalizer.of(mask)``, combine them with ``+`` (or ``sum(...)``) and,
    under data parallelism, across ranks with ``reduce(group)``. Counts are ints or 0-dim tensors; ``of``
    gives tensors so that building one never waits on the device.
    """

    num_tokens: Count
    num_seqs: Count
    max_len: Count

    def __post_init__(self) -> None:
        for name in ("num_tokens", "num_seqs", "max_len"):
            _check_count(name, getattr(self, name))

    @classmethod
    def of(cls, mask: Tensor, *, seq_counts: Tensor | None = None) -> "Normalizer":
        """The counts of one batch. ``mask``: [B, T] bool.

        ``seq_counts``: [B] integer, how many sequences each row counts as in ``num_seqs`` (a rollout split into
        several rows counts once: 1 on one of its rows, 0 on the others); ``None``: every row counts as one.
        """
        check_mask(mask)
        check_tensor("mask", mask, ndim=2)
        if seq_counts is None:
            # torch.full, not torch.tensor: a copy from the host would wait for the device.
            num_seqs = torch.full((), mask.shape[0], dtype=torch.int64, device=mask.device)
        else:
            _check_row_counts("seq_counts", seq_counts, mask)
            num_seqs = seq_counts.sum().to(mask.device)
        max_len = torch.full((), mask.shape[-1], dtype=torch.int64, device=mask.device)
        return cls(num_tokens=mask.sum(), num_seqs=num_seqs, max_len=max_len)

    def __add__(self, other: "Normalizer") -> "Normalizer":
        if not isinstance(other, Normalizer):
            return NotImplemented
        if isinstance(self.max_len, int) and isinstance(other.max_len, int):
            max_len = max(self.max_len, other.max_len)
        else:
            max_len = torch.maximum(torch.as_tensor(self.max_len), torch.as_tensor(other.max_len))
        return Normalizer(self.num_tokens + other.num_tokens, self.num_seqs + other.num_seqs, max_len)

    def __radd__(self, other: object) -> "Normalizer":
        # builtin sum() starts from 0
        if isinstance(other, int) and other == 0:
            return self
        return NotImplemented

    def reduce(self, group: "dist.ProcessGroup | None") -> "Normalizer":
        """The normalizer of the union of every rank's batch: counts summed, ``max_len`` maximised over ``group``.

        A collective: every rank of ``group`` must call it. ``group=None`` returns ``self`` (one process).
        On NCCL the counts must live on the rank's GPU, as ``of`` puts them for a GPU mask.
        """
        if group is None:
            return self
        device = self.num_tokens.device if isinstance(self.num_tokens, Tensor) else torch.device("cpu")
        counts = torch.stack([torch.as_tensor(self.num_tokens), torch.as_tensor(self.num_seqs)])
        counts = counts.to(device, torch.int64)
        max_len = torch.as_tensor(self.max_len).to(device, torch.int64).clone()
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(max_len, op=dist.ReduceOp.MAX, group=group)
        return Normalizer(counts[0], counts[1], max_len)


def _check_row_counts(name: str, counts: Tensor, mask: Tensor) -> None:
    check_tensor(name, counts, ndim=1)
    if counts.dtype.is_floating_point or counts.dtype == torch.bool or counts.shape[0] != mask.shape[0]:
        raise ValueError(
            f"{name} must be an integer tensor [B] with B = {mask.shape[0]} (mask {tuple(mask.shape)}), got "
            f"{counts.dtype} {tuple(counts.shape)}"
        )
    if bool((counts < 0).any()):
        raise ValueError(f"{name} must be >= 0, got min {int(counts.min())}")


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    *,
    mode: str = "token_mean",
    norm: Normalizer | None = None,
    seq_token_counts: Tensor | None = None,
) -> Tensor:
    """Reduce a per-token loss over the valid tokens of a batch to a scalar.

    Modes (``N`` = ``norm``'s counts, those of this batch when ``norm`` is None):

    - ``token_mean``: sum over valid tokens / ``num_tokens``.
    - ``seq_mean_token_mean``: sum over samples of each sample's mean over its valid tokens / ``num_seqs``
      (a sample with no valid token counts as 0). With ``seq_token_counts`` a sample's token sum is divided by
      its entry instead of its own count: slime's ``rollout_mask_sums``, the valid tokens of every sample of its
      rollout, so that a rollout split into several samples is one token mean (and, with ``Normalizer.of``'s
      ``seq_counts``, one sequence).
    - ``seq_mean_token_sum``: sum over samples of each sample's sum over its valid tokens / ``num_seqs``.
    - ``seq_mean_token_sum_norm``: sum over valid tokens / (``num_seqs`` x ``max_len``), Dr. GRPO's constant
      normaliser.

    With ``norm`` of the whole global batch, the ``aggregate`` of every micro-batch (cut along samples)
    and rank sum to the global batch's loss, gradients included. A sample's token mean needs the sample
    whole in the micro-batch.

    Args:
        per_token: [B, T] per-token values; positions outside ``mask`` may hold anything, NaN and inf
            included, and reach neither the result nor the gradient.
        mask: [B, T] bool, valid tokens.
        mode: one of the four above.
        norm: denominators of the global batch; ``None`` uses this batch's own.
        seq_token_counts: [B] integer, ``seq_mean_token_mean``'s per-sample denominators (clamped to >= 1);
            ``None``: each sample's own valid-token count. The other modes ignore it.

    Returns:
        0-dim tensor (float32, float64 for float64 input); 0 for a batch with no valid token.
    """
    check_tensor("per_token", per_token, ndim=2, floating=True)
    check_mask(mask, like=per_token, like_name="per_token")
    check_choice("mode", mode, AGG_MODES)
    if norm is None:
        norm = Normalizer.of(mask)
    elif not isinstance(norm, Normalizer):
        raise TypeError(f"norm must be a Normalizer or None, got {type(norm).__name__}")
    check_finite_where("per_token", per_token, mask)

    values = masked_fill_zero(upcast(per_token), mask)
    device = values.device
    if seq_token_counts is not None:
        _check_row_counts("seq_token_counts", seq_token_counts, mask)
    if mode == "seq_mean_token_mean":
        counts = mask.sum(-1) if seq_token_counts is None else seq_token_counts.to(device)
        per_seq = values.sum(-1) / counts.clamp_min(1)
        return per_seq.sum() / torch.as_tensor(norm.num_seqs, device=device).clamp_min(1)
    if mode == "token_mean":
        denominator = torch.as_tensor(norm.num_tokens, device=device)
    elif mode == "seq_mean_token_sum":
        denominator = torch.as_tensor(norm.num_seqs, device=device)
    else:
        denominator = torch.as_tensor(norm.num_seqs, device=device) * torch.as_tensor(norm.max_len, device=device)
    return values.sum() / denominator.clamp_min(1)
