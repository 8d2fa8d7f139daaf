"""A ``Config`` from a nested or flat mapping of settings and overrides, with slime's derived defaults filled (the
built-in job's values, the placement plan, the global batch, the decay span).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runtime import slime_compat, slime_flags
from runtime.config.schema import _SPECS, _TOP_LEVEL, BUILTIN_JOB_DEFAULTS, SECTIONS, Config, ConfigError, _local_gpus
from runtime.config.typecheck import _coerce


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
            if key in slime_flags.REFUSED_BY_DEST:
                problems.extend(slime_flags.refused_problems({key: value}))
            else:
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
    flat = slime_compat.apply_slime_settings(flat)  # slime's paths that stand for settings (its fully-async rollout)
    fleet = ("sglang_args", "router_args", "rollout_num_gpus_per_engine", "sglang_router_ip")
    if any(flat.get(key) for key in fleet) and "rollout_engine" not in flat:
        # These configure SGLang servers: as in slime (whose only engine SGLang is), they select it.
        flat["rollout_engine"] = "sglang"
    builtin_on_one_gpu = False
    builtin = flat.get("hf_checkpoint") is None and flat.get("prompt_data") is None
    if builtin or "actor_num_gpus_per_node" in flat:
        # On N GPUs with no placement flag, the measured-faster plan (runtime.cluster.plan).
        from runtime.cluster.plan import default_placement

        for key, value in default_placement(flat, gpus=_local_gpus()).items():
            flat.setdefault(key, value)
    if builtin:
        builtin_on_one_gpu = _local_gpus() == 1 and "micro_batch_size" not in flat
        for key, value in BUILTIN_JOB_DEFAULTS.items():
            flat.setdefault(key, value)
        if flat.get("rollout_schedule", "sync") == "sync" and _local_gpus() == 1:
            # One GPU cannot hold a trainer and an engine apart: they share it in turns.
            flat.setdefault("colocate", True)
        if flat.get("rollout_schedule", "sync") != "sync":
            # One version behind, the built-in job learns clearly slower uncorrected and level with sync with
            # TIS on its off-policy tokens (5 seeds, docs/runtime.md); in sync TIS would change nothing it needs.
            flat.setdefault("use_tis", True)
    if flat.get("colocate") and "rollout_num_gpus" not in flat:
        # slime's rule: colocated engines run on the trainers' GPUs.
        per_node = flat.get("actor_num_gpus_per_node", _SPECS["actor_num_gpus_per_node"][1].default)
        flat["rollout_num_gpus"] = flat.get("actor_num_nodes", 1) * per_node
    elif "rollout_num_gpus" not in flat:
        # Running servers: slime counts their GPUs (asking each); ours counts --rollout-num-gpus-per-engine each.
        # Otherwise slime has no default (its placement needs the number); ours: one engine.
        external = flat.get("rollout_external_engine_addrs") or flat.get("sglang_url")
        servers = len(external.replace(",", " ").split()) if isinstance(external, str) else 0
        per_engine = flat.get("rollout_num_gpus_per_engine", 1)
        if isinstance(per_engine, int):
            flat["rollout_num_gpus"] = max(servers, 1) * per_engine
    if flat.get("offload") is True:
        # slime's --offload: both offloads on.
        flat.setdefault("offload_train", True)
        flat.setdefault("offload_rollout", True)
    _resolve_global_batch_size(flat)
    if builtin_on_one_gpu and isinstance(flat.get("global_batch_size"), int):
        # A GPU takes the tiny model's whole batch at once: 32 micro-batches of 8 rows made the GPU slower than
        # the CPU (each a few kernels too small to fill it).
        flat["micro_batch_size"] = flat["global_batch_size"]
    _resolve_lr_decay_iters(flat)
    # slime's defaults from --rollout-max-context-len: room for one generated token, and the evaluation's context.
    if flat.get("rollout_max_context_len") is not None and "rollout_max_prompt_len" not in flat:
        if isinstance(flat["rollout_max_context_len"], int):
            flat["rollout_max_prompt_len"] = flat["rollout_max_context_len"] - 1
    if flat.get("rollout_max_context_len") is not None and "eval_max_context_len" not in flat:
        flat["eval_max_context_len"] = flat["rollout_max_context_len"]

    sections = {name: cls(**{k: v for k, v in flat.items() if _SPECS[k][0] == name}) for name, cls in SECTIONS.items()}
    return Config(**sections, **{k: flat[k] for k in _TOP_LEVEL if k in flat})


def _resolve_global_batch_size(flat: dict[str, Any]) -> None:
    """slime's default: one rollout is ``--num-steps-per-rollout`` (1 when unset) optimizer steps."""
    if "global_batch_size" in flat:
        return
    rollout, n = flat.get("rollout_batch_size"), flat.get("n_samples_per_prompt", 1)
    steps = flat.get("num_steps_per_rollout") or 1
    if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (rollout, n, steps)):
        if rollout * n % steps == 0:
            flat["global_batch_size"] = rollout * n // steps


def _resolve_lr_decay_iters(flat: dict[str, Any]) -> None:
    """Megatron's default: the decay spans the job's optimizer steps (``--num-rollout`` x steps per rollout)."""
    if "lr_decay_iters" in flat:
        return
    rollouts, rollout, n = flat.get("num_rollout"), flat.get("rollout_batch_size"), flat.get("n_samples_per_prompt", 1)
    gbs = flat.get("global_batch_size")
    if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (rollouts, rollout, n, gbs)):
        flat["lr_decay_iters"] = max(1, rollouts * (rollout * n // gbs))
