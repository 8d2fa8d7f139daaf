"""Train step and log-prob forward of the torch and Megatron backends side by side: seconds, tokens/s, MFU two ways,
peak memory, and the measured bf16 matmul rate beside the peak MFU is counted against.

    python3 tools/bench_backends.py                                     # Qwen3-0.6B preset, 64 x 1024 tokens (a GPU)
    python3 tools/bench_backends.py --samples 8 --seq-len 16384 --micro-batch-size 1        # prime-rl's 16k anchor
    python3 tools/bench_backends.py --preset qwen3-4b --seq-len 2048 --nproc 2 --paths megatron,fused
    python3 tools/bench_backends.py --preset tiny --samples 8 --seq-len 64 --peak-tflops 1    # a smoke run on the CPU
    python3 tools/bench_backends.py --preset qwen3-30b-a3b --num-layers 8 --seq-len 2048 --nproc 4 --paths megatron \
        --expert-model-parallel-size 4 --moe-grouped-gemm              # MoE: EP=4 over four GPUs, grouped experts

Every sample is ``--seq-len`` tokens (``--prompt-len`` of prompt, the rest response), random tokens, one optimizer
step over all of them in micro-batches of ``--micro-batch-size``; loss PPO clip with GRPO advantages, no KL.
Paths: ``fused`` (torch backend through ``rlcore.kernels.linear_rl_loss``, the LM head never applied to all
positions), ``unfused`` (torch backend, full logits), ``megatron`` (megatron-core ``GPTModel``, local spec, bf16 with
float32 main weights and Megatron's distributed optimizer on GPUs; ``--tensor-model-parallel-size``,
``--sequence-parallel``, ``--expert-model-parallel-size``, ``--moe-grouped-gemm``, ``--recompute-granularity`` and
``--attention-backend`` are its). With ``--nproc N`` each path runs on N processes (one device each, data parallel
for the torch backend's FSDP2 and for Megatron beyond its TP x PP); tokens/s count the global batch. The MoE presets
(``qwen3-30b-a3b``, ``moonlight-16b-a3b``) are real layer shapes, ``--num-layers`` of them.

MFU is model FLOPs over ``N x --peak-tflops``, two ways: ``6 x active params x tokens`` for a train step (``2 x``
for the forward), and with causal attention added: per token and layer ``seq x heads x (qk_dim + v_dim)`` FLOPs
forward (QK^T and AV over half the positions on average), three times that for a train step. Active params are the
weights a token is multiplied by: the HF model's, a MoE layer's routed experts at top-k of them, and the input
embedding only where tied (it is then the LM head; an untied one is a lookup). The measured bf16 matmul rate (an
8192^3 GEMM on the device; float32 512^3 on the CPU) is printed beside the peak used. ``--profile`` adds, per path,
the kernels of one more train step on rank 0 that took the most device time, and the fraction of the step's wall
time the device was busy.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time

import torch

PATHS = ("fused", "unfused", "megatron")
# --preset -> (the runtime.demo.tiny_model preset it starts from, the config fields it replaces). Qwen3-4B's shape over
# the qwen3-0.6b preset (hidden 2560, MLP 9728, 36 layers, 32 query and 8 key/value heads of 128, tied embeddings,
# vocabulary 151936: Qwen/Qwen3-4B's config.json). The MoE shapes are their real layers (Qwen3-30B-A3B: 128 experts of
# 768, top 8; Moonlight-16B-A3B: MLA, a dense first layer, 64 experts of 1408, top 6, 2 shared), as many as
# --num-layers asks for (the whole models do not fit four GPUs with an optimizer).
SHAPES = {
    "qwen3-0.6b": ("qwen3-0.6b", {}),
    "qwen3-4b": (
        "qwen3-0.6b",
        {
            "hidden_size": 2560,
            "intermediate_size": 9728,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
        },
    ),
    "qwen3-30b-a3b": ("qwen3-30b-a3b-2layers", {}),
    "moonlight-16b-a3b": ("moonlight-16b-a3b-2layers", {}),
    "tiny-qwen3-moe": ("tiny-qwen3-moe", {}),  # for a smoke run on the CPU
}
# A routed expert's weights in the HF names (model.layers.{i}.mlp.experts.{e}.*): a token meets top-k of them.
_ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")


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


def model_flops_per_token(config, *, seq_len: int) -> dict[str, float]:
    """Train-step FLOPs per token: ``dense`` (6 x the active parameters) and ``attn`` (causal attention's matmuls),
    from an HF config; the forward is a third of each.

    Active parameters are the weights a token is multiplied by: every tensor of the HF model, a MoE layer's routed
    experts at top-k of them (``router_topk / num_experts`` of their sum), and the input embedding only where it is
    the LM head too (tied): an untied embedding is a lookup, no FLOPs. Attention per token and layer, forward: QK^T and
    AV over half the positions on average, ``seq x heads x (qk_dim + v_dim)`` (MLA's query/key heads are wider than
    its value heads)."""
    from runtime.train.backends import megatron_config as mc
    from runtime.train.backends import megatron_weights as mw

    shape = mc.shape_from_hf(config.to_dict())
    sizes = {name: torch.Size(size).numel() for name, (size, _) in mw.hf_shapes(shape).items()}
    routed = sum(n for name, n in sizes.items() if _ROUTED_EXPERT.search(name))
    params = sum(sizes.values())
    active = params - routed
    if shape.moe is not None:
        active += routed * shape.moe.router_topk // shape.moe.num_experts
    if not shape.tie_embeddings:
        active -= sizes[mw.EMBED]
    if shape.mla is not None:
        qk, v = shape.mla.qk_head_dim + shape.mla.qk_pos_emb_head_dim, shape.mla.v_head_dim
    else:
        qk = v = shape.kv_channels
    attn = 3 * shape.num_layers * seq_len * shape.num_attention_heads * (qk + v)
    return {"params": params, "active": active, "dense": 6 * active, "attn": attn}


def matmul_tflops(device: torch.device) -> tuple[float, str]:
    """The measured matmul rate on ``device`` and what was measured."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    repeats = 20
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _sync(device)
    seconds = (time.perf_counter() - start) / repeats
    return 2 * n**3 / seconds / 1e12, f"{str(dtype).removeprefix('torch.')} {n}^3"


def _config(path: str, args: argparse.Namespace, world: int, path_name: str):
    from runtime.config import from_dict, validate

    overrides = {}
    if args.torch_compile and path_name != "megatron":
        overrides["torch_compile"] = True
    if path_name == "megatron":
        overrides = {
            "train_backend": "megatron",
            "tensor_model_parallel_size": args.tensor_model_parallel_size,
            "recompute_granularity": args.recompute_granularity,
            "attention_backend": args.attention_backend,
            "overlap_grad_reduce": args.overlap_grad_reduce,
            "sequence_parallel": args.sequence_parallel,
            "expert_model_parallel_size": args.expert_model_parallel_size,
            "moe_grouped_gemm": args.moe_grouped_gemm,
        }
        if args.recompute_granularity == "full":
            overrides.update(recompute_method="uniform", recompute_num_layers=1)
    return validate(
        from_dict(
            None,
            hf_checkpoint=path,
            num_rollout=1,
            actor_num_gpus_per_node=world,
            rollout_max_response_len=args.seq_len - args.prompt_len,
            rollout_batch_size=args.samples // 8,
            n_samples_per_prompt=8,
            global_batch_size=args.samples,
            micro_batch_size=args.micro_batch_size,
            use_kl_loss=False,
            lr=1e-6,
            **overrides,
        )
    )


def measure(
    path: str, args: argparse.Namespace, path_name: str, *, rank: int = 0, world: int = 1, port: int = 0
) -> dict[str, float]:
    """One path's timings on this rank (a collective over ``world`` ranks)."""
    from transformers import AutoConfig

    from rlcore.advantages import compute
    from runtime.train.algo import advantage_config, loss_config
    from runtime.train.backends import backend_class
    from runtime.train.batch import shard_rows
    from runtime.train.roles import ACTOR

    cfg = _config(path, args, world, path_name)
    started = time.perf_counter()

    def progress(what: str) -> None:  # rank 0's phases, as they end: a run cut off still shows where it was
        if rank == 0 and args.progress:
            print(f"  [{path_name}] {time.perf_counter() - started:7.1f} s: {what}", flush=True)

    backend = "megatron" if path_name == "megatron" else "torch"
    if backend == "megatron":
        from runtime.train.backends import megatron_dispatch

        megatron_dispatch.DISPATCHER = args.moe_dispatcher  # read as the MoE layers are built
    trainer = backend_class(backend)(
        path,
        train_cfg=cfg.train,
        loss_cfg=loss_config(cfg),
        temperature=1.0,
        seed=0,
        roles=(ACTOR,),
        rank=rank,
        world_size=world,
        master_port=port,
    )
    if path_name == "unfused":
        trainer._fused_head = lambda model: False  # the full-logits path
    progress("trainer built (weights loaded)")
    config = AutoConfig.from_pretrained(path)
    td = _batch(config.vocab_size, args, pad=0)
    dp_rank, dp_size = trainer.dp_info()
    td = td[shard_rows(args.samples, global_batch_size=args.samples, dp_rank=dp_rank, dp_size=dp_size)]
    rows = td.batch_size[0]
    device = trainer.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    logprob_s, train_s = [], []
    for i in range(args.warmup + args.repeats):
        lp_i, _, train_i = _iteration(trainer, td, cfg, rows)
        progress(f"step {i}: log-probs {lp_i:.3f} s, train {train_i:.3f} s")
        if i >= args.warmup:
            logprob_s.append(lp_i)
            train_s.append(train_i)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    if args.trace:
        _trace_iteration(trainer, td, cfg, rows, args, rank)
    if args.profile:
        # After a log-prob pass, as each timed step.
        td.update(trainer.compute_log_probs(td))
        _profile_step(trainer, compute(td, advantage_config(cfg)), rows, args, f"{path_name}, rank {rank}", rank == 0)
    trainer.shutdown()
    lp, tr = statistics.median(logprob_s), statistics.median(train_s)
    flops = model_flops_per_token(config, seq_len=args.seq_len)
    tokens = args.samples * args.seq_len
    peak_flops = args.peak_tflops * 1e12 * world
    return {
        "params": flops["params"],
        "active": flops["active"],
        "logprob_s": lp,
        "logprob_tok_s": tokens / lp,
        "logprob_mfu": flops["dense"] / 3 * tokens / lp / peak_flops,
        "logprob_mfu_attn": (flops["dense"] + flops["attn"]) / 3 * tokens / lp / peak_flops,
        "train_s": tr,
        "train_tok_s": tokens / tr,
        "train_mfu": flops["dense"] * tokens / tr / peak_flops,
        "train_mfu_attn": (flops["dense"] + flops["attn"]) * tokens / tr / peak_flops,
        "peak_gib": peak,
    }


def _iteration(trainer, td, cfg, rows: int) -> tuple[float, float, float]:
    """One step as the loop takes it, timed: ``(log-prob pass s, advantages s, train step s)``; ``td`` takes the
    new log-probs. The advantages are the loop's, not the trainer's step: timed apart from it."""
    from rlcore.advantages import compute
    from runtime.train.algo import advantage_config

    _sync(trainer.device)
    marks = [time.perf_counter()]
    td.update(trainer.compute_log_probs(td))
    _sync(trainer.device)
    marks.append(time.perf_counter())
    batch = compute(td, advantage_config(cfg))
    marks.append(time.perf_counter())
    trainer.train(batch, per_step_rows=rows)
    _sync(trainer.device)
    marks.append(time.perf_counter())
    return marks[1] - marks[0], marks[2] - marks[1], marks[3] - marks[2]


def _trace_iteration(trainer, td, cfg, rows: int, args: argparse.Namespace, rank: int) -> None:
    """One more timed iteration (:func:`_iteration`: every rank takes it), rank 0's under ``torch.profiler``, its
    Chrome trace written to ``--trace`` (gzipped) with its phases' wall times."""
    from torch.profiler import ProfilerActivity, profile

    if rank != 0:
        _iteration(trainer, td, cfg, rows)
        return
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        phases = _iteration(trainer, td, cfg, rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.trace)), exist_ok=True)
    raw = args.trace.removesuffix(".gz")
    prof.export_chrome_trace(raw)
    import gzip
    import shutil

    with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw)
    print(
        f"\ntraced iteration (rank 0): log-probs {phases[0]:.3f} s, advantages {phases[1]:.3f} s, train "
        f"{phases[2]:.3f} s -> {raw}.gz",
        flush=True,
    )


def _profile_step(trainer, td, rows: int, args: argparse.Namespace, label: str, show: bool) -> None:
    """One more train step (every rank takes it: it is a collective), under ``torch.profiler`` where ``show``: the
    kernels that took the most device time, and how busy the device was over the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    if not show:
        trainer.train(td, per_step_rows=rows)
        return
    cuda = trainer.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        _sync(trainer.device)
        start = time.perf_counter()
        trainer.train(td, per_step_rows=rows)
        _sync(trainer.device)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    if cuda:
        # The kernels alone: an operator's own device time is its kernels', which would count them twice, and so
        # would a GPU-side annotation such as NCCL's ``nccl:all_to_all`` over its own kernels (torch's table total
        # leaves those out the same way).
        events = [
            e
            for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
        ]
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    busy = sum(getattr(e, key) for e in events) / 1e6
    print(
        f"\nprofile of one train step ({label}): wall {wall:.3f} s, {'GPU kernels' if cuda else 'CPU ops'} "
        f"{busy:.3f} s ({busy / wall:.0%} busy)",
        flush=True,
    )
    for event in sorted(events, key=lambda e: getattr(e, key), reverse=True)[: args.profile_rows]:
        share = getattr(event, key) / 1e6
        print(f"  {share:8.3f} s {share / max(busy, 1e-9):6.1%} {event.count:6d}x  {event.key[:100]}", flush=True)


def _worker(rank: int, world: int, port: int, path: str, args: argparse.Namespace, name: str, out: str) -> None:
    if args.device_count:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)  # before CUDA starts in this process: one device per rank
    # Each rank its share of the cores, as rlcore-run gives its trainer actors (runtime/cluster/placement.py): on
    # four H200s, four ranks of 64 OpenMP threads each took 0.42 s for the advantages' CPU ops of 16 x 4096 tokens.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    torch.save(measure(path, args, name, rank=rank, world=world, port=port), f"{out}.{rank}")


def run_path(path: str, args: argparse.Namespace, name: str, tmp: str) -> dict[str, float]:
    """``measure`` on ``--nproc`` processes: rank 0's timings, the largest peak memory of any rank."""
    if args.nproc == 1:
        return measure(path, args, name)
    import torch.multiprocessing as mp

    from runtime.cluster.placement import free_port

    out = os.path.join(tmp, f"{name}.pt")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep (read as the ranks start)
    mp.spawn(_worker, args=(args.nproc, free_port(), path, args, name, out), nprocs=args.nproc, join=True)
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(args.nproc)]
    return {**ranks[0], "peak_gib": max(r["peak_gib"] for r in ranks)}


def _preset_fields(args: argparse.Namespace) -> tuple[str, dict]:
    """The tiny_model preset ``--preset`` starts from and the config fields it replaces, ``--num-layers`` included."""
    preset, fields = SHAPES[args.preset]
    if args.num_layers is not None:
        fields = {**fields, "num_hidden_layers": args.num_layers}
    return preset, fields


def build_model(args: argparse.Namespace, folder: str) -> str:
    from runtime.demo import task
    from runtime.demo.tiny_model import make_preset_model, make_tiny_model

    if args.preset == "tiny":
        return str(make_tiny_model(folder, alphabet=task.ALPHABET, seed=0))
    preset, fields = _preset_fields(args)
    return str(make_preset_model(preset, folder, alphabet=task.ALPHABET, seed=0, **fields))


def _check_reused(path: str, args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``parser.error`` unless the model in ``--model-dir`` has the shape this run's flags ask for."""
    import json

    from runtime.demo import task
    from runtime.demo.tiny_model import preset_config

    preset, fields = _preset_fields(args)
    want = preset_config(preset, alphabet=task.ALPHABET, **fields)[0].to_dict()
    with open(os.path.join(path, "config.json")) as f:
        have = json.load(f)
    keys = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")
    diff = [f"{k} {have.get(k)} (wanted {want.get(k)})" for k in keys if have.get(k) != want.get(k)]
    if diff:
        parser.error(f"--model-dir {path} holds another model: {', '.join(diff)}; give an empty folder")


def main(argv: list[str] | None = None) -> int:
    from runtime.config import MEGATRON_ATTENTION_BACKENDS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen3-0.6b", choices=[*SHAPES, "tiny"])
    parser.add_argument(
        "--num-layers", type=int, default=None, help="decoder layers of the preset's shape (default: the preset's)"
    )
    parser.add_argument(
        "--model-dir",
        default=None,
        help="where the random-init model is built, and reused from by a later run if it is there (default: a "
        "temporary folder); a model there must be this run's --preset and --num-layers",
    )
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per device (H100 SXM: 989)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    parser.add_argument("--nproc", type=int, default=1, help="processes (devices) per path")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1, help="megatron's TP")
    parser.add_argument("--sequence-parallel", action="store_true", help="megatron's sequence parallelism (TP > 1)")
    parser.add_argument("--expert-model-parallel-size", type=int, default=1, help="megatron's EP (MoE presets)")
    parser.add_argument(
        "--moe-grouped-gemm", action="store_true", help="megatron's experts through torch._grouped_mm (MoE presets)"
    )
    parser.add_argument(
        "--moe-dispatcher",
        default="once_per_rank",
        help="megatron's MoE token dispatcher, comma-separated to compare: once_per_rank (rlcore's) or megatron "
        "(megatron-core's own alltoall, unfused: its permutation's bf16 atomic adds); "
        "runtime/train/backends/megatron_dispatch.py",
    )
    parser.add_argument(
        "--recompute-granularity", choices=["full", "selective"], default=None, help="megatron's activation recompute"
    )
    parser.add_argument("--progress", action="store_true", help="print rank 0's phases as they end")
    parser.add_argument("--profile", action="store_true", help="profile one more train step per path (rank 0)")
    parser.add_argument("--profile-rows", type=int, default=15, help="kernels listed by --profile")
    parser.add_argument(
        "--trace",
        default=None,
        help="write a gzipped Chrome trace of one more timed iteration (log-probs, advantages, train; rank 0) here",
    )
    parser.add_argument(
        "--attention-backend",
        choices=MEGATRON_ATTENTION_BACKENDS,
        default="auto",
        help="megatron's core attention: auto (PyTorch SDPA) or local (Megatron's unfused)",
    )
    parser.add_argument(
        "--overlap-grad-reduce", action="store_true", help="megatron's DDP reduces buckets during the backward"
    )
    parser.add_argument(
        "--torch-compile", action="store_true", help="the torch backend's --torch-compile (fused and unfused paths)"
    )
    args = parser.parse_args(argv)
    names = args.paths.split(",")
    unknown = sorted(set(names) - set(PATHS))
    from runtime.train.backends.megatron_dispatch import DISPATCHERS

    if set(args.moe_dispatcher.split(",")) - set(DISPATCHERS):
        parser.error(f"--moe-dispatcher: comma-separated, of {', '.join(DISPATCHERS)}")
    if unknown or args.samples % 8 or args.nproc < 1 or not 0 < args.prompt_len < args.seq_len:
        parser.error(f"--paths of {PATHS} (got {unknown}), --samples a multiple of 8, --prompt-len < --seq-len")
    args.device_count = torch.cuda.device_count()
    if args.device_count and args.nproc > args.device_count:
        parser.error(f"--nproc {args.nproc} needs as many GPUs; {args.device_count} are visible")

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model_dir or f"{tmp}/m"
        if not os.path.exists(os.path.join(path, "config.json")):
            start = time.perf_counter()
            path = build_model(args, path)
            if args.progress:
                print(f"  model built in {time.perf_counter() - start:.1f} s", flush=True)
        elif args.preset != "tiny":
            _check_reused(path, args, parser)
        # The Megatron path once per --moe-dispatcher (MoE presets), labelled by it where several are given.
        runs = [
            (name, dispatcher)
            for name in names
            for dispatcher in (args.moe_dispatcher.split(",") if name == "megatron" else [None])
        ]
        several = args.moe_dispatcher.count(",") > 0
        for name, dispatcher in runs:
            label = f"{name} ({dispatcher})" if dispatcher and several else name
            trace = args.trace
            if trace and len(runs) > 1:  # one trace file per run
                stem, ext = os.path.splitext(trace.removesuffix(".gz"))
                trace = f"{stem}.{label.replace(' (', '.').rstrip(')')}{ext}"
            run_args = argparse.Namespace(**{**vars(args), "moe_dispatcher": dispatcher, "trace": trace})
            rows.append((label, run_path(path, run_args, name, tmp)))
            print(label, {k: round(v, 4) for k, v in rows[-1][1].items()}, flush=True)
    device = torch.device("cuda", 0) if args.device_count else torch.device("cpu")
    rate, what = matmul_tflops(device)
    tokens = args.samples * args.seq_len
    print(
        f"\n{args.preset}{'' if args.num_layers is None else f' ({args.num_layers} layers)'} "
        f"({rows[0][1]['params']:,} params, {rows[0][1]['active']:,} active), {args.samples} x {args.seq_len} "
        f"tokens ({tokens}), "
        f"micro-batch {args.micro_batch_size}, {args.nproc} process(es); MFU against {args.peak_tflops:g} TFLOP/s "
        f"per device; measured {what} matmul: {rate:.1f} TFLOP/s"
    )
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
