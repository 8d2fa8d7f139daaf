"""Sync vs one-step async vs fully async on the default job: steps per minute and the last-10 mean reward.

    .venv/bin/python tools/bench_async.py                      # 3 seeds x 3 schedules, the default job (CPU)
    .venv/bin/python tools/bench_async.py --seeds 1 --num-rollout 60 -- --rollout-batch-size 16

Each run is ``rlcore-run`` in this process (its own Ray session), with the schedule and seed set and any flags after
``--`` passed through (e.g. ``--hf-checkpoint`` of ``tools/make_tiny_model.py --preset qwen3-0.6b`` on a GPU host).
Steps per minute count the training loop only (from the first step's start to the last step's end: Ray start and the
model build are left out); the table's last column is async's last-10 reward minus sync's for the same seed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile

SCHEDULES = ("sync", "one_step", "fully_async")


def one_run(schedule: str, seed: int, num_rollout: int, extra: list[str], out: str) -> tuple[float, float]:
    import ray

    from runtime.config import parse_args
    from runtime.loop import run

    argv = ["--rollout-schedule", schedule, "--seed", str(seed), "--num-rollout", str(num_rollout)]
    cfg = parse_args([*argv, "--output-dir", out, "--no-use-tensorboard", *extra])
    history = run(cfg, progress=False).history
    ray.shutdown()
    seconds = sum(row["perf/step_time"] for row in history)
    last = [row["rollout/reward_mean"] for row in history[-10:]]
    return len(history) / seconds * 60, statistics.fmean(last)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1 :]
        argv = argv[: argv.index("--")]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--num-rollout", type=int, default=250)
    args = parser.parse_args(argv)
    rows = []
    for seed in range(args.seeds):
        sync_reward = None
        for schedule in SCHEDULES:
            with tempfile.TemporaryDirectory() as out:
                rate, reward = one_run(schedule, 1234 + seed, args.num_rollout, extra, out)
            sync_reward = reward if schedule == "sync" else sync_reward
            rows.append((seed, schedule, rate, reward, reward - sync_reward))
            print(f"seed {seed} {schedule:<12} {rate:7.1f} steps/min  last-10 reward {reward:.3f}", flush=True)
    print("\n| seed | schedule | steps/min | last-10 reward | minus sync |\n| --- | --- | --- | --- | --- |")
    for seed, schedule, rate, reward, delta in rows:
        print(f"| {seed} | {schedule} | {rate:.1f} | {reward:.3f} | {delta:+.3f} |")
    for schedule in SCHEDULES:
        rates = [r[2] for r in rows if r[1] == schedule]
        print(f"mean {schedule}: {statistics.fmean(rates):.1f} steps/min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
