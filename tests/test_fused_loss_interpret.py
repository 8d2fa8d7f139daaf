"""Runs ``test_fused_loss.py`` through the Triton kernels themselves, in Triton's interpreter on the CPU.

As ``test_kernels_interpret.py``: Triton fixes interpreter-or-compiler when it is imported, so the run happens in a
fresh interpreter process with TRITON_INTERPRET=1, its cases over one pytest-xdist worker per core; under a suite
already started that way this is skipped.
"""

import os

import pytest
from suite_tools import run_interpreted


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="this process already runs interpreted")
def test_fused_loss_under_triton_interpreter():
    run_interpreted("test_fused_loss.py", timeout=900)
