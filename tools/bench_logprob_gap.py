"""The train-vs-rollout log-prob gap under each logit convention, in one table.

    python3 tools/bench_logprob_gap.py                       # Qwen3-0.6B preset on a GPU (bf16 engine and trainer)
    python3 tools/bench_logprob_gap.py --preset tiny --prompts 8 --new-tokens 8    # a CPU smoke run (float32)

The embedded engine (``runtime.engines.HFEngine``, bf16 on a GPU) samples ``--new-tokens`` tokens for each of
``--prompts`` random prompts and reports each token's ``log_softmax(logits / T)`` (the rollout log-probs). The torch
trainer then recomputes them, and the table gives ``|trainer - rollout|`` (mean, 99th percentile, max over the
response tokens) for:

- ``trainer`` (``TorchTrainer.compute_log_probs``: the step's bf16 weights, the LM head fused, logits rounded to
  bf16, the default convention of ``rlcore.kernels``);
- ``bf16 logits`` and ``float32 logits``: the trainer's final hidden states and LM-head weight, with the logits
  rounded to bf16 before the softmax, or kept in float32 (``float32_logits=True``; verl's and CCE's convention).

A random-init model, so the distributions are near uniform; the gaps are what the arithmetic gives, not what a
trained model's sharper distributions would.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch

# The table's rows: the trainer's own recompute, then the two logit conventions on its hidden states.
ROWS = ("trainer", "bf16 logits", "float32 logits")


def measure(path: str, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    from rlcore import keys
    from runtime.config import from_dict, validate
    from runtime.engines import HFEngine, SamplingParams
    from runtime.rollout.sample import Sample
    from runtime.train.algo import loss_config
    from runtime.train.backends.torch_backend import TorchTrainer
    from runtime.train.batch import RESPONSE_TOKENS, build_batch

    engine = HFEngine(path, seed=0)
    vocab = engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature)
    samples = []
    for i, (prompt, g) in enumerate(zip(prompts, engine.generate(prompts, params), strict=True)):
        sample = Sample(group_index=i, index=i, tokens=prompt + g.token_ids, response_length=len(g.token_ids))
        sample.rollout_log_probs, sample.reward = g.log_probs, 0.0
        samples.append(sample)
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    td = build_batch(samples, pad_token_id=0)
    cfg = validate(
        from_dict(
            None,
            hf_checkpoint=path,
            num_rollout=1,
            use_kl_loss=False,
            rollout_batch_size=args.prompts // 2,
            n_samples_per_prompt=2,
            global_batch_size=args.prompts,
            micro_batch_size=args.micro_batch_size,
            rollout_max_response_len=args.new_tokens,
            actor_num_gpus_per_node=1,
        )
    )
    trainer = TorchTrainer(path, train_cfg=cfg.train, loss_cfg=loss_config(cfg), temperature=args.temperature, seed=0)
    mask = td[keys.MASK]
    rollout = td[keys.ROLLOUT_LOG_PROBS]
    out = {"trainer": (trainer.compute_log_probs(td)[keys.OLD_LOG_PROBS] - rollout)[mask]}
    by_convention: dict[str, list[torch.Tensor]] = {"bf16 logits": [], "float32 logits": []}
    with torch.no_grad(), trainer._step_scope():
        for start in range(0, td.batch_size[0], args.micro_batch_size):
            mb = td[start : start + args.micro_batch_size]
            hidden, weight, targets = trainer._response_hidden(trainer.model, mb)
            logits32 = hidden.float() @ weight.float().T
            for name, logits in (("bf16 logits", logits32.to(hidden.dtype).float()), ("float32 logits", logits32)):
                lp = torch.log_softmax(logits / args.temperature, -1).gather(-1, targets[:, None].to(logits.device))
                by_convention[name].append(lp.view(mb[RESPONSE_TOKENS].shape).cpu())
    for name, parts in by_convention.items():
        out[name] = (torch.cat(parts) - rollout)[mask]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen3-0.6b", help="a tools/make_tiny_model.py preset, or tiny")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    args = parser.parse_args(argv)

    from runtime.demo import task
    from runtime.demo.tiny_model import make_preset_model, make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        if args.preset == "tiny":
            path = str(make_tiny_model(f"{tmp}/m", alphabet=task.ALPHABET, seed=0))
        else:
            path = str(make_preset_model(args.preset, f"{tmp}/m", alphabet=task.ALPHABET, seed=0))
        gaps = measure(path, args)
    count = next(iter(gaps.values())).numel()
    print(
        f"\n{args.preset}, {args.prompts} prompts x up to {args.new_tokens} sampled tokens ({count} tokens), "
        f"T={args.temperature}"
    )
    print("| trainer log-probs | mean abs gap | p99 abs gap | max abs gap | mean signed gap |")
    print("| --- | --- | --- | --- | --- |")
    for name, gap in gaps.items():
        a = gap.double().abs()
        print(f"| {name} | {a.mean():.2e} | {a.quantile(0.99):.2e} | {a.max():.2e} | {gap.double().mean():+.2e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
