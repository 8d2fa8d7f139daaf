"""Loading user hooks (reward, generate, filter functions) from a path string, as slime's flags take them.

Three spellings are accepted: ``"pkg.mod:fn"``, ``"pkg.mod.fn"`` (slime's) and ``"path/to/file.py:fn"``
(a file that need not be on ``sys.path``; relative paths are taken from the working directory).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any


class HookError(ValueError):
    """A hook path that cannot be resolved to a callable; the message names the path and the reason."""


def split_function_path(path: str) -> tuple[str, str, bool]:
    """Split a hook path into ``(module name or file path, attribute name, is_file)``.

    Raises ``HookError`` when ``path`` is not one of the three accepted spellings.
    """
    if not isinstance(path, str) or not path.strip():
        raise HookError(f"hook path must be a non-empty string like 'pkg.mod:fn', got {path!r}")
    path = path.strip()
    if ":" in path:
        # A Windows drive letter is not a concern here: paths are POSIX on every machine this runs on.
        target, _, attr = path.rpartition(":")
    else:
        target, _, attr = path.rpartition(".")
    if not target or not attr.isidentifier():
        raise HookError(
            f"hook path {path!r} must look like 'pkg.mod:fn', 'pkg.mod.fn' or 'path/to/file.py:fn' "
            f"(got module/file {target!r} and function {attr!r})"
        )
    is_file = target.endswith(".py") or os.sep in target
    if not is_file and not all(part.isidentifier() for part in target.split(".")):
        raise HookError(f"hook path {path!r}: {target!r} is neither a module name nor a .py file")
    return target, attr, is_file


def check_function_path(path: str) -> None:
    """Raise ``HookError`` unless the module or file of ``path`` can be found (without importing the hook itself).

    For a module path, parent packages are imported by ``importlib.util.find_spec``; the module itself is not.
    """
    target, _, is_file = split_function_path(path)
    if is_file:
        if not os.path.isfile(target):
            raise HookError(f"hook path {path!r}: file {os.path.abspath(target)!r} does not exist")
        return
    try:
        spec = importlib.util.find_spec(target)
    except (ImportError, ValueError) as err:
        raise HookError(f"hook path {path!r}: cannot find module {target!r} ({err})") from err
    if spec is None:
        raise HookError(f"hook path {path!r}: no module named {target!r} (is it on PYTHONPATH?)")


def _import_file(file_path: str) -> Any:
    file_path = os.path.abspath(file_path)
    if not os.path.isfile(file_path):
        raise HookError(f"hook file {file_path!r} does not exist")
    # One module per file, reused on later loads, so a hook's module-level state is not duplicated.
    digest = hashlib.sha1(file_path.encode()).hexdigest()[:12]
    name = f"_rlcore_hook_{os.path.splitext(os.path.basename(file_path))[0]}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file_path)
    if spec is None or spec.loader is None:
        raise HookError(f"hook file {file_path!r} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_function(path: str) -> Callable[..., Any]:
    """Import and return the callable that ``path`` names.

    Raises ``HookError`` for a malformed path, a missing module or file, a missing attribute or a
    non-callable one. Errors raised while the hook's module is imported propagate with their traceback.
    """
    target, attr, is_file = split_function_path(path)
    if is_file:
        module = _import_file(target)
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as err:
            if err.name is not None and (target == err.name or target.startswith(err.name + ".")):
                raise HookError(f"hook path {path!r}: no module named {err.name!r}") from err
            raise
    if not hasattr(module, attr):
        raise HookError(f"hook path {path!r}: module {module.__name__!r} has no attribute {attr!r}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise HookError(f"hook path {path!r}: {attr!r} is a {type(fn).__name__}, not a callable")
    return fn
