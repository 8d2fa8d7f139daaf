"""``rlcore-run``: parse the config, print it, run the job. With no arguments: the built-in CPU demo job.

``--dry-run`` stops after the config: it is parsed, validated and resolved, printed with the derived settings and the
placement plan, and the command exits 0 (2 with the problems listed) without starting Ray or loading a model.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence

from runtime.config import Config, ConfigError, _tree_value, eval_datasets, format_config, parse_args, read_yaml_tree
from runtime.errors import JobError, JobInterrupted
from runtime.hooks import HookError
from runtime.slime_compat import backend_choice, switches_in
from runtime.train.algo import advantage_config, check_supported, loss_config, model_roles

# Exit status of a job that could not start because of its inputs (argparse uses 2 for bad flags too).
EXIT_BAD_INPUT = 2
# Exit status of a job that started and stopped for a reason the user must fix (runtime.errors.JobError).
EXIT_JOB_STOPPED = 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = parse_args(argv)
        if "--dry-run" in argv:
            check_supported(cfg)
    except ConfigError as err:
        print(f"rlcore-run: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(format_config(cfg), flush=True)
    if "--dry-run" in argv:
        print(dry_run_report(cfg, argv=argv), flush=True)
        return 0

    import transformers

    from runtime.loop import run
    from runtime.rollout.data import DataError

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        result = run(cfg, progress=sys.stdout.isatty())
    except (ConfigError, DataError, HookError) as err:
        print(f"rlcore-run: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except JobInterrupted as err:
        print(f"rlcore-run: {err}", file=sys.stderr)
        return 128 + err.signum
    except KeyboardInterrupt:  # Ctrl-C before the job installed its handlers (model and data being prepared)
        print("rlcore-run: stopped by SIGINT", file=sys.stderr)
        return 128 + signal.SIGINT
    except JobError as err:
        print(f"rlcore-run: {err}", file=sys.stderr)
        return EXIT_JOB_STOPPED
    print(f"rlcore-run: done, {result.final_step} steps; outputs in {result.output_dir}", flush=True)
    return 0


def dry_run_report(cfg: Config, *, argv: Sequence[str] = ()) -> str:
    """What a run would derive from ``cfg`` (parsed from ``argv``) before starting anything: the training backend and
    why, batch arithmetic, the algorithm's settings, the model roles and the placement plan."""
    from runtime.cluster.bundles import plan_bundles
    from runtime.cluster.plan import describe

    r, t, a = cfg.rollout, cfg.train, cfg.algo
    per_rollout = r.rollout_batch_size * r.n_samples_per_prompt
    num_rollout = r.num_rollout if r.num_rollout is not None else f"--num-epoch {r.num_epoch} x (prompts // batch)"
    plan = plan_bundles(cfg)
    lines = [
        "[dry run: resolved]",
        f"  job                    {'built-in task' if cfg.is_builtin_job else 'prompt data / model given'}",
        f"  train backend          {_train_backend(cfg, argv)}",
        f"  rollout steps          {num_rollout}",
        f"  rollout schedule       {r.rollout_schedule}",
        f"  lr decay iters         {_lr_decay_iters(cfg)}",
        f"  samples per rollout    {per_rollout} ({r.rollout_batch_size} prompts x {r.n_samples_per_prompt})",
        f"  optimizer steps/rollout {per_rollout // t.global_batch_size} (global batch {t.global_batch_size})",
        f"  loss aggregation       {a.aggregation}",
        f"  advantages             {advantage_config(cfg)}",
        f"  loss                   {loss_config(cfg)}",
        f"  model roles            {', '.join(role.name for role in model_roles(cfg))}",
        f"  evaluation             {_evaluation(cfg)}",
        "[dry run: placement plan]",
        f"  plan                   {describe(cfg)}",
        f"  bundles                {plan.n_bundles} (one device each; on a CPU, one process slot)",
        f"  trainer bundles        {plan.trainer_bundles} ({cfg.train.train_backend} backend)",
        f"  engine bundles         {plan.engine_bundles} ({cfg.rollout.rollout_engine} engine, share {plan.share})",
        *([f"  pipeline stages        {stages}"] if (stages := _pipeline_stages(cfg)) else []),
        "rlcore-run: dry run, nothing started",
    ]
    return "\n".join(lines)


def _pipeline_stages(cfg: Config) -> str | None:
    """The Megatron backend's pipeline stages and the decoder layers of each (None without pipeline parallelism)."""
    t = cfg.train
    if t.train_backend != "megatron" or t.pipeline_model_parallel_size == 1:
        return None
    from runtime.config.checks import read_config_json
    from runtime.train.backends import megatron_config as mc

    first, last = t.decoder_first_pipeline_num_layers, t.decoder_last_pipeline_num_layers
    hf = read_config_json(cfg.model.hf_checkpoint) if cfg.model.hf_checkpoint else None
    if hf is None:
        given = [f"the {side} {count} layers" for side, count in (("first", first), ("last", last)) if count]
        return (
            f"{t.pipeline_model_parallel_size} stages: {', '.join([*given, 'the others equal shares'])} (no "
            "--hf-checkpoint to count the layers)"
        )
    sizes = mc.pipeline_stage_sizes(
        mc.shape_from_hf(hf).num_layers, pp_size=t.pipeline_model_parallel_size, first=first, last=last
    )
    starts = [sum(sizes[:r]) for r in range(len(sizes))]
    return "; ".join(
        f"stage {r}: layers {start}-{start + size - 1} ({size})"
        for r, (start, size) in enumerate(zip(starts, sizes, strict=True))
    )


def _train_backend(cfg: Config, argv: Sequence[str]) -> str:
    """The backend and why: given on the command line or in --config, or inferred as slime runs a script."""
    given = any(arg.split("=", 1)[0] == "--train-backend" for arg in argv)
    config = next((argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--config"), None)
    if not given and config is not None and _tree_value(read_yaml_tree(config), "train_backend") is not None:
        return f"{cfg.train.train_backend} (--train-backend given in --config)"
    choice = backend_choice(cfg, given=cfg.train.train_backend if given else None, switches=switches_in(argv))
    return f"{choice.name} ({choice.why})"


def _lr_decay_iters(cfg: Config) -> str:
    r, t = cfg.rollout, cfg.train
    if t.lr_decay_iters is not None:
        return str(t.lr_decay_iters)
    if r.num_epoch is not None:
        return (
            f"at the start, as slime: --num-epoch {r.num_epoch} x (dataset rows // {r.rollout_batch_size}) rollouts "
            f"x {r.rollout_batch_size * r.n_samples_per_prompt} samples // global batch {t.global_batch_size}"
        )
    return "none"


def _evaluation(cfg: Config) -> str:
    if cfg.eval.eval_prompt_data is None and cfg.eval.eval_config is None:
        return "built-in task" if cfg.eval.eval_interval is not None else "none"
    return "; ".join(
        f"{d.name}: {d.path} (n {d.n_samples_per_eval_prompt}, T {d.temperature}, top-p {d.top_p}, "
        f"max {d.max_response_len} tokens, reward {d.custom_rm_path or d.rm_type or cfg.reward.rm_type})"
        for d in eval_datasets(cfg)
    )


if __name__ == "__main__":
    sys.exit(main())
