"""Run every GPU test file and the headline benches, and write what happened to ``docs/gpu-results.md``.

    python tools/gpu_suite.py                                   # everything, in the order below, on this machine
    python tools/gpu_suite.py --budget-s 240 --commit abc1234   # items start and run within 240 s
    python tools/gpu_suite.py --only test_megatron_cuda.py,logprob_gap --out /tmp/gpu-results.md
    python tools/gpu_suite.py --lanes 2 --gpus-per-lane 2       # four GPUs: two items at a time, two GPUs each
    python tools/gpu_suite.py --list                            # the items and their commands; runs nothing

Each test file runs in its own ``pytest -v`` process (a process group, killed whole at its timeout); its log is
parsed for each test's outcome, so a file cut off by its timeout still reports the tests it finished. Each bench
prints a table; its output is copied into the results. The results file is rewritten after every item, so a run
killed from outside still leaves a file that says what finished. A SIGTERM (an outer ``timeout``'s) kills the items in
flight with their process groups, records what each had finished as "killed at the time limit", marks the items not
started "not run (killed)", writes the file and exits 143.

With ``--lanes N`` the items run N at a time, each lane on its own ``--gpus-per-lane`` GPUs (``CUDA_VISIBLE_DEVICES``):
a lane that finishes an item takes the next one not yet started, in the order above (:func:`lane_devices`). An item
that needs more GPUs than its lane sees (``GPUS_NEEDED``: the four-GPU MoE bench) is "not run (needs N GPUs, ...)".

The file is regenerated on each run (the previous one is in git history), except its hand-kept last section,
``## Earlier figures``, which is carried over as it is: GPU figures from runs made before this tool, or by commands
it does not run, one row each (``E1``, ``E2``, ...) with machine, date and whether their code changed since. README.md
and docs/ cite the rows by those ids or by this run's item names (``test_megatron_cuda.py``, ``bench logprob_gap``);
a claim whose code changed after its run is marked "not rerun since" where it is made. Rerun at the end of each GPU
change: ``make gpu-suite``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The disputed Megatron multi-GPU tests first, then weight sync, then the rest: a run that is cut short loses the
# least-cited items. Test files not named here run after these, in name order.
TEST_ORDER = (
    "test_megatron_cuda.py",
    "test_megatron_moe_cuda.py",
    "test_scale_cuda.py",
    "test_weight_sync_cuda.py",
    "test_runtime_loop_cuda.py",
)
TEST_TIMEOUT_S = 900

# The benches behind the README's figures: (name, arguments after the script, timeout in seconds).
BENCHES = (
    ("logprob_gap", ["tools/bench_logprob_gap.py"], 300),
    ("weight_sync", ["tools/bench_weight_sync.py", "--models", "qwen3-0.6b", "--transports", "ipc", "nccl"], 300),
    ("kernels", ["tools/bench_kernels.py", "--quick"], 600),
    ("train", ["tools/bench_train.py", "--variants", "fused,unfused", "--repeats", "2"], 600),
    ("backends", ["tools/bench_backends.py", "--repeats", "2"], 900),
    # issue 27's MoE figure (docs/runtime.md, "MoE speed"): Qwen3-30B-A3B's layers at EP=4, both dispatchers.
    (
        "backends_moe",
        [
            "tools/bench_backends.py",
            "--preset",
            "qwen3-30b-a3b",
            "--num-layers",
            "8",
            "--seq-len",
            "4096",
            "--prompt-len",
            "256",
            "--samples",
            "64",
            "--nproc",
            "4",
            "--paths",
            "megatron",
            "--expert-model-parallel-size",
            "4",
            "--moe-grouped-gemm",
            "--micro-batch-size",
            "8",
            "--repeats",
            "3",
            "--moe-dispatcher",
            "once_per_rank,megatron",
        ],
        900,
    ),  # fmt: skip
)
# Items that need more GPUs than one: a lane that sees fewer skips them ("not run (needs N GPUs, ...)").
GPUS_NEEDED = {"backends_moe": 4}

OUTCOME = re.compile(r"^(?P<test>\S+::\S+(?:\[.*?\])?)\s+(?P<outcome>PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
STARTED = re.compile(r"^(?P<test>\S+::\S+(?:\[.*?\])?)\s*$")


@dataclass
class Result:
    name: str
    command: list[str]
    status: str = "not run"  # finished | timed out | not run (budget) | exit N | killed at the time limit
    seconds: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    outcomes: dict[str, str] = field(default_factory=dict)
    output: str = ""


def test_files(root: Path = ROOT) -> list[Path]:
    """Every ``tests/test_*_cuda.py``, the ones in ``TEST_ORDER`` first."""
    files = sorted((root / "tests").glob("test_*_cuda.py"))
    rank = {name: i for i, name in enumerate(TEST_ORDER)}
    return sorted(files, key=lambda p: (rank.get(p.name, len(rank)), p.name))


def test_outcomes(text: str) -> dict[str, str]:
    """Each test's outcome in ``pytest -v`` output, in order; a test cut off by a timeout is ``RUNNING``."""
    outcomes: dict[str, str] = {}
    for line in text.splitlines():
        if m := OUTCOME.match(line.strip()):
            outcomes[m["test"]] = m["outcome"]  # a test's teardown ERROR after its PASSED counts as the ERROR
        elif (m := STARTED.match(line.strip())) and m["test"] not in outcomes:
            outcomes[m["test"]] = "RUNNING"  # its outcome follows on the same line unless the run stopped here
    return outcomes


def parse_pytest_log(text: str) -> tuple[dict[str, int], list[str]]:
    """Each outcome's count and the names of the failed (or erroring) tests, from ``pytest -v`` output."""
    outcomes = test_outcomes(text)
    counts = {o: sum(v == o for v in outcomes.values()) for o in OUTCOMES}
    return counts, [t for t, o in outcomes.items() if o in ("FAILED", "ERROR")]


def lane_devices(lanes: int, gpus_per_lane: int, visible: str | None) -> list[str]:
    """Each lane's ``CUDA_VISIBLE_DEVICES``: consecutive slices of ``visible`` (the devices this run may use, from
    its own ``CUDA_VISIBLE_DEVICES``; unset: 0, 1, ...). ``ValueError`` when the slices need more devices than that.
    """
    devices = visible.split(",") if visible else [str(i) for i in range(lanes * gpus_per_lane)]
    if lanes * gpus_per_lane > len(devices):
        raise ValueError(
            f"--lanes {lanes} x --gpus-per-lane {gpus_per_lane} needs {lanes * gpus_per_lane} GPUs; "
            f"CUDA_VISIBLE_DEVICES has {len(devices)}"
        )
    return [",".join(devices[i * gpus_per_lane : (i + 1) * gpus_per_lane]) for i in range(lanes)]


def visible_gpus(visible: str | None) -> int:
    """How many GPUs a lane with ``CUDA_VISIBLE_DEVICES`` = ``visible`` sees (unset: every GPU ``nvidia-smi -L``
    lists; none without it)."""
    if visible:
        return len(visible.split(","))
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in listed.splitlines())


def run_item(
    command: list[str],
    *,
    timeout_s: float,
    log: Path,
    env: dict[str, str] | None = None,
    started: Callable[[subprocess.Popen], None] | None = None,
) -> tuple[str, float, str]:
    """Run ``command`` from the repository root in its own process group; (status, seconds, output). ``started`` is
    called with the process as soon as it runs (so that a SIGTERM handler can kill it)."""
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(
            command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        if started is not None:
            started(proc)
        try:
            code = proc.wait(timeout=timeout_s)
            status = "finished" if code == 0 else f"exit {code}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its spawned ranks and subprocesses too
            proc.wait()
            status = f"timed out ({timeout_s:.0f} s)"
    return status, time.monotonic() - start, log.read_text(errors="replace")


def machine() -> str:
    """The GPUs, CPU and library versions, in one line."""
    try:
        gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout.strip()
        gpus = "; ".join(re.sub(r" \(UUID: .*?\)", "", g) for g in gpus.splitlines()) or "no GPU"
    except (OSError, subprocess.TimeoutExpired):
        gpus = "no nvidia-smi"
    versions = []
    for module in ("torch", "transformers", "megatron.core", "triton"):
        try:
            versions.append(f"{module} {__import__(module, fromlist=['_']).__version__}")
        except Exception:  # noqa: BLE001 (a missing or broken library is reported, not fatal)
            versions.append(f"{module} absent")
    return f"{gpus}; {os.cpu_count()} x {cpu_model()}; Python {platform.python_version()}; " + (", ".join(versions))


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else ``platform.processor()`` (may be empty)."""
    lines = _read("/proc/cpuinfo").splitlines()
    return next((ln.split(":", 1)[1].strip() for ln in lines if "model name" in ln), "") or platform.processor()


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def commit_of(root: Path = ROOT, *, unknown: str = "unknown (no git checkout; pass --commit)") -> str:
    """The short hash of ``root``'s HEAD, or ``unknown`` outside a git checkout."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return unknown


EARLIER = "## Earlier figures"


def earlier_section(text: str) -> str:
    """The hand-kept ``## Earlier figures`` section of a results file (to its end), or nothing."""
    at = text.find("\n" + EARLIER)
    return text[at + 1 :].rstrip() + "\n" if at >= 0 else ""


def render(results: list[Result], *, header: dict[str, str], earlier: str = "") -> str:
    lines = [
        "# GPU results",
        "",
        "Written by `tools/gpu_suite.py` (`make gpu-suite`); regenerated whole on each run.",
        "",
    ]
    lines += [f"- **{k}**: {v}" for k, v in header.items()]
    lines += ["", "## Test files", "", "| file | status | passed | failed | errors | skipped | xfail | seconds |"]
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
    tests = [r for r in results if r.name.endswith(".py")]
    for r in tests:
        c = r.counts
        lines.append(
            f"| `{r.name}` | {r.status} | {c.get('PASSED', 0)} | {c.get('FAILED', 0)} | {c.get('ERROR', 0)} | "
            f"{c.get('SKIPPED', 0)} | {c.get('XFAIL', 0) + c.get('XPASS', 0)} | {r.seconds:.0f} |"
        )
    lines += ["", "Each test's outcome (`RUNNING`: cut off by the file's timeout):", ""]
    for r in tests:
        for test, outcome in r.outcomes.items():
            lines.append(f"- `{test}` {outcome}")
    lines += ["", "## Benches", ""]
    for r in results:
        if r.name.endswith(".py"):
            continue
        lines += [f"### bench {r.name}", "", f"`python {' '.join(r.command[1:])}`: {r.status}, {r.seconds:.0f} s", ""]
        if r.output.strip():
            tail = "\n".join(r.output.rstrip().splitlines()[-40:])
            lines += ["```", tail, "```", ""]
    if earlier:
        lines += ["", earlier.rstrip()]
    return "\n".join(lines).rstrip() + "\n"


def suite_items(*, test_timeout_s: float, benches: bool = True) -> list[tuple[str, list[str], float]]:
    """Every item in run order: (name, command, timeout in seconds); each test file, then each bench."""
    items = [(p.name, [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", str(p.relative_to(ROOT))],
              test_timeout_s) for p in test_files()]  # fmt: skip
    if benches:
        items += [(name, [sys.executable, *cmd], timeout) for name, cmd, timeout in BENCHES]
    return items


KILLED = "killed at the time limit"


def record(result: Result, status: str, seconds: float, output: str) -> None:
    """Fill ``result`` with an item's run; a test file's log is parsed for each test's outcome."""
    result.status, result.seconds, result.output = status, seconds, output
    if result.name.endswith(".py"):
        result.counts, result.failed = parse_pytest_log(output)
        result.outcomes = test_outcomes(output)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "gpu-results.md"))
    parser.add_argument("--log-dir", default=str(ROOT / "outputs" / "gpu_suite"), help="each item's whole log")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="the run's time: no item starts after it, and one still running is stopped at it",
    )
    parser.add_argument("--test-timeout-s", type=float, default=TEST_TIMEOUT_S, help="per test file")
    parser.add_argument("--only", default=None, help="comma-separated test file and bench names")
    parser.add_argument("--no-benches", action="store_true")
    parser.add_argument("--commit", default=None, help="the commit under test (default: git rev-parse HEAD)")
    parser.add_argument("--note", default=None, help="a line for the results' header (why a run was cut short, say)")
    parser.add_argument("--list", action="store_true", help="print the items and their commands; run nothing")
    parser.add_argument("--lanes", type=int, default=1, help="items run at a time, each on its own GPUs")
    parser.add_argument("--gpus-per-lane", type=int, default=1, help="GPUs each lane's items see (with --lanes > 1)")
    args = parser.parse_args(argv)

    items = suite_items(test_timeout_s=args.test_timeout_s, benches=not args.no_benches)
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {name for name, _, _ in items}
        if unknown:
            parser.error(f"--only names no item: {', '.join(sorted(unknown))} (see --list)")
        items = [item for item in items if item[0] in wanted]
    if args.list:
        for name, cmd, timeout in items:
            print(f"{name:32} {timeout:5.0f} s  {' '.join(cmd[1:])}")
        return 0

    started = dt.datetime.now(dt.UTC)
    header = {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "commit": args.commit or commit_of(),
        "command": "python tools/gpu_suite.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    if args.note:
        header["note"] = args.note
    out, logs = Path(args.out), Path(args.log_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    earlier = earlier_section(out.read_text()) if out.is_file() else ""
    results = [Result(name, cmd) for name, cmd, _ in items]
    if args.lanes < 1 or args.gpus_per_lane < 1:
        parser.error("--lanes and --gpus-per-lane must be at least 1")
    if args.lanes == 1:
        devices = [os.environ.get("CUDA_VISIBLE_DEVICES")]
    else:
        try:
            devices = lane_devices(args.lanes, args.gpus_per_lane, os.environ.get("CUDA_VISIBLE_DEVICES"))
        except ValueError as err:
            parser.error(str(err))
        header["lanes"] = ", ".join(f"lane {i}: GPUs {d}" for i, d in enumerate(devices))
    clock, lock = time.monotonic(), threading.Lock()
    pending = list(zip(results, items, strict=True))
    # Items in flight: result -> (process, log, start); emptied by the SIGTERM handler, which owns the file after.
    running: dict[int, tuple[Result, subprocess.Popen, Path, float]] = {}
    stopped = threading.Event()

    def lane(visible: str | None) -> None:
        env = dict(os.environ) if visible is None else {**os.environ, "CUDA_VISIBLE_DEVICES": visible}
        gpus = visible_gpus(env.get("CUDA_VISIBLE_DEVICES"))
        while True:
            with lock:
                if not pending or stopped.is_set():
                    return
                result, (_, cmd, timeout) = pending.pop(0)
            left = None if args.budget_s is None else args.budget_s - (time.monotonic() - clock)
            if left is not None and left <= 0:
                result.status = "not run (budget)"
                continue
            if result.name in GPUS_NEEDED and GPUS_NEEDED[result.name] > gpus:
                result.status = f"not run (needs {GPUS_NEEDED[result.name]} GPUs, the lane has {gpus})"
                continue
            limit = timeout if left is None else min(timeout, left)
            log = logs / f"{result.name}.log"

            def started(proc: subprocess.Popen, result: Result = result, log: Path = log) -> None:
                with lock:
                    running[id(result)] = (result, proc, log, time.monotonic())

            ran = run_item(cmd, timeout_s=limit, log=log, env=env, started=started)
            with lock:
                if stopped.is_set():
                    return  # the SIGTERM handler recorded this item and wrote the file
                running.pop(id(result), None)
                record(result, *ran)
                where = "" if visible is None else f" on GPUs {visible}"
                print(f"{result.name}: {result.status} in {result.seconds:.0f} s{where} {result.counts or ''}",
                      flush=True)  # fmt: skip
                out.write_text(render(results, header=header, earlier=earlier))

    def on_sigterm(signum: int, frame: object) -> None:
        # An outer `timeout` stops the run: kill what is in flight, keep what it finished, and say so in the file.
        with lock:
            stopped.set()
            for result, proc, log, start in running.values():
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # it ended between its last line and this signal
                proc.wait()
                record(result, KILLED, time.monotonic() - start, log.read_text(errors="replace"))
                print(f"{result.name}: {KILLED} after {result.seconds:.0f} s {result.counts or ''}", flush=True)
            running.clear()
            for result in results:
                if result.status == "not run":
                    result.status = "not run (killed)"
            out.write_text(render(results, header=header, earlier=earlier))
        sys.exit(128 + signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        threads = [threading.Thread(target=lane, args=(d,), daemon=True) for d in devices]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        signal.signal(signal.SIGTERM, previous)
    out.write_text(render(results, header=header, earlier=earlier))
    return 0 if all(r.status == "finished" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
