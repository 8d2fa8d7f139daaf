"""The same job on 1, 2 and 4 GPUs under each placement and schedule: step time and its parts, speed-up, efficiency.

    python tools/bench_scale.py                          # qwen3-0.6b preset, 1/2/4 GPUs (as many as the host has)
    python tools/bench_scale.py --gpus 1 2 --steps 5 --out /tmp/scale

The job is issue 26's: a random-init model of a real shape (``tools/make_tiny_model.py --preset``) on the built-in
task, 8 prompts x 8 samples x up to 512 tokens a step, global batch 64, micro-batch 8. Each placement is one
``rlcore-run`` (:data:`PLACEMENTS`); the figures are medians over the steps after ``--warmup`` (compilation, the
first sync and the allocator's growth stay out). Jobs whose GPU sets do not overlap run at the same time
(``--parallel``), each on its own devices (``CUDA_VISIBLE_DEVICES``) and its own Ray.

Columns: step (``perf/step_time``), rollout (the generation's own seconds, ``perf/rollout_time``: under one_step it
overlaps training), log-probs (``perf/log_probs_time``), train (``perf/train_time``, which includes the log-probs),
sync (``perf/weight_sync_time``), speed-up (one GPU's step / this step), efficiency (speed-up / GPUs), and for
one_step the bound of issue 26: step / (max(rollout, train) + sync), at most 1.1 when the overlap works. The last
lines name the fastest plan per GPU count and the default (``runtime.cluster.plan.plan_for``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from runtime.cluster.plan import plan_for  # noqa: E402

JOB = ["--rollout-batch-size", "8", "--n-samples-per-prompt", "8", "--global-batch-size", "64",
       "--micro-batch-size", "8", "--rollout-max-response-len", "512"]  # fmt: skip


def _split(n: int, schedule: str) -> list[str] | None:
    """Half the n GPUs train, the rest generate, under ``schedule``; None below two GPUs."""
    if n < 2:
        return None
    trainers = n // 2
    return ["--actor-num-gpus-per-node", str(trainers), "--rollout-num-gpus", str(n - trainers), "--rollout-schedule",
            schedule]  # fmt: skip


def _one_trainer(n: int) -> list[str] | None:
    """One GPU trains, the other n - 1 generate, one step apart; None below three GPUs (on two it is split_async)."""
    if n < 3:
        return None
    return ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", str(n - 1), "--rollout-schedule", "one_step"]


# Placement name -> its flags on n GPUs (None: the placement needs more GPUs than n). The names are the plans of
# runtime.cluster.plan.PLANS, and split_sync (split_async's schedule-free baseline).
PLACEMENTS: dict[str, Callable[[int], list[str] | None]] = {
    "colocated_dp": lambda n: ["--colocate", "--actor-num-gpus-per-node", str(n)],
    "split_sync": lambda n: _split(n, "sync"),
    "split_async": lambda n: _split(n, "one_step"),
    "one_trainer_async": _one_trainer,
}
# Placements run one step apart, whose step has issue 26's bound.
ASYNC = ("split_async", "one_trainer_async")
COLUMNS = {
    "step": "perf/step_time",
    "rollout": "perf/rollout_time",
    "log-probs": "perf/log_probs_time",
    "train": "perf/train_time",
    "sync": "perf/weight_sync_time",
}


def python_path() -> str:
    """This checkout first, then whatever the caller's ``PYTHONPATH`` holds (where the dependencies may be)."""
    return os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])


def run_job(model: str, gpus: list[int], flags: list[str], out: Path, steps: int, timeout: float) -> list[dict]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)), "PYTHONPATH": python_path()}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "runtime.cli", "--hf-checkpoint", model, *JOB, *flags, "--num-rollout", str(steps),
           "--output-dir", str(out)]  # fmt: skip
    with open(out.with_suffix(".log"), "w") as log:
        try:
            code = subprocess.run(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            code = f"timed out after {timeout:g} s"
    if code != 0:
        tail = out.with_suffix(".log").read_text()[-1500:]
        raise RuntimeError(f"{' '.join(flags)} on GPUs {gpus} failed ({code}):\n{tail}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def result_file(out: Path, n: int, name: str) -> Path:
    """Where a job's medians are kept, so that a later ``--report-only`` prints them with other runs' (jobs of one
    table may run in separate invocations on disjoint GPUs)."""
    return out / f"{n}gpu-{name}.medians.json"


def medians(rows: list[dict], warmup: int) -> dict[str, float]:
    kept = [r for r in rows if r["step"] >= warmup]
    return {
        name: statistics.median(r[key] for r in kept) if all(r.get(key) is not None for r in kept) else float("nan")
        for name, key in COLUMNS.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--model", help="an HF folder instead of building --preset")
    parser.add_argument("--gpus", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    # split_sync is the one-step schedule's baseline; it is left out by default to keep the run short.
    parser.add_argument(
        "--placements",
        nargs="+",
        default=["colocated_dp", "split_async", "one_trainer_async"],
        choices=list(PLACEMENTS),
    )
    parser.add_argument("--parallel", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--skip", nargs="*", default=[], metavar="N:PLACEMENT", help="jobs left out, e.g. 2:colocated_dp"
    )
    parser.add_argument(
        "--report-only", action="store_true", help="run nothing: print the table of the jobs whose medians --out holds"
    )
    parser.add_argument("--out", default=None)
    parser.add_argument("--job-timeout", type=float, default=900, help="seconds a job may take before it is stopped")
    args = parser.parse_args()
    import torch

    have = torch.cuda.device_count() if not args.report_only else max(args.gpus)
    counts = [n for n in args.gpus if n <= have]
    if not counts:
        raise SystemExit(f"bench_scale needs GPUs: this host has {have}")
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-scale-"))
    out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None and not args.report_only:
        model = str(out / args.preset)
        if not (Path(model) / "config.json").exists():
            subprocess.run([sys.executable, str(REPO / "tools/make_tiny_model.py"), "--preset", args.preset, model],
                           check=True, env={**os.environ, "PYTHONPATH": python_path()})  # fmt: skip
    # One GPU runs its one plan (every speed-up's base) whatever --placements says.
    jobs = [(1, "colocated_dp", PLACEMENTS["colocated_dp"](1))] if 1 in counts else []
    jobs += [
        (n, name, flags)
        for n in counts
        for name in args.placements
        if n > 1 and (flags := PLACEMENTS[name](n)) and f"{n}:{name}" not in args.skip
    ]
    results: dict[tuple[int, str], dict[str, float]] = {}
    if args.report_only:
        jobs, results = (
            [],
            {
                (n, name): json.loads(result_file(out, n, name).read_text())
                for n in counts
                for name in PLACEMENTS
                if result_file(out, n, name).is_file()
            },
        )
    # Waves of jobs on disjoint GPUs: each wave fills the host's GPUs with the largest jobs first.
    waves: list[list[tuple[int, str, list[str]]]] = []
    for job in sorted(jobs, key=lambda j: -j[0]):
        for wave in waves if args.parallel else []:
            if sum(j[0] for j in wave) + job[0] <= have:
                wave.append(job)
                break
        else:
            waves.append([job])
    for wave in waves:
        start = 0
        placed = []
        for n, name, flags in wave:
            placed.append((n, name, flags, list(range(start, start + n))))
            start += n
        began = time.perf_counter()
        with ThreadPoolExecutor(len(placed)) as pool:
            futures = {
                (n, name): pool.submit(
                    run_job, model, gpus, flags, out / f"{n}gpu-{name}", args.steps, args.job_timeout
                )
                for n, name, flags, gpus in placed
            }
            for key, future in futures.items():
                try:
                    results[key] = medians(future.result(), args.warmup)
                except RuntimeError as err:  # a failed job is reported and the others go on
                    print(f"{key[0]} GPU {key[1]}: {err}", flush=True)
                    continue
                result_file(out, *key).write_text(json.dumps(results[key]))
        print(
            f"(wave {[f'{n} GPU {name}' for n, name, _, _ in placed]}: {time.perf_counter() - began:.0f} s)",
            flush=True,
        )
    base = results.get((1, "colocated_dp"), {}).get("step")
    header = ["GPUs", "plan", *COLUMNS, "speed-up", "efficiency", "step / async bound"]
    print("| " + " | ".join(header) + " |\n|" + " --- |" * len(header))
    for (n, name), m in sorted(results.items()):
        speedup = base / m["step"] if base else float("nan")
        bound = m["step"] / (max(m["rollout"], m["train"]) + m["sync"]) if name in ASYNC else None
        cells = [str(n), name, *(f"{m[c]:.3f}" for c in COLUMNS), f"{speedup:.2f}x", f"{speedup / n:.2f}"]
        print("| " + " | ".join([*cells, f"{bound:.2f}" if bound else "-"]) + " |")
    for n in counts:
        measured = {name: m["step"] for (k, name), m in results.items() if k == n}
        if not measured:
            continue
        fastest = min(measured, key=measured.get)
        ratio = f", {measured[fastest] / base:.2f}x one GPU's step" if base else ""
        print(f"{n} GPU(s): fastest {fastest} ({measured[fastest]:.3f} s{ratio}); default plan {plan_for(n)}")
    print(f"(model {args.preset if args.model is None else model}, {args.steps} steps, medians of steps >= "
          f"{args.warmup}; logs in {out})")  # fmt: skip


if __name__ == "__main__":
    main()
