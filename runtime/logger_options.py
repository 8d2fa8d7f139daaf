"""The ``log`` section of the config: metrics to TensorBoard, wandb and the console, and what is logged (slime's
logging flags), read by :mod:`runtime.logger`. Torch-free: ``runtime.config`` composes :class:`LogConfig` into
:class:`~runtime.config.Config` and checks it before anything starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from runtime.option_fields import described, slime


@dataclass(frozen=True)
class LogConfig:
    use_tensorboard: bool = field(
        default=False,
        metadata=described(
            "write TensorBoard event files to the output dir",
            slime=slime("tensorboard", False, note="built-in job: on"),
        ),
    )
    use_wandb: bool = field(
        default=False,
        metadata=described("log to Weights & Biases (needs the wandb package)", slime=slime("wandb", False)),
    )
    wandb_project: str | None = field(
        default=None, metadata=described("W&B project", slime=slime("megatron (reset by slime)", None))
    )
    wandb_team: str | None = field(default=None, metadata=described("W&B entity", slime=slime("wandb", None)))
    wandb_group: str | None = field(
        default=None, metadata=described("W&B group (and run name)", slime=slime("wandb", None))
    )
    wandb_mode: Literal["online", "offline", "disabled"] | None = field(
        default=None, metadata=described("W&B mode", slime=slime("wandb", None))
    )
    wandb_dir: str | None = field(
        default=None,
        metadata=described(
            "W&B local folder (unset: --output-dir)", slime=slime("wandb", None, note="unset: --output-dir")
        ),
    )
    wandb_key: str | None = field(
        default=None, metadata=described("W&B API key (logs in unless offline)", slime=slime("wandb", None))
    )
    wandb_host: str | None = field(
        default=None, metadata=described("W&B host of the login", slime=slime("wandb", None))
    )
    wandb_run_id: str | None = field(
        default=None, metadata=described("resume this W&B run", slime=slime("wandb", None))
    )
    disable_wandb_random_suffix: bool = field(
        default=False,
        metadata=described("no random suffix on --wandb-group (and the run name)", slime=slime("wandb", False)),
    )
    tb_project_name: str | None = field(
        default=None,
        metadata=described(
            "TensorBoard: write to tensorboard_log/<this>/<--tb-experiment-name>",
            slime=slime("tensorboard", None, note="unset (and no $TENSORBOARD_DIR): --output-dir/tensorboard"),
        ),
    )
    tb_experiment_name: str | None = field(
        default=None,
        metadata=described(
            "TensorBoard experiment (unset: the start time) under --tb-project-name", slime=slime("tensorboard", None)
        ),
    )
    log_reward_category: str | None = field(
        default=None,
        metadata=described(
            "log the fraction of samples by this entry of their dict reward", slime=slime("wandb", None)
        ),
    )
    log_passrate: bool = field(
        default=False,
        metadata=described(
            "log pass@k (k = 1, 2, 4, ... up to the group size) of rollouts and evaluation",
            slime=slime("wandb", False),
        ),
    )
    log_multi_turn: bool = field(
        default=False,
        metadata=described(
            "log response lengths with and without tool output, and round counts", slime=slime("wandb", False)
        ),
    )
    log_correct_samples: bool = field(
        default=False,
        metadata=described(
            "log the correct samples' (reward 1) response lengths by quarter of --rollout-max-response-len, and "
            "their mean -log-prob",
            slime=slime(
                "wandb",
                False,
                note="rollout/correct_entropy is the mean over correct samples (slime's sums their sample means)",
            ),
        ),
    )
    wandb_always_use_train_step: bool = field(
        default=False,
        metadata=described(
            "W&B and TensorBoard x axis: optimizer steps so far (rollout x steps per rollout), not rollouts",
            slime=slime("wandb", False, note="TensorBoard's axis too; metrics.jsonl keeps the rollout"),
        ),
    )
