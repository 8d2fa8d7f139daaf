"""tools/bench_vs_trl.py: its summaries against the rows they read, and its CPU smoke run (TRL installed) prints a row
per side."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools import bench_vs_trl as bench  # noqa: E402


def _row(step: int, **perf: float) -> dict:
    return {"step": step, "rollout/response_len_mean": 10.0 + step, **{f"perf/{k}": v for k, v in perf.items()}}


def test_rlcore_summary_skips_the_warm_up_and_splits_the_train_time():
    rows = [
        _row(0, step_time=99.0, rollout_wait_time=90.0, log_probs_time=5.0, train_time=9.0, weight_sync_time=1.0),
        _row(1, step_time=3.0, rollout_wait_time=2.0, log_probs_time=0.25, train_time=0.75, weight_sync_time=0.1),
        _row(2, step_time=5.0, rollout_wait_time=3.0, log_probs_time=0.5, train_time=1.5, weight_sync_time=0.3),
        _row(3, step_time=4.0, rollout_wait_time=4.0, log_probs_time=0.5, train_time=2.5, weight_sync_time=0.2),
    ]
    got = bench.summarize_rlcore(rows, samples=64)
    assert got["steps"] == 3
    assert got["step"] == 4.0 and got["rollout"] == 3.0 and got["sync"] == 0.2
    # train: train_time less the log-prob forward, per step, then the median (0.5, 1.0, 2.0).
    assert got["train"] == 1.0 and got["log_probs"] == 0.5 and got["train_total"] == 1.5
    assert got["tokens"] == statistics.median([11 * 64, 12 * 64, 13 * 64])
    assert got["offload"] is None  # a key the rows lack
    with pytest.raises(ValueError, match="no rlcore step"):
        bench.summarize_rlcore(rows[:1], samples=64)


def test_trl_summary_needs_one_generation_per_step():
    got = bench.summarize_trl([10.0, 2.0, 4.0, 3.0], [9.0, 1.5, 3.0, 1.0], [64, 60, 62, 64])
    assert got == {"steps": 3, "step": 3.0, "rollout": 1.5, "train": 1.0, "tokens": 62}
    with pytest.raises(ValueError, match="one generation per step"):
        bench.summarize_trl([1.0, 2.0], [1.0], [5, 5])


def test_table_has_a_row_per_side_and_the_ratio():
    results = {
        "rlcore": {"steps": 2, "step": 2.0, "rollout": 1.0, "log_probs": 0.2, "train": 0.5, "tokens": 100.0},
        "trl": {"steps": 2, "step": 6.0, "rollout": 5.0, "train": 1.0, "tokens": 120.0},
    }
    table = bench.format_table(results)
    assert "| rlcore | 2 | 2.00 | 1.00 | 0.20 | 0.50 | - | - | 100 | 50 |" in table
    assert "| trl | 2 | 6.00 | 5.00 | - | 1.00 | - | - | 120 | 20 |" in table
    assert "3.00x" in table


def test_the_command_is_a_colocated_job_of_the_asked_shape(tmp_path):
    from runtime.config import parse_args

    model = bench.build_model(tmp_path, tiny=True, seed=0)
    cmd = bench.rlcore_command(
        model=model,
        output_dir=str(tmp_path / "out"),
        prompts=8,
        group=8,
        max_new_tokens=512,
        steps=6,
        lr=1e-6,
        micro_batch_size=8,
        seed=1234,
        extra=["--rollout-top-p", "0.9"],
    )
    assert cmd[1:3] == ["-m", "runtime.cli"]
    cfg = parse_args(cmd[3:])
    assert cfg.colocate and cfg.actor_num_gpus_per_node == 1 and cfg.rollout_num_gpus == 1
    r = cfg.rollout
    assert (r.rollout_batch_size, r.n_samples_per_prompt, r.rollout_max_response_len, r.num_rollout) == (8, 8, 512, 6)
    assert cfg.train.global_batch_size == 64 and cfg.train.micro_batch_size == 8 and cfg.train.lr == 1e-6
    assert r.rollout_top_p == 0.9 and cfg.data.prompt_data is None and cfg.reward.rm_type == "builtin"


def test_builtin_reward_as_a_trl_reward_function_scores_like_the_task():
    from runtime.demo import task

    got = bench.builtin_reward(["c123="] * 3, ["123", "12", "321"], label=["123"] * 3)
    assert got == [task.score(c, "123") for c in ("123", "12", "321")] == [1.0, 2 / 3, 1 / 3]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_the_cpu_smoke_run_prints_both_rows(tmp_path, capsys):
    """Both sides for one step on the CPU (``-m slow``, with TRL installed). Ran on 2026-11-27 on a shared 2-core AMD
    EPYC machine with TRL 1.16.0 from ``tools/trl-wheels.sh`` on PYTHONPATH: passed in 3 min 02 s."""
    pytest.importorskip(
        "trl",
        reason="TRL is a benchmark-only extra: pip install 'rlcore[trl-bench]' (offline: "
        "tools/trl-wheels.sh DIR, then pip install --no-deps DIR/*.whl)",
    )
    assert bench.main(["--tiny", "--steps", "1", "--device", "cpu", "--work-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| rlcore | 1 | " in out and "| trl | 1 | " in out
    assert "TRL step / rlcore step:" in out
