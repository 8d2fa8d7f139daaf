"""The default placement on N GPUs (runtime.cluster.plan): which flags count as a placement, what the default sets."""

import pytest

from runtime.cli import dry_run_report
from runtime.cluster import plan
from runtime.config import from_dict, validate


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_no_placement_flag_on_gpus_gets_the_default_plan_over_all_of_them(gpus):
    settings = plan.default_placement({}, gpus=gpus)
    assert settings == plan.PLANS[plan.DEFAULT_PLAN].settings(gpus)
    trainers = settings["actor_num_gpus_per_node"]
    assert trainers + (0 if settings.get("colocate") else settings["rollout_num_gpus"]) == gpus


def test_the_gpu_count_given_is_the_one_used():
    assert plan.default_placement({"actor_num_gpus_per_node": 2}, gpus=8)["actor_num_gpus_per_node"] == 2


@pytest.mark.parametrize("flag", plan.PLACEMENT_FLAGS)
def test_any_placement_flag_or_no_gpu_leaves_the_job_as_it_is(flag):
    assert plan.default_placement({flag: 1}, gpus=4) == {} == plan.default_placement({flag: False}, gpus=4)
    assert plan.default_placement({}, gpus=0) == {}


def test_split_async_uses_every_gpu():
    for gpus in (2, 3, 4):
        s = plan.PLANS["split_async"].settings(gpus)
        assert s["actor_num_gpus_per_node"] + s["rollout_num_gpus"] == gpus and s["rollout_schedule"] == "one_step"


def test_the_dry_run_prints_the_plan_and_the_rule(tmp_path):
    report = dry_run_report(validate(from_dict(None, output_dir=str(tmp_path))))
    line = next(line for line in report.splitlines() if line.strip().startswith("plan "))
    assert f"Default on N GPUs with no placement flag: {plan.DEFAULT_PLAN}" in line


SMALL = {
    "rollout_batch_size": 4,
    "n_samples_per_prompt": 4,
    "rollout_max_response_len": 5,
    "global_batch_size": 16,
    "micro_batch_size": 8,
    "actor_num_gpus_per_node": 1,
    "use_tensorboard": False,
}


@pytest.mark.slow  # about 80 s on 2 cores; tests/test_scale_cuda.py runs one_step on GPUs
def test_one_step_async_stages_the_weights_while_the_next_rollout_samples(tmp_path, monkeypatch):
    """The embedded engine over a gloo weight-update group (--update-weight-transport nccl on the CPU), one_step: every
    sync but the last is staged (sent while the next rollout samples, not after it) and swapped in before the rollout
    after; each rollout is sampled whole by the weights one step behind (a swap that came late would show a lag of 2,
    one that came mid-rollout a sample with two versions, whose lag counts the older)."""
    import ray

    from runtime.cluster.weight_sync import DistributedSync
    from runtime.logger import METRICS_FILE, read_metrics
    from runtime.loop import run

    calls = []
    for name in ("stage", "commit", "push"):
        original = getattr(DistributedSync, name)

        def spy(self, *args, _original=original, _name=name):
            calls.append(_name)
            return _original(self, *args)

        monkeypatch.setattr(DistributedSync, name, spy)
    settings = {"rollout_schedule": "one_step", "update_weight_transport": "nccl", "num_rollout": 4}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        cfg = validate(from_dict(None, output_dir=str(tmp_path / "out"), **settings, **SMALL))
        rows = read_metrics(run(cfg, progress=False).output_dir / METRICS_FILE)
    finally:
        ray.shutdown()
    # The first push (before training), staged syncs after steps 0-2, each swapped in before the next rollout starts
    # (after step 2 no rollout is left to start), and the last step's pushed whole.
    assert calls == ["push", "stage", "commit", "stage", "commit", "stage", "push"]
    assert [r["rollout/weight_version_lag_max"] for r in rows] == [0, 1, 1, 1]
    assert [r["rollout/weight_version_lag_mean"] for r in rows] == [0, 1, 1, 1]
