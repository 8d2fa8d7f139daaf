"""Plot the reward curve of a job from its ``metrics.jsonl`` (the job writes ``reward_curve.png`` itself at the end).

python tools/plot_rewards.py outputs/default/metrics.jsonl [out.png]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from runtime.logger import plot_rewards, read_metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics")
    parser.add_argument("png", nargs="?", default="reward_curve.png")
    args = parser.parse_args(argv)
    # A null reward (a NaN the logger could not write as JSON) is no point on the curve.
    rewards = [
        r["rollout/reward_mean"] for r in read_metrics(args.metrics) if r.get("rollout/reward_mean") is not None
    ]
    if not rewards:
        print(f"{args.metrics}: no rollout/reward_mean rows yet; nothing to plot", file=sys.stderr)
        return 1
    plot_rewards(args.metrics, args.png)
    head, tail = rewards[:10], rewards[-10:]
    print(f"{len(rewards)} steps; reward first 10: {statistics.mean(head):.3f}, last 10: {statistics.mean(tail):.3f}")
    print(f"plot written to {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
