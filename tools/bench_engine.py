"""The embedded engine's rollout on one device: seconds, generated tokens/s and peak memory per decoder and size.

    python3 tools/bench_engine.py           # Qwen3-0.6B preset; 64x512, 64x1024, 256x1024; graph, eager, hf-generate
    python3 tools/bench_engine.py --preset tiny --sizes 8x16 --decoders eager,hf-generate    # a CPU smoke run
    python3 tools/bench_engine.py --sizes 256x1024 --decoders graph --max-running-requests all,64 --stop-fraction 0.004
    python3 tools/bench_engine.py --sizes 8x512 --samples 8 --prompt-tokens 1024 --decoders graph   # long prompts

Decoders: ``graph`` is the engine as it runs on a GPU (the step's forward and its sampling replayed as CUDA graphs,
the Triton decode attention, a group's prompt prefilled and cached once), ``graph-compile`` the same with the step's
forward through ``torch.compile`` before capture, ``graph-unshared`` without sharing a group's prompt,
``graph-torch-attention`` with the plain torch decode attention (reads every cache column) and sampling,
``graph-unfused`` with transformers' own eager modules (norms, MLP, rotary, separate q/k/v and gate/up projections,
the decoder layer's residual adds) instead of the fused Triton kernels and merged projections, ``graph-unlagged``
with checks that wait for the GPU to reach their own step (not lagged one block behind), ``eager`` the same
loop without the graphs, ``hf-generate`` transformers' plain ``generate`` on the same model with no log-probs (a
baseline, not an engine). The random-init preset never emits EOS, so every response runs to its length. Each
(decoder, size) is run once untimed ("first call", which compiles for graph-compile), then timed (``--repeats``,
median). Peak memory is the CUDA allocator's, reset per size; "beyond weights" subtracts the memory held before.

Continuous refill: ``--max-running-requests`` lists slot counts for the engine decoders (``all``: every prompt at
once, the default); ``--stop-fraction F`` makes the first ``F x vocab`` token ids stop ids, so that each draw of the
near-uniform random model ends its response with probability about ``F`` and lengths spread (mean about ``1 / F``),
which is where refill pays. The table reports the mean response length. ``--kv-cache-tokens N`` bounds the engine's
paged KV cache (groups wait for pages; the last started is preempted when rows run short).

Groups and long prompts: ``--samples N`` sends each prompt N times in a row (a GRPO group: the engine prefills it
once and keeps its keys once); ``--prompt-tokens L`` makes every prompt L tokens long.

The floor (on a GPU) is what a decode must at least cost on this device: every step reads the weights and the KV
cache of each row's context so far (a group's prompt once), at the device's measured copy bandwidth, plus the
prefill's matmul FLOPs (2 x parameters per prompt token, each group's prompt once) at its measured bf16 matmul rate.
It is computed from the response lengths the call produced; "x floor" is seconds over floor.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch

# decoder -> (CUDA graph, torch.compile, share a group's prompt, decode attention and plain sampling kernel (None:
# the default), fused Triton kernels and merged projections, checks that decide from the previous check's state (None:
# the default, on with CUDA graphs))
DECODERS = {
    "graph": (True, False, True, None, True, None),
    "graph-compile": (True, True, True, None, True, None),
    "graph-unshared": (True, False, False, None, True, None),
    "graph-torch-attention": (True, False, True, "torch", True, None),
    "graph-unfused": (True, False, True, None, False, None),
    "graph-unlagged": (True, False, True, None, True, False),
    "eager": (False, False, True, None, True, None),
    "hf-generate": (False, False, True, None, False, None),
}


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
    parser.add_argument("--samples", type=int, default=1, help="samples per prompt, sent in a row (a GRPO group)")
    parser.add_argument("--prompt-tokens", type=int, default=0, help="make every prompt this many tokens (0: as is)")
    parser.add_argument(
        "--kv-cache-tokens", type=int, default=None, help="bound the paged KV cache (default: every row's longest)"
    )
    args = parser.parse_args(argv)
    if args.samples < 1 or args.prompt_tokens < 0:
        parser.error("--samples must be >= 1 and --prompt-tokens >= 0")
    if args.kv_cache_tokens is not None and args.kv_cache_tokens < 1:
        parser.error(f"--kv-cache-tokens must be >= 1, got {args.kv_cache_tokens}")
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
    from runtime.engines.fused import fuse_model

    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.preset == "tiny":
            path = str(make_tiny_model(f"{tmp}/m", alphabet=task.ALPHABET, seed=0))
        else:
            path = str(make_preset_model(args.preset, f"{tmp}/m", alphabet=task.ALPHABET, seed=0))
        tokenizer = AutoTokenizer.from_pretrained(path)
        engine = HFEngine(path, seed=0, kv_cache_tokens=args.kv_cache_tokens)
        cuda = engine.device.type == "cuda"
        records = task.make_records(max(n for n, _ in sizes), seed=0)
        stop_ids = tuple(range(int(args.stop_fraction * len(tokenizer))))
        device_rates = _device_rates() if cuda else None
        for decoder in args.decoders.split(","):
            if decoder not in DECODERS:
                parser.error(f"--decoders: unknown decoder {decoder!r} ({', '.join(DECODERS)})")
            graph, engine.compile, engine.share_prompts, engine.attention_kernel, fused, engine.lagged_checks = (
                DECODERS[decoder]
            )
            engine.cuda_graph = cuda and graph
            if cuda:
                fuse_model(engine.model, on=fused)
            for slots in slot_counts if decoder != "hf-generate" else [None]:
                engine.max_running_requests = slots
                for n_prompts, new_tokens in sizes:
                    prompts = [tokenizer(r["prompt"])["input_ids"] for r in records[:n_prompts]]
                    if args.prompt_tokens:
                        prompts = [(p * -(-args.prompt_tokens // len(p)))[: args.prompt_tokens] for p in prompts]
                    prompts = [p for p in prompts for _ in range(args.samples)]
                    params = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=stop_ids)
                    row = _measure(engine, decoder, prompts, tokenizer, params, args.repeats, cuda, slots)
                    rows.append(_with_floor(row, engine, device_rates, args.samples))
                    print(rows[-1], flush=True)
    print(f"\n{args.preset}, device {engine.device}, {engine.weight_dtype()}")
    print(f"stop ids: the first {args.stop_fraction:g} of the vocabulary; {args.samples} samples per prompt")
    if device_rates is not None:
        print(f"measured: copy {device_rates[0] / 1e12:.2f} TB/s, bf16 matmul {device_rates[1] / 1e12:.0f} TFLOP/s")
    print(
        "| decoder | slots | prompts x new tokens | mean response | first call s | seconds | generated tok/s "
        "| peak GiB | beyond weights GiB | floor s | x floor |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(str(x) for x in row) + " |")
    return 0


def _device_rates() -> tuple[float, float]:
    """The device's copy bandwidth (bytes read and written per second) and bf16 matmul rate (FLOP/s), measured."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    rates = []
    for work, amount in ((lambda: dst.copy_(src), 2 * src.numel()), (lambda: a @ a, 2 * 8192**3)):
        work()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            work()
        torch.cuda.synchronize()
        rates.append(10 * amount / (time.perf_counter() - start))
    return rates[0], rates[1]


def _floor_seconds(engine, lengths: list[int], responses: list[int], samples: int, rates) -> float:
    """Weights once per step, each row's KV at its context per step (a group's prompt once), the prefill's FLOPs."""
    config = engine.model.config.get_text_config(decoder=True)
    params = sum(p.numel() for p in engine.model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(engine.model.parameters()).element_size()
    kv_token = config.num_hidden_layers * config.num_key_value_heads * 2 * head_dim * element
    steps = max(responses)
    kv = 0
    for first in range(0, len(lengths), samples):
        group = responses[first : first + samples]
        kv += lengths[first] * max(group) + sum(r * (r - 1) // 2 for r in group)
    prefill_tokens = sum(lengths[::samples])
    return (steps * weight_bytes + kv * kv_token) / rates[0] + 2 * params * prefill_tokens / rates[1]


def _with_floor(row: tuple, engine, rates, samples: int) -> tuple:
    """The row with the floor and seconds over floor (blank off the GPU or when the call failed)."""
    measured, lengths, responses = row
    if rates is None or not responses:
        return (*measured, "", "")
    floor = _floor_seconds(engine, lengths, responses, samples, rates)
    return (*measured, f"{floor:.2f}", f"{float(measured[5]) / floor:.2f}")


def _measure(engine, decoder, prompts, tokenizer, params, repeats: int, cuda: bool, slots: int | None) -> tuple:
    """One table row, the prompt lengths and the response lengths: an untimed first call, then the median of
    ``repeats`` timed ones."""
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
        times, responses = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            responses = run(params)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        produced = sum(responses)
        peak = torch.cuda.max_memory_allocated() if cuda else float("nan")
        return (
            (
                decoder,
                "all" if slots is None else str(slots),
                size,
                f"{produced / len(prompts):.0f}",
                f"{first:.2f}",
                f"{seconds:.2f}",
                f"{produced / seconds:.0f}",
                f"{peak / 2**30:.1f}",
                f"{(peak - before) / 2**30:.1f}",
            ),
            [len(p) for p in prompts],
            responses,
        )
    except torch.OutOfMemoryError:
        if cuda:
            torch.cuda.empty_cache()
        return (decoder, "all" if slots is None else str(slots), size, "OOM", "", "", "", "", ""), [], []


def _runner(engine, decoder: str, prompts: list[list[int]], tokenizer):
    """A call that generates for ``prompts`` and returns each response's length."""
    if decoder != "hf-generate":

        def generate(params) -> list[int]:
            # Every run draws from the same per-prompt streams, whatever the slot count.
            engine.set_rng_state({**engine.get_rng_state(), "generate_calls": 0})
            return [len(g.token_ids) for g in engine.generate(prompts, params)]

        return generate
    width = max(map(len, prompts))
    pad = engine.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=engine.device)
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    model = engine.model

    @torch.no_grad()
    def run(params) -> list[int]:
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
        return [out.shape[1] - width] * len(prompts)

    return run


if __name__ == "__main__":
    sys.exit(main())
