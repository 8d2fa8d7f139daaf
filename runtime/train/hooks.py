"""slime's trainer-side hooks, resolved inside each trainer process, and the slime-shaped views they are handed.

slime calls these on its Megatron ranks with per-sample lists (``rollout_data``, a micro-batch ``batch``) and a
packed ``[1, T, V]`` logits tensor; here they run on every trainer rank over its shard, with the same names and
shapes built from the batch contract:

- ``--custom-advantage-function-path`` ``fn(args, rollout_data)`` sets ``rollout_data["advantages"]`` and
  ``["returns"]`` (one ``[R_i]`` tensor per sample), after the log-prob recompute, in place of the estimator;
- ``--rollout-data-postprocess-path`` ``fn(args, rollout_id, rollout_data)`` after log-probs and advantages, before
  the optimizer steps; what it writes to ``advantages``, ``returns`` and ``loss_masks`` is trained on;
- ``--custom-loss-function-path`` (``--loss-type custom_loss``) ``fn(args, batch, logits, sum_of_sample_mean) ->
  (loss, metrics)`` per micro-batch, ``logits`` the rows' logits packed as ``[1, sum(total_lengths), V]``;
  :func:`get_log_probs_and_entropy` is the counterpart of slime's helper of that name;
- ``--custom-pg-loss-reducer-function-path`` ``fn(total_lengths, response_lengths, loss_masks,
  calculate_per_token_loss) -> reducer``: the policy term's reducer over the concatenated response tokens;
- ``--custom-tis-function-path`` ``fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks,
  total_lengths, response_lengths) -> (pg_loss, modified_masks, metrics)`` per micro-batch, with ``--use-tis`` or
  ``--get-mismatch-metrics``, in place of the built-in correction: ``pg_loss`` the concatenated per-token policy loss,
  the log-probs and masks one tensor per sample; the returned masks drop tokens from the numerators of the policy,
  KL and entropy terms (the denominators stay the original masks'), each metric is a per-token tensor reported as a
  token mean;
- ``--custom-megatron-init-path`` ``fn(args)``, ``--custom-megatron-before-log-prob-hook-path`` ``fn(args, model,
  store_prefix)`` and ``--custom-megatron-before-train-step-hook-path`` ``fn(args, rollout_id, step_id, model,
  optimizer, opt_param_scheduler)``: under the torch backend ``model`` is the trained ``torch.nn.Module`` (FSDP2
  wrapped with several ranks), ``optimizer`` its ``torch.optim.AdamW`` and ``opt_param_scheduler`` None (the learning
  rate is constant).

A reducer or a ``sum_of_sample_mean`` returns, as in slime, a sum of per-sample means (or with
``--calculate-per-token-loss`` a token sum); the runtime divides it by the global batch's sample (token) count, so a
micro-batch's loss is its share of the step's loss, as slime's ``loss_function`` scales it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from rlcore import keys
from rlcore.kernels import logprobs_entropy
from runtime.hooks import Hook, resolve_hook, split_function_path

# Hook fields of the config that run in the trainers, by their flag's field name.
TRAINER_HOOK_FIELDS = (
    "custom_advantage_function_path",
    "rollout_data_postprocess_path",
    "custom_loss_function_path",
    "custom_pg_loss_reducer_function_path",
    "custom_tis_function_path",
    "custom_megatron_init_path",
    "custom_megatron_before_log_prob_hook_path",
    "custom_megatron_before_train_step_hook_path",
    "custom_model_provider_path",
)

# slime's store prefixes, by the key a model's log-probs are written to: "" for the actor, "ref_" for the reference,
# "teacher_" for the teacher (the before-log-prob hook is handed it).
STORE_PREFIX = {keys.OLD_LOG_PROBS: "", keys.REF_LOG_PROBS: "ref_", keys.TEACHER_LOG_PROBS: "teacher_"}


@dataclass(frozen=True)
class TrainHooks:
    """What the trainer ranks need of slime's trainer-side hooks: the job's config (slime's ``args``), the hook paths
    (file paths made absolute on the driver) with the driver's working directory for module paths, and the loss
    settings they go with."""

    args: Any = None
    cwd: str = ""
    paths: dict[str, str] = field(default_factory=dict)
    loss_type: str = "policy_loss"
    compute_advantages: bool = True
    per_token_loss: bool = False
    only_train: tuple[str, ...] = ()
    freeze: tuple[str, ...] = ()
    rollout_entropy: bool = False
    # MoE routing replay (--use-rollout-routing-replay / --use-routing-replay): "rollout" replays the engine's routes
    # (the batch's ROUTED_EXPERTS), "trainer" records the actor's own in the old-log-prob pass and replays those.
    routing_replay: str | None = None

    def resolve(self) -> dict[str, Hook]:
        """Import every hook (in this process); the driver resolved them already, so this fails only when the
        trainer's environment differs from the driver's."""
        if self.cwd and self.cwd not in sys.path:
            sys.path.insert(0, self.cwd)
        from runtime.config import flag

        return {name: resolve_hook(flag(name), path) for name, path in self.paths.items()}


def train_hooks(cfg: Any) -> TrainHooks:
    """The :class:`TrainHooks` of ``cfg`` (built on the driver)."""
    paths = {}
    for name in TRAINER_HOOK_FIELDS:
        path = getattr(cfg, name)
        if path:
            target, attr, is_file = split_function_path(path)
            paths[name] = f"{os.path.abspath(target)}:{attr}" if is_file else path
    a, t = cfg.algo, cfg.train
    return TrainHooks(
        args=cfg,
        cwd=os.getcwd(),
        paths=paths,
        loss_type=a.loss_type,
        compute_advantages=not a.disable_compute_advantages_and_returns and a.loss_type != "sft_loss",
        per_token_loss=a.aggregation == "token_mean",
        only_train=tuple(t.only_train_params_name_list or ()),
        freeze=tuple(t.freeze_params_name_list or ()),
        rollout_entropy=a.use_rollout_entropy,
        routing_replay=routing_replay(a),
    )


def routing_replay(algo: Any) -> str | None:
    """Which routes the actor replays: ``"rollout"`` (R3, ``--use-rollout-routing-replay``, which implies
    ``--use-routing-replay`` as in slime), ``"trainer"`` (R2, ``--use-routing-replay`` alone), or None."""
    if algo.use_rollout_routing_replay:
        return "rollout"
    return "trainer" if algo.use_routing_replay else None


def freeze_parameters(
    model: torch.nn.Module, *, only_train: tuple[str, ...] = (), freeze: tuple[str, ...] = ()
) -> int:
    """slime's ``--only-train-params-name-list`` (every parameter frozen but those a pattern ``re.search``-matches)
    and ``--freeze-params-name-list`` (those matched frozen), over ``model.named_parameters()``; returns how many
    parameters stay trainable. Raises when nothing would be trained."""
    import re

    for name, param in model.named_parameters():
        if only_train:
            param.requires_grad_(any(re.search(p, name) for p in only_train))
        if freeze and any(re.search(p, name) for p in freeze):
            param.requires_grad_(False)
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    if trainable == 0:
        names = [n for n, _ in model.named_parameters()][:4]
        raise ValueError(
            f"--only-train-params-name-list {list(only_train)} / --freeze-params-name-list {list(freeze)} leave no "
            f"parameter to train (names look like {names})"
        )
    return trainable


# -- slime's per-sample views --------------------------------------------------------------------------------------

TOKENS, PROMPT_LENGTHS, RESPONSE_LENGTHS = "tokens", "prompt_lengths", "response_lengths"


def _rows(td: TensorDict, key: str, lengths: list[int]) -> list[torch.Tensor]:
    values = td[key]
    return [values[i, :r] for i, r in enumerate(lengths)]


def rollout_data_view(td: TensorDict) -> dict[str, Any]:
    """slime's ``rollout_data`` of a shard: lists with one entry per sample (response-length tensors for the token
    keys). ``rewards`` are what the advantages start from (the group-normalised rewards of a group estimator),
    ``raw_reward`` the rewards as scored."""
    response = td[RESPONSE_LENGTHS].tolist()
    total = (td[PROMPT_LENGTHS] + td[RESPONSE_LENGTHS]).tolist()
    data: dict[str, Any] = {
        "tokens": [td[TOKENS][i, :n] for i, n in enumerate(total)],
        "response_lengths": response,
        "total_lengths": total,
        "loss_masks": [m.int() for m in _rows(td, keys.MASK, response)],
        "raw_reward": td[keys.REWARDS].tolist(),
        "rewards": (
            td[keys.SEQUENCE_ADVANTAGES] if keys.SEQUENCE_ADVANTAGES in td.keys() else td[keys.REWARDS]
        ).tolist(),
        "rollout_mask_sums": td[keys.SEQ_TOKEN_COUNTS].tolist() if keys.SEQ_TOKEN_COUNTS in td.keys() else None,
    }
    for ours, theirs in (
        (keys.OLD_LOG_PROBS, "log_probs"),
        (keys.REF_LOG_PROBS, "ref_log_probs"),
        (keys.ROLLOUT_LOG_PROBS, "rollout_log_probs"),
        (keys.TEACHER_LOG_PROBS, "teacher_log_probs"),
        (keys.ADVANTAGES, "advantages"),
        (keys.RETURNS, "returns"),
        (keys.OLD_ENTROPY, "entropy"),
        (keys.REF_ENTROPY, "ref_entropy"),
    ):
        if ours in td.keys():
            data[theirs] = _rows(td, ours, response)
    return data


def _padded(hook: Hook, values: Any, name: str, lengths: list[int], like: torch.Tensor) -> torch.Tensor:
    if not isinstance(values, list | tuple) or len(values) != len(lengths):
        raise hook.bad_result(f"left rollout_data[{name!r}] {type(values).__name__}, expected one tensor per sample")
    out = torch.zeros_like(like, dtype=torch.float32)
    for i, (v, r) in enumerate(zip(values, lengths, strict=True)):
        v = torch.as_tensor(v, dtype=torch.float32).flatten()
        if v.numel() != r:
            raise hook.bad_result(f"left rollout_data[{name!r}][{i}] with {v.numel()} values, response {r}")
        out[i, :r] = v
    return out


def apply_rollout_data(hook: Hook, td: TensorDict, data: dict[str, Any], *, names: tuple[str, ...]) -> TensorDict:
    """``td`` with the entries ``names`` of slime's ``data`` (``advantages``, ``returns``, ``loss_masks``) written
    back as [B, T] tensors."""
    lengths = td[RESPONSE_LENGTHS].tolist()
    out = td.clone(recurse=False)
    for name in names:
        if name not in data:
            raise hook.bad_result(f"did not set rollout_data[{name!r}]")
        values = _padded(hook, data[name], name, lengths, td[keys.MASK])
        if name == "loss_masks":
            out.set(keys.MASK, values.bool())
        else:
            out.set({"advantages": keys.ADVANTAGES, "returns": keys.RETURNS}[name], values)
    return out


def kl_rows(td: TensorDict, *, kl_coef: float, kl_kind: str) -> list[torch.Tensor]:
    """slime's ``rollout_data["kl"]``: the KL of old to reference log-probs per token when ``kl_coef`` is set, else
    zeros."""
    from rlcore.losses import approx_kl

    lengths = td[RESPONSE_LENGTHS].tolist()
    if kl_coef and keys.REF_LOG_PROBS in td.keys():
        kl = approx_kl(td[keys.OLD_LOG_PROBS], td[keys.REF_LOG_PROBS], kind=kl_kind)
    else:
        kl = torch.zeros_like(td[keys.MASK], dtype=torch.float32)
    return [kl[i, :r] for i, r in enumerate(lengths)]


def split_rows(flat: torch.Tensor, lengths: list[int], *, width: int) -> torch.Tensor:
    """[B, width]: the inverse of :func:`concat_rows`, each row's ``lengths[i]`` values then zeros (autograd
    flows through)."""
    rows = torch.split(flat, lengths)
    return torch.stack([torch.nn.functional.pad(r, (0, width - r.numel())) for r in rows])


def custom_tis(
    hook: Hook, args: Any, *, response_lengths: list[int], total_lengths: list[int]
) -> Callable[..., tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]:
    """``rl_loss``'s ``mismatch`` over slime's ``--custom-tis-function-path`` hook: the [B, T] tensors handed to it as
    slime's concatenated ``pg_loss`` and per-sample lists, and its ``(pg_loss, modified_masks, metrics)`` read back as
    [B, T] tensors."""
    lengths = list(response_lengths)
    count = sum(lengths)

    def rows(x: torch.Tensor) -> list[torch.Tensor]:
        return [x[i, :r] for i, r in enumerate(lengths)]

    def flat_tensor(value: Any, what: str) -> torch.Tensor:
        if not torch.is_tensor(value) or value.numel() != count:
            raise hook.bad_result(f"returned {what} {type(value).__name__}, expected a tensor of {count} tokens")
        return value.reshape(-1)

    def mismatch(*, pg, train_log_probs, rollout_log_probs, mask):
        width = mask.shape[1]
        out = hook(
            args,
            pg_loss=concat_rows(pg, lengths),
            train_log_probs=rows(train_log_probs),
            rollout_log_probs=rows(rollout_log_probs),
            loss_masks=[m.int() for m in rows(mask)],
            total_lengths=list(total_lengths),
            response_lengths=list(lengths),
        )
        if not (isinstance(out, tuple | list) and len(out) == 3 and isinstance(out[2], dict)):
            raise hook.wrong_type(out, "(pg_loss, modified_masks, metrics: dict)")
        new_pg, masks, metrics = out
        new_pg = split_rows(flat_tensor(new_pg, "pg_loss"), lengths, width=width)
        if not isinstance(masks, list | tuple) or len(masks) != len(lengths):
            raise hook.bad_result(f"returned modified_masks {type(masks).__name__}, expected one mask per sample")
        for i, (m, r) in enumerate(zip(masks, lengths, strict=True)):
            if not torch.is_tensor(m) or m.numel() != r:
                raise hook.bad_result(f"returned modified_masks[{i}] {m!r:.40}, expected a tensor of {r} tokens")
        keep = split_rows(torch.cat([m.reshape(-1).to(mask.device) for m in masks]), lengths, width=width) != 0
        extra = {
            str(k): split_rows(flat_tensor(v, f"metric {k!r}").detach().float(), lengths, width=width)
            for k, v in metrics.items()
        }
        return new_pg, keep, extra

    return mismatch


def concat_rows(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """[sum(lengths)]: each row's first ``lengths[i]`` entries of ``x`` [B, T], concatenated (slime's layout)."""
    return torch.cat([x[i, :r] for i, r in enumerate(lengths)]) if lengths else x.new_zeros(0)


def sum_of_sample_mean(
    loss_masks: list[torch.Tensor],
    rollout_mask_sums: list[int] | None,
    *,
    per_token: bool,
    global_count: torch.Tensor | float,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """slime's reducer over concatenated response tokens, divided by the global batch's ``global_count`` (samples,
    or tokens under ``per_token``): ``sum_i sum_t m_it x_it / max(D_i, 1) / N`` with ``D_i`` the rollout's mask sum,
    or ``sum m x / N``."""
    masks = [m.float() for m in loss_masks]
    denominators = [
        float(max(d if rollout_mask_sums is not None else float(m.sum()), 1))
        for m, d in zip(masks, rollout_mask_sums or [0] * len(masks), strict=True)
    ]

    def reduce(x: torch.Tensor) -> torch.Tensor:
        pieces = torch.split(x, [int(m.numel()) for m in masks])
        if per_token:
            total = sum((p * m.to(p.device)).sum() for p, m in zip(pieces, masks, strict=True))
        else:
            total = sum((p * m.to(p.device)).sum() / d for p, m, d in zip(pieces, masks, denominators, strict=True))
        return total / global_count

    return reduce


def get_log_probs_and_entropy(
    logits: torch.Tensor,
    *,
    args: Any,
    unconcat_tokens: list[torch.Tensor],
    total_lengths: list[int],
    response_lengths: list[int],
    with_entropy: bool = False,
    **_: Any,
) -> tuple[None, dict[str, list[torch.Tensor]]]:
    """The counterpart of slime's helper for custom losses: from packed ``logits`` [1, sum(total_lengths), V], each
    sample's log-probs (and entropies) of its response tokens at ``args.rollout_temperature``, as
    ``(None, {"log_probs": [...], "entropy": [...]})``."""
    flat = logits.reshape(-1, logits.shape[-1])
    out: dict[str, list[torch.Tensor]] = {"log_probs": [], "entropy": []}
    offset = 0
    temperature = float(getattr(args, "rollout_temperature", 1.0))
    for tokens, total, r in zip(unconcat_tokens, total_lengths, response_lengths, strict=True):
        rows = flat[offset + total - r - 1 : offset + total - 1]
        lp, ent = logprobs_entropy(
            rows, tokens[total - r : total].to(rows.device), temperature=temperature, with_entropy=with_entropy
        )
        out["log_probs"].append(lp)
        if with_entropy:
            out["entropy"].append(ent)
        offset += total
    return None, out
