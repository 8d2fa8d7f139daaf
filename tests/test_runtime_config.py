"""runtime.config: flag parsing, YAML + flag precedence, round trips, and one test per validation rule."""

import copy
import dataclasses
import json
import pickle
import typing
from typing import Literal

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from runtime.cli import EXIT_BAD_INPUT, main
from runtime.cluster import checkpoint
from runtime.config import (
    _SPECS,
    BUILTIN_JOB_DEFAULTS,
    AlgoConfig,
    Config,
    ConfigError,
    _unwrap_optional,
    build_parser,
    dump_yaml,
    flag,
    format_config,
    from_dict,
    load_yaml,
    parse_args,
    to_dict,
    validate,
)
from runtime.train.algo import check_supported

# The flags issue 4 lists, spelled as slime spells them.
ISSUE_FLAGS = """--hf-checkpoint --prompt-data --input-key --label-key --metadata-key --apply-chat-template
--rollout-batch-size --n-samples-per-prompt --rollout-max-prompt-len --rollout-max-response-len --rollout-temperature
--rollout-top-p --rollout-top-k --num-rollout --global-batch-size --micro-batch-size --max-tokens-per-gpu
--advantage-estimator --eps-clip --eps-clip-high --eps-clip-c --kl-coef --use-kl-loss --kl-loss-coef --kl-loss-type
--entropy-coef --use-tis --lr --seed --colocate --actor-num-gpus-per-node --rollout-num-gpus --rm-type --custom-rm-path
--custom-generate-function-path --dynamic-sampling-filter-path --over-sampling-batch-size --eval-interval
--eval-prompt-data --n-samples-per-eval-prompt --save --save-interval --load --use-tensorboard --use-wandb""".split()


def _problems(argv):
    with pytest.raises(ConfigError) as info:
        parse_args(argv)
    return "\n".join(info.value.problems)


# The built-in job's tuned values (issue 4's review, finding 14): its config.yaml must keep exactly these.
BUILTIN_TUNED = {
    "rollout_max_response_len": 8,
    "lr": 1e-3,
    "use_kl_loss": True,
    "kl_loss_type": "low_var_kl",
    "rollout_shuffle": True,
    "rollout_batch_size": 32,
    "n_samples_per_prompt": 8,
    "num_rollout": 250,
    "micro_batch_size": 8,
    "actor_num_gpus_per_node": 1,
    "calculate_per_token_loss": True,
    "use_tensorboard": True,
    "rollout_skip_special_tokens": True,
    "lora_modules_to_save": "embed_tokens",
}
# slime's defaults for the same flags (rollout_max_response_len, rollout_batch_size, num_rollout: none, so a real
# job must set them).
SLIME_DEFAULTS = {
    "rollout_max_response_len": None,
    "lr": 1e-6,
    "use_kl_loss": False,
    "kl_loss_type": "k1",
    "rollout_shuffle": False,
    "rollout_batch_size": None,
    "n_samples_per_prompt": 1,
    "num_rollout": None,
    "micro_batch_size": 1,
    "actor_num_gpus_per_node": 8,
    "calculate_per_token_loss": False,
    "use_tensorboard": False,
    "rollout_skip_special_tokens": False,
    "lora_modules_to_save": "",  # (ours: slime has no LoRA; peft's default, no module trained in full)
}


def _leaf(cfg, name):
    section = _SPECS[name][0]
    return getattr(getattr(cfg, section) if section else cfg, name)


def _with(cfg, values):
    tree = to_dict(cfg)
    for name, value in values.items():
        tree[_SPECS[name][0]][name] = value
    return from_dict(tree)


def test_defaults_parse_and_validate():
    cfg = parse_args([])
    assert BUILTIN_JOB_DEFAULTS == BUILTIN_TUNED
    assert {name: _leaf(cfg, name) for name in BUILTIN_TUNED} == BUILTIN_TUNED
    # Apart from the tuned values, the built-in job is the flag defaults.
    # (and the global batch slime derives from them: one optimizer step per rollout; and Megatron's LR decay over
    # the job's optimizer steps; and one engine's devices for --rollout-num-gpus, not colocated).
    derived = {"global_batch_size": 32 * 8, "lr_decay_iters": 250, "rollout_num_gpus": 1}
    assert cfg == _with(Config(), {**BUILTIN_TUNED, **derived})
    assert validate(cfg) is cfg
    # The default batch arithmetic must be whole optimizer steps.
    per_rollout = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    assert per_rollout % cfg.train.global_batch_size == 0


def test_flag_defaults_follow_slime_outside_the_builtin_job(tmp_path):
    assert {name: _leaf(Config(), name) for name in SLIME_DEFAULTS} == SLIME_DEFAULTS
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1", "label": "2"}\n')
    required = {"rollout_max_response_len": 64, "rollout_batch_size": 4, "num_rollout": 3}
    for job in (["--hf-checkpoint", str(tmp_path / "model")], ["--prompt-data", str(prompts), "--rm-type", "math"]):
        problems = _problems(job)
        assert "--rollout-max-response-len has no default outside the built-in job" in problems
        assert "--rollout-batch-size is required" in problems and "set --num-rollout" in problems
        given = [arg for name, value in required.items() for arg in (flag(name), str(value))]
        one_trainer = ["--actor-num-gpus-per-node", "1", "--advantage-estimator", "reinforce_plus_plus"]
        cfg = parse_args([*job, *given, *one_trainer])
        expected = {**SLIME_DEFAULTS, **required, "actor_num_gpus_per_node": 1}
        assert {name: _leaf(cfg, name) for name in SLIME_DEFAULTS} == expected
        # slime's derived default: one optimizer step per rollout.
        assert cfg.train.global_batch_size == 4 * 1


def test_builtin_job_values_fill_only_what_the_user_left_unset(tmp_path):
    cfg = parse_args(["--lr", "0.01", "--no-use-kl-loss", "--kl-loss-type", "k1"])
    assert (cfg.train.lr, cfg.algo.use_kl_loss, cfg.algo.kl_loss_type) == (0.01, False, "k1")
    assert (cfg.rollout.rollout_max_response_len, cfg.data.rollout_shuffle) == (8, True)
    # A YAML key counts as set, even when it equals the flag default.
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  rollout_shuffle: false\nrollout_max_response_len: 5\n")
    cfg = parse_args(["--config", str(path)])
    assert (cfg.data.rollout_shuffle, cfg.rollout.rollout_max_response_len, cfg.train.lr) == (False, 5, 1e-3)
    help_text = " ".join(build_parser().format_help().split())
    assert "built-in job: 0.001" in help_text and "--rollout-max-response-len 8" in help_text


def test_builtin_job_corrects_off_policy_tokens_under_the_async_schedules(tmp_path):
    assert parse_args([]).algo.use_tis is False
    assert parse_args(["--async"]).algo.use_tis is True
    assert parse_args(["--rollout-schedule", "fully_async"]).algo.use_tis is True
    assert parse_args(["--async", "--no-use-tis"]).algo.use_tis is False
    # Other jobs keep slime's default.
    assert from_dict(None, rollout_schedule="one_step", hf_checkpoint=str(tmp_path)).algo.use_tis is False


def test_slime_hooks_read_leaf_fields_flat():
    cfg = parse_args(["--n-samples-per-prompt", "4", "--global-batch-size", "128", "--seed", "7"])
    assert (cfg.n_samples_per_prompt, cfg.rollout_max_response_len, cfg.global_batch_size) == (4, 8, 128)
    for name in _SPECS:
        assert getattr(cfg, name) == _leaf(cfg, name), name
    assert not hasattr(cfg, "no_such_flag")
    with pytest.raises(AttributeError, match="no_such_flag"):
        cfg.no_such_flag  # noqa: B018
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0
    assert pickle.loads(pickle.dumps(cfg)) == cfg and copy.deepcopy(cfg) == cfg


def test_trainers_on_several_nodes_are_rejected_before_start_unless_a_ray_cluster_is_joined(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    two_nodes = ["--actor-num-nodes", "2", "--global-batch-size", "16"]
    with pytest.raises(ConfigError, match="--actor-num-nodes 2: this runtime runs trainers on one node only, unless"):
        check_supported(parse_args(two_nodes))
    check_supported(parse_args([]))
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    check_supported(parse_args(two_nodes))


def test_bad_load_fails_validation_and_the_cli_exits_2(tmp_path, capsys):
    # slime starts afresh from a --load folder that does not exist or is empty (and --save may write there).
    (tmp_path / "empty").mkdir()
    for fresh in (tmp_path / "empty", tmp_path / "missing"):
        assert parse_args(["--load", str(fresh), "--save", str(fresh)]).ckpt.load == str(fresh)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not a checkpoint")
    assert "neither a checkpoint folder nor a --save root" in _problems(["--load", str(tmp_path / "other")])
    root = tmp_path / "ckpt"
    step = checkpoint.step_dir(root, 3)
    step.mkdir(parents=True)
    (root / checkpoint.LATEST).write_text(step.name)
    (step / checkpoint.LOOP_STATE).write_bytes(b"")
    # A step folder without the trainers' shards is not a checkpoint either.
    assert "'latest' names 'step_000003', which has no trainer" in _problems(["--load", str(root)])
    assert main(["--load", str(root), "--output-dir", str(tmp_path / "out")]) == EXIT_BAD_INPUT
    assert "--load" in capsys.readouterr().err and not (tmp_path / "out").exists()
    (step / checkpoint.TRAINER_DIR).mkdir()
    assert "has no manifest.json" in _problems(["--load", str(root)])
    checkpoint.write_manifest(step, 3)
    assert parse_args(["--load", str(root)]).ckpt.load == str(root)
    assert checkpoint.resolve(root) == step and checkpoint.resolve(step) == step


def test_a_fresh_load_reaches_a_data_source_as_given(tmp_path):
    """slime's data sources look for their state under args.load themselves; a --load folder that does not exist yet
    is handed to them as it is (a checkpoint's is its root)."""
    from runtime.job_data import job_data_source
    from runtime.rollout.plugins import load_rollout_hooks

    fresh = str(tmp_path / "fresh")
    source = "tests/fixtures/slime_style_plugin.py:CountingDataSource"
    cfg = parse_args(["--data-source-path", source, "--load", fresh, "--save", fresh])
    _, data_source = job_data_source(cfg, None, load_rollout_hooks(cfg))
    assert data_source.args.ckpt.load == fresh


def test_flags_reach_their_fields():
    cfg = parse_args(
        [
            "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "2",
            "--global-batch-size", "8",
            "--lr", "3e-4",
            "--use-kl-loss",
            "--no-use-tensorboard",
            "--advantage-estimator", "rloo",
            "--eps-clip-high", "0.28",
            "--rollout-max-prompt-len", "none",
            "--train-backend", "torch",
        ]
    )  # fmt: skip
    assert cfg.rollout.rollout_batch_size == 4
    assert cfg.rollout.n_samples_per_prompt == 2
    assert cfg.train.global_batch_size == 8
    assert cfg.train.lr == 3e-4
    assert cfg.algo.use_kl_loss is True
    assert cfg.log.use_tensorboard is False
    assert cfg.algo.advantage_estimator == "rloo"
    assert cfg.algo.eps_clip_high == 0.28
    assert cfg.data.rollout_max_prompt_len is None


def test_every_field_has_a_flag_named_after_it():
    parser = build_parser()
    options = {opt for action in parser._actions for opt in action.option_strings}
    for section in dataclasses.fields(Config):
        value = getattr(Config(), section.name)
        fields = dataclasses.fields(value) if dataclasses.is_dataclass(value) else [section]
        for f in fields:
            if f.metadata.get("passthrough"):
                continue  # sglang_args / router_args: one --sglang-* / --router-* flag per SGLang flag instead
            assert flag(f.name) in options, f.name
    assert set(ISSUE_FLAGS) <= options, set(ISSUE_FLAGS) - options
    assert {"--sglang-mem-fraction-static", "--sglang-enable-memory-saver", "--router-policy"} <= options


def test_flag_prefixes_are_not_accepted():
    expected = "--rollout-batch: unrecognized argument (neither rlcore's nor slime's)"
    assert expected in _problems(["--rollout-batch", "4"])


def test_bad_flag_value_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--rollout-batch-size", "eight"])
    assert "--rollout-batch-size expects a int" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--advantage-estimator", "magic"])


def test_yaml_nested_then_flags_override(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "seed": 7,
                "rollout": {"rollout_batch_size": 4, "n_samples_per_prompt": 4, "num_rollout": 3},
                "train": {"global_batch_size": 16, "lr": "1e-5"},
                "algo": {"eps-clip": 0.1},
            }
        )
    )
    cfg = parse_args(["--config", str(path), "--num-rollout", "9", "--seed", "11"])
    assert cfg.seed == 11 and cfg.rollout.num_rollout == 9
    assert cfg.rollout.rollout_batch_size == 4 and cfg.train.global_batch_size == 16
    # YAML 1.1 reads 1e-5 as a string; float fields accept it.
    assert cfg.train.lr == 1e-5 and isinstance(cfg.train.lr, float)
    assert cfg.algo.eps_clip == 0.1


def test_yaml_flat_keys_like_slime_custom_config(tmp_path):
    path = tmp_path / "flat.yaml"
    path.write_text(
        "rollout-batch-size: 2\nn_samples_per_prompt: 4\nglobal_batch_size: 8\nkl_loss_coef: 0.01\nuse-kl-loss: true\n"
    )
    cfg = parse_args(["--config", str(path)])
    assert (cfg.rollout.rollout_batch_size, cfg.train.global_batch_size, cfg.algo.kl_loss_coef) == (2, 8, 0.01)


def test_yaml_unknown_and_misplaced_keys(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rollout:\n  lr: 0.1\nnot_a_flag: 3\n")
    text = _problems(["--config", str(path)])
    assert "'lr' belongs to section 'train'" in text
    assert "unknown setting 'not_a_flag'" in text
    assert "does not exist" in _problems(["--config", str(tmp_path / "missing.yaml")])


def test_config_round_trip_through_yaml_and_dict(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1", "label": "2"}\n')
    cfg = parse_args(
        ["--prompt-data", str(prompts), "--rm-type", "math", "--seed", "5", "--eps-clip-c", "3", "--use-tis"]
        + ["--rollout-max-response-len", "32", "--rollout-batch-size", "4", "--num-rollout", "2"]
        + ["--actor-num-gpus-per-node", "1", "--n-samples-per-prompt", "2", "--input-key", "prompt"]
    )
    path = tmp_path / "saved.yaml"
    dump_yaml(cfg, path)
    assert parse_args(["--config", str(path)]) == cfg
    assert from_dict(to_dict(cfg)) == cfg
    assert from_dict(json.loads(json.dumps(to_dict(cfg)))) == cfg


def test_config_is_frozen():
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rollout.rollout_batch_size = 3


def test_format_config_lists_flags_and_marks_changes():
    text = format_config(from_dict(num_rollout=3))
    lines = {line.split()[-2] if line.startswith("*") else None: line for line in text.splitlines()}
    assert "--num-rollout" in lines and lines["--num-rollout"].rstrip().endswith("3")
    assert "  --lr " in text and "* --lr " not in text
    assert "[rollout]" in text and "[reward]" in text


def test_every_estimator_name_maps_to_an_rlcore_estimator():
    from rlcore.advantages.compute import ESTIMATORS as CORE_ESTIMATORS

    names = typing.get_args(typing.get_type_hints(AlgoConfig)["advantage_estimator"])
    assert {from_dict(advantage_estimator=name).algo.core_estimator for name in names} == set(CORE_ESTIMATORS)
    assert from_dict(advantage_estimator="ppo").algo.core_estimator == "gae"


def test_num_trainer_procs_counts_nodes_times_slots():
    assert from_dict(actor_num_nodes=2, actor_num_gpus_per_node=3).resources.num_trainer_procs == 6


# One test per validation rule: each message names the flags involved.


def test_rule_global_batch_multiple_of_micro_batch_times_procs():
    text = _problems(["--global-batch-size", "16", "--micro-batch-size", "3"])
    assert "--global-batch-size 16" in text and "--micro-batch-size 3" in text
    text = _problems(["--global-batch-size", "16", "--actor-num-gpus-per-node", "3"])
    assert "--actor-num-gpus-per-node 3" in text
    # With a token budget only the process count must divide.
    text = _problems(["--global-batch-size", "16", "--max-tokens-per-gpu", "512", "--actor-num-gpus-per-node", "3"])
    assert "trainer processes 3" in text
    parse_args(["--global-batch-size", "16", "--micro-batch-size", "4", "--actor-num-gpus-per-node", "2"])


def test_rule_global_batch_divides_rollout_samples():
    text = _problems(["--rollout-batch-size", "3", "--n-samples-per-prompt", "4", "--global-batch-size", "8"])
    assert "--rollout-batch-size 3" in text and "--n-samples-per-prompt 4" in text and "= 12" in text


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "gspo", "rloo", "reinforce_plus_plus_baseline"])
def test_rule_group_baseline_needs_two_samples(estimator):
    argv = ["--n-samples-per-prompt", "1", "--rollout-batch-size", "8", "--global-batch-size", "8"]
    text = _problems(argv + ["--advantage-estimator", estimator])
    assert "--n-samples-per-prompt 1" in text and estimator in text
    parse_args(argv + ["--advantage-estimator", "reinforce_plus_plus"])


def test_rule_unknown_choices_from_yaml_or_code():
    text = "\n".join(pytest.raises(ConfigError, validate, from_dict(advantage_estimator="magic")).value.problems)
    assert "--advantage-estimator must be one of" in text and "'magic'" in text
    text = "\n".join(pytest.raises(ConfigError, validate, from_dict(on_bad_row="ignore")).value.problems)
    assert "--on-bad-row" in text


def test_rule_wrong_types_from_yaml():
    problems = pytest.raises(ConfigError, validate, from_dict(rollout_batch_size="8", use_tis="yes")).value.problems
    assert any(p.startswith("--rollout-batch-size must be a int") for p in problems)
    assert any(p.startswith("--use-tis must be a bool") for p in problems)


def test_rule_missing_files(tmp_path):
    text = _problems(
        [
            "--prompt-data", str(tmp_path / "nope.jsonl"),
            "--rm-type", "math",
            "--eval-prompt-data", str(tmp_path / "eval.parquet"),
            "--eval-interval", "5",
            "--hf-checkpoint", str(tmp_path / "no_model"),
            "--load", str(tmp_path / "no_ckpt"),
        ]
    )  # fmt: skip
    for name in ("--prompt-data", "--eval-prompt-data", "--hf-checkpoint"):
        assert f"{name}:" in text
    assert "--load:" not in text  # a --load folder that does not exist yet: the job starts afresh, as slime's
    (tmp_path / "model").mkdir()
    assert "has no config.json" in _problems(["--hf-checkpoint", str(tmp_path / "model")])
    (tmp_path / "p.csv").write_text("x")
    assert "must be a .jsonl or .parquet" in _problems(["--prompt-data", str(tmp_path / "p.csv"), "--rm-type", "math"])


def test_rule_hook_paths(tmp_path):
    text = _problems(
        [
            "--custom-rm-path", str(tmp_path / "reward.py") + ":score",
            "--custom-generate-function-path", "no_such_package_xyz.gen:generate",
            "--dynamic-sampling-filter-path", "not a path",
        ]
    )  # fmt: skip
    assert f"--custom-rm-path {tmp_path / 'reward.py'}:score: file" in text and "does not exist" in text
    assert "--custom-generate-function-path no_such_package_xyz.gen:generate: no module named" in text
    assert "--dynamic-sampling-filter-path not a path:" in text
    (tmp_path / "reward.py").write_text("def score(args, sample):\n    return 1.0\n")
    cfg = parse_args(["--custom-rm-path", f"{tmp_path / 'reward.py'}:score"])
    assert cfg.reward.custom_rm_path.endswith("reward.py:score")
    parse_args(["--dynamic-sampling-filter-path", "runtime.rollout.filters.check_reward_nonzero_std"])


def test_rule_ranges():
    text = _problems(
        [
            "--rollout-top-p", "0",
            "--rollout-top-k", "0",
            "--rollout-temperature", "0",
            "--eps-clip-c", "0.5",
            "--gamma", "1.5",
            "--reward-timeout", "-1",
            "--kl-loss-coef", "-0.1",
        ]
    )  # fmt: skip
    for name in (
        "--rollout-top-p",
        "--rollout-top-k",
        "--rollout-temperature",
        "--eps-clip-c",
        "--gamma",
        "--reward-timeout",
        "--kl-loss-coef",
    ):
        assert name in text, name
    assert "--rollout-batch-size must be > 0" in _problems(["--rollout-batch-size", "0"])


def test_rule_combinations(tmp_path):
    assert "--save-interval needs --save" in _problems(["--save-interval", "2"])
    refusal = (
        "--sglang-url: an alias of --rollout-external-engine-addrs (running SGLang servers), used by --rollout-engine "
        "sglang only"
    )
    assert refusal in _problems(["--sglang-url", "http://h:30000"])
    cfg = parse_args(["--rollout-engine", "sglang", "--sglang-url", "http://a:30000,http://b:30000"])
    assert cfg.rollout.sglang_url == "http://a:30000,http://b:30000"
    argv = ["--over-sampling-batch-size", "4", "--rollout-batch-size", "8"]
    assert "--over-sampling-batch-size 4 must be >= --rollout-batch-size 8" in _problems(argv)
    argv = ["--max-tokens-per-gpu", "20", "--rollout-max-prompt-len", "10", "--rollout-max-response-len", "16"]
    assert "--max-tokens-per-gpu 20 cannot hold" in _problems(argv)
    assert "--colocate" in _problems(["--colocate", "--rollout-num-gpus", "2"])
    argv = ["--kl-loss-coef", "0.01", "--no-use-kl-loss"]
    assert "--kl-loss-coef 0.01 has no effect without --use-kl-loss" in _problems(argv)
    parse_args(["--kl-loss-coef", "0.01", "--use-kl-loss"])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1", "label": "2"}\n')
    assert "--rm-type builtin" in _problems(["--prompt-data", str(prompts)])
    argv = ["--prompt-data", str(prompts), "--rm-type", "math", "--eval-interval", "2"]
    assert "--eval-prompt-data" in _problems(argv)


def test_all_problems_reported_at_once():
    problems = pytest.raises(
        ConfigError, parse_args, ["--save-interval", "2", "--global-batch-size", "7", "--micro-batch-size", "2"]
    ).value.problems
    assert len(problems) >= 3
    assert isinstance(ConfigError(problems), ValueError)


def _value_strategy(tp):
    inner, optional = _unwrap_optional(tp)
    if typing.get_origin(inner) is Literal:
        base = st.sampled_from(typing.get_args(inner))
    elif inner is bool:
        base = st.booleans()
    elif inner is int:
        base = st.integers(-(2**40), 2**40)
    elif inner is float:
        base = st.floats(allow_nan=False)
    else:
        base = st.text(max_size=20)
    return st.one_of(st.none(), base) if optional else base


@given(st.fixed_dictionaries({}, optional={name: _value_strategy(tp) for name, (_, _, tp) in _SPECS.items()}))
def test_any_config_round_trips_through_yaml(tmp_path_factory, values):
    cfg = from_dict(values)
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    dump_yaml(cfg, path)
    assert load_yaml(path) == cfg
    assert from_dict(to_dict(cfg)) == cfg
    for name, value in values.items():
        section = _SPECS[name][0]
        assert getattr(getattr(cfg, section) if section else cfg, name) == value


def test_engine_max_running_requests_is_positive_reaches_the_embedded_engine_and_is_refused_with_sglang():
    from runtime.engines.registry import engine_kind

    assert "--engine-max-running-requests must be > 0" in _problems(["--engine-max-running-requests", "0"])
    argv = ["--rollout-engine", "sglang", "--sglang-url", "http://h:1", "--engine-max-running-requests", "4"]
    refusal = (
        "--engine-max-running-requests: a flag of the embedded engine (SGLang servers take --sglang-* flags), used by "
        "--rollout-engine hf only"
    )
    assert refusal in _problems(argv)
    cfg = parse_args(["--engine-max-running-requests", "4"])
    assert engine_kind("hf").kwargs(cfg, "m", 0)["max_running_requests"] == 4
    assert engine_kind("hf").kwargs(parse_args([]), "m", 0)["max_running_requests"] is None
