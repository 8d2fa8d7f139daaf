"""slime's flags: the table (runtime/slime_flags.py) against the parser and the docs, every refusal, and slime's own
run scripts through ``rlcore-run --dry-run``."""

import dataclasses
import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from runtime import slime_flags
from runtime.cli import EXIT_BAD_INPUT, main
from runtime.config import _SPECS, MEGATRON_VALUES_BUILT, Config, ConfigError, build_parser, flag, parse_args
from runtime.slime_flags import DIFFERS, REFUSED, SLIME_FLAGS, YES
from runtime.train.backends import megatron_checkpoint as mck

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "slime_scripts"
# The user modules slime's examples put on PYTHONPATH (examples/retool's generate_with_retool), ported.
EXAMPLE_MODULES = ROOT / "tests" / "fixtures" / "slime_examples"
# rlcore-run's own flags (documented as ours in docs/runtime.md), which slime does not have.
OURS = {
    "output_dir",
    "on_bad_row",
    "allow_prompt_data_change",
    "rollout_engine",
    "sglang_url",
    "engine_compile",
    "engine_max_running_requests",
    "engine_kv_cache_tokens",
    "rollout_schedule",
    "max_staleness",
    "loss_agg_mode",
    "reward_timeout",
    "sft_warmup_steps",
    "weight_decay",
    "bf16",
    "custom_args",
    "max_reward_error_rate",
    "max_reward_error_steps",
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "lora_modules_to_save",
    "lora_export",
    "sglang_args",
    "router_args",
    "sglang_server_command",
    "sglang_server_startup_timeout",
    "max_trainer_restarts",
    "attn_implementation",
    "rollout_top_p_replay",
    "torch_compile",
}


@pytest.fixture(autouse=True)
def _example_modules_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE_MODULES))


def _problems(argv):
    with pytest.raises(ConfigError) as info:
        parse_args(argv)
    return info.value.problems


def test_the_table_lists_slimes_own_flags_once_each():
    # 208 flags of slime's own groups + the 21 Megatron flags slime resets (SLIME_REFERENCE.md, 1a and 1b).
    assert len(SLIME_FLAGS) == 229
    assert len({f.name for f in SLIME_FLAGS}) == 229
    assert sum(slime_flags.counts().values()) == 229
    for f in SLIME_FLAGS:
        assert f.note or f.status == YES, f.name  # every difference and refusal says why


def test_every_config_field_is_a_slime_flag_or_one_of_ours():
    supported = {f.dest for f in SLIME_FLAGS if f.status in (YES, DIFFERS)}
    megatron = {name[2:].replace("-", "_") for name in slime_flags.MEGATRON_PARSED}
    assert set(_SPECS) == supported | OURS | megatron
    assert not supported & OURS and not megatron & (supported | OURS)
    assert not slime_flags.MEGATRON_PARSED & slime_flags.MEGATRON_FLAGS.keys()
    # Refused flags are parsed beside the config's, never as one of its fields.
    assert not set(slime_flags.REFUSED_BY_DEST) & set(_SPECS)


def test_megatron_parsed_is_every_flag_declared_as_megatrons():
    from runtime.config import MODEL_SHAPE_FIELDS, flag
    from runtime.train.backends.megatron_options import MegatronOptions

    parsed = slime_flags.MEGATRON_PARSED
    # The Megatron backend's fields: Megatron's own flags unless they carry a row of slime's table (slime's flags).
    for f in dataclasses.fields(MegatronOptions):
        assert (flag(f.name) in parsed) != ("slime" in f.metadata), f.name
    # The model shape flags, and the Megatron flags that the torch backend reads too (declared in the train section).
    assert {flag(name) for name in MODEL_SHAPE_FIELDS} <= parsed
    assert {"--recompute-granularity", "--lr-decay-iters"} <= parsed
    # Each is a config field's flag, so the command line parses it.
    assert parsed <= {spec[1].metadata.get("flag", flag(name)) for name, spec in _SPECS.items()}


@pytest.mark.parametrize("entry", [f for f in SLIME_FLAGS if f.status == YES], ids=lambda f: f.name)
def test_supported_flags_default_to_slimes_default(entry):
    value = getattr(Config(), entry.dest)
    if entry.default in ({}, []):
        assert value == entry.default
    else:
        assert value == entry.default, f"{entry.name}: rlcore {value!r}, slime {entry.default!r}"


def _non_default_argv(entry):
    if entry.kind in ("true", "false"):
        return [entry.name]
    if entry.type is slime_flags._json:
        return [entry.name, '{"a": 1}']
    if entry.type is int:
        return [entry.name, str((entry.default or 0) + 3)] if not isinstance(entry.default, list) else [entry.name]
    if entry.type is float:
        return [entry.name, str((entry.default or 0.0) + 0.5)]
    return [entry.name, "other"]


@pytest.mark.parametrize("entry", slime_flags.PARSED_REFUSED, ids=lambda f: f.name)
def test_refused_flags_are_accepted_at_slimes_default_and_refused_otherwise(entry):
    if entry.kind in ("value",) and entry.default is not None:
        parse_args([entry.name, str(entry.default)])  # a script that spells the default out runs
    argv = _non_default_argv(entry)
    if entry.kind == "list":
        argv = [entry.name, "3"]
    problems = _problems(argv)
    assert len(problems) == 1 and problems[0].startswith(entry.name) and entry.note in problems[0]


def test_refused_flags_in_a_yaml_config_are_refused_too(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("enable_mtp_training: true\nrollout_task_type: code\nref_load: null\n")
    problems = _problems(["--config", str(path)])
    assert any(p.startswith("--enable-mtp-training") for p in problems)
    assert any(p.startswith("--rollout-task-type code") for p in problems)
    assert not any("--ref-load" in p for p in problems)  # at slime's default


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        # Under an explicit --train-backend torch (alone, the flag would select megatron, as slime runs).
        (["--tensor-model-parallel-size", "2", "--train-backend", "torch"], "--train-backend megatron"),
        (["--no-such-flag"], "neither rlcore's nor slime's"),
    ],
)
def test_flags_of_other_issues_and_megatron_are_named_with_the_issue(argv, named):
    problems = _problems(argv)
    assert problems[0].startswith(argv[0] + ":") and named in problems[0]


def test_every_problem_is_reported_at_once():
    problems = _problems(
        ["--enable-mtp-training", "--sglang-x", "1", "--global-batch-size", "7", "--micro-batch-size", "2"]
    )
    assert [p.split(":")[0].split()[0] for p in problems[:2]] == ["--sglang-x", "--enable-mtp-training"]
    assert any("--global-batch-size 7" in p for p in problems)


def test_custom_config_path_overrides_the_command_line_and_carries_hook_settings(tmp_path):
    path = tmp_path / "custom.yaml"
    path.write_text("lr: 2.0e-5\neps-clip-high: 0.3\ntis_mode: mask\nrs_upper_bound: 2.0\n")
    cfg = parse_args(["--lr", "1e-6", "--eps-clip-high", "0.28", "--custom-config-path", str(path)])
    assert (cfg.train.lr, cfg.algo.eps_clip_high) == (2.0e-5, 0.3)  # the file wins, as in slime
    assert (cfg.tis_mode, cfg.rs_upper_bound) == ("mask", 2.0)  # what slime's mis.py reads from args
    assert cfg.custom_args == {"tis_mode": "mask", "rs_upper_bound": 2.0}
    path.write_text("enable_mtp_training: true\n")
    assert any(p.startswith("--enable-mtp-training") for p in _problems(["--custom-config-path", str(path)]))
    assert "--custom-config-path: file" in _problems(["--custom-config-path", str(tmp_path / "nope.yaml")])[0]


def test_docs_table_is_the_generated_one():
    text = (ROOT / "docs" / "runtime.md").read_text()
    assert slime_flags.render_markdown() in text
    assert slime_flags.replace_in(text) == text


def test_help_lists_refused_flags_with_their_reason():
    text = " ".join(build_parser().format_help().split())
    assert "--enable-mtp-training" in text and "refused: not built in rlcore's Megatron backend yet" in text


# ---------------------------------------------------------------- slime's run scripts


def _local_files(tmp_path, args, hf_config=None):
    """Make the model folders and prompt files a script names, under tmp_path; return the args with their paths.

    ``--hf-checkpoint`` gets ``hf_config`` as its config.json (the model's own, so the model-shape flags are checked
    against it); ``--ref-load`` gets a Megatron save root (a tracker naming ``iter_0000000``, a torch_dist folder)."""
    models, data = tmp_path / "models", tmp_path / "data"
    data.mkdir()
    rows = [{"prompt": "1+1", "label": "2", "messages": [{"role": "user", "content": "1+1"}]}] * 4
    out = []
    for arg in args:
        arg = arg.format(models=models, data=data)
        path = Path(arg)
        if arg.startswith(str(data)) and not path.exists():
            if path.suffix == ".jsonl":
                path.write_text("".join(json.dumps(r) + "\n" for r in rows))
            else:
                pq.write_table(pa.Table.from_pylist(rows), path)
        out.append(arg)
    for i, arg in enumerate(out[:-1]):
        if arg == "--hf-checkpoint":
            Path(out[i + 1]).mkdir(parents=True, exist_ok=True)
            (Path(out[i + 1]) / "config.json").write_text(json.dumps(hf_config or {}))
        if arg == "--ref-load":
            root = Path(out[i + 1])
            folder = mck.iteration_folder(root, 0)
            folder.mkdir(parents=True)
            (root / mck.TRACKER).write_text("0")
            (folder / mck.FORMAT_FILE).write_text(json.dumps({"sharded_backend": "torch_dist"}))
            (folder / ".metadata").write_bytes(b"")
    return out


def _strip(args, flags):
    """``args`` without each flag of ``flags`` and its values."""
    out, skipping = [], False
    for arg in args:
        if arg.startswith("--"):
            skipping = arg in flags
        if not skipping:
            out.append(arg)
    return out


def _flag_of(problem):
    return problem.split(":")[0].split()[0]


SCRIPTS = sorted(p.stem for p in FIXTURES.glob("*.json"))


@pytest.fixture
def ray_job_submit(monkeypatch):
    """A slime script starts Ray itself (`ray start`, on every node of a multi-node job) and hands its entry point to
    `ray job submit`, which runs it with RAY_ADDRESS set to that cluster: rlcore-run joins a cluster so."""
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")


# What rlcore-run refuses in a slime script beyond the table's flags, each with the reason its message gives.
VALUE_REFUSALS = {
    "--use-wandb": "needs the wandb package",  # where it is not installed
    # --no-offload-train/-rollout beside it: SGLang servers hold a fixed fraction of their GPU (slime honours them).
    "--colocate": "hold a fixed fraction of their GPU",
    # An engine over GPUs of several nodes (slime's GLM-4.7-355B script: 32).
    "--rollout-num-gpus-per-engine": "rlcore launches single-node SGLang servers only",
    # A quantized checkpoint (slime's Qwen3-235B-A22B script trains from the released FP8 one).
    "--hf-checkpoint": "rlcore trains and syncs unquantized weights",
}


@pytest.mark.parametrize("script", SCRIPTS)
def test_slime_script_is_refused_naming_each_unsupported_flag_with_its_reason(script, tmp_path, capsys):
    fixture = json.loads((FIXTURES / f"{script}.json").read_text())
    # The torch backend, named: alone, the script's Megatron flags select megatron (tests/test_slime_scripts.py).
    args = [*_local_files(tmp_path, fixture["args"], fixture["hf_config"]), "--train-backend", "torch"]
    assert main([*args, "--dry-run", "--output-dir", str(tmp_path / "out")]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    problems = [line[4:] for line in err.splitlines() if line.startswith("  - ")]
    assert problems
    named = set()
    for problem in problems:
        name = _flag_of(problem)
        assert name in args or name in VALUE_REFUSALS, problem
        named.add(name)
        entry = slime_flags.BY_NAME.get(name)
        if entry is not None and entry.status == REFUSED:
            assert entry.note in problem
        elif name in VALUE_REFUSALS:
            assert VALUE_REFUSALS[name] in problem
        elif name in slime_flags.MEGATRON_FLAGS and not slime_flags.MEGATRON_FLAGS[name].accepted:
            assert slime_flags.MEGATRON_FLAGS[name].reason in problem
        else:
            # A Megatron flag with the issue that brings it or the backend that takes it, or an SGLang flag its
            # pinned version does not have.
            assert any(why in problem for why in ("issue 1", "not a flag of SGLang", "--train-backend megatron")), (
                problem
            )
    # Nothing is refused silently: every flag of the script that rlcore-run cannot take is among those named.
    for arg in args:
        if arg in slime_flags.MEGATRON_FLAGS:
            assert arg in named


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.usefixtures("ray_job_submit")
def test_slime_script_without_the_named_flags_passes_dry_run(script, tmp_path, capsys):
    fixture = json.loads((FIXTURES / f"{script}.json").read_text())
    args = [*_local_files(tmp_path, fixture["args"], fixture["hf_config"]), "--train-backend", "torch"]
    main([*args, "--dry-run", "--output-dir", str(tmp_path / "out")])
    problems = [line[4:] for line in capsys.readouterr().err.splitlines() if line.startswith("  - ")]
    refused = {_flag_of(p) for p in problems}
    assert refused
    rest = _strip(args, refused)
    argv = [*rest, "--dry-run", "--output-dir", str(tmp_path / "out")]
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "[dry run: placement plan]" in out and "rlcore-run: dry run, nothing started" in out
    assert not (tmp_path / "out").exists()


# Why --train-backend megatron refuses a script's flag where the flag is no entry of slime_flags' tables: the words
# its message carries.
MEGATRON_REFUSALS = {
    "--context-parallel-size": "needs Transformer Engine's attention",
    "--sglang-cuda-graph-bs": "not a flag of SGLang",
    # (No script refuses it now: each MoE script passes --sequence-parallel, which MoE layers at TP > 1 need.)
    "--tensor-model-parallel-size": "with the MoE layers of config.json needs --sequence-parallel",
    # Stages of equal depth (slime's DeepSeek-R1 script gives the last stage 13 of 61 layers instead).
    "--pipeline-model-parallel-size": "must divide num_hidden_layers",
    **VALUE_REFUSALS,
}


def _megatron_reason(name):
    if name in slime_flags.MEGATRON_FLAGS:
        return slime_flags.MEGATRON_FLAGS[name].reason
    field = name[2:].replace("-", "_")
    if field in MEGATRON_VALUES_BUILT:
        return MEGATRON_VALUES_BUILT[field][1]
    return MEGATRON_REFUSALS[name]


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.usefixtures("ray_job_submit")
def test_slime_script_under_the_megatron_backend_is_refused_exactly_its_named_flags(script, tmp_path, capsys):
    fixture = json.loads((FIXTURES / f"{script}.json").read_text())
    args = _local_files(tmp_path, fixture["args"], fixture["hf_config"])
    megatron = ["--train-backend", "megatron", "--dry-run", "--output-dir", str(tmp_path / "out")]
    expected = set(fixture["megatron_refusals"])
    if importlib.util.find_spec("wandb") is not None:
        expected.discard("--use-wandb")
    if expected:
        assert main([*args, *megatron]) == EXIT_BAD_INPUT
        err = capsys.readouterr().err.splitlines()
        # Several problems come as a list; a lone one (--use-wandb without wandb) as one line.
        problems = [line[4:] for line in err if line.startswith("  - ")] or [
            line.removeprefix("rlcore-run: ") for line in err if line.startswith("rlcore-run: --")
        ]
        assert {_flag_of(p) for p in problems} == expected, problems
        for problem in problems:
            assert _megatron_reason(_flag_of(problem)) in problem, problem
    # Every other flag of the script (the accepted Megatron switches, dropout 0.0, --load of a folder that does not
    # exist yet beside a torch_dist --ref-load, the model-shape flags against config.json) passes.
    rest = _strip(args, expected)
    if "--hf-checkpoint" in expected:
        return  # the model itself is not built (GLM-4); nothing is left to run
    assert main([*rest, *megatron]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "[dry run: placement plan]" in out and not (tmp_path / "out").exists()


def test_dry_run_of_the_builtin_job_prints_the_resolved_config_and_plan(capsys, tmp_path):
    assert main(["--dry-run", "--output-dir", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "samples per rollout    256 (32 prompts x 8)" in out
    assert "loss aggregation       token_mean" in out
    assert "trainer bundles        [0]" in out and "engine bundles         [1]" in out
    assert not (tmp_path / "out").exists()  # nothing written, no model built
    assert main(["--dry-run", "--advantage-estimator", "on_policy_distillation"]) == EXIT_BAD_INPUT
    assert "needs a teacher model of its own" in capsys.readouterr().err
    assert main(["--dry-run", "--advantage-estimator", "ppo", "--num-critic-only-steps", "2"]) == 0
    assert "model roles            actor, reference, critic" in capsys.readouterr().out  # the built-in KL loss


def test_flag_spelling_round_trip():
    for f in SLIME_FLAGS:
        assert flag(f.dest) == f.name


def test_rollout_max_context_len_sets_the_prompt_limit_as_slime():
    cfg = parse_args(["--rollout-max-context-len", "64"])
    assert (cfg.data.rollout_max_prompt_len, cfg.eval.eval_max_context_len) == (63, 64)
    assert (
        parse_args(["--rollout-max-context-len", "64", "--rollout-max-prompt-len", "10"]).data.rollout_max_prompt_len
        == 10
    )
    problems = _problems(["--rollout-max-context-len", "64", "--rollout-max-prompt-len", "64"])
    assert any("--rollout-max-prompt-len 64 must be below --rollout-max-context-len 64" in p for p in problems)


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_balance_data_keeps_each_step_and_evens_the_ranks_tokens(dp_size):
    import random

    import torch

    from runtime.train.batch import balanced_order, shard_rows

    rng = random.Random(dp_size)
    lengths = [rng.randint(1, 100) for _ in range(32)]
    order = balanced_order(lengths, global_batch_size=16, dp_size=dp_size)
    assert sorted(order.tolist()) == list(range(32))
    assert set(order[:16].tolist()) == set(range(16))  # rows stay in their optimizer step

    def rank_tokens(rows):
        per_step = []
        for r in range(dp_size):
            shard = rows[shard_rows(32, global_batch_size=16, dp_rank=r, dp_size=dp_size)].view(2, -1)
            per_step.append([sum(lengths[i] for i in step.tolist()) for step in shard])
        return torch.tensor(per_step, dtype=torch.float64)  # [rank, step]

    balanced = rank_tokens(order)
    plain = rank_tokens(torch.arange(32))
    spread = (balanced.max(0).values - balanced.min(0).values).max()
    assert spread <= max(lengths)  # greedy on equal counts: within one row's length
    assert spread <= (plain.max(0).values - plain.min(0).values).max()
    assert parse_args(["--balance-data"]).data.balance_data


def test_the_supported_rows_are_generated_from_the_fields_rows():
    """One source: a supported row is its field's ``slime`` metadata, and no refused flag is a field."""
    from runtime.slime_flags import BY_NAME, REFUSED_FLAGS

    rows = {name: f.metadata["slime"] for name, (_, f, _) in _SPECS.items() if "slime" in f.metadata}
    assert {entry.name for entry in SLIME_FLAGS if entry.status != REFUSED} == {flag(name) for name in rows}
    for name, row in rows.items():
        entry = BY_NAME[flag(name)]
        assert (entry.group, entry.default) == (row.group, row.default), name
        assert (entry.status, entry.note) == ((YES, row.note) if row.differs is None else (DIFFERS, row.differs))
    assert not {entry.dest for entry in REFUSED_FLAGS} & set(_SPECS)
