"""Runs ``test_kernels.py`` through the Triton kernels themselves, in Triton's interpreter on the CPU.

Triton fixes interpreter-or-compiler when it is imported, and other test modules import it first, so setting
TRITON_INTERPRET here would come too late: the run happens in a fresh interpreter process with the variable set.
Under a suite already started with TRITON_INTERPRET=1, ``test_kernels.py`` itself runs interpreted and this is skipped.

The interpreter runs every program instance in Python: the default suite leaves out the cases that repeat a piece plan
another case interprets (the bf16 twins of the two N >= H linear shapes, whose float32 cases run the same plan, and
two of the three stash sizes of the 40-row double backward), about a third of the 3 minutes the whole file takes on
a 2-core machine. ``pytest -m slow tests/test_kernels_interpret.py`` interprets every case.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Each left out here runs the same kernels on the same piece plan as a case that stays (see the module docstring).
REPEATS = (
    "test_linear_matches_reference[40-8-300-16-0-dtype1]",
    "test_linear_matches_reference[33-8-301-24-2-dtype1]",
    "test_linear_backward_twice_with_retain_graph[40-0]",
    "test_linear_backward_twice_with_retain_graph[40-5]",
)


def _interpret(deselect: tuple[str, ...]) -> None:
    here = Path(__file__).resolve().parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    target = here / "test_kernels.py"
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(target)]
    command += [arg for case in deselect for arg in ("--deselect", f"tests/{target.name}::{case}")]
    result = subprocess.run(command, cwd=here.parent, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    summary = result.stdout.splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, result.stdout[-2000:]
    # Every case left out was a real one (a renamed test would otherwise drop out of both runs unnoticed).
    assert f"{len(deselect)} deselected" in summary if deselect else "deselected" not in summary, summary


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="this process already runs interpreted")
def test_kernels_under_triton_interpreter():
    _interpret(REPEATS)


@pytest.mark.slow(reason="every case of test_kernels.py interpreted, about 3 minutes on a 2-core machine")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="this process already runs interpreted")
def test_kernels_under_triton_interpreter_every_case():
    _interpret(())
