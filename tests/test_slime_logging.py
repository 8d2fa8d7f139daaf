"""slime's logging and profiling flags: ``--log-multi-turn``, ``--wandb-always-use-train-step`` (the TensorBoard and
W&B axis) and the CUDA memory snapshots (``--record-memory-history`` and friends; the snapshot itself needs CUDA)."""

import pickle

import pytest
import torch

from runtime.config import ConfigError, from_dict, parse_args
from runtime.job import axis_step
from runtime.logger import MetricsLogger
from runtime.rollout import multi_turn_metrics
from runtime.rollout.sample import Sample
from runtime.train.memory import MemoryHistory, memory_history


def test_multi_turn_metrics_with_and_without_tool_output():
    samples = [
        Sample(tokens=[0] * 9, response_length=6, loss_mask=[1, 1, 0, 0, 1, 1], metadata={"round_number": 2}),
        Sample(tokens=[0] * 7, response_length=4, loss_mask=None, metadata={"round_number": 1}),
        Sample(tokens=[0] * 5, response_length=3, loss_mask=[1, 0, 1], metadata={"round_number": 3}),
    ]
    m = multi_turn_metrics(samples, max_response_len=4)
    assert m["raw_response_length/response_length_mean"] == pytest.approx(13 / 3)
    assert (m["raw_response_length/response_length_max"], m["raw_response_length/response_length_min"]) == (6, 3)
    assert m["raw_response_length/response_length_clip_ratio"] == pytest.approx(2 / 3)  # 6 and 4 reach 4
    assert m["wo_obs_response_length/response_length_mean"] == pytest.approx((4 + 4 + 2) / 3)
    assert (m["wo_obs_response_length/response_length_max"], m["wo_obs_response_length/response_length_min"]) == (4, 2)
    assert (m["multi_turn_metric/round_number_mean"], m["multi_turn_metric/round_number_max"]) == (2, 3)
    samples[0].metadata = {}
    assert "multi_turn_metric/round_number_mean" not in multi_turn_metrics(samples, max_response_len=4)
    assert parse_args(["--log-multi-turn"]).log.log_multi_turn


def test_wandb_always_use_train_step_moves_the_tensorboard_axis(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # 8 prompts x 4 samples per rollout, 8 per optimizer step: 4 optimizer steps per rollout.
    sizes = {"rollout_batch_size": 8, "n_samples_per_prompt": 4, "global_batch_size": 8}
    cfg = from_dict(None, wandb_always_use_train_step=True, **sizes)
    assert [axis_step(cfg, step) for step in range(3)] == [0, 4, 8]
    assert axis_step(from_dict(None, **sizes), 2) == 2
    logger = MetricsLogger(tmp_path, use_tensorboard=True, tensorboard_dir=str(tmp_path / "tb"))
    for step in range(3):
        logger.log(step, {"rollout/reward_mean": float(step)}, axis_step=axis_step(cfg, step))
    logger.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("rollout/reward_mean")] == [0, 4, 8]
    assert [row.split('"step": ')[1][0] for row in (tmp_path / "metrics.jsonl").read_text().splitlines()] == list(
        "012"
    )


def test_memory_flags_name_what_they_need():
    with pytest.raises(ConfigError, match="--memory-recorder memray: memray is not a dependency"):
        parse_args(["--memory-recorder", "memray"])
    with pytest.raises(ConfigError, match="--profile-target train_actor / train_log_probs select what"):
        parse_args(["--profile-target", "train_actor"])
    with pytest.raises(ConfigError, match="--memory-snapshot-num-steps must be > 0"):
        parse_args(["--memory-snapshot-num-steps", "0"])
    assert memory_history(from_dict(None).debug, rank=0) is None
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="--record-memory-history records the CUDA allocator: this machine"):
            parse_args(["--record-memory-history"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_memory_history_dumps_a_snapshot_after_the_last_recorded_step(tmp_path):
    cfg = from_dict(None, record_memory_history=True, memory_snapshot_dir=str(tmp_path), memory_snapshot_num_steps=2)
    history = memory_history(cfg.debug, rank=3)
    assert isinstance(history, MemoryHistory)
    block = torch.empty(1 << 20, device="cuda")
    assert history.step(0) is None  # rollout 0 of 2
    path = history.step(1)
    assert path is not None and "rank3_step1" in path
    with open(path, "rb") as fh:
        snapshot = pickle.load(fh)
    traces = [e for trace in snapshot["device_traces"] for e in trace]
    assert any(e["action"] == "alloc" and e["size"] >= block.numel() * 4 for e in traces)
    assert history.step(1) is None and not history.recording  # recorded once, then off
