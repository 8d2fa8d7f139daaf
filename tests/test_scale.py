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
