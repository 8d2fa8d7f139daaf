"""Where a decoding step of the embedded engine spends its GPU time: kernel time per category, from torch.profiler.

    python3 tools/profile_engine.py                    # Qwen3-0.6B preset, 64 prompts x 64 tokens, on a GPU
    python3 tools/profile_engine.py --new-tokens 512   # the bench's 64x512 shape

The table adds up device time per kernel category and divides by the decoding steps, once for the loop without
CUDA graphs and once with them (the engine's default on a GPU; the profiler still sees each replayed kernel). The
last lines set the kernels' time against each call's wall time: where the wall time per step is well above the
kernels' sum, the GPU idles between kernels (launches, host syncs), not in them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict

import torch

# Kernel-name fragment -> category, first match wins.
CATEGORIES = (
    ("_part_kernel", "decode attention"),
    ("_add_rms_norm", "fused add+norm"),
    ("_store_kv", "cache writes"),
    ("_merge_kernel", "decode attention"),
    ("_rms_norm", "fused norm"),
    ("_rotary", "fused rotary"),
    ("_silu_mul", "fused SiLU x up"),
    ("_plain_sample", "sampling"),
    ("gemm", "matmul"),
    ("gemv", "matmul"),
    ("cutlass", "matmul"),
    ("nvjet", "matmul"),
    ("softmax", "sampling"),
    ("scan", "sampling"),
    ("sort", "sampling"),
    ("topk", "sampling"),
    ("reduce", "reductions"),
    ("index", "indexing"),
    ("scatter", "indexing"),
    ("gather", "indexing"),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--modes", default="graph,eager", help="comma-separated: graph (CUDA graphs), eager")
    parser.add_argument("--names", type=int, default=0, help="also list the N kernels of most time, by name")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if not modes or set(modes) - {"graph", "eager"}:
        parser.error(f"--modes: comma-separated graph and/or eager, got {args.modes!r}")
    from transformers import AutoTokenizer

    from runtime.demo import task
    from runtime.demo.tiny_model import make_preset_model
    from runtime.engines import HFEngine, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_preset_model(args.preset, f"{tmp}/m", alphabet=task.ALPHABET, seed=0))
        tokenizer = AutoTokenizer.from_pretrained(path)
        engine = HFEngine(path, seed=0)
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in task.make_records(args.prompts, seed=0)]
    params = SamplingParams(max_new_tokens=args.new_tokens)
    steps = args.new_tokens
    for mode in modes:
        engine.cuda_graph = mode == "graph"
        totals, counts, wall, kernels = _profile(engine, prompts, params)
        print(f"{args.preset}, {args.prompts} prompts x {steps} tokens, {mode}; per decoding step:")
        print("| category | ms per step | kernels per step |")
        print("| --- | --- | --- |")
        for category, ms in sorted(totals.items(), key=lambda kv: -kv[1]):
            print(f"| {category} | {ms / steps:.3f} | {counts[category] / steps:.0f} |")
        busy = sum(totals.values()) / steps
        print(f"| total | {busy:.3f} | {sum(counts.values()) / steps:.0f} |")
        print(f"wall {wall * 1e3 / steps:.3f} ms per step ({mode}, profiled), kernels {busy:.3f} ms\n")
        if args.names:
            print("| kernel | category | ms per step | launches per step |")
            print("| --- | --- | --- | --- |")
            for name, (ms, launches) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[: args.names]:
                print(f"| {name[:90]} | {_category(name)} | {ms / steps:.3f} | {launches / steps:.1f} |")
            print()
    return 0


def _category(name: str) -> str:
    return next((c for fragment, c in CATEGORIES if fragment in name.lower()), "other elementwise")


def _profile(engine, prompts, params) -> tuple[dict[str, float], dict[str, int], float, dict[str, tuple[float, int]]]:
    """Kernel milliseconds and launches per category over one call (after a warm-up call), its wall seconds, and
    milliseconds and launches per kernel name."""
    engine.generate(prompts, params)
    torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        engine.generate(prompts, params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels: dict[str, tuple[float, int]] = {}
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        category = _category(event.key)
        totals[category] += event.device_time_total / 1e3
        counts[category] += event.count
        kernels[event.key] = (event.device_time_total / 1e3, event.count)
    return totals, counts, wall, kernels


if __name__ == "__main__":
    sys.exit(main())
