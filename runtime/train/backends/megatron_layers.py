"""The decoder of a family under ``--train-backend megatron``: megatron-core's local layer specs, per layer, with what
a family's layers add (:data:`runtime.train.backends.megatron_config.FAMILIES`).

- Every layer alike (Llama, Qwen2/3, Qwen3-MoE): one layer spec, as megatron-core builds a uniform stack.
- Dense and MoE layers mixed (GLM-4.5's and DeepSeek-V3's first dense layers, ``first_k_dense_replace``): a block
  spec listing this pipeline stage's layers, dense or MoE by ``MoEShape.layer_pattern`` (megatron-core's
  ``get_gpt_decoder_block_spec`` does the same from ``moe_layer_freq``, but builds its own local layers, without the
  backend's core attention and experts).
- GLM-4's norms after attention and after the MLP: :class:`PostNormTransformerLayer`.
- Multi-latent attention (DeepSeek-V3): megatron-core's ``MLASelfAttention`` and ``MLATransformerConfig``
  (:func:`config_class`; :mod:`runtime.train.backends.megatron_mla`), the attention with the workaround for its
  key's rotary gradient at TP > 1 (:func:`runtime.train.backends.megatron_compat.whole_latent_mla_attention`).
- Every norm is :class:`SequenceParallelNorm` or :class:`WholeSequenceNorm` (torch's RMSNorm or LayerNorm, as
  megatron-core's ``WrappedTorchNorm`` builds them, which refuses ``--sequence-parallel``): which one follows from
  what the norm sees under sequence parallelism (:data:`NORM_SEES`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer

from runtime.train.backends.megatron_attention import local_layer_spec
from runtime.train.backends.megatron_compat import whole_latent_mla_attention
from runtime.train.backends.megatron_config import ModelShape, stage_layers
from runtime.train.backends.megatron_mla import HF_LATENT_NORM_EPS


def _normed(bda: Callable[..., Any], norm: torch.nn.Module) -> Callable[..., Any]:
    """A bias-dropout-add builder (``bda(training, fused)(output_with_bias, residual, prob)``) that normalises the
    sublayer's output before the residual add."""

    def build(training: bool, fused: bool) -> Callable[..., torch.Tensor]:
        inner = bda(training, fused)

        def apply(output_with_bias: tuple[torch.Tensor, Any], residual: torch.Tensor, prob: float) -> torch.Tensor:
            output, bias = output_with_bias
            return inner((norm(output), bias), residual, prob)

        return apply

    return build


class PostNormTransformerLayer(TransformerLayer):
    """megatron-core's ``TransformerLayer`` with GLM-4's two extra RMSNorms, ``post_self_attn_layernorm`` on the
    attention's output and ``post_mlp_layernorm`` on the MLP's, each before its residual add (slime's names for them,
    so its torch_dist checkpoints load):

        h = x + post_self_attn_layernorm(attention(input_layernorm(x)))
        y = h + post_mlp_layernorm(mlp(pre_mlp_layernorm(h)))

    The norms are the layer spec's own (its ``input_layernorm`` module, the config's epsilon). They wrap the
    bias-dropout-adds, so the sublayers' outputs must carry no bias (``add_bias_linear`` false, as in GLM-4): the norm
    of ``output + bias`` is not ``norm(output) + bias``."""

    def __init__(self, config: Any, submodules: Any, *args: Any, **kwargs: Any):
        if config.add_bias_linear:
            raise ValueError("post-attention/post-MLP norms need add_bias_linear false (GLM-4 has no linear biases)")
        super().__init__(config, submodules, *args, **kwargs)
        norm = dict(config=self.config, hidden_size=self.config.hidden_size, eps=self.config.layernorm_epsilon)
        self.post_self_attn_layernorm = build_module(submodules.input_layernorm, **norm)
        self.post_mlp_layernorm = build_module(submodules.input_layernorm, **norm)
        self.self_attn_bda = _normed(self.self_attn_bda, self.post_self_attn_layernorm)
        self.mlp_bda = _normed(self.mlp_bda, self.post_mlp_layernorm)


# torch's norm of each megatron-core ``normalization`` the backend builds (megatron-core's WrappedTorchNorm's choice).
TORCH_NORMS: dict[str, type[torch.nn.Module]] = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}

# What a norm that WrappedTorchNorm builds takes but this backend's do not (WrappedTorchNorm refuses them too).
_REFUSED = {
    "layernorm_zero_centered_gamma": "zero-centred gamma",
    "persist_layer_norm": "the persistent (apex) layer norm",
    "memory_efficient_layer_norm": "the memory-efficient (apex) layer norm",
}


def torch_norm(config: Any, hidden_size: int, *, eps: float, sequence_chunk: bool) -> torch.nn.Module:
    """torch's ``config.normalization`` norm over ``hidden_size`` features at ``eps``: the arithmetic of
    megatron-core's ``WrappedTorchNorm``. With ``sequence_chunk`` (the norm sees this tensor-parallel rank's chunk of
    the sequence under ``config.sequence_parallel``) its weight and bias carry megatron-core's ``sequence_parallel``
    attribute, which ``finalize_model_grads`` (``_allreduce_non_tensor_model_parallel_grads``) and the backend's CPU
    gradient path (:func:`runtime.train.backends.megatron_step.sums_over_tensor_parallel`) read to add the ranks'
    gradients: each rank's is its own tokens' only."""
    if config.normalization not in TORCH_NORMS:
        raise ValueError(f"normalization {config.normalization!r}: the backend builds {sorted(TORCH_NORMS)}")
    refused = [what for field, what in _REFUSED.items() if getattr(config, field, False)]
    if refused:
        raise ValueError(f"the torch norms take no {', '.join(refused)} (those need Transformer Engine or Apex)")
    norm = TORCH_NORMS[config.normalization](hidden_size, eps=eps)
    if sequence_chunk and config.sequence_parallel:
        for param in norm.parameters():
            param.sequence_parallel = True
    return norm


class SequenceParallelNorm:
    """A norm of the hidden states between the sublayers (:func:`torch_norm` with ``sequence_chunk``): under sequence
    parallelism it sees this rank's chunk of the sequence, so its gradient is summed over the tensor-parallel ranks.
    Built as megatron-core builds a layer spec's norm: ``(config, hidden_size, eps, ...)``."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> Any:
        return torch_norm(config, hidden_size, eps=eps, sequence_chunk=True)


class WholeSequenceNorm:
    """A norm that sees the whole sequence under sequence parallelism (:func:`torch_norm` without ``sequence_chunk``):
    the per-head QK-norms, which run after the QKV projection has gathered the sequence. Its gradient is not marked;
    on each rank it is the rank's own heads' share, which megatron-core's gradient finalisation sums by name
    (``q_layernorm``/``k_layernorm`` under ``qk_layernorm``) with or without sequence parallelism."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> Any:
        return torch_norm(config, hidden_size, eps=eps, sequence_chunk=False)


class LatentNorm:
    """MLA's latent norms (``q_a_layernorm``, ``kv_a_layernorm``), :class:`SequenceParallelNorm` at transformers'
    epsilon (:data:`megatron_mla.HF_LATENT_NORM_EPS`, whatever ``rms_norm_eps`` says) where megatron-core would pass
    the model's. megatron-core's ``MLASelfAttention`` gathers the down projections' column shards and, under sequence
    parallelism, scatters the sequence again before these norms (the up projections gather it after): they see this
    rank's chunk of the sequence."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = HF_LATENT_NORM_EPS, **kwargs: Any) -> Any:
        return torch_norm(config, hidden_size, eps=HF_LATENT_NORM_EPS, sequence_chunk=True)


# Every norm of a decoder layer's spec (its path of submodules) -> the module built there, from what it sees under
# sequence parallelism (megatron-core 0.16.1's local spec: the layer's input is this rank's chunk of the sequence;
# column-parallel linears gather it, row-parallel ones reduce-scatter it back):
# - input_layernorm, pre_mlp_layernorm: the layer's input and the attention's residual sum, a chunk;
# - GLM-4's post_self_attn_layernorm and post_mlp_layernorm (PostNormTransformerLayer builds them from the
#   input_layernorm's spec): the row-parallel output projection's and the MLP's (or the MoE layer's) outputs, a chunk;
# - q_layernorm, k_layernorm: per head after linear_qkv, which gathers the sequence, so whole;
# - MLA's q_layernorm and kv_layernorm: LatentNorm (a chunk, as its docstring says).
# The final norm (decoder_spec's layer_norm) normalises the last layer's output, a chunk. A spec entry that is
# IdentityOp (no QK-norm) stays one.
NORM_SEES: dict[tuple[str, ...], type] = {
    ("input_layernorm",): SequenceParallelNorm,
    ("pre_mlp_layernorm",): SequenceParallelNorm,
    ("self_attention", "q_layernorm"): WholeSequenceNorm,
    ("self_attention", "k_layernorm"): WholeSequenceNorm,
}
MLA_NORMS: dict[tuple[str, ...], type] = {
    ("self_attention", "q_layernorm"): LatentNorm,
    ("self_attention", "kv_layernorm"): LatentNorm,
}


def _with_module(spec: Any, path: tuple[str, ...], module: type) -> Any:
    """``spec`` (a ``ModuleSpec``) with the submodule at ``path`` replaced by ``module``, unless it is absent or
    ``IdentityOp``."""
    head, *rest = path
    inner = getattr(spec.submodules, head, None)
    if inner is None or inner is IdentityOp:
        return spec
    inner = _with_module(inner, tuple(rest), module) if rest else module
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **{head: inner}))


def config_class(shape: ModelShape) -> type:
    """megatron-core's ``TransformerConfig`` for ``shape``, ``MLATransformerConfig`` under multi-latent attention."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    return TransformerConfig if shape.mla is None else MLATransformerConfig


def layer_spec(shape: ModelShape, *, moe: bool, attention_backend: str, grouped_gemm: bool = False) -> ModuleSpec:
    """One decoder layer of ``shape``: MoE (its experts and router) or dense, with the family's extras."""
    spec = local_layer_spec(
        attention_backend=attention_backend,
        # MLA's latent norms (q_a_layernorm, kv_a_layernorm) are the spec's QK-norms.
        qk_layernorm=shape.qk_layernorm or shape.mla is not None,
        normalization=shape.normalization,
        num_experts=shape.moe.num_experts if moe else None,
        grouped_gemm=grouped_gemm,
        multi_latent_attention=shape.mla is not None,
    )
    if shape.post_norms:
        spec = dataclasses.replace(spec, module=PostNormTransformerLayer)
    if shape.mla is not None:
        attention = dataclasses.replace(spec.submodules.self_attention, module=whole_latent_mla_attention())
        spec = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))
    norms = {**NORM_SEES, **(MLA_NORMS if shape.mla is not None else {})}
    for path, module in norms.items():
        spec = _with_module(spec, path, module)
    return spec


def decoder_spec(
    shape: ModelShape, *, attention_backend: str, grouped_gemm: bool = False, pp_rank: int = 0, pp_size: int = 1
) -> TransformerBlockSubmodules:
    """What ``GPTModel``'s ``transformer_layer_spec`` takes for pipeline stage ``pp_rank`` of ``pp_size`` (equal or
    uneven stages, :func:`megatron_config.stage_layers`): the stage's layers in order (each dense or MoE as
    ``shape.moe.layer_pattern`` says) and the final norm, :class:`SequenceParallelNorm` (given a single layer spec,
    megatron-core would build its own final norm, which refuses sequence parallelism)."""
    pattern = shape.moe.layer_pattern if shape.moe is not None else (0,) * shape.num_layers
    specs = {
        kind: layer_spec(shape, moe=bool(kind), attention_backend=attention_backend, grouped_gemm=grouped_gemm)
        for kind in sorted(set(pattern))
    }
    layers = stage_layers(shape, pp_rank=pp_rank, pp_size=pp_size)
    return TransformerBlockSubmodules(layer_specs=[specs[pattern[i]] for i in layers], layer_norm=SequenceParallelNorm)


__all__ = [
    "LatentNorm",
    "MLA_NORMS",
    "NORM_SEES",
    "PostNormTransformerLayer",
    "SequenceParallelNorm",
    "TORCH_NORMS",
    "WholeSequenceNorm",
    "config_class",
    "decoder_spec",
    "layer_spec",
    "torch_norm",
]
