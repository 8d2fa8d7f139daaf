"""SGLang's own request classes and flag parsers, imported on demand for tests, the fake server and the flag-list tool.

The runtime never imports SGLang (``runtime.engines.sglang_engine`` speaks HTTP only). Tests and tools check
rlcore against SGLang's own definitions where they import: ``pip install --no-deps sglang==0.5.23`` plus the light
packages of the ``sglang-api`` extra (see ``pyproject.toml``) make ``sglang.srt.managers.io_struct`` and
``sglang.srt.server_args`` import on a CPU machine.

One package is missing on purpose: torchvision. PyPI's torchvision for torch 2.13 links CUDA libraries and does
not load beside the CPU build of torch, and SGLang's configs package imports it for vision models at import time.
:func:`load` puts an inert stand-in module in its place before importing SGLang (only when torchvision itself
cannot be found), and lets SGLang's registration of its vision image processors with transformers fail quietly
(transformers refuses it without torchvision); nothing in the request classes or ``ServerArgs`` touches either.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock


class _InertModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of ``root`` and its submodules give empty modules whose attributes are mocks."""

    def __init__(self, root: str):
        self.root = root

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == self.root or name.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda attr: mock.MagicMock(name=f"{spec.name}.{attr}")  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _tolerate_image_processor_registration() -> None:
    """Load ``sglang.srt.configs.utils`` before its package does, with ``register_image_processor`` made a no-op
    when transformers refuses it (it needs torchvision); the package's vision configs import the patched one."""
    if "sglang.srt.configs.utils" in sys.modules:
        return
    path = Path(importlib.util.find_spec("sglang").origin).parent / "srt" / "configs" / "utils.py"
    spec = importlib.util.spec_from_file_location("sglang.srt.configs.utils", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    register = module.register_image_processor

    def register_if_possible(config: Any, image_processor: Any) -> None:
        with contextlib.suppress(ImportError):
            register(config, image_processor)

    module.register_image_processor = register_if_possible


@dataclass(frozen=True)
class SGLangAPI:
    """The parts of SGLang and sglang-router that rlcore checks itself against."""

    version: str
    io_struct: Any
    ServerArgs: Any
    generate_contract_error: Any
    router_version: str | None
    RouterArgs: Any
    # sglang.srt.sampling.sampling_params.SamplingParams (a request's sampling_params, checked by its verify()).
    SamplingParams: Any = None


@functools.cache
def load() -> SGLangAPI | None:
    """SGLang's API modules, or None when ``sglang`` is not installed (a missing light dependency raises)."""
    if importlib.util.find_spec("sglang") is None:
        return None
    if importlib.util.find_spec("torchvision") is None:
        sys.meta_path.insert(0, _InertModules("torchvision"))
        _tolerate_image_processor_registration()
    with warnings.catch_warnings():
        # SGLang's quantization modules warn at import time that they need CUDA.
        warnings.simplefilter("ignore")
        import sglang
        import sglang.srt.managers.io_struct as io_struct
        from sglang.srt.entrypoints.api_contract import generate_contract_error
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.server_args import ServerArgs
    router_version, router_args = None, None
    if importlib.util.find_spec("sglang_router") is not None:
        from importlib.metadata import version

        from sglang_router.router_args import RouterArgs

        router_version, router_args = version("sglang-router"), RouterArgs
    return SGLangAPI(
        sglang.__version__, io_struct, ServerArgs, generate_contract_error, router_version, router_args, SamplingParams
    )
