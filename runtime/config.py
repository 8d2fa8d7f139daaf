"""The job's configuration: a frozen dataclass tree whose field names are slime's flag names.

A field ``rollout_batch_size`` is the flag ``--rollout-batch-size``; booleans take ``--flag`` / ``--no-flag``.
``parse_args`` reads an optional YAML file (``--config``; nested by section as ``to_dict`` writes it, or flat
as slime's ``--custom-config-path`` files are), lets flags override it, and validates the result: settings that
cannot work together raise ``ConfigError`` naming the flags, before anything starts.

On a CPU-only machine the ``*_gpus*`` fields count processes (CPU slots): ``--actor-num-gpus-per-node 2`` runs
two trainer processes, ``--rollout-num-gpus 1`` one embedded engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from runtime.engines import sglang_flags
from runtime.engines.registry import ROLLOUT_ENGINES
from runtime.hooks import HookError, check_function_path
from runtime.train.backends import TRAIN_BACKENDS

# Choices that registries define: the flags take exactly their names.
TRAIN_BACKEND_NAMES = tuple(TRAIN_BACKENDS)
ROLLOUT_ENGINE_NAMES = tuple(ROLLOUT_ENGINES)
ROLLOUT_SCHEDULES = ("sync", "one_step", "fully_async")
# --update-weight-transport (slime's choices); unset, the engine kind's own default (runtime.engines.registry).
WEIGHT_TRANSPORTS = ("nccl", "disk")

# Estimators whose baseline is the other samples of the prompt's group: a group of one has no baseline.
GROUP_BASELINE_ESTIMATORS = ("grpo", "dr_grpo", "gspo", "rloo", "reinforce_plus_plus_baseline")
# slime's estimator names where rlcore.advantages names them differently.
_CORE_ESTIMATOR_NAMES = {"ppo": "gae", "on_policy_distillation": "distillation"}


class ConfigError(ValueError):
    """Inconsistent or invalid settings. ``problems`` lists each one; every message names its flags."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("invalid configuration:\n  - " + "\n  - ".join(self.problems))


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class ModelConfig:
    hf_checkpoint: str | None = field(
        default=None,
        metadata=_help("HF model directory (config, weights, tokenizer); unset: build the tiny default model"),
    )


@dataclass(frozen=True)
class DataConfig:
    prompt_data: str | None = field(
        default=None, metadata=_help("prompt file, .jsonl or .parquet; unset: the built-in task")
    )
    input_key: str = field(default="prompt", metadata=_help("key of the prompt (a string or a chat message list)"))
    label_key: str = field(default="label", metadata=_help("key of the label the reward compares against"))
    metadata_key: str = field(default="metadata", metadata=_help("key of a per-row metadata dict (optional in rows)"))
    apply_chat_template: bool = field(default=False, metadata=_help("render prompts with the chat template"))
    rollout_max_prompt_len: int | None = field(
        default=None, metadata=_help("drop (and count) prompts longer than this many tokens")
    )
    rollout_shuffle: bool = field(
        default=False, metadata=_help("reshuffle the prompts every epoch (seeded by --seed)")
    )
    on_bad_row: Literal["fail", "skip"] = field(
        default="fail", metadata=_help("a malformed row stops the job (fail) or is skipped and counted (skip)")
    )


@dataclass(frozen=True)
class RolloutConfig:
    rollout_batch_size: int = field(default=32, metadata=_help("prompts per rollout step"))
    n_samples_per_prompt: int = field(default=8, metadata=_help("responses sampled per prompt (the group size)"))
    rollout_max_response_len: int | None = field(
        default=None, metadata=_help("max new tokens per response; no default (as in slime): set it for your model")
    )
    rollout_temperature: float = field(default=1.0, metadata=_help("sampling temperature"))
    rollout_top_p: float = field(default=1.0, metadata=_help("nucleus sampling threshold, in (0, 1]"))
    rollout_top_k: int = field(default=-1, metadata=_help("top-k sampling; -1 is off"))
    num_rollout: int = field(default=250, metadata=_help("number of rollout (and training) steps"))
    custom_generate_function_path: str | None = field(
        default=None, metadata=_help("async def generate(args, sample, sampling_params) -> Sample, as module:function")
    )
    dynamic_sampling_filter_path: str | None = field(
        default=None, metadata=_help("filter fn(args, samples) -> DynamicFilterOutput applied to each prompt's group")
    )
    over_sampling_batch_size: int | None = field(
        default=None, metadata=_help("prompts generated per sampling round when filtering; >= --rollout-batch-size")
    )
    rollout_engine: Literal[ROLLOUT_ENGINE_NAMES] = field(
        default="hf", metadata=_help("rollout engine: embedded transformers (hf) or running SGLang servers (sglang)")
    )
    sglang_url: str | None = field(
        default=None, metadata=_help("alias of --rollout-external-engine-addrs (comma-separated base URLs)")
    )
    rollout_schedule: Literal[ROLLOUT_SCHEDULES] = field(
        default="sync",
        metadata=_help(
            "ours: sync, one_step (rollout k+1 generated while step k trains, slime's train_async.py; --async) or "
            "fully_async (groups in flight across steps under --max-staleness; --fully-async)"
        ),
    )
    update_weights_interval: int = field(default=1, metadata=_help("sync weights to the engines every N steps"))
    update_weight_buffer_size: int = field(default=512 * 1024**2, metadata=_help("bytes per bucket of a weight sync"))
    max_staleness: int = field(
        default=1,
        metadata=_help(
            "ours, fully_async: a group admitted at weight version v is trained by step v + N (admission control)"
        ),
    )
    partial_rollout: bool = field(
        default=False,
        metadata=_help("fully_async: cut generations off at a weight update and resume them with the new weights"),
    )
    mask_offpolicy_in_partial_rollout: bool = field(
        default=False, metadata=_help("partial rollout: tokens sampled before the weight update leave the loss")
    )


@dataclass(frozen=True)
class AlgoConfig:
    advantage_estimator: Literal[
        "grpo",
        "dr_grpo",
        "gspo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "ppo",
        "on_policy_distillation",
    ] = field(default="grpo", metadata=_help("advantage estimator"))
    eps_clip: float = field(default=0.2, metadata=_help("PPO clip range (lower, and upper unless --eps-clip-high)"))
    eps_clip_high: float | None = field(default=None, metadata=_help("PPO upper clip range (clip-higher)"))
    eps_clip_c: float | None = field(default=None, metadata=_help("dual-clip PPO constant, > 1"))
    kl_coef: float = field(default=0.0, metadata=_help("KL penalty folded into the reward"))
    use_kl_loss: bool = field(
        default=False, metadata=_help("add a KL-to-reference term to the loss (coefficient 0: KL is only logged)")
    )
    kl_loss_coef: float = field(default=0.0, metadata=_help("weight of the KL loss (with --use-kl-loss)"))
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = field(
        default="k1", metadata=_help("KL estimator of the KL loss")
    )
    entropy_coef: float = field(default=0.0, metadata=_help("entropy bonus weight"))
    use_tis: bool = field(default=False, metadata=_help("truncated importance sampling on rollout/train mismatch"))
    normalize_advantages: bool = field(default=False, metadata=_help("whiten advantages over the batch"))
    loss_agg_mode: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"] = (
        field(default="token_mean", metadata=_help("how per-token losses are aggregated"))
    )
    gamma: float = field(default=1.0, metadata=_help("discount (ppo / reinforce++)"))
    lambd: float = field(default=1.0, metadata=_help("GAE lambda (ppo)"))

    @property
    def core_estimator(self) -> str:
        """The estimator's name in ``rlcore.advantages`` (slime's ``ppo`` is ``gae``, ``on_policy_distillation``
        is ``distillation``; the others are spelled alike)."""
        return _CORE_ESTIMATOR_NAMES.get(self.advantage_estimator, self.advantage_estimator)


@dataclass(frozen=True)
class TrainConfig:
    # slime's flag is --train-backend (megatron/fsdp there); rlcore's first backend is torch (HF model, FSDP2).
    train_backend: Literal[TRAIN_BACKEND_NAMES] = field(default="torch", metadata=_help("training backend"))
    global_batch_size: int = field(default=256, metadata=_help("samples per optimizer step, over all trainers"))
    micro_batch_size: int = field(default=8, metadata=_help("samples per forward/backward (without a token budget)"))
    max_tokens_per_gpu: int | None = field(
        default=None, metadata=_help("token budget per micro-batch; set: micro-batches are packed by tokens")
    )
    lr: float = field(default=1e-6, metadata=_help("learning rate (AdamW)"))
    weight_decay: float = field(default=0.0, metadata=_help("AdamW weight decay"))
    clip_grad: float = field(default=1.0, metadata=_help("max gradient norm"))
    sft_warmup_steps: int = field(default=0, metadata=_help("SFT steps before RL (built-in task)"))
    bf16: Literal["auto", "true", "false"] = field(
        default="auto", metadata=_help("bf16 training: auto uses it where the device supports it")
    )


@dataclass(frozen=True)
class ResourceConfig:
    """Processes and devices. On a CPU-only machine a "gpu" is a process (a CPU slot)."""

    colocate: bool = field(default=False, metadata=_help("trainer and engine share devices, offloading in turns"))
    actor_num_nodes: int = field(default=1, metadata=_help("nodes for the trainer"))
    actor_num_gpus_per_node: int = field(default=1, metadata=_help("trainer processes per node (GPUs, or CPU slots)"))
    rollout_num_gpus: int = field(default=1, metadata=_help("rollout engine devices in all (or CPU slots)"))

    @property
    def num_trainer_procs(self) -> int:
        """Data-parallel trainer processes: ``actor_num_nodes * actor_num_gpus_per_node``."""
        return self.actor_num_nodes * self.actor_num_gpus_per_node


@dataclass(frozen=True)
class RewardConfig:
    rm_type: Literal["builtin", "math", "exact_match"] = field(
        default="builtin",
        metadata=_help("builtin (the default task's reward), math (math-verify on \\boxed{}), exact_match"),
    )
    custom_rm_path: str | None = field(
        default=None, metadata=_help("reward function as module:function or file.py:function; overrides --rm-type")
    )
    reward_timeout: float = field(default=30.0, metadata=_help("seconds per reward call; over it the reward is 0"))


@dataclass(frozen=True)
class EvalConfig:
    eval_interval: int | None = field(default=None, metadata=_help("evaluate every this many steps"))
    eval_prompt_data: str | None = field(default=None, metadata=_help("evaluation prompt file (.jsonl / .parquet)"))
    n_samples_per_eval_prompt: int = field(default=1, metadata=_help("responses per evaluation prompt"))


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None = field(default=None, metadata=_help("checkpoint directory"))
    save_interval: int | None = field(default=None, metadata=_help("save every this many steps (and at the end)"))
    load: str | None = field(default=None, metadata=_help("checkpoint directory to resume from"))


@dataclass(frozen=True)
class LogConfig:
    use_tensorboard: bool = field(default=True, metadata=_help("write TensorBoard event files to the output dir"))
    use_wandb: bool = field(default=False, metadata=_help("log to Weights & Biases (needs the wandb package)"))
    wandb_project: str | None = field(default=None, metadata=_help("W&B project"))


@dataclass(frozen=True)
class SGLangConfig:
    """The SGLang fleet of ``--rollout-engine sglang``: launched servers (or running ones), the router in front,
    weight sync. ``sglang_args`` / ``router_args`` hold the ``--sglang-*`` / ``--router-*`` passthrough flags by
    SGLang's own names (``runtime.engines.sglang_flags``); they have no flag of their own."""

    rollout_num_gpus_per_engine: int = field(
        default=1, metadata=_help("GPUs per SGLang server (its tensor-parallel size); --rollout-num-gpus in all")
    )
    rollout_external_engine_addrs: str | None = field(
        default=None,
        metadata=_help("use these running SGLang servers (comma- or space-separated host:port or URLs); no launch"),
    )
    sglang_server_command: str = field(
        default="python -m sglang.launch_server",
        metadata=_help("ours: the command that starts one SGLang server (the launcher appends its flags)"),
    )
    sglang_server_startup_timeout: float = field(
        default=600.0, metadata=_help("ours: seconds a launched server may take to answer /health_generate")
    )
    sglang_router_ip: str | None = field(
        default=None, metadata=_help("use the running SGLang router at this address instead of launching one")
    )
    sglang_router_port: int | None = field(
        default=None, metadata=_help("port of the router (with --sglang-router-ip)")
    )
    sglang_router_request_timeout_secs: int = field(
        default=14400, metadata=_help("seconds the router waits for one request")
    )
    update_weight_transport: Literal[WEIGHT_TRANSPORTS] | None = field(
        default=None,
        metadata=_help(
            "how weights reach the engines: nccl (a torch.distributed broadcast in buckets; gloo on the CPU) or disk "
            "(safetensors); unset: nccl for SGLang, Ray's object store for the embedded engine"
        ),
    )
    check_weight_update_equal: bool = field(
        default=False, metadata=_help("after the first weight sync, compare every engine's weights with the trainer's")
    )
    offload_rollout: bool | None = field(
        default=None,
        metadata=_help("release the engines' memory while training (weights back before a sync); unset: --colocate"),
    )
    offload_train: bool | None = field(
        default=None, metadata=_help("offload the trainers while the engines generate; unset: --colocate")
    )
    sglang_args: dict = field(default_factory=dict, metadata={"help": "--sglang-<flag> values", "passthrough": True})
    router_args: dict = field(default_factory=dict, metadata={"help": "--router-<flag> values", "passthrough": True})


@dataclass(frozen=True)
class Config:
    seed: int = field(default=1234, metadata=_help("seed of prompt shuffling, sampling and initialisation"))
    output_dir: str = field(default="outputs/default", metadata=_help("metrics, event files, plots, final model"))
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
    sglang: SGLangConfig = field(default_factory=SGLangConfig)

    def __getattr__(self, name: str) -> Any:
        # slime's hooks read a flat namespace (args.n_samples_per_prompt); leaf names are unique across sections,
        # so a flat read resolves to exactly one field. Only called when normal lookup fails.
        spec = _SPECS.get(name) if not name.startswith("_") else None
        if spec is None or spec[0] is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(object.__getattribute__(self, spec[0]), name)

    @property
    def is_builtin_job(self) -> bool:
        """Whether this is the built-in demo job: no ``--hf-checkpoint`` and no ``--prompt-data``."""
        return self.model.hf_checkpoint is None and self.data.prompt_data is None


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
}


def flag(name: str) -> str:
    """The command-line flag of a field: ``rollout_batch_size`` -> ``--rollout-batch-size``."""
    return "--" + name.replace("_", "-")


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


def _type_problem(name: str, value: Any, tp: Any) -> str | None:
    """A message if ``value`` does not fit the field type ``tp``, else None."""
    inner, optional = _unwrap_optional(tp)
    if value is None:
        return None if optional else f"{flag(name)} must be set (got None)"
    if typing.get_origin(inner) is Literal:
        choices = typing.get_args(inner)
        if value not in choices:
            return f"{flag(name)} must be one of {', '.join(map(str, choices))}; got {value!r}"
        return None
    if inner is bool:
        ok = isinstance(value, bool)
    elif inner is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif inner is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    else:
        ok = isinstance(value, inner)
    if not ok:
        return f"{flag(name)} must be a {inner.__name__}, got {type(value).__name__} {value!r}"
    return None


def _coerce(name: str, value: Any) -> Any:
    """Lenient conversions for YAML input: ints and numeric strings (YAML 1.1 reads ``1e-6`` as text) to floats."""
    inner, _ = _unwrap_optional(_SPECS[name][2])
    if inner is float and not isinstance(value, bool):
        if isinstance(value, int):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                return value
    return value


def _normalise_key(key: Any) -> str:
    if not isinstance(key, str):
        raise ConfigError([f"config keys must be strings, got {key!r}"])
    return key.replace("-", "_")


def from_dict(tree: Mapping[str, Any] | None = None, /, **overrides: Any) -> Config:
    """Build a ``Config`` from a nested (``{"rollout": {"rollout_batch_size": 8}}``) or flat mapping and overrides.

    Keys may use dashes or underscores. Unknown keys raise ``ConfigError``. For the built-in job (neither
    ``hf_checkpoint`` nor ``prompt_data`` given) every setting absent from ``tree`` and ``overrides`` takes its
    ``BUILTIN_JOB_DEFAULTS`` value. The result is not validated: call ``validate``.
    """
    flat: dict[str, Any] = {}
    problems: list[str] = []

    def put(key: str, value: Any, where: str) -> None:
        if key not in _SPECS:
            problems.append(f"unknown setting {key!r} in {where}")
            return
        section = _SPECS[key][0]
        if where != "top level" and where != section:
            problems.append(f"setting {key!r} belongs to section {section!r}, not {where!r}")
            return
        flat[key] = _coerce(key, value)

    for raw_key, value in (tree or {}).items():
        key = _normalise_key(raw_key)
        if key in SECTIONS:
            if value is None:
                continue
            if not isinstance(value, Mapping):
                problems.append(f"section {key!r} must be a mapping, got {type(value).__name__}")
                continue
            for sub_key, sub_value in value.items():
                put(_normalise_key(sub_key), sub_value, key)
        else:
            put(key, value, "top level")
    for key, value in overrides.items():
        put(_normalise_key(key), value, "top level")
    if problems:
        raise ConfigError(problems)
    if flat.get("hf_checkpoint") is None and flat.get("prompt_data") is None:
        for key, value in BUILTIN_JOB_DEFAULTS.items():
            flat.setdefault(key, value)

    sections = {name: cls(**{k: v for k, v in flat.items() if _SPECS[k][0] == name}) for name, cls in SECTIONS.items()}
    return Config(**sections, **{k: flat[k] for k in _TOP_LEVEL if k in flat})


def to_dict(cfg: Config) -> dict[str, Any]:
    """The nested plain-dict form of ``cfg`` (what ``dump_yaml`` writes and ``from_dict`` reads back)."""
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config, path: str | os.PathLike[str]) -> None:
    """Write ``cfg`` as YAML to ``path``; ``parse_args(["--config", path])`` reads it back equal."""
    with open(path, "w") as fh:
        yaml.safe_dump(to_dict(cfg), fh, sort_keys=False)


def load_yaml(path: str | os.PathLike[str]) -> Config:
    """Read a YAML config file (nested or flat); not validated."""
    return from_dict(read_yaml_tree(path))


def read_yaml_tree(path: str | os.PathLike[str]) -> Mapping[str, Any]:
    """The mapping a YAML config file holds, as written (only the keys it sets); raises ``ConfigError``."""
    if not os.path.isfile(path):
        raise ConfigError([f"--config: file {os.path.abspath(path)!r} does not exist"])
    with open(path) as fh:
        try:
            tree = yaml.safe_load(fh)
        except yaml.YAMLError as err:
            raise ConfigError([f"--config: {path} is not valid YAML ({err})"]) from err
    if tree is not None and not isinstance(tree, Mapping):
        raise ConfigError([f"--config: {path} must hold a mapping, got {type(tree).__name__}"])
    return tree or {}


def format_config(cfg: Config) -> str:
    """A readable listing, one ``--flag value`` per line by section; values changed from the defaults of this kind of
    job (built-in or not) are starred."""
    default = to_dict(from_dict(hf_checkpoint=cfg.model.hf_checkpoint, prompt_data=cfg.data.prompt_data))
    current = to_dict(cfg)
    width = max(len(flag(name)) for name in _SPECS)
    lines = []
    for name in _TOP_LEVEL:
        mark = "*" if current[name] != default[name] else " "
        lines.append(f"{mark} {flag(name):<{width}} {current[name]!r}")
    for section in SECTIONS:
        lines.append(f"[{section}]")
        for name, value in current[section].items():
            mark = "*" if value != default[section][name] else " "
            lines.append(f"{mark} {flag(name):<{width}} {value!r}")
    return "\n".join(lines)


def _arg_type(name: str, inner: Any, optional: bool):
    def convert(text: str) -> Any:
        if optional and text.lower() in ("none", "null"):
            return None
        try:
            return inner(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag(name)} expects a {inner.__name__}, got {text!r}") from None

    convert.__name__ = inner.__name__
    return convert


def build_parser() -> argparse.ArgumentParser:
    """The ``rlcore-run`` argument parser: one flag per config field, defaults suppressed so YAML can sit between."""
    parser = argparse.ArgumentParser(
        prog="rlcore-run",
        usage="rlcore-run [--config PATH.yaml] [--FLAG VALUE ...] [--sglang-FLAG ...] [--router-FLAG ...]",
        description=(
            "Run an RL post-training job (GRPO and friends). With no arguments: the built-in CPU demo job. Flag "
            "defaults follow slime's; the built-in job (no --hf-checkpoint and no --prompt-data) uses its own tuned "
            "values for the flags you leave unset: "
            + ", ".join(f"{flag(k)} {v}" for k, v in BUILTIN_JOB_DEFAULTS.items())
            + "."
        ),
        argument_default=argparse.SUPPRESS,
        # A prefix of a flag must not silently select it: --rollout-max could mean two flags as new ones land.
        allow_abbrev=False,
    )
    parser.add_argument("--config", metavar="PATH.yaml", help="YAML config (nested by section, or flat); flags win")
    for shorthand, schedule in (("--async", "one_step"), ("--fully-async", "fully_async")):
        parser.add_argument(
            shorthand,
            dest="rollout_schedule",
            action="store_const",
            const=schedule,
            help=f"--rollout-schedule {schedule}",
        )
    defaults = Config()
    groups = {None: parser.add_argument_group("general")}
    for section in SECTIONS:
        groups[section] = parser.add_argument_group(section)
    for name, (section, f, tp) in _SPECS.items():
        if f.metadata.get("passthrough"):
            continue
        default = getattr(defaults, name)
        help_text = f.metadata.get("help", "") + f" (default: {default!r}"
        if name in BUILTIN_JOB_DEFAULTS:
            help_text += f"; built-in job: {BUILTIN_JOB_DEFAULTS[name]!r}"
        help_text += ")"
        group = groups[section]
        inner, optional = _unwrap_optional(tp)
        if inner is bool:
            group.add_argument(flag(name), dest=name, action=argparse.BooleanOptionalAction, help=help_text)
        elif typing.get_origin(inner) is Literal:
            group.add_argument(flag(name), dest=name, choices=typing.get_args(inner), help=help_text)
        else:
            group.add_argument(flag(name), dest=name, type=_arg_type(name, inner, optional), help=help_text)
    sglang_flags.add_passthrough_flags(parser, "server")
    sglang_flags.add_passthrough_flags(parser, "router")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> Config:
    """Parse ``rlcore-run``'s command line (``sys.argv[1:]`` when None) into a validated ``Config``.

    Precedence: defaults (the built-in job's for settings left unset when neither ``--hf-checkpoint`` nor
    ``--prompt-data`` is given), then the ``--config`` YAML file, then flags. Raises ``ConfigError``.
    """
    namespace = vars(build_parser().parse_args(argv))
    config_path = namespace.pop("config", None)
    tree = read_yaml_tree(config_path) if config_path is not None else {}
    # Passthrough flags add to (and override) the passthrough settings of the YAML file, one flag at a time.
    for key, values in sglang_flags.pop_passthrough(namespace).items():
        from_yaml = from_dict(tree) if tree else Config()
        namespace[key] = {**getattr(from_yaml.sglang, key), **values}
    cfg = from_dict(tree, **namespace)
    validate(cfg)
    return cfg


def _check_positive(problems: list[str], cfg: Config) -> None:
    r, t, res, e, c = cfg.rollout, cfg.train, cfg.resources, cfg.eval, cfg.ckpt
    positive = {
        "rollout_batch_size": r.rollout_batch_size,
        "n_samples_per_prompt": r.n_samples_per_prompt,
        "rollout_max_response_len": r.rollout_max_response_len,
        "num_rollout": r.num_rollout,
        "global_batch_size": t.global_batch_size,
        "micro_batch_size": t.micro_batch_size,
        "actor_num_nodes": res.actor_num_nodes,
        "actor_num_gpus_per_node": res.actor_num_gpus_per_node,
        "rollout_num_gpus": res.rollout_num_gpus,
        "n_samples_per_eval_prompt": e.n_samples_per_eval_prompt,
        "lr": t.lr,
        "clip_grad": t.clip_grad,
        "eps_clip": cfg.algo.eps_clip,
        "rollout_temperature": r.rollout_temperature,
        "reward_timeout": cfg.reward.reward_timeout,
        "rollout_max_prompt_len": cfg.data.rollout_max_prompt_len,
        "max_tokens_per_gpu": t.max_tokens_per_gpu,
        "over_sampling_batch_size": r.over_sampling_batch_size,
        "eval_interval": e.eval_interval,
        "save_interval": c.save_interval,
        "eps_clip_high": cfg.algo.eps_clip_high,
        "update_weights_interval": r.update_weights_interval,
        "update_weight_buffer_size": r.update_weight_buffer_size,
    }
    for name, value in positive.items():
        if value is not None and value <= 0:
            problems.append(f"{flag(name)} must be > 0, got {value!r}")
    non_negative = {
        "weight_decay": t.weight_decay,
        "sft_warmup_steps": t.sft_warmup_steps,
        "kl_coef": cfg.algo.kl_coef,
        "kl_loss_coef": cfg.algo.kl_loss_coef,
        "max_staleness": r.max_staleness,
    }
    for name, value in non_negative.items():
        if value < 0:
            problems.append(f"{flag(name)} must be >= 0, got {value!r}")
    if not 0 < r.rollout_top_p <= 1:
        problems.append(f"--rollout-top-p must be in (0, 1], got {r.rollout_top_p!r}")
    if r.rollout_top_k != -1 and r.rollout_top_k < 1:
        problems.append(f"--rollout-top-k must be -1 (off) or >= 1, got {r.rollout_top_k!r}")
    for name in ("gamma", "lambd"):
        value = getattr(cfg.algo, name)
        if not 0 <= value <= 1:
            problems.append(f"{flag(name)} must be in [0, 1], got {value!r}")
    if cfg.algo.eps_clip_c is not None and cfg.algo.eps_clip_c <= 1:
        problems.append(f"--eps-clip-c (dual clip) must be > 1, got {cfg.algo.eps_clip_c!r}")


def _check_batches(problems: list[str], cfg: Config) -> None:
    r, t, res = cfg.rollout, cfg.train, cfg.resources
    procs = res.num_trainer_procs
    if t.max_tokens_per_gpu is None:
        per_step = t.micro_batch_size * procs
        if t.global_batch_size % per_step:
            problems.append(
                f"--global-batch-size {t.global_batch_size} must be a multiple of --micro-batch-size "
                f"{t.micro_batch_size} x trainer processes {procs} (--actor-num-nodes {res.actor_num_nodes} x "
                f"--actor-num-gpus-per-node {res.actor_num_gpus_per_node}) = {per_step}"
            )
    elif t.global_batch_size % procs:
        problems.append(
            f"--global-batch-size {t.global_batch_size} must be a multiple of the trainer processes {procs} "
            f"(--actor-num-nodes x --actor-num-gpus-per-node)"
        )
    per_rollout = r.rollout_batch_size * r.n_samples_per_prompt
    if per_rollout % t.global_batch_size:
        problems.append(
            f"--global-batch-size {t.global_batch_size} must divide --rollout-batch-size {r.rollout_batch_size} x "
            f"--n-samples-per-prompt {r.n_samples_per_prompt} = {per_rollout} (each rollout is whole optimizer steps)"
        )
    if r.n_samples_per_prompt == 1 and cfg.algo.advantage_estimator in GROUP_BASELINE_ESTIMATORS:
        problems.append(
            f"--n-samples-per-prompt 1 leaves --advantage-estimator {cfg.algo.advantage_estimator} without a group "
            f"baseline: sample >= 2 per prompt or use reinforce_plus_plus / ppo"
        )
    if r.over_sampling_batch_size is not None and r.over_sampling_batch_size < r.rollout_batch_size:
        problems.append(
            f"--over-sampling-batch-size {r.over_sampling_batch_size} must be >= --rollout-batch-size "
            f"{r.rollout_batch_size}"
        )
    prompt_len = cfg.data.rollout_max_prompt_len
    # Without --rollout-max-prompt-len the bound is the data's longest prompt: checked once the data is tokenized
    # (runtime.loop.prepare_model_and_data, still before Ray starts).
    if t.max_tokens_per_gpu is not None and prompt_len is not None and r.rollout_max_response_len is not None:
        longest = r.rollout_max_response_len + prompt_len
        if t.max_tokens_per_gpu < longest:
            problems.append(
                f"--max-tokens-per-gpu {t.max_tokens_per_gpu} cannot hold one sample of up to {longest} tokens "
                f"(--rollout-max-prompt-len {prompt_len} + --rollout-max-response-len {r.rollout_max_response_len})"
            )
    if res.colocate and res.rollout_num_gpus != procs:
        problems.append(
            f"--colocate shares devices: --rollout-num-gpus {res.rollout_num_gpus} must equal --actor-num-nodes x "
            f"--actor-num-gpus-per-node = {procs}"
        )


def _check_paths(problems: list[str], cfg: Config) -> None:
    for name, path in (("prompt_data", cfg.data.prompt_data), ("eval_prompt_data", cfg.eval.eval_prompt_data)):
        if path is None:
            continue
        if not os.path.isfile(path):
            problems.append(f"{flag(name)}: file {os.path.abspath(path)!r} does not exist")
        elif not path.endswith((".jsonl", ".parquet")):
            problems.append(f"{flag(name)}: {path!r} must be a .jsonl or .parquet file")
    checkpoint = cfg.model.hf_checkpoint
    if checkpoint is not None:
        if not os.path.isdir(checkpoint):
            problems.append(f"--hf-checkpoint: directory {os.path.abspath(checkpoint)!r} does not exist")
        elif not os.path.isfile(os.path.join(checkpoint, "config.json")):
            problems.append(f"--hf-checkpoint: {checkpoint!r} has no config.json (not a HF model directory)")
    if cfg.ckpt.load is not None:
        from runtime.cluster.checkpoint import resolve

        try:
            resolve(cfg.ckpt.load)
        except FileNotFoundError as err:
            problems.append(str(err))
    hooks = {
        "custom_rm_path": cfg.reward.custom_rm_path,
        "custom_generate_function_path": cfg.rollout.custom_generate_function_path,
        "dynamic_sampling_filter_path": cfg.rollout.dynamic_sampling_filter_path,
    }
    for name, path in hooks.items():
        if path is None:
            continue
        try:
            check_function_path(path)
        except HookError as err:
            problems.append(f"{flag(name)}: {err}")


def _check_combinations(problems: list[str], cfg: Config) -> None:
    if cfg.rollout.rollout_max_response_len is None:
        problems.append(
            "--rollout-max-response-len has no default outside the built-in job (slime has none either): set the "
            "longest response to sample, e.g. --rollout-max-response-len 1024"
        )
    if cfg.ckpt.save_interval is not None and cfg.ckpt.save is None:
        problems.append("--save-interval needs --save (the checkpoint directory)")
    if cfg.eval.eval_interval is not None and cfg.data.prompt_data is not None and cfg.eval.eval_prompt_data is None:
        problems.append("--eval-interval with --prompt-data needs --eval-prompt-data")
    if cfg.data.prompt_data is not None and cfg.reward.rm_type == "builtin" and cfg.reward.custom_rm_path is None:
        problems.append(
            "--rm-type builtin scores the built-in task only; with --prompt-data choose --rm-type math or "
            "exact_match, or --custom-rm-path"
        )
    if cfg.algo.kl_loss_coef > 0 and not cfg.algo.use_kl_loss:
        problems.append(
            f"--kl-loss-coef {cfg.algo.kl_loss_coef} has no effect without --use-kl-loss (add it, or use --kl-coef "
            "for a KL penalty in the reward)"
        )
    _check_sglang(problems, cfg)
    _check_schedule(problems, cfg)
    if cfg.log.use_wandb and importlib.util.find_spec("wandb") is None:
        problems.append("--use-wandb needs the wandb package (pip install wandb)")


def _check_sglang(problems: list[str], cfg: Config) -> None:
    s, res = cfg.sglang, cfg.resources
    uses_sglang = cfg.rollout.rollout_engine == "sglang"
    if cfg.rollout.sglang_url and s.rollout_external_engine_addrs:
        problems.append("--sglang-url is an alias of --rollout-external-engine-addrs: give one of them")
    for name in ("sglang_url", "rollout_external_engine_addrs"):
        if getattr(cfg, name) and not uses_sglang:
            problems.append(f"{flag(name)} is used only with --rollout-engine sglang")
    for which, values in (("server", s.sglang_args), ("router", s.router_args)):
        problems.extend(sglang_flags.passthrough_problems(which, values))
        if values and not uses_sglang:
            prefix = sglang_flags.SERVER_PREFIX if which == "server" else sglang_flags.ROUTER_PREFIX
            problems.append(f"{prefix}* flags are used only with --rollout-engine sglang")
    if s.rollout_num_gpus_per_engine < 1:
        problems.append(f"--rollout-num-gpus-per-engine must be >= 1, got {s.rollout_num_gpus_per_engine}")
    elif res.rollout_num_gpus % s.rollout_num_gpus_per_engine:
        problems.append(
            f"--rollout-num-gpus {res.rollout_num_gpus} must be a multiple of --rollout-num-gpus-per-engine "
            f"{s.rollout_num_gpus_per_engine} (each engine takes that many)"
        )
    if s.rollout_num_gpus_per_engine != 1 and not uses_sglang:
        problems.append("--rollout-num-gpus-per-engine applies to SGLang engines (--rollout-engine sglang) only")
    if (s.sglang_router_ip is None) != (s.sglang_router_port is None):
        problems.append("--sglang-router-ip and --sglang-router-port go together (the address of a running router)")
    if s.sglang_router_port is not None and not 0 < s.sglang_router_port < 65536:
        problems.append(f"--sglang-router-port must be in [1, 65535], got {s.sglang_router_port}")
    if s.sglang_router_ip is not None and s.router_args:
        problems.append("--router-* flags configure the router rlcore launches: not with --sglang-router-ip")
    if s.sglang_router_request_timeout_secs <= 0 or s.sglang_server_startup_timeout <= 0:
        problems.append("--sglang-router-request-timeout-secs and --sglang-server-startup-timeout must be > 0")
    if not s.sglang_server_command.split():
        problems.append("--sglang-server-command must not be empty")
    for name in ("offload_rollout", "offload_train"):
        if res.colocate and getattr(s, name) is False:
            problems.append(f"--colocate shares devices between trainers and engines: it needs {flag(name)}")
        if getattr(s, name) and cfg.rollout.rollout_schedule != "sync":
            problems.append(
                f"{flag(name)} takes turns between rollout and training: it needs --rollout-schedule sync, not "
                f"{cfg.rollout.rollout_schedule}"
            )
    if uses_sglang and s.sglang_router_ip is None and importlib.util.find_spec("sglang_router") is None:
        problems.append(
            "--rollout-engine sglang launches the SGLang router, which needs the sglang-router package "
            "(pip install 'rlcore[sglang]'), or give a running one with --sglang-router-ip/--sglang-router-port"
        )


def _check_schedule(problems: list[str], cfg: Config) -> None:
    r = cfg.rollout
    if r.rollout_schedule != "sync" and cfg.resources.colocate:
        problems.append(
            f"--rollout-schedule {r.rollout_schedule} (--async / --fully-async) overlaps rollout and training, which "
            "needs trainers and engines on separate devices: colocated mode (--colocate) stays synchronous"
        )
    if r.rollout_schedule == "fully_async" and r.max_staleness < r.update_weights_interval - 1:
        problems.append(
            f"--max-staleness {r.max_staleness} must be >= --update-weights-interval {r.update_weights_interval} - 1: "
            "between two weight syncs the engines sample with one version for that many steps"
        )
    if r.partial_rollout and r.rollout_schedule != "fully_async":
        problems.append("--partial-rollout resumes generations cut off at a weight update: it needs --fully-async")
    if r.partial_rollout and r.custom_generate_function_path:
        problems.append(
            "--partial-rollout continues the default generation; it cannot resume a --custom-generate-function-path"
        )
    if r.mask_offpolicy_in_partial_rollout and not r.partial_rollout:
        problems.append("--mask-offpolicy-in-partial-rollout needs --partial-rollout")


def validate(cfg: Config) -> Config:
    """Return ``cfg`` if its settings work together; raise ``ConfigError`` listing every problem otherwise."""
    if not isinstance(cfg, Config):
        raise TypeError(f"cfg must be a runtime.config.Config, got {type(cfg).__name__}")
    problems: list[str] = []
    for name, (_, _, tp) in _SPECS.items():
        problem = _type_problem(name, getattr(cfg, name), tp)
        if problem:
            problems.append(problem)
    if problems:
        # Range and consistency checks assume well-typed values.
        raise ConfigError(problems)
    _check_positive(problems, cfg)
    if problems:
        # The batch arithmetic below divides by these sizes.
        raise ConfigError(problems)
    _check_batches(problems, cfg)
    _check_paths(problems, cfg)
    _check_combinations(problems, cfg)
    if problems:
        raise ConfigError(problems)
    return cfg
