"""The embedded engine's rollout on one device: seconds, generated tokens/s and peak memory per decoder and size.

    python3 tools/bench_engine.py           # Qwen3-0.6B preset; 64x512, 64x1024, 256x1024; graph, eager, hf-generate
    python3 tools/bench_engine.py --preset tiny --sizes 8x16 --decoders eager,hf-generate    # a CPU smoke run

Decoders: ``graph`` is the engine as it runs on a GPU (static KV cache, the step's forward replayed as a CUDA graph),
``graph-compile`` the same with the step's forward through ``torch.compile`` before capture, ``eager`` the same
loop without the graph, ``hf-generate`` transformers' plain ``generate`` on the same model with no log-probs (a
baseline, not an engine). The random-init preset never emits EOS, so every response runs to its length. Each
(decoder, size) is run once untimed ("first call", which compiles for graph-compile), then timed (``--repeats``,
median). Peak memory is the CUDA allocator's, reset per size; "beyond weights" subtracts the memory held before.
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
    parser.add_argument("--sizes", default="64x512,64x1024,256x1024", help="comma-separated PROMPTSxNEW_TOKENS")
    parser.add_argument("--decoders", default="graph,eager,hf-generate")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from runtime.demo import task
    from runtime.demo.tiny_model import make_preset_model, make_tiny_model
    from runtime.engines import HFEngine, SamplingParams

    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.preset == "tiny":
            path = str(make_tiny_model(f"{tmp}/m", alphabet=task.ALPHABET, seed=0))
        else:
            path = str(make_preset_model(args.preset, f"{tmp}/m", alphabet=task.ALPHABET, seed=0))
        tokenizer = AutoTokenizer.from_pretrained(path)
        engine = HFEngine(path, seed=0)
        cuda = engine.device.type == "cuda"
        records = task.make_records(max(n for n, _ in sizes), seed=0)
        for decoder in args.decoders.split(","):
            engine.cuda_graph = cuda and decoder.startswith("graph")
            engine.compile = decoder == "graph-compile"
            for n_prompts, new_tokens in sizes:
                prompts = [tokenizer(r["prompt"])["input_ids"] for r in records[:n_prompts]]
                run = _runner(engine, decoder, prompts, tokenizer)
                try:
                    start = time.perf_counter()
                    run(SamplingParams(max_new_tokens=new_tokens))  # warm-up: compiles, for graph-compile
                    first = time.perf_counter() - start
                    if cuda:
                        torch.cuda.synchronize()
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated() if cuda else 0
                    times, produced = [], 0
                    for _ in range(args.repeats):
                        start = time.perf_counter()
                        produced = run(SamplingParams(max_new_tokens=new_tokens))
                        if cuda:
                            torch.cuda.synchronize()
                        times.append(time.perf_counter() - start)
                    seconds = statistics.median(times)
                    peak = torch.cuda.max_memory_allocated() if cuda else float("nan")
                    row = (
                        decoder,
                        f"{n_prompts}x{new_tokens}",
                        f"{first:.2f}",
                        f"{seconds:.2f}",
                        f"{produced / seconds:.0f}",
                        f"{peak / 2**30:.1f}",
                        f"{(peak - before) / 2**30:.1f}",
                    )
                except torch.OutOfMemoryError:
                    row = (decoder, f"{n_prompts}x{new_tokens}", "OOM", "", "", "", "")
                    if cuda:
                        torch.cuda.empty_cache()
                rows.append(row)
                print(row, flush=True)
    print(f"\n{args.preset}, device {engine.device}, {engine.weight_dtype()}")
    print(
        "| decoder | prompts x new tokens | first call s | seconds | generated tok/s | peak GiB | beyond weights GiB |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(str(x) for x in row) + " |")
    return 0


def _runner(engine, decoder: str, prompts: list[list[int]], tokenizer):
    """A call that generates for ``prompts`` and returns the number of tokens generated."""
    if decoder in ("graph", "graph-compile", "eager"):
        return lambda params: sum(len(g.token_ids) for g in engine.generate(prompts, params))
    if decoder != "hf-generate":
        raise SystemExit(f"--decoders: unknown decoder {decoder!r} (graph, eager, hf-generate)")
    width = max(map(len, prompts))
    pad = engine.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=engine.device)
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    model = engine.model

    @torch.no_grad()
    def run(params) -> int:
        model.set_attn_implementation("sdpa")
        try:
            out = model.generate(
                input_ids=ids,
                attention_mask=mask.to(engine.device),
                do_sample=True,
                top_k=0,
                top_p=1.0,
                max_new_tokens=params.max_new_tokens,
                min_new_tokens=params.max_new_tokens,
                pad_token_id=pad,
            )
        finally:
            from runtime.engines.decode import ATTENTION

            model.set_attn_implementation(ATTENTION)
        return (out.shape[1] - width) * len(prompts)

    return run


if __name__ == "__main__":
    sys.exit(main())
