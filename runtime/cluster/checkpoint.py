"""Job checkpoints: the trainers' model and optimizer state, the prompt feed, the step, and the RNG states.

Layout under ``--save``: one folder per saved step, ``step_000012/`` holding ``trainer/`` (torch.distributed.checkpoint
shards of model and optimizer, plus each rank's RNG state) and ``loop_state.pt`` (step; the prompt feed: the data
position and every prompt handed out but not yet trained, see ``runtime.rollout.source.PromptFeed``; engine and
driver RNG states) and ``manifest.json`` (the step, and every file's size and SHA-256). A step is written into a
``.step_000012.partial`` folder that becomes ``step_000012/`` only once complete, and ``latest`` names the newest
folder and is replaced atomically after that, so a job killed while saving resumes from the previous checkpoint; a
save that fails (a full disk) removes its partial folder. ``--load`` is checked against the manifest while the config
is validated (:func:`verify`), so a truncated or corrupt file stops the job before Ray starts, naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

from runtime.errors import JobError

# numpy and torch are imported where used: config validation calls ``resolve`` and must stay light.

LATEST = "latest"
LOOP_STATE = "loop_state.pt"
TRAINER_DIR = "trainer"
MANIFEST = "manifest.json"


class SaveError(JobError):
    """A save that failed (a full disk, a path that cannot be written); its partial folder was removed."""


class CheckpointError(ValueError):
    """A ``--load`` checkpoint whose files do not match its manifest; the message names the file."""


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
    partial = folder.with_name(f".{folder.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # left by a job killed while saving this step
    try:
        partial.mkdir(parents=True)
        trainers.save(str(partial / TRAINER_DIR), with_optimizer=with_optimizer)
        state = {
            "step": step,
            "feed": feed.state_dict(),
            "engine_rng": engines.get_rng_state(),
            "driver_rng": {
                "python": random.getstate(),
                "numpy": np.random.get_state(),
                "torch": torch.get_rng_state(),
            },
        }
        torch.save(state, partial / LOOP_STATE)
        write_manifest(partial, step)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(partial, folder)
    except BaseException as err:
        shutil.rmtree(partial, ignore_errors=True)
        # A full disk on a trainer rank arrives as RayTaskError(CheckpointException) holding each rank's OSError.
        if (cause := os_error_in(err)) is not None:
            raise SaveError(
                f"--save {root}: saving step {step} failed ({type(cause).__name__}: {cause}); its partial folder was "
                "removed"
            ) from None
        raise
    _write_durably(Path(root) / LATEST, folder.name)
    return folder


def os_error_in(err: BaseException) -> OSError | None:
    """The first ``OSError`` in ``err`` or what it wraps: a Ray task error's cause, the per-rank failures of a
    ``torch.distributed.checkpoint`` ``CheckpointException``, ``__cause__`` and ``__context__``; None if none."""
    pending, seen = [err], set()
    while pending:
        e = pending.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            pending += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        cause = getattr(e, "cause", None)
        if isinstance(cause, BaseException):
            pending.append(cause)
        pending += [e.__cause__, e.__context__]
    return None


def _sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def write_manifest(folder: str | os.PathLike[str], step: int) -> None:
    """Write ``folder/manifest.json``: ``step`` and the size and SHA-256 of every file under ``folder``."""
    folder = Path(folder)
    files = {
        path.relative_to(folder).as_posix(): {"size": path.stat().st_size, "sha256": _sha256(path)}
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != MANIFEST
    }
    (folder / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1))


def verify(folder: str | os.PathLike[str]) -> int:
    """Check every file of the checkpoint ``folder`` against its manifest; return the checkpoint's step.

    Raises ``CheckpointError`` naming ``--load`` and the first file that is missing, of the wrong size or whose
    SHA-256 differs (a truncated shard, a corrupt ``loop_state.pt``, a damaged manifest).
    """
    folder = Path(folder)
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"--load: {str(folder)!r} has no {MANIFEST} (not a complete rlcore checkpoint)")
    try:
        manifest = json.loads(manifest_path.read_text())
        step, files = int(manifest["step"]), dict(manifest["files"])
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"--load: {str(manifest_path)!r} is unreadable ({type(err).__name__}: {err})") from err
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"--load: checkpoint file {str(path)!r} is missing")
        size = path.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(
                f"--load: checkpoint file {str(path)!r} is corrupt: {size} bytes, the manifest says {entry['size']}"
            )
        if _sha256(path) != entry["sha256"]:
            raise CheckpointError(
                f"--load: checkpoint file {str(path)!r} is corrupt: its SHA-256 differs from the manifest"
            )
    return step


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
        name = (path / LATEST).read_text().strip()
        if not name:
            problem = f"its {LATEST!r} file is empty (a save or a copy cut off while writing it)"
        elif "/" in name or not (path / name).is_dir():
            problem = f"its {LATEST!r} file names {name!r}, which is not a folder of it"
        elif missing := _missing(path / name):
            problem = f"{LATEST!r} names {name!r}, which has no {', '.join(missing)}"
        else:
            return path / name
        intact = newest_intact(path)
        raise FileNotFoundError(
            f"--load: {str(path)!r}: {problem}; "
            + (f"the newest intact checkpoint is {str(intact)!r}: --load it" if intact else "no intact checkpoint")
        )
    raise FileNotFoundError(f"--load: {str(path)!r} is neither a checkpoint folder nor a --save root with '{LATEST}'")


def newest_intact(root: str | os.PathLike[str]) -> Path | None:
    """The newest ``step_*`` folder under ``root`` whose files match its manifest, or None."""
    steps = sorted(
        (p for p in Path(root).glob("step_*") if p.is_dir() and p.name[5:].isdigit()),
        key=lambda p: int(p.name[5:]),
        reverse=True,
    )
    for folder in steps:
        if not _missing(folder):
            try:
                verify(folder)
            except CheckpointError:
                continue
            return folder
    return None


def _write_durably(path: Path, text: str) -> None:
    """Write ``path`` through a temporary file that is fsynced before it replaces ``path`` (and the folder after),
    so a crash leaves the old or the new content, never an empty file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(folder: str | os.PathLike[str]) -> None:
    """Make the entries of ``folder`` (a rename into it) durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def export_final(trainers: Any, folder: str | os.PathLike[str]) -> Path:
    """Write the HF export (``trainers.save_hf``) atomically: into ``.NAME.partial``, every file fsynced, then renamed
    to ``folder`` (an older export is moved aside first and removed after). A kill or a failure midway leaves no
    half-written ``folder``; a failure removes the partial folder and re-raises."""
    folder = Path(folder)
    partial, old = folder.with_name(f".{folder.name}.partial"), folder.with_name(f".{folder.name}.old")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        trainers.save_hf(str(partial))
        for path in partial.rglob("*"):
            if path.is_file():
                with open(path, "rb") as fh:
                    os.fsync(fh.fileno())
        fsync_dir(partial)
        shutil.rmtree(old, ignore_errors=True)
        if folder.exists():
            os.replace(folder, old)
        os.replace(partial, folder)
        fsync_dir(folder.parent)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return folder


def final_export_done(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` holds a finished :func:`export_final`: config and weights (the rename is its last act)."""
    folder = Path(folder)
    weights = any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))
    return (folder / "config.json").is_file() and weights


def is_job_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a complete rlcore checkpoint (a step folder, or a ``--save`` root with ``latest``)."""
    try:
        resolve(path)
    except FileNotFoundError:
        return False
    return True


def starts_fresh(load: str | os.PathLike[str]) -> bool:
    """Whether ``--load`` names a folder that does not exist or is empty: as in slime, the job then starts afresh
    (at step 0, from --hf-checkpoint or a torch_dist --ref-load), and its --save may be that folder."""
    path = Path(load)
    return not path.exists() or (path.is_dir() and not any(path.iterdir()))


def actor_start(
    *, backend: str, load: str | None, ref_load: str | None, ref_ckpt_step: int | None = None
) -> str | None:
    """The Megatron ``torch_dist`` checkpoint that the actor's weights start from, by slime's rule; None when they
    start from ``--hf-checkpoint`` (and a ``--load`` job checkpoint, if any, is restored over them).

    With ``--train-backend megatron``: ``load`` when it is a torch_dist checkpoint (its weights only: the optimizer,
    RNG and step start afresh, as slime's finetune); otherwise, when ``load`` holds no rlcore checkpoint (unset, or
    the ``--save`` folder of a first run), ``ref_load`` when it is one, at ``ref_ckpt_step`` when given (slime's
    ``--ref-ckpt-step``: then the step's folder is returned). ``ValueError`` naming the flag for a Megatron save root
    whose ``latest_checkpointed_iteration.txt`` (or step) names a missing folder."""
    if backend != "megatron" or (load is not None and is_job_checkpoint(load)):
        return None
    from runtime.train.backends.megatron_paths import find_checkpoint

    if load is not None and os.path.isdir(load) and find_checkpoint(load, flag="--load") is not None:
        return load
    if ref_load is not None and os.path.isdir(ref_load):
        folder = find_checkpoint(ref_load, step=ref_ckpt_step, flag="--ref-load")
        if folder is not None:
            return ref_load if ref_ckpt_step is None else str(folder)
    return None


def reference_path(*, ref_load: str, ref_ckpt_step: int | None, flag: str = "--ref-load") -> str:
    """The folder a frozen model (the reference, the OPD teacher: ``flag``) loads: ``ref_load``, or its Megatron
    ``iter_{ref_ckpt_step:07d}`` when given."""
    if ref_ckpt_step is None:
        return ref_load
    from runtime.train.backends.megatron_paths import find_checkpoint

    return str(find_checkpoint(ref_load, step=ref_ckpt_step, flag=flag))


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
