"""Placement against a cluster that has fewer GPUs than the job asks for: a one-line error at once, not a 120 s wait.

Ray is told the machine has one GPU (``num_gpus=1``); no actor is started, so no GPU is needed.
"""

import time

import pytest
import ray

from runtime.cluster.placement import create_placement, plan_bundles
from runtime.config import ConfigError, from_dict, parse_args


@pytest.fixture(scope="module")
def one_gpu_cluster():
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_two_gpu_plan_on_one_gpu_fails_at_once_naming_colocate(one_gpu_cluster, tmp_path):
    cfg = from_dict(None, output_dir=str(tmp_path), colocate=False)
    assert plan_bundles(cfg).n_bundles == 2
    started = time.monotonic()
    with pytest.raises(ConfigError) as err:
        create_placement(cfg, timeout_s=60)
    assert time.monotonic() - started < 5
    text = str(err.value)
    assert "needs 2 GPUs (1 for trainers, 1 for engines) and the Ray cluster has 1" in text and "--colocate" in text
    placement = create_placement(from_dict(None, output_dir=str(tmp_path), colocate=True), timeout_s=60)
    assert placement.use_gpu and placement.trainer_bundles == placement.engine_bundles == [0]
    ray.util.remove_placement_group(placement.group)


def _gpus(monkeypatch, tmp_path, n: int) -> None:
    """The driver shows ``n`` GPUs (``runtime.config`` counts them without torch), all visible."""
    from runtime.cluster import resource_options

    driver = tmp_path / f"driver{n}"
    for i in range(n):
        (driver / f"0000:{i:02x}:00.0").mkdir(parents=True)
    driver.mkdir(exist_ok=True)
    monkeypatch.setattr(resource_options, "NVIDIA_GPUS_DIR", str(driver))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_the_gpu_count_follows_the_driver_and_cuda_visible_devices(monkeypatch, tmp_path):
    from runtime.config import _local_gpus

    _gpus(monkeypatch, tmp_path, 4)
    assert _local_gpus() == 4
    for visible, seen in (("1,3", 2), ("", 0), ("2", 1), ("0,-1,2", 1), ("0,1,2,3,4,5", 4)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert _local_gpus() == seen, visible
    monkeypatch.setattr("runtime.cluster.resource_options.NVIDIA_GPUS_DIR", str(tmp_path / "no-driver"))
    assert _local_gpus() == 0


def test_builtin_job_colocates_on_a_one_gpu_machine(monkeypatch, tmp_path):
    _gpus(monkeypatch, tmp_path, 1)
    assert parse_args([]).resources.colocate is True
    # The whole global batch in one micro-batch on the GPU, unless asked otherwise.
    assert parse_args([]).train.micro_batch_size == parse_args([]).train.global_batch_size == 256
    assert parse_args(["--micro-batch-size", "16"]).train.micro_batch_size == 16
    assert parse_args(["--no-colocate"]).resources.colocate is False
    assert parse_args(["--async"]).resources.colocate is False  # async keeps trainer and engine apart
    assert from_dict(None, hf_checkpoint=str(tmp_path)).resources.colocate is False  # other jobs: as given
    # Two GPUs and no placement flag: the default plan (runtime.cluster.plan, tests/test_scale.py) uses both.
    _gpus(monkeypatch, tmp_path, 2)
    two = parse_args([])
    assert (two.resources.colocate, two.resources.actor_num_gpus_per_node, two.resources.rollout_num_gpus) == (
        False,
        1,
        1,
    )
    assert two.rollout.rollout_schedule == "one_step"  # split_async, measured faster (runtime/cluster/plan.py)
    assert parse_args(["--no-colocate"]).resources.colocate is False


def test_colocated_offload_stops_only_when_every_trainer_and_its_engine_fit_their_device():
    from runtime.colocation import fit_together

    gib = 2**30
    t = {"peak": 30 * gib, "total": 80 * gib}
    assert fit_together([t], [{"peak": 40 * gib, "total": 80 * gib}], fraction=0.9)
    assert not fit_together([t], [{"peak": 43 * gib, "total": 80 * gib}], fraction=0.9)  # 73 > 72
    # Two ranks: one pair that does not fit keeps offloading on.
    small, big = {"peak": 10 * gib, "total": 80 * gib}, {"peak": 50 * gib, "total": 80 * gib}
    assert not fit_together([t, t], [small, big], fraction=0.9)
    # Engines that do not report (SGLang servers, CPU jobs) and mismatched counts keep offloading.
    assert not fit_together([t], [None], fraction=0.9)
    assert not fit_together([None], [None], fraction=0.9)
    assert not fit_together([t, t], [small], fraction=0.9)
    assert not fit_together([], [], fraction=0.9)
