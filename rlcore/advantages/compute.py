"""The TensorDict layer of the advantage step: pick an estimator by name, add the KL penalty, whiten.

Data-parallel trainers get a batch cut into row shards, and a shard can split a group. So the group baselines are
computed over the whole batch first (:func:`sequence_advantages`, on the driver, as slime does) and travel with the
rows as ``sequence_advantages``; :func:`compute` on a shard uses them. Everything else in :func:`compute` is
row-wise, except whitening, whose moments are made global by passing the data-parallel process group.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tensordict import TensorDictBase
from torch import Tensor

from rlcore import keys
from rlcore._checks import check_tensor, masked_fill_zero
from rlcore.advantage_config import ESTIMATORS, GROUP_BASELINE_ESTIMATORS, AdvantageConfig
from rlcore.advantages._checks import (
    check_rewards,
    check_token_mask,
    check_token_tensor,
)
from rlcore.advantages.group import broadcast, grpo, rloo
from rlcore.advantages.token import distillation, gae, reinforce_plus_plus
from rlcore.advantages.whiten import whiten
from rlcore.losses.kl import approx_kl


@dataclass(frozen=True, kw_only=True)
class Estimator:
    """One entry of the estimator table: the keys an estimator reads and the math it runs.

    Attributes:
        in_keys: what ``advantages`` reads from a batch besides ``mask`` (and, with ``kl_coef > 0``, the log-probs
            of the KL penalty). ``old_log_probs`` stands for the policy's log-probs: ``log_probs`` where it is absent.
        advantages: ``(inputs, mask, kl, cfg) -> (advantages, returns)``, each [B, T]. ``inputs`` maps each of
            ``in_keys`` to its tensor, ``mask`` is [B, T] bool and ``kl`` the [B, T] per-token KL estimate of the
            penalty (0 at masked positions; all 0 when ``kl_coef == 0``). Row-wise: row b of the outputs depends on
            row b of the inputs only, so the rows of a batch may be split among ranks.
        baseline: for an estimator with a group baseline, ``(rewards [B], group_ids [B], cfg) -> [B]``, its
            sequence-level part, which needs whole groups; ``None`` for the others.
    """

    in_keys: tuple[str, ...]
    advantages: Callable[[dict[str, Tensor], Tensor, Tensor, AdvantageConfig], tuple[Tensor, Tensor]]
    baseline: Callable[[Tensor, Tensor, AdvantageConfig], Tensor] | None = None


def _last_valid_token(mask: Tensor) -> Tensor:
    """[B, T] bool, True at the last valid token of each row."""
    return mask & (mask.cumsum(dim=1) == mask.sum(dim=1, keepdim=True))


def _check_sequence_advantages(x: object, *, batch: int) -> Tensor:
    """A finite floating [B] tensor (B equal to ``batch``)."""
    check_tensor(keys.SEQUENCE_ADVANTAGES, x, ndim=1, floating=True)
    if x.shape[0] != batch:
        raise ValueError(f"{keys.SEQUENCE_ADVANTAGES} has shape {tuple(x.shape)} but mask has batch size {batch}")
    if not bool(torch.isfinite(x).all()):
        first = int((~torch.isfinite(x)).nonzero()[0])
        raise ValueError(
            f"{keys.SEQUENCE_ADVANTAGES} has a non-finite value at index {first} (shape {tuple(x.shape)})"
        )
    return x


def _gae(inputs: dict[str, Tensor], mask: Tensor, kl: Tensor, cfg: AdvantageConfig) -> tuple[Tensor, Tensor]:
    rewards = check_rewards(inputs[keys.REWARDS], batch=mask.shape[0])
    token_rewards = -cfg.kl_coef * kl + masked_fill_zero(broadcast(rewards, mask), _last_valid_token(mask))
    return gae(token_rewards, inputs[keys.VALUES], mask, gamma=cfg.gamma, lam=cfg.lam)


def _reinforce_plus_plus(
    inputs: dict[str, Tensor], mask: Tensor, kl: Tensor, cfg: AdvantageConfig
) -> tuple[Tensor, Tensor]:
    returns = reinforce_plus_plus(inputs[keys.REWARDS], kl, mask, kl_coef=cfg.kl_coef, gamma=cfg.gamma)
    return returns, returns


def _distillation(inputs: dict[str, Tensor], mask: Tensor, kl: Tensor, cfg: AdvantageConfig) -> tuple[Tensor, Tensor]:
    advantages = distillation(inputs[keys.TEACHER_LOG_PROBS], inputs[keys.OLD_LOG_PROBS], mask) - cfg.kl_coef * kl
    return advantages, advantages


def _sequence_plus_penalty(
    inputs: dict[str, Tensor], mask: Tensor, kl: Tensor, cfg: AdvantageConfig
) -> tuple[Tensor, Tensor]:
    seq = _check_sequence_advantages(inputs[keys.SEQUENCE_ADVANTAGES], batch=mask.shape[0])
    advantages = broadcast(seq, mask) - cfg.kl_coef * kl
    return advantages, advantages


def _grpo_baseline(rewards: Tensor, group_ids: Tensor, cfg: AdvantageConfig) -> Tensor:
    return grpo(rewards, group_ids, std_normalize=cfg.std_normalize, eps=cfg.eps)


def _group_mean_baseline(rewards: Tensor, group_ids: Tensor, cfg: AdvantageConfig) -> Tensor:
    return grpo(rewards, group_ids, std_normalize=False, eps=cfg.eps)


def _rloo_baseline(rewards: Tensor, group_ids: Tensor, cfg: AdvantageConfig) -> Tensor:
    return rloo(rewards, group_ids)


def _with_group_baseline(baseline: Callable[[Tensor, Tensor, AdvantageConfig], Tensor]) -> Estimator:
    return Estimator(in_keys=(keys.SEQUENCE_ADVANTAGES,), advantages=_sequence_plus_penalty, baseline=baseline)


_TABLE: dict[str, Estimator] = {
    "gae": Estimator(in_keys=(keys.REWARDS, keys.VALUES), advantages=_gae),
    "grpo": _with_group_baseline(_grpo_baseline),
    "dr_grpo": _with_group_baseline(_group_mean_baseline),
    "gspo": _with_group_baseline(_grpo_baseline),
    "rloo": _with_group_baseline(_rloo_baseline),
    "reinforce_plus_plus": Estimator(in_keys=(keys.REWARDS,), advantages=_reinforce_plus_plus),
    # The reward minus its group mean, no std (as slime); the KL term is added per token on the rows.
    "reinforce_plus_plus_baseline": _with_group_baseline(_group_mean_baseline),
    "distillation": Estimator(in_keys=(keys.TEACHER_LOG_PROBS, keys.OLD_LOG_PROBS), advantages=_distillation),
}
# The names are declared torch-free in rlcore.advantage_config (the config reads them); the table must match them.
_GROUPED = tuple(name for name, estimator in _TABLE.items() if estimator.baseline is not None)
if tuple(_TABLE) != ESTIMATORS or _GROUPED != GROUP_BASELINE_ESTIMATORS:
    raise RuntimeError(
        f"rlcore.advantage_config names estimators {ESTIMATORS} (grouped {GROUP_BASELINE_ESTIMATORS}), the table "
        f"{tuple(_TABLE)} (grouped {_GROUPED})"
    )


def _check_td_and_cfg(td: object, cfg: object) -> None:
    if not isinstance(td, TensorDictBase):
        raise TypeError(f"td must be a TensorDict, got {type(td).__name__}")
    if not isinstance(cfg, AdvantageConfig):
        raise TypeError(f"cfg must be an AdvantageConfig, got {type(cfg).__name__}")


def _get(td: TensorDictBase, key: str, estimator: str) -> Tensor:
    if key not in td.keys():
        raise ValueError(
            f"estimator {estimator!r} needs key {key!r}, but td (batch_size {tuple(td.batch_size)}) has keys "
            f"{sorted(td.keys())}"
        )
    return td.get(key)


def _policy_log_probs(td: TensorDictBase, estimator: str, mask: Tensor) -> Tensor:
    # At the advantage step the trainer's log-probs of the sampling policy are old_log_probs; a batch that has not
    # been through the trainer yet carries them as log_probs (slime's rollout_data["log_probs"] at this point).
    key = keys.OLD_LOG_PROBS if keys.OLD_LOG_PROBS in td.keys() else keys.LOG_PROBS
    return check_token_tensor(key, _get(td, key, estimator), mask)


def _read(td: TensorDictBase, key: str, estimator: str, mask: Tensor) -> Tensor:
    return _policy_log_probs(td, estimator, mask) if key == keys.OLD_LOG_PROBS else _get(td, key, estimator)


def sequence_advantages(td: TensorDictBase, cfg: AdvantageConfig) -> TensorDictBase:
    """The group-baseline part of the advantages, over a whole batch: run it before cutting the batch into shards.

    For the estimators with a group baseline (``GROUP_BASELINE_ESTIMATORS``) it reads ``rewards`` and ``group_ids``
    only and sets ``sequence_advantages`` [B] float32 (the rewards themselves when ``cfg.group_normalize`` is off):
    :func:`grpo` for ``grpo`` and ``gspo`` (``std_normalize`` and ``eps`` from ``cfg``), :func:`grpo` without std for
    ``dr_grpo`` and ``reinforce_plus_plus_baseline`` (the reward minus its group mean), :func:`rloo` for ``rloo``.
    :func:`compute` with the same ``cfg`` on any row shard of the result gives those rows of :func:`compute` on the
    whole batch. The other estimators (``gae``, ``reinforce_plus_plus``, ``distillation``) have no group baseline:
    their td comes back unchanged (a copy).

    Args:
        td: rollout batch, ``batch_size=[B]``, holding every sample of each of its groups. Not modified.
        cfg: the :class:`AdvantageConfig` that :func:`compute` will get.

    Returns:
        A shallow copy of ``td``, with ``sequence_advantages`` set for an estimator with a group baseline.
    """
    _check_td_and_cfg(td, cfg)
    if len(td.batch_size) != 1:
        raise ValueError(f"td must have batch_size [B], got {tuple(td.batch_size)}")
    estimator = _TABLE[cfg.estimator]
    out = td.copy()
    if estimator.baseline is not None:
        if cfg.group_normalize:
            rewards, group_ids = (_get(td, key, cfg.estimator) for key in (keys.REWARDS, keys.GROUP_IDS))
            seq = estimator.baseline(rewards, group_ids, cfg)
        else:
            seq = check_rewards(_get(td, keys.REWARDS, cfg.estimator), batch=td.batch_size[0])
        out.set(keys.SEQUENCE_ADVANTAGES, seq.to(torch.float32))
    return out


def shard_keys(cfg: AdvantageConfig) -> tuple[str, ...]:
    """The keys :func:`compute` reads from a row shard of a batch that went through :func:`sequence_advantages`.

    ``mask``, the estimator's ``in_keys`` and, with ``kl_coef > 0``, ``ref_log_probs`` and ``old_log_probs``;
    ``old_log_probs`` stands for the policy's log-probs (``compute`` reads ``log_probs`` where it is absent).
    """
    if not isinstance(cfg, AdvantageConfig):
        raise TypeError(f"cfg must be an AdvantageConfig, got {type(cfg).__name__}")
    penalty_keys = (keys.REF_LOG_PROBS, keys.OLD_LOG_PROBS) if cfg.kl_coef > 0 else ()
    opd_keys = (keys.TEACHER_LOG_PROBS, keys.OLD_LOG_PROBS) if cfg.opd_kl_coef > 0 else ()
    return tuple(dict.fromkeys((keys.MASK, *_TABLE[cfg.estimator].in_keys, *penalty_keys, *opd_keys)))


def compute(td: TensorDictBase, cfg: AdvantageConfig, *, group: dist.ProcessGroup | None = None) -> TensorDictBase:
    """Advantages and returns of a rollout batch, or of a row shard of one.

    Reads ``mask`` and what the estimator needs: ``sequence_advantages`` (estimators with a group baseline; computed
    here from ``rewards`` and ``group_ids`` by :func:`sequence_advantages` when td does not hold it), ``rewards``
    (``gae``, ``reinforce_plus_plus``), ``values`` (``gae``), ``teacher_log_probs`` (``distillation``); with
    ``kl_coef > 0`` also ``ref_log_probs`` and the policy's log-probs (``old_log_probs`` if present, else
    ``log_probs``); with ``opd_kl_coef > 0`` also ``teacher_log_probs`` and the policy's log-probs (on-policy
    distillation, subtracted from the advantages before whitening). The KL-in-reward penalty is
    ``kl_t = approx_kl(policy, ref, kind=kl_kind)`` on valid tokens, applied as in slime:

    - ``gae``: token rewards ``-kl_coef * kl_t``, plus the sample reward on the last valid token (slime's ``ppo``
      puts it on the response's last position; on the last *valid* one here because masked tokens are skipped).
    - ``reinforce_plus_plus``: the same token rewards, discounted returns (:func:`reinforce_plus_plus`).
    - ``reinforce_plus_plus_baseline``: the reward minus its group mean, and ``-kl_coef * kl_t`` added per token
      (what :func:`reinforce_plus_plus_baseline` computes, here in two parts: the first over whole groups).
    - ``grpo``, ``dr_grpo``, ``gspo``, ``rloo``, ``distillation``: ``-kl_coef * kl_t`` added per token to the
      advantage, as REINFORCE++-baseline does. Deliberate difference: slime computes but ignores ``kl_coef`` for
      ``grpo``/``gspo``; silently dropping a knob the user set is a trap, so it is applied here.

    ``gspo`` has the advantages of ``grpo`` (its sequence-level ratio lives in the loss); ``dr_grpo`` is ``grpo``
    without std normalisation. ``returns`` are the advantages before whitening for every estimator but ``gae``,
    where they are ``advantages + values`` (the critic's targets), as in slime. With ``cfg.whiten`` the advantages
    are whitened over the valid tokens, globally over ``group`` when given.

    Data parallel: run :func:`sequence_advantages` on the whole batch, give each rank a shard of its rows, and call
    ``compute(shard, cfg, group=dp_group)`` on every rank. The shards' results are the rows of ``compute`` on the
    whole batch: bitwise without ``whiten`` (for ``gae`` and ``reinforce_plus_plus``, whose scans are matmuls, as long
    as the BLAS rounds the same for another number of rows), within float32 rounding with it.

    Args:
        td: rollout batch or row shard, ``batch_size=[B]`` (see the batch contract in DESIGN.md). Not modified.
            Its ``sequence_advantages``, when present, must come from :func:`sequence_advantages` with this ``cfg``.
        cfg: the :class:`AdvantageConfig`.
        group: process group for global whitening moments (every rank must call ``compute``).

    Returns:
        A shallow copy of ``td`` with ``advantages`` and ``returns`` set, each [B, T] float32, 0 at masked positions.
    """
    _check_td_and_cfg(td, cfg)
    name = cfg.estimator
    estimator = _TABLE[name]
    mask = check_token_mask(_get(td, keys.MASK, name))
    if len(td.batch_size) != 1 or td.batch_size[0] != mask.shape[0]:
        raise ValueError(f"td must have batch_size [B] = [{mask.shape[0]}], got {tuple(td.batch_size)}")

    kl = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if cfg.kl_coef > 0:
        policy = _policy_log_probs(td, name, mask)
        ref = check_token_tensor(keys.REF_LOG_PROBS, _get(td, keys.REF_LOG_PROBS, name), mask)
        kl = masked_fill_zero(approx_kl(policy, ref, kind=cfg.kl_kind), mask)
        # k2/k3 of finite but far-apart log-probs can overflow; every estimator must see a finite penalty.
        check_token_tensor(f"kl ({cfg.kl_kind} of {keys.REF_LOG_PROBS})", kl, mask)

    rows = td
    if estimator.baseline is not None and keys.SEQUENCE_ADVANTAGES not in td.keys():
        rows = sequence_advantages(td, cfg)  # td is a whole batch: its groups are all here
    inputs = {key: _read(rows, key, name, mask) for key in estimator.in_keys}
    advantages, returns = estimator.advantages(inputs, mask, kl, cfg)
    if cfg.opd_kl_coef > 0:
        # On-policy distillation on top of the estimator (slime's --use-opd): minus the reverse KL to the teacher.
        student = _policy_log_probs(td, name, mask)
        teacher = check_token_tensor(keys.TEACHER_LOG_PROBS, _get(td, keys.TEACHER_LOG_PROBS, name), mask)
        advantages = advantages - cfg.opd_kl_coef * masked_fill_zero(student - teacher, mask)

    if cfg.whiten:
        advantages = whiten(advantages, mask, eps=cfg.whiten_eps, group=group)
    out = td.copy()
    out.set(keys.ADVANTAGES, advantages.to(torch.float32))
    out.set(keys.RETURNS, returns.to(torch.float32))
    return out
