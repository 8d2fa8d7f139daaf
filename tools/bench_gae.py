"""Time rlcore's GAE against torchrl's and a per-token Python loop on one [B, T] float32 batch.

    .venv/bin/python tools/bench_gae.py [--batch 64] [--length 2048] [--repeats 25]

Prints one row per implementation: median and best wall time over ``--repeats`` runs after warm-up, with torch's
default thread count (as CI runs it).
"""

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torchrl.objectives.value.functional import generalized_advantage_estimate, vec_generalized_advantage_estimate

from rlcore.advantages import gae

GAMMA, LAM = 0.99, 0.95


def per_token_loop(rewards: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The textbook recurrence, vectorised over the batch, one Python step per token (slime's ``vanilla_gae``)."""
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    out = torch.empty_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else 0.0
        running = rewards[:, t] + GAMMA * next_value - values[:, t] + GAMMA * LAM * running
        out[:, t] = running
    return out


def timings(fn: Callable[[], object], repeats: int) -> list[float]:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=25)
    args = parser.parse_args()

    g = torch.Generator().manual_seed(0)
    shape = (args.batch, args.length)
    rewards, values = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    full = torch.ones(shape, dtype=torch.bool)
    # Multi-turn: right padding plus tool-output holes that the scan skips.
    lengths = torch.randint(args.length // 2, args.length + 1, (args.batch,), generator=g)
    holes = (torch.arange(args.length)[None, :] < lengths[:, None]) & (torch.rand(shape, generator=g) < 0.8)

    # torchrl layout: [B, T, 1]; the last step terminates, so the value after it is 0 as in rlcore.
    r3, v3 = rewards[..., None], values[..., None]
    next_v3 = torch.cat([v3[:, 1:], torch.zeros_like(v3[:, :1])], dim=1)
    done = torch.zeros(*shape, 1, dtype=torch.bool)
    done[:, -1] = True

    rows = [
        ("rlcore gae (all tokens valid)", lambda: gae(rewards, values, full, gamma=GAMMA, lam=LAM)),
        ("rlcore gae (padding + tool holes)", lambda: gae(rewards, values, holes, gamma=GAMMA, lam=LAM)),
        (
            "torchrl vec_generalized_advantage_estimate",
            lambda: vec_generalized_advantage_estimate(GAMMA, LAM, v3, next_v3, r3, done, done),
        ),
        (
            "torchrl generalized_advantage_estimate",
            lambda: generalized_advantage_estimate(GAMMA, LAM, v3, next_v3, r3, done, done),
        ),
        ("per-token Python loop", lambda: per_token_loop(rewards, values)),
    ]
    reference = per_token_loop(rewards, values)
    ours = gae(rewards, values, full, gamma=GAMMA, lam=LAM)[0]
    theirs = vec_generalized_advantage_estimate(GAMMA, LAM, v3, next_v3, r3, done, done)[0][..., 0]
    print(
        f"GAE on [{args.batch}, {args.length}] float32, gamma={GAMMA}, lam={LAM}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.repeats} runs"
    )
    print(
        f"max |rlcore - loop| = {float((ours - reference).abs().max()):.2e}, "
        f"max |torchrl - loop| = {float((theirs - reference).abs().max()):.2e}"
    )
    print(f"{'implementation':<44} {'median ms':>10} {'best ms':>9}")
    for name, fn in rows:
        times = timings(fn, args.repeats)
        print(f"{name:<44} {1e3 * statistics.median(times):>10.2f} {1e3 * min(times):>9.2f}")


if __name__ == "__main__":
    main()
