"""A colocated ``rlcore-run`` GRPO step beside TRL's ``GRPOTrainer`` on the same model, prompts, reward and work.

    python3 tools/bench_vs_trl.py                          # Qwen3-0.6B preset, 8 prompts x 8 samples x 512 tokens
    python3 tools/bench_vs_trl.py --steps 5 --device cuda:0 --only rlcore
    python3 tools/bench_vs_trl.py --tiny --steps 1 --device cpu                     # a smoke run on the CPU

Both sides run ``--steps`` + 1 GRPO steps on one device; the first is a warm-up and is left out of the medians.

The work (the same on both sides): the random-init model of ``tools/make_tiny_model.py --preset qwen3-0.6b`` (built
once into ``--work-dir``, or ``--model``), the built-in task's prompts in the job's order (``runtime.demo``: the
first ``--prompts`` per step), its reward (``runtime.demo.task.reward``, wrapped as a TRL reward function),
``--group`` samples per prompt of up to ``--max-new-tokens`` tokens at temperature 1, one AdamW optimizer step over
all of them in micro-batches of ``--micro-batch-size`` rows, learning rate ``--lr``, gradient clipping at 1, no KL
term and no reference model, the PPO clip at 0.2, GRPO's group-normalised advantages and the per-sample mean of the
token losses (TRL's ``loss_type="grpo"``, rlcore's default), float32 weights under bf16 autocast on a GPU.

- **rlcore**: ``rlcore-run --hf-checkpoint MODEL --colocate`` in a subprocess (the embedded HF engine shares the
  device with the trainer); its per-step times are read from the job's ``metrics.jsonl``: ``perf/step_time`` (end
  to end), ``perf/rollout_wait_time`` (generation and reward), ``perf/log_probs_time`` (the trainer's old log-prob
  forward), ``perf/train_time`` (log-probs and the optimizer step; the table's train column is the rest),
  ``perf/weight_sync_time`` and ``perf/offload_time``. ``--rlcore-args`` adds flags (e.g. ``"--use-dynamic-batch-size
  --max-tokens-per-gpu 16384"``).
- **TRL**: ``GRPOTrainer`` in this process with plain ``transformers`` ``generate`` (``use_vllm=False``, no paged
  continuous batching), gradient checkpointing off (TRL's default is on: ``--trl-gradient-checkpointing``). Its
  weights are float32 under bf16 autocast, generation included (TRL's default; ``--trl-dtype bfloat16``: weights,
  optimizer state and generation all in bf16, TRL's fastest plain-``generate`` setting).
  A ``TrainerCallback`` times each optimizer step from ``on_step_begin`` to ``on_step_end`` (the device synchronised
  at both); rollout is the time in ``_generate_and_score_completions`` (generation, reward, advantages), train the
  rest. TRL generates once per optimizer step here (``steps_per_generation`` = the accumulation steps), so it needs
  no old log-prob forward.

Tokens per step are the completion tokens generated (a random-init model rarely samples EOS, so about
prompts x group x max-new-tokens). ``PYTORCH_CUDA_ALLOC_CONF`` and other variables pass through to both sides.

TRL is a benchmark-only dependency (``pip install rlcore[trl-bench]``, pinned to ``trl==1.16.0``, which runs with
transformers 5.17). On a machine without network, ``tools/trl-wheels.sh DIR`` (run where the package index is
reachable) downloads the wheels TRL needs beyond rlcore's runtime install; install them with ``pip install
--no-deps DIR/*.whl``, or into a separate folder (``--target``) put on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SIDES = ("rlcore", "trl")
# rlcore's per-step timings in metrics.jsonl (runtime/loop.py, runtime/train/step.py): table column -> key.
RLCORE_TIMES = {
    "step": "perf/step_time",
    "rollout": "perf/rollout_wait_time",
    "log_probs": "perf/log_probs_time",
    "train_total": "perf/train_time",
    "sync": "perf/weight_sync_time",
    "offload": "perf/offload_time",
}
COLUMNS = (
    ("step", "step s"),
    ("rollout", "rollout s"),
    ("log_probs", "log-probs s"),
    ("train", "train s"),
    ("sync", "sync s"),
    ("offload", "offload s"),
)


def rlcore_command(
    *,
    model: str,
    output_dir: str,
    prompts: int,
    group: int,
    max_new_tokens: int,
    steps: int,
    lr: float,
    micro_batch_size: int,
    seed: int,
    extra: Sequence[str] = (),
) -> list[str]:
    """The ``rlcore-run`` command line (as ``python -m runtime.cli``) of ``steps`` colocated GRPO steps, each of
    ``prompts`` x ``group`` samples of the built-in task, one optimizer step over all of them."""
    return [
        sys.executable,
        "-m",
        "runtime.cli",
        "--hf-checkpoint",
        model,
        "--output-dir",
        output_dir,
        "--colocate",
        "--actor-num-gpus-per-node",
        "1",
        "--rollout-batch-size",
        str(prompts),
        "--n-samples-per-prompt",
        str(group),
        "--global-batch-size",
        str(prompts * group),
        "--rollout-max-response-len",
        str(max_new_tokens),
        "--num-rollout",
        str(steps),
        "--lr",
        repr(lr),
        "--micro-batch-size",
        str(micro_batch_size),
        "--seed",
        str(seed),
        *extra,
    ]


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize_rlcore(rows: Sequence[Mapping[str, Any]], *, samples: int, skip: int = 1) -> dict[str, Any]:
    """Medians over the ``metrics.jsonl`` rows of steps ``skip`` on: every ``RLCORE_TIMES`` column (None where the
    key is absent), ``train`` (train time less the log-prob forward) and ``tokens`` (completion tokens per step:
    the mean response length x ``samples``)."""
    rows = [r for r in rows if r["step"] >= skip]
    if not rows:
        raise ValueError(f"no rlcore step after the first {skip} in metrics.jsonl")
    out: dict[str, Any] = {"steps": len(rows)}
    for name, key in RLCORE_TIMES.items():
        out[name] = _median([r[key] for r in rows if r.get(key) is not None])
    trains = [r["perf/train_time"] - r.get("perf/log_probs_time", 0.0) for r in rows if "perf/train_time" in r]
    out["train"] = _median(trains)
    out["tokens"] = _median([r["rollout/response_len_mean"] * samples for r in rows])
    return out


def summarize_trl(
    step_times: Sequence[float], rollout_times: Sequence[float], tokens: Sequence[int], *, skip: int = 1
) -> dict[str, Any]:
    """Medians over TRL's steps ``skip`` on: ``step``, ``rollout``, ``train`` (step less rollout) and ``tokens``;
    ``rollout_times`` and ``tokens`` hold one entry per generation, one generation per step."""
    if len(rollout_times) != len(step_times) or len(tokens) != len(step_times):
        raise ValueError(
            f"TRL generated {len(rollout_times)} times in {len(step_times)} steps: expected one generation per step"
        )
    steps, rollouts, toks = step_times[skip:], rollout_times[skip:], tokens[skip:]
    if not steps:
        raise ValueError(f"no TRL step after the first {skip}")
    return {
        "steps": len(steps),
        "step": _median(steps),
        "rollout": _median(rollouts),
        "train": _median([s - r for s, r in zip(steps, rollouts, strict=True)]),
        "tokens": _median(toks),
    }


def format_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """A Markdown table, a row per side (median seconds, tokens per step, tokens per second of the whole step),
    then TRL's step time over rlcore's when both ran."""

    def cell(value: float | None, fmt: str = "{:.2f}") -> str:
        return "-" if value is None else fmt.format(value)

    head = ["side", "steps", *(label for _, label in COLUMNS), "tokens/step", "tokens/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for side, r in results.items():
        rate = r["tokens"] / r["step"] if r.get("tokens") and r.get("step") else None
        cells = [side, str(r["steps"]), *(cell(r.get(key)) for key, _ in COLUMNS)]
        cells += [cell(r.get("tokens"), "{:.0f}"), cell(rate, "{:.0f}")]
        lines.append("| " + " | ".join(cells) + " |")
    if "rlcore" in results and "trl" in results:
        ratio = results["trl"]["step"] / results["rlcore"]["step"]
        lines.append(f"\nTRL step / rlcore step: {ratio:.2f}x (median seconds per step; above 1: rlcore is faster)")
    return "\n".join(lines)


def build_model(work_dir: Path, *, tiny: bool, seed: int) -> str:
    """The benchmark's model folder under ``work_dir``, built on first use (tiny Llama or the qwen3-0.6b preset)."""
    from runtime.demo import task
    from runtime.demo.tiny_model import make_preset_model, make_tiny_model

    folder = work_dir / ("model-tiny" if tiny else "model-qwen3-0.6b")
    if (folder / "config.json").exists():
        return str(folder)
    if tiny:
        return str(make_tiny_model(folder, alphabet=task.ALPHABET, seed=seed))
    return str(make_preset_model("qwen3-0.6b", folder, alphabet=task.ALPHABET, seed=seed))


def run_rlcore(args: argparse.Namespace, model: str) -> dict[str, Any]:
    out = Path(args.work_dir) / "rlcore"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cmd = rlcore_command(
        model=model,
        output_dir=str(out),
        prompts=args.prompts,
        group=args.group,
        max_new_tokens=args.max_new_tokens,
        steps=args.steps + 1,
        lr=args.lr,
        micro_batch_size=args.micro_batch_size,
        seed=args.seed,
        extra=shlex.split(args.rlcore_args),
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    log = Path(args.work_dir) / "rlcore.log"
    print(f"rlcore: {shlex.join(cmd)}\n  (output in {log})", flush=True)
    start = time.perf_counter()
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = log.read_text().splitlines()[-40:]
        raise RuntimeError(f"rlcore-run exited with {rc}; the end of {log}:\n" + "\n".join(tail))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    result = summarize_rlcore(rows, samples=args.prompts * args.group)
    print(f"rlcore: {len(rows)} steps in {time.perf_counter() - start:.1f} s (with start-up)", flush=True)
    return result


def builtin_reward(prompts: list, completions: list[str], label: list[str], **_: Any) -> list[float]:
    """The built-in task's reward (``runtime.demo.task.reward``) as a TRL reward function: ``label`` is the dataset's
    column of that name, one entry per completion."""
    from runtime.demo import task
    from runtime.rollout.sample import Sample

    return [task.reward(None, Sample(response=c, label=y)) for c, y in zip(completions, label, strict=True)]


def run_trl(args: argparse.Namespace, model: str) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from runtime.demo import NUM_PROMPTS, task

    cuda = args.device != "cpu"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    steps = args.steps + 1
    # The job's prompts in its order (rlcore-run without --prompt-data and --rollout-shuffle: the pool in order).
    records = task.make_records(NUM_PROMPTS, seed=args.seed)[: args.prompts * steps]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "label": r["label"]} for r in records])
    samples = args.prompts * args.group
    config = GRPOConfig(
        output_dir=str(Path(args.work_dir) / "trl"),
        max_steps=steps,
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=samples // args.micro_batch_size,
        num_generations=args.group,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        loss_type="grpo",
        scale_rewards="group",
        use_vllm=False,
        bf16=cuda,
        use_cpu=not cuda,
        gradient_checkpointing=args.trl_gradient_checkpointing,
        model_init_kwargs={"dtype": args.trl_dtype},
        shuffle_dataset=False,
        seed=args.seed,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    step_times: list[float] = []
    rollout_times: list[float] = []
    tokens: list[int] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            sync()
            self.start = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            sync()
            step_times.append(time.perf_counter() - self.start)

    class TimedGRPOTrainer(GRPOTrainer):
        # (Private methods of trl 1.16's GRPOTrainer, wrapped to split a step; the pinned version has them.)
        def _generate_and_score_completions(self, inputs):
            sync()
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            sync()
            rollout_times.append(time.perf_counter() - start)
            return out

        def _generate(self, prompts):
            out = super()._generate(prompts)
            tokens.append(sum(len(ids) for ids in out[1]))  # (prompt_ids, completion_ids, ...)
            return out

    trainer = TimedGRPOTrainer(
        model=model, reward_funcs=builtin_reward, args=config, train_dataset=dataset, callbacks=[StepTimer()]
    )
    trainer.remove_callback(PrinterCallback)  # (its per-step log lines; the table says what is measured)
    start = time.perf_counter()
    trainer.train()
    print(f"trl: {len(step_times)} steps in {time.perf_counter() - start:.1f} s", flush=True)
    return summarize_trl(step_times, rollout_times, tokens)


def _versions() -> str:
    import torch
    import transformers

    parts = [f"torch {torch.__version__}", f"transformers {transformers.__version__}"]
    try:
        import trl

        parts.append(f"trl {trl.__version__}")
    except ImportError:
        parts.append("trl not installed")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="measured steps per side (one warm-up step more)")
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when there is one)")
    parser.add_argument("--tiny", action="store_true", help="the tiny Llama and small shapes: a smoke run")
    parser.add_argument("--only", choices=SIDES, help="run one side")
    parser.add_argument("--model", help="an HF model folder to use instead of building the benchmark's")
    parser.add_argument("--work-dir", default="outputs/bench_vs_trl", help="model, logs, rlcore's output")
    parser.add_argument("--prompts", type=int, help="prompts per step (default 8; --tiny 2)")
    parser.add_argument("--group", type=int, help="samples per prompt (default 8; --tiny 4)")
    parser.add_argument("--max-new-tokens", type=int, help="longest completion (default 512; --tiny 16)")
    parser.add_argument("--micro-batch-size", type=int, help="rows per forward/backward (default 8; --tiny 4)")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--seed", type=int, default=1234, help="rlcore-run's default seed: the job's prompt order")
    parser.add_argument("--rlcore-args", default="", help="more rlcore-run flags, one string")
    parser.add_argument("--trl-gradient-checkpointing", action="store_true", help="TRL's default (off here)")
    parser.add_argument(
        "--trl-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="TRL's weights: float32 under bf16 autocast (TRL's default, as rlcore's trainer), or all bfloat16",
    )
    args = parser.parse_args(argv)
    defaults = (2, 4, 16, 4) if args.tiny else (8, 8, 512, 8)
    for name, value in zip(("prompts", "group", "max_new_tokens", "micro_batch_size"), defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, value)
    samples = args.prompts * args.group
    if args.steps < 1 or min(args.prompts, args.group, args.max_new_tokens, args.micro_batch_size) < 1:
        parser.error("--steps, --prompts, --group, --max-new-tokens and --micro-batch-size must be positive")
    if samples % args.micro_batch_size:
        parser.error(f"--micro-batch-size {args.micro_batch_size} must divide --prompts x --group = {samples}")
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # (before CUDA starts here; the rlcore subprocess inherits it)
    elif args.device.startswith("cuda:"):
        os.environ["CUDA_VISIBLE_DEVICES"] = args.device.removeprefix("cuda:")
    elif args.device != "cuda":
        parser.error(f"--device must be cuda, cuda:N or cpu, got {args.device!r}")
    sides = [args.only] if args.only else list(SIDES)
    if "trl" in sides:
        try:
            import trl  # noqa: F401
        except ImportError:
            parser.error("TRL is not installed: pip install 'rlcore[trl-bench]' (offline: tools/trl-wheels.sh)")

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model = args.model or build_model(work, tiny=args.tiny, seed=0)
    results: dict[str, dict[str, Any]] = {}
    for side in sides:
        results[side] = run_rlcore(args, model) if side == "rlcore" else run_trl(args, model)
    (work / "results.json").write_text(json.dumps(results, indent=1))
    print(
        f"\n{model}: {args.prompts} prompts x {args.group} samples x up to {args.max_new_tokens} tokens, "
        f"micro-batch {args.micro_batch_size}, lr {args.lr:g}, device {args.device}, TRL weights {args.trl_dtype}; "
        f"median of {args.steps} steps after a warm-up; {_versions()}"
    )
    print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
