"""Reliability findings of issue 29: resumes, exports, checkpoints, signals and errors that must be one line."""

import errno
import os

import pytest

from runtime.cli import EXIT_BAD_INPUT, main
from runtime.cluster import checkpoint
from runtime.config import DataConfig, RewardConfig
from runtime.logger import MetricsLogger
from runtime.rollout.data import DataError, PromptDataset
from runtime.rollout.rewards import check_label_types


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


class _Trainers:
    def save(self, path, *, with_optimizer=True):
        os.makedirs(path)
        with open(os.path.join(path, "shard.distcp"), "wb") as fh:
            fh.write(b"w" * 100)


class _Feed:
    def state_dict(self):
        return {"data": {}}


class _Engines:
    def get_rng_state(self):
        return []


def _save(root, step):
    return checkpoint.save(root, step, trainers=_Trainers(), engines=_Engines(), feed=_Feed())


def test_an_empty_latest_is_named_with_the_intact_checkpoint_to_load(tmp_path, capsys):
    root = tmp_path / "ckpt"
    _save(root, 2)
    newest = _save(root, 4)
    (root / checkpoint.LATEST).write_text("")  # what a crash between creating and writing the file leaves
    message = f"--load: '{root}': its 'latest' file is empty .*; the newest intact checkpoint is '{newest}': --load it"
    with pytest.raises(FileNotFoundError, match=message):
        checkpoint.resolve(root)
    # A checkpoint whose files no longer match its manifest is skipped.
    (newest / checkpoint.TRAINER_DIR / "shard.distcp").write_bytes(b"w" * 99)
    with pytest.raises(FileNotFoundError, match=f"newest intact checkpoint is '{root / 'step_000002'}'"):
        checkpoint.resolve(root)
    (root / checkpoint.LATEST).write_text("step_000007")
    with pytest.raises(FileNotFoundError, match="'latest' file names 'step_000007', which is not a folder of it"):
        checkpoint.resolve(root)
    # The job stops on it before anything starts: one line, exit 2.
    (root / checkpoint.LATEST).write_text("\n")
    assert main(["--load", str(root), "--output-dir", str(tmp_path / "out")]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'latest' file is empty" in err and "step_000002" in err


class _FullDiskTrainers:
    """A trainer rank whose torch.distributed.checkpoint save meets a full disk, as Ray hands it to the driver."""

    def save(self, path, *, with_optimizer=True):
        import ray.exceptions
        from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

        os.makedirs(path)
        try:
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(path, "__0_0.distcp"))
        except OSError as err:
            failure = CheckpointException("save failed", {0: _wrap_exception(err)})
        raise ray.exceptions.RayTaskError("TrainerActor.call", "Traceback ...\n", failure).as_instanceof_cause()


def test_a_full_disk_on_a_trainer_rank_is_a_one_line_save_error(tmp_path):
    root = tmp_path / "ckpt"
    _save(root, 2)
    with pytest.raises(checkpoint.SaveError) as info:
        checkpoint.save(root, 4, trainers=_FullDiskTrainers(), engines=_Engines(), feed=_Feed())
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    assert message.startswith(f"--save {root}: saving step 4 failed (OSError: [Errno 28] No space left on device:")
    assert info.value.__cause__ is None and info.value.__suppress_context__  # the traceback chain is not printed
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002"]  # no partial folder left


def _parquet(path, labels):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": [f"what is {i}?" for i in range(len(labels))], "label": labels}), path)
    return str(path)


def test_a_float_label_column_is_refused_for_a_reward_that_reads_text(tmp_path):
    floats = _parquet(tmp_path / "floats.parquet", [314.0, 2.0])
    dataset = PromptDataset(floats, None, DataConfig(input_key="prompt", label_key="label"), seed=0)
    assert dataset.labels() == [314.0, 2.0]
    for rm_type in ("exact_match", "boxed_exact_match", "f1"):
        with pytest.raises(
            DataError,
            match=rf"^--label-key label: {floats} holds 2 float labels \(first: 314.0\), which --rm-type {rm_type} "
            r"compares with the response as text and can never match: store the column as str or int",
        ):
            check_label_types(dataset.labels(), RewardConfig(rm_type=rm_type), label_key="label", source=floats)
    # Rewards that read numbers as numbers, and custom rewards, take them.
    for cfg in (RewardConfig(rm_type="math"), RewardConfig(rm_type="dapo"), RewardConfig(custom_rm_path="m:f")):
        check_label_types(dataset.labels(), cfg, label_key="label", source=floats)
    check_label_types(["314", 2, None], RewardConfig(rm_type="exact_match"), label_key="label", source="x")
    with pytest.raises(DataError, match="1 bool labels"):
        check_label_types([True, "a"], RewardConfig(rm_type="exact_match"), label_key="label", source="x")


def test_a_job_with_float_labels_and_exact_match_stops_before_it_starts(tmp_path, capsys):
    floats = _parquet(tmp_path / "floats.parquet", [314.0, 2.0, 5.0, 7.0])
    argv = ["--prompt-data", floats, "--input-key", "prompt", "--label-key", "label", "--rm-type", "exact_match"]
    argv += ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4"]
    argv += ["--rollout-max-response-len", "4", "--num-rollout", "1", "--actor-num-gpus-per-node", "1"]
    assert main([*argv, "--output-dir", str(tmp_path / "out")]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--label-key label" in err and "float" in err and "exact_match" in err
