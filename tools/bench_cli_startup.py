"""How long ``rlcore-run --help`` and ``rlcore-run --dry-run`` take, end to end in a fresh interpreter.

Prints a table: the median and the spread of ``--runs`` runs of each command, and whether the command imported torch,
Ray or transformers. Several source trees can be compared in one call, their runs interleaved so that a machine
whose load changes (a shared 2-core box) weighs on each alike:

    python tools/bench_cli_startup.py                       # this tree
    python tools/bench_cli_startup.py --root /work/main --root .   # before / after
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = {
    "--help": ["--help"],
    # A job with a model and data of its own, as users run it (not the built-in job, whose defaults differ).
    "--dry-run": ["--dry-run", "--num-rollout", "2", "--rollout-max-response-len", "16"],
}
_HEAVY = ("torch", "ray", "transformers")
# Runs the CLI's main in-process and reports which heavy modules it imported, on stderr after the command's output.
_PROBE = (
    "import sys, json\n"
    "from runtime.cli import main\n"
    "try:\n"
    "    code = main(sys.argv[1:])\n"
    "except SystemExit as exit_:\n"
    "    code = exit_.code\n"
    f"print('@@' + json.dumps([m for m in {_HEAVY!r} if m in sys.modules]), file=sys.stderr)\n"
    "sys.exit(code or 0)\n"
)


def _run(root: Path, argv: list[str]) -> tuple[float, list[str]]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv], env=env, cwd=root, capture_output=True, text=True, check=False
    )
    elapsed = time.perf_counter() - start
    marker = [line for line in done.stderr.splitlines() if line.startswith("@@")]
    if done.returncode != 0 or not marker:
        raise SystemExit(f"bench_cli_startup: {root}: rlcore-run {' '.join(argv)} failed:\n{done.stderr[-2000:]}")
    return elapsed, json.loads(marker[-1][2:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", action="append", type=Path, help="source tree to time (repeatable; default: .)")
    parser.add_argument("--runs", type=int, default=5, help="runs of each command per tree (default 5)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    roots = [r.resolve() for r in (args.root or [Path(".")])]
    times: dict[tuple[Path, str], list[float]] = {(r, c): [] for r in roots for c in COMMANDS}
    heavy: dict[tuple[Path, str], list[str]] = {}
    for _ in range(args.runs):
        for name, cmd in COMMANDS.items():
            for root in roots:
                elapsed, imported = _run(root, cmd)
                times[root, name].append(elapsed)
                heavy[root, name] = imported
    print(f"rlcore-run start-up, {args.runs} runs each, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print(f"{'tree':<28} {'command':<10} {'median s':>9} {'min s':>7} {'max s':>7}  imports")
    for (root, name), values in times.items():
        imported = ", ".join(heavy[root, name]) or "none of " + "/".join(_HEAVY)
        print(
            f"{str(root)[-28:]:<28} {name:<10} {statistics.median(values):>9.2f} {min(values):>7.2f} "
            f"{max(values):>7.2f}  {imported}"
        )


if __name__ == "__main__":
    main()
