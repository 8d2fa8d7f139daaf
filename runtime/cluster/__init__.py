"""The cluster: Ray placement, trainer and engine groups, weight sync, checkpoints."""
