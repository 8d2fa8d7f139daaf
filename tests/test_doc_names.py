"""Every name the README and docs/ put in backticks still exists: each ``--flag`` is one of rlcore-run's (or a
passthrough, or a flag of a script in tools/), each repository path is there, each ``rlcore.``/``runtime.`` name
imports, and each snake_case name is in the code. A rename that leaves a stale name in the docs fails here.

Names of other programs (slime's scripts, Ray's files, pip's flags) and placeholders are listed in ``EXTERNAL`` with
whose they are."""

from __future__ import annotations

import fnmatch
import importlib
import os
import re
from functools import cache
from pathlib import Path

import pytest

from runtime.config import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/runtime.md", "docs/kernels-notes.md")
SOURCES = ("rlcore", "runtime", "tools", "examples", "tests", "Makefile", "pyproject.toml")

# Names of other programs that the docs mention on purpose, each with whose it is, and placeholders.
EXTERNAL = {
    "--no-deps": "pip",
    "--host": "the SGLang server's own flag",
    "--logdir": "TensorBoard",
    "--no-flag": "a placeholder: any boolean flag's negation",
    "train.py": "slime's entry script",
    "train_async.py": "slime's entry script",
    "examples/on_policy_distillation": "slime's example folder",
    "examples/fully_async/run-qwen2.5-0.5B-fully_async.sh": "slime's example script",
    "examples/retool/retool_qwen3_4b_rl.sh": "slime's example script",
    "consistent_hashing": "slime's router policy",
    "min_eval_samples": "a key of slime's evaluation config",
    "multimodal_keys": "a key of slime's evaluation config",
    "gradient_checkpointing_enable": "transformers' method",
    "~/.ray/auth_token": "Ray's token file",
    "./my_rewards.py": "the user's file in an example",
    ".step_N.partial/": "a pattern: N is the step",
    ".final_model.partial/": "the export's temporary folder, made and removed at run time",
    "len_b": "math notation: sample b's length",
}

BACKTICKED = re.compile(r"`([^`\n]+)`")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9_*<>-]*[a-z0-9*>])")
PYTHON_NAME = re.compile(r"^(rlcore|runtime)(\.[A-Za-z_]\w*)+")
SNAKE = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)+$")
PATH = re.compile(r"^[\w.~-]*(/[\w.*-]*)+$|^[\w-]+\.(py|md|txt|json|jsonl|sh|yaml|png|pt)$")
OUR_PREFIXES = ("rlcore/", "runtime/", "tools/", "tests/", "docs/", "examples/", ".ci/")
# Folders that are not the repository's own files (what .gitignore lists): a file named by its base name is looked for
# outside them. Walking `make test`'s .venv (3 GB) for each such name took 20 s of the suite.
NOT_OURS = ("__pycache__", "outputs", "runs", "build")


def backticked(doc: str) -> list[str]:
    text = re.sub(r"```.*?```", "", (ROOT / doc).read_text(), flags=re.S)
    return sorted(set(BACKTICKED.findall(text)))


@cache
def source_text() -> str:
    parts = []
    for name in SOURCES:
        path = ROOT / name
        for file in [path] if path.is_file() else sorted(path.rglob("*")):
            if file == Path(__file__).resolve():
                continue  # this file names stale names on purpose
            if file.is_file() and (file.suffix in (".py", ".json", ".yaml", ".sh", ".txt", ".toml") or file == path):
                parts.append(file.read_text(errors="replace"))
    return "\n".join(parts)


@cache
def source_words() -> frozenset[str]:
    """Every whole word (``\\w+``) and every whole ``--flag`` token of the code: set look-ups in place of a regex
    search of the whole code per name (200 of those took 20 s of the suite)."""
    text = source_text()
    return frozenset(re.findall(r"\w+", text)) | frozenset(re.findall(r"(?<![\w-])--[\w-]+", text))


@cache
def known_flags() -> frozenset[str]:
    flags = {opt for action in build_parser()._actions for opt in action.option_strings}  # --sglang-* included
    # A script's own flags: the string literals its argparse is given.
    flags |= set(re.findall(r"[\"'](--[a-z][a-z0-9-]*)[\"']", source_text()))
    return frozenset(flags)


@cache
def repository_paths() -> tuple[str, ...]:
    """Every file and folder of the repository, relative, outside hidden folders, virtual environments and the
    ignored ones in ``NOT_OURS``."""
    paths = []
    for folder, dirs, files in os.walk(ROOT):
        here = Path(folder)
        dirs[:] = [
            d
            for d in dirs
            if not d.startswith(".")
            and d not in NOT_OURS
            and not d.endswith(".egg-info")
            and not (here / d / "pyvenv.cfg").exists()
        ]
        paths += [(here / name).relative_to(ROOT).as_posix() for name in (*dirs, *files)]
    return tuple(paths)


def named_by_tail(name: str) -> bool:
    """Some repository path ends with ``name`` (a base name, or a path's last parts; ``*`` matches as in a glob)."""
    if any(c in name for c in "*?["):
        return bool(fnmatch.filter(repository_paths(), name) or fnmatch.filter(repository_paths(), f"*/{name}"))
    return any(p == name or p.endswith(f"/{name}") for p in repository_paths())


def stale_flag(flag: str) -> bool:
    if flag in EXTERNAL:
        return False
    if flag.endswith(("-*", "-<flag>")):  # a family: --sglang-*, --router-<flag>
        return not any(f.startswith(flag.split("*")[0].split("<")[0]) for f in known_flags())
    if "*" in flag:
        return not fnmatch.filter(known_flags(), flag)
    if flag in known_flags() or f"--no-{flag[2:]}" in known_flags():
        return False
    # A flag the code refuses or maps in a table (Megatron's and slime's flags): the code names it, or its field.
    return flag not in source_words() and flag[2:].replace("-", "_") not in source_words()


def stale_path(token: str) -> bool:
    name = token.split()[0]
    if name in EXTERNAL or name.startswith(("http", "/", ".venv/")) or "..." in name:
        return False  # a URL, an HTTP route, the virtual environment `make` builds, an elided name
    if name.split("/")[0] in ("rollout", "train", "perf", "eval", "reward"):
        return False  # a metric's name
    if (ROOT / name).exists() or (ROOT / name.rstrip("/")).exists():
        return False
    if named_by_tail(name.rstrip("/")):
        return False  # a file named by its base name (`keys.py`)
    if name.startswith(OUR_PREFIXES):
        return True  # a path into this repository that is not there
    # A file a job writes (`metrics.jsonl`, `final_model/`, `outputs/default/base_model`): the code names each part.
    return not all(part in source_text() for part in name.strip("/*").split("/") if part)


def stale_python_name(token: str) -> bool:
    dotted = PYTHON_NAME.match(token)[0]
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return True
            obj = getattr(obj, attr)
        return False
    return True


def stale_names(doc: str) -> list[str]:
    stale = []
    for token in backticked(doc):
        for flag in FLAG.findall(token):
            if stale_flag(flag):
                stale.append(flag)
        if token.startswith("-"):
            continue
        if PYTHON_NAME.match(token):
            if stale_python_name(token):
                stale.append(token)
        elif PATH.match(token.split()[0]) and " " not in token.strip():
            if stale_path(token):
                stale.append(token)
        elif SNAKE.match(token) and token not in EXTERNAL and token not in source_words():
            stale.append(token)
    return sorted(set(stale))


@pytest.mark.parametrize("doc", DOCS)
def test_every_name_in_the_docs_exists(doc):
    assert stale_names(doc) == [], f"{doc} names what the code does not have"


def test_a_renamed_function_flag_or_file_is_caught(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "`sglang_launch_command` and `--rollout-num-gpu` and `runtime/engines/launch.py` and "
        "`rlcore.kernels.logprob_entropy` and `--sglang-mem-fraction-statique`, but `server_argv`, "
        "`--rollout-num-gpus`, `runtime/engines/launcher.py`, `rlcore.kernels.logprobs_entropy`, "
        "`--sglang-mem-fraction-static`, "
        "`--no-*-fusion` and `metrics.jsonl` are there.\n```\n`not_checked_in_a_code_block`\n```\n"
    )
    got = stale_names(str(doc))
    assert got == sorted(
        [
            "--rollout-num-gpu",
            "--sglang-mem-fraction-statique",
            "rlcore.kernels.logprob_entropy",
            "runtime/engines/launch.py",
            "sglang_launch_command",
        ]
    )
