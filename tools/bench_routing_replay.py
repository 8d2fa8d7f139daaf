"""The train-vs-rollout log-prob gap of a MoE model with and without rollout routing replay (R3), in one table.

    python3 tools/bench_routing_replay.py                                  # tiny Qwen3-MoE on a GPU (bf16)
    python3 tools/bench_routing_replay.py --prompts 4 --new-tokens 8       # a CPU smoke run (float32)
    python3 tools/bench_routing_replay.py --prompts 8 --new-tokens 16 --engine-dtype bfloat16   # CPU, flips

The embedded engine samples ``--new-tokens`` tokens for each of ``--prompts`` random prompts, reporting each token's
log-prob and the experts that routed every token (``return_routed_experts``). The torch trainer then recomputes the
log-probs three ways: routing as usual, recording its own routes (R2's pass: how often its expert set differs from the
engine's is the "flipped" column), and replaying the engine's routes (``--use-rollout-routing-replay``). The table
gives ``|trainer - rollout|`` over the response tokens (mean, 99th percentile, max) and the share of tokens (prompt and
response, each sequence's last aside) whose expert set differs from the engine's in some layer: the routing flips that
replay undoes.

On the CPU both sides compute in float32 by default and agree on nearly every expert (no flips: the rows differ by
float32 rounding); ``--engine-dtype bfloat16`` samples in bfloat16 against the float32 trainer, as GPU jobs do.

A random-init model (``--router-std`` redraws the routers: transformers' default init nearly ties every expert, the
worst case for flips); the gaps are what the arithmetic gives, not what a trained model's sharper routers would.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch


def measure(path: str, args: argparse.Namespace) -> list[tuple[str, torch.Tensor, float | None]]:
    from rlcore import keys
    from runtime.config import from_dict, validate
    from runtime.engines import HFEngine, SamplingParams
    from runtime.rollout.sample import Sample
    from runtime.train.algo import loss_config
    from runtime.train.backends.torch_backend import TorchTrainer
    from runtime.train.batch import PROMPT_LENGTHS, RESPONSE_LENGTHS, ROUTED_EXPERTS, build_batch
    from runtime.train.hooks import TrainHooks

    engine = HFEngine(path, seed=0, dtype=args.engine_dtype)
    vocab = engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, return_routed_experts=True)
    samples = []
    for i, (prompt, g) in enumerate(zip(prompts, engine.generate(prompts, params), strict=True)):
        sample = Sample(group_index=i, index=i, tokens=prompt + g.token_ids, response_length=len(g.token_ids))
        sample.rollout_log_probs, sample.reward = g.log_probs, 0.0
        sample.rollout_routed_experts = g.extra["routed_experts"]
        samples.append(sample)
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    td = build_batch(samples, pad_token_id=0, routed_experts=True)
    cfg = validate(
        from_dict(
            None,
            hf_checkpoint=path,
            num_rollout=1,
            rollout_batch_size=args.prompts // 2,
            n_samples_per_prompt=2,
            global_batch_size=args.prompts,
            micro_batch_size=args.micro_batch_size,
            rollout_max_response_len=args.new_tokens,
            actor_num_gpus_per_node=1,
        )
    )
    mask = td[keys.MASK]
    rollout = td[keys.ROLLOUT_LOG_PROBS]
    # The tokens with a route row (all but each sequence's last): where the trainer's own routes are compared.
    lengths = td[PROMPT_LENGTHS] + td[RESPONSE_LENGTHS]
    routed = torch.arange(td["tokens"].shape[1])[None] < (lengths - 1)[:, None]
    out = []
    for name, replay in (("no replay", None), ("R2 record (own routes)", "trainer"), ("R3 replay", "rollout")):
        trainer = TorchTrainer(
            path,
            train_cfg=cfg.train,
            loss_cfg=loss_config(cfg),
            temperature=1.0,
            seed=0,
            hooks=TrainHooks(routing_replay=replay),
        )
        batch = td.clone() if replay == "rollout" else td.exclude(ROUTED_EXPERTS)
        result = trainer.compute_log_probs(batch)
        flipped = None
        if replay == "trainer":
            own, engine_routes = result[ROUTED_EXPERTS], td[ROUTED_EXPERTS]
            differs = (own.sort(-1).values != engine_routes.sort(-1).values).any(-1).any(-1)  # [B, L]
            flipped = float(differs[routed].float().mean())
        out.append((name, (result[keys.OLD_LOG_PROBS] - rollout)[mask], flipped))
        del trainer
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny-qwen3-moe", help="a tools/make_tiny_model.py MoE preset")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--router-std", type=float, default=None, help="redraw the routers N(0, std)")
    parser.add_argument(
        "--engine-dtype",
        default="auto",
        choices=("auto", "bfloat16", "float32"),
        help="the engine's weights (auto: bfloat16 on a GPU, float32 on the CPU); the trainer keeps its own",
    )
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from runtime.demo import task
    from runtime.demo.tiny_model import make_preset_model
    from runtime.engines.routes import moe_routers

    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_preset_model(args.preset, f"{tmp}/m", alphabet=task.ALPHABET, seed=0))
        if args.router_std is not None:
            model = AutoModelForCausalLM.from_pretrained(path)
            torch.manual_seed(0)
            with torch.no_grad():
                for _, router in moe_routers(model):
                    router.weight.normal_(0.0, args.router_std)
            model.save_pretrained(path)
        rows = measure(path, args)
    count = rows[0][1].numel()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(
        f"\n{args.preset} (router std {args.router_std or 'default init'}), {args.prompts} prompts x up to "
        f"{args.new_tokens} sampled tokens ({count} tokens), {device}"
    )
    print("| trainer | mean abs gap | p99 abs gap | max abs gap | tokens whose experts differ from the engine's |")
    print("| --- | --- | --- | --- | --- |")
    for name, gap, flipped in rows:
        a = gap.double().abs()
        shown = "" if flipped is None else f"{flipped:.1%}"
        print(f"| {name} | {a.mean():.2e} | {a.quantile(0.99):.2e} | {a.max():.2e} | {shown} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
