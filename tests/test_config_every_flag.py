"""Every flag of rlcore-run through the command line and through YAML: generated from the schema, so a field added
later is covered without editing this file.

Each boolean is set both ways; every other field to a valid value that differs from its default. The resolved
config (``resolve_args``: flags and YAML applied, not validated, so that one field can change alone) must hold
exactly that value in that field. Values are parsed from their text, and text round-trips exactly for the ints,
strings and the binary fractions chosen for floats, so the comparisons are exact by construction.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any, Literal

import pytest
import yaml

from runtime.config import _SPECS, Config, _unwrap_optional, flag, negated, resolve_args

# The fields whose value is given by another flag (passthrough dicts: one --sglang-*/--router-* flag per SGLang flag;
# their own tests are tests/test_sglang_flags.py).
_PASSTHROUGH = {name for name, (_, f, _) in _SPECS.items() if f.metadata.get("passthrough")}
_DEFAULTS = Config()
# Files that resolving reads (their own tests: tests/test_slime_flags*.py): these fields get a real file's path.
_READ_FILES = {
    "custom_config_path": "{}\n",
    "megatron_config_path": "megatron: [{role: actor, overrides: {}}]\n",
}
# A flag with one choice (--optimizer adam: slime's other optimizers are not built) has no other value to set.
_ONLY_CHOICE = object()


def _other_value(name: str) -> Any:
    """A valid value of field ``name`` different from its default."""
    tp = _SPECS[name][2]
    inner, _ = _unwrap_optional(tp)
    default = getattr(_DEFAULTS, name)
    if typing.get_origin(inner) is Literal:
        return next((c for c in typing.get_args(inner) if c != default), _ONLY_CHOICE)
    if typing.get_origin(inner) is list:
        (item,) = typing.get_args(inner)
        return [item(3), item(5)] if item is not str else ["a.jsonl", "b.jsonl"]
    table = {
        int: lambda: (default or 0) + 3,
        # 0.375 and 0.625 are exact binary fractions: text and float agree exactly.
        float: lambda: 0.375 if default != 0.375 else 0.625,
        str: lambda: f"{name}-value",
        dict: lambda: {"key": 1, "other": "text"},
    }
    return table[inner]()


def _argv(name: str, value: Any) -> list[str]:
    f = _SPECS[name][1]
    if isinstance(value, bool):
        return [flag(name) if value else negated(name)]
    if isinstance(value, list) and f.metadata.get("append"):
        return [arg for item in value for arg in (flag(name), str(item))]
    if isinstance(value, list):
        return [flag(name), *map(str, value)]
    if isinstance(value, dict):
        return [flag(name), json.dumps(value)]
    return [flag(name), str(value)]


def _cases() -> list[tuple[str, Any]]:
    cases = []
    for name, (_, _, tp) in _SPECS.items():
        if name in _PASSTHROUGH:
            continue
        inner, optional = _unwrap_optional(tp)
        if inner is bool:
            cases += [(name, True), (name, False)]
        else:
            value = _other_value(name)
            cases += [(name, value if value is not _ONLY_CHOICE else getattr(_DEFAULTS, name))]
            if optional and getattr(_DEFAULTS, name) is not None:
                cases.append((name, None))
    return cases


CASES = _cases()


def _with_files(tmp_path, name: str, value: Any) -> Any:
    if name in _READ_FILES and value is not None:
        path = tmp_path / f"{name}.yaml"
        path.write_text(_READ_FILES[name])
        return str(path)
    return value


def _ids(case: tuple[str, Any]) -> str:
    return f"{case[0]}={case[1]!r}"


def test_the_cases_cover_every_field_with_a_flag():
    covered = {name for name, _ in CASES}
    assert covered == set(_SPECS) - _PASSTHROUGH
    bools = [name for name, (_, _, tp) in _SPECS.items() if _unwrap_optional(tp)[0] is bool]
    assert all((name, True) in CASES and (name, False) in CASES for name in bools)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_every_flag_reaches_its_field_through_argv(tmp_path, case):
    name, value = case
    value = _with_files(tmp_path, name, value)
    argv = _argv(name, value) if value is not None else [flag(name), "none"]
    cfg = resolve_args(argv)
    assert getattr(cfg, name) == value, argv


@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_every_setting_reaches_its_field_through_yaml(tmp_path, layout):
    # One file per case would be hundreds of files; a field's YAML key is its name, so all cases of one polarity go
    # in two files (the first value of each field, then the second), each resolved once.
    firsts: dict[str, Any] = {}
    seconds: dict[str, Any] = {}
    for name, value in CASES:
        (seconds if name in firsts else firsts)[name] = _with_files(tmp_path, name, value)
    for i, values in enumerate((firsts, seconds)):
        tree: dict[str, Any] = {}
        for name, value in values.items():
            section = _SPECS[name][0]
            if layout == "nested" and section is not None:
                tree.setdefault(section, {})[name] = value
            else:
                tree[name] = value
        path = tmp_path / f"{layout}{i}.yaml"
        path.write_text(yaml.safe_dump(tree))
        cfg = resolve_args(["--config", str(path)])
        wrong = {n: (getattr(cfg, n), v) for n, v in values.items() if getattr(cfg, n) != v}
        assert not wrong, wrong


def test_no_save_optim_is_set_by_its_own_flag_and_allows_stateless_adam():
    # argparse's BooleanOptionalAction read any flag starting --no- as False: --no-save-optim resolved to False.
    from runtime.config import parse_args

    assert resolve_args(["--no-save-optim"]).ckpt.no_save_optim is True
    assert resolve_args(["--no-no-save-optim"]).ckpt.no_save_optim is False
    assert parse_args(["--use-stateless-adam", "--no-save-optim"]).ckpt.no_save_optim is True


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--fully-async", "--rollout-schedule", "sync"], ("--fully-async", "--rollout-schedule sync")),
        (["--rollout-schedule", "one_step", "--fully-async"], ("--fully-async", "--rollout-schedule one_step")),
        (["--async", "--fully-async"], ("--async", "--fully-async")),
    ],
)
def test_conflicting_schedule_flags_exit_2_with_one_line_naming_both(capsys, argv, named):
    from runtime.cli import EXIT_BAD_INPUT, main

    assert main([*argv, "--dry-run"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and all(name in err for name in named), err


@pytest.mark.parametrize(
    ("argv", "schedule"),
    [
        (["--async"], "one_step"),
        (["--async", "--async"], "one_step"),
        (["--fully-async", "--rollout-schedule", "fully_async"], "fully_async"),
    ],
)
def test_agreeing_schedule_flags_resolve(argv, schedule):
    assert resolve_args(argv).rollout.rollout_schedule == schedule


def _owned() -> list[tuple[str, str, str]]:
    """(choosing flag's field, plug-in, field) for every field a plug-in declares its own (runtime.config.checks'
    PLUGIN_KINDS: the training backends' and the engines' options modules)."""
    from runtime.config.checks import PLUGIN_KINDS

    return [
        (kind, owner, name)
        for kind, (registry, options) in PLUGIN_KINDS.items()
        for owner in registry
        for name in options(owner).OWN_FIELDS
    ]


def test_plugin_options_name_fields_of_the_schema_owned_once():
    owned = [name for _, _, name in _owned()]
    assert set(owned) <= set(_SPECS), set(owned) - set(_SPECS)
    assert len(owned) == len(set(owned))
    # Each is a field of the section that the plug-in's options dataclass is composed into.
    from runtime.config.checks import PLUGIN_KINDS

    for kind, owner, name in _owned():
        options = PLUGIN_KINDS[kind][1](owner).OPTIONS
        section = _SPECS[name][0]
        assert name in {f.name for f in dataclasses.fields(options[section])}, (owner, name)


@pytest.mark.parametrize(("kind", "owner", "name"), _owned(), ids=lambda x: x)
def test_a_plugins_own_flag_is_refused_under_another_choice_with_the_reason(tmp_path, kind, owner, name):
    from runtime.config import ConfigError, parse_args
    from runtime.config.checks import PLUGIN_KINDS

    default = getattr(_DEFAULTS, name)
    value = not default if isinstance(default, bool) else _other_value(name)
    if value is _ONLY_CHOICE:
        pytest.skip(f"{flag(name)} has one value: it cannot be set away from its default")
    value = _with_files(tmp_path, name, value)
    argv = [] if _SPECS[name][1].metadata.get("passthrough") else _argv(name, value)
    if not argv:
        pytest.skip(f"{name} has no flag of its own (passthrough: tests/test_sglang_flags.py)")
    refusal = _SPECS[name][1].metadata.get("flag", flag(name)) + ": "
    for choice in PLUGIN_KINDS[kind][0]:
        try:
            parse_args([*argv, flag(kind), choice])
            problems = []
        except ConfigError as err:
            problems = err.problems
        mine = [p for p in problems if p.startswith(refusal) and f"used by {flag(kind)} {owner} only" in p]
        assert bool(mine) == (choice != owner), (choice, problems)


def test_the_weight_syncs_options_are_the_transports():
    from runtime.cluster.weight_sync import WEIGHT_SYNCS
    from runtime.cluster.weight_sync_options import WEIGHT_SYNC_OPTIONS, WEIGHT_TRANSPORTS

    # The flag's choices are the options registry's names, each a weight sync the runtime builds.
    assert typing.get_args(_SPECS["update_weight_transport"][2]) == (typing.Literal[WEIGHT_TRANSPORTS], type(None))
    assert set(WEIGHT_SYNC_OPTIONS) == set(WEIGHT_TRANSPORTS) <= set(WEIGHT_SYNCS)


def _disk_flags(tmp_path) -> list[list[str]]:
    """Each of the disk sync's own flags set away from its default, from its declaration (a new one is covered)."""
    from runtime.cluster.weight_sync_options import DiskSyncOptions

    hook = tmp_path / "post_write.py"
    hook.write_text("def publish(args, version_dir, rollout_engines):\n    pass\n")
    values = {"custom_update_weight_post_write_path": f"{hook}:publish", "update_weight_disk_dir": str(tmp_path)}
    return [_argv(f.name, values.get(f.name, True)) for f in dataclasses.fields(DiskSyncOptions)]


# With --update-weight-transport unset the job derives its transport when it starts: the disk sync's settings were
# taken and silently ignored when that was not disk. They are refused, naming what the job gets and the fix.
@pytest.mark.parametrize(
    ("argv", "derived"),
    [
        ([], "nccl or object_store"),  # engines on devices of their own: nccl on GPUs, Ray's object store on the CPU
        (["--colocate"], "ipc"),
        (["--colocate", "--train-backend", "megatron"], "ipc"),  # one Megatron process: ipc is built
    ],
)
def test_a_disk_setting_with_the_transport_unset_is_refused_where_the_job_would_not_sync_by_disk(
    capsys, tmp_path, argv, derived
):
    from runtime.cli import EXIT_BAD_INPUT, main

    for disk in _disk_flags(tmp_path):
        assert main([*disk, *argv, "--dry-run"]) == EXIT_BAD_INPUT, disk
        err = capsys.readouterr().err.strip()
        assert "\n" not in err, err
        assert f"{disk[0]}: a setting of the disk weight sync, used by --update-weight-transport disk only" in err
        assert f"(unset: {derived} in this job; give --update-weight-transport disk)" in err, err


# A debug mode that runs one side only gets no weight sync (runtime.cluster.weight_sync.NoSync), whatever the
# transport: no transport runs to ignore a disk setting, so none is refused; the same setting with both sides running
# is (the test above). Mutation caught: the rule of the test above applied to every job refuses these.
@pytest.mark.parametrize(
    "mode",
    [
        ["--debug-train-only", "--load-debug-rollout-data", "/data/rollout_{rollout_id}.pt"],
        ["--load-debug-rollout-data", "/data/rollout_{rollout_id}.pt"],  # implies --debug-train-only, as in slime
        ["--debug-rollout-only"],
    ],
)
@pytest.mark.parametrize("transport", [[], ["--update-weight-transport", "nccl"]])
def test_a_disk_setting_is_refused_by_no_transport_where_no_weight_sync_runs(tmp_path, mode, transport):
    from runtime.config import ConfigError, parse_args

    for disk in _disk_flags(tmp_path):
        cfg = parse_args([*disk, *transport, *mode])
        name = disk[0].removeprefix("--").replace("-", "_")
        assert getattr(cfg, name) == (disk[1] if len(disk) > 1 else True), disk
        # Control: without the debug mode both sides run, and the setting is refused.
        with pytest.raises(ConfigError, match=f"{disk[0]}: a setting of the disk weight sync"):
            parse_args([*disk, *transport])


@pytest.mark.parametrize(
    "argv",
    [
        ["--update-weight-transport", "disk"],
        # Colocated with two Megatron processes the job derives disk (ipc reaches one engine from rank 0 alone).
        ["--colocate", "--train-backend", "megatron", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2"],
    ],
)
def test_a_disk_setting_is_taken_where_the_job_syncs_by_disk(tmp_path, argv):
    from runtime.config import parse_args

    for disk in _disk_flags(tmp_path):
        cfg = parse_args([*disk, *argv])
        name = disk[0].removeprefix("--").replace("-", "_")
        assert getattr(cfg, name) == (disk[1] if len(disk) > 1 else True), disk


@pytest.mark.parametrize("procs", [1, 2])
def test_the_ipc_transport_reaches_one_engine_from_one_megatron_process(procs):
    from runtime.config import ConfigError, parse_args

    argv = ["--update-weight-transport", "ipc", "--train-backend", "megatron", "--colocate"]
    argv += ["--actor-num-gpus-per-node", str(procs), "--rollout-num-gpus", str(procs)]
    try:
        parse_args(argv)
        problems = []
    except ConfigError as err:
        problems = err.problems
    refused = [p for p in problems if p.startswith("--update-weight-transport ipc reaches one engine")]
    assert bool(refused) == (procs > 1), problems


def _bounded_fields() -> list[tuple[str, dict]]:
    return [(name, f.metadata["bounds"]) for name, (_, f, _) in _SPECS.items() if f.metadata.get("bounds")]


def _outside(bounds: dict, integer: bool) -> list[float]:
    """Values just outside each declared bound (an exact binary step from the edge, so no rounding moves them in)."""
    step = 1 if integer else 0.25
    out = []
    for kind, edge in bounds.items():
        out.append({"gt": edge, "ge": edge - step, "lt": edge, "le": edge + step}[kind])
    return out


@pytest.mark.parametrize(("name", "bounds"), _bounded_fields(), ids=lambda x: x if isinstance(x, str) else "")
def test_a_declared_bound_refuses_values_outside_it_and_takes_its_edge(name, bounds):
    from runtime.config import ConfigError, from_dict, validate

    integer = _unwrap_optional(_SPECS[name][2])[0] is int
    for value in _outside(bounds, integer):
        value = int(value) if integer else float(value)
        with pytest.raises(ConfigError) as err:
            validate(from_dict(None, **{name: value}))
        assert any(p.startswith(f"{flag(name)} must be ") and p.endswith(f"got {value!r}") for p in err.value.problems)
    for kind, edge in bounds.items():
        if kind in ("ge", "le"):  # an inclusive edge is valid: no problem names this flag's bound
            value = int(edge) if integer else float(edge)
            try:
                validate(from_dict(None, **{name: value}))
            except ConfigError as err:
                assert not any(p.startswith(f"{flag(name)} must be ") for p in err.problems), err.problems


def test_core_ranges_name_rlcore_fields():
    import dataclasses

    from rlcore.advantage_config import AdvantageConfig
    from rlcore.loss_config import LossConfig
    from runtime.config import CORE_RANGES

    classes = {"LossConfig": LossConfig, "AdvantageConfig": AdvantageConfig}
    for name, (cls, core, partners) in CORE_RANGES.items():
        assert name in _SPECS and core in {f.name for f in dataclasses.fields(classes[cls])}, name
        assert set(partners) <= set(CORE_RANGES)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--eps-clip", "-0.5"], "LossConfig.eps_clip must be >= 0"),
        (["--tis-clip", "0"], "LossConfig.tis_clip must be > 0"),
        (["--tis-clip-low", "3", "--tis-clip", "2"], "LossConfig.tis_clip_low must be below tis_clip=2.0"),
        (["--eps-clip-c", "0.5"], "LossConfig.eps_clip_c must be > 1"),
        (["--lambd", "1.5"], "lam must be a number in [0, 1]"),
        (["--gamma", "-0.25"], "gamma must be a number in [0, 1]"),
        (["--kl-coef", "-1"], "kl_coef must be a finite number >= 0"),
    ],
)
def test_rlcores_ranges_are_rlcores_own_words(argv, named):
    from runtime.config import ConfigError, parse_args

    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    mine = [p for p in err.value.problems if p.startswith(argv[0]) and "rlcore's range" in p]
    assert len(mine) == 1 and named in mine[0], err.value.problems
