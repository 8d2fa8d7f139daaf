"""The ``--sglang-*`` / ``--router-*`` passthrough: the generated flag list against SGLang's own parsers, the command
lines the launcher builds, and the validation of unknown or launcher-owned flags."""

from __future__ import annotations

import argparse
import json

import pytest

from runtime.cli import main
from runtime.cluster.placement import plan_bundles
from runtime.config import ConfigError, from_dict, parse_args, validate
from runtime.engines import sglang_api, sglang_flags
from runtime.engines.launcher import router_argv, server_argv

API = sglang_api.load()
needs_sglang = pytest.mark.skipif(
    API is None, reason="sglang is not installed (pip install --no-deps sglang==0.5.23, see the Makefile)"
)
needs_router = pytest.mark.skipif(API is None or API.RouterArgs is None, reason="sglang-router is not installed")


@needs_router
def test_the_generated_flag_list_matches_the_installed_sglang_and_router():
    from tools.gen_sglang_flags import generate

    assert json.loads(sglang_flags.FLAGS_FILE.read_text()) == json.loads(json.dumps(generate()))
    assert sglang_flags.versions() == {"sglang": "0.5.23", "sglang-router": API.router_version}


def test_rlcores_own_sglang_flags_do_not_shadow_sglangs():
    """Except slime's --sglang-config (server groups), which shadows SGLang's --config as in slime: that one is not
    passed through, and asking for it in a YAML config is refused, naming slime's flag."""
    own = {a.dest: a.option_strings for a in _rlcore_parser()._actions if not a.dest.startswith("_")}
    shadowed = {s for d in sglang_flags.SERVER_SHADOWED for s in sglang_flags.flags("server")[d].flags}
    passthrough = {s for f in sglang_flags.flags("server").values() for s in f.flags} - shadowed
    for options in own.values():
        for option in options:
            if option.startswith("--sglang-"):
                assert "--" + option.removeprefix("--sglang-") not in passthrough, option
    assert shadowed == {"--config"}
    (problem,) = sglang_flags.passthrough_problems("server", {"config": "server.yaml"})
    assert problem.startswith("--sglang-config is set by rlcore") and "slime's own flag" in problem


def _rlcore_parser():
    from runtime.config import build_parser

    return build_parser()


@needs_sglang
def test_the_server_command_line_parses_with_sglangs_own_parser():
    values = {
        "mem_fraction_static": 0.7,
        "enable_memory_saver": True,
        "dtype": "bfloat16",
        "cuda_graph_bs_decode": [1, 2, 4],
        "enable_tf32_matmul": False,
        "chunked_prefill_size": 4096,
    }
    argv = server_argv(
        "python -m sglang.launch_server",
        model_path="/models/qwen",
        host="10.0.0.1",
        port=31000,
        tp_size=2,
        seed=7,
        server_args=values,
    )
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    parser = argparse.ArgumentParser()
    API.ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv[3:])
    assert (ns.model_path, ns.host, ns.port, ns.tp_size, ns.random_seed) == ("/models/qwen", "10.0.0.1", 31000, 2, 7)
    for dest, value in values.items():
        assert getattr(ns, dest) == value, dest


@needs_router
def test_the_router_command_line_parses_with_the_routers_own_parser_and_keeps_slimes_defaults():
    argv = router_argv(
        ["http://a:1", "http://b:2"],
        host="0.0.0.0",
        port=30000,
        request_timeout_secs=14400,
        router_args={"policy": "round_robin", "balance_rel_threshold": 2.0},
    )
    assert argv[1:3] == ["-m", "sglang_router.launch_router"]
    parser = argparse.ArgumentParser()
    API.RouterArgs.add_cli_args(parser, use_router_prefix=False, exclude_host_port=False)
    ns = parser.parse_args(argv[3:])
    assert ns.worker_urls == ["http://a:1", "http://b:2"] and (ns.host, ns.port) == ("0.0.0.0", 30000)
    assert (ns.policy, ns.request_timeout_secs) == ("round_robin", 14400)
    # slime's overrides, unless a --router-* flag says otherwise.
    assert (ns.log_level, ns.balance_abs_threshold, ns.balance_rel_threshold) == ("warn", 10, 2.0)


def test_passthrough_flags_are_parsed_into_the_config_and_merged_with_yaml(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("sglang:\n  sglang_args: {mem_fraction_static: 0.5, page_size: 16}\n")
    cfg = parse_args(
        [
            "--config", str(config), "--rollout-engine", "sglang",
            "--sglang-mem-fraction-static", "0.7", "--sglang-enable-memory-saver",
            "--sglang-cuda-graph-bs-decode", "1", "2",
            "--router-policy", "round_robin", "--no-sglang-enable-tf32-matmul",
        ]
    )  # fmt: skip
    assert cfg.sglang.sglang_args == {
        "mem_fraction_static": 0.7,
        "page_size": 16,
        "enable_memory_saver": True,
        "cuda_graph_bs_decode": [1, 2],
        "enable_tf32_matmul": False,
    }
    assert cfg.sglang.router_args == {"policy": "round_robin"}


def test_unknown_sglang_flags_fail_before_anything_starts(capsys, tmp_path):
    assert main(["--rollout-engine", "sglang", "--sglang-mem-fraction-statik", "0.7"]) == 2
    err = capsys.readouterr().err
    assert "--sglang-mem-fraction-statik: not a flag of SGLang 0.5.23's ServerArgs" in err
    with pytest.raises(ConfigError, match="--router-polcy: not a flag of sglang-router's RouterArgs"):
        parse_args(["--router-polcy", "manual"])
    config = tmp_path / "c.yaml"
    config.write_text("rollout_engine: sglang\nsglang_args: {mem_fraction_statik: 0.5}\nrouter_args: {bogus: 1}\n")
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "--sglang-mem-fraction-statik is not a flag of SGLang 0.5.23's ServerArgs" in err
    assert "--router-bogus is not a flag of sglang-router's RouterArgs" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sglang-tp-size", "2"], "--sglang-tp-size is set by rlcore: use --rollout-num-gpus-per-engine"),
        (["--sglang-model-path", "/m"], "--sglang-model-path is set by rlcore: use --hf-checkpoint"),
        (["--router-worker-urls", "http://a:1"], "--router-worker-urls is set by rlcore"),
        (["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"], "must be a multiple of"),
        (["--sglang-router-ip", "10.0.0.1"], "--sglang-router-ip and --sglang-router-port go together"),
        (
            ["--colocate", "--no-offload-rollout"],
            "sglang engines, which hold a fixed fraction of their GPU: it needs --offload-rollout",
        ),
        (["--offload-train", "--async"], "--offload-train takes turns between rollout and training"),
        (
            ["--sglang-url", "http://a:1", "--rollout-external-engine-addrs", "a:1"],
            "--sglang-url is an alias of --rollout-external-engine-addrs",
        ),
    ],
)
def test_bad_fleet_settings_name_their_flag(argv, message):
    with pytest.raises(ConfigError) as info:
        parse_args(["--rollout-engine", "sglang", *argv])
    assert message in "\n".join(info.value.problems)


def test_sglang_flags_need_the_sglang_engine():
    # As in slime, whose only engine SGLang is, the server flags select it unless an engine is named.
    assert parse_args(["--sglang-mem-fraction-static", "0.7"]).rollout.rollout_engine == "sglang"
    with pytest.raises(ConfigError) as info:
        parse_args(["--rollout-engine", "hf", "--sglang-mem-fraction-static", "0.7"])
    assert "--sglang-* flags: SGLang server flags, passed through, used by --rollout-engine sglang only" in str(
        info.value
    )
    # The embedded engine receives over a weight-update group too.
    assert parse_args(["--update-weight-transport", "nccl"]).sglang.update_weight_transport == "nccl"


def test_a_passthrough_value_of_the_wrong_type_in_yaml_names_its_flag():
    cfg = from_dict(None, rollout_engine="sglang", sglang_args={"mem_fraction_static": "high", "dtype": "fp7"})
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    text = str(info.value)
    assert "--sglang-mem-fraction-static expects a number, got 'high'" in text
    assert "--sglang-dtype must be one of auto, bfloat16, float" in text


def test_launched_engines_take_rollout_num_gpus_per_engine_bundles_each(tmp_path):
    common = {"output_dir": str(tmp_path), "actor_num_gpus_per_node": 2, "rollout_engine": "sglang"}
    plan = plan_bundles(from_dict(None, **common, rollout_num_gpus=4, rollout_num_gpus_per_engine=2))
    assert (plan.n_bundles, plan.engine_bundles) == (6, [2, 3, 4, 5])
    external = plan_bundles(from_dict(None, **common, rollout_external_engine_addrs="h:1 h:2"))
    assert (external.n_bundles, external.engine_bundles) == (2, [])


def test_external_addresses_become_urls():
    from runtime.engines.registry import sglang_urls

    cfg = from_dict(None, rollout_engine="sglang", rollout_external_engine_addrs="10.0.0.1:30000, http://b:1")
    assert sglang_urls(cfg) == ["http://10.0.0.1:30000", "http://b:1"]
