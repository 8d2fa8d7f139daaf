"""What a slime run script leaves implicit, made explicit: so that a script moves by changing its entry point.

Pure functions and tables, read by ``runtime.config`` (while a command line is resolved), ``runtime.hooks`` (slime's
module paths) and ``runtime.cli`` (``--dry-run`` says what was inferred):

- :func:`infer_train_backend`: slime's only training backend is Megatron, and its scripts never say so. A command line
  that sets Megatron-only flags, or whose ``--load`` / ``--ref-load`` holds a Megatron ``torch_dist`` checkpoint, runs
  ``--train-backend megatron``; any other, ``torch``. An explicit ``--train-backend`` always wins.
- :func:`train_iters`: slime's estimate of a job's optimizer steps, which sizes the LR schedule when
  ``--lr-decay-iters`` is unset, from ``--num-rollout`` or from ``--num-epoch`` and the dataset's size.
- :data:`SLIME_COUNTERPARTS` and :data:`SLIME_SETTINGS`: slime's module paths for hooks, and the runtime's function or
  the settings that stand for each; :func:`slime_path_problem` names a ``slime.*`` path that has neither.
- :data:`SFT_ROLLOUT_PATHS`: slime's SFT rollout (nothing is generated: the data is the dataset's conversations).
- :func:`transformer_engine_flags`: slime's script flags that need Transformer Engine, apex or flash-attn under
  Megatron-LM, and what rlcore does with each.

This module imports neither torch nor Ray (the front end stays fast).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# ---------------------------------------------------------------------------------------------- training backend

# Megatron-LM's save root names its newest step here; every torch_dist folder holds FORMAT_FILE naming its format
# (runtime.train.backends.megatron_checkpoint reads them with torch at hand; this check must not import it).
_TRACKER = "latest_checkpointed_iteration.txt"
_FORMAT_FILE = "metadata.json"


def holds_torch_dist(path: str | os.PathLike[str] | None) -> bool:
    """Whether ``path`` is a Megatron ``torch_dist`` checkpoint folder (``metadata.json`` naming that format) or a
    Megatron-LM save root (``latest_checkpointed_iteration.txt``). A path that does not exist is neither."""
    if path is None or not os.path.isdir(path):
        return False
    if os.path.isfile(os.path.join(path, _TRACKER)):
        return True
    try:
        with open(os.path.join(path, _FORMAT_FILE)) as fh:
            meta = json.load(fh)
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("sharded_backend") == "torch_dist"


def holds_megatron_job(path: str | os.PathLike[str] | None) -> bool:
    """Whether ``path`` is an rlcore job checkpoint (a step folder, or a ``--save`` root whose ``latest`` names one)
    that the Megatron backend saved: its trainers' folder is ``torch_dist`` (the torch backend's is
    torch.distributed.checkpoint's own layout, with no ``metadata.json``). A resume by ``--load`` alone then runs the
    backend that wrote it."""
    from runtime.cluster.checkpoint import TRAINER_DIR, is_job_checkpoint, resolve  # light: no torch

    if path is None or not is_job_checkpoint(path):
        return False
    return holds_torch_dist(resolve(path) / TRAINER_DIR)


@dataclass(frozen=True)
class BackendChoice:
    """The training backend a command line runs, and why (one line, printed by ``--dry-run``)."""

    name: str
    why: str


def infer_train_backend(
    *, given: str | None, megatron_flags: Sequence[str], checkpoints: Mapping[str, str | None]
) -> BackendChoice:
    """The training backend of a job, as a slime user expects it.

    ``given``: the ``--train-backend`` the user set (command line or YAML), None when unset. ``megatron_flags``: the
    Megatron-only flags the job sets (by name, in command-line order). ``checkpoints``: checkpoint flag -> path
    (``--load``, ``--ref-load``). An explicit choice wins; else Megatron-only flags, a ``torch_dist`` checkpoint or a
    job checkpoint the Megatron backend saved (a resume by ``--load`` alone) select ``megatron`` (slime's only
    backend); else ``torch``.
    """
    if given is not None:
        return BackendChoice(given, "--train-backend given")
    held = [f"{name} {path}" for name, path in checkpoints.items() if holds_torch_dist(path)]
    # A job checkpoint of the Megatron backend: the run resumed by --load alone, with no Megatron flag given again.
    resumed = [f"{name} {path}" for name, path in checkpoints.items() if holds_megatron_job(path)]
    reasons = []
    if megatron_flags:
        more = len(megatron_flags) - 4
        shown = ", ".join(megatron_flags[:4]) + (f" and {more} more" if more > 0 else "")
        reasons.append(f"Megatron-only flags are set ({shown})")
    if held:
        verb = "holds" if len(held) == 1 else "hold"
        reasons.append(f"{' and '.join(held)} {verb} a Megatron torch_dist checkpoint")
    if resumed:
        verb = "holds" if len(resumed) == 1 else "hold"
        reasons.append(f"{' and '.join(resumed)} {verb} a job checkpoint of the Megatron backend")
    if reasons:
        return BackendChoice("megatron", "inferred as slime runs: " + "; ".join(reasons))
    return BackendChoice("torch", "inferred: no Megatron-only flag and no torch_dist checkpoint (the default)")


def megatron_flags_set(cfg: Any, switches: Iterable[str] = ()) -> list[str]:
    """The Megatron-only flags ``cfg`` sets away from their defaults, and the Megatron ``switches`` given."""
    from runtime.config import TrainConfig, flag
    from runtime.train.backends import backend_options

    defaults = TrainConfig()
    fields = tuple(backend_options("megatron").OWN_FIELDS)  # the flags the Megatron backend declares its own
    return [flag(n) for n in fields if getattr(cfg.train, n) != getattr(defaults, n)] + list(switches)


def switches_in(argv: Iterable[str]) -> list[str]:
    """The accepted Megatron switches (bare flags of ``slime_flags.MEGATRON_FLAGS``) among ``argv``."""
    from runtime.slime_flags import MEGATRON_FLAGS

    return [arg for arg in argv if arg in MEGATRON_FLAGS and MEGATRON_FLAGS[arg].accepted]


def backend_choice(cfg: Any, *, given: str | None, switches: Iterable[str] = ()) -> BackendChoice:
    """:func:`infer_train_backend` for a resolved config (``given``: the backend set explicitly, if any)."""
    return infer_train_backend(
        given=given,
        megatron_flags=megatron_flags_set(cfg, switches),
        checkpoints={"--load": cfg.ckpt.load, "--ref-load": cfg.ckpt.ref_load},
    )


# ---------------------------------------------------------------------------------------------- the LR schedule


def train_iters(
    *, num_rollout: int, rollout_batch_size: int, n_samples_per_prompt: int, global_batch_size: int
) -> int:
    """slime's estimate of a job's optimizer steps (``num_rollout x rollout_batch_size x n_samples_per_prompt //
    global_batch_size``), which ``--lr-decay-iters`` defaults to (slime's megatron_utils/model.py); at least 1."""
    for name, value in (
        ("num_rollout", num_rollout),
        ("rollout_batch_size", rollout_batch_size),
        ("n_samples_per_prompt", n_samples_per_prompt),
        ("global_batch_size", global_batch_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"train_iters: {name} must be a positive int, got {value!r}")
    return max(1, num_rollout * rollout_batch_size * n_samples_per_prompt // global_batch_size)


def num_rollout_of_epochs(*, num_epoch: int, dataset_size: int, rollout_batch_size: int) -> int:
    """slime's ``--num-rollout`` from ``--num-epoch``: whole rollouts per pass over the dataset, times the passes
    (slime's RolloutManager.get_num_rollout_per_epoch)."""
    return dataset_size // rollout_batch_size * num_epoch


# ---------------------------------------------------------------------------------------------- slime's module paths

# slime's own hook paths that have a counterpart function here: a slime script that names them runs unchanged.
SLIME_COUNTERPARTS: dict[str, str] = {
    "slime.rollout.sft_rollout.generate_rollout": "runtime.rollout.sft:generate_rollout",
    "slime.rollout.sglang_rollout.generate_rollout": "runtime.rollout.plugins:builtin_rollout",
    "slime.rollout.data_source.RolloutDataSourceWithBuffer": "runtime.rollout.plugins:BufferedPromptSource",
    "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std": (
        "runtime.rollout.filters:check_reward_nonzero_std"
    ),
    "slime.rollout.forge_load.generate_rollout": "runtime.rollout.replay:forge_rollout",
    "slime.rollout.on_policy_distillation.reward_func": "runtime.rollout.opd:reward_func",
    "slime.rollout.on_policy_distillation.post_process_rewards": "runtime.rollout.opd:post_process_rewards",
}

# slime's hook paths whose counterpart here is a setting, not a function: (flag that names the path) -> path ->
# the settings (config field -> value) that stand for it. The path itself is dropped from the config.
SLIME_SETTINGS: dict[str, dict[str, dict[str, Any]]] = {
    "rollout_function_path": {
        # A background worker keeps generating across rollout boundaries, aborted groups go back to the buffer: the
        # fully-async schedule (slime/rollout/fully_async_rollout.py).
        "slime.rollout.fully_async_rollout.generate_rollout_fully_async": {"rollout_schedule": "fully_async"},
    },
}

# slime's SFT rollout by its path and ours: nothing is generated, so no engine and no response length are needed.
SFT_ROLLOUT_PATHS = (
    "slime.rollout.sft_rollout.generate_rollout",
    "runtime.rollout.sft:generate_rollout",
    "runtime.rollout.sft.generate_rollout",
)


def is_sft_job(cfg: Any) -> bool:
    """Whether ``cfg``'s rollouts are slime's SFT rollout: named by ``--rollout-function-path``, or run by
    ``--loss-type sft_loss`` with no rollout function of its own (runtime.rollout.plugins). Such a job generates
    nothing: it needs no ``--rollout-max-response-len``, and with ``--debug-train-only`` no engine at all."""
    path = cfg.rollout.rollout_function_path
    if path is not None and path.strip() in SFT_ROLLOUT_PATHS:
        return True
    default = ("slime.rollout.sglang_rollout.generate_rollout",)
    return (path is None or path.strip() in default) and cfg.algo.loss_type == "sft_loss"


def counterpart(path: str) -> str:
    """The runtime's function path standing for slime's ``path``; ``path`` itself when it is none of slime's."""
    return SLIME_COUNTERPARTS.get(path.strip(), path)


def slime_path_problem(path: str) -> str | None:
    """Why ``path`` (a hook path, already through :func:`counterpart`) cannot load: a module of slime's package with no
    counterpart here. None for any other path."""
    module = path.strip().split(":", 1)[0]
    if module != "slime" and not module.startswith("slime."):
        return None
    settings = (f"{p} (as --{field.replace('_', '-')})" for field, paths in SLIME_SETTINGS.items() for p in paths)
    known = sorted({*SLIME_COUNTERPARTS, *settings})
    return (
        "slime's module has no counterpart in rlcore (slime itself is not imported: its functions take slime's own "
        f"args and Sample); the slime paths that run here are {', '.join(known)}"
    )


def apply_slime_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` (config field -> value) with each slime path of :data:`SLIME_SETTINGS` replaced by the settings that
    stand for it (the settings win over the same fields set otherwise: slime's function runs so whatever the loop)."""
    out = dict(values)
    for field, table in SLIME_SETTINGS.items():
        path = out.get(field)
        if isinstance(path, str) and path.strip() in table:
            del out[field]
            out.update(table[path.strip()])
    return out


# ---------------------------------------------------------------------------------------------- Transformer Engine

# Under Megatron-LM these need Transformer Engine, apex or flash-attn. What rlcore does with each: the fused kernel's
# job done another way (accepted), or refused with the reason. Reasons that already live in a table are read from it.
_TE_ACCEPTED_OWN = {
    "--attention-backend flash": (
        "runs PyTorch's scaled_dot_product_attention (its flash kernel on GPUs) instead of Transformer Engine's flash "
        "attention: the same attention, another kernel"
    ),
    "--context-parallel-size 1": "no context parallelism, which is what Transformer Engine's attention would split",
}


@dataclass(frozen=True)
class EngineFlag:
    """A flag of slime's scripts that needs Transformer Engine (or apex, flash-attn) under Megatron-LM."""

    name: str
    accepted: bool
    reason: str


def transformer_engine_flags() -> list[EngineFlag]:
    """Every flag of slime's scripts that needs Transformer Engine, apex or flash-attn under Megatron-LM: those the
    tables of ``runtime.slime_flags`` and ``runtime.config`` give such a reason, and the values accepted here."""
    from runtime.config import MEGATRON_VALUES_BUILT
    from runtime.slime_flags import MEGATRON_FLAGS, SLIME_FLAGS

    def needs_te(reason: str) -> bool:
        return any(word in reason for word in ("Transformer Engine", "apex", "flash-attn"))

    out = [EngineFlag(name, e.accepted, e.reason) for name, e in MEGATRON_FLAGS.items() if needs_te(e.reason)]
    out += [EngineFlag(f.name, True, f.note) for f in SLIME_FLAGS if f.note and needs_te(f.note)]
    out += [EngineFlag(name, True, why) for name, why in _TE_ACCEPTED_OWN.items()]
    _, why = MEGATRON_VALUES_BUILT["attention_backend"]
    out.append(EngineFlag("--attention-backend fused", False, why))
    out.append(
        EngineFlag(
            "--context-parallel-size N>1",
            False,
            "context parallelism needs Transformer Engine's attention, which the local layer spec does not use",
        )
    )
    return sorted(out, key=lambda e: e.name)


def render_transformer_engine_flags() -> str:
    """The markdown list of :func:`transformer_engine_flags` that docs/runtime.md holds (one line each)."""
    return "\n".join(
        f"- `{e.name}`: {'accepted' if e.accepted else 'refused'}: {e.reason}" for e in transformer_engine_flags()
    )


def render_slime_paths() -> str:
    """The markdown table of slime's module paths and what runs for each, that docs/runtime.md holds."""
    rows = [f"| `{path}` | `{ours}` |" for path, ours in SLIME_COUNTERPARTS.items()]
    for field, table in SLIME_SETTINGS.items():
        for path, settings in table.items():
            shown = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in settings.items())
            rows.append(f"| `{path}` (`--{field.replace('_', '-')}`) | the setting `{shown}` |")
    return "\n".join(["| slime's path | what runs here |", "| --- | --- |", *rows])
