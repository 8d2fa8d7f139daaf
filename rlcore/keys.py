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
VALUES = "values"
OLD_VALUES = "old_values"
REWARDS = "rewards"
GROUP_IDS = "group_ids"
ADVANTAGES = "advantages"
RETURNS = "returns"
# [B] float32, the group-baseline part of the advantage over a whole batch (rlcore.advantages.sequence_advantages).
SEQUENCE_ADVANTAGES = "sequence_advantages"
