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
    config, _ = preset_config("qwen3-0.6b", alphabet=task.ALPHABET, **bench_train.SHAPES["qwen3-4b"][1])
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


def test_active_parameters_of_qwen3_30b_a3b_are_its_published_counts():
    """The preset's shape at its 48 layers: 30.5B parameters, 3.3B active (Qwen/Qwen3-30B-A3B's model card; both
    count the embedding and the LM head), and the active count here, without the untied embedding's lookup, by hand."""
    from runtime.demo import task
    from runtime.demo.tiny_model import preset_config

    config, _ = preset_config("qwen3-30b-a3b-2layers", alphabet=task.ALPHABET, num_hidden_layers=48)
    flops = bench_train.model_flops_per_token(config, seq_len=4096)
    embed = 151936 * 2048
    assert round(flops["params"] / 1e9, 1) == 30.5
    assert 3.3e9 <= flops["active"] + embed < 3.4e9  # "3.3B" on the card: 3.35e9
    attention = 2048 * 32 * 128 + 2 * 2048 * 4 * 128 + 32 * 128 * 2048 + 2 * 128  # q, k, v, o and the q/k norms
    layer = attention + 2 * 2048 + 128 * 2048 + 8 * 3 * 2048 * 768  # two norms, the router, 8 of 128 experts
    assert flops["active"] == 48 * layer + 2048 + embed  # + the final norm and the LM head
    assert flops["dense"] == 6 * flops["active"]
    assert flops["attn"] == 3 * 48 * 4096 * 32 * (128 + 128)


def test_mla_attention_flops_count_its_wider_query_key_heads():
    """Moonlight's MLA: query/key heads of 128 + 64 (no position / rotary parts), value heads of 128; its active
    parameters by hand: a dense first layer, then 2 shared and 6 of 64 routed experts with a sigmoid router's bias."""
    from runtime.demo import task
    from runtime.demo.tiny_model import preset_config

    config, _ = preset_config("moonlight-16b-a3b-2layers", alphabet=task.ALPHABET)
    flops = bench_train.model_flops_per_token(config, seq_len=1024)
    assert flops["attn"] == 3 * 2 * 1024 * 16 * (128 + 64 + 128)
    h = 2048
    # q_proj (no q-LoRA), kv_a_proj_with_mqa (latent + rotary key), the latent's norm, kv_b_proj, o_proj; two norms
    attention = 16 * 192 * h + (512 + 64) * h + 512 + 16 * (128 + 128) * 512 + h * 16 * 128 + 2 * h
    dense = attention + 3 * h * 11264
    moe = attention + 64 * h + 64 + 3 * h * 1408 * (2 + 6)  # router, expert bias, 2 shared + 6 of 64 routed experts
    assert flops["active"] == dense + moe + h + 163840 * h  # + the final norm and the untied LM head


@pytest.mark.slow  # two gloo ranks importing megatron-core: about 25 s on two shared cores
@pytest.mark.filterwarnings("ignore")
def test_the_moe_smoke_run_at_ep2_prints_its_active_parameters_with_either_dispatcher(capsys):
    pytest.importorskip("megatron.core")
    argv = ["--preset", "tiny-qwen3-moe", "--samples", "8", "--seq-len", "32", "--prompt-len", "8", "--paths"]
    extra = ["megatron", "--nproc", "2", "--expert-model-parallel-size", "2", "--moe-grouped-gemm", "--warmup", "0"]
    extra += ["--moe-dispatcher", "once_per_rank,megatron"]  # rlcore's dispatcher and megatron-core's, one row each
    assert bench_train.main(argv + extra + ["--repeats", "1", "--micro-batch-size", "4", "--peak-tflops", "1"]) == 0
    out = capsys.readouterr().out
    assert "| megatron (once_per_rank) | " in out and "| megatron (megatron) | " in out
    from runtime.demo import task
    from runtime.demo.tiny_model import preset_config

    flops = bench_train.model_flops_per_token(preset_config("tiny-qwen3-moe", alphabet=task.ALPHABET)[0], seq_len=32)
    assert flops["active"] < flops["params"] / 2  # 4 of 16 experts
    assert f"({flops['params']:,} params, {flops['active']:,} active)" in out
