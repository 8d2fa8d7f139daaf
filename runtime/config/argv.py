"""``rlcore-run``'s command line: the argparse front end generated from the fields (torch- and Ray-free), and
``parse_args``/``resolve_args`` that read ``--config``, slime's ``--custom-config-path`` and
``--megatron-config-path``, apply the flags, and validate.
"""

from __future__ import annotations

import argparse
import functools
import json
import typing
from collections.abc import Sequence
from typing import Any, Literal

from runtime import slime_compat, slime_flags
from runtime.config.checks import validate
from runtime.config.resolve import _normalise_key, from_dict
from runtime.config.schema import _SPECS, BUILTIN_JOB_DEFAULTS, SECTIONS, Config, ConfigError, _unwrap_optional, flag
from runtime.config.yaml_io import _tree_value, megatron_role_overrides, read_yaml_tree
from runtime.engines import sglang_flags


def _arg_type(name: str, inner: Any, optional: bool):
    def convert(text: str) -> Any:
        if optional and text.lower() in ("none", "null"):
            return None
        if inner is dict:
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                value = None
            if not isinstance(value, dict):
                raise argparse.ArgumentTypeError(f"{flag(name)} expects a JSON object, got {text!r}")
            return value
        try:
            return inner(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag(name)} expects a {inner.__name__}, got {text!r}") from None

    convert.__name__ = inner.__name__
    return convert


# slime's schedule switches, each the same as one --rollout-schedule.
SCHEDULE_SHORTHANDS = {"--async": "one_step", "--fully-async": "fully_async"}


def _schedule_problem(namespace: dict[str, Any]) -> str | None:
    """Fold the schedule shorthands of a parsed command line into ``rollout_schedule``; a message naming both flags
    when two of them (or one and ``--rollout-schedule``) ask for different schedules."""
    given = list(dict(namespace.pop("schedule_shorthands", None) or []).items())
    if "rollout_schedule" in namespace:
        given.append((f"--rollout-schedule {namespace['rollout_schedule']}", namespace["rollout_schedule"]))
    if len({schedule for _, schedule in given}) > 1:
        first, a = given[0]
        second, b = next((other, schedule) for other, schedule in given if schedule != a)
        return f"{first} and {second} ask for different rollout schedules ({a} and {b}): give one"
    if given:
        namespace["rollout_schedule"] = given[0][1]
    return None


def negated(name: str) -> str:
    """The flag that sets a boolean field False: ``use_tis`` -> ``--no-use-tis``, ``no_save_optim`` ->
    ``--no-no-save-optim`` (the field's own flag ``--no-save-optim`` sets it True)."""
    return "--no-" + name.replace("_", "-")


class _Switch(argparse.Action):
    """A boolean field's two flags: its own sets True, the ``--no-`` one False. Unlike argparse's
    BooleanOptionalAction, which reads any flag starting ``--no-`` as False, a field named ``no_*``
    (``--no-save-optim``) is set True by its own flag."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any):
        super().__init__(option_strings, dest, nargs=0, **kwargs)
        self.positive = option_strings[0]

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, option_string == self.positive)

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's layout with a plain greedy word wrap: ``textwrap`` (argparse's) was most of ``--help``'s time over
    the ~900 flags (rlcore's and SGLang's passthrough ones)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        lines: list[str] = []
        line = ""
        for word in text.split():
            if line and len(line) + 1 + len(word) > width:
                lines.append(line)
                line = word
            else:
                line = f"{line} {word}" if line else word
        return [*lines, line] if line else lines


def build_parser() -> argparse.ArgumentParser:
    """The ``rlcore-run`` argument parser: one flag per config field, defaults suppressed so YAML can sit between."""
    parser = argparse.ArgumentParser(
        prog="rlcore-run",
        usage="rlcore-run [--config PATH.yaml] [--FLAG VALUE ...] [--sglang-FLAG ...] [--router-FLAG ...]",
        description=(
            "Run an RL post-training job (GRPO and friends). With no arguments: the built-in CPU demo job. Flag "
            "defaults follow slime's; the built-in job (no --hf-checkpoint and no --prompt-data) uses its own tuned "
            "values for the flags you leave unset: "
            + ", ".join(f"{flag(k)} {v}" for k, v in BUILTIN_JOB_DEFAULTS.items())
            + "."
        ),
        argument_default=argparse.SUPPRESS,
        # A prefix of a flag must not silently select it: --rollout-max could mean two flags as new ones land.
        allow_abbrev=False,
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--config", metavar="PATH.yaml", help="YAML config (nested by section, or flat); flags win")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="ours: parse, validate and resolve the config, print it and the placement plan, and exit (no Ray)",
    )
    for shorthand, schedule in SCHEDULE_SHORTHANDS.items():
        # Each given shorthand is recorded with its flag, so that two that disagree are named, not the last taken.
        parser.add_argument(
            shorthand,
            dest="schedule_shorthands",
            action="append_const",
            const=(shorthand, schedule),
            help=f"--rollout-schedule {schedule}",
        )
    defaults = Config()
    groups = {None: parser.add_argument_group("general")}
    for section in SECTIONS:
        groups[section] = parser.add_argument_group(section)
    for name, (section, f, tp) in _SPECS.items():
        if f.metadata.get("passthrough"):
            continue
        default = getattr(defaults, name)
        help_text = f.metadata.get("help", "") + f" (default: {default!r}"
        if name in BUILTIN_JOB_DEFAULTS:
            help_text += f"; built-in job: {BUILTIN_JOB_DEFAULTS[name]!r}"
        help_text += ")"
        group = groups[section]
        inner, optional = _unwrap_optional(tp)
        if inner is bool:
            group.add_argument(flag(name), negated(name), dest=name, action=_Switch, help=help_text)
        elif typing.get_origin(inner) is list and f.metadata.get("append"):
            group.add_argument(flag(name), dest=name, action="append", help=help_text)
        elif typing.get_origin(inner) is list:
            (item,) = typing.get_args(inner)
            group.add_argument(flag(name), dest=name, nargs="+", type=_arg_type(name, item, False), help=help_text)
        elif name == "bf16":
            # Megatron's --bf16 is a bare switch; rlcore's takes auto|true|false too.
            group.add_argument(
                flag(name), dest=name, nargs="?", const="true", choices=typing.get_args(inner), help=help_text
            )
        elif typing.get_origin(inner) is Literal:
            group.add_argument(flag(name), dest=name, choices=typing.get_args(inner), help=help_text)
        else:
            group.add_argument(flag(name), dest=name, type=_arg_type(name, inner, optional), help=help_text)
    slime_flags.add_refused_arguments(parser)
    slime_flags.add_megatron_switches(parser)
    sglang_flags.add_passthrough_flags(parser, "server")
    sglang_flags.add_passthrough_flags(parser, "router")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> Config:
    """Parse ``rlcore-run``'s command line (``sys.argv[1:]`` when None) into a validated ``Config``.

    Precedence: defaults (the built-in job's for settings left unset when neither ``--hf-checkpoint`` nor
    ``--prompt-data`` is given), then the ``--config`` YAML file, then flags. Raises ``ConfigError``.
    """
    cfg, problems = _resolve(argv)
    if cfg is not None:
        try:
            validate(cfg)
        except ConfigError as err:
            problems += err.problems
    if problems:
        raise ConfigError(problems)
    return cfg


def resolve_args(argv: Sequence[str] | None = None) -> Config:
    """The ``Config`` a command line resolves to (YAML files read, flags applied, derived defaults filled), not
    validated: ``parse_args`` is this plus ``validate``. Raises ``ConfigError`` for flags and keys it cannot take."""
    cfg, problems = _resolve(argv)
    if problems:
        raise ConfigError(problems)
    return cfg


@functools.lru_cache(maxsize=1)
def _cached_parser() -> argparse.ArgumentParser:
    # Parsing does not change a parser: one per process serves every parse_args call.
    return build_parser()


def _resolve(argv: Sequence[str] | None) -> tuple[Config | None, list[str]]:
    """The unvalidated ``Config`` of a command line (None when it cannot be built) and the problems found."""
    parsed, extras = _cached_parser().parse_known_args(argv)
    namespace = vars(parsed)
    # Flags of slime's that this parser does not take (the SGLang fleet's, Megatron's) are named with their issue.
    problems = [slime_flags.unknown_flag_problem(arg) for arg in slime_flags.unknown_flags(extras)]
    if extras and not problems:
        problems.append(f"unexpected arguments {' '.join(extras)!r} (every value belongs to a --flag)")
    refused = {dest: namespace.pop(dest) for dest in list(namespace) if dest in slime_flags.REFUSED_BY_DEST}
    switches = slime_flags.pop_megatron_switches(namespace)
    problems += slime_flags.refused_problems(refused)
    namespace.pop("dry_run", None)  # the CLI's business (runtime.cli), not the job's
    schedule_problem = _schedule_problem(namespace)
    if schedule_problem is not None:
        return None, [*problems, schedule_problem]
    config_path = namespace.pop("config", None)
    try:
        tree = read_yaml_tree(config_path) if config_path is not None else {}
        # Passthrough flags add to (and override) the passthrough settings of the YAML file, one flag at a time.
        for key, values in sglang_flags.pop_passthrough(namespace).items():
            from_yaml = from_dict(tree) if tree else Config()
            namespace[key] = {**getattr(from_yaml.sglang, key), **values}
        custom_path = namespace.get("custom_config_path", tree.get("custom_config_path"))
        if custom_path is not None:
            # slime's --custom-config-path: its keys override the command line; the ones that are no flag of ours
            # are the hooks' (args.<key>), unless they are slime flags this runtime refuses.
            custom = read_yaml_tree(custom_path, flag_name="--custom-config-path")
            extras = dict(tree.get("custom_args") or {}) | dict(namespace.pop("custom_args", {}) or {})
            for raw_key, value in custom.items():
                key = _normalise_key(raw_key)
                if key in _SPECS:
                    namespace[key] = value
                elif key in slime_flags.REFUSED_BY_DEST:
                    problems += slime_flags.refused_problems({key: value})
                else:
                    extras[key] = value
            namespace["custom_args"] = extras
        megatron_path = namespace.get("megatron_config_path", _tree_value(tree, "megatron_config_path"))
        if megatron_path is not None:
            # slime's actor role args: the entry's overrides win over the command line.
            namespace.update(megatron_role_overrides(megatron_path, role="actor"))
        cfg = from_dict(tree, **namespace)
        given = namespace.get("train_backend", _tree_value(tree, "train_backend"))
        backend = slime_compat.backend_choice(cfg, given=given, switches=switches).name  # slime's: Megatron
        cfg = cfg if backend == cfg.train.train_backend else from_dict(tree, **namespace, train_backend=backend)
    except ConfigError as err:
        return None, problems + err.problems
    problems += slime_flags.megatron_switch_problems(switches, backend=cfg.train.train_backend)
    return cfg, problems
