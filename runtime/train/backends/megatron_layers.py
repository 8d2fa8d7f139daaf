"""The decoder of a family under ``--train-backend megatron``: megatron-core's local layer specs, per layer, with what
a family's layers add (:data:`runtime.train.backends.megatron_config.FAMILIES`).

- Every layer alike (Llama, Qwen2/3, Qwen3-MoE): one layer spec, as megatron-core builds a uniform stack.
- Dense and MoE layers mixed (GLM-4.5's and DeepSeek-V3's first dense layers, ``first_k_dense_replace``): a block
  spec listing this pipeline stage's layers, dense or MoE by ``MoEShape.layer_pattern`` (megatron-core's
  ``get_gpt_decoder_block_spec`` does the same from ``moe_layer_freq``, but builds its own local layers, without the
  backend's core attention and experts).
- GLM-4's norms after attention and after the MLP: :class:`PostNormTransformerLayer`.
- Multi-latent attention (DeepSeek-V3): megatron-core's ``MLASelfAttention`` and ``MLATransformerConfig``
  (:func:`config_class`; :mod:`runtime.train.backends.megatron_mla`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.models.gpt.gpt_layer_specs import LNImpl
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer

from runtime.train.backends.megatron_attention import local_layer_spec
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


class LatentNorm:
    """The local spec's norm (``LNImpl``, built as megatron-core builds it) at transformers' epsilon for MLA's latent
    norms (``q_a_layernorm``, ``kv_a_layernorm``: :data:`megatron_mla.HF_LATENT_NORM_EPS`, whatever
    ``rms_norm_eps`` says), where megatron-core would pass the model's."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = HF_LATENT_NORM_EPS, **kwargs: Any) -> Any:
        return LNImpl(config, hidden_size, eps=HF_LATENT_NORM_EPS, **kwargs)


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
        attention = spec.submodules.self_attention
        norms = dataclasses.replace(attention.submodules, q_layernorm=LatentNorm, kv_layernorm=LatentNorm)
        attention = dataclasses.replace(attention, submodules=norms)
        spec = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))
    return spec


def decoder_spec(
    shape: ModelShape, *, attention_backend: str, grouped_gemm: bool = False, pp_rank: int = 0, pp_size: int = 1
) -> ModuleSpec | TransformerBlockSubmodules:
    """What ``GPTModel``'s ``transformer_layer_spec`` takes for pipeline stage ``pp_rank`` of ``pp_size`` (equal
    stages, :func:`megatron_config.stage_layers`): one layer spec when every layer is alike, else the stage's layers
    in order (each dense or MoE as ``shape.moe.layer_pattern`` says) and the final norm."""
    pattern = shape.moe.layer_pattern if shape.moe is not None else (0,) * shape.num_layers
    specs = {
        kind: layer_spec(shape, moe=bool(kind), attention_backend=attention_backend, grouped_gemm=grouped_gemm)
        for kind in sorted(set(pattern))
    }
    if len(specs) == 1:
        return specs[pattern[0]]
    layers = stage_layers(shape, pp_rank=pp_rank, pp_size=pp_size)
    return TransformerBlockSubmodules(layer_specs=[specs[pattern[i]] for i in layers], layer_norm=LNImpl)


__all__ = ["LatentNorm", "PostNormTransformerLayer", "config_class", "decoder_spec", "layer_spec"]
