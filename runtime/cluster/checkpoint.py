"""Job checkpoints: the trainers' model and optimizer state, the prompt feed, the step, and the RNG states.

Layout under ``--save``: one folder per saved step, ``step_000012/`` holding ``trainer/`` (torch.distributed.checkpoint
shards of model and optimizer, plus each rank's RNG state) and ``loop_state.pt`` (step; the prompt feed: the data
position and every prompt handed out but not yet trained, see ``runtime.rollout.source.PromptFeed``; engine and
driver RNG states); ``latest`` names the newest folder and is replaced atomically after the folder is complete, so a
job killed while saving resumes from the previous checkpoint.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

# numpy and torch are imported where used: config validation calls ``resolve`` and must stay light.

LATEST = "latest"
LOOP_STATE = "loop_state.pt"
TRAINER_DIR = "trainer"


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def save(
    root: str | os.PathLike[str], step: int, *, trainers: Any, engines: Any, feed: Any, with_optimizer: bool = True
) -> Path:
    """Save the state after ``step`` completed steps (the optimizer's too unless ``with_optimizer`` is False:
    slime's ``--no-save-optim``); returns the step's folder."""
    import numpy as np
    import torch

    folder = step_dir(root, step)
    folder.mkdir(parents=True, exist_ok=True)
    trainers.save(str(folder / TRAINER_DIR), with_optimizer=with_optimizer)
    state = {
        "step": step,
        "feed": feed.state_dict(),
        "engine_rng": engines.get_rng_state(),
        "driver_rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
    }
    torch.save(state, folder / LOOP_STATE)
    tmp = Path(root) / f".{LATEST}.tmp"
    tmp.write_text(folder.name)
    os.replace(tmp, Path(root) / LATEST)
    return folder


def _missing(folder: Path) -> list[str]:
    return [
        name
        for name, ok in ((LOOP_STATE, (folder / LOOP_STATE).is_file()), (TRAINER_DIR, (folder / TRAINER_DIR).is_dir()))
        if not ok
    ]


def resolve(path: str | os.PathLike[str]) -> Path:
    """The step folder that ``--load`` names: a step folder itself, or a ``--save`` root (its ``latest``).

    Raises ``FileNotFoundError`` naming ``--load`` when neither holds a complete checkpoint; config validation
    calls this so that a bad ``--load`` stops the job before anything starts.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--load: {os.path.abspath(path)!r} does not exist")
    if (path / LOOP_STATE).is_file():
        if missing := _missing(path):
            raise FileNotFoundError(f"--load: {str(path)!r}: the checkpoint folder has no {', '.join(missing)}")
        return path
    if (path / LATEST).is_file():
        folder = path / (path / LATEST).read_text().strip()
        if missing := _missing(folder):
            raise FileNotFoundError(
                f"--load: {str(path)!r}: 'latest' names {folder.name!r}, which has no {', '.join(missing)}"
            )
        return folder
    raise FileNotFoundError(f"--load: {str(path)!r} is neither a checkpoint folder nor a --save root with '{LATEST}'")


def load(path: str | os.PathLike[str], *, trainers: Any, engines: Any, feed: Any) -> int:
    """Restore everything :func:`save` wrote; returns the number of completed steps (the step to run next)."""
    import numpy as np
    import torch

    folder = resolve(path)
    state = torch.load(folder / LOOP_STATE, weights_only=False)
    trainers.load(str(folder / TRAINER_DIR))
    feed.load_state_dict(state["feed"])
    if len(state["engine_rng"]) == len(engines.actors):
        engines.set_rng_state(state["engine_rng"])
    rng = state["driver_rng"]
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    return int(state["step"])
