"""The torch backend's train step and log-prob forward on one device: seconds, tokens/s and MFU, fused vs unfused.

    python3 tools/bench_train.py                                   # Qwen3-0.6B preset, 64 x 1024 tokens (a GPU)
    python3 tools/bench_train.py --preset tiny --samples 8 --seq-len 64 --peak-tflops 1   # a smoke run on the CPU

Every sample is ``--seq-len`` tokens (``--prompt-len`` of prompt, the rest response), random tokens, one optimizer
step over all of them in micro-batches of ``--micro-batch-size``; loss PPO clip + low_var_kl-free GRPO advantages.
MFU counts ``6 x params x tokens`` for a train step and ``2 x params x tokens`` for the log-prob forward (attention
FLOPs left out, as the issue counts; the ``attn`` columns add ``12 x layers x hidden x seq`` per token for training,
a third of that for the forward). "fused" trains through ``rlcore.kernels.linear_rl_loss`` (the LM head never
applied to all positions); "unfused" is the backend's full-logits path.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch


def _batch(vocab: int, args: argparse.Namespace, pad: int):
    from runtime.rollout.sample import Sample
    from runtime.train.batch import build_batch

    gen = torch.Generator().manual_seed(0)
    samples = []
    response = args.seq_len - args.prompt_len
    for i in range(args.samples):
        tokens = torch.randint(4, vocab, (args.seq_len,), generator=gen).tolist()
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


def measure(path: str, args: argparse.Namespace, *, fused: bool) -> dict[str, float]:
    from transformers import AutoConfig

    from rlcore.advantages import compute
    from runtime.config import from_dict, validate
    from runtime.train.algo import advantage_config, loss_config
    from runtime.train.backends.torch_backend import TorchTrainer
    from runtime.train.roles import ACTOR

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
        )
    )
    trainer = TorchTrainer(
        path, train_cfg=cfg.train, loss_cfg=loss_config(cfg), temperature=1.0, seed=0, roles=(ACTOR,)
    )
    if not fused:
        trainer._fused_head = lambda model: False  # the full-logits path
    config = AutoConfig.from_pretrained(path)
    td = _batch(config.vocab_size, args, pad=0)
    params = sum(p.numel() for p in trainer.model.parameters())
    tokens = args.samples * args.seq_len
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
    lp, tr = statistics.median(logprob_s), statistics.median(train_s)
    attn = 12 * config.num_hidden_layers * config.hidden_size * args.seq_len  # per token, fwd + bwd
    peak_flops = args.peak_tflops * 1e12
    return {
        "params": params,
        "logprob_s": lp,
        "logprob_tok_s": tokens / lp,
        "logprob_mfu": 2 * params * tokens / lp / peak_flops,
        "logprob_mfu_attn": (2 * params + attn / 3) * tokens / lp / peak_flops,
        "train_s": tr,
        "train_tok_s": tokens / tr,
        "train_mfu": 6 * params * tokens / tr / peak_flops,
        "train_mfu_attn": (6 * params + attn) * tokens / tr / peak_flops,
        "peak_gib": peak,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen3-0.6b", help="a tools/make_tiny_model.py preset, or tiny")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100 SXM: 989)")
    parser.add_argument("--paths", default="fused,unfused")
    args = parser.parse_args(argv)

    from runtime.demo import task
    from runtime.demo.tiny_model import make_preset_model, make_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.preset == "tiny":
            path = str(make_tiny_model(f"{tmp}/m", alphabet=task.ALPHABET, seed=0))
        else:
            path = str(make_preset_model(args.preset, f"{tmp}/m", alphabet=task.ALPHABET, seed=0))
        for name in args.paths.split(","):
            rows.append((name, measure(path, args, fused=name == "fused")))
            print(name, {k: round(v, 4) for k, v in rows[-1][1].items()}, flush=True)
    tokens = args.samples * args.seq_len
    print(f"\n{args.preset}, {args.samples} x {args.seq_len} tokens ({tokens}), micro-batch {args.micro_batch_size}")
    print("| path | log-prob fwd s | tok/s | MFU | MFU+attn | train step s | tok/s | MFU | MFU+attn | peak GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, m in rows:
        print(
            f"| {name} | {m['logprob_s']:.3f} | {m['logprob_tok_s']:.0f} | {m['logprob_mfu']:.1%} | "
            f"{m['logprob_mfu_attn']:.1%} | {m['train_s']:.3f} | {m['train_tok_s']:.0f} | {m['train_mfu']:.1%} | "
            f"{m['train_mfu_attn']:.1%} | {m['peak_gib']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
