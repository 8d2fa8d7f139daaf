"""The once-per-rank dispatcher's Triton sum of copies on a GPU (skipped without one): the same bits as the CPU path
(the same float32 adds in the same order, one rounding to the rows' dtype, round-to-nearest-even both), in bf16
and float32, with rows of 0 to 8 copies over 2048 columns (two column blocks).

Run: ``python -m pytest -q tests/test_megatron_dispatch_cuda.py``."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)

from runtime.train.backends import megatron_dispatch as md  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_sums_as_the_cpu_path(dtype):
    gen = torch.Generator().manual_seed(0)
    rows, slots, width = 3000, 32, 2048
    scores = torch.rand(rows, slots, generator=gen)
    # Top 7 of 32 slots, a fifth of them dropped: 0 to 7 copies a row.
    mask = (scores > scores.topk(8, dim=1).values[:, -1:]) & (torch.rand(rows, slots, generator=gen) < 0.8)
    mask[0] = False
    mask[1] = torch.arange(slots) < 8  # the most: 8
    index, position = md.compact(mask.T, int(mask.sum()))
    copies = md.Copies.of_slots(mask, position.view(slots, rows).T, index % rows, most=8)
    y = torch.randn(int(mask.sum()), width, generator=gen).to(dtype)
    want = copies.sum(y)  # the CPU path: index_add_ in float32, in order
    on_gpu = md.Copies(*(t.cuda() for t in (copies.source, copies.order, copies.offsets)), copies.most)
    got = on_gpu.sum(y.cuda()).cpu()
    assert torch.equal(got, want)
    assert not got[0].any()
