"""The embedded engine's rollout on one device: seconds, generated tokens/s and peak memory per (prompts x new tokens).

    python3 tools/bench_engine.py                       # Qwen3-0.6B preset, 64 prompts x 512 and 1024 new tokens
    python3 tools/bench_engine.py --preset tiny --prompts 8 --new-tokens 16    # a smoke run on the CPU

The random-init preset never emits EOS, so every response runs to ``--new-tokens``. Each size is generated once to
warm up and then timed (``--repeats``, median). Peak memory is the CUDA allocator's, reset per size.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen3-0.6b", help="a tools/make_tiny_model.py preset, or tiny")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", default="512,1024", help="comma-separated response lengths")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from runtime.demo import task
    from runtime.demo.tiny_model import make_preset_model, make_tiny_model
    from runtime.engines import HFEngine, SamplingParams

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.preset == "tiny":
            path = str(make_tiny_model(f"{tmp}/m", alphabet=task.ALPHABET, seed=0))
        else:
            path = str(make_preset_model(args.preset, f"{tmp}/m", alphabet=task.ALPHABET, seed=0))
        tokenizer = AutoTokenizer.from_pretrained(path)
        engine = HFEngine(path, seed=0)
        prompts = [tokenizer(r["prompt"])["input_ids"] for r in task.make_records(args.prompts, seed=0)]
        cuda = engine.device.type == "cuda"
        for new_tokens in (int(n) for n in args.new_tokens.split(",")):
            params = SamplingParams(max_new_tokens=new_tokens)
            try:
                engine.generate(prompts, SamplingParams(max_new_tokens=4))  # warm-up
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                times, produced = [], 0
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    out = engine.generate(prompts, params)
                    if cuda:
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
                    produced = sum(len(g.token_ids) for g in out)
                seconds = statistics.median(times)
                peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
                rows.append((new_tokens, f"{seconds:.2f}", f"{produced / seconds:.0f}", f"{peak:.1f}"))
            except torch.OutOfMemoryError:
                rows.append((new_tokens, "OOM", "", ""))
                if cuda:
                    torch.cuda.empty_cache()
            print(rows[-1], flush=True)
    print(f"\n{args.preset}, {args.prompts} prompts, device {engine.device}")
    print("| new tokens | seconds | generated tok/s | peak GiB |\n| --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(str(x) for x in row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
