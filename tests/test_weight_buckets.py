"""``runtime.train.backends.base.in_buckets``: how both backends' ``weight_buckets`` fill buckets, against a greedy
fill written here from sizes alone, and the argument check both call."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from runtime.train.backends.base import check_bucket_request, in_buckets


def _expected_groups(sizes: list[int], limit: int) -> list[list[int]]:
    """Indices grouped as a greedy fill does: a tensor that would take a non-empty group past ``limit`` starts a new
    one."""
    groups: list[list[int]] = []
    total = 0
    for i, size in enumerate(sizes):
        if groups and groups[-1] and total + size <= limit:
            groups[-1].append(i)
            total += size
        else:
            groups.append([i])
            total = size
    return groups


@given(
    numels=st.lists(st.integers(1, 40), max_size=25),
    limit=st.integers(1, 200),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.uint8]),
)
def test_buckets_keep_every_tensor_in_order_and_fill_greedily(numels, limit, dtype):
    tensors = [(f"t{i}", torch.full((n,), float(i), dtype=dtype)) for i, n in enumerate(numels)]
    buckets = list(in_buckets(iter(tensors), bucket_bytes=limit))
    # Every tensor once, in order, the same object (no copy).
    flat = [(name, t) for bucket in buckets for name, t in bucket.items()]
    assert [name for name, _ in flat] == [name for name, _ in tensors]
    assert all(a is b for (_, a), (_, b) in zip(flat, tensors, strict=True))
    sizes = [t.nbytes for _, t in tensors]
    assert [[int(name[1:]) for name in bucket] for bucket in buckets] == _expected_groups(sizes, limit)
    for bucket in buckets:
        assert len(bucket) == 1 or sum(t.nbytes for t in bucket.values()) <= limit
    # Greedy: no bucket could have taken the next bucket's first tensor.
    for a, b in zip(buckets, buckets[1:], strict=False):
        assert sum(t.nbytes for t in a.values()) + next(iter(b.values())).nbytes > limit


def test_each_bucket_is_yielded_before_the_next_tensor_is_made():
    made = []

    def tensors():
        for i in range(4):
            made.append(i)
            yield f"t{i}", torch.zeros(2, dtype=torch.uint8)

    it = in_buckets(tensors(), bucket_bytes=4)
    assert list(next(it)) == ["t0", "t1"] and made == [0, 1, 2]  # t2 asked for, found to overflow, held back
    assert list(next(it)) == ["t2", "t3"]
    assert next(it, None) is None


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(bucket_bytes=0, device="cpu"), "bucket_bytes must be >= 1, got 0"),
        (dict(bucket_bytes=8, device="cuda"), "device must be 'cpu' or 'model', got 'cuda'"),
    ],
)
def test_a_bucket_request_no_backend_serves_is_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_bucket_request(**kwargs)
    check_bucket_request(bucket_bytes=8, device="model")
