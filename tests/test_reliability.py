"""Reliability findings of issue 29: resumes, exports, checkpoints, signals and errors that must be one line."""

from runtime.logger import MetricsLogger


def _tensorboard_scalars(folder, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), purge_orphaned_data=True)
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_drops_the_steps_a_resume_redoes(tmp_path):
    with MetricsLogger(tmp_path, use_tensorboard=True) as first:
        for step in range(5):
            first.log(step, {"rollout/reward_mean": float(step)})
    # Resumed from the checkpoint after step 2: steps 3 and 4 run again, with other values.
    with MetricsLogger(tmp_path, use_tensorboard=True, start_step=3) as resumed:
        for step in (3, 4):
            resumed.log(step, {"rollout/reward_mean": 10.0 + step})
    # float32 in the event file; these values are exact in it.
    expected = [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]
    assert _tensorboard_scalars(tmp_path / "tensorboard", "rollout/reward_mean") == expected


def test_tensorboard_purges_at_the_axis_step_it_is_given(tmp_path):
    # --wandb-always-use-train-step: rollout step s is plotted at optimizer step 2 s here.
    with MetricsLogger(tmp_path, use_tensorboard=True) as first:
        for step in range(4):
            first.log(step, {"x": float(step)}, axis_step=2 * step)
    with MetricsLogger(tmp_path, use_tensorboard=True, start_step=2, tensorboard_purge_step=4) as resumed:
        resumed.log(2, {"x": 7.0}, axis_step=4)
    assert _tensorboard_scalars(tmp_path / "tensorboard", "x") == [(0, 0.0), (2, 1.0), (4, 7.0)]
