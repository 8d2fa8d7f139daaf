"""Weight sync paused vs drained, with SGLang: one-step and fully async on the fake SGLang server behind the real
router (CPU), the same job twice, once as rlcore runs it (the servers paused around each sync, ``/pause_generation``
in retract mode) and once with the generation in flight drained at each sync (what an engine kind without
``pauses_generation`` gets). Prints a table of the weight-sync wait and the step time, medians over the steps whose
sync found generation in flight (all but the first and the last).

    .venv/bin/python tools/bench_sglang_pause.py          # one_step and fully_async, the default shape
    .venv/bin/python tools/bench_sglang_pause.py --schedules one_step --num-rollout 4 --hold-timeout 2

The fake decodes prompt by prompt, ``--token-delay`` seconds a token (a stand-in for a GPU's decoding). With
``--hold-timeout H`` every request after the first rollout's stops after ``--hold-at`` tokens until the server's
weights change or ``H`` seconds pass (``FakeSGLangServer(hold_timeout=...)``): a drained sync then waits out the hold,
a paused one ends it (the table's last column counts the holds each way ended).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.gpu_suite import commit_of, cpu_model  # noqa: E402

SCHEDULES = ("one_step", "fully_async")
MODES = ("paused", "drained")
COLUMNS = [
    "schedule",
    "sync",
    "syncs paused",
    "weight-sync wait s",
    "step s",
    "rollout s",
    "train s",
    "holds ended by update / timeout",
]


@contextlib.contextmanager
def sglang_pauses(on: bool) -> Iterator[None]:
    """The SGLang engine kind with ``pauses_generation`` as ``on`` for the block (off: each sync drains)."""
    from runtime.engines import registry

    kind = registry.ROLLOUT_ENGINES["sglang"]
    registry.ROLLOUT_ENGINES["sglang"] = dataclasses.replace(kind, pauses_generation=on)
    try:
        yield
    finally:
        registry.ROLLOUT_ENGINES["sglang"] = kind


def measure(schedule: str, mode: str, model: Path, out: Path, args: argparse.Namespace) -> dict[str, object]:
    """One job; the medians of its steps whose sync found generation in flight, and what the fake counted."""
    sys.path.insert(0, str(ROOT / "tests"))
    from fake_sglang import FakeSGLangServer

    from runtime.config import from_dict, validate
    from runtime.logger import METRICS_FILE, read_metrics
    from runtime.loop import run

    per_step = args.rollout_batch_size * args.n_samples_per_prompt
    hold = {"hold_at": args.hold_at, "hold_after": per_step, "hold_timeout": args.hold_timeout}
    with (
        sglang_pauses(mode == "paused"),
        FakeSGLangServer(model, token_delay=args.token_delay, **(hold if args.hold_timeout else {})) as server,
    ):
        cfg = validate(
            from_dict(
                None,
                output_dir=str(out),
                hf_checkpoint=str(model),
                rollout_engine="sglang",
                sglang_url=server.url,
                rollout_schedule=schedule,
                num_rollout=args.num_rollout,
                rollout_batch_size=args.rollout_batch_size,
                n_samples_per_prompt=args.n_samples_per_prompt,
                rollout_max_response_len=args.response_len,
                rollout_top_k=1,  # greedy, no eos: every response runs to its length
                global_batch_size=per_step,
                micro_batch_size=per_step,
                actor_num_gpus_per_node=1,
                rollout_num_gpus=1,
                use_tensorboard=False,
            )
        )
        result = run(cfg, progress=False)
        pauses, releases = len(server.pauses), dict(server.hold_releases)
    rows = read_metrics(result.output_dir / METRICS_FILE)[1:-1]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    return {
        "schedule": schedule,
        "sync": mode,
        "syncs paused": pauses,
        "weight-sync wait s": median("perf/weight_sync_time"),
        "step s": median("perf/step_time"),
        # (fully_async has no rollout of its own per step: its groups are generated across steps)
        "rollout s": median("perf/rollout_time") if "perf/rollout_time" in rows[0] else float("nan"),
        "train s": median("perf/train_time"),
        "holds ended by update / timeout": (
            f"{releases.get('version', 0)} / {releases.get('timeout', 0)}" if args.hold_timeout else "no hold"
        ),
    }


def _cell(value: object) -> str:
    if isinstance(value, float):
        return "n/a" if math.isnan(value) else f"{value:.3f}"
    return str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--schedules", default=",".join(SCHEDULES), help="comma-separated, from " + ", ".join(SCHEDULES)
    )
    parser.add_argument("--num-rollout", type=int, default=6)
    parser.add_argument("--rollout-batch-size", type=int, default=2)
    parser.add_argument("--n-samples-per-prompt", type=int, default=2)
    parser.add_argument("--response-len", type=int, default=48)
    parser.add_argument("--token-delay", type=float, default=0.01, help="seconds per decoded token at the fake")
    parser.add_argument("--hold-at", type=int, default=2)
    parser.add_argument("--hold-timeout", type=float, default=None, help="hold each later request (see above)")
    args = parser.parse_args(argv)
    schedules = [s for s in args.schedules.split(",") if s]
    unknown = sorted(set(schedules) - set(SCHEDULES))
    if unknown:
        parser.error(f"--schedules {','.join(unknown)}: not one of {', '.join(SCHEDULES)}")
    if args.num_rollout < 3:
        parser.error(f"--num-rollout must be >= 3 (the first and the last step are left out), got {args.num_rollout}")
    if args.hold_timeout is not None and not 0 < args.hold_at < args.response_len:
        parser.error(f"--hold-at must be in 1..--response-len - 1 under --hold-timeout, got {args.hold_at}")

    from runtime.demo import task
    from runtime.demo.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-sglang-pause-") as tmp:
        model = make_tiny_model(Path(tmp) / "model", alphabet=task.ALPHABET, seed=0)
        rows = [
            measure(schedule, mode, model, Path(tmp) / f"{schedule}-{mode}", args)
            for schedule in schedules
            for mode in MODES
        ]
    hold = (
        f", each later request held after {args.hold_at} tokens up to {args.hold_timeout:g} s"
        if args.hold_timeout
        else ""
    )
    print(
        f"\nfake SGLang server behind the real router, the built-in tiny model; {args.rollout_batch_size} prompts x "
        f"{args.n_samples_per_prompt} samples x {args.response_len} tokens a step, {args.token_delay:g} s a token"
        f"{hold}; {args.num_rollout} steps, medians of steps 1-{args.num_rollout - 2}; "
        f"{cpu_model() or 'unknown CPU'}, commit {commit_of(ROOT, unknown='unknown')}\n"
    )
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + " --- |" * len(COLUMNS))
    for row in rows:
        print("| " + " | ".join(_cell(row[c]) for c in COLUMNS) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
