"""Training: rollout batches, the advantage and loss settings, and the training backends."""
