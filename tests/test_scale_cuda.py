"""More than one GPU: data-parallel jobs through ``rlcore-run``, the NCCL weight sync from GPU memory, the default
plan on two GPUs and one-step async with pushes mid-run. Skipped without two GPUs (CI has none): run them on a
two-GPU machine with ``pytest -q tests/test_scale_cuda.py``."""

import json
import math
import os
import subprocess
import sys

import pytest
import ray
import torch

from runtime.cluster.engines import EngineGroup
from runtime.cluster.placement import create_placement
from runtime.cluster.trainers import TrainerGroup
from runtime.cluster.weight_sync import DistributedSync, check_weights_equal, make_weight_sync
from runtime.config import from_dict, validate
from runtime.demo import task
from runtime.demo.tiny_model import make_tiny_model
from runtime.train.algo import loss_config, model_roles, role_paths
from runtime.train.hooks import train_hooks

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

BACKENDS = ["torch", "megatron"]


def _run_cli(tmp_path, *flags: str, timeout: int = 600) -> tuple[list[dict], str]:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "runtime.cli", *flags, "--output-dir", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], result.stdout


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_data_parallel_job_runs_through_the_cli(backend, tmp_path):
    """DP=2, colocated on two GPUs: whitening over the NCCL data-parallel group (--normalize-advantages) and the
    correct-sample sums (--log-correct-samples) all-reduce there; both died on a CPU tensor before."""
    rows, _ = _run_cli(
        tmp_path,
        "--train-backend", backend, "--colocate", "--actor-num-gpus-per-node", "2", "--num-rollout", "3",
        "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--global-batch-size", "32",
        "--micro-batch-size", "8", "--normalize-advantages", "--log-correct-samples",
        "--check-weight-update-equal",
    )  # fmt: skip
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert row["train/num_steps"] == 1  # 32 samples, global batch 32
        assert math.isfinite(row["train/loss"]) and row["train/grad_norm"] > 0
        # bf16 engine against the trainer's recompute of the same weights: close (a tenth of a nat per token, as
        # tests/test_runtime_loop_cuda.py bounds it), far from the gap of two different models.
        assert row["train/rollout_log_prob_abs_diff"] < 0.1
        # Whitened over both ranks' tokens: unit variance, so the mean |advantage| is at most 1 (Cauchy-Schwarz),
        # and above 0 unless every reward of the step is equal.
        assert 0 <= row["rollout/advantage_abs_mean"] <= 1 + 1e-6
        # The quarters of the correct samples' lengths, summed over the ranks, are fractions of one whole.
        quarters = sum(row[f"rollout/correct_length/p{q}"] for q in (25, 50, 75, 100))
        assert quarters == pytest.approx(1.0, abs=1e-6) or quarters == 0.0


@pytest.fixture
def two_gpu_ray():
    ray.init(num_gpus=2, num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_default_sync_between_gpus_is_nccl_and_the_engine_holds_the_trainers_weights(
    backend, two_gpu_ray, tmp_path
):
    path = str(make_tiny_model(tmp_path / "tiny", alphabet=task.ALPHABET, seed=0))
    # One trainer GPU, one engine GPU (a placement flag: the default plan would colocate them).
    settings = {"hf_checkpoint": path, "train_backend": backend, "actor_num_gpus_per_node": 1, "rollout_num_gpus": 1}
    settings["num_rollout"] = 1
    settings.update(rollout_max_response_len=8, rollout_batch_size=4, n_samples_per_prompt=4, global_batch_size=16)
    cfg = validate(from_dict(None, output_dir=str(tmp_path / "out"), **settings))
    placement = create_placement(cfg)
    trainers = TrainerGroup(
        placement,
        backend=backend,
        model_path=path,
        roles=model_roles(cfg),
        role_paths=role_paths(cfg),
        train_cfg=cfg.train,
        loss_cfg=loss_config(cfg),
        temperature=1.0,
        seed=0,
        hooks=train_hooks(cfg),
    )
    engines = EngineGroup(cfg, placement, path)
    sync = make_weight_sync(trainers, engines, bucket_bytes=1 << 16)  # small buckets: several in flight in turn
    try:
        assert isinstance(sync, DistributedSync) and sync.backend == "nccl" and engines.weight_dtype() == "bfloat16"
        weights = trainers.get_weights()
        sync.push(1)
        assert len(sync.bucket_sizes) > 2
        # Every row of every weight, bit for bit in bf16 (the trainer's float32 weights cast as the engine holds them).
        assert check_weights_equal(trainers, engines, truncate_size=1 << 20) == len(weights)
        assert engines.weight_versions() == [1]
        assert sum(sync.bucket_sizes) == sum(v.numel() * 2 for v in weights.values())
    finally:
        sync.close()
        engines.shutdown()
        trainers.shutdown()
        ray.util.remove_placement_group(placement.group)


def test_one_step_async_pushes_mid_run_and_trains_one_version_behind(tmp_path):
    """Split on two GPUs (trainer on one, engine on the other), --rollout-schedule one_step: each rollout after the
    first was sampled by the weights pushed mid-run one step before it trains."""
    rows, _ = _run_cli(
        tmp_path, "--rollout-schedule", "one_step", "--num-rollout", "4", "--actor-num-gpus-per-node", "1",
        "--check-weight-update-equal",
    )  # fmt: skip
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for row in rows:  # the step's parts, for the record (pytest -rA shows them)
        print({k.removeprefix("perf/"): round(v, 3) for k, v in row.items() if k.startswith("perf/") and v})
    assert rows[0]["rollout/weight_version_lag_max"] == 0
    for row in rows[1:]:
        assert row["rollout/weight_version_lag_mean"] == 1 and row["rollout/weight_version_lag_max"] == 1
        assert row["perf/weight_sync_time"] < 1.0


def test_the_default_plan_on_two_gpus_is_data_parallel_with_colocated_engines(tmp_path):
    """No placement flag on a two-GPU machine: the default plan (runtime.cluster.plan.DEFAULT_PLAN)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    dry = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "--dry-run"], capture_output=True, text=True, env=env, timeout=120
    )
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert "2 trainer(s) with an engine colocated on each" in dry.stdout
    assert "trainer bundles        [0, 1]" in dry.stdout
    rows, _ = _run_cli(tmp_path, "--num-rollout", "2")
    assert [r["step"] for r in rows] == [0, 1] and all(r["perf/offloaded"] == 1.0 for r in rows)
