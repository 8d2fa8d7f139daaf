"""The embedded engine's rollout on one device: seconds, generated tokens/s and peak memory per decoder and size.

    python3 tools/bench_engine.py           # Qwen3-0.6B preset; 64x512, 64x1024, 256x1024; graph, eager, hf-generate
    python3 tools/bench_engine.py --preset tiny --sizes 8x16 --decoders eager,hf-generate    # a CPU smoke run
    python3 tools/bench_engine.py --sizes 256x1024 --decoders graph --max-running-requests all,64 --stop-fraction 0.004

Decoders: ``graph`` is the engine as it runs on a GPU (static KV cache, the step's forward replayed as a CUDA graph),
``graph-compile`` the same with the step's forward through ``torch.compile`` before capture, ``eager`` the same
loop without the graph, ``hf-generate`` transformers' plain ``generate`` on the same model with no log-probs (a
baseline, not an engine). The random-init preset never emits EOS, so every response runs to its length. Each
(decoder, size) is run once untimed ("first call", which compiles for graph-compile), then timed (``--repeats``,
median). Peak memory is the CUDA allocator's, reset per size; "beyond weights" subtracts the memory held before.

Continuous refill: ``--max-running-requests`` lists slot counts for the engine decoders (``all``: every prompt at
once, the default); ``--stop-fraction F`` makes the first ``F x vocab`` token ids stop ids, so that each draw of the
near-uniform random model ends its response with probability about ``F`` and lengths spread (mean about ``1 / F``),
which is where refill pays. The table reports the mean response length.
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
    parser.add_argument(
        "--max-running-requests", default="all", help="comma-separated slot counts (all: every prompt at once)"
    )
    parser.add_argument("--stop-fraction", type=float, default=0.0, help="share of the vocabulary made stop ids")
    args = parser.parse_args(argv)
    try:
        slot_counts = [None if x == "all" else int(x) for x in args.max_running_requests.split(",")]
    except ValueError:
        parser.error(f"--max-running-requests: comma-separated ints or 'all', got {args.max_running_requests!r}")
    if any(n is not None and n < 1 for n in slot_counts):
        parser.error("--max-running-requests: slot counts must be >= 1")
    if not 0 <= args.stop_fraction < 1:
        parser.error(f"--stop-fraction must be in [0, 1), got {args.stop_fraction}")

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
        stop_ids = tuple(range(int(args.stop_fraction * len(tokenizer))))
        for decoder in args.decoders.split(","):
            engine.cuda_graph = cuda and decoder.startswith("graph")
            engine.compile = decoder == "graph-compile"
            for slots in slot_counts if decoder != "hf-generate" else [None]:
                engine.max_running_requests = slots
                for n_prompts, new_tokens in sizes:
                    prompts = [tokenizer(r["prompt"])["input_ids"] for r in records[:n_prompts]]
                    params = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=stop_ids)
                    rows.append(_measure(engine, decoder, prompts, tokenizer, params, args.repeats, cuda, slots))
                    print(rows[-1], flush=True)
    print(f"\n{args.preset}, device {engine.device}, {engine.weight_dtype()}")
    print(f"stop ids: the first {args.stop_fraction:g} of the vocabulary")
    print(
        "| decoder | slots | prompts x new tokens | mean response | first call s | seconds | generated tok/s "
        "| peak GiB | beyond weights GiB |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(str(x) for x in row) + " |")
    return 0


def _measure(engine, decoder, prompts, tokenizer, params, repeats: int, cuda: bool, slots: int | None) -> tuple:
    """One table row: an untimed first call, then the median of ``repeats`` timed ones."""
    size = f"{len(prompts)}x{params.max_new_tokens}"
    run = _runner(engine, decoder, prompts, tokenizer)
    try:
        start = time.perf_counter()
        run(params)  # warm-up: compiles, for graph-compile
        first = time.perf_counter() - start
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else 0
        times, produced = [], 0
        for _ in range(repeats):
            start = time.perf_counter()
            produced = run(params)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        peak = torch.cuda.max_memory_allocated() if cuda else float("nan")
        return (
            decoder,
            "all" if slots is None else str(slots),
            size,
            f"{produced / len(prompts):.0f}",
            f"{first:.2f}",
            f"{seconds:.2f}",
            f"{produced / seconds:.0f}",
            f"{peak / 2**30:.1f}",
            f"{(peak - before) / 2**30:.1f}",
        )
    except torch.OutOfMemoryError:
        if cuda:
            torch.cuda.empty_cache()
        return (decoder, "all" if slots is None else str(slots), size, "OOM", "", "", "", "", "")


def _runner(engine, decoder: str, prompts: list[list[int]], tokenizer):
    """A call that generates for ``prompts`` and returns the number of tokens generated."""
    if decoder in ("graph", "graph-compile", "eager"):

        def generate(params) -> int:
            # Every run draws from the same per-prompt streams, whatever the slot count.
            engine.set_rng_state({**engine.get_rng_state(), "generate_calls": 0})
            return sum(len(g.token_ids) for g in engine.generate(prompts, params))

        return generate
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
