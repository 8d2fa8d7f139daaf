"""Capture the command line a slime run script hands its entry point, as test data (tests/fixtures/slime_scripts).

The script runs under bash with ``ray``, ``pkill``, ``sleep`` and ``nvidia-smi`` replaced by shell functions: nothing
starts, and ``ray job submit ... -- python3 train.py ARGS`` prints ARGS. Paths move under ``{models}`` (checkpoint
flags) and ``{data}`` (prompt data), which the tests fill with local files. Nothing of slime is copied but the flags.

    python tools/slime_script_args.py --slime /path/to/slime --script scripts/run-qwen3-4B.sh \\
        --hf-config config.json [--env NAME=VALUE ...] > tests/fixtures/slime_scripts/run-qwen3-4B.json

``--slime`` is a checkout of https://github.com/THUDM/slime; its commit is recorded in ``source``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

_STUBS = r"""
pkill() { :; }; sleep() { :; }; nvidia-smi() { return 1; }
ray() {
  if [ "$1" = job ]; then
    while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do shift; done
    shift  # --
    echo "ENTRY $1 $2"; shift 2
    printf 'ARG %s\n' "$@"
  fi
}
"""
# Flags whose value is a checkpoint folder ({models}) or a prompt file ({data}); --eval-prompt-data takes name + path.
_MODEL_FLAGS = ("--hf-checkpoint", "--ref-load", "--load", "--save")
_DATA_FLAGS = ("--prompt-data",)


def capture(slime: Path, script: str, env: dict[str, str]) -> tuple[str, list[str]]:
    """``(entry point, args)`` that ``script`` (relative to ``slime``) hands ``python3``."""
    text = (slime / script).read_text().replace("/root/slime/", f"{slime}/")
    local = slime / (script + ".capture.sh")
    local.write_text(text)
    try:
        out = subprocess.run(
            ["bash", "-c", f"{_STUBS}\nsource {local}"],
            capture_output=True,
            text=True,
            env={**os.environ, **env},
            cwd=slime,
            check=False,
        ).stdout
    finally:
        local.unlink()
    lines = out.splitlines()
    entry = next(line.split()[2] for line in lines if line.startswith("ENTRY "))
    return entry, [line[4:] for line in lines if line.startswith("ARG ")]


def localise(args: list[str]) -> list[str]:
    """Checkpoint paths as ``{models}/<name>``, prompt files as ``{data}/<name>``."""
    out = list(args)
    for i, arg in enumerate(args[:-1]):
        if arg in _MODEL_FLAGS:
            out[i + 1] = "{models}/" + Path(args[i + 1].rstrip("/")).name
        elif arg in _DATA_FLAGS:
            out[i + 1] = "{data}/" + Path(args[i + 1]).name
        elif arg == "--eval-prompt-data" and i + 2 < len(args):
            out[i + 2] = "{data}/" + Path(args[i + 2]).name
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slime", type=Path, required=True, help="a checkout of THUDM/slime")
    parser.add_argument("--script", required=True, help="the run script, relative to the checkout")
    parser.add_argument("--hf-config", type=Path, required=True, help="the model's config.json (the real one)")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the script (e.g. NUM_GPUS=8)")
    ns = parser.parse_args(argv)
    commit = subprocess.run(
        ["git", "-C", str(ns.slime), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    env = dict(item.split("=", 1) for item in ns.env)
    entry, args = capture(ns.slime, ns.script, env)
    fixture = {
        "source": f"https://github.com/THUDM/slime/blob/{commit or 'unknown'}/{ns.script}",
        "entry_point": entry,
        "args": localise(args),
        "hf_config": json.loads(ns.hf_config.read_text()),
    }
    json.dump(fixture, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
