"""Key names of the batch contract (see DESIGN.md): the one place they are spelled out.

A rollout batch is a ``TensorDict`` with ``batch_size=[B]``. Token tensors are response-aligned and
right-padded to ``T``.
"""

MASK = "mask"
LOG_PROBS = "log_probs"
OLD_LOG_PROBS = "old_log_probs"
ROLLOUT_LOG_PROBS = "rollout_log_probs"
REF_LOG_PROBS = "ref_log_probs"
TEACHER_LOG_PROBS = "teacher_log_probs"
ENTROPY = "entropy"
# [B, T] float32, optional: the entropy of each token's distribution in the actor's and the reference's log-prob
# passes (slime's --use-rollout-entropy: rollout_data["entropy"] and ["ref_entropy"]); no loss term reads them.
OLD_ENTROPY = "old_entropy"
REF_ENTROPY = "ref_entropy"
VALUES = "values"
OLD_VALUES = "old_values"
REWARDS = "rewards"
GROUP_IDS = "group_ids"
ADVANTAGES = "advantages"
RETURNS = "returns"
# [B] float32, the group-baseline part of the advantage over a whole batch (rlcore.advantages.sequence_advantages).
SEQUENCE_ADVANTAGES = "sequence_advantages"
# [B] int64, optional: the valid-token count a sample's token sum is divided by under ``seq_mean_token_mean`` when
# one rollout was split into several samples (the whole rollout's count, slime's ``rollout_mask_sums``).
SEQ_TOKEN_COUNTS = "seq_token_counts"
# [B] int64, optional: how many sequences a row counts as in the ``seq_mean_*`` denominators (1 for the first row
# of a rollout, 0 for the other pieces of a split rollout).
SEQ_COUNTS = "seq_counts"
