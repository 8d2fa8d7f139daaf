"""Job logging: ``metrics.jsonl`` (a line per step), TensorBoard event files, optional W&B, the console, plots."""

from __future__ import annotations

import datetime
import json
import math
import os
import secrets
import string
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
# Per step: the dataset indices of the prompts trained, and of those generated but filtered, discarded or aborted.
LEDGER_FILE = "rollout_ledger.jsonl"
REWARD_PLOT = "reward_curve.png"

# The per-step console line: (metric, label, format).
CONSOLE_FIELDS = (
    ("rollout/reward_mean", "reward", "{:.3f}"),
    ("train/kl", "kl", "{:.4f}"),
    ("train/entropy", "entropy", "{:.3f}"),
    ("train/clipfrac", "clipfrac", "{:.3f}"),
    ("train/critic/value_loss", "value_loss", "{:.4f}"),
    ("perf/step_time", "", "{:.2f}s/step"),
)


def _plain(value: Any) -> float | int:
    value = float(value) if not isinstance(value, int) else value
    return value


def _json_value(value: float | int) -> float | int | None:
    # NaN and infinities are not JSON: json.dumps would write bare NaN, which strict readers reject.
    return value if math.isfinite(value) else None


def format_step_line(step: int, total: int, metrics: Mapping[str, Any]) -> str:
    parts = [f"step {step}/{total}"]
    for key, label, fmt in CONSOLE_FIELDS:
        if key in metrics:
            parts.append(f"{label} {fmt.format(metrics[key])}".strip())
    if "eval/reward_mean" in metrics:
        parts.append(f"eval {metrics['eval/reward_mean']:.3f}")
    return "  ".join(parts)


def repair_rows(path: str | os.PathLike[str], *, before_step: int) -> dict[str, int]:
    """Rewrite the JSONL file ``path`` (``metrics.jsonl``, ``LEDGER_FILE``) for a job resumed at ``before_step``: keep
    the rows of earlier steps, in order, and drop the rows of ``before_step`` on (the resumed job writes them again)
    and every line that is not a JSON row with a ``step`` (the torn last line of a job killed while writing).

    The file is replaced atomically. Returns the counts ``{"kept", "dropped_later", "dropped_unreadable"}``; a
    missing file is left missing.
    """
    path = Path(path)
    counts = {"kept": 0, "dropped_later": 0, "dropped_unreadable": 0}
    if not path.exists():
        return counts
    kept = []
    with open(path, "rb") as fh:
        for raw in fh:
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
                step = row["step"] if isinstance(row, dict) else None
            except ValueError:  # JSONDecodeError and UnicodeDecodeError
                step = None
            if not isinstance(step, int):
                counts["dropped_unreadable"] += 1
            elif step >= before_step:
                counts["dropped_later"] += 1
            else:
                kept.append(raw.rstrip(b"\r\n") + b"\n")
    counts["kept"] = len(kept)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(b"".join(kept))
    os.replace(tmp, path)
    return counts


class MetricsLogger:
    """Writes each step's metrics to ``output_dir/metrics.jsonl``, TensorBoard and (optionally) W&B.

    A job resumed at ``start_step`` keeps the rows of earlier steps (:func:`repair_rows`: later rows and a torn last
    line are dropped); a job from step 0 starts the file afresh. TensorBoard drops the events at and after
    ``tensorboard_purge_step`` (default ``start_step``; the x-axis value of the resumed step) left by the run before.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str],
        *,
        use_tensorboard: bool = True,
        use_wandb: bool = False,
        wandb_project: str | None = None,
        config: Mapping[str, Any] | None = None,
        start_step: int = 0,
        tensorboard_dir: str | os.PathLike[str] | None = None,
        wandb_options: WandbOptions | None = None,
        tensorboard_purge_step: int | None = None,
    ):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.repaired = repair_rows(self.dir / METRICS_FILE, before_step=start_step) if start_step > 0 else None
        self._file = open(self.dir / METRICS_FILE, "a" if start_step > 0 else "w")
        self._tb = None
        if use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # A resumed job redoes the steps after its checkpoint: TensorBoard drops the first run's events from the
            # resumed step on (its purge step, at the step's x-axis value), so each step is plotted once.
            purge = tensorboard_purge_step if tensorboard_purge_step is not None else start_step
            self._tb = SummaryWriter(
                log_dir=str(tensorboard_dir or self.dir / "tensorboard"), purge_step=purge if purge > 0 else None
            )
        self._wandb = None
        if use_wandb:
            options = wandb_options or WandbOptions(project=wandb_project)
            self._wandb = options.init(config=dict(config or {}), default_dir=str(self.dir))

    def log(self, step: int, metrics: Mapping[str, Any], *, axis_step: int | None = None) -> None:
        """One row of rollout ``step`` in ``metrics.jsonl``; TensorBoard and W&B plot it at ``axis_step`` (default
        ``step``; slime's ``--wandb-always-use-train-step`` plots at the optimizer step)."""
        axis = step if axis_step is None else axis_step
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps({k: _json_value(v) for k, v in row.items()}, allow_nan=False) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in row.items():
                if key != "step" and math.isfinite(value):
                    self._tb.add_scalar(key, value, axis)
            self._tb.flush()
        if self._wandb is not None:
            # The values TensorBoard gets (plain numbers), non-finite ones too (W&B plots them as gaps).
            self._wandb.log({k: v for k, v in row.items() if k != "step"}, step=axis)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


@dataclass(frozen=True)
class WandbOptions:
    """slime's W&B flags: ``--wandb-project``, ``--wandb-team`` (entity), ``--wandb-group`` (also the run name; a
    random suffix is added unless ``--disable-wandb-random-suffix``), ``--wandb-mode``, ``--wandb-dir``,
    ``--wandb-key`` / ``--wandb-host`` (a login, when not offline) and ``--wandb-run-id`` (resume that run)."""

    project: str | None = None
    team: str | None = None
    group: str | None = None
    mode: str | None = None
    dir: str | None = None
    key: str | None = None
    host: str | None = None
    run_id: str | None = None
    random_suffix: bool = True

    def init(self, *, config: dict[str, Any], default_dir: str) -> Any:
        import wandb

        offline = (self.mode or os.environ.get("WANDB_MODE")) == "offline"
        if self.key is not None and not offline:
            wandb.login(key=self.key, host=self.host)
        group = self.group
        if group is not None and self.random_suffix:
            # slime calls wandb.util.generate_id, which wandb 0.31 no longer has: the same kind of id (8 base-36).
            group = f"{group}_{''.join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))}"
        kwargs: dict[str, Any] = {
            "project": self.project,
            "entity": self.team,
            "group": group,
            "name": group,
            "config": config,
            "dir": self.dir or default_dir,
        }
        if self.mode is not None:
            kwargs["mode"] = self.mode
        if self.run_id is not None:
            kwargs.update(id=self.run_id, resume="allow")
        if self.dir is not None:
            os.makedirs(self.dir, exist_ok=True)
        return wandb.init(**kwargs)


def tensorboard_dir(output_dir: str | os.PathLike[str], *, project: str | None, experiment: str | None) -> Path:
    """Where TensorBoard event files go: ``$TENSORBOARD_DIR``, or ``tensorboard_log/<project>/<experiment>`` with
    ``--tb-project-name`` (the experiment defaults to the start time), as slime; else ``output_dir/tensorboard``."""
    if os.environ.get("TENSORBOARD_DIR"):
        return Path(os.environ["TENSORBOARD_DIR"])
    if project is not None:
        experiment = experiment or datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
        return Path("tensorboard_log") / project / experiment
    return Path(output_dir) / "tensorboard"


def append_ledger(output_dir: str | os.PathLike[str], step: int, prompts: Mapping[str, list[int]]) -> None:
    """Append step ``step``'s row to ``LEDGER_FILE``: prompt indices by what became of them (``trained``, ...)."""
    with open(Path(output_dir) / LEDGER_FILE, "a") as fh:
        fh.write(json.dumps({"step": step, **{k: list(v) for k, v in prompts.items()}}) + "\n")


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` (or ``LEDGER_FILE``); a step logged twice (a resumed job) keeps its last
    row."""
    rows: dict[int, dict[str, Any]] = {}
    with open(path) as fh:
        for line in fh:
            if line.strip():
                row = json.loads(line)
                rows[row["step"]] = row
    return [rows[k] for k in sorted(rows)]


def plot_rewards(metrics_path: str | os.PathLike[str], png_path: str | os.PathLike[str], *, window: int = 10) -> None:
    """Plot ``rollout/reward_mean`` per step (and its moving average, and eval reward if logged) to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    # A null (non-finite when logged) reward is no point on the curve.
    points = [(r["step"], r["rollout/reward_mean"]) for r in rows if r.get("rollout/reward_mean") is not None]
    steps = [step for step, _ in points]
    rewards = [reward for _, reward in points]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, alpha=0.4, label="reward (per step)")
    if len(rewards) >= window:
        smooth = [sum(rewards[i - window + 1 : i + 1]) / window for i in range(window - 1, len(rewards))]
        ax.plot(steps[window - 1 :], smooth, label=f"reward ({window}-step mean)")
    evals = [(r["step"], r["eval/reward_mean"]) for r in rows if r.get("eval/reward_mean") is not None]
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="eval reward")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, max([1.0, *rewards]))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
