"""The ``model`` section of the config: the HF checkpoint the trainers and engines load, and Megatron's model-shape
flags as slime's run scripts pass them, each checked against the checkpoint's ``config.json`` (any backend:
``runtime.config.checks``; the Megatron backend builds its model from them through
``runtime.train.backends.megatron_paths``). Read by the engines (``runtime.engines.hf_engine``) and the training
backends. Torch-free: ``runtime.config`` composes :class:`ModelConfig` into :class:`~runtime.config.Config`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from runtime.option_fields import described, slime


@dataclass(frozen=True)
class ModelConfig:
    hf_checkpoint: str | None = field(
        default=None,
        metadata=described(
            "HF model directory (config, weights, tokenizer); unset: build the tiny default model",
            slime=slime("rollout", None, note="unset: the built-in tiny model"),
        ),
    )
    # Megatron's model-shape flags, as slime's run scripts pass them. The model is built from --hf-checkpoint's
    # config.json; a flag that is given must agree with it (slime's _hf_validate_args), any backend.
    num_layers: int | None = field(default=None, metadata=described("Megatron: decoder layers (config.json's)"))
    hidden_size: int | None = field(default=None, metadata=described("Megatron: hidden size (config.json's)"))
    ffn_hidden_size: int | None = field(default=None, metadata=described("Megatron: MLP width (intermediate_size)"))
    num_attention_heads: int | None = field(default=None, metadata=described("Megatron: query heads"))
    num_query_groups: int | None = field(default=None, metadata=described("Megatron: key/value heads"))
    group_query_attention: bool | None = field(
        default=None, metadata=described("Megatron: fewer key/value heads than query heads")
    )
    kv_channels: int | None = field(default=None, metadata=described("Megatron: head dimension (head_dim)"))
    vocab_size: int | None = field(default=None, metadata=described("Megatron: vocabulary before padding"))
    max_position_embeddings: int | None = field(default=None, metadata=described("Megatron: longest position"))
    rotary_base: float | None = field(default=None, metadata=described("Megatron: rope_theta"))
    rotary_percent: float | None = field(default=None, metadata=described("Megatron: rotated part of a head (1.0)"))
    norm_epsilon: float | None = field(default=None, metadata=described("Megatron: RMSNorm epsilon (rms_norm_eps)"))
    qk_layernorm: bool | None = field(default=None, metadata=described("Megatron: per-head QK RMSNorm (Qwen3)"))
    add_qkv_bias: bool | None = field(default=None, metadata=described("Megatron: bias on q/k/v (Qwen2, GLM-4)"))
    post_self_attn_layernorm: bool | None = field(
        default=None, metadata=described("Megatron: an RMSNorm after self-attention (GLM-4)")
    )
    post_mlp_layernorm: bool | None = field(
        default=None, metadata=described("Megatron: an RMSNorm after the MLP (GLM-4)")
    )
    rotary_interleaved: bool | None = field(
        default=None, metadata=described("Megatron: rotary pairs (2i, 2i+1), not (i, i+d/2) (GLM-4)")
    )
    untie_embeddings_and_output_weights: bool | None = field(
        default=None, metadata=described("Megatron: LM head apart from the embedding (not tie_word_embeddings)")
    )
    normalization: str | None = field(default=None, metadata=described("Megatron: RMSNorm (the families built)"))
    swiglu: bool | None = field(default=None, metadata=described("Megatron: SwiGLU MLP (hidden_act silu)"))
    disable_bias_linear: bool | None = field(default=None, metadata=described("Megatron: no bias on linear layers"))
    position_embedding_type: str | None = field(default=None, metadata=described("Megatron: rope"))
    use_rotary_position_embeddings: bool | None = field(
        default=None, metadata=described("Megatron: rotary position embeddings (--position-embedding-type rope)")
    )
    # Megatron's MoE shape flags (runtime.train.backends.megatron_moe), checked against config.json alike.
    num_experts: int | None = field(default=None, metadata=described("Megatron: experts per MoE layer (num_experts)"))
    moe_router_topk: int | None = field(
        default=None, metadata=described("Megatron: experts per token (num_experts_per_tok)")
    )
    moe_ffn_hidden_size: int | None = field(
        default=None, metadata=described("Megatron: an expert's MLP width (moe_intermediate_size)")
    )
    moe_router_pre_softmax: bool | None = field(
        default=None, metadata=described("Megatron: softmax over all experts, top k unnormalised (not norm_topk_prob)")
    )
    moe_router_score_function: str | None = field(
        default=None, metadata=described("Megatron: the router's score function (softmax for Qwen3-MoE)")
    )
    moe_layer_freq: str | None = field(
        default=None, metadata=described("Megatron: MoE layers, an int N (every N-th) or a list such as [1]*48")
    )
    moe_shared_expert_intermediate_size: int | None = field(
        default=None,
        metadata=described("Megatron: the shared experts' width (n_shared_experts x moe_intermediate_size)"),
    )
    moe_router_enable_expert_bias: bool | None = field(
        default=None, metadata=described("Megatron: a per-expert bias for the choice (e_score_correction_bias)")
    )
    moe_router_topk_scaling_factor: float | None = field(
        default=None, metadata=described("Megatron: gate weights' factor (routed_scaling_factor)")
    )
    moe_router_num_groups: int | None = field(default=None, metadata=described("Megatron: expert groups (n_group)"))
    moe_router_group_topk: int | None = field(
        default=None, metadata=described("Megatron: groups a token's experts come from (topk_group)")
    )
    # Multi-latent attention's shape flags (runtime.train.backends.megatron_mla), checked against config.json alike.
    multi_latent_attention: bool | None = field(
        default=None, metadata=described("Megatron: multi-latent attention (DeepSeek-V3, Moonlight)")
    )
    q_lora_rank: int | None = field(
        default=None, metadata=described("Megatron: MLA's query latent rank (q_lora_rank)")
    )
    kv_lora_rank: int | None = field(default=None, metadata=described("Megatron: MLA's key/value latent rank"))
    qk_head_dim: int | None = field(
        default=None, metadata=described("Megatron: MLA's query/key head without position (qk_nope_head_dim)")
    )
    qk_pos_emb_head_dim: int | None = field(
        default=None, metadata=described("Megatron: MLA's rotary part of a query/key head (qk_rope_head_dim)")
    )
    v_head_dim: int | None = field(default=None, metadata=described("Megatron: MLA's value head (v_head_dim)"))
    # Megatron-LM's rotary flags for MLA (YaRN), checked against config.json's rope_scaling alike.
    rope_type: str | None = field(
        default=None, metadata=described("Megatron: rope or yarn (MLA's default: yarn; rope_scaling's type)")
    )
    rotary_scaling_factor: float | None = field(
        default=None, metadata=described("Megatron: YaRN's context factor (rope_scaling's factor; 1: plain rotary)")
    )
    mscale: float | None = field(default=None, metadata=described("Megatron: YaRN's mscale (rope_scaling's mscale)"))
    mscale_all_dim: float | None = field(
        default=None, metadata=described("Megatron: YaRN's mscale_all_dim (rope_scaling's mscale_all_dim)")
    )


# Megatron's model-shape flags: every field but the checkpoint (runtime.slime_flags.MEGATRON_PARSED lists them).
MODEL_SHAPE_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name != "hf_checkpoint")
