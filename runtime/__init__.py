"""rlcore's runtime: config and CLI, data, rollout engines, rewards, training backends, the loop."""
