"""tools/bench_train.py: the variant grammar, and a CPU smoke run that prints one table row per variant."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools import bench_train  # noqa: E402


def test_variants_map_to_the_trainer_knobs():
    assert bench_train.parse_variant("fused+packed+recompute+compile+varlen") == {
        "fused": True,
        "packed": True,
        "recompute": True,
        "compile": True,
        "attention": "varlen",
    }
    assert bench_train.parse_variant("unfused") == {
        "fused": False,
        "packed": False,
        "recompute": False,
        "compile": False,
        "attention": "auto",
    }
    for bad in ("fused+unfused", "fused+sdpa+varlen", "fused+fast"):
        with pytest.raises(SystemExit, match="--variants"):
            bench_train.parse_variant(bad)


@pytest.mark.slow
def test_cpu_smoke_run_prints_a_row_per_variant(capsys):
    argv = ["--preset", "tiny", "--samples", "8", "--seq-len", "32", "--prompt-len", "8", "--min-response-len", "4"]
    argv += ["--peak-tflops", "1", "--warmup", "0", "--repeats", "1", "--variants", "fused+varlen,unfused+packed"]
    assert bench_train.main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| fused") or "unfused" in line]
    rows = [line for line in rows if line.startswith("|")]
    assert [row.split(" | ")[0] for row in rows] == ["| fused+varlen", "| unfused+packed"]
    for row in rows:
        cells = row.strip("| ").split(" | ")
        assert float(cells[2]) > 0 and float(cells[6]) > 0  # log-prob and train seconds
