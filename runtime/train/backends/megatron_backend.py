"""The ``megatron`` training backend: a megatron-core ``GPTModel`` (local layer spec; its core attention PyTorch's
SDPA unless ``--attention-backend local``, :mod:`runtime.train.backends.megatron_attention`) with tensor, pipeline and
data parallelism, built from the HF checkpoint's ``config.json`` and loaded from its weights.

One :class:`MegatronTrainer` runs per rank (a Ray actor). Ranks form one ``torch.distributed`` group and
megatron-core's ``parallel_state`` splits it into tensor-parallel (TP), pipeline (PP) and data-parallel (DP) groups;
the TP and PP ranks of one model replica share one data shard (:meth:`MegatronTrainer.dp_info`).

The math stays in rlcore: log-probs and entropies come from :func:`rlcore.kernels.logprobs_entropy` over the
vocab-parallel logits (the TP group is its ``group``; the padded vocabulary columns are masked out), and the loss from
:func:`rlcore.losses.rl_loss` with a :class:`rlcore.losses.Normalizer` of the whole global batch (summed over
micro-batches and DP ranks), so that micro-batches, stages and DP ranks add up to the global batch's loss and
gradient.

On GPUs the model is wrapped in Megatron's ``DistributedDataParallel`` and trained by Megatron's optimizer (the
distributed optimizer unless ``--no-use-distributed-optimizer``; mixed precision with float32 master weights under
``--bf16``), with its LR schedule (``OptimizerParamScheduler``); pipelines run Megatron's 1F1B schedule. On the CPU
(tests, gloo) megatron-core needs shims (``megatron_build._cpu_shims``: it asks ``torch.cuda`` for the current
device and for dropout RNG states, and there is no dropout here; a pipeline's tied output layer calls ``.cuda()``,
and its schedules allocate on ``"cuda"``: ``megatron_compat.cpu_pipeline_shims``), gradients are averaged over DP by
this module (as Megatron's DDP averages them; a tied embedding's two copies over pipeline stages summed as Megatron's
``finalize_model_grads`` sums them), and the optimizer is ``torch.optim.AdamW`` with Megatron's parameter groups and
clipping over the model-parallel group. Pipeline parallelism over gloo, with Megatron's own 1F1B schedule and
point-to-point sends, is CPU-verified (tests/test_megatron_pipeline.py).

``--use-dynamic-batch-size`` groups rows into micro-batches of at most ``--max-tokens-per-gpu`` real tokens, as slime
does, each right-padded to its own longest row: packing them into one THD sequence (``packed_seq_params``) needs
Transformer Engine's attention, which the local spec does without.

With ``--advantage-estimator ppo`` each rank also runs the critic (:mod:`megatron_critic`): a second ``GPTModel`` whose
output layer is slime's value head, with its own optimizer and LR schedule.

This module is the trainer's construction and the small parts of its protocol; its methods live by responsibility in
``megatron_build`` (configs, process groups, models, optimizers), ``megatron_forward`` (micro-batches and forward
runs, pipelined or not), ``megatron_step`` (losses and optimizer steps), ``megatron_export`` (HF-named weights out)
and ``megatron_state`` (``torch_dist`` checkpoints of the trainer, over ``megatron_checkpoint``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from rlcore import keys
from rlcore.losses import LossConfig
from runtime.config import TrainConfig
from runtime.engines.hf_engine import pick_device, restore_rng_state, rng_state
from runtime.train.backends import megatron_config as mc
from runtime.train.backends import megatron_critic as mcritic
from runtime.train.backends.megatron_build import (
    LazyHFState,
    MegatronBuild,
    ProviderContext,
    _read_shape,
    _uses_bf16,
    call_model_provider,
    optimizer_config,
    process_group_backend,
    provider_context,
    sequence_parallel,
    transformer_config,
)
from runtime.train.backends.megatron_export import MegatronExport
from runtime.train.backends.megatron_forward import MegatronForward
from runtime.train.backends.megatron_replay import MegatronReplay, replay_mode, replay_problems
from runtime.train.backends.megatron_state import (
    OPTIMIZER_SHARDING,
    MegatronState,
    load_distributed_optimizer,
    start_adam_state,
)
from runtime.train.backends.megatron_step import MegatronSteps
from runtime.train.hooks import STORE_PREFIX, TrainHooks, freeze_parameters
from runtime.train.packing import in_row_order
from runtime.train.roles import ACTOR, CRITIC, REFERENCE, TEACHER, ModelRole

SUPPORTED_ROLES = (ACTOR, REFERENCE, TEACHER, CRITIC)


def _torn_down_on_failure(init: Any) -> Any:
    """``MegatronTrainer.__init__`` that, when it raises, first undoes what it set up: Megatron's parallel groups and
    the process group it created. Otherwise the next trainer of this process (or a retry) would find them initialised
    and wait on peers that are gone."""

    @functools.wraps(init)
    def wrapper(self: MegatronTrainer, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except BaseException:
            self.shutdown()
            raise

    return wrapper


class MegatronTrainer(MegatronBuild, MegatronForward, MegatronSteps, MegatronExport, MegatronState, MegatronReplay):
    """One rank of the megatron backend. Every public method is called on all ranks at once."""

    @_torn_down_on_failure
    def __init__(
        self,
        model_path: str,
        *,
        train_cfg: TrainConfig,
        loss_cfg: LossConfig,
        temperature: float,
        seed: int,
        roles: Sequence[ModelRole] = (ACTOR,),
        rank: int = 0,
        world_size: int = 1,
        master_addr: str = "127.0.0.1",
        master_port: int = 0,
        device: str = "auto",
        role_paths: Mapping[str, str] | None = None,
        hooks: TrainHooks | None = None,
    ):
        # slime's trainer-side hooks (runtime.train.hooks); the loss-replacing ones are refused by the config.
        self.hooks = hooks or TrainHooks()
        self._hook = self.hooks.resolve()
        unsupported = [role.name for role in roles if role not in SUPPORTED_ROLES]
        if unsupported or ACTOR not in roles:
            raise ValueError(
                f"the megatron backend runs the roles {[r.name for r in SUPPORTED_ROLES]} (the actor always); "
                f"asked for {[r.name for r in roles]}"
            )
        self.cfg, self.loss_cfg, self.temperature = train_cfg, loss_cfg, temperature
        self.model_path, self.seed = model_path, seed
        self.rank, self.world_size = rank, world_size
        self.device = pick_device(device)
        self.cpu = self.device.type == "cpu"
        self.shape = self._with_padding(_read_shape(model_path))
        # --model-name (slime's name rules) must name a mapping that exports every tensor of this model.
        mc.weight_mapping(train_cfg.model_name or mc.default_model_name(self.shape.model_type), self.shape)
        paths = dict(role_paths or {})
        for role in roles:
            if role != ACTOR and role.name in paths:
                other = self._path_shape(paths[role.name])
                if other.vocab_size != self.shape.vocab_size:
                    raise ValueError(
                        f"the {role.name} model {paths[role.name]!r} has a vocabulary of {other.vocab_size}, the "
                        f"actor {self.shape.vocab_size}: they must share a tokenizer"
                    )
        self.tp, self.pp = train_cfg.tensor_model_parallel_size, train_cfg.pipeline_model_parallel_size
        self.ep = train_cfg.expert_model_parallel_size
        problems = mc.parallel_problems(
            self.shape,
            tp_size=self.tp,
            pp_size=self.pp,
            ep_size=self.ep,
            sequence_parallel=sequence_parallel(train_cfg),
        )
        if world_size % (self.tp * self.pp):
            problems.append(f"{world_size} ranks are not a multiple of TP {self.tp} x PP {self.pp}")
        elif (world_size // self.pp) % max(self.ep, 1):
            problems.append(
                f"--expert-model-parallel-size {self.ep} must divide the {world_size // self.pp} ranks of a pipeline "
                "stage"
            )
        if self.cpu and train_cfg.optimizer_cpu_offload:
            problems.append("--optimizer-cpu-offload runs on GPUs only (the CPU trains with torch's AdamW already)")
        if train_cfg.context_parallel_size != 1:
            problems.append("--context-parallel-size > 1 needs Transformer Engine (not used by the local spec)")
        # slime's --use-rollout-routing-replay / --use-routing-replay: the actor replays routes (megatron_replay).
        mode = replay_mode(self.hooks)
        problems += replay_problems(mode, self.shape.moe)
        if problems:
            raise ValueError("; ".join(problems))
        self.bf16 = _uses_bf16(train_cfg.bf16, self.device)
        self._own_group = False
        self._init_distributed(master_addr, master_port)
        from megatron.core import parallel_state as ps

        self.ps = ps
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.tp_group = ps.get_tensor_model_parallel_group() if self.tp > 1 else None
        self.first_stage, self.last_stage = self.pp_rank == 0, self.pp_rank == self.pp - 1
        self.padded_vocab = mc.vocab_rows(self.shape, tp_size=self.tp)
        with self._shims():
            # The actor starts from a Megatron checkpoint when the job names one (runtime.cluster.checkpoint).
            self.model = self._build(paths.get(ACTOR.name, model_path), trainable=True, replay=mode is not None)
            self._replay_setup(mode)  # the actor's routers only: the other models never replay
            self.frozen = {
                role.writes: self._build(paths.get(role.name, model_path), trainable=False)
                for role in roles
                if role not in (ACTOR, CRITIC)
            }
            if self.hooks.only_train or self.hooks.freeze:
                freeze_parameters(self.model, only_train=self.hooks.only_train, freeze=self.hooks.freeze)
            self.optimizer, self.scheduler = self._build_optimizer()
            # slime's critic (--advantage-estimator ppo): the model with a value head, its own optimizer and schedule.
            self.critic = mcritic.MegatronCritic(self, paths.get(CRITIC.name, model_path)) if CRITIC in roles else None
        self.released = False
        init = self._hook.get("custom_megatron_init_path")
        if init is not None:
            init(self.hooks.args)

    def _call_hook(self, name: str, *args: Any) -> None:
        hook = self._hook.get(name)
        if hook is not None:
            hook(self.hooks.args, *args)

    # ------------------------------------------------------------------ protocol

    def dp_info(self) -> tuple[int, int]:
        """The data-parallel shard: TP and PP ranks of one replica report the same one."""
        return self.dp_rank, self.dp_size

    def dp_group(self) -> dist.ProcessGroup | None:
        return self.ps.get_data_parallel_group() if self.dp_size > 1 else None

    @torch.no_grad()
    def compute_log_probs(self, td: TensorDict) -> TensorDict:
        """``old_log_probs`` and each frozen role's key, [B, T] float32, for this rank's shard ``td``."""
        self._check_resident()
        models = {ACTOR.writes: self.model, **self.frozen}
        out: dict[str, torch.Tensor] = {}
        parts, groups = self._log_prob_parts(td)
        with self._shims(), self._replay_pass("log_probs"):
            for key, model in models.items():
                self._call_hook("custom_megatron_before_log_prob_hook_path", model, STORE_PREFIX.get(key, ""))
                outputs = self._run(model, parts, forward_only=True)
                out[key] = in_row_order(torch.cat([p["log_probs"] for p in outputs]).float().cpu(), groups)
            out.update(self._recorded_routes(td, groups))  # --use-routing-replay: the routes the update replays
            if self.critic is not None:
                out[CRITIC.writes] = in_row_order(self.critic.values(td, parts=parts), groups)
        return TensorDict(out, batch_size=td.batch_size)

    # ------------------------------------------------------------------ the rest of the protocol

    @torch.no_grad()
    def update_reference(self) -> None:
        if keys.REF_LOG_PROBS not in self.frozen:
            raise RuntimeError("update_reference: this trainer runs no reference model (--use-kl-loss / --kl-coef)")
        reference = dict(self._module(self.frozen[keys.REF_LOG_PROBS]).named_parameters())
        for name, param in self._module(self.model).named_parameters():
            reference[name].copy_(param)

    def reset_optimizer(self) -> None:
        """Drop the actor's optimizer moments and step counts, and the critic's (as the torch backend)."""
        for optimizer in (self.optimizer, *([self.critic.optimizer] if self.critic is not None else [])):
            inner = getattr(optimizer, "optimizer", optimizer)
            inner.state.clear()

    def release_memory(self) -> None:
        """Marks the trainer released; its device memory stays. Megatron's DDP and distributed optimizer hold views of
        flat parameter and gradient buffers, which moving the model would silently detach (slime pauses them with
        torch_memory_saver, which rlcore does not have yet)."""
        self.released = True

    def resume_memory(self) -> None:
        self.released = False

    def _check_resident(self) -> None:
        if self.released:
            raise RuntimeError("trainer memory is released: call resume_memory() first")

    def get_rng_state(self) -> dict[str, Any]:
        return rng_state(self.device)

    def set_rng_state(self, state: dict[str, Any]) -> None:
        restore_rng_state(state, self.device)

    def shutdown(self) -> None:
        """Destroy Megatron's parallel groups and the process group this trainer created (safe on a trainer whose
        ``__init__`` failed part way)."""
        self._replay_close()
        if hasattr(self, "ps") and self.ps.model_parallel_is_initialized():
            self.ps.destroy_model_parallel()
        if getattr(self, "_own_group", False) and dist.is_initialized():
            dist.destroy_process_group()
            self._own_group = False


__all__ = [
    "OPTIMIZER_SHARDING",
    "LazyHFState",
    "MegatronTrainer",
    "ProviderContext",
    "call_model_provider",
    "load_distributed_optimizer",
    "optimizer_config",
    "process_group_backend",
    "provider_context",
    "start_adam_state",
    "transformer_config",
]
