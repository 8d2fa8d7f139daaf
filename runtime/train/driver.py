"""A step's training seen from the driver: the rollout's samples turned into one train batch with its sequence
advantages (slime's conversion and reward hooks included), handed to the trainers, and their metrics named for the
log; and the optional SFT warm-up before the first step."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from rlcore import keys
from rlcore.advantages import sequence_advantages
from runtime import demo
from runtime.cluster.trainers import TrainerGroup
from runtime.config import Config, teacher_from_samples, top_p_replay
from runtime.rollout.plugins import RolloutHooks
from runtime.rollout.sample import Sample
from runtime.train.algo import needs_rollout_log_probs
from runtime.train.batch import PROMPT_LENGTHS, RESPONSE_LENGTHS, ROLLOUT_INDEX, balanced_order, build_batch


def train_step(
    cfg: Config, trainers: TrainerGroup, rollout: Any, tokenizer: Any, adv_cfg: Any, hooks: RolloutHooks | None = None
) -> dict[str, float]:
    """One step's training on ``rollout``: its batch, the trainers' optimizer steps, then slime's per-step extras
    (optimizer reset, reference refresh, the batch saved for debugging); returns the metrics."""
    batch = rollout_batch(cfg, rollout.samples, tokenizer, adv_cfg, hooks)
    if cfg.data.balance_data and int(batch[ROLLOUT_INDEX].max()) + 1 == batch.batch_size[0]:
        # (Rows of rollouts split by a custom generate function keep their order: steps are cut by rollout.)
        lengths = (batch[PROMPT_LENGTHS] + batch[RESPONSE_LENGTHS]).tolist()
        dp_size = cfg.resources.num_trainer_procs
        batch = batch[balanced_order(lengths, global_batch_size=cfg.train.global_batch_size, dp_size=dp_size)]
    if cfg.debug.train_data_path is not None:
        path = Path(cfg.debug.train_data_path.format(rollout_id=rollout.step))
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"rollout_id": rollout.step, "batch": batch.to_dict()}, path)
    # slime's --num-critic-only-steps: the first rollouts train the critic alone (ppo).
    train_actor = rollout.step >= cfg.algo.num_critic_only_steps
    metrics = train_metrics(
        trainers.train_rollout(
            batch,
            global_batch_size=cfg.train.global_batch_size,
            adv_cfg=adv_cfg,
            use_rollout_log_probs=cfg.algo.use_rollout_logprobs,
            train_actor=train_actor,
            rollout_id=rollout.step,
        )
    )
    done = rollout.step + 1
    if cfg.algo.reset_optimizer_states:
        trainers.call("reset_optimizer")
    if train_actor and cfg.algo.ref_update_interval is not None and done % cfg.algo.ref_update_interval == 0:
        trainers.call("update_reference")
    return metrics


def rollout_batch(cfg: Config, samples: list[Sample], tokenizer: Any, adv_cfg: Any, hooks: RolloutHooks | None) -> Any:
    """The train batch of ``samples`` with its sequence advantages. slime's hooks: ``--custom-convert-samples-to-
    train-data-path`` builds the train data itself (its ``rewards`` are final: no group normalisation follows);
    ``--custom-reward-post-process-path`` gives ``(raw_rewards, rewards)`` in place of the group normalisation."""
    pad = tokenizer.pad_token_id
    need_lps = needs_rollout_log_probs(cfg)
    if cfg.algo.disable_compute_advantages_and_returns or cfg.algo.loss_type == "sft_loss":
        adv_cfg = None  # (SFT, custom losses: no advantages)
    if hooks is not None and hooks.convert_samples is not None:
        data = hooks.convert_samples(cfg, samples)
        batch = build_batch(
            samples_from_train_data(hooks.convert_samples, data, samples),
            pad_token_id=pad,
            require_rollout_log_probs=need_lps,
            top_p_replay=top_p_replay(cfg),
            teacher_log_probs=teacher_from_samples(cfg),
            routed_experts=cfg.algo.use_rollout_routing_replay,
        )
        return (
            batch
            if adv_cfg is None
            else sequence_advantages(batch, dataclasses.replace(adv_cfg, group_normalize=False))
        )
    post_processed = None
    if adv_cfg is not None and hooks is not None and hooks.reward_post_process is not None:
        # Before the batch is built: a post-process may set sample fields the batch reads (slime's OPD pair sets
        # teacher_log_probs there).
        post_processed = hooks.reward_post_process(cfg, samples)
        out = post_processed
        if not (isinstance(out, tuple | list) and len(out) == 2 and len(out[1]) == len(samples)):
            raise hooks.reward_post_process.wrong_type(out, f"(raw_rewards, rewards) with {len(samples)} rewards each")
    batch = build_batch(
        samples,
        pad_token_id=pad,
        require_rollout_log_probs=need_lps,
        reward_key=cfg.reward.reward_key,
        top_p_replay=top_p_replay(cfg),
        teacher_log_probs=teacher_from_samples(cfg),
        routed_experts=cfg.algo.use_rollout_routing_replay,
    )
    if adv_cfg is None:
        return batch
    if post_processed is not None:
        batch.set(keys.REWARDS, torch.tensor([float(x) for x in post_processed[1]], dtype=torch.float32))
        return sequence_advantages(batch, dataclasses.replace(adv_cfg, group_normalize=False))
    return sequence_advantages(batch, adv_cfg)


def samples_from_train_data(hook: Any, data: Any, samples: list[Sample]) -> list[Sample]:
    """Samples holding what a slime train-data dict says (``tokens``, ``response_lengths``, ``rewards``, and when
    given ``loss_masks``, ``rollout_log_probs``, ``rollout_ids``); rows keep their sample's group when they are as
    many as the samples."""
    required = ("tokens", "response_lengths", "rewards")
    if not isinstance(data, dict) or any(k not in data for k in required):
        raise hook.wrong_type(data, f"a dict with {', '.join(required)} (slime's train data)")
    n = len(data["tokens"])
    out = []
    for i in range(n):
        s = Sample(
            tokens=[int(t) for t in data["tokens"][i]],
            response_length=int(data["response_lengths"][i]),
            reward=float(data["rewards"][i]),
            group_index=samples[i].group_index if n == len(samples) else i,
            index=samples[i].index if n == len(samples) else i,
        )
        if "loss_masks" in data:
            s.loss_mask = [int(m) for m in data["loss_masks"][i]]
        if "rollout_log_probs" in data:
            s.rollout_log_probs = [float(x) for x in data["rollout_log_probs"][i]]
        if "rollout_ids" in data:
            s.rollout_id = int(data["rollout_ids"][i])
        out.append(s)
    return out


def train_metrics(raw: dict[str, float]) -> dict[str, float]:
    """The trainers' ``rl_loss`` metrics under ``train/`` (the critic's under ``train/critic/``); ``train/kl`` is the
    KL to the reference model when one is kept, else the KL between the sampling and the updated policy (slime's
    ppo_kl); absent on a step that trains the critic only. Timings (``perf/...``) and rollout statistics
    (``rollout/...``) keep their names."""
    out = {
        name if name.startswith(("perf/", "rollout/")) else f"train/{name}": value
        for name, value in raw.items()
        if name != "advantage_abs_mean"
    }
    kl = raw.get("approx_kl_ref", raw.get("approx_kl_old"))
    if kl is not None:  # (SFT and custom losses have none)
        out["train/kl"] = kl
    if "advantage_abs_mean" in raw:
        out["rollout/advantage_abs_mean"] = raw["advantage_abs_mean"]
    return out


def sft_warmup(cfg: Config, trainers: TrainerGroup, tokenizer: Any) -> list[float]:
    """Optional SFT steps on the demo task's format examples (digits of the right length, drawn at random)."""
    losses = []
    for step in range(cfg.train.sft_warmup_steps):
        samples = demo.sft_warmup_samples(tokenizer, cfg.train.global_batch_size, seed=cfg.seed + 7919 * (step + 1))
        losses.append(trainers.sft_train(build_batch(samples, pad_token_id=tokenizer.pad_token_id))["sft_loss"])
    print(f"SFT warm-up: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return losses
