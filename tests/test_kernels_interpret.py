"""Runs ``test_kernels.py`` through the Triton kernels themselves, in Triton's interpreter on the CPU.

Triton fixes interpreter-or-compiler when it is imported, and other test modules import it first, so setting
TRITON_INTERPRET here would come too late: the run happens in a fresh interpreter process with the variable set.
Under a suite already started with TRITON_INTERPRET=1, ``test_kernels.py`` itself runs interpreted and this is skipped.

The interpreter runs every program instance in Python, so its cost grows with the rows of a case: the linear cases
with N >= H use N = 12 or 13 (just above H = 8, more head pieces than larger N), which lets every case of the file run
here (earlier N = 40 and 33 took 3 minutes on a 2-core machine, and some cases were left to a slow test). The cases
are spread over one pytest-xdist worker per core (``suite_tools.run_interpreted``): the interpreter keeps one core
busy, so two workers on a 2-core machine take about half the wall time of one.
"""

import os

import pytest
from suite_tools import run_interpreted


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="this process already runs interpreted")
def test_kernels_under_triton_interpreter():
    run_interpreted("test_kernels.py", timeout=600)
