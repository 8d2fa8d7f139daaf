"""The training backend of a job resumed by ``--load`` alone: the backend whose trainers wrote the job checkpoint
(runtime.slime_compat.holds_megatron_job), with no Megatron flag given again."""

from __future__ import annotations

import json

import pytest

from runtime import slime_compat
from runtime.cluster import checkpoint as ckpt
from runtime.config import resolve_args
from runtime.train.backends import megatron_checkpoint as mck


def _job_checkpoint(root, step: int, write_trainer) -> None:
    """A ``--save`` root as ``runtime.cluster.checkpoint.save`` lays it out, the trainers' folder written by
    ``write_trainer`` (the rest is what the resume reads, not the backend)."""
    folder = ckpt.step_dir(root, step)
    (folder / ckpt.TRAINER_DIR).mkdir(parents=True)
    write_trainer(folder / ckpt.TRAINER_DIR)
    (folder / ckpt.LOOP_STATE).write_bytes(b"state")
    ckpt.write_manifest(folder, step)
    (root / ckpt.LATEST).write_text(folder.name)


def _megatron_trainer(folder) -> None:
    # What megatron-core's dist_checkpointing writes beside its shards (the format file the backend's reader checks).
    (folder / mck.FORMAT_FILE).write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (folder / ".metadata").write_bytes(b"")


def _torch_trainer(folder) -> None:
    # The torch backend's own layout: torch.distributed.checkpoint, one process.
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    dcp.save({"weight": torch.zeros(2, 3)}, checkpoint_id=str(folder))


def test_a_megatron_job_resumed_by_load_alone_runs_megatron(tmp_path):
    root = tmp_path / "save"
    _job_checkpoint(root, 2, _megatron_trainer)
    assert slime_compat.holds_megatron_job(str(root)) and slime_compat.holds_megatron_job(str(root / "step_000002"))
    cfg = resolve_args(["--load", str(root), "--num-rollout", "4"])
    assert cfg.train.train_backend == "megatron"
    choice = slime_compat.backend_choice(cfg, given=None)
    assert choice.name == "megatron" and f"--load {root} holds a job checkpoint of the Megatron backend" in choice.why


def test_a_torch_job_resumed_by_load_alone_stays_torch(tmp_path):
    root = tmp_path / "save"
    _job_checkpoint(root, 2, _torch_trainer)
    assert not slime_compat.holds_megatron_job(str(root))
    assert resolve_args(["--load", str(root), "--num-rollout", "4"]).train.train_backend == "torch"


def test_the_checkpoint_does_not_override_a_given_backend_or_count_when_incomplete(tmp_path):
    root = tmp_path / "save"
    _job_checkpoint(root, 2, _megatron_trainer)
    assert resolve_args(["--load", str(root), "--train-backend", "torch"]).train.train_backend == "torch"
    (root / ckpt.LATEST).write_text("step_000009")  # names no folder: no complete job checkpoint
    assert not slime_compat.holds_megatron_job(str(root))
    assert not slime_compat.holds_megatron_job(None) and not slime_compat.holds_megatron_job(str(tmp_path / "none"))
