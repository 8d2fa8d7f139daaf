"""tools/bench_logprob_gap.py on the CPU: a float32 engine and trainer agree to float32 rounding in every row."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools import bench_logprob_gap  # noqa: E402


def test_cpu_run_gives_float32_rounding_gaps(capsys):
    assert bench_logprob_gap.main(["--preset", "tiny", "--prompts", "8", "--new-tokens", "6"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    rows = [line.strip("| ").split(" | ") for line in rows if line[2:].split(" | ")[0] in bench_logprob_gap.ROWS]
    assert [r[0] for r in rows] == list(bench_logprob_gap.ROWS)
    for row in rows:
        assert float(row[3]) < 1e-5, row  # max |trainer - rollout|
