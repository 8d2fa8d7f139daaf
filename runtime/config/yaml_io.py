"""YAML in and out: ``to_dict``/``dump_yaml``/``load_yaml`` round trips, the trees slime's files hold (flat, nested by
section, ``--megatron-config-path``'s per-role entries), and the printed form of a config.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import yaml

from runtime.config.resolve import _normalise_key, from_dict
from runtime.config.schema import _SPECS, _TOP_LEVEL, SECTIONS, Config, ConfigError, flag


def to_dict(cfg: Config) -> dict[str, Any]:
    """The nested plain-dict form of ``cfg`` (what ``dump_yaml`` writes and ``from_dict`` reads back)."""
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config, path: str | os.PathLike[str]) -> None:
    """Write ``cfg`` as YAML to ``path``; ``parse_args(["--config", path])`` reads it back equal."""
    with open(path, "w") as fh:
        yaml.safe_dump(to_dict(cfg), fh, sort_keys=False)


def load_yaml(path: str | os.PathLike[str]) -> Config:
    """Read a YAML config file (nested or flat); not validated."""
    return from_dict(read_yaml_tree(path))


def read_yaml_tree(path: str | os.PathLike[str], *, flag_name: str = "--config") -> Mapping[str, Any]:
    """The mapping a YAML config file holds, as written (only the keys it sets); raises ``ConfigError``."""
    if not os.path.isfile(path):
        raise ConfigError([f"{flag_name}: file {os.path.abspath(path)!r} does not exist"])
    with open(path) as fh:
        try:
            tree = yaml.safe_load(fh)
        except yaml.YAMLError as err:
            raise ConfigError([f"{flag_name}: {path} is not valid YAML ({err})"]) from err
    if tree is not None and not isinstance(tree, Mapping):
        raise ConfigError([f"{flag_name}: {path} must hold a mapping, got {type(tree).__name__}"])
    return tree or {}


def format_config(cfg: Config) -> str:
    """A readable listing, one ``--flag value`` per line by section; values changed from the defaults of this kind of
    job (built-in or not) are starred."""
    default = to_dict(from_dict(hf_checkpoint=cfg.model.hf_checkpoint, prompt_data=cfg.data.prompt_data))
    current = to_dict(cfg)
    width = max(len(flag(name)) for name in _SPECS)
    lines = []
    for name in _TOP_LEVEL:
        mark = "*" if current[name] != default[name] else " "
        lines.append(f"{mark} {flag(name):<{width}} {current[name]!r}")
    for section in SECTIONS:
        lines.append(f"[{section}]")
        for name, value in current[section].items():
            mark = "*" if value != default[section][name] else " "
            lines.append(f"{mark} {flag(name):<{width}} {value!r}")
    return "\n".join(lines)


def _tree_value(tree: Mapping[str, Any], key: str) -> Any:
    """The value a YAML config tree (flat, or nested by section; dashes or underscores) sets for ``key``, or None."""
    section = _SPECS[key][0]
    for raw, value in tree.items():
        name = raw.replace("-", "_") if isinstance(raw, str) else raw
        if name == key:
            return value
        if name == section and isinstance(value, Mapping):
            for sub_raw, sub_value in value.items():
                if isinstance(sub_raw, str) and sub_raw.replace("-", "_") == key:
                    return sub_value
    return None


# Keys of a --megatron-config-path entry that slime ignores (GPU allocation follows the command line).
_MEGATRON_ROLE_IGNORED = ("num_nodes", "num_gpus_per_node")


def megatron_role_overrides(path: str, *, role: str = "actor") -> dict[str, Any]:
    """The settings a ``--megatron-config-path`` YAML file (slime's ``megatron: [{name, role, overrides}]``; ``args``
    in place of ``overrides`` too) sets for ``role``, by field name; ``{}`` when it has no entry for the role.

    rlcore's Megatron backend trains the actor only, so the actor's entry is applied to the job (its keys must be
    flags of the train or algo section: the trainers'), and a critic entry is refused. ``ConfigError`` naming the
    flag and the key."""
    name = "--megatron-config-path"
    tree = read_yaml_tree(path, flag_name=name)
    entries = tree.get("megatron")
    if not isinstance(entries, list) or not all(isinstance(e, Mapping) for e in entries):
        raise ConfigError(
            [f"{name} {path}: needs a top-level 'megatron' list, e.g. megatron: [{{role: actor, overrides: {{...}}}}]"]
        )
    problems = []
    roles = [e.get("role") for e in entries]
    for other in sorted({str(r) for r in roles} - {"actor"}):
        if other == "critic":
            problems.append(
                f"{name} {path}: a critic entry, but rlcore's Megatron critic trains with the actor's flags "
                "(per-role overrides for it are not built)"
            )
        else:
            problems.append(f"{name} {path}: role {other!r} is neither actor nor critic (slime's roles)")
    if roles.count(role) > 1:
        problems.append(f"{name} {path}: {roles.count(role)} entries with role {role}, slime takes at most one")
    out: dict[str, Any] = {}
    for entry in entries:
        if entry.get("role") != role:
            continue
        overrides = entry.get("overrides") or entry.get("args") or {}
        if not isinstance(overrides, Mapping):
            problems.append(f"{name} {path}: the {role} entry's overrides must be a mapping")
            continue
        for raw_key, value in overrides.items():
            key = _normalise_key(raw_key)
            if key in _MEGATRON_ROLE_IGNORED:
                continue
            if key not in _SPECS:
                problems.append(f"{name} {path}: the {role} entry sets {raw_key!r}, which is no flag of rlcore-run")
            elif _SPECS[key][0] not in ("train", "algo"):
                problems.append(
                    f"{name} {path}: the {role} entry sets {flag(key)}, a flag of the {_SPECS[key][0]} section; a "
                    "role's overrides take the trainers' flags (train and algo sections)"
                )
            elif key == "megatron_config_path":
                problems.append(f"{name} {path}: the {role} entry cannot set {name} itself")
            else:
                out[key] = value
    if problems:
        raise ConfigError(problems)
    return out
