"""Fused Triton kernels for the embedded engine's forward on a GPU, with the HF modules' own rounding.

A decoding step of a small model is bound by kernel count, not bytes: transformers' eager Llama/Qwen layer runs
about 58 kernels per layer (an RMSNorm is eight: upcast, square, mean, add, rsqrt, multiply, downcast, scale; rotary
ten), so at the Qwen3-0.6B shape a step costs ~7 ms of tiny kernels against a ~1 ms memory floor, even replayed as
a CUDA graph. :func:`fuse_model` swaps, on the engine's own model instance only, the forwards of the modules it
knows (tables below) for ones that run one kernel where eager runs many:

- RMSNorm (``LlamaRMSNorm``, ``Qwen2RMSNorm``, ``Qwen3RMSNorm``, ``MistralRMSNorm``): :func:`rms_norm`, one kernel;
- the SwiGLU MLP (``gate_proj``, ``up_proj``, ``down_proj``, SiLU): :func:`silu_mul` between the matmuls;
- the attention of those families: rotary on queries and keys in one kernel (:func:`rotary`), then the model's
  attention function (the engine's).

Each kernel rounds where torch's eager ops round (RMSNorm: float32 math, downcast, then the weight product rounded
in the output dtype; rotary: each product and the sum rounded to the input dtype; SiLU, then the product, each
rounded), so the fused model computes what the trainer's HF model computes, up to float32 summation order inside a
kernel and Triton's fast ``exp`` and ``rsqrt`` (relative errors near 1e-7, far below a bf16 step). Weights stay the
modules' own parameters, so weight updates reach the fused forwards unchanged.
(Triton's CPU interpreter rounds float32 to bfloat16 by truncation, so the bf16 rounding is checked on a GPU only,
``tests/test_engine_decode_cuda.py``.)
"""

from __future__ import annotations

import types

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU engine never fuses
    triton = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x.float() * rsqrt(mean(x.float()**2, -1) + eps)).to(x.dtype)`` over the last dim, in the dtype
    torch promotes ``weight`` and ``x`` to. x ``[..., D]`` contiguous, weight ``[D]``."""
    if x.shape[-1] != weight.shape[0] or not x.is_contiguous():
        raise ValueError(f"rms_norm: x must be contiguous [..., {weight.shape[0]}], got {list(x.shape)}")
    rows, dim = x.numel() // x.shape[-1], x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _rms_norm_kernel[(rows,)](
        x, weight, out, eps, dim, BLOCK=triton.next_power_of_2(dim), ROUND=_rounding(x.dtype),
        ROUND_OUT=_rounding(out.dtype),
    )  # fmt: skip
    return out


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """transformers' ``apply_rotary_pos_emb`` (``x * cos + rotate_half(x) * sin``, each product and the sum rounded
    to ``x``'s dtype) on q ``[B, T, Hq, D]`` and k ``[B, T, Hk, D]`` (contiguous) with cos/sin
    ``[B or 1, T, D]``."""
    tokens, dim = q.shape[0] * q.shape[1], q.shape[-1]
    if cos.shape[-1] != dim or cos.dim() != 3 or not (q.is_contiguous() and k.is_contiguous()):
        raise ValueError(
            f"rotary: q, k [B, T, H, D] contiguous and cos [B, T, D], got {q.shape}, {k.shape}, {cos.shape}"
        )
    cos, sin = (t.expand(q.shape[0], q.shape[1], dim).contiguous() for t in (cos, sin))
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    hq, hk = q.shape[2], k.shape[2]
    _rotary_kernel[(tokens, hq + hk)](
        q,
        k,
        cos,
        sin,
        q_out,
        k_out,
        hq,
        dim,
        HALF=dim // 2,
        BLOCK=triton.next_power_of_2(dim // 2),
        ROUND=_rounding(q.dtype),
    )
    return q_out, k_out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, the SiLU rounded to the dtype before the product (torch's two eager ops)."""
    if gate.shape != up.shape or not (gate.is_contiguous() and up.is_contiguous()):
        raise ValueError(f"silu_mul: gate and up must be contiguous and alike, got {gate.shape}, {up.shape}")
    out = torch.empty_like(gate)
    n = gate.numel()
    _silu_mul_kernel[(triton.cdiv(n, 1024),)](gate, up, out, n, BLOCK=1024, ROUND=_rounding(gate.dtype))
    return out


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states.contiguous(), self.weight, self.variance_epsilon)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


def _attention_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
    """The Llama / Qwen attention forward with :func:`rotary` (and the fused q/k norms, when the model has them);
    a transformers cache (``past_key_values``) is updated as the HF forward does, and the model's attention function
    does the rest."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query = self.q_proj(hidden_states).view(hidden_shape)
    key = self.k_proj(hidden_states).view(hidden_shape)
    value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    if getattr(self, "q_norm", None) is not None:
        query, key = self.q_norm(query), self.k_norm(key)
    query, key = rotary(query, key, *position_embeddings)
    key = key.transpose(1, 2)
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, self.layer_idx)
    attention = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
    out, weights = attention(
        self, query.transpose(1, 2), key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
    )
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


# module class name -> the forward that replaces it (and what the module must have for it to apply)
FUSED_FORWARDS = {
    "LlamaRMSNorm": _norm_forward,
    "Qwen2RMSNorm": _norm_forward,
    "Qwen3RMSNorm": _norm_forward,
    "MistralRMSNorm": _norm_forward,
    "LlamaMLP": _mlp_forward,
    "Qwen2MLP": _mlp_forward,
    "Qwen3MLP": _mlp_forward,
    "MistralMLP": _mlp_forward,
    "LlamaAttention": _attention_forward,
    "Qwen2Attention": _attention_forward,
    "Qwen3Attention": _attention_forward,
    "MistralAttention": _attention_forward,
}


SILU = ("SiLU", "SiLUActivation")  # torch's module and transformers' ACT2FN["silu"]


def _applies(module: torch.nn.Module, forward) -> bool:
    if forward is _mlp_forward:
        return type(getattr(module, "act_fn", None)).__name__ in SILU
    if forward is _norm_forward:
        return hasattr(module, "variance_epsilon") and module.weight.dim() == 1
    return True


def fuse_model(model: torch.nn.Module, *, on: bool = True) -> int:
    """Give the modules of ``model`` that :data:`FUSED_FORWARDS` names their fused forward (this instance only), or
    with ``on=False`` their class's own again; returns how many modules changed. Fusing needs Triton."""
    if on and triton is None:
        raise RuntimeError("fuse_model needs Triton")
    count = 0
    for module in model.modules():
        forward = FUSED_FORWARDS.get(type(module).__name__)
        if forward is None or not _applies(module, forward):
            continue
        if on:
            module.forward = types.MethodType(forward, module)
        elif "forward" in vars(module):
            del module.forward
        count += 1
    return count


# How a kernel rounds a float32 value to its tensors' dtype: not at all, to bf16 by integer arithmetic on the bits
# (round to nearest, ties to even; finite values, as activations are: a conversion pair the compiler cannot fold away,
# and exact in Triton's interpreter too, whose float conversion truncates), or to fp16 by conversion.
ROUNDING = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _rounding(dtype: torch.dtype) -> int:
    if dtype not in ROUNDING:
        raise ValueError(f"fused kernels take float32, bfloat16 or float16 tensors, got {dtype}")
    return ROUNDING[dtype]


if triton is not None:

    @triton.jit
    def _round(x, ROUND: tl.constexpr):
        """float32 ``x`` rounded to the dtype ``ROUND`` names (see ROUNDING), still float32."""
        if ROUND == 1:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        elif ROUND == 2:
            return x.to(tl.float16).to(tl.float32)
        else:
            return x

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, w_ptr, out_ptr, eps, dim, BLOCK: tl.constexpr, ROUND: tl.constexpr, ROUND_OUT: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        real = cols < dim
        xf = tl.load(x_ptr + row * dim + cols, mask=real, other=0.0).to(tl.float32)
        variance = tl.sum(xf * xf, 0) / dim
        normed = _round(xf * tl.rsqrt(variance + eps), ROUND)
        w = tl.load(w_ptr + cols, mask=real, other=0.0).to(tl.float32)
        out = _round(w * normed, ROUND_OUT)
        tl.store(out_ptr + row * dim + cols, out.to(out_ptr.dtype.element_ty), mask=real)

    @triton.jit
    def _rotary_kernel(
        q_ptr, k_ptr, cos_ptr, sin_ptr, q_out, k_out, hq, dim, HALF: tl.constexpr, BLOCK: tl.constexpr,
        ROUND: tl.constexpr,
    ):  # fmt: skip
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        cols = tl.arange(0, BLOCK)
        real = cols < HALF
        if head < hq:
            src = q_ptr + (token * hq + head) * dim
            dst = q_out + (token * hq + head) * dim
        else:
            hk = tl.num_programs(1) - hq
            src = k_ptr + (token * hk + head - hq) * dim
            dst = k_out + (token * hk + head - hq) * dim
        x1 = tl.load(src + cols, mask=real, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + cols, mask=real, other=0.0).to(tl.float32)
        c1 = tl.load(cos_ptr + token * dim + cols, mask=real, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + token * dim + HALF + cols, mask=real, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + token * dim + cols, mask=real, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + token * dim + HALF + cols, mask=real, other=0.0).to(tl.float32)
        # rotate_half(x) = cat(-x2, x1): the first half pairs with -x2, the second with x1.
        lo = _round(_round(x1 * c1, ROUND) + _round(-x2 * s1, ROUND), ROUND)
        hi = _round(_round(x2 * c2, ROUND) + _round(x1 * s2, ROUND), ROUND)
        tl.store(dst + cols, lo.to(q_out.dtype.element_ty), mask=real)
        tl.store(dst + HALF + cols, hi.to(q_out.dtype.element_ty), mask=real)

    @triton.jit
    def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr, ROUND: tl.constexpr):
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        real = at < n
        g = tl.load(gate_ptr + at, mask=real, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + at, mask=real, other=0.0).to(tl.float32)
        silu = _round(g / (1.0 + tl.exp(-g)), ROUND)
        tl.store(out_ptr + at, _round(silu * u, ROUND).to(out_ptr.dtype.element_ty), mask=real)
