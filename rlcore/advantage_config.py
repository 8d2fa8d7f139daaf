"""The advantage step's knobs and the estimator names: torch-free, so a front end (``rlcore-run --help``, a config
check) reads rlcore's ranges without importing torch. :mod:`rlcore.advantages` re-exports everything here; its
estimator table (:mod:`rlcore.advantages.compute`) is checked against these names when it loads."""

from dataclasses import dataclass

from rlcore._values import check_choice, check_non_negative, check_positive, check_unit_interval
from rlcore.loss_config import KL_KINDS

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
# The estimators with a sequence-level group baseline (they need whole groups of samples of one prompt).
GROUP_BASELINE_ESTIMATORS = ("grpo", "dr_grpo", "gspo", "rloo", "reinforce_plus_plus_baseline")


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
        group_normalize: for the estimators with a group baseline; off, the raw reward is the sequence advantage
            (no baseline at all: slime's ``--disable-rewards-normalization``).
        opd_kl_coef: on-policy distillation on top of any estimator (slime's ``--use-opd --opd-kl-coef``), >= 0:
            ``opd_kl_coef * (log_probs - teacher_log_probs)`` is subtracted from every token's advantage before
            whitening; 0 is off and reads no teacher.
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
    group_normalize: bool = True
    opd_kl_coef: float = 0.0
    eps: float = 1e-6
    whiten_eps: float = 1e-8

    def __post_init__(self) -> None:
        check_choice("estimator", self.estimator, ESTIMATORS)
        check_choice("kl_kind", self.kl_kind, KL_KINDS)
        check_unit_interval("gamma", self.gamma)
        check_unit_interval("lam", self.lam)
        check_non_negative("kl_coef", self.kl_coef)
        check_non_negative("opd_kl_coef", self.opd_kl_coef)
        check_positive("eps", self.eps)
        check_non_negative("whiten_eps", self.whiten_eps)
