"""The loss's knobs and the names they choose from: torch-free, so a front end (``rlcore-run --help``, a config
check) reads rlcore's ranges without importing torch. :mod:`rlcore.losses` re-exports everything here."""

import math
from dataclasses import dataclass

from rlcore._values import check_choice

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
KL_KINDS = ("k1", "k2", "k3", "low_var_kl")
MISMATCH_MODES = ("tis", "mis", "icepop")
MISMATCH_LEVELS = ("token", "sequence", "geometric")
POLICY_LOSSES = ("ppo", "gspo", "cispo")


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """Knobs of ``rl_loss``; names follow slime's flags where slime has one.

    Attributes:
        policy_loss: ``ppo`` (``ppo_clip``), ``gspo`` or ``cispo``.
        eps_clip, eps_clip_high: clip ranges (``--eps-clip``, ``--eps-clip-high``; ``None`` = ``eps_clip``).
            CISPO uses ``eps_clip_high`` (or ``eps_clip``) as its upper truncation.
        cispo_clip_low: CISPO's weight is also held at ``1 - eps_clip`` from below (slime's form); off, it has
            no lower bound (the paper's).
        eps_clip_c: ``c > 1`` for dual-clip PPO (``--eps-clip-c``; ``dual_clip`` of ``ppo_clip``), ``None``
            off. PPO only.
        use_tis: correct for the mismatch of rollout and trainer log-probs (``--use-tis``) with
            ``mismatch_weights``; reads ``rollout_log_probs``.
        tis_mode: ``tis`` (truncate, slime's default), ``mis`` (mask out) or ``icepop`` (mask both sides).
        tis_level, tis_clip_low, tis_clip: ``level``, ``low`` and ``high`` of ``mismatch_weights``
            (``--tis-clip-low``, ``--tis-clip``; slime's ``--tis-clip-low`` defaults to 0, ours to the mode's
            default).
        mismatch_metrics: report the mismatch of rollout and trainer log-probs (``tis_weight_*`` of
            ``tis_mode``, ``mismatch_k3``) without applying weights (slime's ``--get-mismatch-metrics``); reads
            ``rollout_log_probs``.
        use_opsm, opsm_delta: off-policy sequence masking (``opsm_keep``; slime's ``--use-opsm``, ``--opsm-delta``).
        use_kl_loss, kl_loss_coef, kl_loss_type: KL-to-reference loss (reads ``ref_log_probs``).
        use_unbiased_kl: weight the KL by ``exp(log_probs - old_log_probs)`` (slime's ``--use-unbiased-kl``);
            ``low_var_kl`` clamps the weighted estimate, as slime does.
        entropy_coef: weight of the entropy bonus (reads ``entropy``).
        value_coef: weight of the value loss; 0 leaves the critic out (reads ``values``, ``old_values``,
            ``returns``).
        value_clip: clip of ``value_loss`` (``--value-clip``), ``None`` off.
        loss_agg_mode: ``aggregate`` mode of every loss term.
    """

    policy_loss: str = "ppo"
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    eps_clip_c: float | None = None
    cispo_clip_low: bool = False
    use_tis: bool = False
    tis_mode: str = "tis"
    tis_level: str = "token"
    tis_clip_low: float | None = None
    tis_clip: float = 2.0
    mismatch_metrics: bool = False
    use_opsm: bool = False
    opsm_delta: float = 1e-4
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "k1"
    use_unbiased_kl: bool = False
    entropy_coef: float = 0.0
    value_coef: float = 0.0
    value_clip: float | None = 0.2
    loss_agg_mode: str = "token_mean"

    def __post_init__(self) -> None:
        check_choice("policy_loss", self.policy_loss, POLICY_LOSSES)
        check_choice("loss_agg_mode", self.loss_agg_mode, AGG_MODES)
        check_choice("kl_loss_type", self.kl_loss_type, KL_KINDS)
        check_choice("tis_mode", self.tis_mode, MISMATCH_MODES)
        check_choice("tis_level", self.tis_level, MISMATCH_LEVELS)
        for name in ("use_tis", "use_kl_loss", "use_unbiased_kl", "cispo_clip_low", "mismatch_metrics", "use_opsm"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"LossConfig.{name} must be a bool, got {getattr(self, name)!r}")
        optional = ("eps_clip_high", "eps_clip_c", "tis_clip_low", "value_clip")
        for name in ("eps_clip", "tis_clip", "opsm_delta", "kl_loss_coef", "entropy_coef", "value_coef", *optional):
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"LossConfig.{name} must be a number, got {type(value).__name__} {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"LossConfig.{name} must be finite, got {value!r}")
        for name in (
            "eps_clip",
            "eps_clip_high",
            "kl_loss_coef",
            "value_coef",
            "value_clip",
            "tis_clip_low",
            "opsm_delta",
        ):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"LossConfig.{name} must be >= 0, got {value!r}")
        if self.tis_clip <= 0:
            raise ValueError(f"LossConfig.tis_clip must be > 0, got {self.tis_clip!r}")
        if self.tis_clip_low is not None and self.tis_clip_low >= self.tis_clip:
            raise ValueError(
                f"LossConfig.tis_clip_low must be below tis_clip={self.tis_clip!r}, got {self.tis_clip_low!r}"
            )
        if self.eps_clip_c is not None:
            if self.policy_loss != "ppo":
                raise ValueError(
                    f"LossConfig.eps_clip_c (dual clip) applies to policy_loss 'ppo' only, got {self.policy_loss!r}"
                )
            if self.eps_clip_c <= 1:
                raise ValueError(f"LossConfig.eps_clip_c must be > 1 (or None), got {self.eps_clip_c!r}")
