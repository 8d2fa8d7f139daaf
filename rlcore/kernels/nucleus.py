"""Top-p nucleus replay: log-probs renormalised over the nucleus the rollout engine sampled from.

With ``top_p < 1`` an engine draws each token from ``softmax(logits / T)`` restricted to a nucleus and renormalised.
When the engine reports that nucleus for every step (slime's ``rollout_top_p_token_ids`` / ``_offsets``), the
trainer can take its log-probs over the same set, so that the ratio, the mismatch weights and the gradient refer to
the policy that sampled:

    log p_nucleus(y) = log_softmax(z / T)[y] - logsumexp_{v in nucleus} log_softmax(z / T)[v]

The sampled token always counts in the nucleus (an engine's nucleus and the trainer's may disagree at the boundary;
slime's SGLang patch keeps the sampled token for the same reason). A row without a recorded nucleus keeps the whole
vocabulary: it is the plain ``log_softmax(z / T)[y]``.

Nuclei travel padded: ``nucleus_ids [N, K]`` int, the ids of row ``n`` first, then ``-1``. :func:`pad_nucleus` turns
slime's ragged per-sample layout into that.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlcore._checks import check_tensor

PAD = -1


def pad_nucleus(token_ids: Tensor, offsets: Tensor, *, width: int | None = None) -> Tensor:
    """slime's ragged nucleus layout of one sample, padded: ``[R, K]`` int64, row ``r`` holding
    ``token_ids[offsets[r]:offsets[r + 1]]`` then ``-1``.

    Args:
        token_ids: [M] integer ids, every response token's nucleus one after another.
        offsets: [R + 1] integer, non-decreasing, ``offsets[0] == 0`` and ``offsets[-1] == M``.
        width: ``K``; by default the largest nucleus. Must be at least that.
    """
    check_tensor("token_ids", token_ids, ndim=1)
    check_tensor("offsets", offsets, ndim=1)
    if token_ids.is_floating_point() or offsets.is_floating_point():
        raise TypeError(f"token_ids and offsets must be integer tensors, got {token_ids.dtype} and {offsets.dtype}")
    if offsets.numel() < 1 or int(offsets[0]) != 0 or int(offsets[-1]) != token_ids.numel():
        raise ValueError(
            f"offsets must start at 0 and end at len(token_ids) = {token_ids.numel()}, got {offsets.tolist()[:8]}..."
            f" (length {offsets.numel()})"
        )
    sizes = offsets[1:] - offsets[:-1]
    if bool((sizes < 0).any()):
        raise ValueError(f"offsets must be non-decreasing, got {offsets.tolist()}")
    longest = int(sizes.max()) if sizes.numel() else 0
    width = longest if width is None else width
    if width < longest:
        raise ValueError(f"width {width} is below the largest nucleus ({longest} ids)")
    rows = sizes.numel()
    out = torch.full((rows, width), PAD, dtype=torch.long)
    if token_ids.numel():
        row = torch.repeat_interleave(torch.arange(rows), sizes)
        col = torch.arange(token_ids.numel()) - offsets[:-1].long()[row]
        out[row, col] = token_ids.long()
    return out


def nucleus_mask(nucleus_ids: Tensor, targets: Tensor, *, vocab_size: int, validate: bool = True) -> Tensor:
    """``keep [N, V]`` bool: the nucleus of each row plus its target; the whole vocabulary where a row has no ids.

    Args:
        nucleus_ids: [N, K] integer ids in ``[0, V)``, padded with ``-1``.
        targets: [N] integer ids in ``[0, V)`` (the sampled tokens).
        validate: check the ids' range (a host sync on an accelerator; a caller that checked them on the host
            passes False).
    """
    check_tensor("nucleus_ids", nucleus_ids, ndim=2)
    check_tensor("targets", targets, ndim=1)
    if nucleus_ids.shape[0] != targets.shape[0]:
        raise ValueError(f"nucleus_ids {tuple(nucleus_ids.shape)} and targets {tuple(targets.shape)} differ in rows")
    ids = nucleus_ids.long()
    if validate and bool(((ids < PAD) | (ids >= vocab_size)).any()):
        raise ValueError(f"nucleus_ids must be in [0, {vocab_size}) or -1 (padding)")
    recorded = (ids != PAD).any(-1)
    keep = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.bool, device=ids.device)
    # Padding scatters into the extra column, which is dropped.
    keep.scatter_(1, torch.where(ids == PAD, vocab_size, ids), True)
    keep = keep[:, :vocab_size]
    keep[torch.arange(ids.shape[0], device=ids.device), targets.long()] = True
    return keep | ~recorded[:, None]


def nucleus_log_probs(
    logits: Tensor, targets: Tensor, nucleus_ids: Tensor, *, temperature: float = 1.0, validate: bool = True
) -> Tensor:
    """Log-prob of each target under ``softmax(logits / T)`` restricted to its row's nucleus and renormalised.

    Args:
        logits: [N, V] full-vocabulary logits (any floating dtype; differentiable).
        targets: [N] integer ids in ``[0, V)``.
        nucleus_ids: [N, K] the nucleus of each row, padded with ``-1`` (:func:`pad_nucleus`); a row of padding
            only keeps the whole vocabulary.
        temperature: > 0.
        validate: as :func:`nucleus_mask`'s.

    Returns:
        [N] in ``logits``' dtype promoted to at least float32. Materialises ``[N, V]`` (use on micro-batches).
    """
    check_tensor("logits", logits, ndim=2, floating=True)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    keep = nucleus_mask(nucleus_ids, targets, vocab_size=logits.shape[1], validate=validate)
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    log_p = torch.log_softmax(z.masked_fill(~keep, float("-inf")), dim=-1)
    return log_p.gather(-1, targets.long()[:, None]).squeeze(-1)
