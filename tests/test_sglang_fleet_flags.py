"""slime's fleet flags (issue 12): how each resolves and what each changes, without a fleet (the router-backed
effects are in ``tests/test_sglang_fleet.py``)."""

from __future__ import annotations

import pytest

from runtime.config import ConfigError, parse_args
from runtime.slime_flags import BY_NAME

SGLANG = ["--rollout-engine", "sglang"]


def _problems(argv):
    with pytest.raises(ConfigError) as info:
        parse_args(argv)
    return info.value.problems


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        # slime's rule under --colocate: the engines run on the trainers' GPUs.
        (["--colocate", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "2"], 4),
        # Ours where slime has no default: one engine.
        ([*SGLANG, "--actor-num-gpus-per-node", "1", "--rollout-num-gpus-per-engine", "2", "--no-colocate"], 2),
        (["--actor-num-gpus-per-node", "1", "--no-colocate"], 1),
        # Given, it stays.
        ([*SGLANG, "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "4", "--no-colocate"], 4),
    ],
)
def test_rollout_num_gpus_is_derived_as_slime_derives_it(argv, expected):
    assert parse_args(argv).resources.rollout_num_gpus == expected


def test_offload_turns_both_offloads_on():
    cfg = parse_args(["--offload"])
    assert cfg.sglang.offload_train is True and cfg.sglang.offload_rollout is True
    plain = parse_args([])
    assert (plain.sglang.offload_train, plain.sglang.offload_rollout) == (None, None)


@pytest.mark.parametrize("off", ["--no-offload-train", "--no-offload-rollout"])
def test_offload_with_an_offload_turned_off_is_refused(off):
    (problem,) = _problems(["--offload", off])
    assert problem.startswith("--offload turns --offload-train and --offload-rollout on") and off in problem


def test_an_engine_wider_than_a_node_is_refused():
    argv = [*SGLANG, "--rollout-num-gpus-per-engine", "4", "--rollout-num-gpus", "4", "--no-colocate"]
    (problem,) = _problems([*argv, "--num-gpus-per-node", "2"])
    assert "--rollout-num-gpus-per-engine 4 > --num-gpus-per-node 2" in problem and "single-node" in problem
    assert parse_args([*argv, "--num-gpus-per-node", "4"]).resources.num_gpus_per_node == 4


@pytest.mark.parametrize("flag_name", ["--sglang-server-concurrency", "--num-gpus-per-node"])
def test_counts_below_one_are_refused(flag_name):
    (problem,) = _problems([*SGLANG, flag_name, "0"])
    assert problem == f"{flag_name} must be > 0, got 0"


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--update-weight-mode", "delta"], "/pull_weights"),
        (["--update-weight-delta-encoding", "overwrite"], "--update-weight-mode delta"),
        (["--update-weight-delta-checksum", "blake3"], "--update-weight-mode delta"),
        (["--update-weight-local-checkpoint-dir", "/nvme"], "/pull_weights"),
        (["--prefill-num-servers", "1"], "prefill/decode disaggregation"),
        (["--sglang-config", "groups.yaml"], "server groups"),
    ],
)
def test_fleet_modes_that_cannot_be_built_are_refused_with_why(argv, why):
    (problem,) = _problems(argv)
    assert problem.startswith(argv[0]) and why in problem and BY_NAME[argv[0]].note in problem
    # At slime's default they are accepted, so a slime script that spells the default out runs.
    default = BY_NAME[argv[0]].default
    if default is not None:
        parse_args([argv[0], str(default)])
