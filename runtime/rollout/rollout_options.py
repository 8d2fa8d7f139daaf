"""The core of the ``rollout`` section of the config: prompts and samples per step, sampling, how many steps, and
which engine and schedule run them (slime's rollout and data flags), read by the rollout source and the loop
(``runtime.rollout``, ``runtime.loop``). Torch-free: ``runtime.config`` composes :class:`RolloutOptions` with the
rollout functions' options (``runtime.rollout.plugin_options``) and the plug-ins' (engines, schedules) into
:class:`~runtime.config.RolloutConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from runtime.engines.registry import ROLLOUT_ENGINES
from runtime.option_fields import bounded, described, slime
from runtime.rollout.schedule_options import SCHEDULE_OPTIONS

# Choices that registries define: the flags take exactly their names.
ROLLOUT_ENGINE_NAMES = tuple(ROLLOUT_ENGINES)
ROLLOUT_SCHEDULES = tuple(SCHEDULE_OPTIONS)


@dataclass(frozen=True)
class RolloutOptions:
    rollout_batch_size: int | None = field(
        default=None,
        metadata=bounded(
            gt=0,
            help="prompts per rollout step (required)",
            slime=slime("data", None, note="required, as in slime; built-in job: 32"),
        ),
    )
    n_samples_per_prompt: int = field(
        default=1,
        metadata=bounded(
            gt=0,
            help="responses sampled per prompt (the group size)",
            slime=slime("data", 1, note="built-in job: 8; 1 is refused with a group baseline (by design)"),
        ),
    )
    rollout_max_response_len: int | None = field(
        default=None,
        metadata=bounded(
            gt=0,
            help="max new tokens per response; no default (as in slime): set it for your model",
            slime=slime("rollout", None, note="built-in job: 8"),
        ),
    )
    rollout_temperature: float = field(
        default=1.0, metadata=bounded(gt=0, help="sampling temperature", slime=slime("rollout", 1.0))
    )
    rollout_top_p: float = field(
        default=1.0,
        metadata=bounded(
            gt=0,
            le=1,
            help="nucleus sampling threshold, in (0, 1]",
            slime=slime(
                "rollout",
                1.0,
                note="below 1: nucleus replay (embedded engine, torch backend); "
                "--no-rollout-top-p-replay (ours) opts out",
            ),
        ),
    )
    rollout_top_k: int = field(default=-1, metadata=described("top-k sampling; -1 is off", slime=slime("rollout", -1)))
    rollout_top_p_replay: bool = field(
        default=True,
        metadata=described(
            "with --rollout-top-p below 1, take rollout and training log-probs over each token's sampled nucleus, "
            "as slime (ours: --no-rollout-top-p-replay keeps the untruncated log-probs)"
        ),
    )
    rollout_skip_special_tokens: bool = field(
        default=False,
        metadata=described(
            "leave special tokens (e.g. <|im_end|>) out of the response text",
            slime=slime("rollout", False, note="built-in job: on"),
        ),
    )
    rollout_stop: list[str] | None = field(
        default=None,
        metadata=described(
            "stop strings: a response ends at the first token after which its text holds one (kept)",
            slime=slime("rollout", None),
        ),
    )
    rollout_stop_token_ids: list[int] | None = field(
        default=None,
        metadata=described("token ids that end a response, besides the model's eos ids", slime=slime("rollout", None)),
    )
    num_rollout: int | None = field(
        default=None,
        metadata=bounded(
            gt=0,
            help="number of rollout (and training) steps; unset: from --num-epoch",
            slime=slime("data", None, note="built-in job: 250; unset: from --num-epoch"),
        ),
    )
    num_epoch: int | None = field(
        default=None,
        metadata=bounded(
            gt=0,
            help="passes over --prompt-data when --num-rollout is unset (whole rollouts per epoch)",
            slime=slime("data", None),
        ),
    )
    over_sampling_batch_size: int | None = field(
        default=None,
        metadata=bounded(
            gt=0,
            help="prompts generated per sampling round when filtering; >= --rollout-batch-size",
            slime=slime("rollout", None, differs="rounds run in order (not first-completed)"),
        ),
    )
    rollout_engine: Literal[ROLLOUT_ENGINE_NAMES] = field(
        default="hf",
        metadata=described("rollout engine: embedded transformers (hf) or running SGLang servers (sglang)"),
    )
    rollout_schedule: Literal[ROLLOUT_SCHEDULES] = field(
        default="sync",
        metadata=described(
            "ours: sync, one_step (rollout k+1 generated while step k trains, slime's train_async.py; --async) or "
            "fully_async (groups in flight across steps under --max-staleness; --fully-async)"
        ),
    )


def top_p_replay(cfg: Any) -> bool:
    """Whether the job replays the rollout's top-p nucleus in training (slime's rule: ``--rollout-top-p`` below 1;
    ``--no-rollout-top-p-replay`` is ours). ``cfg``: a ``runtime.config.Config``."""
    return cfg.rollout.rollout_top_p < 1 and cfg.rollout.rollout_top_p_replay
