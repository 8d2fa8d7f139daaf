"""The composed RL loss over a batch TensorDict: policy loss, mismatch correction, KL, entropy and value terms."""

from collections.abc import Callable

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from rlcore import keys
from rlcore._checks import check_finite_where, check_mask, check_tensor, masked_fill_zero
from rlcore.loss_config import LossConfig
from rlcore.losses.aggregate import Normalizer, aggregate
from rlcore.losses.entropy import entropy_bonus
from rlcore.losses.kl import approx_kl
from rlcore.losses.mismatch import mismatch_weights
from rlcore.losses.policy import cispo, gspo, opsm_keep, ppo_clip, sequence_log_ratio
from rlcore.losses.value import value_loss

# The metrics rl_loss (and the fused loss) report as maxima over tokens: they combine by max over micro-batches, ranks
# and optimizer steps. Every other metric is a micro-batch's share of a global-batch token mean, which adds up.
MAX_METRICS = frozenset({"ratio_max", "tis_weight_max"})


def _read(td: TensorDictBase, key: str, mask: Tensor, *, needed_by: str) -> Tensor:
    """``td[key]`` checked against ``mask``, with masked positions set to 0 so padding never reaches a gradient."""
    if key not in td.keys():
        raise ValueError(f"rl_loss needs td[{key!r}] for {needed_by}; the batch has keys {sorted(td.keys())}")
    x = check_tensor(key, td.get(key), floating=True)
    if x.shape != mask.shape:
        raise ValueError(f"{key} has shape {tuple(x.shape)} but mask has shape {tuple(mask.shape)}")
    check_finite_where(key, x, mask)
    return masked_fill_zero(x, mask)


def _ppo_term(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, cfg: LossConfig):
    pg, clipped = ppo_clip(
        log_probs,
        old_log_probs,
        advantages,
        eps_clip=cfg.eps_clip,
        eps_clip_high=_eps_high(cfg),
        dual_clip=cfg.eps_clip_c,
    )
    return pg, clipped, torch.exp(log_probs - old_log_probs).detach()


def _gspo_term(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, cfg: LossConfig):
    pg, clipped = gspo(log_probs, old_log_probs, advantages, mask, eps_clip=cfg.eps_clip, eps_clip_high=_eps_high(cfg))
    ratio = torch.exp(sequence_log_ratio(log_probs, old_log_probs, mask))[:, None].expand_as(mask).detach()
    return pg, clipped, ratio


def _cispo_term(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, cfg: LossConfig):
    eps_low = cfg.eps_clip if cfg.cispo_clip_low else None
    pg, clipped = cispo(log_probs, old_log_probs, advantages, eps_clip_high=_eps_high(cfg), eps_clip=eps_low)
    return pg, clipped, torch.exp(log_probs - old_log_probs).detach()


def _eps_high(cfg: LossConfig) -> float:
    return cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high


# One entry per policy loss: (log_probs, old_log_probs, advantages, mask, cfg) -> (per-token loss, clipped [B, T]
# bool, ratio [B, T] reported as ``ratio_*``; GSPO's is the sequence ratio on every token of its sample).
_POLICY_TERMS: dict[str, Callable[..., tuple[Tensor, Tensor, Tensor]]] = {
    "ppo": _ppo_term,
    "gspo": _gspo_term,
    "cispo": _cispo_term,
}


def rl_loss(
    td: TensorDictBase,
    cfg: LossConfig,
    *,
    norm: Normalizer | None = None,
    pg_reduce: Callable[[Tensor], Tensor] | None = None,
    mismatch: Callable[..., tuple[Tensor, Tensor, dict[str, Tensor]]] | None = None,
) -> tuple[Tensor, TensorDict]:
    """The training loss of a (micro-)batch and its metrics.

    ``loss = pg + kl_loss_coef * kl - entropy_coef * entropy + value_coef * value``, each ``aggregate``d with
    ``cfg.loss_agg_mode`` and ``norm``:

    - ``pg``: the per-token policy loss of ``cfg.policy_loss``, times the mismatch weights when
      ``cfg.use_tis``; tokens outside the mismatch ``keep`` leave the numerators of ``pg``, ``kl``
      and ``entropy`` (as in slime) but not the denominators, which stay those of ``mask``.
    - ``kl``: ``approx_kl(log_probs, ref_log_probs, kind=cfg.kl_loss_type)`` when ``cfg.use_kl_loss``.
    - ``entropy``: the policy's entropy, when ``cfg.entropy_coef`` is not 0.
    - ``value``: the clipped value loss, when ``cfg.value_coef`` is not 0 (the critic sees every valid token).

    Reads (batch contract, ``keys``): ``mask``, ``log_probs``, ``advantages``; ``seq_token_counts`` and
    ``seq_counts`` when a rollout was split into several rows (see ``aggregate``); ``old_log_probs`` (absent:
    ``log_probs`` detached, i.e. one on-policy step, as slime does); ``rollout_log_probs``, ``ref_log_probs``,
    ``entropy``, ``values``/``old_values``/``returns`` as the config asks. Every token tensor is [B, T];
    masked positions may hold anything, NaN included. Only ``log_probs``, ``entropy`` and ``values`` carry
    gradient; the others are detached.

    Metrics (a detached TensorDict, batch size []): ``loss``, ``pg_loss`` and each term used, before its
    coefficient (``kl_loss``, ``entropy_loss`` = minus the aggregated entropy, ``value_loss``); token means
    over valid tokens of ``clipfrac``, ``approx_kl_old`` (mean ``old_log_probs - log_probs``, slime's
    ``ppo_kl``), ``ratio_mean`` (the ratio the clip acts on: per token, per sequence for GSPO), and when
    their inputs are present ``entropy``, ``approx_kl_ref`` (of ``cfg.kl_loss_type``),
    ``rollout_log_prob_abs_diff``, ``tis_weight_mean``, ``tis_masked_frac`` (valid tokens outside ``keep``),
    ``value_clipfrac``; maxima over valid tokens ``ratio_max`` and ``tis_weight_max``.
    The means use ``norm``'s token count, so summed over the micro-batches of the global batch they give
    its token means; combine the maxima with ``max``.

    Args:
        td: the batch, ``batch_size=[B]``.
        cfg: a ``LossConfig``.
        norm: denominators of the global batch (``Normalizer.of`` its mask, summed); ``None`` uses this batch's.
        pg_reduce: replaces ``aggregate`` for the policy term only (slime's custom pg-loss reducer): called with the
            per-token policy loss [B, T], 0 outside the valid (and mismatch-kept) tokens; returns a 0-dim tensor.
        mismatch: replaces the built-in mismatch correction when ``cfg.use_tis`` or ``cfg.mismatch_metrics`` is
            set (slime's ``--custom-tis-function-path``): called as ``mismatch(pg=, train_log_probs=,
            rollout_log_probs=, mask=)`` with the per-token policy loss, the old and the rollout log-probs and the
            mask, all [B, T]; returns ``(pg, keep, extra)``: the corrected per-token loss [B, T], the tokens kept in
            the numerators [B, T] bool (the denominators stay ``mask``'s) and per-token metrics {name: [B, T]},
            reported as token means over ``mask``.

    Returns:
        ``(loss, metrics)``: a 0-dim differentiable loss and the metrics.
    """
    if not isinstance(td, TensorDictBase):
        raise TypeError(f"td must be a TensorDict, got {type(td).__name__}")
    if not isinstance(cfg, LossConfig):
        raise TypeError(f"cfg must be a LossConfig, got {type(cfg).__name__}")
    if keys.MASK not in td.keys():
        raise ValueError(f"rl_loss needs td[{keys.MASK!r}]; the batch has keys {sorted(td.keys())}")
    mask = check_mask(td.get(keys.MASK))
    check_tensor(keys.MASK, mask, ndim=2)
    if norm is None:
        norm = Normalizer.of(mask, seq_counts=td.get(keys.SEQ_COUNTS, None))
    seq_token_counts = td.get(keys.SEQ_TOKEN_COUNTS, None)

    def agg(per_token: Tensor) -> Tensor:
        return aggregate(per_token, mask, mode=cfg.loss_agg_mode, norm=norm, seq_token_counts=seq_token_counts)

    def token_mean(per_token: Tensor) -> Tensor:
        return aggregate(per_token.detach(), mask, mode="token_mean", norm=norm)

    def valid_max(per_token: Tensor) -> Tensor:
        return masked_fill_zero(per_token.detach(), mask).amax() if mask.numel() else per_token.new_zeros(())

    log_probs = _read(td, keys.LOG_PROBS, mask, needed_by="the policy loss")
    advantages = _read(td, keys.ADVANTAGES, mask, needed_by="the policy loss").detach()
    if keys.OLD_LOG_PROBS in td.keys():
        old_log_probs = _read(td, keys.OLD_LOG_PROBS, mask, needed_by="the policy loss").detach()
    else:
        old_log_probs = log_probs.detach()
    log_ratio = (log_probs - old_log_probs).detach()

    pg, clipped, ratio = _POLICY_TERMS[cfg.policy_loss](log_probs, old_log_probs, advantages, mask, cfg)
    if cfg.use_opsm:
        opsm = opsm_keep(log_probs, old_log_probs, advantages, mask, delta=cfg.opsm_delta)
        pg = pg * opsm
    else:
        opsm = mask

    metrics: dict[str, Tensor] = {}
    keep = mask
    if cfg.use_tis or cfg.mismatch_metrics or keys.ROLLOUT_LOG_PROBS in td.keys():
        rollout_log_probs = _read(td, keys.ROLLOUT_LOG_PROBS, mask, needed_by="use_tis / mismatch_metrics").detach()
        metrics["rollout_log_prob_abs_diff"] = token_mean((old_log_probs - rollout_log_probs).abs())
        if cfg.mismatch_metrics:
            metrics["mismatch_k3"] = token_mean(approx_kl(rollout_log_probs, old_log_probs, kind="k3"))
        if mismatch is not None and (cfg.use_tis or cfg.mismatch_metrics):
            pg, custom_keep, extra = mismatch(
                pg=pg, train_log_probs=old_log_probs, rollout_log_probs=rollout_log_probs, mask=mask
            )
            for name, value in (("pg", pg), ("keep", custom_keep)):
                if check_tensor(f"mismatch's {name}", value, ndim=2).shape != mask.shape:
                    raise ValueError(f"mismatch's {name} must have the mask's shape {tuple(mask.shape)}")
            keep = mask & custom_keep.bool()
            for name, per_token in extra.items():
                metrics[name] = token_mean(per_token.to(pg.dtype))
        elif cfg.use_tis or cfg.mismatch_metrics:
            weights, tis_keep = mismatch_weights(
                old_log_probs,
                rollout_log_probs,
                mask,
                mode=cfg.tis_mode,
                level=cfg.tis_level,
                low=cfg.tis_clip_low,
                high=cfg.tis_clip,
            )
            metrics["tis_weight_mean"] = token_mean(weights)
            metrics["tis_weight_max"] = valid_max(weights)
            metrics["tis_masked_frac"] = token_mean((mask & ~tis_keep).to(weights.dtype))
            if cfg.use_tis:
                pg = pg * weights
                keep = tis_keep

    def kept(per_token: Tensor) -> Tensor:
        return masked_fill_zero(per_token, keep)

    pg_loss = agg(kept(pg)) if pg_reduce is None else pg_reduce(kept(pg))
    loss = pg_loss
    metrics["pg_loss"] = pg_loss
    metrics["clipfrac"] = token_mean(clipped.to(pg.dtype))
    if cfg.use_opsm:
        metrics["opsm_masked_frac"] = token_mean((mask & ~opsm).to(pg.dtype))
    metrics["approx_kl_old"] = token_mean(-log_ratio)
    metrics["ratio_mean"] = token_mean(ratio)
    metrics["ratio_max"] = valid_max(ratio)

    if cfg.use_kl_loss or keys.REF_LOG_PROBS in td.keys():
        ref_log_probs = _read(td, keys.REF_LOG_PROBS, mask, needed_by="use_kl_loss").detach()
        kl = approx_kl(log_probs, ref_log_probs, kind=cfg.kl_loss_type)
        metrics["approx_kl_ref"] = token_mean(kl)
        if cfg.use_kl_loss:
            if cfg.use_unbiased_kl:
                # Weighted before low_var_kl's clamp, as slime's compute_approx_kl does.
                kl = approx_kl(
                    log_probs,
                    ref_log_probs,
                    kind=cfg.kl_loss_type,
                    importance_ratio=torch.exp(log_probs - old_log_probs),
                )
            kl_loss = agg(kept(kl))
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["kl_loss"] = kl_loss

    if cfg.entropy_coef != 0 or keys.ENTROPY in td.keys():
        entropy = _read(td, keys.ENTROPY, mask, needed_by="entropy_coef")
        metrics["entropy"] = token_mean(entropy)
        if cfg.entropy_coef != 0:
            entropy_loss = agg(kept(entropy_bonus(entropy)))
            loss = loss + cfg.entropy_coef * entropy_loss
            metrics["entropy_loss"] = entropy_loss

    if cfg.value_coef != 0:
        values = _read(td, keys.VALUES, mask, needed_by="value_coef")
        old_values = _read(td, keys.OLD_VALUES, mask, needed_by="value_coef").detach()
        returns = _read(td, keys.RETURNS, mask, needed_by="value_coef").detach()
        v_loss = agg(value_loss(values, old_values, returns, clip=cfg.value_clip))
        loss = loss + cfg.value_coef * v_loss
        metrics["value_loss"] = v_loss
        if cfg.value_clip is not None:
            metrics["value_clipfrac"] = token_mean(((values - old_values).abs() > cfg.value_clip).to(v_loss.dtype))

    metrics["loss"] = loss
    return loss, TensorDict({name: value.detach() for name, value in metrics.items()}, batch_size=[])
