"""The ``eval`` section of the config: the evaluation sets, their interval and sampling (slime's eval flags),
read by :mod:`runtime.evaluation` (the sets resolved by ``runtime.config.evalsets``). Torch-free:
``runtime.config`` composes :class:`EvalConfig` into :class:`~runtime.config.Config` and checks it before
anything starts."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.option_fields import bounded, described, slime


@dataclass(frozen=True)
class EvalConfig:
    eval_interval: int | None = field(
        default=None,
        metadata=bounded(gt=0, help="evaluate every this many steps", slime=slime("megatron (reset by slime)", None)),
    )
    eval_prompt_data: list[str] | None = field(
        default=None,
        metadata=described(
            "evaluation datasets as name/path pairs (aime /data/aime.jsonl ...), or one path (named after its file)",
            slime=slime("eval", None, note="name/path pairs; one bare path is named aime, as in slime"),
        ),
    )
    eval_config: str | None = field(
        default=None,
        metadata=described(
            "YAML of evaluation datasets with per-dataset settings (slime's layout); wins over --eval-prompt-data",
            slime=slime(
                "eval",
                None,
                differs="read with PyYAML (no OmegaConf interpolation); per-dataset keys "
                "beyond rlcore-run's are refused by name",
            ),
        ),
    )
    skip_eval_before_train: bool = field(
        default=False,
        metadata=described("with --eval-interval, do not evaluate before the first step", slime=slime("eval", False)),
    )
    n_samples_per_eval_prompt: int = field(
        default=1, metadata=bounded(gt=0, help="responses per evaluation prompt", slime=slime("eval", 1))
    )
    eval_input_key: str | None = field(
        default=None, metadata=described("--input-key of the evaluation data", slime=slime("eval", None))
    )
    eval_label_key: str | None = field(
        default=None, metadata=described("--label-key of the evaluation data", slime=slime("eval", None))
    )
    eval_tool_key: str | None = field(
        default=None, metadata=described("--tool-key of the evaluation data", slime=slime("eval", None))
    )
    eval_temperature: float | None = field(
        default=None,
        metadata=bounded(gt=0, help="evaluation temperature (unset: rollout's)", slime=slime("eval", None)),
    )
    eval_top_p: float | None = field(
        default=None,
        metadata=bounded(gt=0, le=1, help="evaluation top-p (unset: rollout's)", slime=slime("eval", None)),
    )
    eval_top_k: int | None = field(
        default=None, metadata=described("evaluation top-k (unset: rollout's)", slime=slime("eval", None))
    )
    eval_max_response_len: int | None = field(
        default=None,
        metadata=bounded(
            gt=0, help="evaluation max new tokens (unset: --rollout-max-response-len)", slime=slime("eval", None)
        ),
    )
    eval_max_context_len: int | None = field(
        default=None,
        metadata=bounded(
            gt=0,
            help="evaluation context (unset: --rollout-max-context-len); as in slime, recorded only",
            slime=slime("eval", None, note="as in slime: recorded, defaulting to --rollout-max-context-len"),
        ),
    )
    eval_max_prompt_len: int | None = field(
        default=None,
        metadata=bounded(
            gt=0,
            help="drop evaluation prompts longer than this (unset: --rollout-max-prompt-len)",
            slime=slime("eval", None),
        ),
    )
    eval_min_new_tokens: int | None = field(
        default=None,
        metadata=bounded(
            ge=0,
            help="evaluation responses get at least this many tokens (eos and stop ids held off)",
            slime=slime("eval", None),
        ),
    )
