"""Regenerate ``runtime/engines/sglang_flags.json``: the flags of SGLang's ``ServerArgs`` and sglang-router's
``RouterArgs``, which ``rlcore-run`` passes through as ``--sglang-<flag>`` and ``--router-<flag>``.

    pip install --no-deps sglang==0.5.23 sglang-router==0.3.2 && pip install -e '.[sglang-api]'
    python tools/gen_sglang_flags.py            # writes the file
    python tools/gen_sglang_flags.py --check    # exit 1 if the file differs from what the installed packages say

``tests/test_sglang_flags.py`` runs the same comparison.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from runtime.engines import sglang_api
from runtime.engines.sglang_flags import FLAGS_FILE


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def _choices(choices: Any) -> list[Any] | None:
    if choices is None:
        return None
    # Sorted: some choices are sets, or lists built from sets, whose order changes from run to run.
    return [_jsonable(c) for c in sorted(choices, key=str)]


def _kind(action: argparse.Action) -> str:
    if isinstance(action, argparse.BooleanOptionalAction):
        return "bool_optional"
    if isinstance(action, argparse._StoreTrueAction):
        return "true"
    if isinstance(action, argparse._StoreFalseAction):
        return "false"
    if action.nargs == 0:
        # store_const-like actions (SGLang's deprecated ones among them).
        return "true" if action.const is True else "const"
    return "value"


def parser_flags(parser: argparse.ArgumentParser) -> list[dict[str, Any]]:
    """Every flag of ``parser`` (help excluded) as the generated file records it (see ``sglang_flags.Flag``)."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        spellings = [s for s in action.option_strings if s.startswith("--")]
        if isinstance(action, argparse.BooleanOptionalAction):
            spellings = [s for s in spellings if not s.startswith("--no-")]
        converter = getattr(action.type, "__name__", None) if action.type is not None else None
        out.append(
            {
                "dest": action.dest,
                "flags": spellings,
                "kind": _kind(action),
                "type": converter,
                "nargs": action.nargs if _kind(action) == "value" else None,
                "default": _jsonable(action.default),
                "choices": _choices(action.choices),
                "help": " ".join((action.help or "").split()),
            }
        )
    return out


def generate() -> dict[str, Any]:
    api = sglang_api.load()
    if api is None or api.RouterArgs is None:
        raise SystemExit("needs sglang and sglang-router installed (see this script's docstring)")
    server = argparse.ArgumentParser()
    api.ServerArgs.add_cli_args(server)
    router = argparse.ArgumentParser()
    api.RouterArgs.add_cli_args(router, use_router_prefix=False, exclude_host_port=False)
    return {
        "server": {"package": "sglang", "version": api.version, "flags": parser_flags(server)},
        "router": {"package": "sglang-router", "version": api.router_version, "flags": parser_flags(router)},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    text = json.dumps(generate(), indent=1) + "\n"
    if args.check:
        same = FLAGS_FILE.read_text() == text
        print(f"{FLAGS_FILE}: {'up to date' if same else 'differs from the installed packages'}")
        return 0 if same else 1
    FLAGS_FILE.write_text(text)
    print(f"wrote {FLAGS_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
