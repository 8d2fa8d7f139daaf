"""The default placement on N GPUs (runtime.cluster.plan): which flags count as a placement, what the default sets."""

import pytest

from runtime.cli import dry_run_report
from runtime.cluster import plan
from runtime.config import from_dict, validate


@pytest.mark.parametrize("gpus", [1, 2, 3, 4, 8])
def test_no_placement_flag_on_gpus_gets_the_default_plan_over_all_of_them(gpus):
    settings = plan.default_placement({}, gpus=gpus)
    # The table's entry for this count, or for the largest count below it (3 GPUs: two's plan, 8: four's).
    measured = max(n for n in plan.PLAN_BY_GPUS if n <= gpus)
    assert settings == plan.PLANS[plan.PLAN_BY_GPUS[measured]].settings(gpus)
    assert plan.plan_for(1) == "colocated_dp" and plan.plan_for(gpus) == plan.PLAN_BY_GPUS[measured]
    trainers = settings["actor_num_gpus_per_node"]
    assert trainers + (0 if settings.get("colocate") else settings["rollout_num_gpus"]) == gpus


def test_every_measured_count_names_a_plan_and_fewer_than_one_gpu_has_none():
    assert set(plan.PLAN_BY_GPUS.values()) <= set(plan.PLANS) and 1 in plan.PLAN_BY_GPUS
    with pytest.raises(ValueError, match="at least one GPU, got 0"):
        plan.plan_for(0)


def test_the_gpu_count_given_is_the_one_used():
    four = plan.PLANS[plan.plan_for(4)].settings(4)
    assert plan.default_placement({"actor_num_gpus_per_node": 4}, gpus=8) == four
    assert plan.default_placement({"actor_num_gpus_per_node": 1}, gpus=8) == {
        "colocate": True,
        "actor_num_gpus_per_node": 1,
    }


@pytest.mark.parametrize("flag", plan.PLACEMENT_FLAGS)
def test_any_placement_flag_or_no_gpu_leaves_the_job_as_it_is(flag):
    assert plan.default_placement({flag: 1}, gpus=4) == {} == plan.default_placement({flag: False}, gpus=4)
    assert plan.default_placement({}, gpus=0) == {}


@pytest.mark.parametrize("name", ["split_async", "one_trainer_async"])
def test_the_split_plans_use_every_gpu_one_step_apart(name):
    for gpus in (2, 3, 4, 8):
        s = plan.PLANS[name].settings(gpus)
        assert s["actor_num_gpus_per_node"] + s["rollout_num_gpus"] == gpus and s["rollout_schedule"] == "one_step"
        assert s["actor_num_gpus_per_node"] == (gpus // 2 if name == "split_async" else 1)


def test_the_dry_run_prints_the_plan_and_the_rule(tmp_path):
    report = dry_run_report(validate(from_dict(None, output_dir=str(tmp_path))))
    line = next(line for line in report.splitlines() if line.strip().startswith("plan "))
    for n, name in plan.PLAN_BY_GPUS.items():
        assert f"{n} GPU(s): {name}" in line


SMALL = {
    "rollout_batch_size": 4,
    "n_samples_per_prompt": 4,
    "rollout_max_response_len": 5,
    "global_batch_size": 16,
    "micro_batch_size": 8,
    "actor_num_gpus_per_node": 1,
    "use_tensorboard": False,
}


@pytest.mark.slow  # 80-230 s on 2 loaded cores; tests/test_scale_cuda.py runs one_step on GPUs
@pytest.mark.parametrize("engines", [1, 3])  # 3: one_trainer_async's shape on four GPUs (the rollout split three ways)
def test_one_step_async_stages_the_weights_while_the_next_rollout_samples(engines, tmp_path, monkeypatch):
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
    settings["rollout_num_gpus"] = engines
    ray.init(num_cpus=1 + engines, include_dashboard=False, log_to_driver=False)
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


def _broadcast_as_trainer(port: int, buckets: list) -> None:
    """Trainer rank 0 of a gloo weight-update group of two, in its own process: start every bucket's broadcast
    before waiting on the one before it, as ``TrainerWorker.broadcast_buckets`` does."""
    from runtime.engines import weight_transfer

    group = weight_transfer.init_weights_update_group(
        master_address="127.0.0.1", master_port=port, rank=0, world_size=2, group_name="staged", backend="gloo"
    )
    in_flight = None
    for bucket in buckets:
        started = weight_transfer.start_bucket(group, bucket)
        if in_flight is not None:
            weight_transfer.finish_bucket(group, in_flight)
        in_flight = started
    weight_transfer.finish_bucket(group, in_flight)
    weight_transfer.destroy_group(group)


def test_staged_weights_leave_the_model_alone_until_the_swap(tmp_path):
    """The embedded engine's second buffer: buckets received by ``stage_weights_from_distributed`` change nothing it
    samples with; ``commit_staged_weights`` loads them all (bit for bit) with their version; a second commit has
    nothing to do."""
    import multiprocessing

    import torch
    from transformers import AutoModelForCausalLM

    from runtime.demo import task
    from runtime.demo.tiny_model import make_tiny_model
    from runtime.engines import HFEngine, weight_transfer
    from runtime.engines.launcher import free_port

    engine = HFEngine(str(make_tiny_model(tmp_path / "a", alphabet=task.ALPHABET, seed=0)), seed=0)
    state = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "b", alphabet=task.ALPHABET, seed=1))
    other = {k: v.clone() for k, v in state.state_dict().items() if k != "lm_head.weight"}
    before = {k: v.clone() for k, v in engine.get_weights().items()}
    names = sorted(other)
    buckets = [{n: other[n] for n in names[i::3]} for i in range(3)]
    port = free_port()
    trainer = multiprocessing.get_context("spawn").Process(target=_broadcast_as_trainer, args=(port, buckets))
    trainer.start()
    try:
        engine.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="staged", backend="gloo")
        for i, bucket in enumerate(buckets):
            version = 7 if i == len(buckets) - 1 else None
            engine.stage_weights_from_distributed(
                *weight_transfer.bucket_meta(bucket), group_name="staged", weight_version=version
            )
        engine.destroy_weights_update_group("staged")
    finally:
        trainer.join(60)
    assert trainer.exitcode == 0
    assert engine.weight_version() == 0
    assert all(torch.equal(v, before[k]) for k, v in engine.get_weights().items())
    assert engine.commit_staged_weights() == 7 and engine.weight_version() == 7
    weights = engine.get_weights()
    assert all(torch.equal(weights[n], other[n].to(weights[n].dtype)) for n in names)
    assert engine.commit_staged_weights() is None and engine.weight_version() == 7


def test_bench_scale_prints_the_table_of_saved_medians_and_the_fastest_plan(tmp_path, monkeypatch):
    """``tools/bench_scale.py --report-only``: jobs run in separate invocations (on disjoint GPUs) print as one table,
    speed-up against the one-GPU job, the async bound for the one-step plans, and the fastest plan per count."""
    import json
    import subprocess
    import sys

    monkeypatch.syspath_prepend("tools")
    import bench_scale

    parts = {"rollout": 2.0, "log-probs": 0.3, "train": 1.5, "sync": 0.1}
    for (n, name), step in {(1, "colocated_dp"): 4.0, (4, "colocated_dp"): 3.0, (4, "one_trainer_async"): 2.0}.items():
        bench_scale.result_file(tmp_path, n, name).write_text(json.dumps({"step": step, **parts}))
    assert bench_scale.PLACEMENTS["one_trainer_async"](4)[:4] == [
        "--actor-num-gpus-per-node",
        "1",
        "--rollout-num-gpus",
        "3",
    ]
    assert bench_scale.PLACEMENTS["one_trainer_async"](2) is None  # on two GPUs it is split_async
    out = subprocess.run(
        [sys.executable, "tools/bench_scale.py", "--gpus", "1", "4", "--report-only", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    rows = {tuple(line.split(" | ")[:2]): line for line in out.splitlines() if line.startswith("| ")}
    assert "| 2.00x | 0.50 | 0.95 |" in rows[("| 4", "one_trainer_async")]  # 4 / 2 s; 2 / (max(2, 1.5) + 0.1)
    assert "| 1.33x | 0.33 | - |" in rows[("| 4", "colocated_dp")]
    assert (
        f"4 GPU(s): fastest one_trainer_async (2.000 s, 0.50x one GPU's step); default plan {plan.plan_for(4)}" in out
    )
