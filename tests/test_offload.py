"""Colocation's offload of the trainer (``runtime.train.offload``): the bucket plan's order and bounds, the metrics'
declared reductions, and round trips of weights and AdamW state through :class:`HostOffload` (on the CPU the same
code runs with plain host buffers), alone and inside the torch backend, after which training goes on identically."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_torch_backend_perf import _cfg, _samples, _step, _trainer

from runtime.demo import task
from runtime.demo.tiny_model import make_tiny_model
from runtime.train.batch import build_batch
from runtime.train.offload import (
    KINDS,
    METRICS,
    HostOffload,
    Piece,
    bucket_plan,
    module_tensors,
    optimizer_tensors,
    reduce_over_ranks,
)


def same_tensors(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, value in got.items():
        assert torch.equal(value, expected[name]), name


pieces_strategy = st.lists(
    st.builds(Piece, kind=st.sampled_from(KINDS), name=st.text(max_size=3), nbytes=st.integers(0, 300)), max_size=30
)


@given(pieces=pieces_strategy, bucket_bytes=st.integers(1, 400))
def test_bucket_plan_moves_optimizer_state_first_in_bounded_greedy_buckets(pieces, bucket_bytes):
    plan = bucket_plan(pieces, bucket_bytes=bucket_bytes)
    flat = [i for bucket in plan for i in bucket]
    # Every piece once: the optimizer's in their order, then the weights in theirs.
    assert flat == [i for k in KINDS for i, p in enumerate(pieces) if p.kind == k]
    sizes = [sum(pieces[i].nbytes for i in bucket) for bucket in plan]
    for bucket, size in zip(plan, sizes, strict=True):
        assert bucket and len({pieces[i].kind for i in bucket}) == 1
        assert size <= bucket_bytes or len(bucket) == 1
    # Greedy: a bucket is closed only when the next piece of its kind would not fit.
    for (a, size), b in zip(zip(plan, sizes, strict=True), plan[1:], strict=False):
        if pieces[a[0]].kind == pieces[b[0]].kind:
            assert size + pieces[b[0]].nbytes > bucket_bytes


def test_bucket_plan_rejects_bad_input():
    with pytest.raises(ValueError, match="bucket_bytes"):
        bucket_plan([], bucket_bytes=0)
    with pytest.raises(ValueError, match="kind"):
        bucket_plan([Piece("grads", "g", 4)], bucket_bytes=8)
    assert bucket_plan([Piece("weights", "w", 9), Piece("optimizer", "m", 1)], bucket_bytes=8) == [[1], [0]]


def test_offload_metrics_reduce_as_declared():
    ranks = [
        {"perf/offload_train_bytes": 10.0, "perf/offload_train_time": 0.5},
        None,
        {"perf/offload_train_bytes": 6.0, "perf/offload_train_time": 0.7},
    ]
    assert reduce_over_ranks(ranks) == {"perf/offload_train_bytes": 16.0, "perf/offload_train_time": 0.7}
    assert reduce_over_ranks([{}, None]) == {}
    assert set(METRICS.values()) <= {"sum", "max"}
    with pytest.raises(ValueError, match="declared"):
        reduce_over_ranks([{"perf/other": 1.0}])


def _model_and_adamw(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    model[2].weight = torch.nn.Parameter(torch.randn(3, 16))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, optimizer, steps: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 8, generator=g)
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _state(model, optimizer) -> dict[str, torch.Tensor]:
    tensors = [*module_tensors(model), *optimizer_tensors(optimizer)]
    return {name: t.detach().clone() for name, t in tensors}


def test_host_offload_round_trips_weights_and_adamw_state_bit_exactly_and_training_goes_on_alike():
    model, opt = _model_and_adamw(0)
    twin, twin_opt = _model_and_adamw(0)
    _train(model, opt, 2, seed=1)
    _train(twin, twin_opt, 2, seed=1)
    before = _state(model, opt)
    params = list(model.parameters())
    offload = HostOffload(torch.device("cpu"), bucket_bytes=300)
    tensors = [
        *(("optimizer", n, t) for n, t in optimizer_tensors(opt)),
        *(("weights", n, t) for n, t in module_tensors(model)),
    ]
    for _ in range(2):
        metrics = offload.offload(tensors)
        assert metrics["perf/offload_train_bytes"] == sum(t.numel() * t.element_size() for _, _, t in tensors)
        assert metrics["perf/offload_train_time"] >= 0
        # Every tensor now lives in one of the host buffers; the first buffers hold the optimizer's state.
        spans = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in offload._buffers]
        where = {n: next(k for k, (lo, hi) in enumerate(spans) if lo <= t.data_ptr() < hi) for _, n, t in tensors}
        last_optimizer = max(where[n] for kind, n, _ in tensors if kind == "optimizer")
        assert last_optimizer < min(where[n] for kind, n, _ in tensors if kind == "weights")
        with pytest.raises(RuntimeError, match="already offloaded"):
            offload.offload(tensors)
        assert set(offload.resume()) == {"perf/offload_train_resume_time"}
        assert offload.resume() == {}
        # The buffers are made once and reused while the tensors stay the same.
        assert offload.buffer_allocations == len(offload._buffers) > 2
        assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
        same_tensors(_state(model, opt), before)
    _train(model, opt, 3, seed=2)
    _train(twin, twin_opt, 3, seed=2)
    same_tensors(_state(model, opt), _state(twin, twin_opt))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), alphabet=task.ALPHABET, seed=0))


def test_torch_backend_offload_and_resume_leave_training_identical(tiny, tmp_path):
    cfg = _cfg(tmp_path)
    td = build_batch(_samples(18, seed=0), pad_token_id=0)
    offloaded, control = _trainer(tiny, cfg), _trainer(tiny, cfg)
    # On the CPU the backend moves nothing by default; given a HostOffload it runs the GPU path's code.
    assert offloaded.host_offload is None and offloaded.release_memory() == {}
    offloaded.resume_memory()
    offloaded.host_offload = HostOffload(torch.device("cpu"), bucket_bytes=4096)
    for step in range(2):
        metrics = offloaded.release_memory()
        moved = sum(t.numel() * t.element_size() for _, _, t in offloaded._offload_tensors())
        assert metrics["perf/offload_train_bytes"] == moved > 0
        with pytest.raises(RuntimeError, match="resume_memory"):
            offloaded.compute_log_probs(td.clone())
        assert set(offloaded.resume_memory()) == {"perf/offload_train_resume_time"}
        got, expected = _step(offloaded, td, cfg), _step(control, td, cfg)
        same_tensors(got[2], expected[2])
        assert got[1] == expected[1], step
    kinds = [kind for kind, _, _ in offloaded._offload_tensors()]
    assert "optimizer" in kinds and kinds == sorted(kinds, key=KINDS.index)


def test_the_weights_buffers_are_kept_when_optimizer_state_appears():
    model, opt = _model_and_adamw(0)
    offload = HostOffload(torch.device("cpu"), bucket_bytes=300)

    def tensors():
        return [
            *(("optimizer", n, t) for n, t in optimizer_tensors(opt)),
            *(("weights", n, t) for n, t in module_tensors(model)),
        ]

    offload.offload(tensors())  # before the first step: no AdamW state yet
    offload.resume()
    weight_buffers = [b.data_ptr() for b in offload._buffers]
    first = offload.buffer_allocations
    _train(model, opt, 1, seed=1)
    offload.offload(tensors())
    offload.resume()
    assert [b.data_ptr() for b in offload._buffers][-len(weight_buffers) :] == weight_buffers
    assert offload.buffer_allocations == first + len(offload._buffers) - len(weight_buffers)
