"""HF <-> megatron-core weight names and layouts, as pure tensor operations (no megatron-core, no process group).

Megatron's names are those of ``GPTModel`` built with the *local* layer spec (``get_gpt_layer_local_spec``), one
tensor-parallel (TP) rank of one pipeline stage (PP), with layer numbers local to the stage:

==========================================================  =====================================================
Megatron (stage-local)                                      HF
==========================================================  =====================================================
``embedding.word_embeddings.weight`` (first stage)          ``model.embed_tokens.weight``, vocab padded, TP rows
``decoder.layers.i.input_layernorm.weight``                 ``model.layers.L.input_layernorm.weight``
``decoder.layers.i.self_attention.linear_qkv.weight|bias``  ``q_proj``, ``k_proj``, ``v_proj``: per query group
                                                            [its q heads, k, v], TP splits the groups
``decoder.layers.i.self_attention.q_layernorm.weight``      ``self_attn.q_norm.weight`` (Qwen3)
``decoder.layers.i.self_attention.k_layernorm.weight``      ``self_attn.k_norm.weight`` (Qwen3)
``decoder.layers.i.self_attention.linear_proj.weight``      ``self_attn.o_proj.weight``, TP columns
``decoder.layers.i.pre_mlp_layernorm.weight``               ``post_attention_layernorm.weight``
``decoder.layers.i.mlp.linear_fc1.weight``                  ``gate_proj`` and ``up_proj``: each rank [gate, up]
                                                            of its TP rows
``decoder.layers.i.mlp.linear_fc2.weight``                  ``down_proj``, TP columns
``decoder.final_layernorm.weight`` (last stage)             ``model.norm.weight``
``output_layer.weight`` (last stage)                        ``lm_head.weight`` (the embedding when tied)
==========================================================  =====================================================

In a mixture-of-experts layer the MLP rows are the router's and the experts' instead
(:mod:`runtime.train.backends.megatron_moe`: experts split over expert-parallel ranks, not over TP).

``L = stage_start + i``. Every HF tensor is checked for its name and shape against the ``config.json`` it claims to
be, and every Megatron shard against the model it is loaded into: a mismatch raises ``ValueError`` naming the tensor
and the config field that sizes it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from runtime.train.backends import megatron_mla as mla
from runtime.train.backends import megatron_moe as moe
from runtime.train.backends.megatron_config import ModelShape, stage_layers, vocab_rows

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
FINAL_NORM = "model.norm.weight"
# GLM-4's fused [gate; up] of a dense MLP, and its norms after attention and after the MLP (same names both sides).
GATE_UP = "mlp.gate_up_proj.weight"
POST_NORMS = ("post_self_attn_layernorm.weight", "post_mlp_layernorm.weight")


def _layer(i: int) -> str:
    return f"model.layers.{i}."


def hf_layer_shapes(shape: ModelShape, layer: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF name -> (shape, the config fields that size it) of decoder layer ``layer``."""
    h, d = shape.hidden_size, shape.kv_channels
    q, kv = shape.num_attention_heads * d, shape.num_query_groups * d
    p = _layer(layer)
    if shape.mla is not None:
        out = {
            p + "input_layernorm.weight": ((h,), "hidden_size"),
            p + "post_attention_layernorm.weight": ((h,), "hidden_size"),
            **mla.hf_attention_shapes(shape.mla, hidden_size=h, heads=shape.num_attention_heads, prefix=p),
        }
        _add_mlp_shapes(out, shape, layer, p)
        return out
    out = {
        p + "input_layernorm.weight": ((h,), "hidden_size"),
        p + "self_attn.q_proj.weight": ((q, h), "num_attention_heads x head_dim, hidden_size"),
        p + "self_attn.k_proj.weight": ((kv, h), "num_key_value_heads x head_dim, hidden_size"),
        p + "self_attn.v_proj.weight": ((kv, h), "num_key_value_heads x head_dim, hidden_size"),
        p + "self_attn.o_proj.weight": ((h, q), "hidden_size, num_attention_heads x head_dim"),
        p + "post_attention_layernorm.weight": ((h,), "hidden_size"),
    }
    _add_mlp_shapes(out, shape, layer, p)
    if shape.add_qkv_bias:
        out[p + "self_attn.q_proj.bias"] = ((q,), "num_attention_heads x head_dim")
        out[p + "self_attn.k_proj.bias"] = ((kv,), "num_key_value_heads x head_dim")
        out[p + "self_attn.v_proj.bias"] = ((kv,), "num_key_value_heads x head_dim")
    if shape.qk_layernorm:
        out[p + "self_attn.q_norm.weight"] = ((d,), "head_dim")
        out[p + "self_attn.k_norm.weight"] = ((d,), "head_dim")
    return out


def _add_mlp_shapes(out: dict, shape: ModelShape, layer: int, p: str) -> None:
    """The MLP's (dense or MoE) and the post-norms' HF shapes of layer ``layer`` (prefix ``p``) into ``out``."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    if _is_moe(shape, layer):
        out.update(moe.hf_moe_shapes(shape.moe, hidden_size=h, prefix=p))
    elif shape.hf_gate_up_fused:
        out[p + GATE_UP] = ((2 * f, h), "2 x intermediate_size, hidden_size")
        out[p + "mlp.down_proj.weight"] = ((h, f), "hidden_size, intermediate_size")
    else:
        out[p + "mlp.gate_proj.weight"] = ((f, h), "intermediate_size, hidden_size")
        out[p + "mlp.up_proj.weight"] = ((f, h), "intermediate_size, hidden_size")
        out[p + "mlp.down_proj.weight"] = ((h, f), "hidden_size, intermediate_size")
    if shape.post_norms:
        for name in POST_NORMS:
            out[p + name] = ((h,), "hidden_size")


def _is_moe(shape: ModelShape, layer: int) -> bool:
    return shape.moe is not None and bool(shape.moe.layer_pattern[layer])


def hf_shapes(shape: ModelShape) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every HF tensor of the model (tied: no ``lm_head.weight``) -> (shape, the config fields that size it)."""
    v, h = shape.vocab_size, shape.hidden_size
    out = {EMBED: ((v, h), "vocab_size, hidden_size")}
    for layer in range(shape.num_layers):
        out.update(hf_layer_shapes(shape, layer))
    out[FINAL_NORM] = ((h,), "hidden_size")
    if not shape.tie_embeddings:
        out[LM_HEAD] = ((v, h), "vocab_size, hidden_size")
    return out


def check_hf_state(hf: Mapping[str, torch.Tensor], shape: ModelShape, *, source: str = "the checkpoint") -> None:
    """``ValueError`` unless ``hf`` holds exactly the tensors of ``shape`` with their shapes (a tied checkpoint may
    also carry ``lm_head.weight`` equal to the embedding, and a checkpoint with multi-token-prediction layers their
    tensors, which are not read)."""
    expected = hf_shapes(shape)
    mtp = tuple(_layer(shape.num_layers + i) for i in range(shape.checkpoint_mtp_layers))
    extra = {name for name in set(hf) - set(expected) if not name.startswith(mtp)}
    if shape.tie_embeddings and LM_HEAD in extra:
        if not torch.equal(hf[LM_HEAD], hf.get(EMBED, hf[LM_HEAD])):
            raise ValueError(
                f"{source}: lm_head.weight differs from model.embed_tokens.weight but config.json says "
                "tie_word_embeddings true"
            )
        extra.discard(LM_HEAD)
    missing = sorted(set(expected) - set(hf))
    if missing or extra:
        hint = " (config.json says tie_word_embeddings true)" if LM_HEAD in extra else ""
        hint = " (config.json says tie_word_embeddings false)" if LM_HEAD in missing else hint
        raise ValueError(
            f"{source} does not match its config.json{hint}: missing {missing[:4]}{' ...' if len(missing) > 4 else ''}"
            f" ({len(missing)}), unexpected {sorted(extra)[:4]} ({len(extra)})"
        )
    for name, (want, fields) in expected.items():
        got = tuple(hf[name].shape)
        if got != want:
            raise ValueError(f"{source}: {name} has shape {got}, config.json ({fields}) gives {want}")


def _split(t: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    return torch.chunk(t, tp_size, dim=dim)[tp_rank].clone()


def _pad_vocab(t: torch.Tensor, padded: int) -> torch.Tensor:
    if t.shape[0] == padded:
        return t
    return torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])])


def _qkv_to_megatron(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """Rows of q/k/v (weights [*, H] or biases [*]) as Megatron's fused QKV of TP rank ``tp_rank``: for each of its
    query groups, that group's query heads, then its key head, then its value head."""
    g, d = shape.num_query_groups, shape.kv_channels
    per = shape.num_attention_heads // g
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(g, per * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)
    return _split(fused, 0, tp_rank, tp_size).reshape(-1, *rest)


def _qkv_to_hf(parts: Sequence[torch.Tensor], shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`_qkv_to_megatron` over all TP ranks' fused QKV tensors, in rank order."""
    g, d = shape.num_query_groups, shape.kv_channels
    per = shape.num_attention_heads // g
    fused = torch.cat(list(parts), dim=0)
    rest = fused.shape[1:]
    fused = fused.reshape(g, (per + 2) * d, *rest)
    q, k, v = fused.split([per * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def to_megatron(
    hf: Mapping[str, torch.Tensor],
    shape: ModelShape,
    *,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> dict[str, torch.Tensor]:
    """The Megatron state of TP rank ``tp_rank`` and expert-parallel rank ``ep_rank`` of pipeline stage ``pp_rank``
    from a full HF state dict ``hf`` (checked against ``shape`` first). Tensors are new (clones); dtypes are kept."""
    check_hf_state(hf, shape)
    out: dict[str, torch.Tensor] = {}
    padded = vocab_rows(shape, tp_size=tp_size)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    if first:
        out["embedding.word_embeddings.weight"] = _split(_pad_vocab(hf[EMBED], padded), 0, tp_rank, tp_size)
    for local, layer in enumerate(stage_layers(shape, pp_rank=pp_rank, pp_size=pp_size)):
        p, m = _layer(layer), f"decoder.layers.{local}."
        out[m + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"].clone()
        if shape.mla is not None:
            out.update(
                mla.attention_to_megatron(hf, shape.mla, hf_prefix=p, prefix=m, tp_rank=tp_rank, tp_size=tp_size)
            )
        else:
            _attention_to_megatron(out, hf, shape, p=p, m=m, tp_rank=tp_rank, tp_size=tp_size)
        out[m + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"].clone()
        if shape.post_norms:
            for name in POST_NORMS:
                out[m + name] = hf[p + name].clone()
        if _is_moe(shape, layer):
            out.update(
                moe.moe_to_megatron(
                    hf,
                    shape.moe,
                    hf_prefix=p,
                    prefix=m,
                    ep_rank=ep_rank,
                    ep_size=ep_size,
                    tp_rank=tp_rank,
                    tp_size=tp_size,
                )
            )
            continue
        if shape.hf_gate_up_fused:
            gate, up = hf[p + GATE_UP].chunk(2, dim=0)
        else:
            gate, up = hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [_split(gate, 0, tp_rank, tp_size), _split(up, 0, tp_rank, tp_size)]
        )
        out[m + "mlp.linear_fc2.weight"] = _split(hf[p + "mlp.down_proj.weight"], 1, tp_rank, tp_size)
    if last:
        out["decoder.final_layernorm.weight"] = hf[FINAL_NORM].clone()
        head = hf[EMBED] if shape.tie_embeddings else hf[LM_HEAD]
        # Tied on one stage, the embedding is the head; over stages the last keeps its own copy (Megatron syncs it).
        if not (shape.tie_embeddings and first):
            out["output_layer.weight"] = _split(_pad_vocab(head, padded), 0, tp_rank, tp_size)
    return out


def _attention_to_megatron(
    out: dict, hf: Mapping[str, torch.Tensor], shape: ModelShape, *, p: str, m: str, tp_rank: int, tp_size: int
) -> None:
    """Grouped-query attention's Megatron tensors of one layer into ``out`` (HF prefix ``p``, Megatron ``m``)."""
    attn = p + "self_attn."
    out[m + "self_attention.linear_qkv.weight"] = _qkv_to_megatron(
        hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"], shape, tp_rank, tp_size
    )
    if shape.add_qkv_bias:
        out[m + "self_attention.linear_qkv.bias"] = _qkv_to_megatron(
            hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"], shape, tp_rank, tp_size
        )
    if shape.qk_layernorm:
        out[m + "self_attention.q_layernorm.weight"] = hf[attn + "q_norm.weight"].clone()
        out[m + "self_attention.k_layernorm.weight"] = hf[attn + "k_norm.weight"].clone()
    out[m + "self_attention.linear_proj.weight"] = _split(hf[attn + "o_proj.weight"], 1, tp_rank, tp_size)


def megatron_shapes(
    shape: ModelShape, *, tp_size: int, pp_rank: int, pp_size: int, ep_size: int = 1
) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor :func:`to_megatron` gives one TP x EP rank of stage ``pp_rank`` (all ranks alike)."""
    meta = {name: torch.empty(size, device="meta") for name, (size, _) in hf_shapes(shape).items()}
    shard = to_megatron(meta, shape, tp_rank=0, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, ep_size=ep_size)
    return {name: tuple(t.shape) for name, t in shard.items()}


def check_megatron_state(
    state: Mapping[str, torch.Tensor],
    shape: ModelShape,
    *,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    what: str,
    ep_size: int = 1,
) -> None:
    """``ValueError`` unless ``state`` (a model's parameters, or a shard to load) holds exactly the tensors and shapes
    of a TP x EP rank of stage ``pp_rank`` of ``shape``; ``what`` names the side in the message."""
    expected = megatron_shapes(shape, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, ep_size=ep_size)
    check_shapes(state, expected, what=what, kind="Megatron tensors")


def check_shapes(
    state: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]], *, what: str, kind: str
) -> None:
    """``ValueError`` unless ``state`` holds exactly the names of ``expected`` with those shapes; the message starts
    with ``what`` and calls the tensors ``kind``."""
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise ValueError(f"{what}: missing {kind} {missing[:4]} ({len(missing)}), unexpected {extra[:4]}")
    for name, want in expected.items():
        if tuple(state[name].shape) != want:
            raise ValueError(f"{what}: {name} has shape {tuple(state[name].shape)}, the model wants {want}")


def layer_to_hf(
    name: str, parts: Sequence[torch.Tensor], shape: ModelShape, *, layer: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors of one Megatron decoder-layer tensor ``name`` (without its ``decoder.layers.i.`` prefix), given its
    TP shards ``parts`` in rank order (an expert's: its expert-parallel ranks' tensors, in rank order,
    :func:`megatron_moe.expert_to_hf`); ``layer`` is the global layer index."""
    p = _layer(layer)
    if moe.is_expert(name):
        yield from moe.expert_to_hf(name, parts, shape.moe, layer=layer)
        return
    hf_name = None if shape.mla is None else mla.attention_to_hf(name, shape.mla)
    if hf_name is not None:
        yield p + hf_name, mla.join_parts(name, parts)
        return
    attn = p + "self_attn."
    if name in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = name.rsplit(".", 1)[1]
        q, k, v = _qkv_to_hf(parts, shape)
        yield attn + f"q_proj.{kind}", q
        yield attn + f"k_proj.{kind}", k
        yield attn + f"v_proj.{kind}", v
    elif name == moe.SHARED_FC1:
        gates, ups = zip(*(part.chunk(2, dim=0) for part in parts), strict=True)
        yield p + "mlp.shared_experts.gate_proj.weight", torch.cat(gates)
        yield p + "mlp.shared_experts.up_proj.weight", torch.cat(ups)
    elif name == "mlp.linear_fc1.weight":
        gates, ups = zip(*(part.chunk(2, dim=0) for part in parts), strict=True)
        if shape.hf_gate_up_fused:
            yield p + GATE_UP, torch.cat([*gates, *ups])
        else:
            yield p + "mlp.gate_proj.weight", torch.cat(gates)
            yield p + "mlp.up_proj.weight", torch.cat(ups)
    elif name in _ROW_PARALLEL:
        yield p + _ROW_PARALLEL[name], torch.cat(list(parts), dim=1)
    elif name in _REPLICATED:
        yield p + _REPLICATED[name], parts[0]
    else:
        raise ValueError(f"no HF name for the Megatron tensor decoder.layers.*.{name}")


_ROW_PARALLEL = {
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    moe.SHARED_FC2: "mlp.shared_experts.down_proj.weight",
}
_REPLICATED = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    moe.ROUTER: "mlp.gate.weight",
    moe.EXPERT_BIAS: moe.HF_EXPERT_BIAS,
    **{name: name for name in POST_NORMS},
}


def tensor_to_hf(
    name: str, parts: Sequence[torch.Tensor], shape: ModelShape, *, pp_rank: int, pp_size: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors of the stage-local Megatron tensor ``name`` of stage ``pp_rank``, from its TP shards ``parts`` in
    rank order. The vocabulary padding is cut off; a tied model's ``output_layer.weight`` gives nothing (the embedding
    is exported once)."""
    if name.startswith("decoder.layers."):
        local, rest = name[len("decoder.layers.") :].split(".", 1)
        layer = stage_layers(shape, pp_rank=pp_rank, pp_size=pp_size)[int(local)]
        yield from layer_to_hf(rest, parts, shape, layer=layer)
    elif name == "embedding.word_embeddings.weight":
        yield EMBED, torch.cat(list(parts))[: shape.vocab_size]
    elif name == "output_layer.weight":
        if not shape.tie_embeddings:
            yield LM_HEAD, torch.cat(list(parts))[: shape.vocab_size]
    elif name == "decoder.final_layernorm.weight":
        yield FINAL_NORM, parts[0]
    else:
        raise ValueError(f"no HF name for the Megatron tensor {name}")


def to_hf(shards: Sequence[Sequence[Mapping[str, torch.Tensor]]], shape: ModelShape) -> dict[str, torch.Tensor]:
    """The full HF state dict from every rank's Megatron state at expert parallelism 1: ``shards[pp_rank][tp_rank]``.
    Each shard is checked against ``shape`` first; the result against the HF shapes."""
    pp_size = len(shards)
    out: dict[str, torch.Tensor] = {}
    for pp_rank, stage in enumerate(shards):
        tp_size = len(stage)
        for tp_rank, state in enumerate(stage):
            check_megatron_state(
                state,
                shape,
                tp_size=tp_size,
                pp_rank=pp_rank,
                pp_size=pp_size,
                what=f"Megatron shard (stage {pp_rank}, tensor rank {tp_rank})",
            )
        for name in stage[0]:
            # Experts are whole on every TP rank (expert tensor parallelism 1): one copy is the EP=1 rank's.
            parts = [stage[0][name]] if moe.is_expert(name) else [state[name] for state in stage]
            for hf_name, tensor in tensor_to_hf(name, parts, shape, pp_rank=pp_rank, pp_size=pp_size):
                out.setdefault(hf_name, tensor)
    check_hf_state(out, shape, source="the exported weights")
    return out


__all__ = [
    "check_hf_state",
    "check_megatron_state",
    "check_shapes",
    "hf_shapes",
    "megatron_shapes",
    "tensor_to_hf",
    "to_hf",
    "to_megatron",
]
