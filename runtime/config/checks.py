"""The checks of a resolved ``Config``: ``validate`` runs the field types and bounds, rlcore's ranges, and the rules
that relate settings, each naming its flags.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from rlcore.advantage_config import GROUP_BASELINE_ESTIMATORS
from runtime import slime_compat
from runtime.cluster.weight_sync_options import (
    WEIGHT_SYNC_OPTIONS,
    derived_transports,
    syncs_weights,
    weight_sync_options,
)
from runtime.config.evalsets import _eval_dataset_problems, eval_datasets
from runtime.config.resolve import from_dict
from runtime.config.schema import (
    _SPECS,
    FORGE_ROLLOUT_PATHS,
    KL_COEF_IGNORED,
    MODEL_SHAPE_FIELDS,
    RM_TYPES,
    SLIME_RM_TYPES_NOT_BUILT,
    Config,
    ConfigError,
    flag,
    top_p_replay,
)
from runtime.config.typecheck import _type_problems
from runtime.config.yaml_io import _tree_value, read_yaml_tree
from runtime.engines.registry import ROLLOUT_ENGINE_OPTIONS, ROLLOUT_ENGINES, engine_options
from runtime.hooks import HookError, resolve_hook
from runtime.rollout.schedule_options import SCHEDULE_OPTIONS, schedule_options
from runtime.train.backends import TRAIN_BACKEND_OPTIONS, backend_options

# Flags whose range is rlcore's: flag field -> (rlcore config class name, its field, the flags of the fields its rule
# compares it with). Each value is checked by building that class with it (and those), so the range is the one rlcore
# enforces, in rlcore's words (rlcore.loss_config / rlcore.advantage_config: torch-free).
CORE_RANGES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "eps_clip": ("LossConfig", "eps_clip", ()),
    "eps_clip_high": ("LossConfig", "eps_clip_high", ()),
    "eps_clip_c": ("LossConfig", "eps_clip_c", ()),
    "tis_clip": ("LossConfig", "tis_clip", ()),
    "tis_clip_low": ("LossConfig", "tis_clip_low", ("tis_clip",)),
    "opsm_delta": ("LossConfig", "opsm_delta", ()),
    "kl_loss_coef": ("LossConfig", "kl_loss_coef", ()),
    "entropy_coef": ("LossConfig", "entropy_coef", ()),
    "value_clip": ("LossConfig", "value_clip", ()),
    "gamma": ("AdvantageConfig", "gamma", ()),
    "lambd": ("AdvantageConfig", "lam", ()),
    "kl_coef": ("AdvantageConfig", "kl_coef", ()),
    "opd_kl_coef": ("AdvantageConfig", "opd_kl_coef", ()),
}


def _check_core_ranges(problems: list[str], cfg: Config) -> None:
    from rlcore.advantage_config import AdvantageConfig
    from rlcore.loss_config import LossConfig

    classes = {"LossConfig": LossConfig, "AdvantageConfig": AdvantageConfig}
    failed: set[str] = set()
    for name, (cls, core, partners) in CORE_RANGES.items():
        if failed & set(partners):
            continue  # a partner out of range is reported already; the comparison with it says nothing more
        values = {core: getattr(cfg, name)} | {CORE_RANGES[p][1]: getattr(cfg, p) for p in partners}
        try:
            classes[cls](**values)
        except (TypeError, ValueError) as err:
            failed.add(name)
            problems.append(f"{flag(name)} {getattr(cfg, name)!r}: out of rlcore's range ({err})")


# Top-p replay's two halves, each a capability its plug-in declares in its options module (True: it does its half;
# False, or nothing declared: it does not, and ``TOP_P_NUCLEI_NOTE`` may say why): the engine reports each token's
# nucleus, the backend takes log-probs over it. The plug-in kind's flag -> its options loader and the capability.
TOP_P_REPLAY_CAPABILITIES: dict[str, tuple[Callable[[str], Any], str]] = {
    "rollout_engine": (engine_options, "REPORTS_TOP_P_NUCLEI"),
    "train_backend": (backend_options, "REPLAYS_TOP_P_NUCLEI"),
}


def _check_top_p_replay(problems: list[str], cfg: Config) -> None:
    """slime's top-p replay runs only where the chosen engine and backend each declare their half of it."""
    if not top_p_replay(cfg):
        return
    for kind, (options, capability) in TOP_P_REPLAY_CAPABILITIES.items():
        chosen = getattr(cfg, kind)
        module = options(chosen)
        if getattr(module, capability, False) is True:
            continue
        why = getattr(module, "TOP_P_NUCLEI_NOTE", f"{module.__name__} does not declare {capability} = True")
        problems.append(
            f"--rollout-top-p {cfg.rollout.rollout_top_p} replays each token's nucleus in training (slime's top-p "
            f"replay), which {flag(kind)} {chosen} does not do ({why}): add --no-rollout-top-p-replay to train on "
            "untruncated log-probs"
        )


def _check_positive(problems: list[str], cfg: Config) -> None:
    # Each number's own bounds are declared on its field (_bounded) and rlcore's are rlcore's (_check_core_ranges);
    # these are the rules that involve more than one value, or more than a bound.
    r, t, res, e = cfg.rollout, cfg.train, cfg.resources, cfg.eval
    if res.rollout_num_gpus is None:
        problems.append("--rollout-num-gpus must be a number (leave it out to have it derived)")
    _check_top_p_replay(problems, cfg)
    if e.eval_top_k is not None and e.eval_top_k != -1 and e.eval_top_k < 1:
        problems.append(f"--eval-top-k must be -1 (off) or >= 1, got {e.eval_top_k!r}")
    context, prompt = cfg.data.rollout_max_context_len, cfg.data.rollout_max_prompt_len
    if context is not None and prompt is not None and prompt > context - 1:
        problems.append(
            f"--rollout-max-prompt-len {prompt} must be below --rollout-max-context-len {context}: a response needs "
            "at least one token"
        )
    bad_env = {k: v for k, v in t.train_env_vars.items() if not isinstance(v, str) or not k or "=" in k}
    if bad_env:
        problems.append(
            f"--train-env-vars {json.dumps(bad_env)}: names must be non-empty without '=', and values strings "
            '(write {"NAME": "1"}, not {"NAME": 1})'
        )
    if any(not stop for stop in r.rollout_stop or ()):
        problems.append("--rollout-stop: stop strings must not be empty")
    if r.rollout_top_k != -1 and r.rollout_top_k < 1:
        problems.append(f"--rollout-top-k must be -1 (off) or >= 1, got {r.rollout_top_k!r}")


def _check_required(problems: list[str], cfg: Config) -> None:
    """What slime requires (or derives) and this job left unset."""
    r, t = cfg.rollout, cfg.train
    if r.rollout_batch_size is None:
        problems.append("--rollout-batch-size is required (prompts per rollout), as in slime")
    if r.num_rollout is None and r.num_epoch is None:
        problems.append("set --num-rollout (rollout steps) or --num-epoch (passes over --prompt-data)")
    if r.num_rollout is None and r.num_epoch is not None and cfg.data.prompt_data is None:
        problems.append("--num-epoch counts passes over --prompt-data; the built-in task needs --num-rollout")
    steps = t.num_steps_per_rollout
    if r.rollout_batch_size is not None and steps is not None:
        per_rollout = r.rollout_batch_size * r.n_samples_per_prompt
        if per_rollout % steps:
            problems.append(
                f"--num-steps-per-rollout {steps} must divide --rollout-batch-size x --n-samples-per-prompt = "
                f"{per_rollout}"
            )
        elif t.global_batch_size is not None and t.global_batch_size != per_rollout // steps:
            problems.append(
                f"--global-batch-size {t.global_batch_size} disagrees with --num-steps-per-rollout {steps} "
                f"({per_rollout} samples per rollout / {steps} = {per_rollout // steps}): set one of them"
            )
    if t.global_batch_size is None and r.rollout_batch_size is not None and not problems:
        problems.append("--global-batch-size is unset: set it, or --num-steps-per-rollout")
    if cfg.eval.eval_prompt_data is not None or cfg.eval.eval_config is not None:
        try:
            for dataset in eval_datasets(cfg):
                problems.extend(_eval_dataset_problems(dataset))
        except ConfigError as err:
            problems.extend(err.problems)


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
    # A group of one has no baseline for the estimators whose baseline is the rest of the prompt's group.
    no_baseline = cfg.algo.disable_rewards_normalization and cfg.algo.advantage_estimator != "rloo"
    # SFT and custom losses without advantages need no baseline.
    no_baseline = no_baseline or cfg.algo.disable_compute_advantages_and_returns or cfg.algo.loss_type == "sft_loss"
    if r.n_samples_per_prompt == 1 and cfg.algo.core_estimator in GROUP_BASELINE_ESTIMATORS and not no_baseline:
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
    # (runtime.job_data.prepare_model_and_data, still before Ray starts).
    if t.use_dynamic_batch_size and t.max_tokens_per_gpu is None:
        problems.append("--use-dynamic-batch-size packs micro-batches by --max-tokens-per-gpu: set it")
    if t.log_probs_max_tokens_per_gpu is not None and t.max_tokens_per_gpu is None:
        problems.append("--log-probs-max-tokens-per-gpu needs --max-tokens-per-gpu (the training passes' budget)")
    for name in ("max_tokens_per_gpu", "log_probs_max_tokens_per_gpu"):
        value = getattr(t, name)
        if value is not None and value < 1:
            problems.append(f"{flag(name)} must be >= 1, got {value}")
    if t.max_tokens_per_gpu is not None and prompt_len is not None and r.rollout_max_response_len is not None:
        longest = r.rollout_max_response_len + prompt_len
        if t.max_tokens_per_gpu < longest:
            problems.append(
                f"--max-tokens-per-gpu {t.max_tokens_per_gpu} cannot hold one sample of up to {longest} tokens "
                f"(--rollout-max-prompt-len {prompt_len} + --rollout-max-response-len {r.rollout_max_response_len})"
            )


def _check_paths(problems: list[str], cfg: Config) -> None:
    paths = [("prompt_data", cfg.data.prompt_data)]
    if cfg.eval.eval_prompt_data is not None or cfg.eval.eval_config is not None:
        flag_name = "eval_config" if cfg.eval.eval_config is not None else "eval_prompt_data"
        paths += [(flag_name, d.path) for d in eval_datasets(cfg)]
    for name, path in paths:
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
    _check_checkpoints(problems, cfg)
    # Every hook flag is resolved (imported) now, before Ray or the model start.
    for name, (_, f, _) in _SPECS.items():
        value = getattr(cfg, name)
        if not f.metadata.get("hook") or value is None:
            continue
        for path in value if isinstance(value, list) else [value]:
            try:
                resolve_hook(flag(name), path)
            except HookError as err:
                problems.append(str(err))


def _check_checkpoints(problems: list[str], cfg: Config) -> None:
    """``--load`` is a complete checkpoint whose files match its manifest and that has steps left to run (or, with
    --train-backend megatron, where the actor's weights start: :func:`runtime.cluster.checkpoint.actor_start`), or a
    folder that does not exist yet or is empty (the job starts afresh, as slime's); ``--save`` is a directory that
    exists or can be created."""
    from runtime.cluster.checkpoint import (
        CheckpointError,
        actor_start,
        final_export_done,
        resolve,
        starts_fresh,
        verify,
    )

    try:
        start = actor_start(
            backend=cfg.train.train_backend,
            load=cfg.ckpt.load,
            ref_load=cfg.ckpt.ref_load,
            ref_ckpt_step=cfg.ckpt.ref_ckpt_step,
        )
    except ValueError as err:
        problems.append(str(err))
        return
    if cfg.ckpt.load is not None and start is None and not starts_fresh(cfg.ckpt.load):
        try:
            step = verify(resolve(cfg.ckpt.load))
        except (FileNotFoundError, CheckpointError) as err:
            problems.append(str(err))
        else:
            # A job stopped during its final export (its last step saved, final_model/ not written) finishes the
            # export on --load: the output folder's config.yaml (the stopped run's) ends at this step.
            finishing = (
                step == cfg.rollout.num_rollout
                and not cfg.debug.debug_rollout_only
                and not final_export_done(os.path.join(cfg.output_dir, "final_model"))
                and _earlier_num_rollout(cfg.output_dir) == step
            )
            if step >= cfg.rollout.num_rollout and not finishing:
                problems.append(
                    f"--load {cfg.ckpt.load}: the checkpoint is at step {step}, at or past --num-rollout "
                    f"{cfg.rollout.num_rollout}: nothing is left to train and final_model/ is exported (raise "
                    "--num-rollout to go on)"
                )
    if cfg.ckpt.save is not None and (problem := _not_creatable_dir(cfg.ckpt.save)):
        problems.append(f"--save {cfg.ckpt.save}: {problem}")


def _earlier_num_rollout(output_dir: str) -> int | None:
    """``--num-rollout`` of the run that last wrote ``output_dir`` (its ``config.yaml``), or None."""
    try:
        return _tree_value(read_yaml_tree(os.path.join(output_dir, "config.yaml")), "num_rollout")
    except ConfigError:
        return None


def _reads_torch_dist(backend: str) -> bool:
    """Whether ``--train-backend backend`` reads Megatron torch_dist checkpoints (its options' READS_TORCH_DIST)."""
    return getattr(backend_options(backend), "READS_TORCH_DIST", False) is True


def _torch_dist_backends() -> str:
    """The flags that choose a backend reading torch_dist checkpoints, for a refusal to name."""
    return " or ".join(f"--train-backend {name}" for name in TRAIN_BACKEND_OPTIONS if _reads_torch_dist(name))


def _check_opd_teacher(problems: list[str], cfg: Config) -> None:
    """``--opd-teacher-load`` (with ``--opd-teacher-ckpt-step``): an HF folder, or under a backend that reads them
    (--train-backend megatron) a torch_dist checkpoint, or the save root holding the step asked for (slime's)."""
    a = cfg.algo
    load, step = a.opd_teacher_load, a.opd_teacher_ckpt_step
    megatron = _reads_torch_dist(cfg.train.train_backend)
    if step is not None:
        if not megatron:
            problems.append(
                "--opd-teacher-ckpt-step picks a step of a Megatron --opd-teacher-load save root: it needs "
                f"{_torch_dist_backends()}"
            )
            return
        from runtime.train.backends.megatron_paths import find_checkpoint

        try:
            find_checkpoint(load, step=step, flag="--opd-teacher-load")
        except ValueError as err:
            problems.append(f"{err} (--opd-teacher-ckpt-step {step})")
        return
    if os.path.isfile(os.path.join(load, "config.json")):
        return
    if not megatron:
        problems.append(
            f"--opd-teacher-load: {load!r} is not an HF model folder (no config.json); Megatron torch_dist "
            f"checkpoints need {_torch_dist_backends()}"
        )
    elif not _is_megatron_checkpoint(load, "--opd-teacher-load", problems):
        problems.append(
            f"--opd-teacher-load {load!r} is neither an HF folder (config.json) nor a Megatron torch_dist checkpoint "
            "(metadata.json, or a save root with latest_checkpointed_iteration.txt)"
        )


def _is_megatron_checkpoint(path: str, flag_name: str, problems: list[str]) -> bool:
    """Whether ``path`` is a Megatron torch_dist checkpoint (folder or save root); a save root naming a missing folder
    is a problem of its own."""
    from runtime.train.backends.megatron_paths import find_checkpoint

    if not os.path.isdir(path):
        return False
    try:
        return find_checkpoint(path, flag=flag_name) is not None
    except ValueError as err:
        problems.append(str(err))
        return True


def _not_creatable_dir(path: str) -> str | None:
    """Why ``path`` can neither be used nor created as a writable directory; None when it can."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        if not os.path.isdir(path):
            return "exists and is not a directory"
        return None if os.access(path, os.W_OK | os.X_OK) else "is a directory this user cannot write to"
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot be created: {parent!r} is a file"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: {parent!r} is not writable"
    return None


# The config.json fields that give a MoE model's routed experts (qwen3_moe, mixtral/olmoe, glm4_moe/deepseek_v3).
MOE_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


def _check_routing_replay(problems: list[str], cfg: Config) -> None:
    """``--use-routing-replay`` / ``--use-rollout-routing-replay`` replay experts: a model without them is refused."""
    a = cfg.algo
    if not (a.use_routing_replay or a.use_rollout_routing_replay):
        return
    shown = "--use-rollout-routing-replay" if a.use_rollout_routing_replay else "--use-routing-replay"
    if slime_compat.is_sft_job(cfg):
        # slime's sft_rollout reads samples from the data: no engine reports their experts (its fill_routing_replay
        # asserts on the missing rollout_routed_experts), and SFT runs no old-log-prob pass for R2 to record in.
        problems.append(
            f"{shown} replays routes an engine reported (R3) or an old-log-prob pass recorded (R2); an SFT job has "
            "neither (its samples come from the data): leave it out"
        )
        return
    if a.loss_type == "sft_loss" and not a.use_rollout_routing_replay:
        problems.append(
            "--use-routing-replay records routes in the old-log-prob pass, which --loss-type sft_loss does not run: "
            "use --use-rollout-routing-replay (the engine's routes) or leave it out"
        )
    if cfg.model.hf_checkpoint is None:
        problems.append(f"{shown} replays MoE routes; the built-in tiny model is dense (give a MoE --hf-checkpoint)")
        return
    hf = read_config_json(cfg.model.hf_checkpoint)
    text = hf.get("text_config", hf) if hf is not None else None
    if isinstance(text, dict) and not any(text.get(name) for name in MOE_EXPERT_FIELDS):
        problems.append(
            f"{shown} replays MoE routes; --hf-checkpoint {cfg.model.hf_checkpoint} is a dense "
            f"{text.get('model_type', 'model')} (no {'/'.join(MOE_EXPERT_FIELDS)} in its config.json)"
        )


def _check_unquantized_checkpoint(problems: list[str], cfg: Config) -> None:
    """A quantized ``--hf-checkpoint`` (DeepSeek-R1's released fp8 weights, with their ``weight_scale_inv`` tensors) is
    refused: both backends read its weights as the parameters they train, and the weight sync sends unquantized
    tensors to engines that would serve the quantized layout."""
    hf = read_config_json(cfg.model.hf_checkpoint) if cfg.model.hf_checkpoint else None
    quant = hf.get("quantization_config") if hf is not None else None
    if quant is None:
        return
    method = quant.get("quant_method", "quantized") if isinstance(quant, dict) else "quantized"
    problems.append(
        f"--hf-checkpoint {cfg.model.hf_checkpoint}: {method} weights (config.json's quantization_config); rlcore "
        "trains and syncs unquantized weights: give the bf16 copy of the checkpoint"
    )


def _check_combinations(problems: list[str], cfg: Config) -> None:
    _check_routing_replay(problems, cfg)
    _check_unquantized_checkpoint(problems, cfg)
    if cfg.rollout.rollout_max_response_len is None and not slime_compat.is_sft_job(cfg):
        problems.append(
            "--rollout-max-response-len has no default outside the built-in job (slime has none either): set the "
            "longest response to sample, e.g. --rollout-max-response-len 1024"
        )
    if cfg.train.keep_old_actor and (
        cfg.rollout.rollout_schedule != "one_step" or cfg.rollout.update_weights_interval != 1
    ):
        problems.append(
            "--keep-old-actor keeps the weights that sampled a one-step-async rollout (slime's train_async.py): it "
            "needs --async (--rollout-schedule one_step) and --update-weights-interval 1; under the sync schedule the "
            "actor's own weights sampled the rollout, and under fully_async a batch mixes weight versions"
        )
    if cfg.ckpt.save_interval is not None and cfg.ckpt.save is None and cfg.ckpt.save_hf is None:
        problems.append("--save-interval needs --save (the checkpoint directory) or --save-hf")
    if cfg.ckpt.save_hf is not None:
        try:
            cfg.ckpt.save_hf.format(rollout_id=0)
        except (KeyError, IndexError, ValueError) as err:
            problems.append(f"--save-hf {cfg.ckpt.save_hf!r}: a path formatted with {{rollout_id}} only ({err!r})")
    ref_load, ref_step = cfg.ckpt.ref_load, cfg.ckpt.ref_ckpt_step
    if ref_step is not None:
        if ref_load is None or not _reads_torch_dist(cfg.train.train_backend):
            problems.append(
                "--ref-ckpt-step picks a step of a Megatron --ref-load: it needs both --ref-load and "
                f"{_torch_dist_backends()}"
            )
        else:
            from runtime.train.backends.megatron_paths import find_checkpoint

            try:
                find_checkpoint(ref_load, step=ref_step, flag="--ref-load")
            except ValueError as err:
                problems.append(f"{err} (--ref-ckpt-step {ref_step})")
    if ref_load is not None and not os.path.isfile(os.path.join(ref_load, "config.json")):
        if not _reads_torch_dist(cfg.train.train_backend):
            problems.append(
                f"--ref-load {ref_load!r}: the {cfg.train.train_backend} backend loads the reference from an HF "
                f"folder (config.json and weights); Megatron torch_dist checkpoints need {_torch_dist_backends()}"
            )
        elif not _is_megatron_checkpoint(ref_load, "--ref-load", problems):
            problems.append(
                f"--ref-load {ref_load!r} is neither an HF folder (config.json) nor a Megatron torch_dist checkpoint "
                "(metadata.json, or a save root with latest_checkpointed_iteration.txt)"
            )
    start, total = cfg.ckpt.start_rollout_id, cfg.rollout.num_rollout
    if start is not None and (start < 0 or (total is not None and start >= total)):
        problems.append(f"--start-rollout-id {start} must be in [0, --num-rollout {total})")
    has_eval_data = cfg.eval.eval_prompt_data is not None or cfg.eval.eval_config is not None
    if cfg.eval.eval_interval is not None and cfg.data.prompt_data is not None and not has_eval_data:
        problems.append("--eval-interval with --prompt-data needs --eval-prompt-data")
    rm_type = cfg.reward.rm_type
    known = rm_type in RM_TYPES or (rm_type.startswith("boxed_") and rm_type[6:] in RM_TYPES[1:])
    if not known and cfg.reward.custom_rm_path is None:
        if rm_type.removeprefix("boxed_") in SLIME_RM_TYPES_NOT_BUILT:
            problems.append(f"--rm-type {rm_type}: slime's reward type is not built yet in rlcore-run (issue 13)")
        else:
            problems.append(
                f"--rm-type must be one of {', '.join(RM_TYPES)} or boxed_<type> (or use --custom-rm-path); got "
                f"{rm_type!r}"
            )
    if rm_type.removeprefix("boxed_") == "remote_rm" and not cfg.reward.rm_url and cfg.reward.custom_rm_path is None:
        problems.append("--rm-type remote_rm needs --rm-url (the reward server's URL)")
    sft = cfg.algo.loss_type == "sft_loss"  # (SFT samples carry reward 0: nothing is scored)
    if cfg.data.prompt_data is not None and rm_type == "builtin" and cfg.reward.custom_rm_path is None and not sft:
        problems.append(
            "--rm-type builtin scores the built-in task only; with --prompt-data choose --rm-type math or "
            "exact_match, or --custom-rm-path"
        )
    if cfg.algo.kl_loss_coef > 0 and not cfg.algo.use_kl_loss:
        problems.append(
            f"--kl-loss-coef {cfg.algo.kl_loss_coef} has no effect without --use-kl-loss (add it, or use --kl-coef "
            "for a KL penalty in the reward)"
        )
    a = cfg.algo
    if a.loss_agg_mode is not None and a.calculate_per_token_loss and a.loss_agg_mode != "token_mean":
        problems.append(
            "--calculate-per-token-loss is --loss-agg-mode token_mean; it contradicts --loss-agg-mode "
            f"{a.loss_agg_mode}"
        )
    kl_in_reward = a.kl_coef != 0 and a.advantage_estimator not in KL_COEF_IGNORED
    if a.ref_update_interval is not None and not a.use_kl_loss and not kl_in_reward:
        problems.append(
            "--ref-update-interval refreshes the reference model, which the job keeps only with --use-kl-loss or "
            "--kl-coef"
        )
    if a.use_opd:
        if a.opd_type is None:
            problems.append("--use-opd needs --opd-type megatron (a teacher model in the trainers) or sglang")
        elif a.opd_type == "sglang":
            if a.opd_teacher_load is not None:
                problems.append(
                    "--opd-teacher-load is for --opd-type megatron; with sglang the teacher is a server (as slime)"
                )
            teacher_filled = (
                cfg.reward.custom_rm_path is not None
                or cfg.rollout.custom_generate_function_path is not None
                or cfg.rollout.rollout_function_path not in (None, "slime.rollout.sglang_rollout.generate_rollout")
            )
            if not teacher_filled:
                problems.append(
                    "--opd-type sglang trains on each sample's teacher_log_probs, which a reward or generate function "
                    "sets: add --custom-rm-path slime.rollout.on_policy_distillation.reward_func "
                    "--custom-reward-post-process-path slime.rollout.on_policy_distillation.post_process_rewards "
                    "--rm-url http://<teacher>/generate (as slime's examples)"
                )
        elif a.opd_teacher_load is None:
            problems.append(
                "--opd-type megatron needs --opd-teacher-load (the teacher's HF folder; with --train-backend megatron "
                "also a torch_dist checkpoint)"
            )
        else:
            _check_opd_teacher(problems, cfg)
    elif a.opd_type is not None or a.opd_teacher_load is not None or a.opd_teacher_ckpt_step is not None:
        problems.append("--opd-type, --opd-teacher-load and --opd-teacher-ckpt-step take effect with --use-opd only")
    if a.num_critic_only_steps and a.advantage_estimator != "ppo":
        problems.append(
            f"--num-critic-only-steps {a.num_critic_only_steps} trains the critic, which only --advantage-estimator "
            "ppo has"
        )
    if a.use_rollout_logprobs and a.use_tis:
        problems.append(
            "--use-rollout-logprobs makes the engine's log-probs the old ones, leaving nothing for --use-tis to "
            "correct: use one of them (as slime)"
        )
    if a.kl_coef != 0 and a.kl_loss_coef != 0:
        problems.append(
            f"--kl-coef {a.kl_coef} (KL in the reward) and --kl-loss-coef {a.kl_loss_coef} (KL loss) cannot both be "
            "set, as in slime"
        )
    _check_model_shape(problems, cfg)
    _check_plugins(problems, cfg)
    _check_hook_combinations(problems, cfg)
    _check_offload(problems, cfg)
    _check_colocate(problems, cfg)
    _check_debug(problems, cfg)
    if cfg.log.use_wandb and importlib.util.find_spec("wandb") is None:
        problems.append("--use-wandb needs the wandb package (pip install 'rlcore[wandb]')")


def read_config_json(path: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(path, "config.json")) as fh:
            value = json.load(fh)
    except (OSError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


def installed(dotted: str) -> bool:
    """Whether the module ``dotted`` can be imported, found without importing it or its parents (``find_spec`` of
    ``a.b`` imports ``a``, and megatron's ``__init__`` imports torch)."""
    top, *rest = dotted.split(".")
    spec = importlib.util.find_spec(top)
    for part in rest:
        if spec is None or not spec.submodule_search_locations:
            return False
        spec = importlib.machinery.PathFinder.find_spec(part, list(spec.submodule_search_locations))
    return spec is not None


# The plug-in kinds: the flag that chooses one -> its registry of options modules and the loader of one. Each module
# declares ``OWN_FIELDS`` (its flags: refused under another choice) and, when it has rules, ``check(problems, cfg)``
# (run when it is chosen). Which flag belongs to which plug-in is the plug-ins' declaration, not a list kept here.
# A kind whose flag is unset is derived when the job starts (DERIVED_CHOICES: what it can be), or refuses nothing.
PLUGIN_KINDS: dict[str, tuple[Mapping[str, Any], Callable[[str], Any]]] = {
    "train_backend": (TRAIN_BACKEND_OPTIONS, backend_options),
    "rollout_engine": (ROLLOUT_ENGINE_OPTIONS, engine_options),
    "rollout_schedule": (SCHEDULE_OPTIONS, schedule_options),
    "update_weight_transport": (WEIGHT_SYNC_OPTIONS, weight_sync_options),
}
# The kinds whose flag, unset, is derived when the job starts: the choices the derivation can make for a config. A
# plug-in's own flag set while its plug-in is none of them would be ignored, so it is refused.
DERIVED_CHOICES: dict[str, Callable[[Config], tuple[str, ...]]] = {"update_weight_transport": derived_transports}
# The kinds whose plug-in runs only in some jobs: where none runs, no plug-in of the kind ignores a setting, so none
# is refused (the chosen one's rules still run). A weight sync runs only where both trainers and engines do.
RUNS: dict[str, Callable[[Config], bool]] = {"update_weight_transport": syncs_weights}


def _check_plugins(problems: list[str], cfg: Config) -> None:
    """A flag that a plug-in not chosen declares as its own, set away from its default, is refused (the chosen one
    would ignore it); the chosen plug-in's own rules run."""
    # The defaults of this kind of job (the built-in job has its own, --lora-modules-to-save among them).
    defaults = from_dict(hf_checkpoint=cfg.model.hf_checkpoint, prompt_data=cfg.data.prompt_data)
    for kind, (registry, options) in PLUGIN_KINDS.items():
        chosen = getattr(cfg, kind)
        if chosen is None and kind not in DERIVED_CHOICES:
            continue
        derived = DERIVED_CHOICES[kind](cfg) if chosen is None else ()
        runs = kind not in RUNS or RUNS[kind](cfg)
        for owner in registry if runs else ():
            if owner == chosen or owner in derived:
                continue
            # Unset and derived: the refusal says what the job gets instead, and how to have the owner.
            unset = f" (unset: {' or '.join(derived)} in this job; give {flag(kind)} {owner})" if derived else ""
            for name, what in options(owner).OWN_FIELDS.items():
                if getattr(cfg, name) != getattr(defaults, name):
                    shown = _SPECS[name][1].metadata.get("flag", flag(name))
                    problems.append(f"{shown}: {what}, used by {flag(kind)} {owner} only{unset}")
        if chosen is None:
            continue
        check = getattr(options(chosen), "check", None)
        if check is not None:
            check(problems, cfg)


def _check_model_shape(problems: list[str], cfg: Config) -> None:
    """The model-shape flags slime's scripts pass (any backend) agree with ``--hf-checkpoint``'s config.json (slime's
    _hf_validate_args); a config.json the Megatron backend cannot build is its own check's to report."""
    from runtime.train.backends import megatron_config

    hf = read_config_json(cfg.model.hf_checkpoint) if cfg.model.hf_checkpoint else None
    if hf is None:
        return
    source = f"--hf-checkpoint {cfg.model.hf_checkpoint}/config.json"
    try:
        shape = megatron_config.shape_from_hf(hf, source=source)
    except ValueError:
        return
    given = {name: getattr(cfg.model, name) for name in MODEL_SHAPE_FIELDS}
    problems.extend(megatron_config.shape_flag_problems(given, shape, source=source))


def _check_colocate(problems: list[str], cfg: Config) -> None:
    """``--colocate``'s rules, in one place: trainers and engines take turns on the same devices."""
    res, s = cfg.resources, cfg.sglang
    procs = res.num_trainer_procs
    if res.colocate and res.rollout_num_gpus != procs:
        problems.append(
            f"--colocate shares devices: --rollout-num-gpus {res.rollout_num_gpus} must equal --actor-num-nodes x "
            f"--actor-num-gpus-per-node = {procs}"
        )
    if s.update_weight_transport == "ipc" and not res.colocate:
        problems.append(
            "--update-weight-transport ipc shares the trainer's memory with engines on its own devices: it needs "
            "--colocate"
        )
    engine = cfg.rollout.rollout_engine
    for name in ("offload_rollout", "offload_train"):
        if res.colocate and ROLLOUT_ENGINES[engine].fixed_memory and getattr(s, name) is False:
            problems.append(
                f"--colocate shares devices between trainers and --rollout-engine {engine} engines, which hold a "
                f"fixed fraction of their GPU: it needs {flag(name)}"
            )
    if cfg.rollout.rollout_schedule != "sync" and res.colocate:
        problems.append(
            f"--rollout-schedule {cfg.rollout.rollout_schedule} (--async / --fully-async) overlaps rollout and "
            "training, which needs trainers and engines on separate devices: colocated mode (--colocate) stays "
            "synchronous"
        )


def _check_offload(problems: list[str], cfg: Config) -> None:
    s = cfg.sglang
    if s.offload and not (s.offload_train and s.offload_rollout):
        problems.append(
            "--offload turns --offload-train and --offload-rollout on: it cannot go with --no-offload-train or "
            "--no-offload-rollout"
        )
    for name in ("offload_rollout", "offload_train"):
        if getattr(s, name) and cfg.rollout.rollout_schedule != "sync":
            problems.append(
                f"{flag(name)} takes turns between rollout and training: it needs --rollout-schedule sync, not "
                f"{cfg.rollout.rollout_schedule}"
            )


def _check_hook_combinations(problems: list[str], cfg: Config) -> None:
    """slime's hook flags that need one another, or cannot run together here."""
    a, r, t = cfg.algo, cfg.rollout, cfg.train
    if a.loss_type == "custom_loss" and a.custom_loss_function_path is None:
        problems.append("--loss-type custom_loss needs --custom-loss-function-path")
    if a.custom_loss_function_path is not None and a.loss_type != "custom_loss":
        problems.append("--custom-loss-function-path takes effect with --loss-type custom_loss only")
    if a.disable_compute_advantages_and_returns and a.loss_type == "policy_loss":
        problems.append(
            "--disable-compute-advantages-and-returns leaves --loss-type policy_loss without advantages: use "
            "--loss-type sft_loss or custom_loss"
        )
    if t.only_train_params_name_list and t.freeze_params_name_list:
        problems.append("--only-train-params-name-list and --freeze-params-name-list: give one of them (as slime)")
    for name in ("only_train_params_name_list", "freeze_params_name_list"):
        for pattern in getattr(t, name) or []:
            try:
                re.compile(pattern)
            except re.error as err:
                problems.append(f"{flag(name)} {pattern!r}: not a regular expression ({err})")
    if (t.only_train_params_name_list or t.freeze_params_name_list) and t.lora_rank > 0:
        problems.append("--only-train-params-name-list / --freeze-params-name-list cannot go with --lora-rank")
    custom_rollout = r.rollout_function_path not in (None, "slime.rollout.sglang_rollout.generate_rollout")
    custom_source = cfg.data.data_source_path not in (None, "slime.rollout.data_source.RolloutDataSourceWithBuffer")
    if cfg.data.disable_rollout_global_dataset and not (custom_rollout or custom_source):
        problems.append(
            "--disable-rollout-global-dataset leaves the built-in rollout no prompts (the default data source then "
            "holds only groups put back with add_samples): give --rollout-function-path or --data-source-path"
        )
    if cfg.data.disable_rollout_global_dataset and r.num_epoch is not None:
        problems.append("--num-epoch counts passes over the prompt data, which --disable-rollout-global-dataset drops")
    if a.custom_tis_function_path is not None and not (a.use_tis or a.get_mismatch_metrics):
        problems.append(
            "--custom-tis-function-path is called with --use-tis or --get-mismatch-metrics only (as slime): set one"
        )
    if r.rollout_schedule == "fully_async":
        if custom_rollout:
            problems.append("--rollout-function-path runs whole rollouts: use --rollout-schedule sync or one_step")
        if r.rollout_all_samples_process_path is not None:
            problems.append(
                "--rollout-all-samples-process-path runs at the end of a rollout, which --fully-async has not"
            )


def _check_debug(problems: list[str], cfg: Config) -> None:
    d = cfg.debug
    unknown_targets = sorted(set(d.profile_target) - {"train_overall", "train_actor", "train_log_probs"})
    if unknown_targets:
        problems.append(
            f"--profile-target {' '.join(unknown_targets)}: choose from train_overall, train_actor, train_log_probs"
        )
    if set(d.profile_target) - {"train_overall"}:
        problems.append(
            "--profile-target train_actor / train_log_probs select what --use-pytorch-profiler (a Megatron flag, "
            "issue 11) traces; rlcore-run's profiling is the memory history of train_overall"
        )
    if d.memory_recorder == "memray":
        problems.append("--memory-recorder memray: memray is not a dependency of rlcore; use torch (the default)")
    if d.memory_snapshot_num_steps is not None and d.memory_snapshot_num_steps <= 0:
        problems.append(f"--memory-snapshot-num-steps must be > 0, got {d.memory_snapshot_num_steps}")
    if d.record_memory_history:
        import torch

        if not torch.cuda.is_available():
            problems.append("--record-memory-history records the CUDA allocator: this machine has no CUDA device")
    forge = cfg.rollout.rollout_function_path in FORGE_ROLLOUT_PATHS
    if d.load_forge_rollout_data is not None and not forge:
        problems.append(
            "--load-forge-rollout-data is read by slime's forge rollout: add --rollout-function-path "
            "slime.rollout.forge_load.generate_rollout"
        )
    if forge and d.load_forge_rollout_data is None:
        problems.append(
            f"--rollout-function-path {cfg.rollout.rollout_function_path} replays a saved rollout: it needs "
            "--load-forge-rollout-data"
        )
    for name, path in (
        ("save_debug_rollout_data", d.save_debug_rollout_data),
        ("load_debug_rollout_data", d.load_debug_rollout_data),
        ("load_forge_rollout_data", d.load_forge_rollout_data),
        ("save_debug_train_data", d.save_debug_train_data),
    ):
        if path is not None:
            try:
                path.format(rollout_id=0)
            except (KeyError, IndexError, ValueError) as err:
                problems.append(f"{flag(name)} {path!r}: a path formatted with {{rollout_id}} only ({err!r})")
    if d.rollout_data_path is not None and d.rollout_data_path == d.train_data_path:
        problems.append("--save-debug-train-data must differ from --save-debug-rollout-data")
    if d.load_debug_rollout_data_subsample is not None and not 0 < d.load_debug_rollout_data_subsample <= 1:
        problems.append(
            f"--load-debug-rollout-data-subsample must be in (0, 1], got {d.load_debug_rollout_data_subsample!r}"
        )
    sft = slime_compat.is_sft_job(cfg)  # slime's SFT: --debug-train-only trains on the dataset, with no engine
    if d.debug_train_only and d.load_debug_rollout_data is None and not sft:
        problems.append(
            "--debug-train-only trains on saved rollouts: it needs --load-debug-rollout-data (or slime's SFT rollout, "
            "--rollout-function-path slime.rollout.sft_rollout.generate_rollout)"
        )
    if d.debug_rollout_only and d.train_only:
        problems.append("--debug-rollout-only and --debug-train-only (--load-debug-rollout-data) exclude each other")
    if d.debug_rollout_only and (cfg.ckpt.save is not None or cfg.ckpt.save_hf is not None):
        problems.append("--debug-rollout-only trains nothing: it cannot go with --save or --save-hf")
    replaying = d.debug_rollout_only or (d.train_only and not sft)
    if replaying and (cfg.ckpt.load is not None or cfg.train.sft_warmup_steps):
        problems.append(
            "the debug modes (--debug-rollout-only, --debug-train-only, --load-debug-rollout-data) start from "
            "--hf-checkpoint: they cannot go with --load or --sft-warmup-steps"
        )


def validate(cfg: Config) -> Config:
    """Return ``cfg`` if its settings work together; raise ``ConfigError`` listing every problem otherwise."""
    if not isinstance(cfg, Config):
        raise TypeError(f"cfg must be a runtime.config.Config, got {type(cfg).__name__}")
    problems: list[str] = []
    types, bounds = _type_problems({name: getattr(cfg, name) for name in _SPECS})
    if types:
        # Range and consistency checks assume well-typed values.
        raise ConfigError(types)
    problems += bounds
    _check_core_ranges(problems, cfg)
    _check_positive(problems, cfg)
    if problems:
        # The batch arithmetic below divides by these sizes.
        raise ConfigError(problems)
    _check_required(problems, cfg)
    if not problems:
        _check_batches(problems, cfg)
    _check_paths(problems, cfg)
    _check_combinations(problems, cfg)
    if problems:
        raise ConfigError(problems)
    return cfg
