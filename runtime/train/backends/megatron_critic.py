"""The Megatron backend's critic (``--advantage-estimator ppo``), as slime builds it.

slime's critic is the actor's ``GPTModel`` whose output layer is ``LinearForLastLayer``: a ``Linear(hidden, 1)`` with a
bias, weights from N(0, ``init_method_std``^2) and bias 0, its output in float32 (gathered over the sequence-parallel
ranks). :class:`ValueHead` is that layer, with its weights drawn from the job's seed on the CPU (the same on every
rank, and the same as the torch backend's critic head: slime draws from each rank's stream, which lets TP ranks
disagree, THUDM/slime#1419). The LM head is not built (the embedding keeps its own weight, untied).

:class:`MegatronCritic` holds that model with its own optimizer and LR schedule, built from the same flags as the
actor's (slime's critic inherits the actor's Megatron settings; rlcore has no ``--megatron-config-path``). Its values
are the value head's outputs at the positions that predict each response token, its loss
:func:`rlcore.losses.critic_loss` (``--value-clip``, the job's aggregation over the whole global batch), and its
checkpoint a ``torch_dist`` folder of its own (model, optimizer, LR schedule) inside the actor's, :data:`CRITIC_DIR`.

Over pipeline stages (even or uneven, tested over gloo) the value head is on the last stage, the micro-batches run
Megatron's 1F1B schedule as the actor's, and the values are broadcast from the last stage. Not built: a critic started
from a Megatron checkpoint (it starts from the HF model, as the torch backend's does).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from rlcore import keys
from rlcore.losses import Normalizer, critic_loss
from runtime.train.backends import megatron_checkpoint as mck
from runtime.train.backends import megatron_weights as mw
from runtime.train.backends.megatron_config import ModelShape
from runtime.train.backends.torch_models import VALUE_HEAD_INIT_STD
from runtime.train.batch import PROMPT_LENGTHS, RESPONSE_TOKENS
from runtime.train.metrics import add_step, sums_and_maxima
from runtime.train.packing import in_row_order

if TYPE_CHECKING:
    from runtime.train.backends.megatron_backend import MegatronTrainer

# The critic's checkpoint, a torch_dist folder of its own inside the actor's (slime saves it to its own directory).
CRITIC_DIR = "critic"
# The value head's parameters: GPTModel's output layer.
HEAD_NAMES = ("output_layer.weight", "output_layer.bias")
# The critic's GPTModel has no LM head to tie to the embedding (its output layer is the value head).
GPT_KWARGS = {"share_embeddings_and_output_weights": False}


def checkpoint_start_refusal(path: str) -> str:
    """The error for a critic asked to start from the Megatron checkpoint ``path``."""
    return (
        f"the Megatron critic starts from the HF model (a fresh value head over its weights); {path} is a Megatron "
        "checkpoint, which it cannot start from (resume a job's critic with --load of its --save folder)"
    )


class ValueHead(torch.nn.Linear):
    """slime's ``LinearForLastLayer``: ``[s, b, hidden] -> ([s, b, 1] float32 values, None)``, called as GPTModel
    calls its output layer (the ``weight`` it passes, the embedding when tied, is not used).

    Args:
        hidden_size: the model's hidden size.
        seed: the generator seed of the weights, N(0, ``init_std``^2) drawn on the CPU (bias 0).
        config: the model's ``TransformerConfig``; under ``sequence_parallel`` the values are gathered over the
            TP ranks and the parameters marked so that Megatron all-reduces their gradients over TP.
        init_std: the weights' standard deviation (Megatron's ``init_method_std``, 0.02).
    """

    def __init__(self, hidden_size: int, *, seed: int, config: Any, init_std: float = VALUE_HEAD_INIT_STD):
        super().__init__(hidden_size, 1, bias=True)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, generator=generator) * init_std)
            self.bias.zero_()
        self.sequence_parallel = bool(config.sequence_parallel)
        if self.sequence_parallel:
            self.weight.sequence_parallel = True
            self.bias.sequence_parallel = True

    def forward(
        self, hidden: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: bool | None = None
    ) -> tuple[torch.Tensor, None]:
        values = super().forward(hidden).float()
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None


def critic_shapes(
    shape: ModelShape, *, tp_size: int, pp_rank: int, pp_size: int, ep_size: int = 1
) -> dict[str, tuple[int, ...]]:
    """The shape of every parameter of the critic's stage ``pp_rank`` (with ``ep_size`` expert-parallel ranks): the
    actor's without an LM head, and on the last stage the value head (``[1, hidden]`` and ``[1]``)."""
    expected = mw.megatron_shapes(shape, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, ep_size=ep_size)
    expected.pop(HEAD_NAMES[0], None)
    if pp_rank == pp_size - 1:
        expected.update({HEAD_NAMES[0]: (1, shape.hidden_size), HEAD_NAMES[1]: (1,)})
    return expected


def check_critic_state(
    state: Mapping[str, torch.Tensor],
    shape: ModelShape,
    *,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    what: str,
    ep_size: int = 1,
) -> None:
    """``ValueError`` unless ``state`` holds exactly the tensors and shapes of :func:`critic_shapes`; ``what`` names
    the side in the message."""
    expected = critic_shapes(shape, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, ep_size=ep_size)
    mw.check_shapes(state, expected, what=f"{what} (critic)", kind="tensors")


def response_values(output: torch.Tensor, prompt_lengths: torch.Tensor, response_len: int) -> torch.Tensor:
    """Response-aligned values ``[b, T]`` float32 from the value head's ``output`` ``[b, width, 1]``: at response
    token ``t`` the output at position ``prompt_length - 1 + t`` (the state before the token), positions past the
    sequence clamped to its last (they are masked out)."""
    width = output.shape[1]
    offsets = torch.arange(response_len, device=output.device)
    positions = (prompt_lengths.to(output.device)[:, None] - 1 + offsets).clamp(max=width - 1)
    return output[..., 0].gather(1, positions).float()


class MegatronCritic:
    """The critic of one Megatron rank: its ``GPTModel`` with a :class:`ValueHead`, optimizer and LR schedule. It
    runs inside ``trainer`` (:class:`~runtime.train.backends.megatron_backend.MegatronTrainer`): the same process
    groups, micro-batches, gradient reduction and clipping as the actor. Every method is a collective."""

    def __init__(self, trainer: MegatronTrainer, path: str):
        self.trainer = trainer
        self.model = trainer._build(path, trainable=True, value_head=True)
        self.optimizer, self.scheduler = trainer._build_optimizer(self.model)

    @torch.no_grad()
    def values(self, td: TensorDict, *, parts: list[TensorDict] | None = None) -> torch.Tensor:
        """``[B, T]`` float32 values (on the CPU) of this rank's shard ``td``, for the rollout's ``values``: in
        ``td``'s row order, or in the order of the micro-batches ``parts`` where given (the caller undoes any
        regrouping); over pipeline stages the last stage's, broadcast to the others."""
        t = self.trainer
        groups = None
        if parts is None:
            parts, groups = t._log_prob_parts(td)
        kept: list[torch.Tensor] = []

        def keep(output: torch.Tensor, mb: TensorDict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            kept.append(response_values(output, mb[PROMPT_LENGTHS], mb[RESPONSE_TOKENS].shape[1]))
            return output.new_zeros(()), {"micro_batches": output.new_ones(())}

        t._run(self.model, parts, forward_only=True, loss_fn=keep)
        if t.pp > 1:
            group = t.ps.get_pipeline_model_parallel_group()
            src = t.ps.get_pipeline_model_parallel_last_rank()
            for i, mb in enumerate(parts):
                if not t.last_stage:
                    kept.append(torch.empty(mb[RESPONSE_TOKENS].shape, dtype=torch.float32, device=t.device))
                dist.broadcast(kept[i], src=src, group=group)
        values = torch.cat(kept).cpu()
        return in_row_order(values, groups)

    def _loss(self, norm: Normalizer) -> Any:
        """The value loss of one micro-batch as the backend's ``_run`` takes it: ``(output [b, width, 1], mb) ->
        (loss, metrics)``, aggregated over the global batch's ``norm``."""
        t = self.trainer

        def loss_fn(output: torch.Tensor, mb: TensorDict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            batch = mb.to(t.device, non_blocking=False).clone(recurse=False)
            batch.set(keys.VALUES, response_values(output, mb[PROMPT_LENGTHS], mb[RESPONSE_TOKENS].shape[1]))
            loss, metrics = critic_loss(
                batch, clip=t.loss_cfg.value_clip, loss_agg_mode=t.loss_cfg.loss_agg_mode, norm=norm
            )
            return loss, dict(metrics.items())

        return loss_fn

    def train(self, td: TensorDict, *, per_step_rows: int) -> dict[str, float]:
        """Optimizer steps over this rank's shard ``td``, ``per_step_rows`` rows each, on slime's value loss.

        ``td`` carries ``mask``, ``old_values`` and ``returns`` (:func:`runtime.train.step.critic_targets`). Returns
        the torch backend's ``critic/``-prefixed metrics averaged over the steps: ``value_loss``,
        ``value_clipfrac``, ``values_mean`` (token means of each global batch), ``grad_norm`` and ``num_steps``. The
        micro-batches run as the actor's (each DP rank's loss its share of the global batch's; Megatron's 1F1B
        schedule over pipeline stages)."""
        t = self.trainer
        n = td.batch_size[0]
        if not isinstance(per_step_rows, int) or per_step_rows < 1 or n % per_step_rows:
            raise ValueError(f"shard of {n} rows is not a whole number of critic steps of {per_step_rows} rows")
        steps = n // per_step_rows
        totals: dict[str, float] = {}
        for step in range(steps):
            parts = t._micro_batches(td[step * per_step_rows : (step + 1) * per_step_rows])
            t._zero_grad(self.model, self.optimizer)
            loss_fn = self._loss(t._global_normalizer(parts))
            sums, _ = sums_and_maxima(t._train_run(self.model, parts, loss_fn))
            step_metrics = t._all_reduce(sums, dist.ReduceOp.SUM)
            step_metrics["grad_norm"] = t._optimizer_step(self.model, self.optimizer, self.scheduler)
            add_step(totals, step_metrics, steps=steps)
        totals["num_steps"] = steps
        return {f"critic/{name}": value for name, value in totals.items()}

    # ------------------------------------------------------------------ checkpoints

    def _sharded_state(self, *, with_optimizer: bool, is_loading: bool) -> dict[str, Any]:
        """The critic's sharded state dict: the model, and unless ``with_optimizer`` is False the optimizer's state
        and the LR schedule, laid out as the actor's (:meth:`MegatronTrainer._sharded_state`)."""
        from runtime.train.backends.megatron_backend import OPTIMIZER_SHARDING

        t = self.trainer
        model_sd = t._module(self.model).sharded_state_dict()
        state: dict[str, Any] = {"model": model_sd, "checkpoint_version": 3.0}
        if with_optimizer:
            state["opt_param_scheduler"] = self.scheduler.state_dict()
            if t.cpu:
                state["optimizer"] = t._cpu_optimizer_state(model_sd, self.optimizer)
            else:
                t._start_optimizer_state(self.optimizer)  # as the actor's (MegatronTrainer._sharded_state)
                state["optimizer"] = self.optimizer.sharded_state_dict(
                    model_sd, is_loading=is_loading, metadata=OPTIMIZER_SHARDING
                )
        return state

    def save(self, path: str, *, with_optimizer: bool) -> None:
        """The critic's ``torch_dist`` checkpoint in the folder ``path`` (the model; the optimizer and LR schedule
        unless ``with_optimizer`` is False)."""
        mck.save_sharded(self._sharded_state(with_optimizer=with_optimizer, is_loading=False), path)

    def load(self, path: str) -> None:
        """Restore :meth:`save`'s folder ``path``: the model, and the optimizer and LR schedule when it has them.
        ``RuntimeError`` when there is none (a checkpoint of a job without a critic)."""
        from megatron.core import dist_checkpointing

        t = self.trainer
        if not mck.is_checkpoint_folder(path):
            raise RuntimeError(
                f"{os.path.dirname(path)} holds no critic (saved by a job without --advantage-estimator ppo)"
            )
        saved = dist_checkpointing.load_tensors_metadata(path)
        with_optimizer = any(mck.is_optimizer_key(key) for key in saved)
        state = mck.load_sharded(
            self._sharded_state(with_optimizer=with_optimizer, is_loading=True), path, vocab_size=t.shape.vocab_size
        )
        t._module(self.model).load_state_dict(state["model"], strict=True)
        if with_optimizer:
            t._load_optimizer(state["optimizer"], self.optimizer)
            self.scheduler.load_state_dict(state["opt_param_scheduler"])
        elif not t.cpu:
            self.optimizer.reload_model_params()


__all__ = [
    "CRITIC_DIR",
    "MegatronCritic",
    "ValueHead",
    "check_critic_state",
    "critic_shapes",
    "response_values",
]
