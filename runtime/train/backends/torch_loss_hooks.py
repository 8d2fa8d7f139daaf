"""slime's loss hooks on the ``torch`` backend (:mod:`runtime.train.backends.torch_backend`): ``--loss-type
sft_loss``, ``--custom-pg-loss-reducer-function-path``, ``--custom-tis-function-path`` and
``--custom-loss-function-path``, each adapted to one micro-batch of :func:`rlcore.losses.rl_loss`'s step."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from rlcore import keys
from rlcore.losses import Normalizer, aggregate, sft_loss
from runtime.train.batch import PROMPT_LENGTHS, RESPONSE_LENGTHS, TOKENS
from runtime.train.hooks import (
    concat_rows,
    custom_tis,
    rollout_data_view,
    sum_of_sample_mean,
)


class TorchLossHooks:
    """slime's loss hooks on one micro-batch of :class:`~runtime.train.backends.torch_backend.TorchTrainer`
    (methods of the trainer)."""

    def _sft_loss(self, batch: TensorDict, norm: Normalizer, *, mode: str) -> torch.Tensor:
        """``--loss-type sft_loss`` on one micro-batch: the NLL of its loss-masked response tokens, aggregated with
        ``mode`` over the global batch's ``norm``."""
        log_probs, _ = self._forward(self.model, batch, with_entropy=False)
        return aggregate(
            sft_loss(log_probs, mask=batch[keys.MASK]),
            batch[keys.MASK],
            mode=mode,
            norm=norm,
            seq_token_counts=batch.get(keys.SEQ_TOKEN_COUNTS, None),
        )

    def _slime_count(self, norm: Normalizer) -> torch.Tensor:
        """The global count slime's reducers are divided by: tokens (per-token loss) or samples."""
        count = norm.num_tokens if self.hooks.per_token_loss else norm.num_seqs
        return torch.as_tensor(count, device=self.device, dtype=torch.float32).clamp_min(1)

    def _pg_reduce(self, reducer: Any, batch: TensorDict, norm: Normalizer) -> Any:
        """slime's custom pg reducer over this micro-batch, as a ``pg_reduce`` of ``rl_loss``."""
        response = batch[RESPONSE_LENGTHS].tolist()
        total = (batch[PROMPT_LENGTHS] + batch[RESPONSE_LENGTHS]).tolist()
        masks = [batch[keys.MASK][i, :r].int() for i, r in enumerate(response)]
        reduce = reducer(total, response, masks, self.hooks.per_token_loss)
        if not callable(reduce):
            raise reducer.wrong_type(reduce, "a reducer: a function of the concatenated per-token loss")
        count = self._slime_count(norm)
        return lambda pg: reduce(concat_rows(pg, response)) / count

    def _mismatch(self, hook: Any, batch: TensorDict) -> Any:
        """slime's ``--custom-tis-function-path`` over this micro-batch, as a ``mismatch`` of ``rl_loss``."""
        response = batch[RESPONSE_LENGTHS].tolist()
        total = (batch[PROMPT_LENGTHS] + batch[RESPONSE_LENGTHS]).tolist()
        return custom_tis(hook, self.hooks.args, response_lengths=response, total_lengths=total)

    def _custom_loss(self, batch: TensorDict, norm: Normalizer) -> tuple[torch.Tensor, dict[str, Any]]:
        """slime's ``--custom-loss-function-path`` on one micro-batch: ``fn(args, batch, logits, sum_of_sample_mean)``
        with the rows' logits packed as [1, sum(total_lengths), V] and slime's per-sample ``batch``."""
        fn = self._hook["custom_loss_function_path"]
        total = (batch[PROMPT_LENGTHS] + batch[RESPONSE_LENGTHS]).tolist()
        width = max(total)
        attention = torch.arange(width, device=self.device)[None, :] < torch.tensor(total, device=self.device)[:, None]
        # Routing replay as in the policy loss's forward: these right-padded rows cut to the longest are the padded
        # layout (whatever --use-dynamic-batch-size packs elsewhere).
        self._route(self.model, batch, packed=False)
        with self._autocast():
            logits = self.model(
                input_ids=batch[TOKENS][:, :width], attention_mask=attention.long(), use_cache=False
            ).logits
        packed = torch.cat([logits[i, :n] for i, n in enumerate(total)])[None]
        view = rollout_data_view(batch)
        view["unconcat_tokens"] = view["tokens"]
        reduce = sum_of_sample_mean(
            view["loss_masks"],
            view["rollout_mask_sums"],
            per_token=self.hooks.per_token_loss,
            global_count=self._slime_count(norm),
        )
        out = fn(self.hooks.args, view, packed, reduce)
        if not (isinstance(out, tuple | list) and len(out) == 2 and torch.is_tensor(out[0]) and out[0].dim() == 0):
            raise fn.wrong_type(out, "(loss: 0-dim tensor, metrics: dict)")
        loss, metrics = out
        return loss, {k: (v.detach() if torch.is_tensor(v) else v) for k, v in dict(metrics).items()}
