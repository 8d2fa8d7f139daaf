"""Speed and memory of rlcore.kernels on a CUDA GPU beside naive torch, torch.compile and Liger-Kernel.

Prints one table. For logits [N, V] (bf16): forward + backward with entropy (log-prob only for Liger), the ratio to
the HBM floor (three passes over the bf16 logits: the forward read, the backward read and write, at the measured
device-to-device copy bandwidth) and the extra peak memory (peak allocated during the step minus what was allocated
before it: logits, targets and upstream gradients; a freshly allocated d(logits) counts as extra). For the fused
LM head [N, H, V]: the same step; extra memory there excludes the gradients of hidden and weight, which every method
must return, and the floor is 3 matmuls (logits, d(hidden), d(weight)) at the measured bf16 matmul rate. The RL loss
inside the LM head (``linear_rl_loss``, PPO + TIS + low_var_kl + entropy bonus over a [16, 1024] batch) is timed the
same way beside ``linear_logprobs_entropy`` + ``rl_loss`` and Liger's fused linear cross-entropy, against a measured
floor: its three matmuls over the whole batch, back to back (on a power-capped H100 these run at lower clocks than
the short matmul that gives the rate above; that extrapolated floor is printed too). Then its numerics: the weight
gradient's bf16 accumulation against a float32 accumulator, and bf16-rounded against float32 logits.

Usage: python tools/bench_kernels.py [--quick] [--sweep] [--fused-loss] [--breakdown]
(Liger is optional: the ``bench`` extra)
"""

import argparse
import functools
import gc
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tensordict import TensorDict  # noqa: E402

from rlcore import keys  # noqa: E402
from rlcore.kernels import linear as linear_module  # noqa: E402
from rlcore.kernels import linear_logprobs_entropy, linear_rl_loss, logprobs_entropy  # noqa: E402
from rlcore.kernels import logprobs as logprobs_module  # noqa: E402
from rlcore.kernels.linear import DEFAULT_CHUNK  # noqa: E402
from rlcore.losses import LossConfig, rl_loss  # noqa: E402

GIB = 1024**3
LOGIT_SHAPES = [(4096, 151936), (16384, 151936), (16384, 128256)]
LINEAR_SHAPE = (16384, 4096, 151936)


def median_ms(fn: Callable[[], object], rep_ms: int = 400) -> float:
    return float(triton.testing.do_bench(fn, warmup=50, rep=rep_ms, return_mode="median"))


def extra_peak_gib(fn: Callable[[], object], exclude_bytes: int = 0) -> float:
    """Peak memory allocated while ``fn`` runs, above what was allocated before it (minus ``exclude_bytes``)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before - exclude_bytes
    del result
    return peak / GIB


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def matmul_rate(n: int, h: int, cols: int, repeats: int = 1) -> float:
    """bf16 FLOP/s of ``[n, h] @ [h, cols]``, ``repeats`` back to back per timed call: the floor of the fused linear
    op is its matmuls at the rate of one; many show the clock a power-capped GPU holds through back-to-back
    matmuls."""
    a = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(cols, h, device="cuda", dtype=torch.bfloat16)

    def matmuls():
        for _ in range(repeats):
            torch.mm(a, b.T)

    ms = median_ms(matmuls, rep_ms=400 if repeats == 1 else 2000)
    return 2 * n * h * cols * repeats / (ms * 1e-3)


def naive_logprobs_entropy(logits, targets):
    log_p = torch.log_softmax(logits.float(), dim=-1)
    log_probs = log_p.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return log_probs, entropy


def logits_methods():
    compiled = torch.compile(naive_logprobs_entropy, dynamic=False)
    methods = {
        "rlcore (in-place bwd)": lambda x, t: logprobs_entropy(x, t, inplace_backward=True),
        "rlcore": lambda x, t: logprobs_entropy(x, t),
        "naive torch fp32": naive_logprobs_entropy,
        "torch.compile": compiled,
    }
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy

        methods["Liger CE (log-prob only)"] = lambda x, t: (-liger_cross_entropy(x, t, reduction="sum"), None)
    except ImportError as err:
        print(f"Liger-Kernel not available ({err}); skipped", file=sys.stderr)
    return methods


def logits_step(method, logits, targets, g_lp, g_ent):
    """One forward + backward; returns d(logits). Liger computes its gradient in the forward, in place."""

    def step():
        x = logits.detach().requires_grad_()
        log_probs, entropy = method(x, targets)
        if entropy is None:
            return torch.autograd.grad(log_probs, x)[0]
        return torch.autograd.grad([log_probs, entropy], x, [g_lp, g_ent])[0]

    return step


def bench_logits(rows, bandwidth, quick):
    methods = logits_methods()
    shapes = LOGIT_SHAPES[1:2] if quick else LOGIT_SHAPES
    for n, v in shapes:
        floor_ms = 3 * n * v * 2 / bandwidth * 1e3
        logits = torch.randn(n, v, device="cuda", dtype=torch.bfloat16) * 4
        targets = torch.randint(0, v, (n,), device="cuda")
        g_lp, g_ent = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
        for name, method in methods.items():
            step = logits_step(method, logits, targets, g_lp, g_ent)
            try:
                mem = extra_peak_gib(step)
                ms = median_ms(step)
            except torch.OutOfMemoryError:
                rows.append((f"[{n}, {v}] bf16", name, "OOM", "", ""))
                continue
            finally:
                gc.collect()
                torch.cuda.empty_cache()
            rows.append((f"[{n}, {v}] bf16", name, f"{ms:.2f}", f"{ms / floor_ms:.2f}x", f"{mem:.2f}"))
        rows.append((f"[{n}, {v}] bf16", "HBM floor (3 passes)", f"{floor_ms:.2f}", "1.00x", ""))
        del logits
        torch.cuda.empty_cache()


def linear_methods():
    def naive(hidden, weight, targets):
        return naive_logprobs_entropy(hidden @ weight.T, targets)

    methods = {
        "rlcore fused linear": lambda h, w, t: linear_logprobs_entropy(h, w, t),
        "rlcore fused linear, no stash": lambda h, w, t: linear_logprobs_entropy(h, w, t, stash_bytes=0),
        "naive matmul + fp32 log_softmax": naive,
    }
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        methods["Liger FLCE (log-prob only)"] = lambda h, w, t: (
            -liger_fused_linear_cross_entropy(h, w, t, reduction="sum"),
            None,
        )
    except ImportError as err:
        print(f"Liger-Kernel not available ({err}); skipped", file=sys.stderr)
    return methods


def linear_step(method, hidden, weight, targets, g_lp, g_ent):
    def step():
        h = hidden.detach().requires_grad_()
        w = weight.detach().requires_grad_()
        log_probs, entropy = method(h, w, targets)
        if entropy is None:
            return torch.autograd.grad(log_probs, [h, w])
        return torch.autograd.grad([log_probs, entropy], [h, w], [g_lp, g_ent])

    return step


def bench_linear(rows, rate, methods=None, label=None):
    n, h, v = LINEAR_SHAPE
    floor_ms = 3 * 2 * n * h * v / rate * 1e3
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(v, h, device="cuda", dtype=torch.bfloat16) / h**0.5 * 4
    targets = torch.randint(0, v, (n,), device="cuda")
    g_lp, g_ent = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    grads_bytes = (hidden.numel() + weight.numel()) * 2
    for name, method in (methods or linear_methods()).items():
        step = linear_step(method, hidden, weight, targets, g_lp, g_ent)
        try:
            mem = extra_peak_gib(step, exclude_bytes=grads_bytes)
            ms = median_ms(step, rep_ms=1500)
        except torch.OutOfMemoryError:
            rows.append((label or f"[{n}, {h}, {v}] bf16", name, "OOM", "", ""))
            continue
        finally:
            gc.collect()
            torch.cuda.empty_cache()
        rows.append((label or f"[{n}, {h}, {v}] bf16", name, f"{ms:.1f}", f"{ms / floor_ms:.2f}x", f"{mem:.2f}"))
    rows.append((label or f"[{n}, {h}, {v}] bf16", "matmul floor (3 matmuls)", f"{floor_ms:.1f}", "1.00x", ""))


FUSED_LOSS_CONFIG = LossConfig(
    eps_clip_high=0.28,
    use_tis=True,
    use_kl_loss=True,
    kl_loss_coef=0.01,
    kl_loss_type="low_var_kl",
    entropy_coef=0.001,
)


def loss_batch(n: int, seq_len: int = 1024) -> TensorDict:
    """A [n / seq_len, seq_len] batch: every token valid, log-probs near a typical policy's."""
    batch = n // seq_len
    base = -torch.rand(batch, seq_len, device="cuda") * 2

    def near(scale):
        return base + scale * torch.randn(batch, seq_len, device="cuda")

    return TensorDict(
        {
            keys.MASK: torch.ones(batch, seq_len, dtype=torch.bool, device="cuda"),
            keys.ADVANTAGES: torch.randn(batch, seq_len, device="cuda"),
            keys.OLD_LOG_PROBS: base,
            keys.ROLLOUT_LOG_PROBS: near(0.05),
            keys.REF_LOG_PROBS: near(0.1),
        },
        batch_size=[batch],
    )


def unfused_rl_loss(hidden, weight, targets, td, cfg):
    log_probs, entropy = linear_logprobs_entropy(hidden, weight, targets)
    full = td.clone(recurse=False)
    full.set(keys.LOG_PROBS, log_probs.view(td[keys.MASK].shape))
    full.set(keys.ENTROPY, entropy.view(td[keys.MASK].shape))
    return rl_loss(full, cfg)[0]


def fused_loss(hidden, weight, targets, *, td, cfg, **options):
    return linear_rl_loss(hidden, weight, targets, td, cfg, **options)[0]


def fused_loss_methods(td, cfg):
    # As the torch backend calls it: the per-sample lengths from the host, so no host sync before the first matmul.
    lengths = td[keys.MASK].sum(-1).tolist()
    counted = functools.partial(fused_loss, td=td, cfg=cfg)
    fused = functools.partial(counted, seq_lengths=lengths)
    methods = {
        "rlcore linear_rl_loss (fused)": fused,
        "linear_rl_loss, lengths counted on the GPU": counted,
        "linear_rl_loss, chunks of 2048 rows": functools.partial(fused, chunk_bytes=2048 * LINEAR_SHAPE[2] * 2),
        "linear_rl_loss, fp32 d(weight) accumulator": functools.partial(fused, grad_weight_dtype=torch.float32),
        "linear_rl_loss, fp32 logits": functools.partial(fused, float32_logits=True),
        "linear_logprobs_entropy + rl_loss": lambda h, w, t: unfused_rl_loss(h, w, t, td, cfg),
    }
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        methods["Liger FLCE (log-prob only)"] = lambda h, w, t: liger_fused_linear_cross_entropy(
            h, w, t, reduction="sum"
        )
    except ImportError as err:
        print(f"Liger-Kernel not available ({err}); skipped", file=sys.stderr)
    return methods


def bench_fused_loss(rows, rate):
    """The fused loss beside its alternatives. Its floor is measured: the op's three matmuls over the whole batch, back
    to back, timed as the op is (``three_matmuls``). Run back to back, matmuls hold an H100 at its power cap at lower
    clocks than one short matmul does, so ``3 x 2NHV / rate`` (``rate`` from one 2 ms matmul at a time) is a lower
    figure no sustained run reaches; it is printed too, with the ratios against it."""
    n, h, v = LINEAR_SHAPE
    label = f"loss [{n}, {h}, {v}] bf16"
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(v, h, device="cuda", dtype=torch.bfloat16) / h**0.5 * 4
    targets = torch.randint(0, v, (n,), device="cuda")
    td = loss_batch(n)
    floor_ms = median_ms(functools.partial(three_matmuls, hidden, weight), rep_ms=1500)
    gc.collect()
    torch.cuda.empty_cache()
    extrapolated_ms = 3 * 2 * n * h * v / rate * 1e3
    grads_bytes = (hidden.numel() + weight.numel()) * 2
    fused_ms = queued_ms = None
    methods = fused_loss_methods(td, FUSED_LOSS_CONFIG)
    first_name = next(iter(methods))
    for name, method in methods.items():

        def step(method=method):
            hh = hidden.detach().requires_grad_()
            ww = weight.detach().requires_grad_()
            return torch.autograd.grad(method(hh, ww, targets), [hh, ww])

        try:
            mem = extra_peak_gib(step, exclude_bytes=grads_bytes)
            ms = median_ms(step, rep_ms=1500)
            if name == first_name:
                fused_ms, queued_ms = ms, queued_median_ms(step)
        except torch.OutOfMemoryError:
            rows.append((label, name, "OOM", "", ""))
            continue
        except Exception as err:  # one failing method must not cost the rest of the table
            rows.append((label, name, f"error: {type(err).__name__}: {str(err)[:60]}", "", ""))
            continue
        finally:
            gc.collect()
            torch.cuda.empty_cache()
        rows.append((label, name, f"{ms:.1f}", f"{ms / floor_ms:.2f}x", f"{mem:.2f}"))
        if name == first_name:
            rows.append(
                (label, "  the same, queued behind GPU work", f"{queued_ms:.1f}", f"{queued_ms / floor_ms:.2f}x", "")
            )
    ms = median_ms(functools.partial(chunked_matmuls, hidden, weight, 4096), rep_ms=1500)
    rows.append((label, "3 matmuls alone, chunks of 4096 rows", f"{ms:.1f}", f"{ms / floor_ms:.2f}x", ""))
    rows.append((label, "3 matmuls, whole batch (measured floor)", f"{floor_ms:.1f}", "1.00x", ""))
    rows.append(
        (
            label,
            "3 x one short matmul's time (extrapolated)",
            f"{extrapolated_ms:.1f}",
            f"{extrapolated_ms / floor_ms:.2f}x",
            "",
        )
    )
    sustained = matmul_rate(n, h, DEFAULT_CHUNK, repeats=40)
    notes = [
        f"against the extrapolated floor ({extrapolated_ms:.1f} ms at {rate / 1e12:.0f} TFLOP/s): fused "
        + (f"{fused_ms / extrapolated_ms:.3f}x, queued {queued_ms / extrapolated_ms:.3f}x" if fused_ms else "n/a")
        + f"; one matmul of that shape 40 times per call: {sustained / 1e12:.0f} TFLOP/s"
    ]
    try:
        return (
            notes + fused_loss_numerics(hidden, weight, targets, td) + fused_loss_profile(hidden, weight, targets, td)
        )
    except Exception as err:
        return notes + [f"numerics failed: {type(err).__name__}: {err}"]


def three_matmuls(hidden, weight):
    """The fused loss's three matmuls over the whole batch, into fresh outputs: logits, d(hidden), d(weight)."""
    logits = hidden @ weight.T
    return logits @ weight, logits.T @ hidden


def queued_median_ms(step, sleep_ms: float = 3.0) -> float:
    """``step``'s time with the GPU kept busy while the host queues it (as behind a model's forward in training): the
    median of a GPU sleep followed by ``step``, minus the sleep's own."""
    probe = 1_000_000  # cycles; scaled to sleep_ms by its measured time (the clock varies, and NVML may be absent)
    cycles = int(probe * sleep_ms / median_ms(lambda: torch.cuda._sleep(probe)))
    sleep_alone = median_ms(lambda: torch.cuda._sleep(cycles))
    return median_ms(lambda: (torch.cuda._sleep(cycles), step()), rep_ms=1500) - sleep_alone


def fused_loss_profile(hidden, weight, targets, td) -> list[str]:
    """Where one fused step's GPU time goes: CUDA time per kernel name over 3 steps, largest first."""
    hh, ww = hidden.detach().requires_grad_(), weight.detach().requires_grad_()

    def step():
        return torch.autograd.grad(linear_rl_loss(hh, ww, targets, td, FUSED_LOSS_CONFIG)[0], [hh, ww])

    return ["profile of linear_rl_loss:", *kernel_profile(step, steps=3)]


def kernel_profile(step, steps: int = 5, top: int = 8) -> list[str]:
    """GPU time per kernel name of ``step`` (averaged over ``steps`` runs), largest first, and the wall time."""
    step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)
    busy = sum(e.device_time_total for e in events) / steps / 1e3
    lines = [f"  wall {start.elapsed_time(end) / steps:.3f} ms per step, GPU kernels {busy:.3f} ms"]
    for event in events[:top]:
        ms = event.device_time_total / steps / 1e3
        lines.append(f"  {ms:8.3f} ms {event.count / steps:5.1f}x  {event.key[:80]}")
    return lines


def _forward_backward_ms(logits, targets, g_lp, g_ent) -> tuple[float, float]:
    x = logits.detach().requires_grad_()
    fwd = median_ms(lambda: logprobs_entropy(x, targets))
    lp, ent = logprobs_entropy(x, targets)
    bwd = median_ms(lambda: torch.autograd.grad([lp, ent], x, [g_lp, g_ent], retain_graph=True))
    return fwd, bwd


def breakdown(rate: float, bandwidth: float) -> list[str]:
    """Where the time of the [4096, 151936] logits op and of the fused loss's matmuls goes."""
    lines = []
    n, v = LOGIT_SHAPES[0]
    floor_ms = 3 * n * v * 2 / bandwidth * 1e3
    logits = torch.randn(n, v, device="cuda", dtype=torch.bfloat16) * 4
    targets = torch.randint(0, v, (n,), device="cuda")
    g_lp, g_ent = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    step = logits_step(lambda x, t: logprobs_entropy(x, t, inplace_backward=True), logits, targets, g_lp, g_ent)
    lines.append(f"logits op [{n}, {v}]: {median_ms(step):.3f} ms (floor {floor_ms:.3f} ms)")
    lines += kernel_profile(step)
    fwd, bwd = _forward_backward_ms(logits, targets, g_lp, g_ent)
    lines.append(f"  forward alone {fwd:.3f} ms, backward alone {bwd:.3f} ms (1 pass floor {floor_ms / 3:.3f} ms)")
    del logits
    gc.collect()
    torch.cuda.empty_cache()
    rows, h, v = 4096, LINEAR_SHAPE[1], LINEAR_SHAPE[2]
    one_floor = 2 * rows * h * v / rate * 1e3
    hidden = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(v, h, device="cuda", dtype=torch.bfloat16)
    chunk = torch.randn(rows, v, device="cuda", dtype=torch.bfloat16)
    grad_hidden, grad_weight = torch.empty_like(hidden), torch.randn_like(weight)
    variants = {
        "logits = hidden @ weight^T": lambda: torch.mm(hidden, weight.T, out=chunk),
        "d(hidden) = dlogits @ weight": lambda: torch.mm(chunk, weight, out=grad_hidden),
        "d(hidden)^T = weight^T @ dlogits^T": lambda: torch.mm(weight.T, chunk.T, out=grad_hidden.T),
        "d(weight) = dlogits^T @ hidden": lambda: torch.mm(chunk.T, hidden, out=grad_weight),
        "d(weight) += dlogits^T @ hidden": lambda: grad_weight.addmm_(chunk.T, hidden),
        "d(weight)^T += hidden^T @ dlogits": lambda: grad_weight.T.addmm_(hidden.T, chunk),
    }
    lines.append(f"one matmul of a {rows}-row chunk, floor {one_floor:.2f} ms at {rate / 1e12:.0f} TFLOP/s:")
    for name, fn in variants.items():
        ms = median_ms(fn, rep_ms=800)
        lines.append(f"  {name:40s} {ms:7.2f} ms  {ms / one_floor:.3f}x")
    return lines


def chunked_matmuls(hidden, weight, chunk_rows):
    """The fused loss's three matmuls and nothing else: logits, d(hidden), d(weight) accumulated in bf16."""
    grad_hidden, grad_weight = torch.empty_like(hidden), torch.empty_like(weight)
    logits = torch.empty(chunk_rows, weight.shape[0], device=hidden.device, dtype=hidden.dtype)
    for start in range(0, hidden.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        torch.mm(hidden[rows], weight.T, out=logits)
        torch.mm(logits, weight, out=grad_hidden[rows])
        if start == 0:
            torch.mm(logits.T, hidden[rows], out=grad_weight)
        else:
            grad_weight.addmm_(logits.T, hidden[rows])
    return grad_hidden, grad_weight


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def fused_loss_numerics(hidden, weight, targets, td) -> list[str]:
    """The weight gradient's accumulation error and the logit-precision gap, as lines to print under the table."""
    cfg = FUSED_LOSS_CONFIG

    def grads(fn):
        hh, ww = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        loss = fn(hh, ww)
        return (loss.detach(), *torch.autograd.grad(loss, [hh, ww]))

    bf16_acc = grads(lambda hh, ww: linear_rl_loss(hh, ww, targets, td, cfg)[0])
    fp32_acc = grads(lambda hh, ww: linear_rl_loss(hh, ww, targets, td, cfg, grad_weight_dtype=torch.float32)[0])
    unfused = grads(lambda hh, ww: unfused_rl_loss(hh, ww, targets, td, cfg))
    lines = [
        "d(weight), bf16 accumulation over 4 chunks vs float32 accumulator: "
        f"{_relative(bf16_acc[2], fp32_acc[2]):.2e} relative (Frobenius)",
        f"fused vs unfused: loss {abs(float(bf16_acc[0] - unfused[0])) / abs(float(unfused[0])):.2e} relative, "
        f"d(hidden) {_relative(bf16_acc[1], unfused[1]):.2e}, d(weight) {_relative(bf16_acc[2], unfused[2]):.2e}; "
        f"grad norms {float(bf16_acc[2].float().norm()) / float(unfused[2].float().norm()):.5f}x (weight), "
        f"{float(bf16_acc[1].float().norm()) / float(unfused[1].float().norm()):.5f}x (hidden)",
    ]
    del bf16_acc, fp32_acc, unfused
    with torch.no_grad():
        rounded, exact = [], []
        for start in range(0, hidden.shape[0], 2048):
            rows = slice(start, start + 2048)
            rounded.append(linear_logprobs_entropy(hidden[rows], weight, targets[rows], with_entropy=False)[0])
            logits = torch.mm(hidden[rows], weight.T, out_dtype=torch.float32)
            exact.append(logprobs_entropy(logits, targets[rows], with_entropy=False)[0])
        gap = (torch.cat(rounded) - torch.cat(exact)).abs()
    lines.append(
        f"log-prob, bf16-rounded vs float32 logits: max |diff| {float(gap.max()):.3f} nats, "
        f"mean {float(gap.mean()):.4f} (logits std {float((hidden[:256] @ weight.T).float().std()):.1f})"
    )
    return lines


def sweep_logits_config(rows, bandwidth, block, warps):
    n, v = LOGIT_SHAPES[1]
    floor_ms = 3 * n * v * 2 / bandwidth * 1e3
    x = (torch.randn(n, v, device="cuda", dtype=torch.bfloat16) * 4).requires_grad_()
    targets = torch.randint(0, v, (n,), device="cuda")
    g_lp, g_ent = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    default = logprobs_module._launch_config
    logprobs_module._launch_config = lambda vocab, size, kind: (block, warps)
    try:
        lp, ent = logprobs_entropy(x, targets)
        fwd = median_ms(lambda: logprobs_entropy(x, targets))
        bwd = median_ms(lambda: torch.autograd.grad([lp, ent], x, [g_lp, g_ent], retain_graph=True))
    finally:
        logprobs_module._launch_config = default
    total = fwd + bwd
    rows.append(
        (
            f"sweep [{n}, {v}]",
            f"BLOCK_V={block} warps={warps}",
            f"{total:.2f}",
            f"{total / floor_ms:.2f}x",
            f"fwd {fwd:.2f} bwd {bwd:.2f}",
        )
    )


def sweep_segments(rows, bandwidth):
    """Each pass alone with its rows split into 1 to 8 column segments (``logprobs.SPLIT_PROGRAMS``), per row count."""
    for n in (2048, 4096, 8192, 16384):
        _sweep_segments_at(rows, bandwidth, n, LOGIT_SHAPES[0][1])
        gc.collect()
        torch.cuda.empty_cache()


def _sweep_segments_at(rows, bandwidth, n, v):
    default = logprobs_module._segments
    x = torch.randn(n, v, device="cuda", dtype=torch.bfloat16) * 4
    targets = torch.randint(0, v, (n,), device="cuda")
    lse, mu, g_lp, g_ent = torch.randn(4, n, device="cuda")
    stats_pass = functools.partial(logprobs_module.triton_partial_stats, x, targets, 0, 1.0, True)
    grad_pass = functools.partial(logprobs_module.triton_logits_grad, x, targets, 0, lse, mu, g_lp, g_ent, 1.0, x)
    floor_ms = n * v * 2 / bandwidth * 1e3  # one pass over the logits
    blocks = {kind: logprobs_module._launch_config(v, x.element_size(), kind)[0] for kind in ("stats", "grad")}
    for count in (1, 2, 3, 4, 6, 8):
        # The count asked for; a pass runs whole blocks per segment, so it may get a few fewer (printed).
        got = {kind: _fixed_segments(n, v, block, 0, count=count)[0] for kind, block in blocks.items()}
        logprobs_module._segments = functools.partial(_fixed_segments, count=count)
        try:
            stats, grad = median_ms(stats_pass), median_ms(grad_pass)
        finally:
            logprobs_module._segments = default
        rows.append(
            (
                f"sweep [{n}, {v}]",
                f"segments per row: stats {got['stats']}, grad {got['grad']}",
                f"stats {stats:.3f}",
                f"{stats / floor_ms:.3f}x",
                f"grad {grad:.3f} ms, {grad / (2 * floor_ms):.3f}x",
            )
        )


def _fixed_segments(rows, vocab, block, programs, *, count):
    blocks = triton.cdiv(vocab, block)
    per_segment = triton.cdiv(blocks, count)
    return triton.cdiv(blocks, per_segment), per_segment * block


def sweep(rows, bandwidth, rate):
    """Launch configurations and row splits of the logits kernels, and chunk / stash / piece sizes of the fused
    linear op."""
    for block, warps in [(2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)]:
        sweep_logits_config(rows, bandwidth, block, warps)
        gc.collect()
        torch.cuda.empty_cache()
    sweep_segments(rows, bandwidth)
    configs = {}
    for chunk, stash, split in [(12288, 0, 2), (12288, 1.5, 2), (12288, 1.85, 2), (8192, 1.75, 2)] + [
        (12288, 1.75, split) for split in (1, 2, 3)
    ]:
        configs[f"chunk={chunk} stash={stash}GiB split={split}"] = functools.partial(
            _linear_with_split, chunk=chunk, stash_bytes=int(stash * GIB), split=split
        )
    bench_linear(rows, rate, methods=configs, label="sweep linear")


def _linear_with_split(hidden, weight, targets, *, chunk, stash_bytes, split):
    default = linear_module.DEFAULT_SPLIT
    linear_module.DEFAULT_SPLIT = split
    try:
        return linear_logprobs_entropy(hidden, weight, targets, chunk=chunk, stash_bytes=stash_bytes)
    finally:
        linear_module.DEFAULT_SPLIT = default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only [16384, 151936] and the fused linear op")
    parser.add_argument("--sweep", action="store_true", help="also sweep launch configurations")
    parser.add_argument("--no-linear", action="store_true")
    parser.add_argument("--fused-loss", action="store_true", help="only the RL loss inside the LM head")
    parser.add_argument(
        "--breakdown", action="store_true", help="only where the time goes: the [4096, V] logits op, one matmul each"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    # Measured at the op's own matmul shape, a [N, H] x [H, chunk] block of the vocabulary.
    rate = matmul_rate(LINEAR_SHAPE[0], LINEAR_SHAPE[1], DEFAULT_CHUNK)
    rows: list[tuple[str, str, str, str, str]] = []
    notes: list[str] = []
    if args.breakdown:
        notes = breakdown(rate, bandwidth)
    elif args.fused_loss:
        notes = bench_fused_loss(rows, rate)
    else:
        if args.sweep:
            sweep(rows, bandwidth, rate)
        bench_logits(rows, bandwidth, args.quick)
        if not args.no_linear:
            bench_linear(rows, rate)
            notes = bench_fused_loss(rows, rate)
    print(
        f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bandwidth / 1e12:.2f} TB/s "
        f"(read + write), bf16 matmul {rate / 1e12:.0f} TFLOP/s"
    )
    header = ("shape", "method", "fwd+bwd ms", "vs floor", "extra GiB")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(5)]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))
    for line in notes:
        print(line)


if __name__ == "__main__":
    main()
