"""The job's model and data, prepared before Ray starts: the model folder and tokenizer, the prompt and evaluation
datasets (checked against the reward and the token budget), ``--num-epoch``'s step count, and the data source the
rollout draws from."""

from __future__ import annotations

import dataclasses
from typing import Any

from runtime import demo
from runtime.cluster import checkpoint
from runtime.config import Config, ConfigError, EvalDataset, eval_datasets, resolve_eval_dataset
from runtime.evaluation import eval_data_config, eval_hub_config
from runtime.rollout.data import PromptDataset
from runtime.rollout.plugins import BufferedPromptSource, DataSourceFeed, RolloutHooks
from runtime.rollout.rewards import check_label_types
from runtime.rollout.sample import Sample
from runtime.rollout.source import PromptFeed
from runtime.slime_compat import num_rollout_of_epochs, train_iters

# Skipped data rows printed at start (the rest are counted).
MAX_REPORTED_ROWS = 10


def prepare_model_and_data(
    cfg: Config,
) -> tuple[str, Any, PromptDataset, list[tuple[EvalDataset, list[Sample]]] | None]:
    """The model folder, its tokenizer, the prompt dataset and the evaluation datasets with their prompts (None
    without eval).

    Without ``--hf-checkpoint`` the demo's tiny model is built into ``output_dir/base_model`` and loaded from there
    like any checkpoint; without ``--prompt-data`` the prompts are the demo task's. What was dropped or skipped is
    printed (``PromptDataset.report``); a prompt that does not fit the model's context is a bad row (``--on-bad-row``:
    refused, or dropped and counted with the over-long ones). Data errors, and a ``--max-tokens-per-gpu`` too small
    for the longest prompt plus ``--rollout-max-response-len``, raise here, before Ray starts.
    """
    from transformers import AutoTokenizer

    model_path = cfg.model.hf_checkpoint or demo.base_model(cfg.output_dir, seed=cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    context = model_context(model_path)
    eval_sets: list[tuple[EvalDataset, PromptDataset]] = []
    has_eval_data = cfg.eval.eval_prompt_data is not None or cfg.eval.eval_config is not None
    if cfg.data.prompt_data is None:
        dataset, demo_eval = demo.prompt_datasets(tokenizer, cfg.data, seed=cfg.seed)
        if cfg.eval.eval_interval is not None and not has_eval_data:
            eval_sets.append((resolve_eval_dataset(cfg, {"name": "builtin", "path": ""}), demo_eval))
    else:
        dataset = PromptDataset(
            cfg.data.prompt_data,
            tokenizer,
            cfg.data,
            seed=cfg.data.rollout_seed,
            max_context=context,
            messages=cfg.algo.loss_type == "sft_loss",
        )
    if cfg.eval.eval_interval is not None and has_eval_data:
        for d in eval_datasets(cfg):
            config = eval_data_config(cfg, d)
            eval_sets.append(
                (d, PromptDataset(d.path, tokenizer, config, seed=cfg.data.rollout_seed, max_context=context))
            )
    datasets = (dataset, *(ds for _, ds in eval_sets))
    check_label_types(dataset.labels(), cfg.reward, label_key=cfg.data.label_key, source=dataset.source)
    for d, ds in eval_sets:
        check_label_types(ds.labels(), eval_hub_config(cfg, d), label_key=d.label_key, source=ds.source)
    for ds in datasets:
        print("\n".join(ds.report(max_rows=MAX_REPORTED_ROWS)), flush=True)
    budget = cfg.train.max_tokens_per_gpu
    if budget is not None:
        longest = max(ds.max_prompt_tokens for ds in datasets)
        need = longest + max([cfg.rollout.rollout_max_response_len] + [d.max_response_len for d, _ in eval_sets])
        if budget < need:
            raise ConfigError(
                [
                    f"--max-tokens-per-gpu {budget} cannot hold the longest sample: a prompt of {longest} tokens + "
                    f"--rollout-max-response-len {cfg.rollout.rollout_max_response_len} = {need} (raise the budget, "
                    "or drop long prompts with --rollout-max-prompt-len)"
                ]
            )
    evals = []
    for d, ds in eval_sets:
        prompts = ds.next_batch(len(ds))
        for sample in prompts:
            sample.metadata = {**sample.metadata, **d.metadata_overrides}
        evals.append((d, prompts))
    return model_path, tokenizer, dataset, evals or None


def model_context(model_path: str) -> int | None:
    """The model's context length in tokens (``max_position_embeddings`` of its text config), None if it has none."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "max_position_embeddings", None)


def resolve_num_rollout(cfg: Config, dataset_size: int) -> Config:
    """``cfg`` with ``--num-rollout`` set: as given, or slime's ``--num-epoch`` x whole rollouts per pass; and
    ``--lr-decay-iters``, when unset, derived from it as slime does (runtime.slime_compat.train_iters)."""
    r, t = cfg.rollout, cfg.train
    if r.num_rollout is not None:
        return cfg
    if dataset_size // r.rollout_batch_size == 0:
        raise ConfigError(
            [
                f"--num-epoch: the prompt data holds {dataset_size} prompts, fewer than --rollout-batch-size "
                f"{r.rollout_batch_size}: set --num-rollout"
            ]
        )
    num_rollout = num_rollout_of_epochs(
        num_epoch=r.num_epoch, dataset_size=dataset_size, rollout_batch_size=r.rollout_batch_size
    )
    sizes = dict(rollout_batch_size=r.rollout_batch_size, n_samples_per_prompt=r.n_samples_per_prompt)
    decay = t.lr_decay_iters or train_iters(num_rollout=num_rollout, global_batch_size=t.global_batch_size, **sizes)
    return dataclasses.replace(
        cfg,
        rollout=dataclasses.replace(r, num_rollout=num_rollout),
        train=dataclasses.replace(t, lr_decay_iters=decay),
    )


def job_data_source(cfg: Config, dataset: Any, hooks: RolloutHooks) -> tuple[Any, Any]:
    """``(feed, data_source)``: the built-in rollout's prompt feed and the data source that rollout functions and
    slime's hooks are handed: ``--data-source-path``'s class built as ``cls(args)`` (the feed draws from it), or the
    prompt data with a buffer over the feed (the buffer alone with ``--disable-rollout-global-dataset``)."""
    if hooks.data_source_cls is not None:
        if cfg.ckpt.load is not None and checkpoint.is_job_checkpoint(cfg.ckpt.load):
            # slime's data sources read their state from args.load/rollout/...: the checkpoint root, also when
            # --load names one step's folder.
            root = checkpoint.resolve(cfg.ckpt.load).parent
            cfg = dataclasses.replace(cfg, ckpt=dataclasses.replace(cfg.ckpt, load=str(root)))
        data_source = hooks.data_source_cls(cfg)
        for method in ("get_samples", "add_samples", "save", "load", "__len__"):
            if not callable(getattr(data_source, method, None)):
                raise hooks.data_source_cls.bad_result(f"built an object without {method}() (slime's DataSource)")
        return DataSourceFeed(data_source, dataset), data_source
    feed = PromptFeed(dataset)
    source = BufferedPromptSource(
        None if cfg.data.disable_rollout_global_dataset else feed,
        cfg,
        n_samples=cfg.rollout.n_samples_per_prompt,
        buffer_filter=hooks.buffer_filter,
    )
    return feed, source
