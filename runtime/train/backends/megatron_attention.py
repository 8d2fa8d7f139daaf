"""Core attention of the Megatron backend's local layer spec through PyTorch's ``scaled_dot_product_attention``.

The GPU hosts have no Transformer Engine or flash-attn, so the Megatron backend builds megatron-core's local spec,
whose core attention (``DotProductAttention``) materialises the ``[b, heads, s, s]`` scores and their softmax in
memory. :class:`SDPADotProductAttention` is the same module (constructor, forward signature, checkpoint state) with
the attention computed by ``torch.nn.functional.scaled_dot_product_attention``: on a GPU PyTorch's flash or
memory-efficient kernels, which never store the scores; on the CPU its math kernel.

``--attention-backend`` picks it (Megatron's flag; :data:`ATTENTION_IMPLEMENTATIONS`): ``auto`` and ``flash`` give the
SDPA attention, ``local`` and ``unfused`` megatron-core's unfused ``DotProductAttention``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.utils import is_layer_window_attention

from runtime.config import MEGATRON_VALUES_BUILT
from runtime.train.backends.megatron_compat import apply_no_te_workarounds

SDPA, UNFUSED = "sdpa", "unfused"

# --attention-backend -> the core attention the local spec is built with.
ATTENTION_IMPLEMENTATIONS: dict[str, str] = {"auto": SDPA, "flash": SDPA, "local": UNFUSED, "unfused": UNFUSED}
# The values the validation lets through (runtime.config.MEGATRON_VALUES_BUILT; "fused", Transformer Engine's, is not).
assert set(ATTENTION_IMPLEMENTATIONS) == set(MEGATRON_VALUES_BUILT["attention_backend"][0])

# Dtypes and head sizes of PyTorch's CUDA flash kernel, the one SDPA kernel that takes grouped key/value heads itself.
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256


def sdpa_core_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    mask: torch.Tensor | None = None,
    native_gqa: bool | None = None,
) -> torch.Tensor:
    """Softmax attention in Megatron's layout through ``scaled_dot_product_attention``.

    Args:
        query: [sq, b, np, hn] queries of this rank's ``np`` heads.
        key, value: [sk, b, ng, hn] and [sk, b, ng, hv], ``ng`` key/value groups dividing ``np`` (grouped-query
            attention: query head ``h`` reads group ``h // (np // ng)``, as Megatron's ``repeat_interleave``); the
            value head ``hv`` may differ from the query/key head (multi-latent attention).
        scale: multiplies ``query @ key^T`` before the softmax.
        causal: query ``i`` attends to keys ``j <= i`` only (needs ``sq == sk``); ignored when ``mask`` is given.
        mask: optional bool mask broadcastable to [b, np, sq, sk], True where a query must NOT attend (Megatron's
            convention). A row masked everywhere gives NaN (Megatron's unfused softmax gives a uniform row).
        native_gqa: hand the grouped key/value heads to the kernel (``enable_gqa``) instead of repeating them.
            None: only where PyTorch's flash kernel runs it (CUDA, float16/bfloat16, no mask, head size up to 256,
            flash enabled); its other kernels would fall back to the math kernel, which materialises the scores.

    Returns:
        [sq, b, np * hv], the attention output of every head, heads outermost in the last dimension.
    """
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or key.shape[:3] != value.shape[:3]:
        raise ValueError(
            f"query [sq, b, np, hn], key [sk, b, ng, hn] and value [sk, b, ng, hv], got {tuple(query.shape)}, "
            f"{tuple(key.shape)}, {tuple(value.shape)}"
        )
    sq, b, heads, dim = query.shape
    sk, groups, value_dim = key.shape[0], key.shape[2], value.shape[3]
    if key.shape[1] != b or key.shape[3] != dim or heads % groups:
        raise ValueError(f"key/value {tuple(key.shape)} do not fit query {tuple(query.shape)} (np % ng must be 0)")
    if mask is None and causal and sq != sk:
        raise ValueError(f"causal attention needs as many queries as keys, got {sq} and {sk}")
    if mask is not None and mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool (True: masked out), got {mask.dtype}")
    if native_gqa is None:
        native_gqa = (
            query.is_cuda
            and query.dtype in _FLASH_DTYPES
            and mask is None
            and dim <= _FLASH_MAX_HEAD_DIM
            and value_dim == dim
            and torch.backends.cuda.flash_sdp_enabled()
        )
    # [s, b, n, h] -> [b, n, s, h]: the kernels take strided inputs whose last dimension is contiguous.
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    if groups != heads and not native_gqa:
        k = k.repeat_interleave(heads // groups, dim=1)
        v = v.repeat_interleave(heads // groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=None if mask is None else ~mask,
        is_causal=causal and mask is None,
        scale=scale,
        enable_gqa=groups != heads and native_gqa,
    )
    # Contiguous: cuDNN's kernel lays its output out as [b, s, n, h], whose [s, b, n * h] view the output projection
    # would copy in its forward matmul and again for its weight gradient (it saves its input as given).
    return out.permute(2, 0, 1, 3).reshape(sq, b, heads * value_dim).contiguous()


class SDPADotProductAttention(DotProductAttention):
    """megatron-core's ``DotProductAttention`` (same constructor, forward signature and checkpoint state) computed by
    :func:`sdpa_core_attention`.

    Masking follows Megatron's unfused softmax: a given ``attention_mask`` (bool, True where masked) is applied as it
    is; without one, a causal mask type means causal attention (the flash kernel's own causal masking, no mask tensor).
    The softmax runs in float32 inside the kernels whatever ``attention_softmax_in_fp32`` says. Attention dropout,
    sliding windows, softmax offsets, attention biases and packed sequences are refused."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        *,
        k_channels: int | None = None,
        v_channels: int | None = None,
        **kwargs,
    ):
        # k_channels / v_channels: the query/key and value head sizes multi-latent attention passes (they differ)
        # with its own softmax_scale; megatron-core's local DotProductAttention takes neither (megatron_compat), and
        # this attention reads the head sizes off its inputs.
        super().__init__(config, layer_number, attn_mask_type, attention_type, **kwargs)
        dropout = kwargs.get("attention_dropout")
        dropout = config.attention_dropout if dropout is None else dropout
        problems = []
        if dropout:
            problems.append(f"attention dropout {dropout} (it must be 0: --attention-dropout)")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            problems.append(f"sliding-window attention (window {config.window_size})")
        if config.softmax_type != "vanilla":
            problems.append(f"softmax_type {config.softmax_type!r}")
        if problems:
            raise ValueError(
                f"--attention-backend auto (PyTorch SDPA attention) does not take {', '.join(problems)}; "
                "--attention-backend local runs Megatron's unfused attention"
            )
        # DotProductAttention divides its scale by the layer number under apply_query_key_layer_scaling and its
        # softmax multiplies it back: the attention's scale is the undivided one.
        self.sdpa_scale = self.softmax_scale * (self.layer_number if config.apply_query_key_layer_scaling else 1)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """[sq, b, np, hn] queries, [sk, b, ng, hn] keys, [sk, b, ng, hv] values -> [sq, b, np * hv]."""
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("the SDPA core attention takes no attention bias and no packed sequences")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        return sdpa_core_attention(
            query,
            key,
            value,
            scale=self.sdpa_scale,
            causal=mask_type == AttnMaskType.causal and query.shape[0] > 1,
            mask=attention_mask,
        )


def local_layer_spec(
    *,
    attention_backend: str,
    qk_layernorm: bool,
    normalization: str,
    num_experts: int | None = None,
    grouped_gemm: bool = False,
    multi_latent_attention: bool = False,
) -> ModuleSpec:
    """megatron-core's local GPT layer spec with the core attention that ``attention_backend`` names
    (:data:`ATTENTION_IMPLEMENTATIONS`); with ``num_experts`` its MLP is megatron-core's ``MoELayer`` (experts
    ``SequentialMLP``, or with ``grouped_gemm`` :func:`runtime.train.backends.megatron_moe.grouped_gemm_experts`'s
    module, the same parameters); with ``multi_latent_attention`` megatron-core's ``MLASelfAttention`` (its latent
    norms are the spec's ``qk_layernorm``)."""
    if attention_backend not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"--attention-backend {attention_backend!r}: the Megatron backend runs {sorted(ATTENTION_IMPLEMENTATIONS)}"
        )
    # Every model of the backend is built from this spec: megatron-core's no-TE bugs are worked around first.
    apply_no_te_workarounds()
    spec = get_gpt_layer_local_spec(
        qk_layernorm=qk_layernorm,
        normalization=normalization,
        num_experts=num_experts,
        multi_latent_attention=multi_latent_attention,
    )
    if num_experts is not None and grouped_gemm:
        from runtime.train.backends.megatron_moe import grouped_gemm_experts

        mlp = spec.submodules.mlp
        experts = dataclasses.replace(mlp.submodules.experts, module=grouped_gemm_experts())
        mlp = dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, experts=experts))
        spec = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=mlp))
    if ATTENTION_IMPLEMENTATIONS[attention_backend] == UNFUSED:
        return spec
    attention = spec.submodules.self_attention
    submodules = dataclasses.replace(attention.submodules, core_attention=SDPADotProductAttention)
    layer = dataclasses.replace(spec.submodules, self_attention=dataclasses.replace(attention, submodules=submodules))
    return dataclasses.replace(spec, submodules=layer)


def causal_attention_mask(width: int, *, attention_backend: str, device: torch.device) -> torch.Tensor | None:
    """The attention mask of right-padded rows of ``width`` tokens for the core attention of ``attention_backend``:
    None for the SDPA attention (its kernel masks causally by itself, no [width, width] tensor is made), else the
    [1, 1, width, width] bool causal mask (True above the diagonal: masked) that Megatron's unfused attention reads.

    Under a causal mask real tokens of a right-padded row never see its padding: no padding mask is needed."""
    if ATTENTION_IMPLEMENTATIONS[attention_backend] == SDPA:
        return None
    return torch.ones(width, width, dtype=torch.bool, device=device).triu(1)[None, None]


__all__ = [
    "ATTENTION_IMPLEMENTATIONS",
    "SDPADotProductAttention",
    "causal_attention_mask",
    "local_layer_spec",
    "sdpa_core_attention",
]
