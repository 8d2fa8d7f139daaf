"""How the ``megatron`` backend (:mod:`runtime.train.backends.megatron_backend`) builds its models and optimizers:
megatron-core's ``TransformerConfig`` and ``OptimizerConfig`` from the job's flags, the process groups, the CPU shims,
the HF weights read lazily, ``--custom-model-provider-path``'s call, and :class:`MegatronBuild`, the trainer's methods
that put them together."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import datetime
import inspect
import json
import os
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from runtime.cluster.loopback import confine_collectives, is_loopback, rendezvous_store
from runtime.config import TrainConfig
from runtime.train.backends import megatron_checkpoint as mck
from runtime.train.backends import megatron_config as mc
from runtime.train.backends import megatron_critic as mcritic
from runtime.train.backends import megatron_moe as mmoe
from runtime.train.backends import megatron_weights as mw
from runtime.train.backends.megatron_compat import apply_no_te_workarounds, cpu_dispatcher_shims, cpu_pipeline_shims


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


def sequence_parallel(cfg: Any) -> bool:
    """Whether the model of ``cfg`` (the train section) is built sequence-parallel: as ``--sequence-parallel`` says at
    TP > 1, never at TP 1 (Megatron-LM turns it off there; slime's scripts pass it anyway). Every norm the backend
    builds takes it (:mod:`runtime.train.backends.megatron_layers`)."""
    return bool(cfg.sequence_parallel and cfg.tensor_model_parallel_size > 1)


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


def batch_major_logits(model: torch.nn.Module) -> None:
    """Have ``model``'s output layer (a megatron-core ``ColumnParallelLinear``, without sequence parallelism) compute
    its logits batch-major: its input ``[s, b, H]`` transposed to ``[b, s, H]`` (a copy of the hidden states), its
    output ``[b, s, V]`` handed on as the ``[s, b, V]`` view that ``GPTModel`` transposes back, whose
    ``.contiguous()`` then copies nothing. Left sequence-major, the logits (``b x s x V``: 10 GB a micro-batch at
    Qwen3's vocabulary, 8 x 4096 tokens) are copied whole by that transpose forward, and their gradient again by
    the output layer's weight-gradient ``contiguous()`` backward (on four H200s about 77 ms of a 1.06 s MoE train
    step). Each logit is the same dot product either way. A no-op for any other output layer (a value head, a custom
    provider's) or under sequence parallelism (whose all-gather runs along the sequence, dimension 0)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    layer = getattr(model, "output_layer", None)
    if type(layer) is not ColumnParallelLinear or layer.sequence_parallel:
        return

    def batch_major(self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
        logits, bias = ColumnParallelLinear.forward(
            self, input_.transpose(0, 1).contiguous(), weight=weight, runtime_gather_output=runtime_gather_output
        )
        return logits.transpose(0, 1), bias

    # Bound to the layer (not a closure over its forward): a deep copy of the model binds its own copy.
    layer.forward = types.MethodType(batch_major, layer)


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
        torch.Tensor.cuda,
    )
    torch.cuda.current_device = lambda: "cpu"
    # A pipeline's tied output layer starts as the first stage's embedding, all-reduced after a ``.cuda()``.
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.cuda.synchronize = lambda device=None: None  # dist_checkpointing's writer waits for the device
    mrandom._CUDA_RNG_STATE_TRACKER = _NoDropoutRNG()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: None
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
    try:
        # The MoE alltoall dispatcher's CUDA stream and split sizes, the pipeline schedules' "cuda" (megatron_compat).
        with cpu_dispatcher_shims(), cpu_pipeline_shims():
            yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = saved[0], saved[1]
        mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved[2], saved[3]
        mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state = saved[4], saved[5]
        torch.Tensor.cuda = saved[6]


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


def transformer_config(shape: mc.ModelShape, cfg: TrainConfig, *, bf16: bool, cpu: bool, dp_size: int = 1) -> Any:
    """megatron-core's ``TransformerConfig`` of ``shape`` trained as ``cfg`` (its Megatron flags: parallelism,
    recompute, dropout, deterministic mode) over ``dp_size`` data-parallel ranks in bf16 or float32, with CPU
    initialisation (``MLATransformerConfig`` under multi-latent attention)."""
    from runtime.train.backends.megatron_layers import config_class

    recompute = {}
    if cfg.recompute_granularity is not None:
        recompute["recompute_granularity"] = cfg.recompute_granularity
    if cfg.recompute_method is not None:
        recompute["recompute_method"] = cfg.recompute_method
        recompute["recompute_num_layers"] = cfg.recompute_num_layers
    # A MoE model's experts, router and expert parallelism (megatron_moe); a dense model has none.
    moe = {} if shape.moe is None else mmoe.transformer_config_kwargs(shape.moe, cfg, dp_size=dp_size)
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
        # The layer numbers (routing replay's slots, checkpoint keys) follow the stages' depths (mc.stage_layers).
        num_layers_in_first_pipeline_stage=shape.first_stage_layers,
        num_layers_in_last_pipeline_stage=shape.last_stage_layers,
        sequence_parallel=sequence_parallel(cfg),
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


class MegatronBuild:
    """The setup half of :class:`~runtime.train.backends.megatron_backend.MegatronTrainer`: its process groups,
    models and optimizers (methods of the trainer, reading the attributes its ``__init__`` sets)."""

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
        """``shape`` with the first and last pipeline stages' depths (``--decoder-first-pipeline-num-layers``,
        ``--decoder-last-pipeline-num-layers``: checked with the other parallel problems) and ``--padded-vocab-size``
        (checked against its vocabulary and TP) when given."""
        shape = dataclasses.replace(
            shape,
            first_stage_layers=self.cfg.decoder_first_pipeline_num_layers,
            last_stage_layers=self.cfg.decoder_last_pipeline_num_layers,
        )
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
        return transformer_config(self.shape, self.cfg, bf16=self.bf16, cpu=self.cpu, dp_size=self.dp_size)

    def _build(self, path: str, *, trainable: bool, value_head: bool = False, replay: bool = False) -> torch.nn.Module:
        """A ``GPTModel`` stage with the HF weights of ``path`` (checked tensor by tensor), wrapped for training; with
        ``value_head`` the critic's (:mod:`megatron_critic`): its output layer is a value head, the LM head unused;
        with ``replay`` its routers can replay given routes (the actor's, :mod:`megatron_replay`)."""
        from megatron.core.models.gpt import GPTModel

        from runtime.train.backends.megatron_layers import decoder_spec

        folder = mck.find_checkpoint(path)
        if value_head and folder is not None:
            raise ValueError(mcritic.checkpoint_start_refusal(path))
        shape = self._path_shape(path)
        if shape != self.shape and trainable:
            raise ValueError(f"{path}: its config.json describes another model than {self.model_path}")
        config = self._transformer_config()
        config.moe_enable_routing_replay = replay
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
        elif self.last_stage:
            batch_major_logits(model)
        if shape.moe is not None:
            from runtime.train.backends.megatron_dispatch import use_once_per_rank

            use_once_per_rank(model)  # the backend's MoE dispatcher in every MoE layer
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
        mmoe.mark_expert_grads(model)
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

            # Among them the distributed optimizer's checkpoint layout, also under a custom model provider (whose
            # model need not come from the backend's layer spec, where they are applied first).
            apply_no_te_workarounds()
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
