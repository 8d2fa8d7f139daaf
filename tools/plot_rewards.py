"""Plot the reward curve of a job from its ``metrics.jsonl`` (the job writes ``reward_curve.png`` itself at the end).

python tools/plot_rewards.py outputs/default/metrics.jsonl [out.png]
"""

from __future__ import annotations

import argparse
import statistics

from runtime.logger import plot_rewards, read_metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics")
    parser.add_argument("png", nargs="?", default="reward_curve.png")
    args = parser.parse_args(argv)
    plot_rewards(args.metrics, args.png)
    rewards = [row["rollout/reward_mean"] for row in read_metrics(args.metrics) if "rollout/reward_mean" in row]
    head, tail = rewards[:10], rewards[-10:]
    print(f"{len(rewards)} steps; reward first 10: {statistics.mean(head):.3f}, last 10: {statistics.mean(tail):.3f}")
    print(f"plot written to {args.png}")


if __name__ == "__main__":
    main()
