"""megatron-core 0.16.1's MoE and MLA paths without Transformer Engine (TE): the library's bugs there, worked around.

The GPU hosts and this machine have no TE, so the Megatron backend builds megatron-core's local (plain torch) spec.
Its MoE and multi-latent attention (MLA) modules then trip on three bugs (``/work/shared/MOE.md``), its router on a
fourth, MLA at tensor parallelism > 1 on a fifth, and the distributed optimizer's checkpoint on a sixth. Each patch is
one entry of :data:`WORKAROUNDS`, applied by :func:`apply_no_te_workarounds` before any model is built; each
workaround, patch or not, has a test
(``tests/test_megatron_compat.py``; the router's in ``tests/test_megatron_moe_aux_loss.py``) that shows the bug in the
unpatched library, so that a version that fixes it is noticed and the workaround dropped:

- ``transformer/moe/moe_utils.py`` imports ``te_general_gemm`` and the ``fused_*`` helpers inside ``try: import
  transformer_engine``; without TE the names are never bound and the router's ``RouterGatingLinearFunction`` raises
  ``NameError`` on every forward. The workaround binds them to ``None`` (the value the module's own checks expect).
- ``extensions/transformer_engine.py`` stands a ``MagicMock`` in for a missing TE, so ``multi_latent_attention.py``
  imports its ``TELinear`` and sets ``HAVE_TE = True``; ``isinstance(linear_proj, TELinear)`` then raises
  ``TypeError`` in ``MLASelfAttention.__init__``. The workaround sets that module's ``HAVE_TE = False``.
- The local ``DotProductAttention`` takes no ``k_channels``/``v_channels``, which MLA passes (its value head is
  narrower than its query head; Megatron-LM issue #1589, fix PR #6564 open). Not a patch: the backend's own core
  attention (``megatron_attention.SDPADotProductAttention``) takes both and sizes its output ``heads * v_channels``.

- ``transformer/moe/router.py``'s ``TopKRouter._apply_expert_bias`` (the token counts of
  ``--moe-router-bias-update-rate``) masks its ``[tokens, experts]`` routing map with the ``[tokens]`` padding mask
  unaligned, which fails (or, with as many tokens as experts, drops the wrong entries) whenever a padding mask is
  given, as the backend gives one to keep padding out of the balancing loss. Not a TE bug, but on the same path. The
  workaround aligns the mask to the tokens and hands the masked map to megatron-core's own count.

- ``transformer/multi_latent_attention.py``'s ``get_query_key_value_tensors`` at tensor parallelism > 1, where the
  local spec's ``linear_kv_down_proj`` is column-parallel (TE's is a duplicated ``TELinear``, whose output is whole):
  it gathers the latent's column shards, and the gather's backward keeps each rank's own columns of the gradient. The
  key's rotary part (``k_pos_emb``, the last ``qk_pos_emb_head_dim`` columns, shared by every head) gets gradient
  from every rank's heads, but only the share of the heads of the rank that holds those columns survives: the rotary
  rows of ``linear_kv_down_proj`` and everything before them train on part of their gradient (up to 1% off at TP=2,
  with or without sequence parallelism). Not a patch: the backend's MLA layers are
  :func:`whole_latent_mla_attention`, whose forward hook hands megatron-core the latent whole, so that it takes its
  path for a whole latent, where the rotary part's gradient is summed over the tensor-parallel ranks (by
  megatron-core's own gather of ``k_pos_emb`` under sequence parallelism, else by the hook).

- ``optimizer/distrib_optimizer.py``'s ``sharded_param_state_fully_reshardable`` (the distributed optimizer's state
  in a ``torch_dist`` checkpoint, the backend's layout): ``get_parameter_state_dp_zero`` packs each gradient buffer's
  state bucket after bucket without the padding at each bucket's end, but each parameter's state is then sliced at its
  offset in the padded buffer. With one bucket the two agree; with several (``--overlap-grad-reduce`` on a model over
  ``max(40M, 1M x DP)`` parameters or over ``--ddp-bucket-size``; and, without overlap, pipeline parallelism with
  tied embeddings, whose shared embedding gets a bucket of its own) every parameter past the first bucket saves its
  neighbour's main weights and moments, shifted by the padding before it (the tail zero-filled, with only a logged
  warning), and a resume loads them: a silent corruption (Megatron-LM PR #5077 fixes it upstream). Not a TE bug
  either. The workaround lays each packed world tensor out as its buffer (each bucket's state at the bucket's offset)
  before the slicing.

On the CPU the alltoall token dispatcher also needs :func:`cpu_dispatcher_shims` (entered by the backend's CPU shims):
its constructor asks for a CUDA stream for its device-to-host copies, and with expert parallelism it hands
``all_to_all_single`` its split sizes as tensors, which gloo refuses ("incompatible function arguments": it takes
sequences of ints).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

# The names moe_utils binds only when TE imports (megatron-core 0.16.1, transformer/moe/moe_utils.py).
MOE_UTILS_TE_NAMES = (
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_permute",
    "fused_permute_with_probs",
    "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs",
    "fused_topk_with_score_function",
    "fused_unpermute",
    "te_general_gemm",
)
MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
MLA = "megatron.core.transformer.multi_latent_attention"


def _have_te() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def _moe_utils_unbound() -> bool:
    module = importlib.import_module(MOE_UTILS)
    return not _have_te() and any(not hasattr(module, name) for name in MOE_UTILS_TE_NAMES)


def _bind_moe_utils_te_names() -> None:
    module = importlib.import_module(MOE_UTILS)
    for name in MOE_UTILS_TE_NAMES:
        if not hasattr(module, name):
            setattr(module, name, None)


def _mla_believes_te() -> bool:
    return not _have_te() and bool(getattr(importlib.import_module(MLA), "HAVE_TE", False))


def _mla_without_te() -> None:
    importlib.import_module(MLA).HAVE_TE = False


ROUTER = "megatron.core.transformer.moe.router"


def _expert_bias_mask_misaligned() -> bool:
    """Whether ``TopKRouter._apply_expert_bias`` masks its ``[tokens, experts]`` routing map with the ``[tokens]``
    padding mask unaligned (``routing_map & ~padding_mask`` broadcasts the tokens over the experts: an error, or
    the wrong tokens dropped where the two counts are equal), probed on its unwrapped function."""
    import inspect
    from types import SimpleNamespace

    fn = importlib.import_module(ROUTER).TopKRouter._apply_expert_bias
    if getattr(fn, "rlcore_original", None) is not None:
        return False
    probe = SimpleNamespace(enable_expert_bias=True, local_tokens_per_expert=torch.zeros(2))
    try:
        inspect.unwrap(fn)(probe, torch.ones(3, 2, dtype=torch.bool), padding_mask=torch.tensor([False, False, True]))
    except RuntimeError:
        return True
    return probe.local_tokens_per_expert.tolist() != [2.0, 2.0]


def _expert_bias_mask_aligned() -> None:
    router = importlib.import_module(ROUTER).TopKRouter
    original = router._apply_expert_bias

    def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None) -> None:
        # Only the count of routed real tokens per expert is taken: the caller's routing map is not changed.
        if padding_mask is not None:
            routing_map = routing_map & ~padding_mask.reshape(-1, 1)
        original(self, routing_map, padding_mask=None)

    _apply_expert_bias.rlcore_original = original
    router._apply_expert_bias = _apply_expert_bias


def original_expert_bias() -> Callable[..., None]:
    """``TopKRouter._apply_expert_bias`` as megatron-core defines it (under the workaround or not)."""
    fn = importlib.import_module(ROUTER).TopKRouter._apply_expert_bias
    return getattr(fn, "rlcore_original", fn)


DISTRIB_OPTIMIZER = "megatron.core.optimizer.distrib_optimizer"


def _fully_reshardable_save_misaligned() -> bool:
    """Whether ``sharded_param_state_fully_reshardable`` slices the state of a parameter in a second bucket at the
    wrong place of world tensors packed as megatron-core 0.16.1's ``get_parameter_state_dp_zero`` packs them, probed
    on the unwrapped method with a stand-in optimizer (two one-parameter buckets, two elements of padding each)."""
    import logging
    from types import SimpleNamespace

    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    cls = importlib.import_module(DISTRIB_OPTIMIZER).DistributedOptimizer
    fn = cls.sharded_param_state_fully_reshardable
    if getattr(fn, "rlcore_original", None) is not None:
        return False
    params = {"first": torch.arange(3.0), "second": torch.arange(10.0, 14.0)}
    # The buffer [first, 2 of padding, second, 2 of padding]; its state packed as 0.16.1 packs it, padding left out.
    buckets = [
        SimpleNamespace(offset=0, numel_unpadded=3, grad_data=torch.empty(5)),
        SimpleNamespace(offset=5, numel_unpadded=4, grad_data=torch.empty(6)),
    ]
    index = {params["first"]: (0, 3, 0), params["second"]: (5, 9, 1)}
    buffer = SimpleNamespace(param_index_map=index, buckets=buckets, numel=11, numel_unpadded=7)
    world = {"param": torch.cat(list(params.values())), "numel_unpadded": 7}
    probe = SimpleNamespace(
        buffers=[buffer],
        gbuf_ranges=[{torch.float32: [None, None]}],
        get_parameter_state_dp_zero=lambda **kwargs: {0: {torch.float32: world}},
    )
    sharded = {name: ShardedTensor.from_rank_offsets(name, p, replica_id=0) for name, p in params.items()}
    # Its warning of the zero-filled tail is the bug being probed. ``disabled`` (not the level, whose change would
    # leave the logger's cache of enabled levels stale) is checked first and caches nothing.
    log = logging.getLogger(DISTRIB_OPTIMIZER)
    disabled, log.disabled = log.disabled, True
    try:
        saved = fn(probe, sharded, is_loading=False, metadata={})
    finally:
        log.disabled = disabled
    return any(
        not torch.equal(state["param"].data, params[state["param"].key.split(".")[-1]]) for state in saved.values()
    )


def _in_buffer_layout(state: dict[Any, Any], buffers: list[Any]) -> dict[Any, Any]:
    """``get_parameter_state_dp_zero``'s ``state``, each world tensor laid out as its buffer: bucket ``b``'s packed
    state at ``b.offset``, zeros in the padding. A world tensor not of the packed length (a library that keeps the
    padding) is left as it is."""
    for gbuf_idx, buffer in enumerate(buffers):
        for world in state.get(gbuf_idx, {}).values():
            for key, tensor in world.items():
                if not isinstance(tensor, torch.Tensor) or tensor.numel() != buffer.numel_unpadded:
                    continue
                laid_out, at = tensor.new_zeros(buffer.numel), 0
                for bucket in buffer.buckets:
                    laid_out[bucket.offset : bucket.offset + bucket.numel_unpadded] = tensor[
                        at : at + bucket.numel_unpadded
                    ]
                    at += bucket.numel_unpadded
                world[key] = laid_out
    return state


def _fully_reshardable_save_aligned() -> None:
    cls = importlib.import_module(DISTRIB_OPTIMIZER).DistributedOptimizer
    original = cls.sharded_param_state_fully_reshardable

    @functools.wraps(original)
    def sharded_param_state_fully_reshardable(self, model_sharded_state_dict, is_loading=False, metadata=None):
        gather = self.get_parameter_state_dp_zero

        def in_buffer_layout(*args: Any, **kwargs: Any) -> Any:
            state = gather(*args, **kwargs)
            return state if state is None else _in_buffer_layout(state, self.buffers)

        self.get_parameter_state_dp_zero = in_buffer_layout  # for this call only: shadows the method
        try:
            return original(self, model_sharded_state_dict, is_loading, metadata)
        finally:
            del self.get_parameter_state_dp_zero

    sharded_param_state_fully_reshardable.rlcore_original = original
    cls.sharded_param_state_fully_reshardable = sharded_param_state_fully_reshardable


def original_fully_reshardable() -> Callable[..., Any]:
    """``DistributedOptimizer.sharded_param_state_fully_reshardable`` as megatron-core defines it."""
    fn = importlib.import_module(DISTRIB_OPTIMIZER).DistributedOptimizer.sharded_param_state_fully_reshardable
    return getattr(fn, "rlcore_original", fn)


@dataclass(frozen=True)
class Workaround:
    """One library bug: ``present()`` says whether the loaded megatron-core has it, ``apply()`` works around it."""

    name: str
    present: Callable[[], bool]
    apply: Callable[[], None]


WORKAROUNDS: tuple[Workaround, ...] = (
    Workaround("moe_utils binds no TE names without TE", _moe_utils_unbound, _bind_moe_utils_te_names),
    Workaround("multi_latent_attention believes TE is present", _mla_believes_te, _mla_without_te),
    Workaround(
        "the router's expert-bias count broadcasts its padding mask over the experts",
        _expert_bias_mask_misaligned,
        _expert_bias_mask_aligned,
    ),
    Workaround(
        "the distributed optimizer's fully_reshardable save slices later buckets' state at padded offsets",
        _fully_reshardable_save_misaligned,
        _fully_reshardable_save_aligned,
    ),
)


def apply_no_te_workarounds() -> list[str]:
    """Apply every workaround whose bug the loaded megatron-core has; return their names (idempotent: a second call
    returns ``[]``). Call before building a model."""
    applied = []
    for workaround in WORKAROUNDS:
        if workaround.present():
            workaround.apply()
            applied.append(workaround.name)
    return applied


class _SumLastColumnsGrad(torch.autograd.Function):
    """The identity forward; backward, the gradient of the last ``width`` columns summed over ``group``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, width: int, group: Any) -> torch.Tensor:
        ctx.width, ctx.group = width, group
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        import torch.distributed as dist

        grad = grad.clone()
        part = grad[..., -ctx.width :].contiguous()
        dist.all_reduce(part, group=ctx.group)
        grad[..., -ctx.width :] = part
        return grad, None, None


def _whole_kv_latent(module: torch.nn.Module, args: Any, output: tuple[torch.Tensor, Any]) -> tuple[Any, Any]:
    """A forward hook on MLA's column-parallel ``linear_kv_down_proj``: its output gathered whole along the columns
    (and under sequence parallelism cut back to this rank's sequence chunk), so that ``MLASelfAttention`` takes its
    path for a whole latent, where the gradient of the key's rotary part (``k_pos_emb``, shared by every head) is
    summed over the tensor-parallel ranks: under sequence parallelism by its own gather of ``k_pos_emb`` (whose
    backward reduce-scatters), else by :class:`_SumLastColumnsGrad`. On megatron-core 0.16.1's path for a column-cut
    output, the gather's backward keeps each rank's own heads' share of that gradient: the rotary rows of
    ``linear_kv_down_proj`` and everything before them train on part of their gradient (shown at TP=2 over gloo by
    tests/test_megatron_compat.py)."""
    from megatron.core.tensor_parallel.mappings import (
        gather_from_tensor_model_parallel_region,
        scatter_to_sequence_parallel_region,
    )

    out, bias = output
    group = module.tp_group
    if group is None or group.size() == 1:
        return output
    out = gather_from_tensor_model_parallel_region(out, group=group)
    if module.config.sequence_parallel:
        return scatter_to_sequence_parallel_region(out, group=group), bias
    return _SumLastColumnsGrad.apply(out, module.config.qk_pos_emb_head_dim, group), bias


@functools.cache
def whole_latent_mla_attention() -> type:
    """megatron-core's ``MLASelfAttention`` with :func:`_whole_kv_latent` on its ``linear_kv_down_proj`` (one class,
    made once: megatron-core is imported when a model is built)."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    class WholeLatentMLASelfAttention(MLASelfAttention):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.linear_kv_down_proj.register_forward_hook(_whole_kv_latent)

    return WholeLatentMLASelfAttention


class _HostStream:
    """Stands in for the dispatcher's CUDA side stream on the CPU: copies are synchronous, so waits do nothing."""

    def wait_stream(self, stream: object) -> None:
        pass

    def record_event(self) -> _HostStream:
        return self

    def synchronize(self) -> None:
        pass


_HOST_STREAM = _HostStream()


def _int_splits(splits: object) -> list[int] | None:
    if splits is None:
        return None
    values = splits.tolist() if hasattr(splits, "tolist") else list(splits)
    return [int(v) for v in values]


@contextlib.contextmanager
def cpu_dispatcher_shims() -> Iterator[None]:
    """For the duration of the block: the alltoall dispatcher's side stream, ``torch.cuda.current_stream()`` and
    ``torch.cuda.stream(s)`` are a host stream (its device-to-host copies are plain copies on the CPU), and
    ``torch.distributed.all_to_all_single`` takes split sizes as lists of ints whatever it is handed. (The
    ``torch.cuda.Stream`` class itself stays: modules imported meanwhile use it in annotations.)"""
    import torch.distributed as dist
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as Dispatcher

    saved = (Dispatcher.cuda_dtoh_stream, torch.cuda.current_stream, torch.cuda.stream, dist.all_to_all_single)
    all_to_all_single = dist.all_to_all_single

    def all_to_all_host(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
        return all_to_all_single(
            output,
            input,
            output_split_sizes=_int_splits(output_split_sizes),
            input_split_sizes=_int_splits(input_split_sizes),
            **kwargs,
        )

    # The dispatcher's constructor makes its side stream (a class attribute) only when none is set.
    Dispatcher.cuda_dtoh_stream = _HOST_STREAM
    torch.cuda.current_stream = lambda device=None: _HOST_STREAM
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    dist.all_to_all_single = all_to_all_host
    try:
        yield
    finally:
        Dispatcher.cuda_dtoh_stream, torch.cuda.current_stream, torch.cuda.stream, dist.all_to_all_single = saved


class _HostTorch(types.ModuleType):
    """``torch`` as the pipeline schedules see it on the CPU: ``zeros(..., device="cuda")`` (their token count,
    megatron-core 0.16.1 ``pipeline_parallel/schedules.py``) is made on the CPU; everything else is torch's."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)

    @staticmethod
    def zeros(*size: object, device: object = None, **kwargs: object) -> torch.Tensor:
        return torch.zeros(*size, device="cpu" if device == "cuda" else device, **kwargs)


SCHEDULES = "megatron.core.pipeline_parallel.schedules"


@contextlib.contextmanager
def cpu_pipeline_shims() -> Iterator[None]:
    """For the duration of the block, Megatron's pipeline schedules run on the CPU: the token count they allocate on
    ``"cuda"`` by name is made on the CPU (their point-to-point sends allocate on ``torch.cuda.current_device()`` and
    wait with ``torch.cuda.synchronize()``, which the backend's CPU shims answer)."""
    schedules = importlib.import_module(SCHEDULES)
    saved = schedules.torch
    schedules.torch = _HostTorch()
    try:
        yield
    finally:
        schedules.torch = saved


__all__ = [
    "WORKAROUNDS",
    "Workaround",
    "apply_no_te_workarounds",
    "cpu_dispatcher_shims",
    "cpu_pipeline_shims",
    "original_expert_bias",
    "original_fully_reshardable",
    "whole_latent_mla_attention",
]
