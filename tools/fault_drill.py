"""Fault drill: small CPU jobs of ``rlcore-run`` with a process killed at a chosen point, and the reliability table.

Each drill runs the built-in job in a child process (``python -m runtime.cli``), waits for a step to be logged, then
SIGKILLs one process of that job (found among the job's own descendants by its Ray process title: an engine while it
generates, a trainer while it trains, or the driver itself) and reports what happened: the outcome (exit status),
the samples lost (prompts of the data schedule that were never trained, compared with an uninterrupted run's
ledger), the steps done twice (steps logged before the kill and run again after it) and the time from the kill to the
next logged step. A killed driver is followed by the ``--load`` resume a user would run.

    python tools/fault_drill.py            # every drill, then the table
    python tools/fault_drill.py --only engine-2

Times are wall-clock on the machine it runs on (the jobs share its cores with Ray).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
# The built-in job, small: 4 prompts x 4 samples a step, 5 steps.
JOB = [
    "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
    "--micro-batch-size", "4", "--rollout-max-response-len", "5", "--no-use-tensorboard", "--num-rollout", "5",
    "--rollout-health-check-interval", "1", "--rollout-health-check-timeout", "5",
]  # fmt: skip
METRICS, LEDGER = "metrics.jsonl", "rollout_ledger.jsonl"
# The fake SGLang server (tests/fake_sglang.py) behind the real router; health checks may take longer through it.
SGLANG = (
    "--rollout-engine", "sglang", "--sglang-server-command", f"{sys.executable} {ROOT / 'tests' / 'fake_sglang.py'}",
    "--sglang-server-startup-timeout", "120", "--rollout-health-check-timeout", "30",
)  # fmt: skip
# The embedded engines over the weight-update group (gloo on the CPU), in small buckets: a broadcast of many calls.
BROADCAST = (
    "--rollout-num-gpus", "2", "--update-weight-transport", "nccl", "--update-weight-buffer-size", "4096",
    "--rollout-health-check-timeout", "3",
)  # fmt: skip


def job_processes(root_pid: int, title: str, *, anywhere: bool = False) -> list[psutil.Process]:
    """The descendants of ``root_pid`` whose Ray process title (their argv[0]) starts with ``title``, e.g.
    ``ray::HFEngine.generate`` (an engine while it generates) or ``ray::TrainerWorker.train_rollout``; with
    ``anywhere``, those whose command line contains ``title`` (``fake_sglang.py``: the launched fake servers)."""
    found = []
    try:
        children = psutil.Process(root_pid).children(recursive=True)
    except psutil.Error:
        return []
    for p in children:
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        if cmd and (title in " ".join(cmd) if anywhere else cmd[0].startswith(title)):
            found.append(p)
    return found


def logged_steps(out: Path) -> list[int]:
    """The steps in ``out/metrics.jsonl`` (complete lines only)."""
    path = out / METRICS
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return steps


@dataclass
class Kill:
    """What a killer did: when (seconds since the epoch), which pid, the steps logged then."""

    at: float | None = None
    pid: int | None = None
    steps_before: int = 0
    cmdline: str = ""


def kill_when(
    root_pid: int,
    title: str,
    out: Path,
    *,
    after_steps: int,
    timeout: float = 600.0,
    poll_s: float = 0.005,
    target: str | None = None,
    sig: int = signal.SIGKILL,
) -> tuple[threading.Thread, Kill]:
    """Start a thread that, once ``after_steps`` steps are logged in ``out``, sends ``sig`` (SIGKILL) to the first
    descendant of ``root_pid`` whose title starts with ``title`` (``title == "driver"``: ``root_pid`` itself); with
    ``target``, once such a process is seen, to the first descendant whose command line contains ``target``
    instead (e.g. a fake SGLang server, killed while the router's client generates)."""
    kill = Kill()

    def watch() -> None:
        deadline = time.time() + timeout
        while time.time() < deadline and len(logged_steps(out)) < after_steps:
            time.sleep(0.05)
        while time.time() < deadline:
            targets = [psutil.Process(root_pid)] if title == "driver" else job_processes(root_pid, title)
            if targets and target is not None:
                targets = job_processes(root_pid, target, anywhere=True)
            if targets:
                kill.steps_before = len(logged_steps(out))
                kill.pid, kill.at = targets[0].pid, time.time()
                with contextlib.suppress(psutil.Error):
                    kill.cmdline = " ".join(targets[0].cmdline())
                os.kill(targets[0].pid, sig)
                return
            time.sleep(poll_s)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread, kill


@dataclass
class JobRun:
    """A finished job: its exit status, its output, the kill made meanwhile and when each step was first logged."""

    status: int
    text: str
    kill: Kill
    step_seen: dict[int, float]


def run_job(
    args: list[str],
    *,
    kill: tuple[str, int] | None = None,
    timeout: float = 900.0,
    target: str | None = None,
    sig: int = signal.SIGKILL,
) -> JobRun:
    """Run ``rlcore-run args`` in a child process, killing ``(title, after_steps)`` meanwhile (see
    :func:`kill_when` for ``target`` and ``sig``)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = Path(args[args.index("--output-dir") + 1])
    seen_before = set(logged_steps(out))
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.cli", *args], env=env, stdout=log, stderr=log, text=True
        )
        killed = Kill()
        if kill is not None:
            _, killed = kill_when(proc.pid, kill[0], out, after_steps=kill[1], target=target, sig=sig)
        step_seen: dict[int, float] = {}
        deadline = time.time() + timeout
        while proc.poll() is None and time.time() < deadline:
            for i, _ in enumerate(logged_steps(out)):
                step_seen.setdefault(i, time.time())
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.seek(0)
        text = log.read()
    for i, _ in enumerate(logged_steps(out)):
        step_seen.setdefault(i, time.time())
    del seen_before
    return JobRun(proc.returncode, text, killed, step_seen)


def ledger_prompts(out: Path) -> list[int]:
    """Every prompt index trained, step by step, from the rollout ledger (the last row of each step)."""
    rows = {}
    if (out / LEDGER).exists():
        for line in (out / LEDGER).read_text().splitlines():
            row = json.loads(line)
            rows[row["step"]] = row["trained"]
    return [i for step in sorted(rows) for i in rows[step]]


@dataclass
class Drill:
    name: str
    killed: str
    title: str
    after_steps: int
    extra: tuple[str, ...] = ()
    target: str | None = None  # killed instead, once ``title`` is seen (a command-line substring)
    sig: int = signal.SIGKILL


DRILLS = [
    Drill("engine-2", "one of 2 engines, mid-rollout", "ray::HFEngine.generate", 2, ("--rollout-num-gpus", "2")),
    Drill("engine-1", "the only engine, mid-rollout", "ray::HFEngine.generate", 2),
    Drill(
        "engine-off",
        "the only engine, --no-use-fault-tolerance",
        "ray::HFEngine.generate",
        2,
        ("--no-use-fault-tolerance",),
    ),  # fmt: skip
    Drill(
        "trainer",
        "the trainer, mid-step (--save-interval 1)",
        "ray::TrainerWorker.train_rollout",
        2,
        ("--save-interval", "1"),
    ),  # fmt: skip
    Drill(
        "trainer-2",
        "one trainer rank of 2, mid-step (--save-interval 1)",
        "ray::TrainerWorker.train_rollout",
        2,
        ("--save-interval", "1", "--actor-num-gpus-per-node", "2"),
    ),  # fmt: skip
    Drill("driver", "the driver, then --load by hand (--save-interval 1)", "driver", 2, ("--save-interval", "1")),
    Drill("sglang-2", "one of 2 SGLang servers, mid-rollout", "ray::SGLangEngine.generate", 2,
          (*SGLANG, "--rollout-num-gpus", "2"), target="fake_sglang.py"),
    Drill("sglang-1", "the only SGLang server, mid-rollout", "ray::SGLangEngine.generate", 2, SGLANG,
          target="fake_sglang.py"),
    Drill("sync-killed", "one of 2 engines, mid-broadcast (gloo group)",
          "ray::HFEngine.update_weights_from_distributed", 2, BROADCAST),
    Drill("sync-hung", "one of 2 engines stopped (SIGSTOP), mid-broadcast (gloo group)",
          "ray::HFEngine.update_weights_from_distributed", 2, BROADCAST, sig=signal.SIGSTOP),
    Drill("async", "one of 2 engines, mid-rollout, --async", "ray::HFEngine.generate", 2,
          ("--rollout-num-gpus", "2", "--async")),
]  # fmt: skip


def run_drill(drill: Drill, work: Path, baseline: list[int]) -> dict[str, object]:
    out, ckpt = work / drill.name / "out", work / drill.name / "ckpt"
    args = [*JOB, *drill.extra, "--output-dir", str(out), "--save", str(ckpt)]
    job = run_job(args, kill=(drill.title, drill.after_steps), target=drill.target, sig=drill.sig)
    kill, final, text = job.kill, job.status, job.text
    lines_logged = dict(job.step_seen)
    resumed_at = None
    if drill.title == "driver" and kill.at is not None:
        resumed_at = int((ckpt / "latest").read_text().removeprefix("step_"))
        resumed = run_job([*args, "--load", str(ckpt)])
        final, text = resumed.status, text + resumed.text
        lines_logged = {k: v for k, v in resumed.step_seen.items() if k >= len(job.step_seen)} | {
            k: v for k, v in job.step_seen.items()
        }
    next_line = [t for i, t in lines_logged.items() if i >= kill.steps_before and kill.at is not None and t > kill.at]
    trained = ledger_prompts(out)
    n = int(JOB[JOB.index("--n-samples-per-prompt") + 1])
    lost = sum(1 for i in baseline if i not in trained) * n if final == 0 else "-"
    messages = [line for line in text.splitlines() if line.startswith("rlcore-run:") and " done, " not in line]
    return {
        "drill": drill.name,
        "killed": drill.killed,
        "when": f"step {kill.steps_before} (0-based)" if kill.at is not None else "never (no target seen)",
        "outcome": ("completed" if final == 0 else f"stopped, exit {final}"),
        "samples lost": lost,
        "steps redone": redone_steps(text, kill.steps_before, resumed_at) if kill.at is not None else "-",
        "kill to next step s": f"{min(next_line) - kill.at:.1f}" if next_line else "-",
        "trained as baseline": (trained == baseline) if final == 0 else "-",
        "message": "; ".join(m.removeprefix("rlcore-run: ")[:110] for m in messages[-2:]),
    }


def redone_steps(text: str, steps_before: int, resumed_at: int | None) -> int:
    """Completed steps trained twice: those logged before the kill but after the checkpoint a trainer restart (its
    ``rebuilt from ... (step K)`` line) or a resume by hand (``resumed_at``) went back to."""
    for line in text.splitlines():
        if "the job is rebuilt from" in line and "(step " in line:
            resumed_at = int(line.rsplit("(step ", 1)[1].split(")")[0])
    return 0 if resumed_at is None else max(steps_before - resumed_at, 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="drill names (default: all)")
    parser.add_argument("--work-dir", default=None, help="where the jobs write (default: a temporary folder)")
    args = parser.parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="rlcore-drill-"))
    base_out = work / "baseline" / "out"
    t = time.time()
    base = run_job([*JOB, "--output-dir", str(base_out)])
    if base.status != 0:
        print(base.text[-3000:])
        return 1
    baseline = ledger_prompts(base_out)
    times = sorted(base.step_seen.values())
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    print(
        f"baseline: {len(baseline)} prompts trained in {time.time() - t:.0f} s, uninterrupted; a step every "
        f"{sum(gaps) / max(len(gaps), 1):.1f} s"
    )
    rows = []
    for drill in DRILLS:
        if args.only and drill.name not in args.only:
            continue
        t = time.time()
        rows.append(run_drill(drill, work, baseline))
        rows[-1]["job s"] = f"{time.time() - t:.0f}"
        print(json.dumps(rows[-1]), flush=True)
    print_table(rows)
    return 0


def print_table(rows: list[dict[str, object]]) -> None:
    columns = ["killed", "when", "outcome", "samples lost", "steps redone", "kill to next step s", "job s", "message"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row.get(c, "")) for c in columns) + " |")


if __name__ == "__main__":
    sys.exit(main())
