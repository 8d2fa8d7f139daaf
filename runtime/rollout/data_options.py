"""The ``data`` section of the config: the prompt dataset, its keys and templates (slime's data flags), read by
:mod:`runtime.rollout.data`. Torch-free: ``runtime.config`` composes :class:`DataConfig` into
:class:`~runtime.config.Config` and checks it before anything starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from runtime.option_fields import bounded, described, hook, slime


@dataclass(frozen=True)
class DataConfig:
    prompt_data: str | None = field(
        default=None,
        metadata=described(
            "prompt file, .jsonl or .parquet; unset: the built-in task",
            slime=slime("data", None, note="unset: the built-in task"),
        ),
    )
    input_key: str = field(
        default="input",
        metadata=described("key of the prompt (a string or a chat message list)", slime=slime("data", "input")),
    )
    label_key: str | None = field(
        default=None,
        metadata=described(
            "key of the label the reward compares against; unset: rows carry no label", slime=slime("data", None)
        ),
    )
    metadata_key: str = field(
        default="metadata",
        metadata=described("key of a per-row metadata dict (optional in rows)", slime=slime("data", "metadata")),
    )
    tool_key: str = field(
        default="tools",
        metadata=described(
            "key of a row's tool list, passed to the chat template (when present)", slime=slime("data", "tools")
        ),
    )
    apply_chat_template: bool = field(
        default=False, metadata=described("render prompts with the chat template", slime=slime("data", False))
    )
    apply_chat_template_kwargs: dict = field(
        default_factory=dict,
        metadata=described("JSON object of keyword arguments for the chat template", slime=slime("data", {})),
    )
    rollout_max_prompt_len: int | None = field(
        default=None,
        metadata=bounded(
            gt=0,
            help="drop (and count) prompts longer than this many tokens (unset: --rollout-max-context-len - 1)",
            slime=slime("rollout", None),
        ),
    )
    rollout_max_context_len: int | None = field(
        default=None,
        metadata=bounded(
            gt=0,
            help="the engines' context; sets --rollout-max-prompt-len's default to this - 1",
            slime=slime(
                "rollout",
                None,
                note="as in slime: sets --rollout-max-prompt-len's default (context - 1) and checks it",
            ),
        ),
    )
    rollout_shuffle: bool = field(
        default=False,
        metadata=described(
            "reshuffle the prompts every epoch (seeded by --rollout-seed)",
            slime=slime("rollout", False, note="built-in job: on"),
        ),
    )
    rollout_seed: int = field(
        default=42,
        metadata=described(
            "seed of the prompt order of --prompt-data",
            slime=slime("rollout", 42, note="the built-in task's prompts are drawn and shuffled from --seed"),
        ),
    )
    balance_data: bool = field(
        default=False,
        metadata=described(
            "balance each optimizer step's tokens over the trainer ranks (rows reordered)",
            slime=slime("data", False, differs="greedy within each optimizer step (slime: Karmarkar-Karp)"),
        ),
    )
    on_bad_row: Literal["fail", "skip"] = field(
        default="fail", metadata=described("a malformed row stops the job (fail) or is skipped and counted (skip)")
    )
    allow_prompt_data_change: bool = field(
        default=False,
        metadata=described(
            "ours: --load a checkpoint although the prompt data's rows changed since it was saved (same row count; "
            "without it the resume stops naming the file)"
        ),
    )
    data_source_path: str | None = field(
        default=None,
        metadata=hook(
            "class cls(args) with get_samples(n) -> list[list[Sample]], add_samples, save(rollout_id), "
            "load(rollout_id), __len__; unset: the prompt data with a buffer (slime's RolloutDataSourceWithBuffer)",
            slime=slime(
                "data",
                "slime.rollout.data_source.RolloutDataSourceWithBuffer",
                differs="unset: the prompt data with a buffer (slime's default path is accepted and means it)",
            ),
        ),
    )
    disable_rollout_global_dataset: bool = field(
        default=False,
        metadata=described(
            "the default data source holds no prompt data, only the groups put back with add_samples (a "
            "--rollout-function-path makes its own prompts); hooks read args.rollout_global_dataset",
            slime=slime("data", False),
        ),
    )
