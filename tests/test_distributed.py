"""rlcore.distributed: collectives run on a device the group's backend serves (NCCL reduces CUDA tensors only)."""

import pytest
import torch
import torch.distributed as dist

from rlcore import distributed


class _Group:
    """Stands for a process group: only its backend's name is read."""


@pytest.fixture
def backend(monkeypatch):
    def use(name: str) -> _Group:
        monkeypatch.setattr(dist, "get_backend", lambda group: name)
        return _Group()

    return use


@pytest.mark.parametrize(
    ("name", "served"),
    [("gloo", ("cpu", "cuda")), ("nccl", ("cuda",)), ("cpu:gloo,cuda:nccl", ("cpu", "cuda"))],
)
def test_served_devices(backend, name, served):
    assert distributed.served_devices(backend(name)) == served


def test_a_cpu_tensor_over_nccl_is_reduced_on_the_current_cuda_device(backend, monkeypatch):
    # The bug this guards: a CPU tensor all-reduced over the NCCL data-parallel group ("No backend type associated
    # with device type cpu"). CUDA is not needed to check where the reduction is sent.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert distributed.reduce_device(backend("nccl"), torch.zeros(2)) == torch.device("cuda", 1)
    assert distributed.reduce_device(backend("gloo"), torch.zeros(2)) == torch.device("cpu")


def test_an_unknown_backend_is_named(backend):
    with pytest.raises(ValueError, match="'ucc' is not one of gloo, nccl, mpi"):
        distributed.served_devices(backend("ucc"))


def test_without_a_group_the_input_comes_back_unchanged_and_unshared():
    x = torch.arange(3.0)
    out = distributed.all_reduce(x, group=None)
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()


def test_all_reduce_over_a_one_rank_gloo_group(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        x = torch.tensor([1.5, 2.0], dtype=torch.float64)
        out = distributed.all_reduce(x, group=dist.group.WORLD, op=dist.ReduceOp.MAX)
        assert torch.equal(out, x) and out.device == x.device and out.data_ptr() != x.data_ptr()
    finally:
        dist.destroy_process_group()
