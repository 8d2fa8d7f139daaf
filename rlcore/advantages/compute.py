"""The TensorDict layer of the advantage step: pick an estimator by name, add the KL penalty, whiten."""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from tensordict import TensorDictBase
from torch import Tensor

from rlcore import keys
from rlcore._checks import check_choice, masked_fill_zero
from rlcore.advantages._checks import (
    check_non_negative,
    check_positive,
    check_rewards,
    check_token_mask,
    check_token_tensor,
    check_unit_interval,
)
from rlcore.advantages.group import broadcast, grpo, reinforce_plus_plus_baseline, rloo
from rlcore.advantages.token import distillation, gae, reinforce_plus_plus
from rlcore.advantages.whiten import whiten
from rlcore.losses.kl import KL_KINDS, approx_kl

ESTIMATORS = (
    "gae",
    "grpo",
    "dr_grpo",
    "gspo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "distillation",
)


@dataclass(frozen=True, kw_only=True)
class AdvantageConfig:
    """Knobs of :func:`compute`; defaults follow slime's.

    Attributes:
        estimator: one of ``ESTIMATORS`` (slime's ``--advantage-estimator``; ``gae`` is slime's ``ppo``).
        gamma: discount for ``gae`` and ``reinforce_plus_plus``, in [0, 1].
        lam: GAE lambda, in [0, 1] (slime's ``--lambd``).
        kl_coef: coefficient of the KL-in-reward penalty (slime's ``--kl-coef``), >= 0; 0 reads no log-probs.
        kl_kind: the KL estimator of the penalty, one of ``k1``, ``k2``, ``k3``, ``low_var_kl`` (slime's
            ``--kl-loss-type``, default ``k1``).
        whiten: whiten the advantages over the valid tokens (slime's ``--normalize-advantages``).
        std_normalize: divide GRPO/GSPO advantages by the group std (off is Dr. GRPO; ``dr_grpo`` forces it off).
        eps: added to the group std, > 0 (a group of equal rewards has std 0).
        whiten_eps: added to the variance when whitening.
    """

    estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    kl_coef: float = 0.0
    kl_kind: str = "k1"
    whiten: bool = False
    std_normalize: bool = True
    eps: float = 1e-6
    whiten_eps: float = 1e-8

    def __post_init__(self) -> None:
        check_choice("estimator", self.estimator, ESTIMATORS)
        check_choice("kl_kind", self.kl_kind, KL_KINDS)
        check_unit_interval("gamma", self.gamma)
        check_unit_interval("lam", self.lam)
        check_non_negative("kl_coef", self.kl_coef)
        check_positive("eps", self.eps)
        check_non_negative("whiten_eps", self.whiten_eps)


def _get(td: TensorDictBase, key: str, estimator: str) -> Tensor:
    if key not in td.keys():
        raise ValueError(
            f"compute: estimator {estimator!r} needs key {key!r}, but td (batch_size {tuple(td.batch_size)}) has "
            f"keys {sorted(td.keys())}"
        )
    return td.get(key)


def _policy_log_probs(td: TensorDictBase, estimator: str, mask: Tensor) -> Tensor:
    # At the advantage step the trainer's log-probs of the sampling policy are old_log_probs; a batch that has not
    # been through the trainer yet carries them as log_probs (slime's rollout_data["log_probs"] at this point).
    key = keys.OLD_LOG_PROBS if keys.OLD_LOG_PROBS in td.keys() else keys.LOG_PROBS
    return check_token_tensor(key, _get(td, key, estimator), mask)


def _last_valid_token(mask: Tensor) -> Tensor:
    """[B, T] bool, True at the last valid token of each row."""
    return mask & (mask.cumsum(dim=1) == mask.sum(dim=1, keepdim=True))


def compute(td: TensorDictBase, cfg: AdvantageConfig, *, group: dist.ProcessGroup | None = None) -> TensorDictBase:
    """Advantages and returns of a rollout batch.

    Reads ``mask`` and what the estimator needs: ``rewards`` and ``group_ids`` (sequence-level estimators),
    ``values`` (``gae``), ``teacher_log_probs`` (``distillation``); with ``kl_coef > 0`` also ``ref_log_probs``
    and the policy's log-probs (``old_log_probs`` if present, else ``log_probs``). The KL-in-reward penalty is
    ``kl_t = approx_kl(policy, ref, kind=kl_kind)`` on valid tokens, applied as in slime:

    - ``gae``: token rewards ``-kl_coef * kl_t``, plus the sample reward on the last valid token (slime's ``ppo``
      puts it on the response's last position; on the last *valid* one here because masked tokens are skipped).
    - ``reinforce_plus_plus``: the same token rewards, discounted returns (:func:`reinforce_plus_plus`).
    - ``reinforce_plus_plus_baseline``: ``-kl_coef * kl_t`` added per token (:func:`reinforce_plus_plus_baseline`).
    - ``grpo``, ``dr_grpo``, ``gspo``, ``rloo``, ``distillation``: ``-kl_coef * kl_t`` added per token to the
      advantage, as REINFORCE++-baseline does. Deliberate difference: slime computes but ignores ``kl_coef`` for
      ``grpo``/``gspo``; silently dropping a knob the user set is a trap, so it is applied here.

    ``gspo`` has the advantages of ``grpo`` (its sequence-level ratio lives in the loss); ``dr_grpo`` is ``grpo``
    without std normalisation. ``returns`` are the advantages before whitening for every estimator but ``gae``,
    where they are ``advantages + values`` (the critic's targets), as in slime. With ``cfg.whiten`` the advantages
    are whitened over the valid tokens, globally over ``group`` when given.

    Args:
        td: rollout batch, ``batch_size=[B]`` (see the batch contract in DESIGN.md). Not modified.
        cfg: the :class:`AdvantageConfig`.
        group: process group for global whitening moments (every rank must call ``compute``).

    Returns:
        A shallow copy of ``td`` with ``advantages`` and ``returns`` set, each [B, T] float32, 0 at masked positions.
    """
    if not isinstance(td, TensorDictBase):
        raise TypeError(f"td must be a TensorDict, got {type(td).__name__}")
    if not isinstance(cfg, AdvantageConfig):
        raise TypeError(f"cfg must be an AdvantageConfig, got {type(cfg).__name__}")
    name = cfg.estimator
    mask = check_token_mask(_get(td, keys.MASK, name))
    if len(td.batch_size) != 1 or td.batch_size[0] != mask.shape[0]:
        raise ValueError(f"td must have batch_size [B] = [{mask.shape[0]}], got {tuple(td.batch_size)}")

    kl = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if cfg.kl_coef > 0:
        policy = _policy_log_probs(td, name, mask)
        ref = check_token_tensor(keys.REF_LOG_PROBS, _get(td, keys.REF_LOG_PROBS, name), mask)
        kl = masked_fill_zero(approx_kl(policy, ref, kind=cfg.kl_kind), mask)
        # k2/k3 of finite but far-apart log-probs can overflow; every estimator below must see a finite penalty.
        check_token_tensor(f"kl ({cfg.kl_kind} of {keys.REF_LOG_PROBS})", kl, mask)
    penalty = -cfg.kl_coef * kl

    if name == "gae":
        rewards = check_rewards(_get(td, keys.REWARDS, name), batch=mask.shape[0])
        token_rewards = penalty + masked_fill_zero(broadcast(rewards, mask), _last_valid_token(mask))
        advantages, returns = gae(token_rewards, _get(td, keys.VALUES, name), mask, gamma=cfg.gamma, lam=cfg.lam)
    elif name == "reinforce_plus_plus":
        returns = reinforce_plus_plus(_get(td, keys.REWARDS, name), kl, mask, kl_coef=cfg.kl_coef, gamma=cfg.gamma)
        advantages = returns
    elif name == "reinforce_plus_plus_baseline":
        rewards, group_ids = _get(td, keys.REWARDS, name), _get(td, keys.GROUP_IDS, name)
        advantages = reinforce_plus_plus_baseline(rewards, group_ids, kl, mask, kl_coef=cfg.kl_coef)
        returns = advantages
    elif name == "distillation":
        teacher = _get(td, keys.TEACHER_LOG_PROBS, name)
        advantages = distillation(teacher, _policy_log_probs(td, name, mask), mask) + penalty
        returns = advantages
    else:
        rewards, group_ids = _get(td, keys.REWARDS, name), _get(td, keys.GROUP_IDS, name)
        if name == "rloo":
            seq = rloo(rewards, group_ids)
        else:
            std_normalize = cfg.std_normalize and name != "dr_grpo"
            seq = grpo(rewards, group_ids, std_normalize=std_normalize, eps=cfg.eps)
        advantages = broadcast(seq, mask) + penalty
        returns = advantages

    if cfg.whiten:
        advantages = whiten(advantages, mask, eps=cfg.whiten_eps, group=group)
    out = td.copy()
    out.set(keys.ADVANTAGES, advantages.to(torch.float32))
    out.set(keys.RETURNS, returns.to(torch.float32))
    return out
