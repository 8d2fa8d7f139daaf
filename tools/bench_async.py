"""Sync vs one-step async vs fully async on the default job: steps per minute and the last-10 mean reward.

    .venv/bin/python tools/bench_async.py                      # 3 seeds x 3 schedules, the default job (CPU)
    .venv/bin/python tools/bench_async.py --seeds 1 --num-rollout 60 -- --rollout-batch-size 16
    python3 tools/bench_async.py --parallel --cpus-per-run 3   # all 9 runs at once on a many-core host

Each run is ``rlcore-run`` in this process (its own Ray session), with the schedule and seed set and any flags after
``--`` passed through (e.g. ``--hf-checkpoint`` of ``tools/make_tiny_model.py --preset qwen3-0.6b`` on a GPU host;
a job with ``--hf-checkpoint`` takes slime's defaults, so add ``--actor-num-gpus-per-node 1`` there).
Steps per minute count the training loop only (from the first step's start to the last step's end: Ray start and the
model build are left out); the table's last column is async's last-10 reward minus sync's for the same seed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

SCHEDULES = ("sync", "one_step", "fully_async")


def one_run(
    schedule: str, seed: int, num_rollout: int, extra: list[str], out: str, *, warmup: int = 0
) -> tuple[float, float]:
    import ray

    from runtime.config import parse_args
    from runtime.loop import run

    argv = ["--rollout-schedule", schedule, "--seed", str(seed), "--num-rollout", str(num_rollout)]
    cfg = parse_args([*argv, "--output-dir", out, "--no-use-tensorboard", *extra])
    history = run(cfg, progress=False).history
    ray.shutdown()
    timed = history[warmup:]
    seconds = sum(row["perf/step_time"] for row in timed)
    last = [row["rollout/reward_mean"] for row in history[-10:]]
    return len(timed) / seconds * 60, statistics.fmean(last)


def _table(rows: list[dict]) -> None:
    sync = {r["seed"]: r["reward"] for r in rows if r["schedule"] == "sync"}
    print("\n| seed | schedule | steps/min | last-10 reward | minus sync |\n| --- | --- | --- | --- | --- |")
    for r in sorted(rows, key=lambda r: (r["seed"], SCHEDULES.index(r["schedule"]))):
        delta = f"{r['reward'] - sync[r['seed']]:+.3f}" if r["seed"] in sync else "n/a"
        print(f"| {r['seed']} | {r['schedule']} | {r['rate']:.1f} | {r['reward']:.3f} | {delta} |")
    for schedule in SCHEDULES:
        mine = [r for r in rows if r["schedule"] == schedule]
        if mine:
            rate = statistics.fmean(r["rate"] for r in mine)
            reward = statistics.fmean(r["reward"] for r in mine)
            print(f"mean {schedule}: {rate:.1f} steps/min, last-10 reward {reward:.3f}")


def _parallel(runs: list[tuple[str, int]], args: argparse.Namespace, extra: list[str]) -> list[dict]:
    """Each run in its own process pinned to ``--cpus-per-run`` cores of their own (the job sizes itself from its
    affinity mask), so that runs side by side on a many-core host do not share cores."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < len(runs) * args.cpus_per_run:
        raise SystemExit(f"{len(runs)} runs x {args.cpus_per_run} cores need more than the {len(cores)} cores here")
    procs = []
    for i, (schedule, seed) in enumerate(runs):
        mine = set(cores[i * args.cpus_per_run : (i + 1) * args.cpus_per_run])
        cmd = [sys.executable, __file__, "--one", schedule, str(seed), "--num-rollout", str(args.num_rollout)]
        cmd += ["--warmup-steps", str(args.warmup_steps)]
        procs.append(
            subprocess.Popen(
                [*cmd, "--", *extra],
                stdout=subprocess.PIPE,
                text=True,
                preexec_fn=lambda mine=mine: os.sched_setaffinity(0, mine),
            )
        )
    rows = []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"a run failed (exit {proc.returncode}):\n{out}")
        row = json.loads(out.strip().splitlines()[-1])
        print(f"seed {row['seed']} {row['schedule']:<12} {row['rate']:7.1f} steps/min  last-10 {row['reward']:.3f}")
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1 :]
        argv = argv[: argv.index("--")]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--num-rollout", type=int, default=250)
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated subset of " + str(SCHEDULES))
    parser.add_argument("--warmup-steps", type=int, default=0, help="first steps left out of steps/min")
    parser.add_argument("--parallel", action="store_true", help="every run at once, each on cores of its own")
    parser.add_argument("--cpus-per-run", type=int, default=2)
    parser.add_argument("--one", nargs=2, metavar=("SCHEDULE", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        schedule, seed = args.one[0], int(args.one[1])
        with tempfile.TemporaryDirectory() as out:
            rate, reward = one_run(schedule, seed, args.num_rollout, extra, out, warmup=args.warmup_steps)
        print(json.dumps({"seed": seed - 1234, "schedule": schedule, "rate": rate, "reward": reward}))
        return 0
    schedules = [s for s in args.schedules.split(",") if s]
    if unknown := set(schedules) - set(SCHEDULES):
        parser.error(f"--schedules: unknown {sorted(unknown)}; choose from {SCHEDULES}")
    runs = [(schedule, 1234 + seed) for seed in range(args.seeds) for schedule in schedules]
    if args.parallel:
        rows = _parallel(runs, args, extra)
    else:
        rows = []
        for schedule, seed in runs:
            with tempfile.TemporaryDirectory() as out:
                rate, reward = one_run(schedule, seed, args.num_rollout, extra, out, warmup=args.warmup_steps)
            rows.append({"seed": seed - 1234, "schedule": schedule, "rate": rate, "reward": reward})
            print(f"seed {seed - 1234} {schedule:<12} {rate:7.1f} steps/min  last-10 reward {reward:.3f}", flush=True)
    _table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
