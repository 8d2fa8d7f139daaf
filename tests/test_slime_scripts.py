"""slime's run scripts through ``rlcore-run --dry-run`` with only the entry point and the local paths changed, and what
that needs (runtime/slime_compat.py): the training backend inferred as slime runs, SFT with no engine, decay
iterations from ``--num-epoch``, slime's module paths, the flags that need Transformer Engine, and W&B logging.

The scripts' command lines are test data (tests/fixtures/slime_scripts/*.json: each names its source file at slime's
commit, captured by tools/slime_script_args.py). The MoE scripts among them, each with its released model's
config.json: Qwen3-30B-A3B (the ``qwen3-30b-a3b-2layers`` preset's fields at 48 layers), GLM-4.7-355B-A32B (GLM-4.5's
layout, ``glm4_moe``; slime renamed its GLM-4.5 script so) and Moonlight-16B-A3B (the DeepSeek-V3 layout, MLA at
TP=4). GLM-4-9B's passes too, less slime's --spec plug-in and context parallelism."""

import json
import math
import struct
from pathlib import Path

import pytest
from test_slime_flags import EXAMPLE_MODULES, FIXTURES, _flag_of, _local_files, _strip, ray_job_submit  # noqa: F401

from runtime import slime_compat, slime_flags
from runtime.cli import EXIT_BAD_INPUT, main
from runtime.cluster.placement import plan_bundles
from runtime.config import ConfigError, parse_args
from runtime.hooks import HookError, load_function
from runtime.train.backends import megatron_checkpoint as mck

ROOT = Path(__file__).resolve().parent.parent
# slime's entry points and the rlcore-run command line that stands for each (train_async.py overlaps the next rollout
# with training: one step off-policy, rlcore's --async).
ENTRY_POINTS = {"train.py": [], "train_async.py": ["--async"]}
SCRIPTS = sorted(p.stem for p in FIXTURES.glob("*.json"))
# Every script's families are built by the Megatron backend (Llama, Qwen2, Qwen3, GLM-4, Qwen3-MoE, GLM-4.5,
# DeepSeek-V3).
DRY_RUN_SCRIPTS = SCRIPTS


@pytest.fixture(autouse=True)
def _example_modules_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE_MODULES))


def _script(name, tmp_path):
    """The script's ``rlcore-run`` command line (its entry point's flags, then its own, paths made local)."""
    fixture = json.loads((FIXTURES / f"{name}.json").read_text())
    assert fixture["source"].startswith("https://github.com/THUDM/slime/blob/")
    args = _local_files(tmp_path, fixture["args"], fixture["hf_config"])
    return fixture, [*ENTRY_POINTS[fixture["entry_point"]], *args]


def _dry_run(argv, tmp_path, capsys):
    rc = main([*argv, "--dry-run", "--output-dir", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    return rc, out, err


def _refused(fixture):
    """The flags rlcore-run refuses in the script, each with the reason it names (the fixture lists them)."""
    refused = set(fixture["megatron_refusals"])
    refused.discard("--use-wandb")  # wandb is installed (rlcore[dev]); without it --use-wandb is refused
    return refused


@pytest.mark.parametrize("name", DRY_RUN_SCRIPTS)
@pytest.mark.usefixtures("ray_job_submit")
def test_slime_script_passes_dry_run_by_changing_the_entry_point(name, tmp_path, capsys):
    fixture, argv = _script(name, tmp_path)
    refused = _refused(fixture)
    rc, out, err = _dry_run(argv, tmp_path, capsys)
    if refused:
        # What cannot run here is named, each with its reason, and nothing else is. Several problems come as a list, a
        # lone one as one line.
        assert rc == EXIT_BAD_INPUT
        lines = err.splitlines()
        problems = [line[4:] for line in lines if line.startswith("  - ")] or [
            line.removeprefix("rlcore-run: ") for line in lines if line.startswith("rlcore-run: --")
        ]
        assert {_flag_of(p) for p in problems} == refused, problems
        rc, out, err = _dry_run(_strip(argv, refused), tmp_path, capsys)
    assert rc == 0, err
    # No --train-backend in the script: its Megatron flags and torch_dist --ref-load select megatron, and it says so.
    (line,) = [line for line in out.splitlines() if line.startswith("  train backend")]
    assert line.split()[2:4] == ["megatron", "(inferred"] and "--ref-load" in line and "torch_dist" in line
    assert "rlcore-run: dry run, nothing started" in out and not (tmp_path / "out").exists()


def test_the_scripts_refusals_are_the_ones_named_in_the_notes():
    # The scripts that do not pass whole, and why (docs/runtime.md lists them): SGLang holds a fixed share of a
    # colocated GPU, Transformer Engine's optimizer, a flag of a newer SGLang.
    refused = {name: _refused(json.loads((FIXTURES / f"{name}.json").read_text())) for name in DRY_RUN_SCRIPTS}
    assert {name: flags for name, flags in refused.items() if flags} == {
        "run-qwen3-4B-amd": {"--colocate"},
        "run-qwen3-32B": {"--use-precision-aware-optimizer", "--sglang-cuda-graph-bs"},
        # (MoE layers over tensor-parallel ranks need --sequence-parallel, which the MoE scripts pass.)
        "run-qwen3-30B-A3B": {"--use-precision-aware-optimizer", "--sglang-cuda-graph-bs"},
        # slime's layer spec plug-in (the backend builds GLM-4's layers from config.json itself) and context
        # parallelism (Transformer Engine's attention).
        "run-glm4-9B": {"--spec", "--context-parallel-size"},
        # DeepEP's dispatcher (twice: the flag and the dispatcher type it selects), and an engine over 32 GPUs of
        # several nodes (rlcore launches single-node SGLang servers).
        "run-glm4.7-355B-A32B": {
            "--use-precision-aware-optimizer", "--moe-enable-deepep", "--moe-token-dispatcher-type",
            "--context-parallel-size", "--rollout-num-gpus-per-engine",
        },
        "run-moonlight-16B-A3B": {
            "--use-precision-aware-optimizer", "--sglang-cuda-graph-bs", "--moe-enable-deepep",
            "--moe-token-dispatcher-type",
        },
        # The released FP8 checkpoint (quantized weights are refused, as for DeepSeek-R1 below) and an engine over 32
        # GPUs of several nodes. (Its uneven stages, 94 layers over PP=4 with a last stage of 22, are taken.)
        "run-qwen3-235B-A22B": {
            "--hf-checkpoint", "--use-precision-aware-optimizer", "--sglang-cuda-graph-bs", "--context-parallel-size",
            "--rollout-num-gpus-per-engine",
        },
        "run-qwen3-235B-A22B-sft": {"--use-precision-aware-optimizer"},
        # DeepSeek-R1 (the DeepSeek-V3 layout; its --hf-checkpoint the bf16 copy the script names in a comment, see
        # below). It trains no MTP layer (no --mtp-num-layers, which is refused); its SGLang speculative decoding
        # (EAGLE) is SGLang's own. (Its uneven last pipeline stage, 13 of 61 layers at PP=4, is taken.)
        "run-deepseek-r1": {
            "--use-precision-aware-optimizer", "--moe-enable-deepep", "--context-parallel-size",
            "--moe-token-dispatcher-type", "--rollout-num-gpus-per-engine",
        },
    }  # fmt: skip
    # The scripts the issue names are all among those covered.
    for name in (
        "run-qwen3-4B",
        "run-qwen3-4B-base-sft",
        "run-qwen2.5-0.5B-reproducibility",
        "run-qwen2.5-0.5B-fully_async",
        "retool_qwen3_4b_rl",
        "retool_qwen3_4b_sft",
    ):
        assert name in DRY_RUN_SCRIPTS and not refused[name]


@pytest.mark.parametrize(
    ("name", "stages"),
    [
        ("run-deepseek-r1", "stage 0: layers 0-15 (16); stage 1: layers 16-31 (16); stage 2: layers 32-47 (16); "
         "stage 3: layers 48-60 (13)"),
        # (Its --hf-checkpoint, the released FP8 weights, is refused: the dry run runs without it.)
        ("run-qwen3-235B-A22B", "4 stages: the last 22 layers, the others equal shares (no --hf-checkpoint to count "
         "the layers)"),
    ],
)  # fmt: skip
@pytest.mark.usefixtures("ray_job_submit")
def test_the_dry_run_prints_the_uneven_pipeline_stages(name, stages, tmp_path, capsys):
    """slime's --decoder-last-pipeline-num-layers: the last stage takes that many layers, the other stages split the
    rest equally (61 = 3 x 16 + 13), and --dry-run prints each stage's layers."""
    fixture, argv = _script(name, tmp_path)
    rc, out, err = _dry_run(_strip(argv, _refused(fixture)), tmp_path, capsys)
    assert rc == 0, err
    (line,) = [line for line in out.splitlines() if line.startswith("  pipeline stages")]
    assert line.split(None, 2)[2] == stages


@pytest.mark.usefixtures("ray_job_submit")
def test_the_released_fp8_deepseek_r1_checkpoint_is_refused_in_one_line(tmp_path, capsys):
    # slime's script points --hf-checkpoint at DeepSeek-R1's released fp8 weights and names the bf16 copy in a
    # comment; the fixture holds the copy (a local path, config.json without quantization_config). Catches the fp8
    # release accepted: both backends would read its float8 tensors (and their scale tensors) as the weights they
    # train, and the weight sync would send bf16 tensors to engines serving the fp8 layout.
    fixture, argv = _script("run-deepseek-r1", tmp_path)
    release = {**fixture["hf_config"], "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}
    (tmp_path / "release").mkdir()
    (tmp_path / "release" / "config.json").write_text(json.dumps(release))
    at = argv.index("--hf-checkpoint") + 1
    argv = _strip([*argv[:at], str(tmp_path / "release"), *argv[at + 1 :]], _refused(fixture))
    rc, _, err = _dry_run(argv, tmp_path, capsys)
    assert rc == EXIT_BAD_INPUT
    (problem,) = [line[4:] for line in err.splitlines() if line.startswith("  - ")] or [err.strip()]
    assert "--hf-checkpoint" in problem and "fp8 weights" in problem and "bf16 copy" in problem


# ---------------------------------------------------------------- SFT


@pytest.mark.parametrize("name", ["run-qwen3-4B-base-sft", "retool_qwen3_4b_sft"])
def test_sft_scripts_start_no_engine_and_need_no_response_length(name, tmp_path, capsys):
    _, argv = _script(name, tmp_path)
    cfg = parse_args(argv)
    assert cfg.debug.debug_train_only and cfg.debug.load_debug_rollout_data is None
    assert cfg.rollout.rollout_max_response_len is None and slime_compat.is_sft_job(cfg)
    plan = plan_bundles(cfg)
    assert plan.engine_bundles == [] and len(plan.trainer_bundles) == 8
    # slime's path loads the runtime's SFT rollout.
    from runtime.rollout import sft

    assert load_function(cfg.rollout.rollout_function_path) is sft.generate_rollout
    rc, out, _ = _dry_run(argv, tmp_path, capsys)
    assert rc == 0 and "engine bundles         []" in out
    assert "lr decay iters         at the start, as slime: --num-epoch 3 x (dataset rows // 128)" in out


def test_debug_train_only_without_sft_still_needs_saved_rollouts(tmp_path):
    with pytest.raises(ConfigError) as info:
        parse_args(["--debug-train-only"])
    assert any(
        "--debug-train-only trains on saved rollouts: it needs --load-debug-rollout-data" in p
        for p in info.value.problems
    )
    # The replay mode starts from --hf-checkpoint; slime's SFT may resume from --load.
    with pytest.raises(ConfigError) as info:
        parse_args(["--load-debug-rollout-data", "d/{rollout_id}.pt", "--load", str(tmp_path)])
    assert any("cannot go with --load" in p for p in info.value.problems)


def test_rl_still_needs_a_response_length(tmp_path, capsys):
    _, argv = _script("run-qwen3-4B", tmp_path)
    rest = _strip(argv, {"--rollout-max-response-len"})
    rc, _, err = _dry_run(rest, tmp_path, capsys)
    assert rc == EXIT_BAD_INPUT and "--rollout-max-response-len has no default outside the built-in job" in err


# ---------------------------------------------------------------- decay iterations from --num-epoch


def test_num_epoch_derives_num_rollout_and_decay_iters_at_the_start(tmp_path):
    from runtime.job_data import resolve_num_rollout

    _, argv = _script("run-qwen3-4B-base-sft", tmp_path)
    cfg = parse_args(argv)
    assert (cfg.rollout.num_rollout, cfg.train.lr_decay_iters, cfg.train.lr_decay_style) == (None, None, "cosine")
    # slime: num_rollout = num_epoch x (rows // rollout_batch_size); train_iters = num_rollout x rollout_batch_size x
    # n_samples_per_prompt // global_batch_size, which lr_decay_iters defaults to. 1000 rows, 128 a rollout: 7 whole
    # rollouts a pass, 3 passes; 128 samples a rollout at a global batch of 128: one optimizer step each.
    resolved = resolve_num_rollout(cfg, 1000)
    assert (resolved.rollout.num_rollout, resolved.train.lr_decay_iters) == (21, 21)
    given = parse_args([*argv, "--lr-decay-iters", "5"])
    assert resolve_num_rollout(given, 1000).train.lr_decay_iters == 5  # given wins
    # Two optimizer steps a rollout double the steps the schedule spans.
    halves = parse_args([*_strip(argv, {"--global-batch-size"}), "--global-batch-size", "64"])
    assert resolve_num_rollout(halves, 1000).train.lr_decay_iters == 42
    # With --num-rollout, the length is known before the start (as Megatron: num_rollout x steps a rollout).
    assert parse_args([*_strip(argv, {"--num-epoch"}), "--num-rollout", "4"]).train.lr_decay_iters == 4


@pytest.mark.parametrize(
    ("num_rollout", "rollout_batch_size", "n", "gbs"), [(3, 8, 4, 32), (7, 5, 3, 2), (1, 1, 1, 4)]
)
def test_train_iters_counts_the_optimizer_steps_of_the_job(num_rollout, rollout_batch_size, n, gbs):
    # Counted one sample at a time: a step each time a global batch fills (slime's formula floors the same way).
    filled = steps = 0
    for _ in range(num_rollout * rollout_batch_size * n):
        filled += 1
        if filled == gbs:
            steps, filled = steps + 1, 0
    got = slime_compat.train_iters(
        num_rollout=num_rollout, rollout_batch_size=rollout_batch_size, n_samples_per_prompt=n, global_batch_size=gbs
    )
    assert got == max(1, steps)
    with pytest.raises(ValueError, match="global_batch_size must be a positive int"):
        slime_compat.train_iters(num_rollout=1, rollout_batch_size=1, n_samples_per_prompt=1, global_batch_size=0)


# ---------------------------------------------------------------- the training backend


def _torch_dist(root):
    folder = mck.iteration_folder(root, 3)
    folder.mkdir(parents=True)
    (root / mck.TRACKER).write_text("3")
    (folder / mck.FORMAT_FILE).write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (folder / ".metadata").write_bytes(b"")
    return root, folder


def test_holds_torch_dist_agrees_with_the_megatron_checkpoint_reader(tmp_path):
    root, folder = _torch_dist(tmp_path / "ckpt")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    other = tmp_path / "other"
    other.mkdir()
    (other / mck.FORMAT_FILE).write_text(json.dumps({"sharded_backend": "zarr"}))
    (other / ".metadata").write_bytes(b"")
    for path in (root, folder, hf, other, tmp_path / "missing"):
        found = path.is_dir() and mck.find_checkpoint(path) is not None
        assert slime_compat.holds_torch_dist(str(path)) == found, path


def test_the_backend_is_inferred_as_slime_runs_unless_given(tmp_path, capsys):
    root, _ = _torch_dist(tmp_path / "ref")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert parse_args([]).train.train_backend == "torch"
    assert parse_args(["--attention-softmax-in-fp32"]).train.train_backend == "megatron"  # a Megatron switch
    assert parse_args(["--adam-beta2", "0.95"]).train.train_backend == "megatron"  # a Megatron field set
    assert parse_args(["--ref-load", str(root)]).train.train_backend == "megatron"  # a torch_dist checkpoint
    assert parse_args(["--load", str(tmp_path / "new")]).train.train_backend == "torch"  # a folder to create
    assert parse_args(["--adam-beta2", "0.999"]).train.train_backend == "torch"  # Megatron's default, set or not
    # Given wins: the torch backend then names the Megatron flag it cannot take.
    with pytest.raises(ConfigError) as info:
        parse_args(["--train-backend", "torch", "--adam-beta2", "0.95"])
    assert info.value.problems == ["--adam-beta2: a Megatron flag, used by --train-backend megatron only"]
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("train:\n  train_backend: torch\n")
    with pytest.raises(ConfigError):
        parse_args(["--config", str(yaml_file), "--adam-beta2", "0.95"])
    # --dry-run says which, and why, on one line.
    for argv, want in (
        ([], "torch (inferred: no Megatron-only flag and no torch_dist checkpoint (the default))"),
        (["--ref-load", str(root)], f"megatron (inferred as slime runs: --ref-load {root} holds a Megatron"),
        (["--train-backend", "megatron", "--ref-load", str(root)], "megatron (--train-backend given)"),
        (["--config", str(yaml_file)], "torch (--train-backend given in --config)"),
    ):
        rc, out, err = _dry_run(argv, tmp_path, capsys)
        assert rc == 0, err
        (line,) = [line for line in out.splitlines() if line.startswith("  train backend")]
        assert line.split(None, 2)[2].startswith(want), line


def test_infer_train_backend_names_every_reason():
    choice = slime_compat.infer_train_backend(
        given=None, megatron_flags=[f"--f{i}" for i in range(6)], checkpoints={"--load": None, "--ref-load": None}
    )
    assert choice == slime_compat.BackendChoice(
        "megatron", "inferred as slime runs: Megatron-only flags are set (--f0, --f1, --f2, --f3 and 2 more)"
    )
    assert slime_compat.infer_train_backend(given="torch", megatron_flags=["--x"], checkpoints={}).name == "torch"


# ---------------------------------------------------------------- slime's module paths


def test_slime_paths_load_their_counterparts_and_others_are_named():
    from runtime.rollout import filters, opd, sft

    assert load_function("slime.rollout.sft_rollout.generate_rollout") is sft.generate_rollout
    assert (
        load_function("slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std")
        is filters.check_reward_nonzero_std
    )
    assert load_function("slime.rollout.on_policy_distillation.reward_func") is opd.reward_func
    with pytest.raises(HookError) as info:
        load_function("slime.rollout.rm_hub.math_dapo_utils.compute_score")
    message = str(info.value)
    assert "slime's module has no counterpart in rlcore" in message
    assert "slime.rollout.fully_async_rollout.generate_rollout_fully_async (as --rollout-function-path)" in message
    # A hook flag names itself with the path.
    with pytest.raises(ConfigError) as info:
        parse_args(["--custom-rm-path", "slime.rollout.rm_hub.deepscaler.get_deepscaler_rule_based_reward"])
    assert any(
        p.startswith("--custom-rm-path slime.rollout.rm_hub.deepscaler.get_deepscaler_rule_based_reward: slime's")
        for p in info.value.problems
    )
    # A user's own package that merely starts with "slime" is not slime's.
    assert slime_compat.slime_path_problem("slimer.mod:fn") is None


def test_the_fully_async_rollout_path_runs_the_fully_async_schedule(tmp_path):
    _, argv = _script("run-qwen2.5-0.5B-fully_async", tmp_path)
    cfg = parse_args(argv)
    assert (cfg.rollout.rollout_schedule, cfg.rollout.rollout_function_path) == ("fully_async", None)
    # Its trainer and its engines on their own GPUs: 1 + 3, as the script asks.
    plan = plan_bundles(cfg)
    assert (plan.trainer_bundles, plan.engine_bundles) == ([0], [1, 2, 3])
    # In a --config file too.
    path = tmp_path / "c.yaml"
    path.write_text("rollout_function_path: slime.rollout.fully_async_rollout.generate_rollout_fully_async\n")
    assert parse_args(["--config", str(path)]).rollout.rollout_schedule == "fully_async"


def test_the_retool_scripts_hooks_resolve_to_the_ported_module(tmp_path):
    from examples.tool_use import calculator_agent

    _, argv = _script("retool_qwen3_4b_rl", tmp_path)
    cfg = parse_args(argv)
    assert load_function(cfg.rollout.custom_generate_function_path) is calculator_agent.generate
    assert load_function(cfg.reward.custom_rm_path) is calculator_agent.reward
    assert (cfg.log.use_wandb, cfg.log.wandb_project, cfg.log.wandb_group) == (
        True,
        "slime-dapo",
        "qwen3-4B-test-multi-turn",
    )


# ---------------------------------------------------------------- Transformer Engine


def test_the_flags_that_need_transformer_engine_are_listed_one_line_each_in_the_docs():
    text = (ROOT / "docs" / "runtime.md").read_text()
    rendered = slime_compat.render_transformer_engine_flags()
    assert rendered in text
    names = {e.name for e in slime_compat.transformer_engine_flags()}
    assert len(rendered.splitlines()) == len(names)
    # Every Megatron flag of the covered scripts whose reason is Transformer Engine (apex, flash-attn) is listed.
    for name in SCRIPTS:
        for arg in json.loads((FIXTURES / f"{name}.json").read_text())["args"]:
            entry = slime_flags.MEGATRON_FLAGS.get(arg)
            if entry is not None and ("Transformer Engine" in entry.reason or "apex" in entry.reason):
                assert arg in names, arg
    by_name = {e.name: e for e in slime_compat.transformer_engine_flags()}
    assert by_name["--attention-backend flash"].accepted and not by_name["--use-precision-aware-optimizer"].accepted
    assert by_name["--no-gradient-accumulation-fusion"].accepted and not by_name["--attention-backend fused"].accepted


# ---------------------------------------------------------------- W&B


def offline_run(wandb_dir):
    """The one offline W&B run under ``wandb_dir`` (a ``--wandb-dir``), once written whole.

    ``finish()`` hands the run's last records to wandb's service process, which writes the transaction log after it
    returns (the history read back was empty in about half the runs after a torch import, 2026-11-27); teardown waits
    for the service to exit, as wandb's own exit hook does at the end of a job's process."""
    import wandb

    wandb.teardown()
    (run_dir,) = (Path(wandb_dir) / "wandb").glob("offline-run-*")
    return run_dir


def wandb_history(run_dir):
    """The history rows of an offline W&B run, read back from its transaction log (``run-<id>.wandb``).

    wandb 0.31 ships no reader of its own for it: the file is LevelDB's log format (32 KiB blocks of records, each
    with a 7-byte header: crc32, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4) after a 7-byte file header
    (``:W&B``, magic 0xBEE1, version), each record a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    (path,) = Path(run_dir).glob("run-*.wandb")
    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    block, pos, pending, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                # A key is in ``key`` or, as wandb 0.31 writes it, in ``nested_key``.
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def tensorboard_scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_wandb_logs_offline_what_tensorboard_gets(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from runtime.logger import MetricsLogger, WandbOptions

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rows = [
        {"train/loss": 1.25, "rollout/reward_mean": 0.5, "perf/step_time": 3},
        {"train/loss": 0.75, "rollout/reward_mean": 0.625, "perf/step_time": 2, "eval/reward_mean": 0.25},
        {"train/loss": float("nan"), "rollout/reward_mean": 1.0, "perf/step_time": 1},
    ]
    options = WandbOptions(project="p", group="g", dir=str(tmp_path / "wb"), random_suffix=False)
    with MetricsLogger(tmp_path / "out", use_tensorboard=True, use_wandb=True, wandb_options=options) as logger:
        for step, metrics in enumerate(rows):
            logger.log(step, metrics)
    history = wandb_history(offline_run(tmp_path / "wb"))
    assert [h["_step"] for h in history] == [0, 1, 2]
    scalars = tensorboard_scalars(tmp_path / "out" / "tensorboard")
    # Every value TensorBoard holds, W&B holds at the same step; float32 is TensorBoard's storage, so compare there.
    assert set(scalars) == {"train/loss", "rollout/reward_mean", "perf/step_time", "eval/reward_mean"}
    for tag, by_step in scalars.items():
        for step, value in by_step.items():
            assert history[step][tag] == pytest.approx(value, rel=2**-23), (tag, step)
    # The non-finite loss TensorBoard skips reaches W&B as NaN, the eval metric only where logged.
    assert math.isnan(history[2]["train/loss"])
    assert "eval/reward_mean" not in history[0] and history[1]["eval/reward_mean"] == 0.25


def test_the_docs_table_of_slime_paths_is_the_generated_one():
    assert slime_compat.render_slime_paths() in (ROOT / "docs" / "runtime.md").read_text()
