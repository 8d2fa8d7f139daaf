"""Runs ``test_fused_loss.py`` through the Triton kernels themselves, in Triton's interpreter on the CPU.

As ``test_kernels_interpret.py``: Triton fixes interpreter-or-compiler when it is imported, so the run happens in a
fresh interpreter process with TRITON_INTERPRET=1; under a suite already started that way this is skipped.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="this process already runs interpreted")
def test_fused_loss_under_triton_interpreter():
    here = Path(__file__).resolve().parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(here / "test_fused_loss.py")]
    result = subprocess.run(command, cwd=here.parent, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1], result.stdout[-2000:]
