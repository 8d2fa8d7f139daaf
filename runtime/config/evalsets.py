"""Evaluation datasets resolved as slime resolves them: a dataset's own settings (``--eval-config``), else the
config's ``defaults``, else the ``--eval-*`` flags, else the rollout's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from runtime.config.schema import RM_TYPES, Config, ConfigError


@dataclass(frozen=True)
class EvalDataset:
    """One evaluation dataset with its settings resolved: the dataset's own (``--eval-config``), else the config's
    ``defaults``, else the ``--eval-*`` flags, else the rollout's (as slime resolves them)."""

    name: str
    path: str
    n_samples_per_eval_prompt: int
    temperature: float
    top_p: float
    top_k: int
    max_response_len: int | None
    stop_token_ids: tuple[int, ...]
    stop: tuple[str, ...]
    min_new_tokens: int | None
    input_key: str
    label_key: str | None
    tool_key: str
    metadata_key: str
    apply_chat_template: bool
    apply_chat_template_kwargs: Mapping[str, Any]
    max_prompt_len: int | None
    rm_type: str | None = None
    custom_rm_path: str | None = None
    metadata_overrides: Mapping[str, Any] = field(default_factory=dict)


# Per-dataset keys of slime's --eval-config that rlcore-run takes, with the flags they fall back to (first set wins).
_EVAL_KEY_FALLBACKS: dict[str, tuple[str, ...]] = {
    "n_samples_per_eval_prompt": ("n_samples_per_eval_prompt",),
    "temperature": ("eval_temperature", "rollout_temperature"),
    "top_p": ("eval_top_p", "rollout_top_p"),
    "top_k": ("eval_top_k", "rollout_top_k"),
    "max_response_len": ("eval_max_response_len", "rollout_max_response_len"),
    "stop_token_ids": ("rollout_stop_token_ids",),
    "stop": ("rollout_stop",),
    "min_new_tokens": ("eval_min_new_tokens",),
    "input_key": ("eval_input_key", "input_key"),
    "label_key": ("eval_label_key", "label_key"),
    "tool_key": ("eval_tool_key", "tool_key"),
    "metadata_key": ("metadata_key",),
    "apply_chat_template": ("apply_chat_template",),
    "apply_chat_template_kwargs": ("apply_chat_template_kwargs",),
    "max_prompt_len": ("eval_max_prompt_len", "rollout_max_prompt_len"),
}
_EVAL_KEYS_OWN = ("name", "path", "rm_type", "custom_rm_path", "metadata_overrides")


def _eval_config_entries(path: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(defaults, datasets)`` of an ``--eval-config`` YAML file (slime's layout: ``eval: {defaults, datasets}``,
    the ``eval`` level optional, ``datasets`` a list of entries with a ``name`` or a mapping by name)."""
    if not os.path.isfile(path):
        raise ConfigError([f"--eval-config: file {os.path.abspath(path)!r} does not exist"])
    with open(path) as fh:
        try:
            root = yaml.safe_load(fh)
        except yaml.YAMLError as err:
            raise ConfigError([f"--eval-config: {path} is not valid YAML ({err})"]) from err
    tree = root.get("eval", root) if isinstance(root, Mapping) else None
    if not isinstance(tree, Mapping):
        raise ConfigError([f"--eval-config: {path} must hold a mapping (an `eval` section, or its content)"])
    defaults = dict(tree.get("defaults") or {})
    raw = tree.get("datasets")
    if isinstance(raw, Mapping):
        entries = [{"name": name, **dict(entry or {})} for name, entry in raw.items()]
    elif isinstance(raw, list) and all(isinstance(entry, Mapping) for entry in raw):
        entries = [dict(entry) for entry in raw]
    else:
        raise ConfigError([f"--eval-config: {path} defines no datasets under `eval.datasets` (a list or a mapping)"])
    problems = []
    for where, entry in [("defaults", defaults), *((f"dataset {e.get('name')!r}", e) for e in entries)]:
        unknown = sorted(set(entry) - set(_EVAL_KEY_FALLBACKS) - set(_EVAL_KEYS_OWN))
        if unknown:
            problems.append(
                f"--eval-config: {where} sets {', '.join(unknown)}, which rlcore-run does not take (it takes "
                f"{', '.join(sorted(set(_EVAL_KEY_FALLBACKS) | set(_EVAL_KEYS_OWN)))})"
            )
    for entry in entries:
        if not entry.get("name") or not entry.get("path"):
            problems.append(f"--eval-config: every dataset needs a name and a path, got {entry!r}")
    if problems:
        raise ConfigError(problems)
    return defaults, entries


def eval_datasets(cfg: Config) -> list[EvalDataset]:
    """The evaluation datasets, settings resolved: from ``--eval-config`` when given, else ``--eval-prompt-data``'s
    name/path pairs (one bare path is named ``aime``, as slime names it). Raises ``ConfigError``."""
    if cfg.eval.eval_config is not None:
        defaults, entries = _eval_config_entries(cfg.eval.eval_config)
    else:
        values = cfg.eval.eval_prompt_data or []
        if len(values) == 1:
            values = ["aime", values[0]]
        if len(values) % 2:
            raise ConfigError(
                [f"--eval-prompt-data takes name/path pairs (aime /data/aime.jsonl ...) or one path; got {values!r}"]
            )
        defaults, entries = {}, [{"name": n, "path": p} for n, p in zip(values[::2], values[1::2], strict=True)]
    names = [str(entry["name"]) for entry in entries]
    if len(set(names)) != len(names):
        raise ConfigError([f"evaluation dataset names must differ, got {names}"])
    return [resolve_eval_dataset(cfg, entry, defaults) for entry in entries]


def resolve_eval_dataset(
    cfg: Config, entry: Mapping[str, Any], defaults: Mapping[str, Any] | None = None
) -> EvalDataset:
    """An evaluation dataset (``entry``: its name, path and own settings) with every setting resolved: the entry's,
    else ``defaults``', else the ``--eval-*`` flags', else the rollout's."""
    defaults = defaults or {}
    resolved = {}
    for key, fallbacks in _EVAL_KEY_FALLBACKS.items():
        if key in entry:
            resolved[key] = entry[key]
        elif key in defaults:
            resolved[key] = defaults[key]
        else:
            resolved[key] = next((v for v in (getattr(cfg, f) for f in fallbacks) if v is not None), None)
    resolved["stop_token_ids"] = tuple(resolved["stop_token_ids"] or ())
    # slime takes one stop string or a list of them.
    stop = resolved["stop"]
    resolved["stop"] = (stop,) if isinstance(stop, str) else tuple(stop or ())
    resolved["apply_chat_template_kwargs"] = dict(resolved["apply_chat_template_kwargs"] or {})
    own = {key: entry.get(key, defaults.get(key)) for key in ("rm_type", "custom_rm_path")}
    overrides = dict(defaults.get("metadata_overrides") or {}) | dict(entry.get("metadata_overrides") or {})
    return EvalDataset(
        name=str(entry["name"]), path=str(entry["path"]), metadata_overrides=overrides, **own, **resolved
    )


def _eval_dataset_problems(d: EvalDataset) -> list[str]:
    """Type and range problems of one resolved evaluation dataset, named by the dataset and key."""
    where = f"evaluation dataset {d.name!r}"
    checks = {
        "n_samples_per_eval_prompt": isinstance(d.n_samples_per_eval_prompt, int) and d.n_samples_per_eval_prompt > 0,
        "temperature": isinstance(d.temperature, int | float) and d.temperature > 0,
        "top_p": isinstance(d.top_p, int | float) and 0 < d.top_p <= 1,
        "top_k": isinstance(d.top_k, int) and (d.top_k == -1 or d.top_k >= 1),
        "max_response_len": d.max_response_len is None
        or (isinstance(d.max_response_len, int) and d.max_response_len > 0),
        "rm_type": d.rm_type is None or d.rm_type in RM_TYPES or d.rm_type.removeprefix("boxed_") in RM_TYPES[1:],
        "min_new_tokens": d.min_new_tokens is None
        or (isinstance(d.min_new_tokens, int) and not isinstance(d.min_new_tokens, bool) and d.min_new_tokens >= 0),
        "stop": all(isinstance(x, str) and x for x in d.stop),
    }
    return [f"{where}: {key} {getattr(d, key)!r} is out of range" for key, ok in checks.items() if not ok]
