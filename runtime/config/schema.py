"""The job's settings: a frozen dataclass tree (one section per part of the job) whose field names are slime's
flag names, composed here from where each section is declared, with the rules that span sections and the field table
the flags and YAML keys are generated from.

Every section is declared beside the code that reads it: ``model`` in ``runtime.model_options``, ``data`` in
``runtime.rollout.data_options``, ``rollout`` in ``runtime.rollout.rollout_options`` (with the rollout's functions
and hooks from ``runtime.rollout.plugin_options``), ``algo`` in ``runtime.train.algo_options``, ``train`` in
``runtime.train.train_options``, ``resources`` in ``runtime.cluster.resource_options``, ``reward`` in
``runtime.rollout.reward_options``, ``eval`` in ``runtime.evaluation_options``, ``ckpt`` in
``runtime.cluster.checkpoint_options``, ``log`` in ``runtime.logger_options``, ``debug`` in
``runtime.debug_options``, ``sglang`` in ``runtime.engines.fleet_options`` and ``fault`` in
``runtime.fault_options``. The ``rollout``, ``train`` and ``sglang`` sections also inherit the plug-ins' own options
(:func:`_plugin_options`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime.cluster import weight_sync_options
from runtime.cluster.checkpoint_options import CheckpointConfig  # noqa: F401  (runtime.config's)
from runtime.cluster.resource_options import NVIDIA_GPUS_DIR, ResourceConfig  # noqa: F401  (runtime.config's)
from runtime.cluster.resource_options import local_gpus as _local_gpus  # noqa: F401  (runtime.config's)
from runtime.cluster.weight_sync_options import WEIGHT_SYNC_OPTIONS, WEIGHT_TRANSPORTS  # noqa: F401  (runtime.config's)
from runtime.debug_options import FORGE_ROLLOUT_PATHS, DebugConfig  # noqa: F401  (runtime.config's)
from runtime.engines.fleet_options import FleetOptions
from runtime.engines.registry import ROLLOUT_ENGINE_OPTIONS, engine_options
from runtime.evaluation_options import EvalConfig  # noqa: F401  (runtime.config's)
from runtime.fault_options import FaultConfig  # noqa: F401  (runtime.config's)
from runtime.logger_options import LogConfig  # noqa: F401  (runtime.config's)
from runtime.model_options import MODEL_SHAPE_FIELDS, ModelConfig  # noqa: F401  (runtime.config's)
from runtime.option_fields import described, flag, slime  # noqa: F401  (flag: runtime.config.flag)
from runtime.rollout.data_options import DataConfig  # noqa: F401  (runtime.config's)
from runtime.rollout.plugin_options import RolloutFunctionOptions
from runtime.rollout.reward_options import RM_TYPES, SLIME_RM_TYPES_NOT_BUILT, RewardConfig  # noqa: F401  (runtime.config's)
from runtime.rollout.rollout_options import (  # noqa: F401  (runtime.config's)
    ROLLOUT_ENGINE_NAMES,
    ROLLOUT_SCHEDULES,
    RolloutOptions,
    top_p_replay,
)
from runtime.rollout.schedule_options import SCHEDULE_OPTIONS
from runtime.train.algo_options import KL_COEF_IGNORED, AlgoConfig, teacher_from_samples  # noqa: F401  (runtime.config's)
from runtime.train.backends import TRAIN_BACKEND_OPTIONS, backend_options
from runtime.train.train_options import TRAIN_BACKEND_NAMES, TrainOptions  # noqa: F401  (runtime.config's)


class ConfigError(ValueError):
    """Inconsistent or invalid settings. ``problems`` lists each one; every message names its flags."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        # One problem is the whole message (``rlcore-run: <flag> ...: <what>``); several are listed.
        message = (
            self.problems[0]
            if len(self.problems) == 1
            else "invalid configuration:\n  - " + "\n  - ".join(self.problems)
        )
        super().__init__(message)


def _plugin_options(section: str) -> tuple[type, ...]:
    """The options dataclasses that the plug-ins (training backends, engines, rollout schedules, weight syncs)
    declare for ``section``: the section inherits their fields, so ``cfg.train.tensor_model_parallel_size`` is a field
    the Megatron backend declares. Every plug-in's fields are there; the chosen plug-in's are checked, another's
    refused when set (``runtime.config.checks``)."""
    modules = [backend_options(n) for n in TRAIN_BACKEND_OPTIONS] + [engine_options(n) for n in ROLLOUT_ENGINE_OPTIONS]
    modules += [*SCHEDULE_OPTIONS.values(), weight_sync_options, *WEIGHT_SYNC_OPTIONS.values()]
    return tuple(dict.fromkeys(m.OPTIONS[section] for m in modules if section in m.OPTIONS))


@dataclass(frozen=True)
class RolloutConfig(RolloutOptions, RolloutFunctionOptions, *_plugin_options("rollout")):
    """The ``rollout`` section: its core (``runtime.rollout.rollout_options``), the rollout functions and hooks
    (``runtime.rollout.plugin_options``) and the engines' and schedules' own options."""


@dataclass(frozen=True)
class TrainConfig(TrainOptions, *_plugin_options("train")):
    """The ``train`` section: its core (``runtime.train.train_options``) and the training backends' own options."""


@dataclass(frozen=True)
class SGLangConfig(FleetOptions, *_plugin_options("sglang")):
    """The engines' fleet: requests in flight and the offloads (``runtime.engines.fleet_options``), the SGLang
    engine's options (``runtime.engines.sglang_options``: servers, router, passthrough flags) and the weight syncs'
    (``runtime.cluster.weight_sync_options``)."""


@dataclass(frozen=True)
class Config:
    seed: int = field(
        default=1234,
        metadata=described(
            "seed of prompt shuffling, sampling and initialisation", slime=slime("megatron (reset by slime)", 1234)
        ),
    )
    output_dir: str = field(default="outputs/default", metadata=described("metrics, event files, plots, final model"))
    custom_config_path: str | None = field(
        default=None,
        metadata=described(
            "slime's YAML of settings that override the command line; keys that are no flag reach hooks as args.<key>",
            slime=slime(
                "megatron (reset by slime)",
                None,
                note="its keys override the command line; the ones that are no flag reach hooks as args.<key>",
            ),
        ),
    )
    custom_args: dict = field(
        default_factory=dict,
        metadata=described("ours: extra settings for hooks, read as args.<key> (the YAML's others)"),
    )
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    resources: ResourceConfig = field(default_factory=ResourceConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)

    def __getattr__(self, name: str) -> Any:
        # slime's hooks read a flat namespace (args.n_samples_per_prompt); leaf names are unique across sections,
        # so a flat read resolves to exactly one field. Only called when normal lookup fails.
        spec = _SPECS.get(name) if not name.startswith("_") else None
        if name in _SLIME_POSITIVE:
            # slime stores its --disable-* flags under the positive name (args.rewards_normalization).
            return _SLIME_POSITIVE[name](self)
        if spec is None or spec[0] is None:
            # A hook's own setting from --custom-config-path (slime sets any key of that YAML on args).
            extra = object.__getattribute__(self, "custom_args")
            if not name.startswith("_") and name in extra:
                return extra[name]
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(object.__getattribute__(self, spec[0]), name)

    @property
    def is_builtin_job(self) -> bool:
        """Whether this is the built-in demo job: no ``--hf-checkpoint`` and no ``--prompt-data``."""
        return self.model.hf_checkpoint is None and self.data.prompt_data is None


# slime's args that its --disable-* flags store into, as hooks read them.
_SLIME_POSITIVE: dict[str, Any] = {
    "rollout_global_dataset": lambda c: not c.data.disable_rollout_global_dataset,
    "compute_advantages_and_returns": lambda c: not c.algo.disable_compute_advantages_and_returns,
    "rewards_normalization": lambda c: not c.algo.disable_rewards_normalization,
    "grpo_std_normalization": lambda c: not c.algo.disable_grpo_std_normalization,
}

_CONFIG_HINTS = typing.get_type_hints(Config)
SECTIONS: dict[str, type] = {name: tp for name, tp in _CONFIG_HINTS.items() if dataclasses.is_dataclass(tp)}
_TOP_LEVEL = tuple(f.name for f in dataclasses.fields(Config) if f.name not in SECTIONS)


# The built-in demo job's tuned values (no --hf-checkpoint, no --prompt-data). They fill only the settings the user
# did not give (flag or YAML key); every other job gets the flag defaults above, which follow slime's.
BUILTIN_JOB_DEFAULTS: dict[str, Any] = {
    "rollout_max_response_len": 8,
    "lr": 1e-3,
    "use_kl_loss": True,
    "kl_loss_type": "low_var_kl",
    "rollout_shuffle": True,
    "rollout_batch_size": 32,
    "n_samples_per_prompt": 8,
    "num_rollout": 250,
    "micro_batch_size": 8,
    "actor_num_gpus_per_node": 1,
    "calculate_per_token_loss": True,
    "use_tensorboard": True,
    "rollout_skip_special_tokens": True,
    # Under --lora-rank: the random-init model's logits are bounded by its frozen tied embedding (rows of norm 0.18
    # under an RMSNorm of gain 1 cap a token's probability near 0.2), so adapters alone cannot make it confident:
    # the embedding (and with it the tied LM head) trains in full beside them.
    "lora_modules_to_save": "embed_tokens",
}


def _field_specs() -> dict[str, tuple[str | None, dataclasses.Field, Any]]:
    """Every leaf field by name: (section or None for top level, the Field, its resolved type)."""
    specs: dict[str, tuple[str | None, dataclasses.Field, Any]] = {}
    for f in dataclasses.fields(Config):
        if f.name in SECTIONS:
            cls = SECTIONS[f.name]
            hints = typing.get_type_hints(cls)
            for sub in dataclasses.fields(cls):
                if sub.name in specs:
                    raise RuntimeError(f"field {sub.name} appears in two config sections")
                specs[sub.name] = (f.name, sub, hints[sub.name])
        else:
            specs[f.name] = (None, f, _CONFIG_HINTS[f.name])
    return specs


_SPECS = _field_specs()


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False
