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
        # Running servers: each counts --rollout-num-gpus-per-engine (slime asks each server).
        ([*SGLANG, "--rollout-external-engine-addrs", "h:1,h:2 h:3", "--actor-num-gpus-per-node", "1"], 3),
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


# ---------------------------------------------------------------- disk sync: slime's folder, cleanup and hook

POST_WRITE_HOOK = """
import json, os
from ray.actor import ActorHandle

def publish(args, version_dir, rollout_engines):
    with open(os.environ["RLCORE_TEST_HOOK_LOG"], "a") as fh:
        fh.write(json.dumps({
            "args_seed": args.seed,
            "version_dir": version_dir,
            "files": sorted(os.listdir(version_dir)),
            "engines": [isinstance(e, ActorHandle) for e in rollout_engines],
        }) + "\\n")
"""


@pytest.mark.parametrize("keep_files", [False, True])
def test_disk_sync_writes_slimes_version_folders_calls_the_hook_and_cleans_up(
    keep_files, ray_session, tmp_path, monkeypatch
):
    import json

    import ray

    from runtime.cluster.engines import EngineGroup
    from runtime.cluster.placement import create_placement
    from runtime.cluster.trainers import TrainerGroup
    from runtime.cluster.weight_sync import DiskSync, disk_options, make_weight_sync
    from runtime.demo import task
    from runtime.demo.tiny_model import make_tiny_model
    from runtime.train.algo import loss_config, model_roles

    model_path = str(make_tiny_model(tmp_path / "tiny", alphabet=task.ALPHABET, seed=0))
    (tmp_path / "hook.py").write_text(POST_WRITE_HOOK)
    log = tmp_path / "hook.log"
    monkeypatch.setenv("RLCORE_TEST_HOOK_LOG", str(log))
    disk_dir = tmp_path / "shared"
    flags = [
        "--output-dir", str(tmp_path / "out"), "--seed", "77", "--update-weight-transport", "disk",
        "--update-weight-disk-dir", str(disk_dir),
        "--custom-update-weight-post-write-path", f"{tmp_path / 'hook.py'}:publish",
        *(["--update-weight-disk-keep-files"] if keep_files else []),
    ]  # fmt: skip
    cfg = parse_args(flags)
    placement = create_placement(cfg)
    trainers = TrainerGroup(
        placement,
        backend="torch",
        model_path=model_path,
        roles=model_roles(cfg),
        train_cfg=cfg.train,
        loss_cfg=loss_config(cfg),
        temperature=1.0,
        seed=0,
    )
    engines = EngineGroup(cfg, placement, model_path)
    sync = make_weight_sync(trainers, engines, bucket_bytes=4096, disk=disk_options(cfg))
    try:
        assert isinstance(sync, DiskSync) and sync.root == disk_dir
        for version in (5, 6):
            sync.push(version)
            assert engines.weight_versions() == [version]
        calls = [json.loads(line) for line in log.read_text().splitlines()]
        # slime's hook signature: (args, version_dir, rollout_engines), after the folder is written.
        assert [c["version_dir"] for c in calls] == [
            str(disk_dir / "weight_v000005"),
            str(disk_dir / "weight_v000006"),
        ]
        assert all(c["args_seed"] == 77 and c["engines"] == [True] for c in calls)
        assert all("model.safetensors.index.json" in c["files"] and "config.json" in c["files"] for c in calls)
        kept = sorted(p.name for p in disk_dir.iterdir())
        assert kept == (["weight_v000005", "weight_v000006"] if keep_files else [])
    finally:
        sync.close()
        trainers.shutdown()
        engines.shutdown()
        ray.util.remove_placement_group(placement.group)
    assert disk_dir.is_dir()  # the user's folder stays
