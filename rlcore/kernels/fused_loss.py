"""The RL loss inside the LM head: ``rl_loss`` of ``hidden [N, H] x weight [V, H]`` in three matmuls, no recompute.

Row-chunked, over the valid tokens only (padding rows are gathered out first). For each chunk of rows (a few
thousand tokens):

1. ``logits = hidden[rows] @ weight^T`` over the whole (local) vocabulary, one cuBLAS matmul into one reused buffer;
2. the Triton statistics pass (``logprobs._stats_kernel``): per-token ``lse``, ``mu``, target logit, hence the
   log-prob and entropy (all-reduced over ``group`` when the vocabulary is sharded);
3. the loss's per-token coefficients ``g_lp = d loss / d log_prob`` and ``g_ent = d loss / d entropy`` in closed form
   (:func:`token_coefficients`), given the global ``Normalizer``: every term of ``rl_loss`` but the value loss is a
   per-token function of the token's log-prob and entropy once its denominators are fixed;
4. the Triton gradient pass writes ``d logits = [g_lp (onehot - p) + g_ent p (mu - z)] / T`` over the logits, in
   place;
5. ``grad_hidden[rows] = d logits @ weight`` and ``grad_weight += d logits^T @ hidden[rows]``.

Everything happens in the forward (the op returns the loss of a batch, so it knows its gradient then); the backward
only scales the two stored gradients by the upstream one. ``rl_loss``'s metrics come from per-chunk sums, and the
batch's finiteness checks are read back asynchronously, so the host never waits on the pass. Cost: exactly three
[rows, H] x [H, V] matmuls per chunk and two passes over the chunk's logits, whose buffer is the op's only large
temporary.

Sequence-level terms. Sequence and geometric TIS/MIS/ICEPOP weights depend on the old and rollout log-probs only, so
they are fixed per token before the pass. GSPO's sequence ratio needs every current log-prob of its sequence before
any of them has a gradient coefficient: chunks are cut along whole sequences (rows of the ``[B, T]`` batch) when a
sequence fits in a chunk, which costs nothing; when one does not (``T`` rows of logits larger than ``chunk_bytes``),
a first pass computes the log-probs of all rows (one more matmul: four instead of three) rather than holding
``[T, V]`` logits at once. Anything else (``value_coef != 0``, a custom ``loss_fn``) falls back to
:func:`~rlcore.kernels.linear_logprobs_entropy` and autograd through ``rl_loss`` or the custom loss.

Numerics. Logits are rounded to the input dtype (bf16) before the softmax, as rlcore's other kernels, Liger and the
rollout engines (SGLang's logits processor reads the bf16 LM-head output) do, so the trainer's ratio compares like
with like; ``float32_logits=True`` keeps them in float32 (verl, CCE) at twice the chunk's memory per row. The
weight gradient is accumulated across chunks in the weight's dtype by default (each chunk's matmul accumulates in
float32 and rounds once when added, so a bf16 gradient carries ~``sqrt(chunks) * 2**-9`` relative error) or, with
``grad_weight_dtype=torch.float32``, in a float32 [V, H] buffer (4 bytes x V x H more memory, rounded once at the
end). The hidden gradient of a row is one matmul over the whole vocabulary: one rounding.
"""

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor
from torch.autograd.function import once_differentiable

from rlcore import keys
from rlcore._checks import check_finite_where, check_mask, check_tensor, masked_fill_zero
from rlcore.kernels._stats import (
    Partial,
    check_float_matrix,
    check_targets,
    check_temperature,
    group_layout,
    host_later,
    outputs,
)
from rlcore.kernels.linear import linear_logprobs_entropy
from rlcore.kernels.logprobs import backend_ops
from rlcore.losses import LossConfig, Normalizer, rl_loss
from rlcore.losses.mismatch import mismatch_weights_unchecked

# 1.25 GiB of logits per chunk: 4096 rows of a 151936-token vocabulary in bf16, four chunks at N = 16384.
DEFAULT_CHUNK_BYTES = 5 << 28
# Chunks start on multiples of this many rows when they are not cut along sequences (cuBLAS prefers aligned rows).
_ROW_ALIGN = 128
# mismatch_weights and low_var_kl bound what they clamp with these constants (see rlcore.losses).
_LOW_VAR_KL_BOUND = 10.0


class TokenInputs(NamedTuple):
    """Per-token constants of the loss over the n valid tokens (the rows the op computes), in batch order.

    ``c_pg``: the weight of each token's policy loss in ``pg_loss`` (aggregation weight times the mismatch weight,
    0 outside ``keep``); ``kept_weight``: the aggregation weight, 0 outside ``keep`` (the KL and entropy terms);
    ``advantages``, ``old`` (``None``: the current log-probs, detached), ``ref`` and ``rollout`` (``None`` when the
    batch has none): the loss's inputs; all float32 [n]. ``seq_ids``: [n] int64 sample of each token;
    ``seq_lengths``: [B] float32 valid tokens per sample, at least 1 (GSPO's sequence mean).
    """

    c_pg: Tensor
    kept_weight: Tensor
    advantages: Tensor
    old: Tensor | None
    ref: Tensor | None
    rollout: Tensor | None
    seq_ids: Tensor
    seq_lengths: Tensor


class PolicyTerm(NamedTuple):
    """The policy loss's knobs as the closed form reads them (see :func:`token_coefficients`)."""

    kind: str
    eps_low: float
    eps_high: float
    dual_clip: float | None
    cispo_eps_low: float | None


def _count(value: Tensor | int, device: torch.device) -> Tensor:
    """A count of a ``Normalizer`` as a float32 0-dim tensor on ``device``. A host number is filled in on the device:
    ``torch.as_tensor(n, device=cuda)`` copies from pageable host memory, which waits for the device."""
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=torch.float32)
    return torch.full((), float(value), device=device, dtype=torch.float32)


def aggregation_weights(
    mask: Tensor, mode: str, norm: Normalizer, *, seq_token_counts: Tensor | None = None
) -> Tensor:
    """[B, T] float32 weight of each valid token's value in ``aggregate(per_token, mask, mode=mode, norm=norm,
    seq_token_counts=seq_token_counts)``."""
    device = mask.device

    def count(value) -> Tensor:
        return _count(value, device)

    if mode == "token_mean":
        per_row = count(norm.num_tokens).clamp_min(1).reciprocal().expand(mask.shape[0])
    elif mode == "seq_mean_token_mean":
        counts = mask.sum(-1) if seq_token_counts is None else seq_token_counts.to(device)
        per_row = 1.0 / (counts.clamp_min(1).float() * count(norm.num_seqs).clamp_min(1))
    elif mode == "seq_mean_token_sum":
        per_row = count(norm.num_seqs).clamp_min(1).reciprocal().expand(mask.shape[0])
    else:
        per_row = (count(norm.num_seqs) * count(norm.max_len)).clamp_min(1).reciprocal().expand(mask.shape[0])
    return torch.where(mask, per_row[:, None], 0.0)


def policy_values(
    term: PolicyTerm, log_probs: Tensor, old: Tensor, advantages: Tensor, seq_ratio: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token ``(loss, d loss / d log_prob, clipped)`` of the policy term, for float32 [n] inputs.

    ``seq_ratio`` is GSPO's sequence ratio broadcast to the tokens; PPO and GSPO share the clipped surrogate.
    """
    ratio = seq_ratio if term.kind == "gspo" else torch.exp(log_probs - old)
    if term.kind == "cispo":
        low = None if term.cispo_eps_low is None else 1.0 - term.cispo_eps_low
        weight = ratio.clamp(min=low, max=1.0 + term.eps_high)
        clipped = ratio > 1.0 + term.eps_high
        if low is not None:
            clipped = clipped | (ratio < low)
        return -weight * advantages * log_probs, -weight * advantages, clipped
    unclipped = -advantages * ratio
    clipped_branch = -advantages * ratio.clamp(1.0 - term.eps_low, 1.0 + term.eps_high)
    loss = torch.maximum(unclipped, clipped_branch)
    clipped = clipped_branch > unclipped
    if term.dual_clip is not None:
        dual_bound = -term.dual_clip * advantages
        held = (advantages < 0) & (dual_bound < loss)
        loss = torch.where(held, dual_bound, loss)
        clipped = clipped | held
    return loss, torch.where(clipped, 0.0, unclipped), clipped


def kl_values(kind: str, log_probs: Tensor, ref: Tensor, importance_ratio: Tensor | None) -> tuple[Tensor, Tensor]:
    """Per-token ``(kl, d kl / d log_prob)`` of ``approx_kl(log_probs, ref, kind=kind, importance_ratio=...)``, where
    ``importance_ratio = exp(log_probs - old)`` carries gradient (slime's unbiased KL)."""
    d = log_probs - ref
    if kind == "k1":
        kl, grad = d, torch.ones_like(d)
    elif kind == "k2":
        kl, grad = 0.5 * d.square(), d
    else:
        kl, grad = torch.expm1(-d) + d, -torch.expm1(-d)
    if importance_ratio is not None:
        kl, grad = kl * importance_ratio, (grad + kl) * importance_ratio
    if kind == "low_var_kl":
        inside = (kl >= -_LOW_VAR_KL_BOUND) & (kl <= _LOW_VAR_KL_BOUND)
        kl, grad = kl.clamp(-_LOW_VAR_KL_BOUND, _LOW_VAR_KL_BOUND), torch.where(inside, grad, 0.0)
    return kl, grad


# The sums each chunk adds to (see token_coefficients), in this order.
SUMS = (
    "pg_loss",
    "kl_loss",
    "entropy_loss",
    "clipped",
    "approx_kl_old",
    "ratio",
    "approx_kl_ref",
    "entropy",
    "rollout",
)


def token_coefficients(
    cfg: LossConfig,
    term: PolicyTerm,
    inputs: TokenInputs,
    rows: slice,
    log_probs: Tensor,
    entropy: Tensor,
    seq_ratio: Tensor | None,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """The closed form of one chunk: ``(g_lp [n], g_ent [n] or None, sums [len(SUMS)], ratio max (0-dim))``.

    ``sums`` holds the chunk's part of ``pg_loss``, ``kl_loss`` and ``entropy_loss`` (before their coefficients), then
    its sums over tokens of: clipped tokens, ``old - log_probs``, the ratio the clip acts on, the KL estimate to the
    reference (unweighted), the entropy and ``|old - rollout|`` (``rl_loss``'s token-mean metrics, before the
    division by the token count). ``log_probs``, ``entropy``: float32 [n] of the chunk's rows ``rows``;
    ``seq_ratio``: [n] GSPO sequence ratio of each row's sequence, else ``None``.
    """
    advantages = inputs.advantages[rows]
    old = log_probs if inputs.old is None else inputs.old[rows]
    pg, g_pg, clipped = policy_values(term, log_probs, old, advantages, seq_ratio)
    c_pg = inputs.c_pg[rows]
    kept_weight = inputs.kept_weight[rows]
    g_lp = c_pg * g_pg
    zero = pg.new_zeros(())
    kl_share = ent_share = kl_ref = rollout_diff = zero
    if inputs.ref is not None:
        ref = inputs.ref[rows]
        kl_ref = kl_values(cfg.kl_loss_type, log_probs, ref, None)[0].sum()
        if cfg.use_kl_loss:
            ratio = torch.exp(log_probs - old) if cfg.use_unbiased_kl else None
            kl, g_kl = kl_values(cfg.kl_loss_type, log_probs, ref, ratio)
            g_lp = g_lp + (cfg.kl_loss_coef * kept_weight) * g_kl
            kl_share = (kept_weight * kl).sum()
    g_ent = None
    if cfg.entropy_coef != 0:
        g_ent = -cfg.entropy_coef * kept_weight
        ent_share = -(kept_weight * entropy).sum()
    if inputs.rollout is not None:
        rollout_diff = (old - inputs.rollout[rows]).abs().sum()
    ratio = seq_ratio if seq_ratio is not None else torch.exp(log_probs - old)
    sums = torch.stack(
        [
            (c_pg * pg).sum(),
            kl_share,
            ent_share,
            clipped.sum().to(pg.dtype),
            (old - log_probs).sum(),
            ratio.sum(),
            kl_ref,
            entropy.sum(),
            rollout_diff,
        ]
    )
    return g_lp, g_ent, sums, ratio.amax() if ratio.numel() else zero


class _Finite:
    """Deferred checks that batch tensors are finite at valid positions: the flags are computed on the device and
    copied to the host asynchronously, so ``verify()``, called once the op's work is queued, stalls nothing."""

    def __init__(self, mask: Tensor):
        self.mask = mask
        self.checked: dict[str, Tensor] = {}

    def add(self, name: str, x: Tensor) -> None:
        self.checked[name] = x

    def verify_later(self):
        if not self.checked:
            return lambda: None
        flags = host_later(torch.stack([(self.mask & ~torch.isfinite(x)).any() for x in self.checked.values()]))

        def verify() -> None:
            for (name, x), bad in zip(self.checked.items(), flags().tolist(), strict=True):
                if bad:
                    check_finite_where(name, x, self.mask)  # raises, naming the first bad position

        return verify


def _needed_keys(cfg: LossConfig, td: TensorDictBase) -> list[tuple[str, str]]:
    """The batch keys the fused pass reads, each with what needs it."""
    needed = [(keys.ADVANTAGES, "the policy loss")]
    present = td.keys()
    if keys.OLD_LOG_PROBS in present:
        needed.append((keys.OLD_LOG_PROBS, "the policy loss"))
    if cfg.use_tis or keys.ROLLOUT_LOG_PROBS in present:
        needed.append((keys.ROLLOUT_LOG_PROBS, "use_tis"))
    if cfg.use_kl_loss or keys.REF_LOG_PROBS in present:
        needed.append((keys.REF_LOG_PROBS, "use_kl_loss"))
    return needed


def _check_key(td: TensorDictBase, key: str, mask: Tensor, *, needed_by: str) -> Tensor:
    if key not in td.keys():
        raise ValueError(f"linear_rl_loss needs td[{key!r}] for {needed_by}; the batch has keys {sorted(td.keys())}")
    x = check_tensor(key, td.get(key), floating=True)
    if x.shape != mask.shape:
        raise ValueError(f"{key} has shape {tuple(x.shape)} but mask has shape {tuple(mask.shape)}")
    return x


def _read(td: TensorDictBase, key: str, mask: Tensor, finite: _Finite, *, needed_by: str) -> Tensor:
    x = _check_key(td, key, mask, needed_by=needed_by)
    finite.add(key, x)
    return masked_fill_zero(x.detach().float(), mask)


def mismatch(td: TensorDictBase, cfg: LossConfig, mask: Tensor) -> tuple[Tensor, Tensor] | None:
    """``mismatch_weights``' ``(weights, keep)`` for ``cfg.use_tis``, else ``None``. Without a host sync: the
    log-probs' finiteness at valid positions is checked by the caller's :class:`_Finite` (``token_inputs`` reads both
    through it)."""
    if not cfg.use_tis:
        return None
    old = masked_fill_zero(_check_key(td, keys.OLD_LOG_PROBS, mask, needed_by="use_tis").detach().float(), mask)
    rollout = masked_fill_zero(
        _check_key(td, keys.ROLLOUT_LOG_PROBS, mask, needed_by="use_tis").detach().float(), mask
    )
    return mismatch_weights_unchecked(
        old, rollout, mask, mode=cfg.tis_mode, level=cfg.tis_level, low=cfg.tis_clip_low, high=cfg.tis_clip
    )


def token_inputs(
    td: TensorDictBase,
    cfg: LossConfig,
    mask: Tensor,
    norm: Normalizer,
    rows: Tensor,
    finite: _Finite,
    tis: tuple[Tensor, Tensor] | None,
) -> tuple[TokenInputs, dict[str, Tensor]]:
    """Everything per token the loss needs besides the current log-probs and entropy, at the flat positions ``rows``
    ([n] int64: the valid tokens of ``mask``, row-major), and the metrics that depend on nothing else (the mismatch
    weights', given as ``tis`` by :func:`mismatch`). Batch tensors are checked finite at valid positions through
    ``finite``."""
    weight = aggregation_weights(mask, cfg.loss_agg_mode, norm, seq_token_counts=td.get(keys.SEQ_TOKEN_COUNTS, None))
    advantages = _read(td, keys.ADVANTAGES, mask, finite, needed_by="the policy loss")
    old = rollout = ref = None
    if keys.OLD_LOG_PROBS in td.keys():
        old = _read(td, keys.OLD_LOG_PROBS, mask, finite, needed_by="the policy loss")
    if cfg.use_tis or keys.ROLLOUT_LOG_PROBS in td.keys():
        rollout = _read(td, keys.ROLLOUT_LOG_PROBS, mask, finite, needed_by="use_tis")
    if cfg.use_kl_loss or keys.REF_LOG_PROBS in td.keys():
        ref = _read(td, keys.REF_LOG_PROBS, mask, finite, needed_by="use_kl_loss")
    keep = mask
    c_pg = weight
    metrics = {}
    if tis is not None:
        tis, keep = tis
        c_pg = weight * tis.float()
        num_tokens = _count(norm.num_tokens, mask.device).clamp_min(1)
        metrics["tis_weight_mean"] = tis.float().sum() / num_tokens
        metrics["tis_weight_max"] = tis.float().amax() if tis.numel() else tis.new_zeros((), dtype=torch.float32)
        metrics["tis_masked_frac"] = (mask & ~keep).sum() / num_tokens

    def at_rows(x: Tensor | None) -> Tensor | None:
        return None if x is None else x.flatten().index_select(0, rows)

    inputs = TokenInputs(
        c_pg=at_rows(torch.where(keep, c_pg, 0.0)),
        kept_weight=at_rows(torch.where(keep, weight, 0.0)),
        advantages=at_rows(advantages),
        old=at_rows(old),
        ref=at_rows(ref),
        rollout=at_rows(rollout),
        seq_ids=torch.div(rows, mask.shape[1], rounding_mode="floor"),
        seq_lengths=mask.sum(-1).clamp_min(1).float(),
    )
    return inputs, metrics


def _host_lengths(seq_lengths: Sequence[int] | None, mask: Tensor) -> tuple[list[int], Callable[[], None]]:
    """The per-sample valid-token counts on the host, and ``verify()``, which raises unless they equal ``mask``'s.

    ``None`` counts them from ``mask`` (a host sync; nothing to verify). Given ones are checked for length and sign at
    once, and against ``mask`` through an asynchronous copy, as ``check_targets`` checks the ids' range."""
    if seq_lengths is None:
        return mask.sum(-1).tolist(), lambda: None
    lengths = list(seq_lengths)
    if len(lengths) != mask.shape[0] or not all(
        isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= mask.shape[1] for n in lengths
    ):
        raise ValueError(
            f"seq_lengths must be {mask.shape[0]} ints in [0, {mask.shape[1]}] (one per row of mask "
            f"{tuple(mask.shape)}), got {lengths[:8]}{' ...' if len(lengths) > 8 else ''}"
        )
    given = torch.tensor(lengths, dtype=torch.int64)
    if mask.is_cuda:
        given = given.pin_memory()  # a copy from pageable memory could wait for the stream
    wrong = host_later((mask.sum(-1) != given.to(mask.device, non_blocking=True)).any())

    def verify() -> None:
        if bool(wrong()):
            raise ValueError(
                f"seq_lengths {lengths[:8]}{' ...' if len(lengths) > 8 else ''} do not match the valid tokens of "
                f"mask per row {mask.sum(-1).tolist()[:8]}"
            )

    return lengths, verify


def plan_chunks(
    seq_lengths: list[int], vocab: int, bytes_per_logit: int, chunk_bytes: int, by_sequence: bool
) -> tuple[list[tuple[int, int]], bool]:
    """Row bounds ``[(start, stop), ...]`` covering the ``sum(seq_lengths)`` rows, and whether they are cut along
    sequences.

    At most ``chunk_bytes`` of logits per chunk (at least one row), in near-equal chunks starting on multiples of 128
    rows; with ``by_sequence`` (GSPO), whole sequences (consecutive runs of ``seq_lengths`` rows) packed greedily,
    when the longest fits in a chunk.
    """
    rows = sum(seq_lengths)
    budget = max(1, chunk_bytes // max(1, vocab * bytes_per_logit))
    if rows == 0:
        return [], by_sequence
    if by_sequence and max(seq_lengths) <= budget:
        bounds, start, stop = [], 0, 0
        for length in seq_lengths:
            if stop + length - start > budget:
                bounds.append((start, stop))
                start = stop
            stop += length
        bounds.append((start, stop))
        return [(a, b) for a, b in bounds if b > a], True
    size = -(-rows // max(1, -(-rows // budget)))
    if budget >= _ROW_ALIGN:
        size = min(-(-size // _ROW_ALIGN), budget // _ROW_ALIGN) * _ROW_ALIGN
    return [(a, min(a + size, rows)) for a in range(0, rows, size)], False


def _chunk_logits(hidden: Tensor, weight: Tensor, out: Tensor) -> Tensor:
    """``hidden @ weight^T`` written into ``out`` (float32 from bf16/fp16 operands without a rounded copy on CUDA)."""
    if out.dtype == hidden.dtype:
        return torch.mm(hidden, weight.T, out=out)
    if hidden.is_cuda:
        return torch.mm(hidden, weight.T, out_dtype=out.dtype, out=out)
    return out.copy_(hidden.float() @ weight.float().T)


def _seq_ratio(log_probs: Tensor, old: Tensor, seq_ids: Tensor, seq_lengths: Tensor) -> Tensor:
    """GSPO's ``exp(mean over a sequence's valid tokens of (log_probs - old))``, at each of the rows given (whose
    sequences must be whole among them)."""
    sums = torch.zeros_like(seq_lengths).index_add_(0, seq_ids, log_probs - old)
    return torch.exp(sums / seq_lengths).index_select(0, seq_ids)


class _Settings(NamedTuple):
    cfg: LossConfig
    term: PolicyTerm
    seq_lengths: list[int]
    col_offset: int
    inv_temperature: float
    group: object
    chunk_bytes: int
    grad_weight_dtype: torch.dtype
    float32_logits: bool


def _token_stats(hidden, weight, targets, logits, settings: _Settings, start: int, stop: int):
    """Log-prob, entropy, ``lse`` and ``mu`` ([n] float32) of rows ``[start, stop)``; ``logits`` then holds theirs."""
    partial_stats, _ = backend_ops(hidden)
    _chunk_logits(hidden[start:stop], weight, logits)
    packed = partial_stats(logits, targets[start:stop], settings.col_offset, settings.inv_temperature, True)
    totals, log_probs, entropy = outputs(Partial(*packed), settings.group, True)
    return log_probs, entropy, totals


def _fused_pass(hidden, weight, targets, prepare, settings: _Settings, want_hidden, want_weight):
    """The row-chunked pass: ``(loss, sums, ratio max, grad_hidden, grad_weight)``, with ``sums`` and the ratio's
    maximum those of :func:`token_coefficients` over the chunks (the maximum 0 without any token).

    ``prepare()`` gives the :class:`TokenInputs`; it is called once the first chunk's logits are queued, so that the
    device computes them while the host prepares the per-token inputs.
    """
    vocab = weight.shape[0]
    logit_dtype = torch.float32 if settings.float32_logits else hidden.dtype
    separate_grad = logit_dtype != hidden.dtype
    bytes_per_logit = torch.finfo(logit_dtype).bits // 8 + (hidden.element_size() if separate_grad else 0)
    by_sequence = settings.term.kind == "gspo"
    chunks, aligned = plan_chunks(settings.seq_lengths, vocab, bytes_per_logit, settings.chunk_bytes, by_sequence)
    widest = max((b - a for a, b in chunks), default=0)
    buffer = torch.empty(widest, vocab, dtype=logit_dtype, device=hidden.device)
    grad_buffer = torch.empty(widest, vocab, dtype=hidden.dtype, device=hidden.device) if separate_grad else None
    inputs = None
    seq_ratio_all = None
    if by_sequence and not aligned:
        # Two-phase GSPO: a sequence does not fit in a chunk, so every log-prob comes first (one extra matmul).
        log_probs_all = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start, stop in chunks:
            lp, _, _ = _token_stats(hidden, weight, targets, buffer[: stop - start], settings, start, stop)
            log_probs_all[start:stop] = lp
            if inputs is None:
                inputs = prepare()
        old = log_probs_all if inputs.old is None else inputs.old
        seq_ratio_all = _seq_ratio(log_probs_all, old, inputs.seq_ids, inputs.seq_lengths)

    _, logits_grad = backend_ops(hidden)
    grad_hidden = torch.empty_like(hidden) if want_hidden else None
    grad_weight = None
    if want_weight:
        acc_dtype = settings.grad_weight_dtype
        allocate = torch.empty if chunks else torch.zeros  # no valid token: the gradient is 0
        grad_weight = allocate(weight.shape, dtype=acc_dtype, device=weight.device)
    sums = torch.zeros(len(SUMS), dtype=torch.float64, device=hidden.device)
    ratio_max = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for index, (start, stop) in enumerate(chunks):
        rows = slice(start, stop)
        logits = buffer[: stop - start]
        log_probs, entropy, totals = _token_stats(hidden, weight, targets, logits, settings, start, stop)
        if inputs is None:
            inputs = prepare()
        seq_ratio = None
        if by_sequence:
            if seq_ratio_all is not None:
                seq_ratio = seq_ratio_all[rows]
            else:
                old = log_probs if inputs.old is None else inputs.old[rows]
                seq_ratio = _seq_ratio(log_probs, old, inputs.seq_ids[rows], inputs.seq_lengths)
        g_lp, g_ent, chunk_sums, chunk_max = token_coefficients(
            settings.cfg, settings.term, inputs, rows, log_probs, entropy, seq_ratio
        )
        sums += chunk_sums
        ratio_max = torch.maximum(ratio_max, chunk_max)
        if not (want_hidden or want_weight):
            continue
        grads = grad_buffer[: stop - start] if separate_grad else logits
        logits_grad(
            logits,
            targets[rows],
            settings.col_offset,
            totals.lse,
            totals.mu,
            g_lp,
            g_ent,
            settings.inv_temperature,
            grads,
        )
        if want_hidden:
            torch.mm(grads, weight, out=grad_hidden[rows])
        if want_weight:
            _add_weight_grad(grad_weight, grads, hidden[rows], first=index == 0)
    if inputs is None:
        prepare()  # no valid token: the metrics still need the batch's
    if want_weight and grad_weight.dtype != weight.dtype:
        grad_weight = grad_weight.to(weight.dtype)
    cfg = settings.cfg
    loss = sums[0] + cfg.kl_loss_coef * sums[1] + cfg.entropy_coef * sums[2]
    return loss, sums, ratio_max, grad_hidden, grad_weight


def _add_weight_grad(acc: Tensor, grads: Tensor, hidden: Tensor, *, first: bool) -> None:
    """``acc (+)= grads^T @ hidden``: one matmul accumulating in float32, rounded once into ``acc``'s dtype."""
    if acc.dtype == grads.dtype:
        if first:
            torch.mm(grads.T, hidden, out=acc)
        else:
            acc.addmm_(grads.T, hidden)
    elif grads.is_cuda and first:
        torch.mm(grads.T, hidden, out_dtype=acc.dtype, out=acc)
    elif grads.is_cuda:
        torch.addmm(acc, grads.T, hidden, out_dtype=acc.dtype, out=acc)
    elif first:
        acc.copy_(grads.T.float() @ hidden.float())
    else:
        acc.add_(grads.T.float() @ hidden.float())


class LinearRLLoss(torch.autograd.Function):
    """Computes the loss and both gradients in the forward; the backward scales them by the upstream gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, prepare, settings, want_hidden, want_weight):
        loss, sums, ratio_max, grad_hidden, grad_weight = _fused_pass(
            hidden, weight, targets, prepare, settings, want_hidden, want_weight
        )
        ctx.grads = (grad_hidden, grad_weight)
        sums = sums.float()
        ctx.mark_non_differentiable(sums, ratio_max)
        return loss.float(), sums, ratio_max

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, *_):
        grad_hidden, grad_weight = ctx.grads
        if grad_hidden is None and grad_weight is None:
            raise RuntimeError("linear_rl_loss's backward already ran: its gradients were handed out")
        ctx.grads = (None, None)
        # One host sync, after the forward did all the work: a loss.backward() upstream gradient of 1 costs no pass.
        if grad_loss is not None and float(grad_loss) != 1.0:
            grad_hidden = None if grad_hidden is None else grad_hidden * grad_loss.to(grad_hidden.dtype)
            grad_weight = None if grad_weight is None else grad_weight * grad_loss.to(grad_weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def fusable(cfg: LossConfig, td: TensorDictBase) -> bool:
    """Whether ``linear_rl_loss`` computes ``cfg``'s loss on ``td`` in the fused pass (else it falls back): every term
    but the value loss (its input is the critic's output, not the LM head's), and mismatch weights only from a
    batch's ``old_log_probs`` (without them ``rl_loss`` takes the current log-probs, which the fused pass does not
    have before the mismatch weights are needed)."""
    return cfg.value_coef == 0 and (keys.OLD_LOG_PROBS in td.keys() or not cfg.use_tis)


def linear_rl_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    td: TensorDictBase,
    cfg: LossConfig,
    *,
    norm: Normalizer | None = None,
    loss_fn: Callable[[TensorDict], tuple[Tensor, TensorDict]] | None = None,
    cispo_eps_clip: float | None = None,
    temperature: float = 1.0,
    group: object = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    grad_weight_dtype: torch.dtype | None = None,
    float32_logits: bool = False,
    seq_lengths: Sequence[int] | None = None,
) -> tuple[Tensor, TensorDict]:
    """``rl_loss`` of the policy ``softmax(hidden @ weight^T / temperature)``, never holding the [N, V] logits.

    Equals ``rl_loss(td.set("log_probs", lp).set("entropy", ent), cfg, norm=norm)`` with ``(lp, ent)`` the
    ``linear_logprobs_entropy`` of the same inputs reshaped to ``[B, T]``, loss and gradients with respect to
    ``hidden`` and ``weight``, in three matmuls per row chunk and no recompute (see the module docstring).

    Args:
        hidden: [B * T, H] bfloat16, float16 or float32 final hidden states; row ``b * T + t`` predicts the t-th
            response token of sample ``b`` (the batch contract's layout, flattened). Rows outside the mask are
            gathered out first (only valid tokens go through the matmuls) and get zero gradient.
        weight: [V, H] LM-head weight, same dtype and device; with ``group`` this rank's vocabulary shard (rank ``r``
            holds rows ``[r * V, (r + 1) * V)``), and then ``hidden``'s gradient is this rank's partial sum, reduced
            over the group by the caller, as for ``linear_logprobs_entropy``.
        targets: [B * T] int64 or int32 token ids of the full vocabulary (padding: any valid id).
        td: the batch, ``batch_size=[B]``, with ``mask`` [B, T] and what ``cfg`` reads: ``advantages``;
            ``old_log_probs`` (absent: the current log-probs, detached); ``rollout_log_probs`` for ``use_tis``;
            ``ref_log_probs`` for ``use_kl_loss``; ``values``, ``old_values``, ``returns`` for ``value_coef``. Its
            ``log_probs`` and ``entropy``, if any, are ignored (the op computes them).
        cfg: a ``LossConfig``; every policy loss, mismatch mode and level, KL kind (with ``use_unbiased_kl``),
            the entropy bonus and every aggregation mode run fused; ``value_coef != 0`` falls back.
        norm: denominators of the global batch (``Normalizer.of`` its mask, summed over micro-batches and reduced
            over data-parallel ranks); ``None`` uses this batch's.
        loss_fn: a custom loss ``fn(td) -> (loss, metrics)`` over the batch with ``log_probs`` and ``entropy``
            [B, T] set; given, the op falls back to ``linear_logprobs_entropy`` and autograd through it.
        cispo_eps_clip: CISPO's lower truncation ``ratio >= 1 - cispo_eps_clip`` (slime's two-sided clamp);
            ``None`` keeps the one-sided weight of ``rlcore.losses.cispo`` today. Fused path only.
        temperature: divides the logits.
        group: the process group over which the vocabulary is sharded, or ``None``.
        chunk_bytes: logits memory per row chunk: the op's one large temporary.
        grad_weight_dtype: dtype in which the weight gradient accumulates over chunks: ``None`` (the weight's),
            or ``torch.float32`` (4 x V x H bytes more; rounded to the weight's dtype once at the end).
        float32_logits: keep the logits in float32 instead of rounding them to the input dtype (verl's and CCE's
            convention; half as many rows per chunk for the same ``chunk_bytes``). CUDA or float32 inputs only
            matter: on the CPU the product is float32 either way.
        seq_lengths: the valid tokens of each sample (``mask.sum(-1)``) as host integers, from a caller that has
            them (a trainer's batch keeps its lengths on the host); ``None`` counts them on the device, a host
            sync before the first matmul. Given, the op queues all its work without waiting for the device, and
            checks them against ``mask`` afterwards (a mismatch raises, naming both).

    Returns:
        ``(loss, metrics)`` as ``rl_loss``: a 0-dim float32 loss, differentiable with respect to ``hidden`` and
        ``weight`` (its backward runs once), and the detached metrics TensorDict of ``rl_loss`` (the same names
        and values, from sums the fused pass keeps per chunk: no pass over [B, T] tensors after it, no sync).
    """
    hidden = check_float_matrix("hidden", hidden)
    weight = check_tensor("weight", weight, ndim=2)
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise TypeError(
            f"weight ({weight.dtype}, {weight.device}) must match hidden ({hidden.dtype}, {hidden.device})"
        )
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be [V, H] for hidden {tuple(hidden.shape)} ([N, H])")
    if not isinstance(td, TensorDictBase):
        raise TypeError(f"td must be a TensorDict, got {type(td).__name__}")
    if not isinstance(cfg, LossConfig):
        raise TypeError(f"cfg must be a LossConfig, got {type(cfg).__name__}")
    if keys.MASK not in td.keys():
        raise ValueError(f"linear_rl_loss needs td[{keys.MASK!r}]; the batch has keys {sorted(td.keys())}")
    mask = check_mask(td.get(keys.MASK))
    check_tensor(keys.MASK, mask, ndim=2)
    if mask.numel() != hidden.shape[0] or mask.device != hidden.device:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must have one row per position of mask {tuple(mask.shape)} ([B * T, H]), "
            f"on mask's device ({mask.device}, hidden on {hidden.device})"
        )
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    if grad_weight_dtype not in (None, weight.dtype, torch.float32):
        raise ValueError(
            f"grad_weight_dtype must be None, the weight's dtype or torch.float32, got {grad_weight_dtype}"
        )
    if cispo_eps_clip is not None:
        if cfg.policy_loss != "cispo":
            raise ValueError(f"cispo_eps_clip applies to policy_loss 'cispo' only, got {cfg.policy_loss!r}")
        if isinstance(cispo_eps_clip, bool) or not isinstance(cispo_eps_clip, int | float) or not cispo_eps_clip >= 0:
            raise ValueError(f"cispo_eps_clip must be a non-negative number or None, got {cispo_eps_clip!r}")
    inv_temperature = 1.0 / check_temperature(temperature)
    rank, world = group_layout(group)
    targets, verify_targets = check_targets(
        targets,
        rows=hidden.shape[0],
        rows_name=f"hidden {tuple(hidden.shape)}",
        vocab=weight.shape[0] * world,
        device=hidden.device,
    )
    if norm is None:
        norm = Normalizer.of(mask, seq_counts=td.get(keys.SEQ_COUNTS, None))
    batch, seq_len = mask.shape

    if loss_fn is not None or not fusable(cfg, td):
        if cispo_eps_clip is not None:
            raise ValueError("cispo_eps_clip needs the fused path (no loss_fn and value_coef == 0)")
        log_probs, entropy = linear_logprobs_entropy(hidden, weight, targets, temperature=temperature, group=group)
        verify_targets()
        full = td.clone(recurse=False)
        full.set(keys.LOG_PROBS, log_probs.view(batch, seq_len))
        full.set(keys.ENTROPY, entropy.view(batch, seq_len))
        return loss_fn(full) if loss_fn is not None else rl_loss(full, cfg, norm=norm)

    lengths, verify_lengths = _host_lengths(seq_lengths, mask)
    eps_high = cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high
    term = PolicyTerm(cfg.policy_loss, float(cfg.eps_clip), float(eps_high), cfg.eps_clip_c, cispo_eps_clip)
    settings = _Settings(
        cfg=cfg,
        term=term,
        seq_lengths=lengths,
        col_offset=rank * weight.shape[0],
        inv_temperature=inv_temperature,
        group=group,
        chunk_bytes=chunk_bytes,
        grad_weight_dtype=grad_weight_dtype or weight.dtype,
        float32_logits=float32_logits,
    )
    # Only valid tokens go through the matmuls: padding costs a gather of its hidden states, not three matmuls.
    rows = torch.arange(mask.numel(), device=mask.device)
    if sum(lengths) < mask.numel():
        # nonzero_static: the count is known, so no wait for the device (a wrong count is caught by verify_lengths).
        rows = torch.nonzero_static(mask.flatten(), size=sum(lengths), fill_value=0).squeeze(1)
        hidden, targets = hidden.index_select(0, rows), targets.index_select(0, rows)
    for key, needed_by in _needed_keys(cfg, td):
        _check_key(td, key, mask, needed_by=needed_by)
    finite = _Finite(mask)
    prepared = {}

    def prepare() -> TokenInputs:
        tis = mismatch(td, cfg, mask)
        prepared["inputs"], prepared["metrics"] = token_inputs(td, cfg, mask, norm, rows, finite, tis)
        prepared["verify"] = finite.verify_later()
        return prepared["inputs"]

    grad_enabled = torch.is_grad_enabled()
    loss, sums, ratio_max = LinearRLLoss.apply(
        hidden.contiguous(),
        weight.contiguous(),
        targets,
        prepare,
        settings,
        grad_enabled and hidden.requires_grad,
        grad_enabled and weight.requires_grad,
    )
    verify_lengths()
    verify_targets()
    prepared["verify"]()
    metrics = _metrics(cfg, prepared["inputs"], norm, loss, sums, ratio_max, prepared["metrics"], device=hidden.device)
    return loss, metrics


def _metrics(cfg, inputs: TokenInputs, norm: Normalizer, loss, sums, ratio_max, metrics, *, device) -> TensorDict:
    """``rl_loss``'s metrics from the fused pass's sums (token means divide by the global token count)."""
    num_tokens = _count(norm.num_tokens, device).clamp_min(1)
    total = dict(zip(SUMS, sums.unbind(), strict=True))
    metrics = {
        **metrics,
        "loss": loss.detach(),
        "pg_loss": total["pg_loss"],
        "clipfrac": total["clipped"] / num_tokens,
        "approx_kl_old": total["approx_kl_old"] / num_tokens,
        "ratio_mean": total["ratio"] / num_tokens,
        "ratio_max": ratio_max,
        "entropy": total["entropy"] / num_tokens,
    }
    if inputs.rollout is not None:
        metrics["rollout_log_prob_abs_diff"] = total["rollout"] / num_tokens
    if inputs.ref is not None:
        metrics["approx_kl_ref"] = total["approx_kl_ref"] / num_tokens
    if cfg.use_kl_loss:
        metrics["kl_loss"] = total["kl_loss"]
    if cfg.entropy_coef != 0:
        metrics["entropy_loss"] = total["entropy_loss"]
    return TensorDict({name: value.detach().float() for name, value in metrics.items()}, batch_size=[])
