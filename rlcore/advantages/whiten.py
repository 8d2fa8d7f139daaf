"""Masked whitening of advantages with moments that may span a process group."""

import torch
import torch.distributed as dist
from torch import Tensor

from rlcore._checks import check_finite_where, check_mask, check_tensor, masked_fill_zero
from rlcore.advantages._checks import check_non_negative
from rlcore.distributed import all_reduce


def _summed(local: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """``local`` summed over ``group`` (itself without one). The gradient is that of this rank's share: the sum of
    the other ranks enters as a constant, since ``all_reduce`` is not differentiable."""
    if group is None:
        return local
    total = all_reduce(local, group=group)  # on a device the group's backend serves (NCCL: CUDA)
    return local + (total - local.detach())


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
    around the mean), and with ``group`` the moments are global. Differences: two passes in float64, the mean
    first (one ``all_reduce`` of (sum, count)), then the sum of squared deviations from it (a second
    ``all_reduce``), so that no ``E[x^2] - E[x]^2`` cancels when the spread is small next to the mean; with
    ``group=None`` the moments are local (slime falls back to the default world group; rlcore takes distributed
    reductions only as arguments); masked positions come out as 0 and get gradient 0, whatever they hold.

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
    # Padding is zeroed before any arithmetic: a NaN there would otherwise reach the backward as 0 * NaN.
    valid = masked_fill_zero(x.to(torch.float64), mask)
    total, count = _summed(torch.stack([valid.sum(), mask.sum().to(valid)]), group).unbind()
    num_valid = int(count.detach())
    if num_valid == 0:
        where = "across the process group" if group is not None else f"in mask of shape {tuple(mask.shape)}"
        raise ValueError(f"whiten: no valid entry {where}, the mean is undefined")
    mean = total / num_valid
    centered = masked_fill_zero(valid - mean, mask)
    var = _summed(centered.square().sum(), group) / max(num_valid - 1, 1)
    out = centered * torch.rsqrt(var + eps)
    if not shift_mean:
        out = masked_fill_zero(out + mean, mask)
    return out.to(x.dtype)
