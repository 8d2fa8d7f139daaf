"""The compiled Triton kernels on a CUDA GPU against the float64 reference, including N * V beyond 2**31.

Skipped without CUDA (CI has none; ``test_kernels.py`` runs the same kernels there through Triton's interpreter).
"""

import pytest
import torch

from rlcore.kernels import linear as linear_module
from rlcore.kernels import linear_logprobs_entropy, logprobs_entropy, reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GRAD_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def reference_step(logits, targets, g_lp, g_ent, temperature):
    x = logits.detach().double().requires_grad_()
    lp, ent = reference.logprobs_entropy(x, targets, temperature=temperature)
    (grad,) = torch.autograd.grad([lp, ent], x, [g_lp.double(), g_ent.double()])
    return lp, ent, grad


def assert_grad_close(actual, expected, dtype):
    rtol = GRAD_RTOL[dtype]
    atol = rtol * float(expected.abs().max()) + torch.finfo(dtype).tiny
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "v"), [(1, 1000), (37, 32007), (64, 151936), (3, 5)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("inplace", [False, True])
def test_cuda_matches_reference(dtype, n, v, temperature, inplace):
    gen = torch.Generator(device="cuda").manual_seed(n + v)
    base = torch.randn(n, v, device="cuda", generator=gen) * 4
    base[0, 0] += 40.0  # one very peaked row
    if n > 2:
        base[1] = 0.5  # one flat row
    base = base.to(dtype)
    logits = base.clone().requires_grad_()
    targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
    g_lp, g_ent = torch.randn(n, device="cuda", generator=gen), torch.randn(n, device="cuda", generator=gen)
    lp, ent = logprobs_entropy(logits, targets, temperature=temperature, inplace_backward=inplace)
    ref_lp, ref_ent, ref_grad = reference_step(base, targets, g_lp, g_ent, temperature)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=2e-5, atol=2e-5)
    (grad,) = torch.autograd.grad([lp, ent], logits, [g_lp, g_ent])
    assert (grad.data_ptr() == logits.data_ptr()) == inplace
    assert_grad_close(grad, ref_grad, dtype)


def test_cuda_beyond_int32_offsets():
    """N * V > 2**31 elements: rows at the far end must be read and written at the right 64-bit offsets."""
    v = 151936
    n = 2**31 // v + 8
    logits = torch.empty(n, v, device="cuda", dtype=torch.bfloat16).normal_(0, 3)
    targets = torch.randint(0, v, (n,), device="cuda")
    g_lp, g_ent = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    tail = slice(n - 16, n)
    tail_logits = logits[tail].clone()
    lp, ent = logprobs_entropy(logits.requires_grad_(), targets, inplace_backward=True)
    ref_lp, ref_ent, ref_grad = reference_step(tail_logits, targets[tail], g_lp[tail], g_ent[tail], 1.0)
    torch.testing.assert_close(lp[tail].double(), ref_lp, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(ent[tail].double(), ref_ent, rtol=2e-5, atol=2e-5)
    (grad,) = torch.autograd.grad([lp, ent], logits, [g_lp, g_ent])
    assert_grad_close(grad[tail], ref_grad, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("chunk", "stash_bytes"), [(1024, 0), (1024, 3 * 300 * 1024 * 2), (8192, 1 << 30)])
def test_cuda_linear_matches_reference(dtype, chunk, stash_bytes):
    """N > H: head pieces in the weight gradient's buffer."""
    n, h, v = 300, 64, 5003
    gen = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(n, h, device="cuda", generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=gen) / 2).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
    g_lp, g_ent = torch.randn(n, device="cuda", generator=gen), torch.randn(n, device="cuda", generator=gen)
    lp, ent = linear_logprobs_entropy(hidden, weight, targets, temperature=0.9, chunk=chunk, stash_bytes=stash_bytes)
    grad_h, grad_w = torch.autograd.grad([lp, ent], [hidden, weight], [g_lp, g_ent])
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref_lp, ref_ent = reference.linear_logprobs_entropy(h64, w64, targets, temperature=0.9)
    ref_h, ref_w = torch.autograd.grad([ref_lp, ref_ent], [h64, w64], [g_lp.double(), g_ent.double()])
    # float32 matmuls may run in TF32; half-precision logits are rounded once by the matmul.
    tol = {torch.float32: 3e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(lp.double(), ref_lp, rtol=tol, atol=tol)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=tol, atol=tol)
    for got, want in ((grad_h, ref_h), (grad_w, ref_w)):
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * float(want.abs().max()))


def test_cuda_out_of_range_target():
    with pytest.raises(ValueError, match="targets must lie in"):
        logprobs_entropy(torch.randn(2, 7, device="cuda"), torch.tensor([0, 7], device="cuda"))


def _nccl_vocab_parallel_worker(rank: int, world: int, init_file: str) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        n, v, h = 257, 151936, 256
        v_local = v // world
        shard = slice(rank * v_local, (rank + 1) * v_local)
        gen = torch.Generator(device="cuda").manual_seed(7)  # the same full tensors on every rank
        full = (torch.randn(n, v, device="cuda", generator=gen) * 4).bfloat16()
        targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
        g_lp, g_ent = torch.randn(n, device="cuda", generator=gen), torch.randn(n, device="cuda", generator=gen)
        logits = full[:, shard].clone().requires_grad_()
        lp, ent = logprobs_entropy(logits, targets, temperature=0.7, group=dist.group.WORLD, inplace_backward=True)
        ref_lp, ref_ent, ref_grad = reference_step(full, targets, g_lp, g_ent, 0.7)
        torch.testing.assert_close(lp.double(), ref_lp, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(ent.double(), ref_ent, rtol=2e-5, atol=2e-5)
        (grad,) = torch.autograd.grad([lp, ent], logits, [g_lp, g_ent])
        assert_grad_close(grad, ref_grad[:, shard], torch.bfloat16)

        hidden = torch.randn(n, h, device="cuda", generator=gen).requires_grad_()
        weight_full = torch.randn(v, h, device="cuda", generator=gen) / 8
        weight = weight_full[shard].clone().requires_grad_()
        lp, ent = linear_logprobs_entropy(hidden, weight, targets, group=dist.group.WORLD, chunk=8192)
        grad_h, grad_w = torch.autograd.grad([lp, ent], [hidden, weight], [g_lp, g_ent])
        dist.all_reduce(grad_h)
        h64, w64 = hidden.detach().double().requires_grad_(), weight_full.double().requires_grad_()
        ref_lp, ref_ent = reference.linear_logprobs_entropy(h64, w64, targets)
        ref_h, ref_w = torch.autograd.grad([ref_lp, ref_ent], [h64, w64], [g_lp.double(), g_ent.double()])
        for got, want in ((lp, ref_lp), (ent, ref_ent), (grad_h, ref_h), (grad_w, ref_w[shard])):
            torch.testing.assert_close(got.double(), want, rtol=3e-3, atol=3e-3 * float(want.abs().max()))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_cuda_vocab_parallel_nccl(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_nccl_vocab_parallel_worker, args=(2, str(tmp_path / "store")), nprocs=2, join=True)


def test_cuda_linear_every_kind_of_piece():
    """A medium shape with head pieces, a tail stash and recomputed pieces, all several cuBLAS waves wide."""
    n, h, v = 2048, 256, 32000
    gen = torch.Generator(device="cuda").manual_seed(2)
    hidden = torch.randn(n, h, device="cuda", generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=gen) / 4).bfloat16().requires_grad_()
    targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
    g_lp, g_ent = torch.randn(n, device="cuda", generator=gen), torch.randn(n, device="cuda", generator=gen)
    plan = linear_module.plan_pieces(n, h, v, 2, chunk=1024, stash_bytes=n * 6000 * 2, keep=True, head=True)
    assert {p.kept for p in plan.forward} == {"head", "tail", ""}
    lp, ent = linear_logprobs_entropy(hidden, weight, targets, chunk=1024, stash_bytes=n * 6000 * 2)
    grad_h, grad_w = torch.autograd.grad([lp, ent], [hidden, weight], [g_lp, g_ent])
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref_lp, ref_ent = reference.linear_logprobs_entropy(h64, w64, targets)
    ref_h, ref_w = torch.autograd.grad([ref_lp, ref_ent], [h64, w64], [g_lp.double(), g_ent.double()])
    torch.testing.assert_close(lp.double(), ref_lp, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=3e-2, atol=3e-2)
    for got, want in ((grad_h, ref_h), (grad_w, ref_w)):
        torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2 * float(want.abs().max()))
