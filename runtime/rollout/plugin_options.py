"""The rollout's functions and hooks (slime's ``--custom-generate-function-path``, ``--rollout-function-path``,
the sample hooks and filters, the rollout log functions), declared beside the code that loads and calls them
(:mod:`runtime.rollout.plugins`, :mod:`runtime.rollout.filters`, :mod:`runtime.rollout.generation`). Torch-free:
``runtime.config`` composes :class:`RolloutFunctionOptions` into its ``rollout`` section
(``cfg.rollout.custom_generate_function_path``), and validation resolves every hook before anything starts."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.option_fields import hook, slime


@dataclass(frozen=True)
class RolloutFunctionOptions:
    """The functions that replace or extend parts of the built-in rollout, as ``module:function`` paths."""

    custom_generate_function_path: str | None = field(
        default=None,
        metadata=hook(
            "async def generate(args, sample, sampling_params[, evaluation]) -> Sample | list[Sample], as "
            "module:function",
            slime=slime("rollout", None, note="engines through runtime.rollout.engine_generate"),
        ),
    )
    rollout_function_path: str | None = field(
        default=None,
        metadata=hook(
            "the whole rollout, generate_rollout(args, rollout_id, data_source, evaluation=False) -> "
            "RolloutFnTrainOutput | list[list[Sample]]; unset: the built-in rollout",
            slime=slime(
                "rollout",
                "slime.rollout.sglang_rollout.generate_rollout",
                differs="unset: the built-in "
                "rollout (slime's default path is accepted and means it); --fully-async refused",
            ),
        ),
    )
    eval_function_path: str | None = field(
        default=None,
        metadata=hook(
            "evaluation rollout, called with evaluation=True -> RolloutFnEvalOutput; unset: --rollout-function-path "
            "when set, else the built-in evaluation",
            slime=slime("eval", None, note="unset: the rollout function when one is given"),
        ),
    )
    rollout_sample_hook_path: list[str] = field(
        default_factory=list,
        metadata={
            **hook("(repeatable) [async] hook(args, sample, *, rollout_id, evaluation) -> Sample | None"),
            "append": True,
            "slime": slime("rollout", []),
        },
    )
    buffer_filter_path: str | None = field(
        default=None,
        metadata=hook(
            "fn(args, rollout_id, buffer, num_samples) -> list[list[Sample]]: groups taken back",
            slime=slime("rollout", None, note="the default data source's buffer (rollout functions)"),
        ),
    )
    rollout_sample_filter_path: str | None = field(
        default=None,
        metadata=hook(
            "fn(args, data: list[list[Sample]]) -> None; sets sample.remove_sample",
            slime=slime("rollout_buffer", None),
        ),
    )
    rollout_all_samples_process_path: str | None = field(
        default=None,
        metadata=hook(
            "fn(args, all_samples: list[list[Sample]], data_source) -> None, filtered groups too",
            slime=slime("rollout_buffer", None, note="built-in rollout; not with --fully-async"),
        ),
    )
    rollout_data_postprocess_path: str | None = field(
        default=None,
        metadata=hook(
            "fn(args, rollout_id, rollout_data: dict) -> None, after log-probs and advantages",
            slime=slime("rollout", None, note="on every trainer rank, over its shard"),
        ),
    )
    custom_rollout_log_function_path: str | None = field(
        default=None,
        metadata=hook(
            "fn(rollout_id, args, samples, extra_metrics, rollout_time) -> bool (True: skip ours)",
            slime=slime("rollout", None),
        ),
    )
    custom_eval_rollout_log_function_path: str | None = field(
        default=None,
        metadata=hook(
            "fn(rollout_id, args, data, extra_metrics) -> bool (True: skip ours)", slime=slime("rollout", None)
        ),
    )
    dynamic_sampling_filter_path: str | None = field(
        default=None,
        metadata=hook(
            "filter fn(args, samples) -> DynamicFilterOutput applied to each prompt's group",
            slime=slime("rollout", None),
        ),
    )
