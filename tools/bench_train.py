"""The torch backend's train step and log-prob forward on one device: seconds, tokens/s and MFU, for each
combination of its speed options, in one table.

    python3 tools/bench_train.py                                   # Qwen3-0.6B preset, 64 x 1024 tokens (a GPU)
    python3 tools/bench_train.py --variants fused,fused+packed,fused+packed+recompute --min-response-len 64
    python3 tools/bench_train.py --preset tiny --samples 8 --seq-len 64 --peak-tflops 1   # a smoke run on the CPU

A variant is options joined by ``+``: ``fused`` (the loss inside the LM head, ``rlcore.kernels.linear_rl_loss``) or
``unfused`` (the full-logits path); ``packed`` (``--use-dynamic-batch-size``: each micro-batch one row of at most
``--max-tokens-per-gpu`` real tokens, default micro-batch size x seq-len); ``recompute`` (``--recompute-granularity
full``); ``compile`` (``--torch-compile``); ``varlen``, ``sdpa``, ``flex`` or ``eager`` (``--attn-implementation``;
default auto: varlen on a GPU whose PyTorch has it, else transformers' default).

Each sample has ``--prompt-len`` prompt tokens and a response of ``--seq-len - --prompt-len`` tokens, or, with
``--min-response-len``, of a length drawn uniformly from ``[min, seq-len - prompt-len]`` (where packing pays: padded
micro-batches run every row to the longest). Random tokens, one optimizer step over all samples; loss PPO clip with
GRPO advantages. MFU counts ``6 x params x tokens`` for a train step and ``2 x params x tokens`` for the log-prob
forward over the real tokens (attention FLOPs left out, as the issue counts; the ``attn`` columns add
``12 x layers x hidden x length`` per token of a sequence for training, a third of that for the forward).
``--profile`` prints a ``torch.profiler`` table of one more train step per variant.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch

OPTIONS = {"fused", "unfused", "packed", "recompute", "compile", "varlen", "sdpa", "flex", "eager"}
ATTENTION = {"varlen": "varlen", "sdpa": "sdpa", "flex": "flex_attention", "eager": "eager"}


def parse_variant(name: str) -> dict[str, object]:
    """``fused+packed`` -> the trainer's knobs; an unknown option raises naming it."""
    parts = name.split("+")
    unknown = set(parts) - OPTIONS
    if unknown or ("fused" in parts and "unfused" in parts) or len(set(parts) & set(ATTENTION)) > 1:
        raise SystemExit(
            f"--variants: {name!r} is not options from {sorted(OPTIONS)} joined by '+' (one of each kind)"
        )
    attention = next((ATTENTION[p] for p in parts if p in ATTENTION), "auto")
    return {
        "fused": "unfused" not in parts,
        "packed": "packed" in parts,
        "recompute": "recompute" in parts,
        "compile": "compile" in parts,
        "attention": attention,
    }


def _lengths(args: argparse.Namespace) -> list[int]:
    """Response length of each sample."""
    longest = args.seq_len - args.prompt_len
    if args.min_response_len is None:
        return [longest] * args.samples
    gen = torch.Generator().manual_seed(1)
    return torch.randint(args.min_response_len, longest + 1, (args.samples,), generator=gen).tolist()


def _batch(vocab: int, args: argparse.Namespace, pad: int):
    from runtime.rollout.sample import Sample
    from runtime.train.batch import build_batch

    gen = torch.Generator().manual_seed(0)
    samples = []
    for i, response in enumerate(_lengths(args)):
        tokens = torch.randint(4, vocab, (args.prompt_len + response,), generator=gen).tolist()
        samples.append(
            Sample(
                index=i // 8,
                group_index=i // 8,
                tokens=tokens,
                response_length=response,
                reward=float(i % 3) / 2,
                rollout_log_probs=(-torch.rand(response, generator=gen) * 5).tolist(),
            )
        )
    return build_batch(samples, pad_token_id=pad)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(path: str, args: argparse.Namespace, variant: dict[str, object]) -> dict[str, float]:
    from transformers import AutoConfig

    from rlcore.advantages import compute
    from runtime.config import from_dict, validate
    from runtime.train.algo import advantage_config, loss_config
    from runtime.train.backends.torch_backend import TorchTrainer
    from runtime.train.roles import ACTOR

    knobs: dict[str, object] = {"attn_implementation": variant["attention"]}
    if variant["packed"]:
        knobs.update(use_dynamic_batch_size=True, max_tokens_per_gpu=args.max_tokens_per_gpu)
    if variant["recompute"]:
        knobs["recompute_granularity"] = "full"
    if variant["compile"]:
        knobs["torch_compile"] = True
    cfg = validate(
        from_dict(
            None,
            hf_checkpoint=path,
            num_rollout=1,
            actor_num_gpus_per_node=1,
            rollout_max_response_len=args.seq_len - args.prompt_len,
            rollout_batch_size=args.samples // 8,
            n_samples_per_prompt=8,
            global_batch_size=args.samples,
            micro_batch_size=args.micro_batch_size,
            use_kl_loss=False,
            lr=1e-6,
            **knobs,
        )
    )
    trainer = TorchTrainer(
        path, train_cfg=cfg.train, loss_cfg=loss_config(cfg), temperature=1.0, seed=0, roles=(ACTOR,)
    )
    if not variant["fused"]:
        trainer._fused_head = lambda model: False  # the full-logits path
    config = AutoConfig.from_pretrained(path)
    td = _batch(config.vocab_size, args, pad=0)
    params = sum(p.numel() for p in trainer.model.parameters())
    lengths = [args.prompt_len + r for r in _lengths(args)]
    tokens = sum(lengths)
    if trainer.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    logprob_s, train_s = [], []
    for i in range(args.warmup + args.repeats):
        _sync(trainer.device)
        start = time.perf_counter()
        td.update(trainer.compute_log_probs(td))
        _sync(trainer.device)
        mid = time.perf_counter()
        trainer.train(compute(td, advantage_config(cfg)), per_step_rows=args.samples)
        _sync(trainer.device)
        end = time.perf_counter()
        if i >= args.warmup:
            logprob_s.append(mid - start)
            train_s.append(end - mid)
    peak = torch.cuda.max_memory_allocated() / 2**30 if trainer.device.type == "cuda" else float("nan")
    if args.profile:
        _profile(trainer, compute(td, advantage_config(cfg)), args)
    lp, tr = statistics.median(logprob_s), statistics.median(train_s)
    # Causal attention over each sequence, fwd + bwd: 12 x layers x hidden x length FLOPs per token (summed).
    attn = sum(12 * config.num_hidden_layers * config.hidden_size * length * length for length in lengths)
    peak_flops = args.peak_tflops * 1e12
    return {
        "params": params,
        "tokens": tokens,
        "micro_batches": len(trainer._micro_batches(td)),
        "logprob_s": lp,
        "logprob_tok_s": tokens / lp,
        "logprob_mfu": 2 * params * tokens / lp / peak_flops,
        "logprob_mfu_attn": (2 * params * tokens + attn / 3) / lp / peak_flops,
        "train_s": tr,
        "train_tok_s": tokens / tr,
        "train_mfu": 6 * params * tokens / tr / peak_flops,
        "train_mfu_attn": (6 * params * tokens + attn) / tr / peak_flops,
        "peak_gib": peak,
    }


def _profile(trainer, td, args: argparse.Namespace) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        trainer.train(td, per_step_rows=args.samples)
        _sync(trainer.device)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    sort = "self_cuda_time_total" if trainer.device.type == "cuda" else "self_cpu_time_total"
    print(events.table(sort_by=sort, row_limit=args.profile_rows), flush=True)
    if trainer.device.type == "cuda":
        # Device time summed over kernels, against the profiled step's wall time: how busy the GPU was.
        busy = sum(e.self_device_time_total for e in events) / 1e6
        print(f"profiled train step: wall {wall:.3f} s, GPU kernels {busy:.3f} s ({busy / wall:.0%} busy)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen3-0.6b", help="a tools/make_tiny_model.py preset, or tiny")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=1024, help="the longest sample's tokens")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--min-response-len", type=int, default=None, help="unset: every response is the longest")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--max-tokens-per-gpu", type=int, default=None, help="packed; unset: micro-batch x seq-len")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100 SXM: 989)")
    parser.add_argument("--variants", "--paths", default="fused,unfused", help="comma-separated, see above")
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler table per variant")
    parser.add_argument("--profile-rows", type=int, default=20)
    args = parser.parse_args(argv)
    if args.max_tokens_per_gpu is None:
        args.max_tokens_per_gpu = args.micro_batch_size * args.seq_len
    variants = [(name, parse_variant(name)) for name in args.variants.split(",")]

    from runtime.demo import task
    from runtime.demo.tiny_model import make_preset_model, make_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.preset == "tiny":
            path = str(make_tiny_model(f"{tmp}/m", alphabet=task.ALPHABET, seed=0))
        else:
            path = str(make_preset_model(args.preset, f"{tmp}/m", alphabet=task.ALPHABET, seed=0))
        for name, variant in variants:
            rows.append((name, measure(path, args, variant)))
            print(name, {k: round(v, 4) for k, v in rows[-1][1].items()}, flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    lengths = (
        "all"
        if args.min_response_len is None
        else f"responses {args.min_response_len}..{args.seq_len - args.prompt_len} +"
    )
    print(
        f"\n{args.preset}, {args.samples} samples, {lengths} {args.prompt_len}-token prompts "
        f"({rows[0][1]['tokens']} real tokens), micro-batch {args.micro_batch_size} rows or "
        f"{args.max_tokens_per_gpu} tokens packed"
    )
    print(
        "| variant | micro-batches | log-prob fwd s | tok/s | MFU | MFU+attn | train step s | tok/s | MFU | MFU+attn "
        "| peak GiB |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, m in rows:
        print(
            f"| {name} | {m['micro_batches']} | {m['logprob_s']:.3f} | {m['logprob_tok_s']:.0f} | "
            f"{m['logprob_mfu']:.1%} | {m['logprob_mfu_attn']:.1%} | {m['train_s']:.3f} | {m['train_tok_s']:.0f} | "
            f"{m['train_mfu']:.1%} | {m['train_mfu_attn']:.1%} | {m['peak_gib']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
