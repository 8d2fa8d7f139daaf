"""Masked whitening of advantages with moments that may span a process group."""

import torch
import torch.distributed as dist
from torch import Tensor

from rlcore._checks import check_finite_where, check_mask, check_tensor, masked_fill_zero
from rlcore.advantages._checks import check_non_negative


def whiten(
    x: Tensor,
    mask: Tensor,
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` with the mean and variance of the valid entries of ``x``.

    Matches slime's ``distributed_masked_whiten`` (``--normalize-advantages``): the variance is the unbiased one
    (Bessel's correction when there are at least 2 valid entries), ``shift_mean=False`` adds the mean back (scales
    around the mean), and with ``group`` the moments are global: one ``all_reduce`` of (sum, sum of squares,
    count). Differences: the moments are accumulated in float64 so that ``E[x^2] - E[x]^2`` does not cancel; with
    ``group=None`` the moments are local (slime falls back to the default world group; rlcore takes distributed
    reductions only as arguments); masked positions come out as 0.

    Args:
        x: [...] floating.
        mask: [...] bool of ``x``'s shape.
        shift_mean: output mean 0 (True) or the input's mean (False).
        eps: added to the variance, >= 0.
        group: a ``torch.distributed`` process group; every rank of it must call ``whiten``.

    Returns:
        Tensor of ``x``'s shape and dtype, 0 at masked positions.

    Raises:
        ValueError: when there is no valid entry at all (across the group).
    """
    check_tensor("x", x, floating=True)
    check_mask(mask, like=x, like_name="x")
    check_finite_where("x", x, mask)
    eps = check_non_negative("eps", eps)
    valid = masked_fill_zero(x.to(torch.float64), mask)
    moments = torch.stack([valid.sum(), valid.square().sum(), mask.sum().to(torch.float64)])
    if group is not None:
        dist.all_reduce(moments, op=dist.ReduceOp.SUM, group=group)
    total, total_sq, count = moments.unbind()
    if float(count) == 0:
        where = "across the process group" if group is not None else f"in mask of shape {tuple(mask.shape)}"
        raise ValueError(f"whiten: no valid entry {where}, the mean is undefined")
    mean = total / count
    var = (total_sq / count - mean.square()).clamp(min=0.0)
    if float(count) >= 2:
        var = var * (count / (count - 1))
    out = (x.to(torch.float64) - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return masked_fill_zero(out.to(x.dtype), mask)
