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
(tests, gloo) megatron-core needs two shims (:func:`_cpu_shims`: it asks ``torch.cuda`` for the current device and
for dropout RNG states, and there is no dropout here), gradients are averaged over DP by this module (as Megatron's
DDP averages them), the optimizer is ``torch.optim.AdamW`` with Megatron's parameter groups and clipping over the
model-parallel group, and pipeline parallelism is refused (Megatron's schedules allocate on ``"cuda"``).

``--use-dynamic-batch-size`` groups rows into micro-batches of at most ``--max-tokens-per-gpu`` real tokens, as slime
does, each right-padded to its own longest row: packing them into one THD sequence (``packed_seq_params``) needs
Transformer Engine's attention, which the local spec does without.

With ``--advantage-estimator ppo`` each rank also runs the critic (:mod:`megatron_critic`): a second ``GPTModel`` whose
output layer is slime's value head, with its own optimizer and LR schedule.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import datetime
import functools
import inspect
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from rlcore import keys
from rlcore.kernels import logprobs_entropy
from rlcore.losses import LossConfig, Normalizer, aggregate, rl_loss, sft_loss
from runtime.cluster.loopback import confine_collectives, is_loopback, rendezvous_store
from runtime.config import TrainConfig
from runtime.engines.hf_engine import pick_device, restore_rng_state, rng_state
from runtime.train.backends import megatron_checkpoint as mck
from runtime.train.backends import megatron_config as mc
from runtime.train.backends import megatron_critic as mcritic
from runtime.train.backends import megatron_moe as mmoe
from runtime.train.backends import megatron_weights as mw
from runtime.train.backends.megatron_compat import cpu_dispatcher_shims
from runtime.train.backends.torch_backend import micro_batches
from runtime.train.batch import PROMPT_LENGTHS, RESPONSE_LENGTHS, RESPONSE_TOKENS, TOKENS
from runtime.train.hooks import STORE_PREFIX, TrainHooks, freeze_parameters
from runtime.train.metrics import add_step, sums_and_maxima
from runtime.train.packing import in_row_order, min_micro_batches, pack_by_tokens, token_budget
from runtime.train.roles import ACTOR, CRITIC, REFERENCE, TEACHER, ModelRole

SUPPORTED_ROLES = (ACTOR, REFERENCE, TEACHER, CRITIC)


@dataclasses.dataclass(frozen=True)
class ProviderContext:
    """What a ``--custom-model-provider-path`` function gets to build the model this backend would build:
    megatron-core's ``TransformerConfig``, the layer spec, the other ``GPTModel`` arguments (vocabulary rows,
    positions, rotary, tied embeddings), the checkpoint's :class:`~runtime.train.backends.megatron_config.ModelShape`
    and the job's config (slime's ``args``)."""

    config: Any
    layer_spec: Any
    gpt_model_kwargs: dict[str, Any]
    shape: mc.ModelShape
    args: Any


_PROVIDER_CONTEXT: contextvars.ContextVar[ProviderContext] = contextvars.ContextVar("megatron_provider_context")


def provider_context() -> ProviderContext:
    """The :class:`ProviderContext` of the model being built, inside a ``--custom-model-provider-path`` call (slime's
    providers read Megatron's global ``get_args()`` instead, which rlcore does not set up)."""
    try:
        return _PROVIDER_CONTEXT.get()
    except LookupError:
        raise RuntimeError(
            "provider_context() is available only inside a --custom-model-provider-path call of the megatron backend"
        ) from None


def call_model_provider(
    provider: Callable[..., Any], context: ProviderContext, *, pre_process: bool, post_process: bool
) -> torch.nn.Module:
    """``provider(pre_process=, post_process=[, vp_stage=None])`` as slime calls it (``vp_stage`` only when the
    function takes it), with ``context`` readable through :func:`provider_context` during the call."""
    kwargs: dict[str, Any] = {"pre_process": pre_process, "post_process": post_process}
    if "vp_stage" in inspect.signature(provider).parameters:
        kwargs["vp_stage"] = None
    token = _PROVIDER_CONTEXT.set(context)
    try:
        model = provider(**kwargs)
    finally:
        _PROVIDER_CONTEXT.reset(token)
    if not isinstance(model, torch.nn.Module):
        raise ValueError(
            f"--custom-model-provider-path returned {type(model).__name__}, not a megatron-core GPTModel (a "
            "torch.nn.Module)"
        )
    return model


def process_group_backend(distributed_backend: str, *, device: torch.device) -> str:
    """The trainers' ``torch.distributed`` backend: ``--distributed-backend`` (nccl or gloo) on GPUs, gloo on the CPU
    (the only backend of CPU tensors)."""
    if distributed_backend not in ("nccl", "gloo"):
        raise ValueError(f"--distributed-backend must be nccl or gloo (Megatron's), got {distributed_backend!r}")
    return distributed_backend if device.type == "cuda" else "gloo"


def start_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's starting state (zero moments, step 0) for every parameter of ``optimizer`` that has none yet."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            slot = optimizer.state[p]
            if not slot:
                slot["step"] = torch.zeros((), dtype=torch.float32)
                slot["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                slot["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def load_distributed_optimizer(distributed: Any, state: dict[str, Any]) -> None:
    """Load a Megatron ``DistributedOptimizer``'s torch_dist state (:data:`OPTIMIZER_SHARDING`) into ``distributed``.

    megatron-core 0.16.1 with torch's Adam (no Apex or Transformer Engine, as on our GPU hosts) cannot do this in
    ``load_state_dict``: it sets Adam's per-parameter ``step`` from the param groups, then copies every state entry,
    ``step`` included, from the loaded moments, which have none (a ``KeyError``). So the common part (param groups,
    step) goes through ``load_state_dict``, and the moments and main weights are copied with ``step`` set aside. It
    also gives every parameter the same ``step`` tensor, which torch's foreach Adam would then advance once per
    parameter: each gets its own copy."""
    param_state = state.pop("param_state")
    sharding = state.pop("param_state_sharding_type")
    if sharding != OPTIMIZER_SHARDING["distrib_optim_sharding_type"]:
        raise ValueError(f"the checkpoint's distributed optimizer state is {sharding!r}, not {OPTIMIZER_SHARDING}")
    distributed.load_state_dict(state)
    inner = distributed.optimizer
    steps = {p: inner.state[p].pop("step") for group in inner.param_groups for p in group["params"]}
    try:
        distributed.load_parameter_state_from_fully_reshardable(param_state)
    finally:
        for p, step in steps.items():
            inner.state[p]["step"] = step.clone()


# How the distributed optimizer's state is laid out in a torch_dist checkpoint (megatron-core's metadata).
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}


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


class _NoDropoutRNG:
    """Stands in for megatron-core's CUDA RNG tracker on the CPU: it forks an RNG state only around dropout, which
    this backend never applies (dropout is 0), and has no state for activation recompute to save and restore."""

    def fork(self, name: str | None = None) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def get_states(self) -> dict[str, Any]:
        return {}

    def set_states(self, states: dict[str, Any]) -> None:
        pass

    def is_initialized(self) -> bool:
        return True


@contextlib.contextmanager
def _cpu_shims() -> Iterator[None]:
    """megatron-core on the CPU: ``torch.cuda.current_device()`` reads as ``"cpu"`` (megatron-core allocates
    buffers on it), ``torch.cuda.synchronize()`` does nothing (dist_checkpointing's writer calls it) and the dropout
    RNG tracker is :class:`_NoDropoutRNG`, for the duration of the block; activation recompute saves and restores no
    CUDA RNG state."""
    import megatron.core.tensor_parallel.random as mrandom

    saved = (
        torch.cuda.current_device,
        torch.cuda.synchronize,
        mrandom._CUDA_RNG_STATE_TRACKER,
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED,
        mrandom._get_cuda_rng_state,
        mrandom._set_cuda_rng_state,
    )
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None  # dist_checkpointing's writer waits for the device
    mrandom._CUDA_RNG_STATE_TRACKER = _NoDropoutRNG()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: None
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
    try:
        with cpu_dispatcher_shims():  # the MoE alltoall dispatcher's CUDA stream and split sizes (megatron_compat)
            yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = saved[0], saved[1]
        mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved[2], saved[3]
        mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state = saved[4], saved[5]


class LazyHFState(Mapping[str, torch.Tensor]):
    """An HF checkpoint's safetensors weights by name, each read from disk when asked for (one at a time)."""

    def __init__(self, path: str):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as fh:
                self.files = {name: os.path.join(path, f) for name, f in json.load(fh)["weight_map"].items()}
        elif os.path.exists(os.path.join(path, "model.safetensors")):
            from safetensors import safe_open

            single = os.path.join(path, "model.safetensors")
            with safe_open(single, framework="pt") as fh:
                self.files = {name: single for name in fh.keys()}
        else:
            raise ValueError(
                f"{path}: no model.safetensors (or its index): --train-backend megatron reads safetensors"
            )

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.files[name], framework="pt") as fh:
            return fh.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


def _read_hf_config(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "config.json")) as fh:
        return json.load(fh)


def _read_shape(path: str) -> mc.ModelShape:
    return mc.shape_from_hf(_read_hf_config(path), source=os.path.join(path, "config.json"))


def _uses_bf16(setting: str, device: torch.device) -> bool:
    if setting in ("true", "false"):
        return setting == "true"
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def transformer_config(shape: mc.ModelShape, cfg: TrainConfig, *, bf16: bool, cpu: bool) -> Any:
    """megatron-core's ``TransformerConfig`` of ``shape`` trained as ``cfg`` (its Megatron flags: parallelism,
    recompute, dropout, deterministic mode) in bf16 or float32, with CPU initialisation (``MLATransformerConfig``
    under multi-latent attention)."""
    from runtime.train.backends.megatron_layers import config_class

    recompute = {}
    if cfg.recompute_granularity is not None:
        recompute["recompute_granularity"] = cfg.recompute_granularity
    if cfg.recompute_method is not None:
        recompute["recompute_method"] = cfg.recompute_method
        recompute["recompute_num_layers"] = cfg.recompute_num_layers
    # A MoE model's experts, router and expert parallelism (megatron_moe); a dense model has none.
    moe = {} if shape.moe is None else mmoe.transformer_config_kwargs(shape.moe, cfg)
    return config_class(shape)(
        **{
            **mc.transformer_config_kwargs(shape),
            "hidden_dropout": cfg.hidden_dropout,
            "attention_dropout": cfg.attention_dropout,
            "moe_token_dispatcher_type": "alltoall",  # checked even for dense models with variable lengths
            **moe,
        },
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        # Megatron-LM turns sequence parallelism off at TP 1 (slime's scripts pass it there too).
        sequence_parallel=cfg.sequence_parallel and cfg.tensor_model_parallel_size > 1,
        params_dtype=torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        bf16=bf16,
        use_cpu_initialization=cpu,
        # The weights are overwritten from the checkpoint, but megatron-core marks a parameter as tensor-parallel
        # (which the gradient norm and the optimizer read) only while initialising it.
        perform_initialization=True,
        variable_seq_lengths=True,
        # The fused kernels need apex or Transformer Engine, which the local spec does without (slime's
        # --no-*-fusion switches ask for this). SwiGLU's is megatron-core's own torch.compile'd function: on GPUs
        # unless --no-bias-swiglu-fusion (the CPU keeps the eager one: no compiler needed, and the CPU tests compare
        # against the torch backend's eager SwiGLU).
        bias_dropout_fusion=False,
        bias_activation_fusion=cfg.bias_swiglu_fusion and not cpu,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        attention_softmax_in_fp32=True,
        # --attention-backend is not passed on: megatron-core reads TransformerConfig.attention_backend only to set
        # Transformer Engine's NVTE_*_ATTN variables, process-wide (a second model of another backend in the same
        # process then fails its check), and the local spec reads neither; the backend picks its core attention
        # from cfg.attention_backend itself (auto, local or unfused: the values it builds).
        deterministic_mode=cfg.deterministic_mode,
        **recompute,
    )


def optimizer_config(cfg: TrainConfig, *, bf16: bool) -> Any:
    """megatron-core's ``OptimizerConfig`` of ``cfg`` (Adam, its schedule's bounds, clipping, the distributed
    optimizer and --optimizer-cpu-offload, all of the state on the CPU) in bf16 or float32."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer=cfg.optimizer,
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad,
        bf16=bf16,
        params_dtype=torch.float32,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        optimizer_cpu_offload=cfg.optimizer_cpu_offload,
        optimizer_offload_fraction=1.0 if cfg.optimizer_cpu_offload else 0.0,
        overlap_cpu_optimizer_d2h_h2d=cfg.overlap_cpu_optimizer_d2h_h2d,
    )


class MegatronTrainer:
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
        problems = mc.parallel_problems(self.shape, tp_size=self.tp, pp_size=self.pp, ep_size=self.ep)
        if world_size % (self.tp * self.pp):
            problems.append(f"{world_size} ranks are not a multiple of TP {self.tp} x PP {self.pp}")
        elif (world_size // self.pp) % max(self.ep, 1):
            problems.append(
                f"--expert-model-parallel-size {self.ep} must divide the {world_size // self.pp} ranks of a pipeline "
                "stage"
            )
        if self.cpu and self.shape.moe is not None and self.tp > 1:
            problems.append(
                "experts with --tensor-model-parallel-size > 1 are not built on the CPU (its gradient reduction "
                "covers TP 1; on GPUs megatron-core's DDP reduces them)"
            )
        if self.cpu and self.pp > 1:
            problems.append("--pipeline-model-parallel-size > 1 runs on GPUs only (Megatron's schedules)")
        if self.cpu and train_cfg.sequence_parallel and self.tp > 1:
            problems.append("--sequence-parallel runs on GPUs only (its collectives are not gloo's)")
        if self.cpu and train_cfg.optimizer_cpu_offload:
            problems.append("--optimizer-cpu-offload runs on GPUs only (the CPU trains with torch's AdamW already)")
        if train_cfg.context_parallel_size != 1:
            problems.append("--context-parallel-size > 1 needs Transformer Engine (not used by the local spec)")
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
            self.model = self._build(paths.get(ACTOR.name, model_path), trainable=True)
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

    # ------------------------------------------------------------------ setup

    def _path_shape(self, path: str) -> mc.ModelShape:
        """The shape of the model at ``path``: an HF folder's ``config.json``; for a Megatron checkpoint the HF config
        it keeps (rlcore's), else the actor's (``--hf-checkpoint``; a checkpoint of another shape then fails to load,
        naming the tensor)."""
        folder = mck.find_checkpoint(path)
        if folder is None:
            return self._with_padding(_read_shape(path))
        hf = mck.read_common(folder).get("hf_config")
        return self.shape if hf is None else self._with_padding(mc.shape_from_hf(hf, source=f"{folder}/common.pt"))

    def _with_padding(self, shape: mc.ModelShape) -> mc.ModelShape:
        """``shape`` with ``--padded-vocab-size`` (checked against its vocabulary and TP) when given."""
        if self.cfg.padded_vocab_size is None:
            return shape
        shape = dataclasses.replace(shape, padded_vocab_size=self.cfg.padded_vocab_size)
        mc.vocab_rows(shape, tp_size=self.cfg.tensor_model_parallel_size)
        return shape

    def _shims(self) -> contextlib.AbstractContextManager[None]:
        return _cpu_shims() if self.cpu else contextlib.nullcontext()

    def _init_distributed(self, master_addr: str, master_port: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # --distributed-timeout-minutes bounds every collective, of the default group and of Megatron's.
        timeout = datetime.timedelta(minutes=self.cfg.distributed_timeout_minutes)
        if not dist.is_initialized():
            backend = process_group_backend(self.cfg.distributed_backend, device=self.device)
            if is_loopback(master_addr):
                confine_collectives()
                store = rendezvous_store(master_port, rank=self.rank, world_size=self.world_size, timeout=timeout)
                dist.init_process_group(
                    backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout
                )
            else:
                dist.init_process_group(
                    backend,
                    init_method=f"tcp://{master_addr}:{master_port}",
                    rank=self.rank,
                    world_size=self.world_size,
                    timeout=timeout,
                )
            self._own_group = True
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.cfg.expert_tensor_parallel_size,
            create_gloo_process_groups=self.device.type == "cuda",
            distributed_timeout_minutes=self.cfg.distributed_timeout_minutes,
        )
        torch.manual_seed(self.seed)
        if self.device.type == "cuda":
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(self.seed)

    def _transformer_config(self) -> Any:
        return transformer_config(self.shape, self.cfg, bf16=self.bf16, cpu=self.cpu)

    def _build(self, path: str, *, trainable: bool, value_head: bool = False) -> torch.nn.Module:
        """A ``GPTModel`` stage with the HF weights of ``path`` (checked tensor by tensor), wrapped for training; with
        ``value_head`` the critic's (:mod:`megatron_critic`): its output layer is a value head, the LM head unused."""
        from megatron.core.models.gpt import GPTModel

        from runtime.train.backends.megatron_layers import decoder_spec

        folder = mck.find_checkpoint(path)
        if value_head and folder is not None:
            raise ValueError(mcritic.checkpoint_start_refusal(path))
        shape = self._path_shape(path)
        if shape != self.shape and trainable:
            raise ValueError(f"{path}: its config.json describes another model than {self.model_path}")
        config = self._transformer_config()
        spec = decoder_spec(
            shape,
            attention_backend=self.cfg.attention_backend,
            grouped_gemm=self.cfg.moe_grouped_gemm,
            pp_rank=self.pp_rank,
            pp_size=self.pp,
        )
        kwargs = {**mc.gpt_model_kwargs(shape, tp_size=self.tp), **(mcritic.GPT_KWARGS if value_head else {})}
        # slime builds the critic through the custom provider too, then swaps its output layer for the value head.
        provider = self._hook.get("custom_model_provider_path")
        if provider is None:
            model = GPTModel(
                config=config,
                transformer_layer_spec=spec,
                pre_process=self.first_stage,
                post_process=self.last_stage,
                **kwargs,
            )
            what = f"the Megatron {'critic' if value_head else 'model'} of {path}"
        else:
            context = ProviderContext(
                config=config, layer_spec=spec, gpt_model_kwargs=kwargs, shape=shape, args=self.hooks.args
            )
            model = call_model_provider(provider, context, pre_process=self.first_stage, post_process=self.last_stage)
            hook_path = self.hooks.paths["custom_model_provider_path"]
            what = f"--custom-model-provider-path {hook_path}: the {'critic' if value_head else 'model'} for {path}"
        if value_head and self.last_stage:
            model.output_layer = mcritic.ValueHead(config.hidden_size, seed=self.seed, config=config)
        params = mmoe.model_tensors(model)  # the routers' expert biases are buffers
        if value_head:
            mcritic.check_critic_state(
                params, shape, tp_size=self.tp, pp_rank=self.pp_rank, pp_size=self.pp, ep_size=self.ep, what=what
            )
        else:
            mw.check_megatron_state(
                params, shape, tp_size=self.tp, pp_rank=self.pp_rank, pp_size=self.pp, ep_size=self.ep, what=what
            )
        if folder is not None:
            state = mck.load_sharded({"model": model.sharded_state_dict()}, folder, vocab_size=shape.vocab_size)
            model.load_state_dict(state["model"], strict=True)
        else:
            shard = mw.to_megatron(
                LazyHFState(path),
                shape,
                tp_rank=self.tp_rank,
                tp_size=self.tp,
                pp_rank=self.pp_rank,
                pp_size=self.pp,
                ep_rank=self.ps.get_expert_model_parallel_rank(),
                ep_size=self.ep,
            )
            with torch.no_grad():
                for name, param in params.items():
                    if not (value_head and name in mcritic.HEAD_NAMES):
                        param.copy_(shard[name])
        model.to(self.device)
        if self.bf16:
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(config, model)
        if not trainable:
            model.requires_grad_(False)
        elif not self.cpu:
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

            ddp = DistributedDataParallelConfig(
                grad_reduce_in_fp32=self.cfg.accumulate_allreduce_grads_in_fp32,
                use_distributed_optimizer=self.cfg.use_distributed_optimizer,
                overlap_grad_reduce=self.cfg.overlap_grad_reduce,
                bucket_size=self.cfg.ddp_bucket_size,
            )
            model = DistributedDataParallel(config=config, ddp_config=ddp, module=model)
            # Gradients accumulate over the micro-batches and are reduced after the last one's backward (with
            # --overlap-grad-reduce, each bucket while that backward runs): the pipeline schedule holds the reduce
            # back with no_sync, as _run does for PP=1.
            config.no_sync_func = model.no_sync
        model.eval()  # no dropout anyway; eval keeps old and new log-probs computed alike
        return model

    def _build_optimizer(self, model: torch.nn.Module | None = None) -> tuple[Any, Any]:
        """The optimizer and LR schedule of ``model`` (the actor by default) from the job's optimizer flags."""
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        model = model if model is not None else self.model
        c = self.cfg
        if self.cpu:
            decay, no_decay = [], []
            for name, p in model.named_parameters():
                # Megatron's default: no weight decay on biases and 1-D parameters (norms).
                (no_decay if name.endswith(".bias") or p.dim() == 1 else decay).append(p)
            groups = [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}]
            optimizer = torch.optim.AdamW(
                [g for g in groups if g["params"]],
                lr=c.lr,
                betas=(c.adam_beta1, c.adam_beta2),
                eps=c.adam_eps,
                weight_decay=c.weight_decay,
            )
        else:
            from megatron.core.optimizer import get_megatron_optimizer

            optimizer = get_megatron_optimizer(optimizer_config(c, bf16=self.bf16), [model])
        steps = c.lr_decay_iters or 1
        warmup = round(c.lr_warmup_fraction * steps) if c.lr_warmup_fraction is not None else c.lr_warmup_iters
        scheduler = OptimizerParamScheduler(
            optimizer,
            init_lr=0.0 if warmup else c.lr,
            max_lr=c.lr,
            min_lr=c.min_lr,
            lr_warmup_steps=warmup,
            lr_decay_steps=max(steps, warmup + 1) if c.lr_decay_style != "constant" else max(steps, 1),
            lr_decay_style=c.lr_decay_style,
            start_wd=c.weight_decay,
            end_wd=c.weight_decay,
            wd_incr_steps=max(steps, 1),
            wd_incr_style="constant",
            # A resume takes the schedule's values from the checkpoint (slime's --use-checkpoint-opt_param-scheduler).
            use_checkpoint_opt_param_scheduler=True,
        )
        return optimizer, scheduler

    # ------------------------------------------------------------------ forward

    def _logits(self, model: torch.nn.Module, mb: TensorDict) -> torch.Tensor:
        """``[b, width, V / TP]``: this rank's vocab shard of the logits of micro-batch ``mb`` (last stage only), in
        the model's dtype: under bf16 Megatron's ``Float16Module`` would copy them to float32, which
        :func:`rlcore.kernels.logprobs_entropy` does not need (it accumulates in float32)."""
        tokens, positions, mask = self._inputs(mb)
        extra = {"fp32_output": False} if self.bf16 else {}
        if self.shape.moe is not None:
            # The rows' right padding stays out of the routers' balancing loss and expert-bias counts.
            seq_lens = (mb[PROMPT_LENGTHS] + mb[RESPONSE_LENGTHS]).to(self.device)
            extra["padding_mask"] = mmoe.padding_mask(seq_lens, tokens.shape[1])
        return model(input_ids=tokens, position_ids=positions, attention_mask=mask, **extra)

    def _inputs(self, mb: TensorDict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        seq_lens = mb[PROMPT_LENGTHS] + mb[RESPONSE_LENGTHS]
        width = int(seq_lens.max())
        if self.cfg.sequence_parallel and width % self.tp:
            width += self.tp - width % self.tp  # the sequence splits evenly over TP ranks
        tokens = mb[TOKENS][:, :width].to(self.device)
        if tokens.shape[1] < width:
            tokens = torch.nn.functional.pad(tokens, (0, width - tokens.shape[1]))
        positions = torch.arange(width, device=self.device)[None, :].expand(tokens.shape[0], -1)
        from runtime.train.backends.megatron_attention import causal_attention_mask

        mask = causal_attention_mask(width, attention_backend=self.cfg.attention_backend, device=self.device)
        return tokens, positions, mask

    def _response_log_probs(
        self, logits: torch.Tensor, mb: TensorDict, *, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Response-aligned ``(log_probs [b, T], entropy [b, T] or None)`` from this rank's logits shard."""
        response = mb[RESPONSE_TOKENS].to(self.device)
        width = logits.shape[1]
        offsets = torch.arange(response.shape[1], device=self.device)
        positions = (mb[PROMPT_LENGTHS].to(self.device)[:, None] - 1 + offsets).clamp(max=width - 1)
        picked = logits.gather(1, positions[..., None].expand(-1, -1, logits.shape[-1]))
        picked = picked.reshape(-1, logits.shape[-1])
        local = logits.shape[-1]
        start = self.tp_rank * local
        if start + local > self.shape.vocab_size:
            # Megatron's padded vocabulary rows are not tokens: they take no probability.
            padding = torch.arange(start, start + local, device=self.device) >= self.shape.vocab_size
            picked = picked.masked_fill(padding, float("-inf"))
        log_probs, entropy = logprobs_entropy(
            picked,
            response.reshape(-1),
            temperature=self.temperature,
            with_entropy=with_entropy,
            group=self.tp_group,
        )
        shape = response.shape
        return log_probs.view(shape), (entropy.view(shape) if entropy is not None else None)

    def _micro_batches(self, td: TensorDict, *, log_probs: bool = False) -> list[TensorDict]:
        """``td``'s rows in micro-batches, each right-padded to its own longest row by :meth:`_inputs`: grouped by
        real tokens with ``--use-dynamic-batch-size`` (:meth:`_token_groups`: rows regrouped), else consecutive rows
        by ``--micro-batch-size`` or the rows x longest budget (:func:`runtime.train.packing.token_budget`;
        ``log_probs``: a log-prob pass's)."""
        if self.cfg.use_dynamic_batch_size:
            return [td[torch.tensor(rows)] for rows in self._token_groups(td, log_probs=log_probs)]
        return micro_batches(
            td, micro_batch_size=self.cfg.micro_batch_size, max_tokens=token_budget(self.cfg, log_probs=log_probs)
        )

    def _log_prob_parts(self, td: TensorDict) -> tuple[list[TensorDict], list[list[int]] | None]:
        """The micro-batches of a no-gradient pass over ``td``, and their rows for
        :func:`runtime.train.packing.in_row_order` to undo ``--use-dynamic-batch-size``'s regrouping on their
        concatenated outputs (``None``: consecutive rows)."""
        if not self.cfg.use_dynamic_batch_size:
            return self._micro_batches(td, log_probs=True), None
        groups = self._token_groups(td, log_probs=True)
        return [td[torch.tensor(rows)] for rows in groups], groups

    def _token_groups(self, td: TensorDict, *, log_probs: bool) -> list[list[int]]:
        """Row indices of ``td``'s micro-batches under ``--use-dynamic-batch-size``, at most the budget's real tokens
        each (:func:`runtime.train.packing.pack_by_tokens`). As slime, every DP rank runs as many micro-batches: the
        most any rank needs (first fit), over which each rank balances its rows. A rank with fewer rows than that
        count (uneven shards of multi-row rollouts) runs one per row; that is harmless, since gradients are reduced
        once per step, in or after each rank's own last micro-batch (Megatron's DDP, bucket by bucket in the same
        order on every rank under --overlap-grad-reduce, and the CPU path alike), and the
        stages of one pipeline share their rows and so their count."""
        budget = token_budget(self.cfg, log_probs=log_probs)
        if budget is None:
            raise ValueError("--use-dynamic-batch-size groups micro-batches by --max-tokens-per-gpu: set it")
        lengths = (td[PROMPT_LENGTHS] + td[RESPONSE_LENGTHS]).tolist()
        count = self._dp_max(min_micro_batches(lengths, max_tokens=budget))
        while True:
            groups = pack_by_tokens(lengths, max_tokens=budget, at_least=count)
            # Balancing can open a micro-batch that first fit did not need: agree on the count again.
            most = self._dp_max(len(groups))
            if most == count:
                return groups
            count = most

    def _dp_max(self, value: int) -> int:
        group = self.dp_group()
        if group is None:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return int(t)

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
        with self._shims():
            for key, model in models.items():
                self._call_hook("custom_megatron_before_log_prob_hook_path", model, STORE_PREFIX.get(key, ""))
                outputs = self._run(model, parts, forward_only=True)
                out[key] = in_row_order(torch.cat([p["log_probs"] for p in outputs]).float().cpu(), groups)
            if self.critic is not None:
                out[CRITIC.writes] = in_row_order(self.critic.values(td, parts=parts), groups)
        return TensorDict(out, batch_size=td.batch_size)

    def _run(
        self, model: torch.nn.Module, parts: list[TensorDict], *, forward_only: bool, loss_fn: Any = None
    ) -> list[dict[str, torch.Tensor]]:
        """Forward (and backward unless ``forward_only``) over micro-batches ``parts``; each micro-batch's outputs
        (``log_probs`` when ``loss_fn`` is None, else ``loss_fn``'s metrics) on every rank of the pipeline."""
        if self.ep > 1:
            # Each MoE layer's forward and backward exchange tokens over the expert-parallel ranks: every rank must
            # run as many micro-batches, or the alltoall of the one with more waits forever.
            most, least = self._dp_max(len(parts)), -self._dp_max(-len(parts))
            if most != least:
                raise ValueError(
                    f"--expert-model-parallel-size {self.ep}: the data-parallel ranks' shards split into "
                    f"{least} to {most} micro-batches; expert parallelism needs one count (give every rank "
                    "as many rows, or --use-dynamic-batch-size, which agrees on the count)"
                )
        if self.pp == 1:
            if not forward_only and self.shape.moe is not None:
                # The balancing loss's gradient: the micro-batches' mean (Megatron's pipeline schedules set it so).
                mmoe.set_aux_loss_scale(1.0 / len(parts), device=self.device)
            results = []
            no_sync = getattr(model, "no_sync", contextlib.nullcontext)  # Megatron's DDP (GPUs, a trained model)
            for i, mb in enumerate(parts):
                with no_sync() if i < len(parts) - 1 else contextlib.nullcontext():
                    logits = self._logits(model, mb)
                    results.append(self._finish(logits, mb, forward_only=forward_only, loss_fn=loss_fn))
            return results
        return self._run_pipeline(model, parts, forward_only=forward_only, loss_fn=loss_fn)

    def _finish(
        self, logits: torch.Tensor, mb: TensorDict, *, forward_only: bool, loss_fn: Any
    ) -> dict[str, torch.Tensor]:
        if loss_fn is None:
            log_probs, _ = self._response_log_probs(logits, mb, with_entropy=False)
            return {"log_probs": log_probs.detach()}
        loss, metrics = self._loss(loss_fn, logits, mb)
        if not forward_only:
            # Each DP rank's loss is its share of the global batch's (a global Normalizer): gradients must add up
            # over DP ranks, and Megatron's DDP averages them (the CPU path too: _optimizer_step).
            (loss * self.dp_size).backward()
        return metrics

    def _run_pipeline(
        self, model: torch.nn.Module, parts: list[TensorDict], *, forward_only: bool, loss_fn: Any
    ) -> list[dict[str, torch.Tensor]]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        count = len(parts)

        def step(data: Iterator[TensorDict], chunk: torch.nn.Module) -> tuple[torch.Tensor, Any]:
            mb = next(data)
            output = self._logits(chunk, mb)

            def reduce(logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
                if loss_fn is None:
                    log_probs, _ = self._response_log_probs(logits, mb, with_entropy=False)
                    return logits.new_zeros(()), {"log_probs": log_probs.detach()}
                loss, metrics = self._loss(loss_fn, logits, mb)
                # The schedule divides by the micro-batch count; the loss is already this one's global share.
                return loss * count * self.dp_size, metrics

            return output, reduce

        width = max(int((mb[PROMPT_LENGTHS] + mb[RESPONSE_LENGTHS]).max()) for mb in parts)
        results = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter(parts),
            model=[model],
            num_microbatches=count,
            seq_length=width,
            micro_batch_size=max(mb.batch_size[0] for mb in parts),
            forward_only=forward_only,
        )
        return self._from_last_stage(results, parts, loss_fn)

    def _from_last_stage(
        self, results: list[dict[str, torch.Tensor]], parts: list[TensorDict], loss_fn: Any
    ) -> list[dict[str, torch.Tensor]]:
        """The last stage's per-micro-batch outputs, broadcast to every stage of the pipeline."""
        group = self.ps.get_pipeline_model_parallel_group()
        src = self.ps.get_pipeline_model_parallel_last_rank()
        out = []
        for i, mb in enumerate(parts):
            if loss_fn is None:
                value = results[i]["log_probs"] if self.last_stage else None
                buffer = value if value is not None else torch.empty(mb[RESPONSE_TOKENS].shape, device=self.device)
                dist.broadcast(buffer, src=src, group=group)
                out.append({"log_probs": buffer})
            else:
                names = sorted(results[i]) if self.last_stage else None
                holder = [names]
                dist.broadcast_object_list(holder, src=src, group=group)
                names = holder[0]
                values = (
                    torch.stack([results[i][n].float().reshape(()) for n in names])
                    if self.last_stage
                    else torch.empty(len(names), device=self.device)
                )
                dist.broadcast(values, src=src, group=group)
                out.append(dict(zip(names, values, strict=True)))
        return out

    def _loss(self, loss_fn: Any, logits: torch.Tensor, mb: TensorDict) -> tuple[torch.Tensor, Any]:
        """``loss_fn(logits, mb)``; with ``--recompute-loss-function`` under activation checkpointing (slime's), so
        that backward keeps only the logits and recomputes the loss's intermediates (the float32 softmax over the
        vocabulary among them): the same operations on the same inputs, so the same loss and gradients."""
        if not self.cfg.recompute_loss_function or not torch.is_grad_enabled():
            return loss_fn(logits, mb)
        from torch.utils.checkpoint import checkpoint

        return checkpoint(loss_fn, logits, mb, use_reentrant=False)

    def _global_normalizer(self, parts: list[TensorDict]) -> Normalizer:
        norm = sum(Normalizer.of(mb[keys.MASK].to(self.device)) for mb in parts)
        return norm.reduce(self.dp_group())

    def _rl_loss(self, norm: Normalizer) -> Any:
        def loss_fn(logits: torch.Tensor, mb: TensorDict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            log_probs, entropy = self._response_log_probs(logits, mb, with_entropy=True)
            batch = mb.to(self.device, non_blocking=False).clone(recurse=False)
            batch.set(keys.LOG_PROBS, log_probs)
            batch.set(keys.ENTROPY, entropy)
            loss, metrics = rl_loss(batch, self.loss_cfg, norm=norm)
            return loss, {name: value.detach() for name, value in metrics.items()}

        return loss_fn

    def train_critic(self, td: TensorDict, *, per_step_rows: int) -> dict[str, float]:
        """Optimizer steps of the critic over this rank's shard ``td`` (:meth:`MegatronCritic.train`)."""
        self._check_resident()
        if self.critic is None:
            raise RuntimeError("train_critic: this trainer runs no critic (--advantage-estimator ppo)")
        with self._shims():
            return self.critic.train(td, per_step_rows=per_step_rows)

    def advance_old_actor(self) -> None:
        """Not built for this backend: ``--keep-old-actor`` is refused at validation."""
        raise RuntimeError("advance_old_actor: --keep-old-actor is built for the torch backend only")

    def train(self, td: TensorDict, *, per_step_rows: int, rollout_id: int | None = None) -> dict[str, float]:
        """Optimizer steps over this rank's shard ``td``, ``per_step_rows`` rows each; metrics of the global batches
        (token means summed over micro-batches and DP ranks, maxima as maxima), ``grad_norm``, ``lr`` and
        ``num_steps``. Rollouts split into rows of varying counts per step (a custom generate function's fan-out)
        are not built here: ``per_step_rows`` must be one count."""
        self._check_resident()
        if not isinstance(per_step_rows, int):
            raise ValueError(
                "--train-backend megatron: rollouts split into several samples (a custom generate function "
                "returning lists) are built for the torch backend only"
            )
        n = td.batch_size[0]
        if n % per_step_rows:
            raise ValueError(f"shard of {n} rows is not a whole number of steps of {per_step_rows} rows")
        steps = n // per_step_rows
        totals: dict[str, float] = {}
        with self._shims():
            for step in range(steps):
                self._call_hook(
                    "custom_megatron_before_train_step_hook_path",
                    rollout_id,
                    step,
                    self.model,
                    self.optimizer,
                    self.scheduler,
                )
                part = td[step * per_step_rows : (step + 1) * per_step_rows]
                parts = self._micro_batches(part)
                norm = self._global_normalizer(parts)
                if self.hooks.loss_type == "sft_loss":  # slime's --loss-type sft_loss
                    loss_fn = self._sft_loss(norm, mode=self.loss_cfg.loss_agg_mode)
                else:
                    loss_fn = self._rl_loss(norm)
                add_step(totals, self._step(parts, loss_fn), steps=steps)
        totals["num_steps"] = steps
        return totals

    def _step(self, parts: list[TensorDict], loss_fn: Any) -> dict[str, float]:
        """One optimizer step over micro-batches ``parts`` with ``loss_fn``; the step's reduced metrics."""
        self._zero_grad()
        moe_aux = self.shape.moe is not None and self.cfg.moe_aux_loss_coeff > 0
        if moe_aux:
            mmoe.clear_aux_loss()
        sums, maxes = sums_and_maxima(self._train_run(self.model, parts, loss_fn))
        if moe_aux:
            sums["moe_aux_loss"] = self._moe_aux_loss(len(parts))
        out = {**self._all_reduce(sums, dist.ReduceOp.SUM), **self._all_reduce(maxes, dist.ReduceOp.MAX)}
        out["grad_norm"] = self._optimizer_step()
        out["lr"] = float(self.optimizer.param_groups[0]["lr"])
        return out

    def _train_run(
        self, model: torch.nn.Module, parts: list[TensorDict], loss_fn: Any
    ) -> list[dict[str, torch.Tensor]]:
        """:meth:`_run` with the backward, ``model`` (the actor or the critic) in training mode for it: Megatron
        recomputes activations (--recompute-granularity) in training mode only; with no dropout the forward is the
        same in either mode."""
        model.train()
        try:
            return self._run(model, parts, forward_only=False, loss_fn=loss_fn)
        finally:
            model.eval()

    def _moe_aux_loss(self, micro_batches: int) -> float:
        """This rank's share of the step's ``moe_aux_loss`` metric, a sum like the loss's token means: the balancing
        loss the step added (:func:`megatron_moe.recorded_aux_loss`: --moe-aux-loss-coeff x the sum over MoE layers of
        the micro-batches' mean) over the data-parallel size, so that the sum over DP ranks is their mean."""
        groups = [self.ps.get_tensor_and_context_parallel_group(), self.ps.get_pipeline_model_parallel_group()]
        value = mmoe.recorded_aux_loss(self.cfg.moe_aux_loss_coeff, micro_batches=micro_batches, groups=groups)
        return 0.0 if value is None else float(value) / self.dp_size

    def _all_reduce(self, values: dict[str, float], op: dist.ReduceOp) -> dict[str, float]:
        group = self.dp_group()
        if group is None or not values:
            return values
        names = sorted(values)
        t = torch.tensor([values[k] for k in names], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op, group=group)
        return dict(zip(names, t.tolist(), strict=True))

    def _zero_grad(self, model: torch.nn.Module | None = None, optimizer: Any = None) -> None:
        """Zero the gradients of ``model`` and ``optimizer`` (the actor's by default)."""
        model = self.model if model is None else model
        optimizer = self.optimizer if optimizer is None else optimizer
        if self.cpu:
            optimizer.zero_grad(set_to_none=True)
        else:
            model.zero_grad_buffer()
            optimizer.zero_grad()

    def _optimizer_step(
        self, model: torch.nn.Module | None = None, optimizer: Any = None, scheduler: Any = None
    ) -> float:
        """Reduce, clip and apply the gradients of ``model`` with ``optimizer`` and ``scheduler`` (the actor's by
        default); the gradient norm before clipping."""
        model = self.model if model is None else model
        optimizer = self.optimizer if optimizer is None else optimizer
        scheduler = self.scheduler if scheduler is None else scheduler
        if not self.cpu:
            from megatron.core.distributed import finalize_model_grads

            finalize_model_grads([model])
            _, grad_norm, _ = optimizer.step()
            scheduler.step(increment=1)
            return float(grad_norm)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        group = self.dp_group()
        # An expert's gradient holds every rank's tokens routed to it (the dispatcher's backward sends them home):
        # its replicas are the expert-data-parallel group's, fewer than DP by EP (Megatron's DDP sums there and
        # scales by 1 / DP alike).
        expert_group = self.ps.get_expert_data_parallel_group() if self.ep > 1 else group
        for name, p in named:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self.tp > 1 and ("q_layernorm" in name or "k_layernorm" in name):
                # Each TP rank normalises its own heads with the shared QK-norm weight: its gradient is the sum over
                # ranks (Megatron's finalize_model_grads does the same).
                dist.all_reduce(p.grad, group=self.tp_group)
            replicas = expert_group if mmoe.is_expert(name) else group
            if replicas is not None and dist.get_world_size(replicas) > 1:
                dist.all_reduce(p.grad, group=replicas)
            if group is not None:
                # The mean over DP ranks, as Megatron's DDP takes it: each rank's loss was scaled by the DP size.
                p.grad.div_(self.dp_size)
        grad_norm = self._grad_norm(params, experts={id(p) for n, p in named if mmoe.is_expert(n)})
        if self.cfg.clip_grad > 0 and grad_norm > self.cfg.clip_grad:
            for p in params:
                p.grad.mul_(self.cfg.clip_grad / (grad_norm + 1e-6))
        optimizer.step()
        scheduler.step(increment=1)
        if self.shape.moe is not None and self.shape.moe.expert_bias:
            # The routers' expert-bias step towards balanced loads, which finalize_model_grads takes on GPUs.
            mmoe.update_expert_bias(self._module(model))
        return grad_norm

    def _grad_norm(
        self, params: list[torch.nn.Parameter], *, experts: frozenset[int] | set[int] = frozenset()
    ) -> float:
        """The global gradient norm: TP shards counted once each, TP-replicated tensors (norms) once, and the
        experts (``experts``: their ids; whole on each TP rank) of every expert-parallel rank once each."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        square = torch.zeros((), dtype=torch.float64, device=self.device)
        expert_square = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in params:
            if id(p) in experts:
                expert_square += p.grad.double().pow(2).sum()
            elif param_is_not_tensor_parallel_duplicate(p):
                square += p.grad.double().pow(2).sum()
        if self.world_size > 1:
            dist.all_reduce(square, group=self.ps.get_model_parallel_group())
            if experts:
                dist.all_reduce(expert_square, group=self.ps.get_expert_tensor_model_pipeline_parallel_group())
        return float((square + expert_square).sqrt())

    def sft_train(self, td: TensorDict) -> dict[str, float]:
        """One supervised step: the negative log-likelihood of the response tokens."""
        self._check_resident()
        parts = self._micro_batches(td)
        with self._shims():
            metrics = self._step(parts, self._sft_loss(self._global_normalizer(parts), mode="token_mean"))
        return {"sft_loss": metrics["loss"], "grad_norm": metrics["grad_norm"]}

    def _sft_loss(self, norm: Normalizer, *, mode: str) -> Any:
        """The NLL of the loss-masked response tokens, aggregated with ``mode`` over the global batch's ``norm``."""

        def loss_fn(logits: torch.Tensor, mb: TensorDict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            log_probs, _ = self._response_log_probs(logits, mb, with_entropy=False)
            mask = mb[keys.MASK].to(self.device)
            loss = aggregate(sft_loss(log_probs, mask=mask), mask, mode=mode, norm=norm)
            return loss, {"loss": loss.detach()}

        return loss_fn

    # ------------------------------------------------------------------ weights out

    def _module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The ``GPTModel`` inside the DDP and Float16 wrappers."""
        while hasattr(model, "module"):
            model = model.module
        return model

    def _hf_tensors(
        self, model: torch.nn.Module, *, dtype: torch.dtype, on_cpu: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, full tensor in dtype)`` in one global order, gathered over TP, sent from each stage to global
        rank 0; yielded on rank 0 only, on the CPU or (``on_cpu=False``) on rank 0's device. A collective: every rank
        runs it to the end."""
        params = mmoe.model_tensors(self._module(model))
        tp_group = self.ps.get_tensor_model_parallel_group()
        for stage in range(self.pp):
            expected = mw.megatron_shapes(self.shape, tp_size=self.tp, pp_rank=stage, pp_size=self.pp, ep_size=self.ep)
            mine = stage == self.pp_rank
            src = self._global_rank(tp_rank=0, pp_rank=stage)
            for name, local_shape in expected.items():
                expert = mmoe.is_expert(name)
                if mine and expert:
                    # Each expert from its owning rank: the local experts of every EP rank, in EP-rank order (whole
                    # on every TP rank).
                    value = params[name].detach().to(dtype)
                    parts = [value]
                    if self.ep > 1:
                        parts = [torch.empty_like(value) for _ in range(self.ep)]
                        dist.all_gather(parts, value.contiguous(), group=self.ps.get_expert_model_parallel_group())
                elif expert:
                    parts = [torch.empty(local_shape, dtype=dtype, device="meta") for _ in range(self.ep)]
                elif mine:
                    value = params[name].detach().to(dtype)
                    if self.tp > 1:
                        parts = [torch.empty_like(value) for _ in range(self.tp)]
                        dist.all_gather(parts, value.contiguous(), group=tp_group)
                    else:
                        parts = [value]
                else:
                    parts = [torch.empty(local_shape, dtype=dtype, device="meta") for _ in range(self.tp)]
                for hf_name, tensor in mw.tensor_to_hf(name, parts, self.shape, pp_rank=stage, pp_size=self.pp):
                    if src == 0:
                        if self.rank == 0:
                            yield hf_name, tensor.to("cpu" if on_cpu else self.device, copy=True)
                        continue
                    if self.rank == src:
                        dist.send(tensor.contiguous(), dst=0)
                    elif self.rank == 0:
                        buffer = torch.empty(tensor.shape, dtype=dtype, device=self.device)
                        dist.recv(buffer, src=src)
                        yield hf_name, buffer.cpu() if on_cpu else buffer

    def _global_rank(self, *, tp_rank: int, pp_rank: int) -> int:
        """The global rank of (tp_rank, pp_rank) in data-parallel replica 0 (Megatron's order tp-cp-ep-dp-pp)."""
        return pp_rank * (self.world_size // self.pp) + tp_rank

    def weight_buckets(
        self, *, dtype: torch.dtype, bucket_bytes: int, device: str = "cpu"
    ) -> Iterator[dict[str, torch.Tensor]]:
        """HF-named weights in ``dtype``, tied weights once, in buckets of about ``bucket_bytes``: each tensor
        gathered over TP and sent from its stage on its own, so no rank holds more than one full tensor plus the
        bucket. Rank 0 yields, on the CPU or (``device="model"``) on its device; unlike the torch backend the other
        ranks yield nothing there, so ``ipc`` weight sync reaches one colocated engine (the config refuses more)."""
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        if device not in ("cpu", "model"):
            raise ValueError(f"device must be 'cpu' or 'model', got {device!r}")
        self._check_resident()
        bucket: dict[str, torch.Tensor] = {}
        size = 0
        with self._shims():
            for name, tensor in self._hf_tensors(self.model, dtype=dtype, on_cpu=device == "cpu"):
                if bucket and size + tensor.nbytes > bucket_bytes:
                    yield bucket
                    bucket, size = {}, 0
                bucket[name] = tensor
                size += tensor.nbytes
        if bucket:
            yield bucket

    def get_weights(self) -> dict[str, torch.Tensor] | None:
        """The full float32 HF weights on the CPU on rank 0, None elsewhere (a collective)."""
        weights: dict[str, torch.Tensor] = {}
        for bucket in self.weight_buckets(dtype=torch.float32, bucket_bytes=1 << 62):
            weights.update(bucket)
        return weights if self.rank == 0 else None

    def save_hf(self, path: str) -> None:
        """A HF folder (config, safetensors, tokenizer) that ``from_pretrained`` loads, written by rank 0."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        from runtime.engines.checkpoint_layout import load_checkpoint_state_dict

        weights = self.get_weights()
        if self.rank != 0:
            return
        mw.check_hf_state(weights, self.shape, source="the exported weights")
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.model_path), dtype=torch.float32)
        # The weights are in the checkpoint's names (an MoE model's experts one tensor each), the model's fused.
        missing, unexpected = load_checkpoint_state_dict(model, weights)
        if missing or unexpected:
            raise RuntimeError(f"save_hf: missing {missing[:5]}, unexpected {unexpected[:5]}")
        model.save_pretrained(path)
        AutoTokenizer.from_pretrained(self.model_path).save_pretrained(path)

    # ------------------------------------------------------------------ checkpoints

    def _sharded_state(self, *, with_optimizer: bool, is_loading: bool) -> dict[str, Any]:
        """The actor's sharded state dict (megatron-core's ``ShardedTensor`` s, whole-tensor names and shapes): the
        model, and the optimizer's moments under ``optimizer.state.*`` unless ``with_optimizer`` is False; the LR
        schedule, the Megatron-LM ``args`` and the HF config go to ``common.pt``."""
        model_sd = self._module(self.model).sharded_state_dict()
        state: dict[str, Any] = {
            "model": model_sd,
            "checkpoint_version": 3.0,
            "args": mck.model_args(self.shape, tp_size=self.tp, pp_size=self.pp, padded_vocab_size=self.padded_vocab),
            "hf_config": _read_hf_config(self.model_path),
        }
        if with_optimizer:
            state["opt_param_scheduler"] = self.scheduler.state_dict()
            if self.cpu:
                state["optimizer"] = self._cpu_optimizer_state(model_sd)
            else:
                # fully_reshardable: the canonical per-parameter state, so a checkpoint loads at another TP/PP/DP
                # layout (megatron-core 0.16 refuses its old default, fully_sharded_model_space, at save). An actor
                # that has not stepped yet (critic-only steps) gets AdamW's starting state first: megatron-core's
                # state_dict asserts one shared step count, and at load it builds the state it loads into from it.
                self._start_optimizer_state()
                state["optimizer"] = self.optimizer.sharded_state_dict(
                    model_sd, is_loading=is_loading, metadata=OPTIMIZER_SHARDING
                )
        return state

    def _cpu_optimizer_state(self, model_sd: dict[str, Any], optimizer: Any = None) -> dict[str, Any]:
        """The CPU AdamW's state (``optimizer``, the actor's by default) as shards of the parameters' layout
        (Megatron's ``optimizer.state.exp_avg.*`` names), its step count once (``common_step``). Parameters without
        state yet get zero moments at step 0, which is what AdamW starts from."""
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        optimizer = self.optimizer if optimizer is None else optimizer
        params = [p for group in optimizer.param_groups for p in group["params"]]
        start_adam_state(optimizer)
        state = optimizer.state_dict()
        step = max((float(slot["step"]) for slot in state["state"].values()), default=0.0)
        optim_state_to_sharding_state(
            state, get_param_id_to_sharded_param_map(model_sd, params), exclude_keys=("step",)
        )
        state["common_step"] = step
        return state

    def save(self, path: str, *, with_optimizer: bool = True) -> None:
        """A Megatron ``torch_dist`` checkpoint in the folder ``path`` (megatron-core's ``dist_checkpointing``; every
        rank writes its shards, DP replicas once): the model, the optimizer's state and the LR schedule (unless
        ``with_optimizer`` is False), and beside it each rank's RNG state (``rng_rank{r}.pt``). It loads at another
        TP/PP layout, and slime's ``convert_torch_dist_to_hf.py`` reads it."""
        with self._shims():
            mck.save_sharded(self._sharded_state(with_optimizer=with_optimizer, is_loading=False), path)
            if self.critic is not None:
                self.critic.save(os.path.join(path, mcritic.CRITIC_DIR), with_optimizer=with_optimizer)
        torch.save(self.get_rng_state(), os.path.join(path, f"rng_rank{self.rank}.pt"))

    def save_model(self, path: str) -> None:
        """The actor's weights alone as a ``torch_dist`` folder (no optimizer, no RNG): the converter's output."""
        with self._shims():
            mck.save_sharded(self._sharded_state(with_optimizer=False, is_loading=False), path)

    def load(self, path: str) -> None:
        """Restore a ``torch_dist`` checkpoint: :meth:`save`'s folder, a Megatron-LM save root (its
        ``latest_checkpointed_iteration.txt``) or one of slime's. The optimizer and LR schedule come back when the
        checkpoint has them (otherwise they keep their state), the RNG when this rank's file is there."""
        from megatron.core import dist_checkpointing

        folder = mck.find_checkpoint(path)
        if folder is None:
            raise ValueError(f"{path} is no Megatron torch_dist checkpoint (no metadata.json, no {mck.TRACKER})")
        saved = dist_checkpointing.load_tensors_metadata(str(folder))
        with_optimizer = any(key.startswith("optimizer.") for key in saved)
        with self._shims():
            state = mck.load_sharded(
                self._sharded_state(with_optimizer=with_optimizer, is_loading=True),
                folder,
                vocab_size=self.shape.vocab_size,
            )
            self._module(self.model).load_state_dict(state["model"], strict=True)
            if with_optimizer:
                self._load_optimizer(state["optimizer"])
                if "opt_param_scheduler" in state:
                    self.scheduler.load_state_dict(state["opt_param_scheduler"])
            elif not self.cpu:
                self.optimizer.reload_model_params()  # the float32 main weights from the loaded ones
            if self.critic is not None:
                self.critic.load(os.path.join(folder, mcritic.CRITIC_DIR))
        rng_path = os.path.join(folder, f"rng_rank{self.rank}.pt")
        if os.path.exists(rng_path):
            self.set_rng_state(torch.load(rng_path, weights_only=False))

    def _start_optimizer_state(self, optimizer: Any = None) -> None:
        """Give every main-weight shard of an optimizer (the actor's by default) that has not stepped yet AdamW's
        starting state (zero moments, step 0). Megatron's distributed optimizer builds the state dict it loads into
        from its current one, and without Apex or Transformer Engine (torch's Adam) it requires one step count shared
        by all parameters."""
        optimizer = self.optimizer if optimizer is None else optimizer
        for distributed in getattr(optimizer, "chained_optimizers", [optimizer]):
            start_adam_state(distributed.optimizer)

    def _load_optimizer(self, state: dict[str, Any], optimizer: Any = None) -> None:
        """Load ``state`` (:meth:`_sharded_state`'s optimizer part) into ``optimizer``, the actor's by default."""
        optimizer = self.optimizer if optimizer is None else optimizer
        if not self.cpu:
            chained = getattr(optimizer, "chained_optimizers", [optimizer])
            parts = [state] if len(chained) == 1 else [v for _, v in sorted(state.items())]
            for distributed, part in zip(chained, parts, strict=True):
                load_distributed_optimizer(distributed, part)
            return
        step = torch.tensor(float(state.pop("common_step")), dtype=torch.float32)
        for slot in state["state"].values():
            slot["step"] = step.clone()
        optimizer.load_state_dict(state)

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
        if hasattr(self, "ps") and self.ps.model_parallel_is_initialized():
            self.ps.destroy_model_parallel()
        if getattr(self, "_own_group", False) and dist.is_initialized():
            dist.destroy_process_group()
            self._own_group = False


__all__ = ["MegatronTrainer"]
