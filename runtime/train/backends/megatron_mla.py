"""Multi-latent attention (MLA: DeepSeek-V3, Moonlight) under ``--train-backend megatron``: the HF config's attention
as megatron-core's ``MLASelfAttention`` (``MLATransformerConfig``), its weights both ways, and what is refused.

Pure functions over plain dicts and tensors: ``rlcore-run --dry-run`` reads this module without megatron-core.

MLA projects each token's keys and values through a low-rank latent (``kv_lora_rank``) and, with a query LoRA
(``q_lora_rank``; Moonlight has none), its queries too. Each query/key head is a part without position
(``qk_nope_head_dim``) and a rotary part (``qk_rope_head_dim``) whose key is shared by all heads; the value head
(``v_head_dim``) may differ. megatron-core rotates the rotary part as transformers' ``rope_interleave`` true does (its
interleaved pairs gathered first), with plain rotary or YaRN (``rope_type``, its factor, original length, betas and
both mscales, which also scale the softmax).

Weights, and how a tensor-parallel rank holds each (megatron-core's local spec: the down projections are
column-parallel over the latent, gathered before the latent norms; the up projections column-parallel over the heads;
the output projection row-parallel; the latent norms whole on every rank):

==========================================  =====================================
Megatron (``decoder.layers.i.``)            HF (``model.layers.L.``)
==========================================  =====================================
``self_attention.linear_q_proj``            ``self_attn.q_proj`` (no query LoRA), TP rows
``self_attention.linear_q_down_proj``       ``self_attn.q_a_proj``, TP rows
``self_attention.q_layernorm``              ``self_attn.q_a_layernorm``, whole
``self_attention.linear_q_up_proj``         ``self_attn.q_b_proj``, TP rows
``self_attention.linear_kv_down_proj``      ``self_attn.kv_a_proj_with_mqa``, TP rows
``self_attention.kv_layernorm``             ``self_attn.kv_a_layernorm``, whole
``self_attention.linear_kv_up_proj``        ``self_attn.kv_b_proj``, TP rows
``self_attention.linear_proj``              ``self_attn.o_proj``, TP columns
==========================================  =====================================
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# transformers builds the latent norms (q_a_layernorm, kv_a_layernorm) with this epsilon whatever rms_norm_eps says
# (Moonlight's is 1e-5); megatron-core would build them with the model's (megatron_layers.LatentNorm keeps this one).
HF_LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLAShape:
    """The multi-latent attention of a model, in megatron-core's terms (``MLATransformerConfig``'s fields)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int
    rope_type: str = "rope"
    rotary_scaling_factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


def _rope(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(hf.get(key), Mapping):
            return hf[key]
    return {}


def mla_from_hf(hf: Mapping[str, Any], *, source: str = "config.json") -> MLAShape:
    """The :class:`MLAShape` of a ``deepseek_v3`` config (a dict); ``ValueError`` naming ``source`` and each field
    megatron-core would compute differently."""
    required = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    missing = [key for key in required if hf.get(key) is None]
    if missing:
        raise ValueError(f"{source}: missing {', '.join(missing)} (multi-latent attention)")
    rope = _rope(hf)
    kind = rope.get("rope_type", rope.get("type", "default"))
    problems = []
    if kind not in ("default", "yarn"):
        problems.append(f"rope_type {kind!r} (multi-latent attention builds plain rotary or yarn)")
    if not hf.get("rope_interleave", True):
        problems.append("rope_interleave false (megatron-core's MLA rotates interleaved pairs, transformers' default)")
    if hf.get("attention_bias"):
        problems.append("attention_bias true (a bias on the MLA projections)")
    if problems:
        raise ValueError(f"{source}: --train-backend megatron cannot build this model: " + "; ".join(problems))
    q_lora = hf.get("q_lora_rank")
    yarn = kind == "yarn"
    return MLAShape(
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(hf["kv_lora_rank"]),
        qk_head_dim=int(hf["qk_nope_head_dim"]),
        qk_pos_emb_head_dim=int(hf["qk_rope_head_dim"]),
        v_head_dim=int(hf["v_head_dim"]),
        rope_type="yarn" if yarn else "rope",
        rotary_scaling_factor=float(rope.get("factor", 1.0)) if yarn else 1.0,
        original_max_position_embeddings=int(
            rope.get("original_max_position_embeddings") or hf.get("max_position_embeddings") or 4096
        ),
        beta_fast=float(rope.get("beta_fast", 32.0)),
        beta_slow=float(rope.get("beta_slow", 1.0)),
        mscale=float(rope.get("mscale", 1.0)) if yarn else 1.0,
        mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)) if yarn else 0.0,
    )


def config_kwargs(mla: MLAShape) -> dict[str, Any]:
    """The MLA fields of megatron-core's ``MLATransformerConfig``."""
    return {
        "multi_latent_attention": True,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_head_dim": mla.qk_head_dim,
        "qk_pos_emb_head_dim": mla.qk_pos_emb_head_dim,
        "v_head_dim": mla.v_head_dim,
        "rope_type": mla.rope_type,
        "rotary_scaling_factor": mla.rotary_scaling_factor,
        "original_max_position_embeddings": mla.original_max_position_embeddings,
        "beta_fast": mla.beta_fast,
        "beta_slow": mla.beta_slow,
        "mscale": mla.mscale,
        "mscale_all_dim": mla.mscale_all_dim,
    }


# Megatron's tensor (under decoder.layers.i.self_attention.) -> HF's (under model.layers.L.self_attn.), by whether the
# model has a query LoRA.
_SHARED = {
    "linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
    "kv_layernorm.weight": "kv_a_layernorm.weight",
    "linear_kv_up_proj.weight": "kv_b_proj.weight",
    "linear_proj.weight": "o_proj.weight",
}
NAMES: dict[bool, dict[str, str]] = {
    True: {
        "linear_q_down_proj.weight": "q_a_proj.weight",
        "q_layernorm.weight": "q_a_layernorm.weight",
        "linear_q_up_proj.weight": "q_b_proj.weight",
        **_SHARED,
    },
    False: {"linear_q_proj.weight": "q_proj.weight", **_SHARED},
}


# The dimension a tensor-parallel rank cuts each Megatron MLA tensor along (None: whole on every rank).
SPLIT_DIM: dict[str, int | None] = {
    "linear_q_proj.weight": 0,
    "linear_q_down_proj.weight": 0,
    "q_layernorm.weight": None,
    "linear_q_up_proj.weight": 0,
    "linear_kv_down_proj.weight": 0,
    "kv_layernorm.weight": None,
    "linear_kv_up_proj.weight": 0,
    "linear_proj.weight": 1,
}


def tp_problems(mla: MLAShape, *, heads: int, tp_size: int, source: str = "config.json") -> list[str]:
    """What keeps ``tp_size`` tensor-parallel ranks from each holding an equal cut of every MLA tensor."""
    cuts = {
        "num_attention_heads": heads,
        "kv_lora_rank + qk_rope_head_dim": mla.kv_lora_rank + mla.qk_pos_emb_head_dim,
    }
    if mla.q_lora_rank is not None:
        cuts["q_lora_rank"] = mla.q_lora_rank
    return [
        f"--tensor-model-parallel-size {tp_size} must divide {what} {size} of {source} (multi-latent attention "
        "cuts it over the ranks)"
        for what, size in cuts.items()
        if size % tp_size
    ]


def names(mla: MLAShape) -> dict[str, str]:
    """Megatron attention tensor name (after ``self_attention.``) -> HF name (after ``self_attn.``)."""
    return NAMES[mla.q_lora_rank is not None]


def hf_attention_shapes(
    mla: MLAShape, *, hidden_size: int, heads: int, prefix: str
) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF name -> (shape, the config fields that size it) of one layer's attention; ``prefix``: ``model.layers.L.``."""
    h, q_head = hidden_size, mla.qk_head_dim + mla.qk_pos_emb_head_dim
    p = prefix + "self_attn."
    out = {
        p + "kv_a_proj_with_mqa.weight": ((mla.kv_lora_rank + mla.qk_pos_emb_head_dim, h), "kv_lora_rank + qk_rope"),
        p + "kv_a_layernorm.weight": ((mla.kv_lora_rank,), "kv_lora_rank"),
        p + "kv_b_proj.weight": (
            (heads * (mla.qk_head_dim + mla.v_head_dim), mla.kv_lora_rank),
            "heads x (qk_nope_head_dim + v_head_dim), kv_lora_rank",
        ),
        p + "o_proj.weight": ((h, heads * mla.v_head_dim), "hidden_size, heads x v_head_dim"),
    }
    if mla.q_lora_rank is None:
        out[p + "q_proj.weight"] = ((heads * q_head, h), "heads x qk_head_dim, hidden_size")
    else:
        out[p + "q_a_proj.weight"] = ((mla.q_lora_rank, h), "q_lora_rank, hidden_size")
        out[p + "q_a_layernorm.weight"] = ((mla.q_lora_rank,), "q_lora_rank")
        out[p + "q_b_proj.weight"] = ((heads * q_head, mla.q_lora_rank), "heads x qk_head_dim, q_lora_rank")
    return out


def _cut(tensor: torch.Tensor, dim: int | None, tp_rank: int, tp_size: int) -> torch.Tensor:
    return tensor.clone() if dim is None else tensor.chunk(tp_size, dim=dim)[tp_rank].clone()


def attention_to_megatron(
    hf: Mapping[str, torch.Tensor],
    mla: MLAShape,
    *,
    hf_prefix: str,
    prefix: str,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> dict[str, torch.Tensor]:
    """Tensor-parallel rank ``tp_rank``'s MLA tensors of one layer under ``prefix`` (``decoder.layers.i.``) from the HF
    tensors under ``hf_prefix`` (``model.layers.L.``), cut as :data:`SPLIT_DIM` says; copies."""
    return {
        f"{prefix}self_attention.{m}": _cut(hf[f"{hf_prefix}self_attn.{h}"], SPLIT_DIM[m], tp_rank, tp_size)
        for m, h in names(mla).items()
    }


def attention_to_hf(name: str, mla: MLAShape) -> str | None:
    """The HF name (after ``model.layers.L.``) of the Megatron layer tensor ``name`` (after ``decoder.layers.i.``),
    None when it is no MLA tensor."""
    rest = name.removeprefix("self_attention.")
    hf = names(mla).get(rest) if rest != name else None
    return None if hf is None else "self_attn." + hf


def join_parts(name: str, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The whole tensor of the Megatron MLA layer tensor ``name`` (after ``decoder.layers.i.``) from its
    tensor-parallel ranks' ``parts``, in rank order."""
    import torch  # (here: ``--help`` and ``--dry-run`` read this module without torch)

    dim = SPLIT_DIM[name.removeprefix("self_attention.")]
    return parts[0] if dim is None else torch.cat(list(parts), dim=dim)


__all__ = [
    "HF_LATENT_NORM_EPS",
    "MLAShape",
    "attention_to_hf",
    "attention_to_megatron",
    "config_kwargs",
    "hf_attention_shapes",
    "join_parts",
    "mla_from_hf",
    "names",
    "SPLIT_DIM",
    "tp_problems",
]
