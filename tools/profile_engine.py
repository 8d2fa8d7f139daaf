"""Where a decoding step of the embedded engine spends its GPU time: kernel time per category, from torch.profiler.

    python3 tools/profile_engine.py                    # Qwen3-0.6B preset, 64 prompts x 64 tokens, on a GPU

The decode loop runs without CUDA graphs here (the profiler sees every kernel; inside a graph the kernels are the
same, only the launch gaps between them shrink), so the table adds up device time per kernel category and divides
by the decoding steps: what each part costs per step, against the step's memory floor.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict

import torch

# Kernel-name fragment -> category, first match wins.
CATEGORIES = (
    ("_part_kernel", "decode attention"),
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
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from runtime.demo import task
    from runtime.demo.tiny_model import make_preset_model
    from runtime.engines import HFEngine, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_preset_model(args.preset, f"{tmp}/m", alphabet=task.ALPHABET, seed=0))
        tokenizer = AutoTokenizer.from_pretrained(path)
        engine = HFEngine(path, seed=0)
    engine.cuda_graph = False
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in task.make_records(args.prompts, seed=0)]
    params = SamplingParams(max_new_tokens=args.new_tokens)
    engine.generate(prompts, params)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, params)
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.key.lower()
        category = next((c for fragment, c in CATEGORIES if fragment in name), "other elementwise")
        totals[category] += event.device_time_total / 1e3
        counts[category] += event.count
    steps = args.new_tokens
    print(f"{args.preset}, {args.prompts} prompts x {steps} tokens, no graph; per decoding step:")
    print("| category | ms per step | kernels per step |")
    print("| --- | --- | --- |")
    for category, ms in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"| {category} | {ms / steps:.3f} | {counts[category] / steps:.0f} |")
    print(f"| total | {sum(totals.values()) / steps:.3f} | {sum(counts.values()) / steps:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
