"""The front end stays light: parsing the command line, ``--help`` and ``--dry-run`` import neither torch nor Ray
(nor transformers). A fresh interpreter runs each, since the test process itself has imported torch.

The timing is tools/bench_cli_startup.py's business, not a test's (a shared machine's load would make it flaky).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_HEAVY = ("torch", "ray", "transformers", "tensordict", "megatron")

_PROBE = """
import contextlib, io, json, sys
from runtime.cli import main
from runtime.config import parse_args
argv = json.loads(sys.argv[1])
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
    try:
        code = main(argv) if argv else parse_args([]) and 0
    except SystemExit as exit_:
        code = exit_.code
heavy = sorted({name.split(".")[0] for name in sys.modules} & set(json.loads(sys.argv[2])))
print(json.dumps({"code": code, "heavy": heavy, "out": out.getvalue()[-2000:]}))
"""


def _probe(argv: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(argv), json.dumps(_HEAVY)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    "argv",
    [
        [],  # parse_args alone
        ["--help"],
        ["--dry-run"],  # the built-in job
        ["--dry-run", "--num-rollout", "2", "--rollout-max-response-len", "16", "--lora-rank", "4"],
        ["--dry-run", "--train-backend", "megatron", "--tensor-model-parallel-size", "1"],
        ["--dry-run", "--rollout-engine", "sglang", "--rollout-external-engine-addrs", "127.0.0.1:30000"],
    ],
    ids=["parse", "help", "dry-run-builtin", "dry-run-lora", "dry-run-megatron", "dry-run-sglang"],
)
def test_the_front_end_imports_neither_torch_nor_ray(argv):
    result = _probe(argv)
    assert result["code"] in (0, None), result["out"]
    assert result["heavy"] == [], f"{argv} imported {result['heavy']}"
