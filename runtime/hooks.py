"""User hooks (reward, generate, filter functions) named by a path string, as slime's flags take them.

Three spellings are accepted: ``"pkg.mod:fn"``, ``"pkg.mod.fn"`` (slime's) and ``"path/to/file.py:fn"``
(a file that need not be on ``sys.path``; relative paths are taken from the working directory, which is on the
import path as it is for ``python -m``).

This is the one place hook errors are made, so every hook flag reports them alike, as ``<flag> <path>: <what>`` with
the hook's own file and line:

- :func:`resolve_hook` (called for every hook flag while the config is validated, before Ray or the model start)
  raises :class:`HookError` for a missing module, file or function, a syntax error or a failing import: exit 2.
- The :class:`Hook` it returns is called as the function; a call that raises, or a result the caller finds of the
  wrong type (:meth:`Hook.wrong_type`), is a :class:`HookFailure`, a ``JobError``: exit 1 once the last completed
  step is saved.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
import types
from collections.abc import Callable
from typing import Any

from runtime import slime_compat
from runtime.errors import JobError, JobInterrupted


class HookError(ValueError):
    """A hook that cannot be resolved to a callable: a bad path, a missing module, file or function, or a module
    that fails to import (syntax error, its own import error). The message names the flag (when known), the path and
    what went wrong, with the hook's own file and line where there is one."""

    def __init__(self, what: str, *, path: str | None = None, flag: str | None = None):
        self.what, self.path, self.flag = what, path, flag
        super().__init__(_describe(flag, path, what))

    def for_flag(self, flag: str) -> HookError:
        """The same error, reported under ``flag``."""
        return HookError(self.what, path=self.path, flag=flag)


class HookFailure(JobError):
    """A hook that raised, or returned the wrong type, while the job ran (exit 1)."""


def _describe(flag: str | None, path: str | None, what: str) -> str:
    if flag is not None:
        return f"{flag} {path}: {what}" if path is not None else f"{flag}: {what}"
    return f"hook path {path!r}: {what}" if path is not None else what


def _where(tb: types.TracebackType | None, own_file: str | None) -> str | None:
    """``file:line`` of the innermost frame in ``own_file`` (the hook's file), else of the innermost frame outside
    Python's import machinery and this module."""
    frames = [f for f in traceback.extract_tb(tb) if not f.filename.startswith("<frozen") and f.filename != __file__]
    own = [f for f in frames if own_file is not None and os.path.abspath(f.filename) == own_file]
    frame = (own or frames or [None])[-1]
    return None if frame is None else f"{frame.filename}:{frame.lineno}"


def _raised(err: BaseException, own_file: str | None) -> str:
    if isinstance(err, SyntaxError) and err.filename:
        return f"{type(err).__name__}: {err.msg} ({err.filename}:{err.lineno})"
    where = _where(err.__traceback__, own_file)
    return f"{type(err).__name__}: {err}" + (f" ({where})" if where else "")


def _import_failure(err: Exception, own_file: str | None) -> str:
    # A syntax error is the module's own, whatever the traceback says; anything else was raised while importing.
    return ("" if isinstance(err, SyntaxError) else "importing it raised ") + _raised(err, own_file)


def _source_file(fn: Callable[..., Any]) -> str | None:
    try:
        source = inspect.getsourcefile(inspect.unwrap(fn))
    except TypeError:  # builtins and some callable objects have no source file
        source = None
    return os.path.abspath(source) if source else None


def _definition(fn: Callable[..., Any]) -> str:
    source = _source_file(fn)
    try:
        line = inspect.getsourcelines(inspect.unwrap(fn))[1]
    except (OSError, TypeError):
        line = None
    if source is None:
        return repr(fn)
    return f"{source}:{line}" if line else source


def working_directory_on_path() -> None:
    """Put the working directory first on the import path, as ``python -m`` does (a console script does not)."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)


# What a hook may raise and still be reported as its failure: sys.exit() and KeyboardInterrupt (or GeneratorExit)
# raised by the hook itself too, which would otherwise end a worker thread or the job with no word. A real Ctrl-C or
# SIGTERM arrives as runtime.errors.JobInterrupted (see runtime.cli) and passes through; asyncio's CancelledError does.
_HOOK_RAISED = (Exception, SystemExit, KeyboardInterrupt, GeneratorExit)


class Hook:
    """A user function named by a hook flag, called as the function itself.

    A call that raises (anything, ``sys.exit()`` included) becomes a :class:`HookFailure` naming the flag, the path,
    the exception and the hook's own file and line; so does an awaitable result that raises when awaited.
    :meth:`wrong_type` builds the failure for a result of the wrong type, pointing at the function's definition.
    """

    def __init__(self, flag: str, path: str, fn: Callable[..., Any]):
        self.flag, self.path, self.fn = flag, path, fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__wrapped__ = fn
        self._file = _source_file(fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            out = self.fn(*args, **kwargs)
        except JobInterrupted:
            raise
        except _HOOK_RAISED as err:
            raise self.failure(err) from err
        return self._awaited(out) if inspect.isawaitable(out) else out

    async def _awaited(self, awaitable: Any) -> Any:
        try:
            return await awaitable
        except JobInterrupted:
            raise
        except _HOOK_RAISED as err:
            raise self.failure(err) from err

    def failure(self, err: BaseException) -> HookFailure:
        return HookFailure(_describe(self.flag, self.path, "raised " + _raised(err, self._file)))

    def wrong_type(self, value: Any, expected: str) -> HookFailure:
        return self.bad_result(f"returned {type(value).__name__} {value!r:.60}, expected {expected}")

    def bad_result(self, what: str) -> HookFailure:
        """The failure for a result the caller cannot use; ``what`` says why, the function's definition is named."""
        return HookFailure(_describe(self.flag, self.path, f"{what} ({_definition(self.fn)})"))


def resolve_hook(flag: str, path: str) -> Hook:
    """Import the function ``path`` names for ``flag``; raises :class:`HookError` naming both (see
    :func:`load_function`)."""
    try:
        return Hook(flag, path, load_function(path))
    except HookError as err:
        raise err.for_flag(flag) from err


def split_function_path(path: str) -> tuple[str, str, bool]:
    """Split a hook path into ``(module name or file path, attribute name, is_file)``.

    Raises ``HookError`` when ``path`` is not one of the three accepted spellings.
    """
    if not isinstance(path, str) or not path.strip():
        raise HookError(f"a hook path must be a non-empty string like 'pkg.mod:fn', got {path!r}")
    path = path.strip()
    if ":" in path:
        # A Windows drive letter is not a concern here: paths are POSIX on every machine this runs on.
        target, _, attr = path.rpartition(":")
    else:
        target, _, attr = path.rpartition(".")
    if not target or not attr.isidentifier():
        raise HookError(
            f"must look like 'pkg.mod:fn', 'pkg.mod.fn' or 'path/to/file.py:fn' (got module/file {target!r} and "
            f"function {attr!r})",
            path=path,
        )
    is_file = target.endswith(".py") or os.sep in target
    if not is_file and not all(part.isidentifier() for part in target.split(".")):
        raise HookError(f"{target!r} is neither a module name nor a .py file", path=path)
    return target, attr, is_file


def _no_module(name: str) -> str:
    return (
        f"no module named {name!r} (the working directory {os.getcwd()!r} is on the import path; a module elsewhere "
        "needs PYTHONPATH, or give the file: path/to/file.py:function)"
    )


def _import_file(file_path: str, path: str) -> Any:
    file_path = os.path.abspath(file_path)
    if not os.path.isfile(file_path):
        raise HookError(f"file {file_path!r} does not exist", path=path)
    # One module per file, reused on later loads, so a hook's module-level state is not duplicated.
    digest = hashlib.sha1(file_path.encode()).hexdigest()[:12]
    name = f"_rlcore_hook_{os.path.splitext(os.path.basename(file_path))[0]}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file_path)
    if spec is None or spec.loader is None:
        raise HookError(f"file {file_path!r} cannot be imported as a Python module", path=path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise HookError(_import_failure(err, file_path), path=path) from err
    return module


def _import_module(target: str, path: str) -> Any:
    working_directory_on_path()
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as err:
        if err.name is not None and (target == err.name or target.startswith(err.name + ".")):
            raise HookError(_no_module(err.name), path=path) from err
        raise HookError(_import_failure(err, _module_file(target)), path=path) from err
    except Exception as err:
        raise HookError(_import_failure(err, _module_file(target)), path=path) from err


def _module_file(target: str) -> str | None:
    try:
        spec = importlib.util.find_spec(target)
    except (ImportError, ValueError):
        return None
    return os.path.abspath(spec.origin) if spec is not None and spec.origin else None


def load_function(path: str) -> Callable[..., Any]:
    """Import and return the callable that ``path`` names (the working directory is on the import path).

    slime's own paths load the runtime's counterpart (``runtime.slime_compat.SLIME_COUNTERPARTS``); a path into slime's
    package without one is a ``HookError`` saying so. Raises ``HookError`` for a malformed path, a missing module or
    file, a module that fails to import (a syntax error, its own import error, anything its body raises: named with the
    hook's file and line), a missing attribute or a non-callable one.
    """
    path = slime_compat.counterpart(path) if isinstance(path, str) else path
    target, attr, is_file = split_function_path(path)
    if not is_file and (problem := slime_compat.slime_path_problem(path)) is not None:
        raise HookError(problem, path=path)
    module = _import_file(target, path) if is_file else _import_module(target, path)
    where = getattr(module, "__file__", None) or module.__name__
    if not hasattr(module, attr):
        raise HookError(f"{where} has no function {attr!r}", path=path)
    fn = getattr(module, attr)
    if not callable(fn):
        raise HookError(f"{attr!r} in {where} is a {type(fn).__name__}, not a callable", path=path)
    return fn
