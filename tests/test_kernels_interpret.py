"""Runs ``test_kernels.py`` through the Triton kernels themselves, in Triton's interpreter on the CPU.

Triton fixes interpreter-or-compiler when it is imported, and other test modules import it first, so setting
TRITON_INTERPRET here would come too late: the run happens in a fresh interpreter process with the variable set.
Under a suite already started with TRITON_INTERPRET=1, ``test_kernels.py`` itself runs interpreted and this is skipped.

The interpreter runs every program instance in Python, so its cost grows with the rows of a case: the linear cases
with N >= H use N = 12 or 13 (just above H = 8, more head pieces than larger N), which lets every case of the file run
here (earlier N = 40 and 33 took 3 minutes on a 2-core machine, and some cases were left to a slow test).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest


def _interpret() -> None:
    here = Path(__file__).resolve().parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(here / "test_kernels.py")]
    result = subprocess.run(command, cwd=here.parent, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    summary = result.stdout.splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "deselected" not in summary, result.stdout[-2000:]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="this process already runs interpreted")
def test_kernels_under_triton_interpreter():
    _interpret()
