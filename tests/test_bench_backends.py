"""tools/bench_backends.py: its FLOP counts against hand counts, and its CPU smoke run prints the table for the
torch and Megatron paths."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools import bench_backends as bench_train  # noqa: E402


def test_flops_per_token_of_the_qwen3_shapes():
    from runtime.demo import task
    from runtime.demo.tiny_model import preset_config

    config, _ = preset_config("qwen3-0.6b", alphabet=task.ALPHABET)
    flops = bench_train.model_flops_per_token(config, seq_len=16384)
    assert flops["params"] == 596_049_920  # the preset's documented count (tied embedding once)
    assert flops["dense"] == 6 * 596_049_920
    # Causal attention: 28 layers x 16 heads x 128, QK^T and AV over half of 16384 positions, x3 for a train step.
    assert flops["attn"] == 3 * 28 * 2 * 16384 * 16 * 128
    config, _ = preset_config("qwen3-0.6b", alphabet=task.ALPHABET, **bench_train.SHAPES["qwen3-4b"])
    params = bench_train.model_flops_per_token(config, seq_len=2048)["params"]
    layer = 2 * 2560 + 2 * 128 + 2560 * (32 * 128 + 2 * 8 * 128) + 32 * 128 * 2560 + 3 * 2560 * 9728
    assert params == 151936 * 2560 + 36 * layer + 2560  # about 4.02e9: Qwen3-4B


@pytest.mark.filterwarnings("ignore")
def test_the_cpu_smoke_run_prints_every_path(capsys):
    pytest.importorskip("megatron.core")
    argv = ["--preset", "tiny", "--samples", "8", "--seq-len", "32", "--prompt-len", "8", "--peak-tflops", "1"]
    extra = ["--micro-batch-size", "4", "--warmup", "0", "--repeats", "1", "--profile", "--profile-rows", "3"]
    assert bench_train.main(argv + extra) == 0
    out = capsys.readouterr().out
    for path in bench_train.PATHS:
        assert f"| {path} | " in out
        assert f"profile of one train step ({path}, rank 0)" in out
    assert "measured float32 512^3 matmul" in out
