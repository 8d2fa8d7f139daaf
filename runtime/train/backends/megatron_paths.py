"""Where Megatron ``torch_dist`` checkpoints are: a folder, or a Megatron-LM save root and its steps. Torch-free, so
the config checks (``rlcore-run --dry-run``) find them without importing torch; reading and writing them is
:mod:`runtime.train.backends.megatron_checkpoint`'s, which re-exports these names."""

from __future__ import annotations

import json
import os
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"
# dist_checkpointing writes it into every checkpoint folder (the format's name and version).
FORMAT_FILE = "metadata.json"
COMMON_FILE = "common.pt"


def iteration_folder(root: str | os.PathLike[str], step: int | str) -> Path:
    """Megatron-LM's folder of ``step`` under a save root: ``iter_0000012`` (seven digits) or ``release``."""
    return Path(root) / ("release" if step == "release" else f"iter_{int(step):07d}")


def is_checkpoint_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` itself is a ``torch_dist`` checkpoint folder (``metadata.json`` naming the format, and the
    torch.distributed ``.metadata``)."""
    path = Path(path)
    if not (path / FORMAT_FILE).is_file() or not (path / ".metadata").is_file():
        return False
    try:
        backend = json.loads((path / FORMAT_FILE).read_text()).get("sharded_backend")
    except (ValueError, AttributeError):
        return False
    return backend == "torch_dist"


def find_checkpoint(path: str | os.PathLike[str], *, step: int | None = None, flag: str = "--load") -> Path | None:
    """The ``torch_dist`` folder that ``path`` names, None when ``path`` is no Megatron checkpoint at all.

    ``path`` is a checkpoint folder itself, or a Megatron-LM save root: with ``step`` its ``iter_{step:07d}``,
    otherwise the step its ``latest_checkpointed_iteration.txt`` names (``release`` included). ``ValueError``
    naming ``flag`` when the root names a folder that is missing or is no checkpoint."""
    path = Path(path)
    if step is None and is_checkpoint_folder(path):
        return path
    tracker = path / TRACKER
    if step is None and not tracker.is_file():
        return None
    if step is None:
        text = tracker.read_text().strip()
        if text != "release" and not text.isdigit():
            raise ValueError(f"{flag} {path}: {TRACKER} holds {text!r}, neither a step nor 'release'")
        target = iteration_folder(path, text)
    else:
        target = iteration_folder(path, step)
    if not is_checkpoint_folder(target):
        raise ValueError(f"{flag} {path}: {target.name} is no torch_dist checkpoint folder (no {FORMAT_FILE})")
    return target
