"""The weight syncs' own options and rules (``--update-weight-transport``,
:data:`runtime.cluster.weight_sync.WEIGHT_SYNCS`), beside them: torch-free, so the config checks a job before anything
starts.

Every weight sync reads :class:`WeightSyncOptions` (composed into the config's ``rollout`` section:
``cfg.rollout.update_weight_buffer_size``) and :class:`WeightTransportOptions` (the ``sglang`` section:
``cfg.sglang.update_weight_transport``). A transport with settings of its own declares them in a dataclass here
(:class:`DiskSyncOptions`, ``disk``'s) and its entry in :data:`WEIGHT_SYNC_OPTIONS`: ``runtime.config`` composes it
into its section, refuses its flags under another ``--update-weight-transport``, and runs the chosen transport's
``check``. Unset, the transport is derived when the job starts (the engine kind's default:
``runtime.engines.registry``); a transport's settings are refused then unless the derivation can pick it
(:func:`derived_transports`). (``ipc``'s need of ``--colocate`` is with
the other colocate rules, on the composed config: ``runtime.config.checks``; an SGLang engine's limit on ``ipc`` is
in ``runtime.engines.sglang_options``.)"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, Literal

from runtime.engines.registry import ROLLOUT_ENGINES
from runtime.option_fields import bounded, described, hook, own_fields, slime


@dataclass(frozen=True)
class WeightSyncOptions:
    """Every weight sync's schedule and bucket size (the ``rollout`` section)."""

    update_weights_interval: int = field(
        default=1, metadata=bounded(gt=0, help="sync weights to the engines every N steps", slime=slime("rollout", 1))
    )
    update_weight_buffer_size: int = field(
        default=512 * 1024**2,
        metadata=bounded(gt=0, help="bytes per bucket of a weight sync", slime=slime("rollout", 536870912)),
    )


@dataclass(frozen=True)
class WeightTransportOptions:
    """The transport, and the check after the first sync (the ``sglang`` section)."""

    update_weight_transport: Literal[WEIGHT_TRANSPORTS] | None = field(
        default=None,
        metadata=described(
            "how weights reach the engines: nccl (a torch.distributed broadcast in buckets; gloo on the CPU), disk "
            "(safetensors) or ipc (colocated engines load buckets as handles to the trainer's memory: CUDA IPC, "
            "shared memory on the CPU), lora_adapter (--lora-rank with SGLang: the adapters as a peft folder, loaded "
            "with /load_lora_adapter; the launcher adds --enable-lora); unset: ipc under --colocate (disk where ipc "
            "is not built: SGLang engines of several GPUs, several Megatron processes), else nccl on GPUs (from "
            "the trainer's GPU memory, the next bucket packed while one is in flight) and for SGLang, and Ray's "
            "object store for the embedded engine on the CPU",
            slime=slime(
                "train", "nccl", differs="unset: nccl for SGLang engines, the object store for the embedded engine"
            ),
        ),
    )
    check_weight_update_equal: bool = field(
        default=False,
        metadata=described(
            "after the first weight sync, compare every engine's weights with the trainer's",
            slime=slime("debug", False),
        ),
    )


@dataclass(frozen=True)
class DiskSyncOptions:
    """The disk sync's settings (slime's ``--update-weight-disk-*`` and its post-write hook)."""

    OWN = "a setting of the disk weight sync"

    update_weight_disk_dir: str | None = field(
        default=None,
        metadata=described(
            "where --update-weight-transport disk writes one HF folder per sync (weight_v<version, 6 digits>), on a "
            "file system the engines read; unset: a temporary folder (slime needs it given)",
            slime=slime(
                "train",
                None,
                differs="unset with --update-weight-transport disk: a temporary folder (slime refuses the job)",
            ),
        ),
    )
    update_weight_disk_keep_files: bool = field(
        default=False,
        metadata=described(
            "keep every folder a disk sync writes (by default each is deleted once the engines loaded it)",
            slime=slime("train", False),
        ),
    )
    custom_update_weight_post_write_path: str | None = field(
        default=None,
        metadata=hook(
            "fn(args, version_dir, rollout_engines) -> None, after a disk sync's folder is written and before the "
            "engines read it (to publish it on a file system without cross-host visibility); rollout_engines are "
            "the engine actors",
            slime=slime(
                "train",
                None,
                differs="called once, in the driver, after trainer rank 0 (rlcore's only "
                "writer) wrote the folder; slime calls it on every trainer rank",
            ),
        ),
    )


def _check_lora_adapter(problems: list[str], cfg: Any) -> None:
    """The adapters reach SGLang engines alone: a LoRA job, nothing but the adapters trained, nothing to compare."""
    s, t = cfg.sglang, cfg.train
    if t.lora_rank == 0 or cfg.rollout.rollout_engine != "sglang":
        problems.append(
            "--update-weight-transport lora_adapter pushes LoRA adapters to SGLang engines: it needs --lora-rank "
            "and --rollout-engine sglang"
        )
    if t.lora_modules_to_save:
        problems.append(
            "--update-weight-transport lora_adapter sends the adapters only: --lora-modules-to-save "
            f"{t.lora_modules_to_save!r} trains whole modules too (drop it, or push merged weights)"
        )
    if s.check_weight_update_equal:
        problems.append(
            "--check-weight-update-equal compares the engines' weights with the trainer's merged ones; under "
            "--update-weight-transport lora_adapter the engines keep the base weights and hold the adapter apart"
        )


def _check_ipc(problems: list[str], cfg: Any) -> None:
    """A backend that sends from rank 0 alone (its options' ``WEIGHTS_FROM_RANK0``: the Megatron backend's): ipc
    reaches one colocated engine from one trainer process."""
    from runtime.train.backends import backend_options

    backend = cfg.train.train_backend
    if getattr(backend_options(backend), "WEIGHTS_FROM_RANK0", False) and cfg.resources.num_trainer_procs > 1:
        problems.append(
            f"--update-weight-transport ipc reaches one engine from the {backend.capitalize()} backend (its rank 0 "
            "alone sends): with more than one trainer process give nccl or disk (unset under --colocate: disk)"
        )


def _transport(options: tuple[type, ...] = (), check: Any = None) -> types.SimpleNamespace:
    """A transport's options, shaped as a plug-in's options module (``OPTIONS``, ``OWN_FIELDS``, ``check``)."""
    return types.SimpleNamespace(
        OPTIONS={"sglang": options[0]} if options else {}, OWN_FIELDS=own_fields(*options), check=check
    )


# Each --update-weight-transport's options (the names are WEIGHT_TRANSPORTS; the syncs are
# runtime.cluster.weight_sync.WEIGHT_SYNCS').
WEIGHT_SYNC_OPTIONS: dict[str, types.SimpleNamespace] = {
    "nccl": _transport(),
    "disk": _transport((DiskSyncOptions,)),
    "ipc": _transport(check=_check_ipc),
    "lora_adapter": _transport(check=_check_lora_adapter),
}
# --update-weight-transport's choices (slime's): the registry's names. Unset, the engine kind's own default
# (runtime.engines.registry); Ray's object store (``object_store``) is no choice of the flag: the embedded engine's
# default on the CPU. (WeightTransportOptions' annotation names it; annotations are read once the module is loaded.)
WEIGHT_TRANSPORTS = tuple(WEIGHT_SYNC_OPTIONS)
# The settings every weight sync reads, by config section.
OPTIONS: dict[str, type] = {"rollout": WeightSyncOptions, "sglang": WeightTransportOptions}


def weight_sync_options(name: str) -> types.SimpleNamespace:
    """The options of ``--update-weight-transport name`` (see :data:`WEIGHT_SYNC_OPTIONS`)."""
    return WEIGHT_SYNC_OPTIONS[name]


def syncs_weights(cfg: Any) -> bool:
    """Whether the job runs a weight sync at all: a debug mode that runs one side only (``--debug-train-only``, which
    ``--load-debug-rollout-data`` and slime's SFT imply: no engines; ``--debug-rollout-only``: no trainers) gets
    ``runtime.cluster.weight_sync.NoSync`` whatever the transport, so no transport reads a sync's settings there."""
    return not (cfg.debug.train_only or cfg.debug.debug_rollout_only)


def derived_transports(cfg: Any) -> tuple[str, ...]:
    """The transports the job gets with ``--update-weight-transport`` unset: its engine kind's default
    (``EngineKind.weight_sync``), on GPUs and on the CPU (the config does not know which the job will run on)."""
    kind = ROLLOUT_ENGINES[cfg.rollout.rollout_engine]
    return tuple(dict.fromkeys(kind.weight_sync(cfg, use_gpu) for use_gpu in (True, False)))
