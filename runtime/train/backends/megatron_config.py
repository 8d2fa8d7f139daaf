"""An HF ``config.json`` as the shape of a megatron-core ``GPTModel``; slime's model-shape flags checked against it.

Pure functions over plain dicts: nothing here imports megatron-core, so the config validation (``rlcore-run
--dry-run``) and the weight mapping (:mod:`runtime.train.backends.megatron_weights`) run without it.

Families: Llama, Qwen2 and Qwen3 (dense): RMSNorm, SwiGLU, rotary embeddings, grouped-query attention, tied or untied
embeddings, QKV bias (Qwen2) and per-head QK-norm (Qwen3); GLM-4 (dense: QKV bias, a norm after attention and after
the MLP, interleaved rotary pairs over part of each head); Qwen3-MoE, Qwen3's attention with MoE layers; GLM-4.5
(``glm4_moe``): QKV bias, partial rotary, optional QK-norm, a sigmoid router with expert bias, a shared expert, the
first layers dense (:mod:`runtime.train.backends.megatron_moe`). :data:`FAMILIES` says how each family's layers
differ. Anything else in a ``config.json`` that would build a different model (rope scaling, biases on other layers,
sliding windows, another activation) is refused by name: a model built differently from the checkpoint would train
silently wrong.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from runtime.train.backends.megatron_mla import MLAShape, mla_from_hf
from runtime.train.backends.megatron_mla import config_kwargs as mla_config_kwargs
from runtime.train.backends.megatron_mla import tp_problems as mla_tp_problems
from runtime.train.backends.megatron_moe import MoEShape, layer_pattern, local_experts, moe_from_hf


@dataclass(frozen=True)
class Family:
    """How a ``model_type``'s layers differ from Llama's."""

    # Per-head QK RMSNorm: always (Qwen3), or as the config.json field qk_layernorm_field says (GLM-4.5's
    # use_qk_norm).
    qk_layernorm: bool = False
    qk_layernorm_field: str | None = None
    # A bias on q/k/v: always (Qwen2), or, with qkv_bias_field, as that config.json field says (GLM-4's
    # attention_bias, on q/k/v only: its o_proj has none).
    qkv_bias: bool = False
    qkv_bias_field: str | None = None
    # RMSNorms after self-attention and after the MLP, before each residual add (GLM-4: post_self_attn_layernorm,
    # post_mlp_layernorm; Megatron's TransformerLayer has neither: megatron_layers.PostNormTransformerLayer).
    post_norms: bool = False
    # Rotary pairs (2i, 2i + 1) instead of (i, i + d/2) (Megatron's rotary_interleaved; GLM-4's rotate_half).
    rotary_interleaved: bool = False
    # Whether config.json may rotate part of each head (partial_rotary_factor; Megatron's rotary_percent).
    partial_rotary: bool = False
    # The dense MLP's gate and up projections as one HF tensor, mlp.gate_up_proj.weight [gate; up] (GLM-4).
    hf_gate_up_fused: bool = False
    # Multi-latent attention (DeepSeek-V3; megatron_mla): its own rotary (plain or YaRN) on part of each head.
    mla: bool = False


# model_type -> its layers (the families --train-backend megatron builds).
FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "qwen2": Family(qkv_bias=True),
    "qwen3": Family(qk_layernorm=True),
    "qwen3_moe": Family(qk_layernorm=True),
    # GLM-4.5: GLM-4's attention without its post-norms and with Llama's rotary pairs (over half of each head).
    "glm4_moe": Family(qkv_bias_field="attention_bias", qk_layernorm_field="use_qk_norm", partial_rotary=True),
    "deepseek_v3": Family(mla=True),
    "glm4": Family(
        qkv_bias_field="attention_bias",
        post_norms=True,
        rotary_interleaved=True,
        partial_rotary=True,
        hf_gate_up_fused=True,
    ),
}

# Megatron's --make-vocab-size-divisible-by default.
VOCAB_DIVISIBLE_BY = 128


@dataclass(frozen=True)
class ModelShape:
    """What a ``GPTModel`` needs of the checkpoint's architecture, in Megatron's terms."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    max_position_embeddings: int
    rotary_base: float
    norm_epsilon: float
    qk_layernorm: bool
    add_qkv_bias: bool
    tie_embeddings: bool
    rotary_percent: float = 1.0
    normalization: str = "RMSNorm"
    swiglu: bool = True
    add_bias_linear: bool = False
    position_embedding_type: str = "rope"
    # --padded-vocab-size: rows of the embedding and output layer; None pads as Megatron does (vocab_rows).
    padded_vocab_size: int | None = None
    # --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers: the decoder layers of the first and
    # last pipeline stages (the job's, as padded_vocab_size); None splits as the middle stages (pipeline_stage_sizes).
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    # The experts and router of a mixture-of-experts family; None: dense.
    moe: MoEShape | None = None
    # GLM-4's layer (Family): norms after attention and the MLP, interleaved rotary pairs, HF's fused gate_up_proj.
    post_norms: bool = False
    rotary_interleaved: bool = False
    hf_gate_up_fused: bool = False
    # Multi-latent attention (DeepSeek-V3, Moonlight); None: grouped-query attention.
    mla: MLAShape | None = None
    # The checkpoint's multi-token-prediction layers (DeepSeek-V3's num_nextn_predict_layers), stored after the
    # decoder's as model.layers.{num_layers + i}: neither built nor read, as transformers skips them.
    checkpoint_mtp_layers: int = 0


def _rope_theta(hf: Mapping[str, Any]) -> float | None:
    # transformers 5 keeps it in rope_parameters; older config.json files at the top level.
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping) and "rope_theta" in params:
        return float(params["rope_theta"])
    value = hf.get("rope_theta")
    return None if value is None else float(value)


def _partial_rotary_factor(hf: Mapping[str, Any]) -> float:
    # transformers 5 writes it into rope_parameters too; older config.json files at the top level only.
    params = hf.get("rope_parameters")
    value = hf.get("partial_rotary_factor")
    if value is None and isinstance(params, Mapping):
        value = params.get("partial_rotary_factor")
    return 1.0 if value is None else float(value)


def _rope_type(hf: Mapping[str, Any]) -> str:
    for key in ("rope_parameters", "rope_scaling"):
        params = hf.get(key)
        if isinstance(params, Mapping):
            kind = params.get("rope_type", params.get("type", "default"))
            if kind not in (None, "default"):
                return str(kind)
    return "default"


def shape_from_hf(hf: Mapping[str, Any], *, source: str = "config.json") -> ModelShape:
    """The :class:`ModelShape` of an HF ``config.json`` (as a dict); ``ValueError`` naming ``source`` and each field
    that this backend cannot build as written."""
    if "text_config" in hf:
        raise ValueError(f"{source}: multimodal configs (text_config) are not supported by --train-backend megatron")
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(
            f"{source}: model_type {model_type!r} is not one --train-backend megatron builds ({', '.join(FAMILIES)})"
        )
    family = FAMILIES[model_type]
    problems = []
    required = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
    missing = [key for key in required if hf.get(key) is None]
    if missing:
        raise ValueError(f"{source}: missing {', '.join(missing)}")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf['hidden_act']!r} (only silu, SwiGLU)")
    if _rope_type(hf) != "default" and not family.mla:
        problems.append(f"rope scaling {_rope_type(hf)!r} (only plain rotary embeddings)")
    if hf.get("attention_bias") and not (family.qkv_bias or family.qkv_bias_field == "attention_bias"):
        problems.append("attention_bias true (a bias on q/k/v/o)")
    if hf.get("mlp_bias"):
        problems.append("mlp_bias true")
    if hf.get("use_sliding_window"):
        problems.append("use_sliding_window true")
    elif hf.get("sliding_window") is not None and "use_sliding_window" not in hf:
        # Mistral's layout: a window given without a use_sliding_window switch is in use on every layer.
        problems.append(f"sliding_window {hf['sliding_window']} (attention over a sliding window, Mistral-style)")
    rotary_percent = _partial_rotary_factor(hf)
    if rotary_percent != 1.0 and not family.partial_rotary:
        problems.append(f"partial_rotary_factor {rotary_percent} (this family rotates whole heads)")
    if hf.get("pretraining_tp", 1) not in (1, None):
        problems.append(f"pretraining_tp {hf['pretraining_tp']}")
    theta = _rope_theta(hf)
    if theta is None:
        problems.append("no rope_theta (neither at the top level nor in rope_parameters)")
    if problems:
        raise ValueError(f"{source}: --train-backend megatron cannot build this model: " + "; ".join(problems))
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    groups = int(hf.get("num_key_value_heads") or heads)
    head_dim = hf.get("head_dim")
    head_dim = int(head_dim) if head_dim is not None else hidden // heads
    mla = mla_from_hf(hf, source=source) if family.mla else None
    if mla is not None:
        head_dim = mla.qk_head_dim + mla.qk_pos_emb_head_dim
    if heads % groups:
        raise ValueError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {groups}")
    return ModelShape(
        model_type=model_type,
        num_layers=int(hf["num_hidden_layers"]),
        hidden_size=hidden,
        ffn_hidden_size=int(hf["intermediate_size"]),
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        vocab_size=int(hf["vocab_size"]),
        max_position_embeddings=int(hf.get("max_position_embeddings") or 4096),
        rotary_base=float(theta),
        norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        qk_layernorm=family.qk_layernorm or bool(family.qk_layernorm_field and hf.get(family.qk_layernorm_field)),
        add_qkv_bias=family.qkv_bias or bool(family.qkv_bias_field and hf.get(family.qkv_bias_field, True)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rotary_percent=rotary_percent,
        moe=moe_from_hf(hf, source=source),
        post_norms=family.post_norms,
        rotary_interleaved=family.rotary_interleaved,
        hf_gate_up_fused=family.hf_gate_up_fused,
        mla=mla,
        checkpoint_mtp_layers=int(hf.get("num_nextn_predict_layers") or 0),
    )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return a == b


# slime's model-shape flag (a config field) -> (what it is compared with, read from the shape, HF's name for it).
SHAPE_FLAGS: dict[str, tuple[Callable[[ModelShape], Any], str]] = {
    "num_layers": (lambda s: s.num_layers, "num_hidden_layers"),
    "hidden_size": (lambda s: s.hidden_size, "hidden_size"),
    "ffn_hidden_size": (lambda s: s.ffn_hidden_size, "intermediate_size"),
    "num_attention_heads": (lambda s: s.num_attention_heads, "num_attention_heads"),
    "num_query_groups": (lambda s: s.num_query_groups, "num_key_value_heads"),
    "group_query_attention": (lambda s: s.num_query_groups != s.num_attention_heads, "num_key_value_heads"),
    "kv_channels": (lambda s: s.kv_channels, "head_dim"),
    "vocab_size": (lambda s: s.vocab_size, "vocab_size"),
    "max_position_embeddings": (lambda s: s.max_position_embeddings, "max_position_embeddings"),
    "rotary_base": (lambda s: s.rotary_base, "rope_theta"),
    "rotary_percent": (lambda s: s.rotary_percent, "partial_rotary_factor"),
    "norm_epsilon": (lambda s: s.norm_epsilon, "rms_norm_eps"),
    # Under MLA megatron-core's QK norms are the latent norms (q_a_layernorm, kv_a_layernorm), which it always has.
    "qk_layernorm": (lambda s: s.qk_layernorm or s.mla is not None, "model_type"),
    "add_qkv_bias": (lambda s: s.add_qkv_bias, "model_type / attention_bias"),
    "post_self_attn_layernorm": (lambda s: s.post_norms, "model_type (GLM-4's post_self_attn_layernorm)"),
    "post_mlp_layernorm": (lambda s: s.post_norms, "model_type (GLM-4's post_mlp_layernorm)"),
    "rotary_interleaved": (lambda s: s.rotary_interleaved, "model_type (GLM-4's interleaved rotary pairs)"),
    "untie_embeddings_and_output_weights": (lambda s: not s.tie_embeddings, "tie_word_embeddings"),
    "normalization": (lambda s: s.normalization, "model_type (RMSNorm)"),
    "swiglu": (lambda s: s.swiglu, "hidden_act"),
    "disable_bias_linear": (lambda s: not s.add_bias_linear, "attention_bias / mlp_bias"),
    "position_embedding_type": (lambda s: s.position_embedding_type, "model_type (rope)"),
    "use_rotary_position_embeddings": (lambda s: s.position_embedding_type == "rope", "model_type (rope)"),
    # slime's MoE shape flags (a dense model's value is None: any of them given disagrees).
    "num_experts": (lambda s: s.moe and s.moe.num_experts, "num_experts"),
    "moe_router_topk": (lambda s: s.moe and s.moe.router_topk, "num_experts_per_tok"),
    "moe_ffn_hidden_size": (lambda s: s.moe and s.moe.ffn_hidden_size, "moe_intermediate_size"),
    "moe_router_pre_softmax": (lambda s: s.moe and s.moe.pre_softmax, "norm_topk_prob (negated)"),
    "moe_router_score_function": (lambda s: s.moe and s.moe.score_function, "model_type (the router)"),
    "moe_layer_freq": (
        lambda s: s.moe and list(s.moe.layer_pattern),
        "decoder_sparse_step / mlp_only_layers / first_k_dense_replace",
    ),
    "moe_shared_expert_intermediate_size": (
        lambda s: s.moe and s.moe.shared_ffn_hidden_size,
        "n_shared_experts x moe_intermediate_size",
    ),
    "moe_router_enable_expert_bias": (lambda s: s.moe and s.moe.expert_bias, "model_type (e_score_correction_bias)"),
    "moe_router_topk_scaling_factor": (lambda s: s.moe and s.moe.topk_scaling_factor, "routed_scaling_factor"),
    "moe_router_num_groups": (lambda s: s.moe and s.moe.num_groups, "n_group"),
    "moe_router_group_topk": (lambda s: s.moe and s.moe.group_topk, "topk_group"),
    # Multi-latent attention's (a model without it has None: any of them given disagrees).
    "multi_latent_attention": (lambda s: s.mla is not None, "model_type (deepseek_v3)"),
    "q_lora_rank": (lambda s: s.mla and s.mla.q_lora_rank, "q_lora_rank"),
    "kv_lora_rank": (lambda s: s.mla and s.mla.kv_lora_rank, "kv_lora_rank"),
    "qk_head_dim": (lambda s: s.mla and s.mla.qk_head_dim, "qk_nope_head_dim"),
    "qk_pos_emb_head_dim": (lambda s: s.mla and s.mla.qk_pos_emb_head_dim, "qk_rope_head_dim"),
    "v_head_dim": (lambda s: s.mla and s.mla.v_head_dim, "v_head_dim"),
    # Rotary scaling (MLA's YaRN; a model without MLA has plain rotary, factor 1).
    "rope_type": (lambda s: s.mla.rope_type if s.mla else "rope", "rope_scaling's type"),
    "rotary_scaling_factor": (lambda s: s.mla.rotary_scaling_factor if s.mla else 1.0, "rope_scaling's factor"),
    "mscale": (lambda s: s.mla.mscale if s.mla else 1.0, "rope_scaling's mscale"),
    "mscale_all_dim": (lambda s: s.mla.mscale_all_dim if s.mla else 0.0, "rope_scaling's mscale_all_dim"),
}


def _one_is_no_grouping(given: Any, shape: ModelShape) -> Any:
    return None if given == 1 and shape.moe and shape.moe.num_groups is None else given


def _yarn_only(name: str) -> Callable[[Any, ModelShape], Any]:
    """The reader of MLA's rotary field ``name`` (the rotary type or a YaRN value): for an MLA model with plain rotary,
    YaRN at factor 1 is that rotary and scales nothing, whatever ``name`` says, so any value agrees;
    --rotary-scaling-factor, checked on its own, says whether the factor is 1."""
    return lambda given, s: getattr(s.mla, name) if s.mla is not None and s.mla.rope_type == "rope" else given


# How a flag's value reads before it is compared (the flag as given, the shape): --moe-layer-freq is an expression.
FLAG_READERS: dict[str, Callable[[Any, ModelShape], Any]] = {
    "moe_layer_freq": lambda given, s: list(layer_pattern(given, num_layers=s.num_layers)),
    # Megatron reads --moe-router-pre-softmax for softmax routers only (slime's GLM-4.5 script passes it with sigmoid).
    "moe_router_pre_softmax": lambda given, s: (
        s.moe.pre_softmax if s.moe and s.moe.score_function != "softmax" else given
    ),
    # --moe-router-num-groups 1 is no grouping (the shape says None), and so is --moe-router-group-topk 1 with it.
    "moe_router_num_groups": _one_is_no_grouping,
    "moe_router_group_topk": _one_is_no_grouping,
    # megatron-core's MLA sizes its heads by --qk-head-dim, --qk-pos-emb-head-dim and --v-head-dim and never reads
    # --kv-channels (slime's MLA scripts set it to --qk-head-dim): any value agrees.
    "kv_channels": lambda given, s: s.kv_channels if s.mla is not None else given,
    # MLA takes YaRN unless --rope-type rope; YaRN at factor 1 is plain rotary (the factor is checked on its own).
    "rope_type": _yarn_only("rope_type"),
    "mscale": _yarn_only("mscale"),
    "mscale_all_dim": _yarn_only("mscale_all_dim"),
}


def shape_flag_problems(flags: Mapping[str, Any], shape: ModelShape, *, source: str = "config.json") -> list[str]:
    """One problem per model-shape flag in ``flags`` (field name -> value; None means not given) that disagrees with
    ``shape``, naming the flag, its value, the HF field and the checkpoint's value (slime's ``_hf_validate_args``)."""
    problems = []
    for name, (read, hf_name) in SHAPE_FLAGS.items():
        given = flags.get(name)
        if given is None:
            continue
        expected = read(shape)
        if name in FLAG_READERS:
            try:
                given = FLAG_READERS[name](given, shape)
            except ValueError as err:
                problems.append(str(err))
                continue
        if not _same(given, expected):
            problems.append(
                f"--{name.replace('_', '-')} {given} disagrees with {source}: {hf_name} gives {expected} "
                "(remove the flag or fix it)"
            )
    return problems


def padded_vocab_size(vocab_size: int, *, tp_size: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Megatron's padded vocabulary: ``vocab_size`` rounded up to a multiple of ``divisible_by * tp_size`` (so every
    tensor-parallel rank holds an equal, aligned vocab shard)."""
    if vocab_size < 1 or tp_size < 1 or divisible_by < 1:
        raise ValueError(
            f"vocab_size, tp_size and divisible_by must be >= 1, got {vocab_size}, {tp_size}, {divisible_by}"
        )
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def vocab_rows(shape: ModelShape, *, tp_size: int) -> int:
    """The rows of the embedding and output layer: ``--padded-vocab-size`` when given (``shape.padded_vocab_size``),
    else Megatron's :func:`padded_vocab_size`. ``ValueError`` when the given size is below the vocabulary or does not
    split evenly over ``tp_size`` ranks."""
    if shape.padded_vocab_size is None:
        return padded_vocab_size(shape.vocab_size, tp_size=tp_size)
    rows = shape.padded_vocab_size
    if rows < shape.vocab_size:
        raise ValueError(
            f"--padded-vocab-size {rows} is smaller than the vocabulary ({shape.vocab_size}, config.json's "
            "vocab_size): every token needs a row"
        )
    if rows % tp_size:
        raise ValueError(
            f"--padded-vocab-size {rows} does not split over --tensor-model-parallel-size {tp_size} (each rank holds "
            "an equal vocabulary shard)"
        )
    return rows


# slime's Megatron-to-HF dispatch by --model-name (slime/backends/megatron_utils/megatron_to_hf/__init__.py): the
# name lowercased without "_" and "-", the first fragment it contains wins. Each entry: the mapping rlcore uses for
# it, or None and why rlcore cannot export that family.
_MOE = "a mixture-of-experts family that rlcore's Megatron backend does not build (it builds Qwen3-MoE)"
MODEL_NAME_RULES: tuple[tuple[str, str | None, str], ...] = (
    ("minimaxm2", None, _MOE),
    ("glm4moelite", None, _MOE + " (DeepSeek-V3 layout, MLA)"),
    ("deepseekv3", "deepseek_v3", ""),
    ("deepseekv32", None, _MOE + " (DeepSeek-V3.2: MLA and sparse attention)"),
    ("glmmoedsa", None, _MOE + " (sparse attention)"),
    ("kimi", None, _MOE + " (DeepSeek-V3 layout, MLA)"),
    ("glm4moe", "glm4_moe", ""),
    ("glm4", "glm4", ""),
    ("qwen3next", None, _MOE + " (Qwen3-Next: linear attention too)"),
    ("qwen35", None, "Qwen3.5's gated and linear attention, which rlcore's Megatron backend does not build"),
    ("qwen3vl", None, "a vision-language model; rlcore is text only"),
    ("qwen2moe", None, _MOE),
    ("qwen3moe", "qwen3_moe", ""),
    ("qwen2", "qwen2", ""),
    ("qwen3", "qwen2", ""),
    ("llama", "llama", ""),
    ("mimo", None, "MiMo's multi-token-prediction layers, which rlcore's Megatron backend does not build"),
)
# What each mapping exports beyond Llama's tensors (slime's convert_llama_to_hf maps neither).
MAPPING_EXTRAS: dict[str, tuple[bool, bool]] = {
    "llama": (False, False),
    "qwen2": (True, True),
    "qwen3_moe": (False, True),
    "glm4": (True, False),
    "glm4_moe": (True, True),
    "deepseek_v3": (False, False),
}
# The mappings that name multi-latent attention's tensors (slime's convert_deepseekv3_to_hf).
MLA_MAPPINGS = ("deepseek_v3",)
# The mappings that name GLM-4's post-attention and post-MLP norms (slime's convert_glm4_to_hf).
POST_NORM_MAPPINGS = ("glm4",)
# The mappings that name experts and a router (slime's convert_qwen3moe_to_hf).
MOE_MAPPINGS = ("qwen3_moe", "glm4_moe", "deepseek_v3")


def default_model_name(model_type: str) -> str:
    """slime's default ``--model-name``: the HF config class's name, lowercased (``qwen3`` -> ``qwen3config``)."""
    return model_type.replace("_", "").replace("-", "").lower() + "config"


def mapping_of_name(model_name: str, *, flag: str = "--model-name") -> str:
    """The mapping (``llama``, ``qwen2``, ``glm4``, ``qwen3_moe`` or ``glm4_moe``) slime's name rules pick for
    ``model_name``; ``ValueError`` naming ``flag`` and why for a family rlcore does not build, or a name no rule
    matches."""
    key = model_name.lower().replace("_", "").replace("-", "")
    for fragment, mapping, reason in MODEL_NAME_RULES:
        if fragment in key:
            if mapping is None:
                raise ValueError(f"{flag} {model_name}: {reason}")
            return mapping
    raise ValueError(
        f"{flag} {model_name}: no weight mapping of slime's has this name (rlcore builds llama, qwen2, qwen3, glm4, "
        "qwen3_moe and glm4_moe)"
    )


def weight_mapping(model_name: str, shape: ModelShape, *, flag: str = "--model-name") -> str:
    """The Megatron-to-HF mapping (``llama`` or ``qwen2``) that slime's name rules pick for ``model_name``;
    ``ValueError`` naming ``flag`` for a family rlcore does not build, an unknown name, or a mapping that lacks a
    tensor of ``shape`` (Llama's has no q/k/v bias and no QK-norm)."""
    mapping = mapping_of_name(model_name, flag=flag)
    bias, qk_norm = MAPPING_EXTRAS[mapping]
    lacking = [
        what
        for what, needed, present in (
            ("the q/k/v biases (self_attn.*_proj.bias)", shape.add_qkv_bias, bias),
            ("the QK-norms (self_attn.q_norm / k_norm)", shape.qk_layernorm, qk_norm),
            ("the experts and router (mlp.experts.*, mlp.gate)", shape.moe is not None, mapping in MOE_MAPPINGS),
            (
                "the multi-latent attention (self_attn.kv_a_proj_with_mqa, kv_b_proj, ...)",
                shape.mla is not None,
                mapping in MLA_MAPPINGS,
            ),
            (
                "the post-attention and post-MLP norms (post_self_attn_layernorm, post_mlp_layernorm)",
                shape.post_norms,
                mapping in POST_NORM_MAPPINGS,
            ),
        )
        if needed and not present
    ]
    if mapping in MOE_MAPPINGS and shape.moe is None:
        raise ValueError(
            f"{flag} {model_name}: slime's {mapping} mapping is for MoE models; this {shape.model_type} model is dense"
        )
    if lacking:
        raise ValueError(
            f"{flag} {model_name}: slime's {mapping} mapping has no name for {' and '.join(lacking)} of this "
            f"{shape.model_type} model (use --model-name {shape.model_type})"
        )
    return mapping


def parallel_problems(
    shape: ModelShape,
    *,
    tp_size: int,
    pp_size: int,
    ep_size: int = 1,
    sequence_parallel: bool = False,
    source: str = "config.json",
) -> list[str]:
    """Why ``shape`` cannot be split ``tp_size`` x ``pp_size`` ways with ``ep_size`` expert-parallel ranks (with
    ``--sequence-parallel`` or without), naming the flag and the HF field."""
    problems = []
    if shape.moe is None and ep_size != 1:
        problems.append(
            f"--expert-model-parallel-size {ep_size}: expert parallelism splits MoE experts, and {source} describes "
            f"a dense {shape.model_type} model"
        )
    elif shape.moe is not None:
        try:
            local_experts(shape.moe, ep_size=ep_size)
        except ValueError as err:
            problems.append(f"{err} ({source})")
    if shape.mla is not None:
        problems += mla_tp_problems(shape.mla, heads=shape.num_attention_heads, tp_size=tp_size, source=source)
    if shape.moe is not None and any(shape.moe.layer_pattern) and tp_size > 1 and not sequence_parallel:
        problems.append(
            f"--tensor-model-parallel-size {tp_size} with the MoE layers of {source} needs --sequence-parallel "
            "(megatron-core trains MoE layers over tensor-parallel ranks only with sequence parallelism)"
        )
    if shape.num_query_groups % tp_size:
        problems.append(
            f"--tensor-model-parallel-size {tp_size} must divide num_key_value_heads {shape.num_query_groups} "
            f"of {source} (each rank holds whole query groups)"
        )
    if shape.num_attention_heads % tp_size:
        problems.append(
            f"--tensor-model-parallel-size {tp_size} must divide num_attention_heads {shape.num_attention_heads}"
        )
    if shape.ffn_hidden_size % tp_size:
        problems.append(
            f"--tensor-model-parallel-size {tp_size} must divide intermediate_size {shape.ffn_hidden_size}"
        )
    try:
        sizes = pipeline_stage_sizes(
            shape.num_layers, pp_size=pp_size, first=shape.first_stage_layers, last=shape.last_stage_layers
        )
    except ValueError as err:
        problems.append(f"{err} (num_hidden_layers {shape.num_layers} of {source})")
    else:
        problems += _dense_stage_problems(shape, sizes, source=source)
    return problems


def _dense_stage_problems(shape: ModelShape, sizes: tuple[int, ...], *, source: str) -> list[str]:
    """A pipeline stage of a MoE model with no MoE layer (DeepSeek-V3's and GLM-4.5's first layers are dense):
    megatron-core's optimizer gives its ranks no expert part, while the other stages' expert part takes its gradient
    norm over every stage, so they would wait on those ranks until the collective timed out."""
    if shape.moe is None or len(sizes) < 2:
        return []
    problems, start = [], 0
    for stage, size in enumerate(sizes):
        if not any(shape.moe.layer_pattern[start : start + size]):
            problems.append(
                f"pipeline stage {stage} holds decoder layers {start}-{start + size - 1} of {source}, none of them "
                "MoE: megatron-core's optimizer leaves such a stage out of the experts' gradient norm, which the "
                "other stages wait on; give every stage a MoE layer (--decoder-first-pipeline-num-layers, "
                "--decoder-last-pipeline-num-layers)"
            )
        start += size
    return problems


def pipeline_stage_sizes(
    num_layers: int, *, pp_size: int, first: int | None = None, last: int | None = None
) -> tuple[int, ...]:
    """The decoder layers of each of ``pp_size`` pipeline stages, in order, as Megatron splits them: ``first`` on the
    first stage and ``last`` on the last (``--decoder-first-pipeline-num-layers``,
    ``--decoder-last-pipeline-num-layers``; megatron-core's ``num_layers_in_first_pipeline_stage`` and
    ``num_layers_in_last_pipeline_stage``) when given, the rest split equally over the other (middle) stages.
    ``ValueError`` naming the flags when the layers do not split so."""
    named = {"--decoder-first-pipeline-num-layers": first, "--decoder-last-pipeline-num-layers": last}
    given = {name: count for name, count in named.items() if count is not None}
    for name, count in given.items():
        if count <= 0:
            raise ValueError(f"{name} must be > 0, got {count}")
    middle_stages, middle_layers = pp_size - len(given), num_layers - sum(given.values())
    if middle_stages < 0:
        raise ValueError(
            f"{' and '.join(given)} are two stages' depths: --pipeline-model-parallel-size {pp_size} has one stage"
        )
    if middle_layers < 0 or bool(middle_stages) != bool(middle_layers):
        shown = " and ".join(f"{name} {count}" for name, count in given.items())
        raise ValueError(
            f"{shown} leave {middle_layers} layers for the {middle_stages} other stages of "
            f"--pipeline-model-parallel-size {pp_size}: each stage needs layers, and every layer a stage"
        )
    if middle_stages and middle_layers % middle_stages:
        stages = "its stages" if not given else f"the {middle_stages} stages besides {' and '.join(given)}"
        raise ValueError(
            f"--pipeline-model-parallel-size {pp_size} must split the {middle_layers} decoder layers equally over "
            f"{stages} (or set --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers)"
        )
    each = middle_layers // middle_stages if middle_stages else 0
    return tuple(
        first if stage == 0 and first is not None else last if stage == pp_size - 1 and last is not None else each
        for stage in range(pp_size)
    )


def stage_layers(shape: ModelShape, *, pp_rank: int, pp_size: int) -> range:
    """The global decoder-layer indices of pipeline stage ``pp_rank``, in order (:func:`pipeline_stage_sizes` with
    the shape's first and last stage depths)."""
    sizes = pipeline_stage_sizes(
        shape.num_layers, pp_size=pp_size, first=shape.first_stage_layers, last=shape.last_stage_layers
    )
    start = sum(sizes[:pp_rank])
    return range(start, start + sizes[pp_rank])


def transformer_config_kwargs(shape: ModelShape) -> dict[str, Any]:
    """The architecture fields of megatron-core's ``TransformerConfig`` for ``shape`` (parallelism, precision and
    recompute are the backend's to add). Dropout is off: an RL trainer recomputes old log-probs in the same mode."""
    import torch  # here, not at the top: the config checks read this module without torch

    return {
        "num_layers": shape.num_layers,
        "hidden_size": shape.hidden_size,
        "ffn_hidden_size": shape.ffn_hidden_size,
        "num_attention_heads": shape.num_attention_heads,
        "num_query_groups": shape.num_query_groups,
        "kv_channels": shape.kv_channels,
        "normalization": shape.normalization,
        "layernorm_epsilon": shape.norm_epsilon,
        "gated_linear_unit": shape.swiglu,
        # Megatron's default activation is GELU; SwiGLU is SiLU on the gate.
        "activation_func": torch.nn.functional.silu,
        "add_bias_linear": shape.add_bias_linear,
        "add_qkv_bias": shape.add_qkv_bias,
        "qk_layernorm": shape.qk_layernorm,
        "rotary_interleaved": shape.rotary_interleaved,
        # MLA rotates with its own embedding (megatron_mla), from the config's base.
        **({} if shape.mla is None else {**mla_config_kwargs(shape.mla), "rotary_base": shape.rotary_base}),
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    }


def gpt_model_kwargs(shape: ModelShape, *, tp_size: int) -> dict[str, Any]:
    """The ``GPTModel`` arguments for ``shape`` besides its config and layer spec."""
    return {
        "vocab_size": vocab_rows(shape, tp_size=tp_size),
        "max_sequence_length": shape.max_position_embeddings,
        "position_embedding_type": shape.position_embedding_type,
        "rotary_base": shape.rotary_base,
        "rotary_percent": shape.rotary_percent,
        "share_embeddings_and_output_weights": shape.tie_embeddings,
    }


__all__ = [
    "FAMILIES",
    "FLAG_READERS",
    "Family",
    "MODEL_NAME_RULES",
    "SHAPE_FLAGS",
    "ModelShape",
    "default_model_name",
    "gpt_model_kwargs",
    "mapping_of_name",
    "padded_vocab_size",
    "parallel_problems",
    "pipeline_stage_sizes",
    "shape_flag_problems",
    "shape_from_hf",
    "stage_layers",
    "transformer_config_kwargs",
    "vocab_rows",
    "weight_mapping",
]
