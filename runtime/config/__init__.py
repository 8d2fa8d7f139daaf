"""The job's configuration: a frozen dataclass tree whose field names are slime's flag names.

A field ``rollout_batch_size`` is the flag ``--rollout-batch-size``; booleans take ``--flag`` / ``--no-flag``.
``parse_args`` reads an optional YAML file (``--config``; nested by section as ``to_dict`` writes it, or flat
as slime's ``--custom-config-path`` files are), lets flags override it, and validates the result: settings that
cannot work together raise ``ConfigError`` naming the flags, before anything starts.

On a CPU-only machine the ``*_gpus*`` fields count processes (CPU slots): ``--actor-num-gpus-per-node 2`` runs
two trainer processes, ``--rollout-num-gpus 1`` one embedded engine.

The package by responsibility: :mod:`.schema` (the sections composed into ``Config``, each declared beside the code
that reads it, with the plug-ins' options), :mod:`.typecheck` (types and bounds, by pydantic),
:mod:`.resolve` (a ``Config`` from settings), :mod:`.evalsets`, :mod:`.yaml_io`, :mod:`.checks` (``validate``) and
:mod:`.argv` (the command line). Every name is importable from ``runtime.config``.
"""

from __future__ import annotations

from runtime.config.argv import (  # noqa: F401
    SCHEDULE_SHORTHANDS,
    build_parser,
    negated,
    parse_args,
    resolve_args,
)
from runtime.config.checks import (  # noqa: F401
    CORE_RANGES,
    validate,
)
from runtime.config.evalsets import (  # noqa: F401
    EvalDataset,
    eval_datasets,
    resolve_eval_dataset,
)
from runtime.config.resolve import (  # noqa: F401
    from_dict,
)
from runtime.config.schema import (  # noqa: F401
    _SPECS,
    BUILTIN_JOB_DEFAULTS,
    FORGE_ROLLOUT_PATHS,
    KL_COEF_IGNORED,
    MODEL_SHAPE_FIELDS,
    NVIDIA_GPUS_DIR,
    RM_TYPES,
    ROLLOUT_ENGINE_NAMES,
    ROLLOUT_SCHEDULES,
    SECTIONS,
    SLIME_RM_TYPES_NOT_BUILT,
    TRAIN_BACKEND_NAMES,
    WEIGHT_TRANSPORTS,
    AlgoConfig,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    DebugConfig,
    EvalConfig,
    FaultConfig,
    LogConfig,
    ModelConfig,
    ResourceConfig,
    RewardConfig,
    RolloutConfig,
    SGLangConfig,
    TrainConfig,
    _local_gpus,
    _unwrap_optional,
    flag,
    teacher_from_samples,
    top_p_replay,
)
from runtime.config.yaml_io import (  # noqa: F401
    _tree_value,
    dump_yaml,
    format_config,
    load_yaml,
    megatron_role_overrides,
    read_yaml_tree,
    to_dict,
)
from runtime.train.backends.megatron_options import MEGATRON_ATTENTION_BACKENDS, MEGATRON_VALUES_BUILT  # noqa: F401
