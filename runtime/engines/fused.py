"""Fused Triton kernels for the embedded engine's forward on a GPU, with the HF modules' own rounding.

A decoding step of a small model is bound by kernel count, not bytes: transformers' eager Llama/Qwen layer runs
about 58 kernels per layer (an RMSNorm is eight: upcast, square, mean, add, rsqrt, multiply, downcast, scale; rotary
ten), so at the Qwen3-0.6B shape a step costs ~7 ms of tiny kernels against a ~1 ms memory floor, even replayed as
a CUDA graph. :func:`fuse_model` swaps, on the engine's own model instance only, the forwards of the modules it
knows (tables below) for ones that run one kernel where eager runs many:

- RMSNorm (``LlamaRMSNorm``, ``Qwen2RMSNorm``, ``Qwen3RMSNorm``, ``MistralRMSNorm``): :func:`rms_norm`, one kernel;
- the decoder layer of those families: the residual add after the attention and the norm after it in one kernel
  (:func:`add_rms_norm`), and the residual add after the MLP and the norm that follows the layer (the next layer's
  input norm, or the model's final norm) in another;
- the SwiGLU MLP (``gate_proj``, ``up_proj``, ``down_proj``, SiLU): gate and up as one matmul, then
  :func:`silu_mul` on its two halves, then ``down_proj``;
- the attention of those families: q, k and v as one matmul, then the q/k norms (when the model has them, Qwen3)
  and rotary on queries and keys in one kernel (:func:`rotary` with ``norms``) that reads them from it in place,
  then the model's attention function (the engine's).

**Merged projections** (:func:`merge_projections`): the weights of ``q_proj``/``k_proj``/``v_proj`` (and of
``gate_proj``/``up_proj``) are concatenated once into one tensor, and each module's own parameter becomes a view of
its rows of it. A weight update copies into the parameters (``HFEngine.load_weights``), so it writes the merged
tensor itself: the two cannot drift apart. Moving the model (``model.to``) gives each parameter its own storage
again, so the engine unfuses before it moves the model and fuses after (``HFEngine.release_memory`` /
``resume_memory``).

Each kernel rounds where torch's eager ops round (RMSNorm: float32 math, downcast, then the weight product rounded
in the output dtype; rotary: each product and the sum rounded to the input dtype; SiLU, then the product, each
rounded), so the fused model computes what the trainer's HF model computes, up to float32 summation order inside a
kernel and Triton's fast ``exp`` and ``rsqrt`` (relative errors near 1e-7, far below a bf16 step), and a merged
matmul's output columns are each the dot product the separate matmul computes (cuBLAS may pick another kernel for
the wider matrix, which may round differently in the last bit).
(Triton's CPU interpreter rounds float32 to bfloat16 by truncation, so the bf16 rounding is checked on a GPU only,
``tests/test_engine_decode_cuda.py``.)
"""

from __future__ import annotations

import types

import torch

from runtime.engines.decode import CACHE_KWARG, STORED_KWARG

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU engine never fuses
    triton = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x.float() * rsqrt(mean(x.float()**2, -1) + eps)).to(x.dtype)`` over the last dim, in the dtype
    torch promotes ``weight`` and ``x`` to; the output is contiguous. x ``[..., H, D]`` whose rows of ``D`` lie back
    to back within a token (a contiguous tensor, or a view of some heads' columns of a merged projection,
    :func:`token_stride`); weight ``[D]``."""
    x = x if x.dim() > 1 else x[None]
    stride = token_stride(x)
    if x.shape[-1] != weight.shape[0] or stride is None:
        raise ValueError(f"rms_norm: x must be [..., {weight.shape[0]}] with rows back to back, got {list(x.shape)}")
    dim, heads = x.shape[-1], x.shape[-2]
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _rms_norm_kernel[(x.numel() // dim,)](
        x, weight, out, eps, dim, heads, stride, BLOCK=triton.next_power_of_2(dim), ROUND=_rounding(x.dtype),
        ROUND_OUT=_rounding(out.dtype),
    )  # fmt: skip
    return out


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the norm after it in one kernel: ``total = x + delta`` (rounded to their dtype, as
    torch's add) and :func:`rms_norm` of ``total``. x, delta ``[..., D]`` contiguous, alike; weight ``[D]``."""
    if x.shape != delta.shape or x.dtype != delta.dtype or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"add_rms_norm: x and delta must be alike [..., {weight.shape[0]}], got {x.shape}, {delta.shape}"
        )
    if not (x.is_contiguous() and delta.is_contiguous()):
        raise ValueError("add_rms_norm: x and delta must be contiguous")
    dim = x.shape[-1]
    total = torch.empty_like(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _add_rms_norm_kernel[(x.numel() // dim,)](
        x, delta, total, weight, out, eps, dim, BLOCK=triton.next_power_of_2(dim), ROUND=_rounding(x.dtype),
        ROUND_OUT=_rounding(out.dtype),
    )  # fmt: skip
    return total, out


def token_stride(x: torch.Tensor) -> int | None:
    """The stride between the tokens of ``x [..., H, D]`` (every dim before the heads flattened into one) when each
    token's ``H`` rows of ``D`` elements lie back to back and the tokens are evenly spaced; else None."""
    if x.dim() < 2:
        return None
    *lead, heads, dim = x.shape
    *lead_strides, stride_h, stride_d = x.stride()
    if (dim > 1 and stride_d != 1) or (heads > 1 and stride_h != dim):
        return None
    token, inner = None, 1
    for size, stride in zip(reversed(lead), reversed(lead_strides), strict=True):
        if size == 1:
            continue
        if token is None:
            token = stride
        elif stride != token * inner:
            return None
        inner *= size
    return heads * dim if token is None else token


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    store: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, ...]:
    """transformers' ``apply_rotary_pos_emb`` (``x * cos + rotate_half(x) * sin``, each product and the sum rounded
    to ``x``'s dtype) on q ``[B, T, Hq, D]`` and k ``[B, T, Hk, D]`` (heads back to back, :func:`token_stride`)
    with cos/sin ``[B or 1, T, D]``; the outputs are contiguous. ``norms`` ``(q_weight, k_weight, eps)`` (weights
    ``[D]`` in q's dtype): each head is first :func:`rms_norm`-ed by its weight (Qwen3's q/k norms), in the same
    kernel, rounded to the dtype before the rotation as the separate norm's output is. ``store`` ``(value, pool_k,
    pool_v, pages, offsets)`` (a decoding step: one token per row, ``T == 1``): the same kernel also writes row
    ``b``'s rotated key and its value (``value [B, 1, Hk, D]``, heads back to back) to page ``pages[b]`` at column
    ``offsets[b]`` of pool_k / pool_v ``[pages, Hk, S, D]``, as
    :func:`runtime.engines.decode_attention.store_decode_kv_torch` does."""
    tokens, dim = q.shape[0] * q.shape[1], q.shape[-1]
    stride_q, stride_k = token_stride(q), token_stride(k)
    if cos.shape[-1] != dim or cos.dim() != 3 or q.dim() != 4 or stride_q is None or stride_k is None:
        raise ValueError(
            f"rotary: q, k [B, T, H, D] (heads back to back) and cos [B, T, D], got {q.shape}, {k.shape}, {cos.shape}"
        )
    cos, sin = (t.expand(q.shape[0], q.shape[1], dim).contiguous() for t in (cos, sin))
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    hq, hk = q.shape[2], k.shape[2]
    q_weight, k_weight, eps = (q, q, 0.0) if norms is None else norms
    if norms is not None and not (q_weight.shape == k_weight.shape == (dim,) and q_weight.dtype == k_weight.dtype):
        raise ValueError(f"rotary: norms' weights must be [{dim}] alike, got {q_weight.shape}, {k_weight.shape}")
    if norms is not None and q_weight.dtype != q.dtype:
        raise ValueError(f"rotary: norms' weights must be in q's dtype {q.dtype}, got {q_weight.dtype}")
    value, pool_k, pool_v, pages, offsets = (q, q, q, q, q) if store is None else store
    stride_v, page = 0, 1
    if store is not None:
        stride_v, page = token_stride(value), pool_k.shape[2]
        if q.shape[1] != 1 or value.shape != k.shape or stride_v is None or pool_k.shape[1] != hk:
            raise ValueError(f"rotary: store needs one token per row and value like k, got {q.shape}, {value.shape}")
        if (
            pool_k.shape != pool_v.shape
            or pool_k.shape[-1] != dim
            or not (pool_k.is_contiguous() and pool_v.is_contiguous())
        ):
            raise ValueError(f"rotary: store needs contiguous pools [pages, {hk}, S, {dim}], got {pool_k.shape}")
    _rotary_kernel[(tokens, hq + hk)](
        q, k, cos, sin, q_out, k_out, q_weight, k_weight, eps, hq, dim, stride_q, stride_k, value, stride_v, pool_k,
        pool_v, pages, offsets, HALF=dim // 2, BLOCK=triton.next_power_of_2(dim // 2), ROUND=_rounding(q.dtype),
        NORM=norms is not None, STORE=store is not None, PAGE=page,
    )  # fmt: skip
    return q_out, k_out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for gate_up ``[..., 2I]`` contiguous (the gate in its first ``I`` columns, up in the
    rest: the merged gate/up matmul's output) -> ``[..., I]``; the SiLU rounded to the dtype before the product
    (torch's two eager ops)."""
    if gate_up.shape[-1] % 2 or not gate_up.is_contiguous():
        raise ValueError(f"silu_mul: gate_up must be contiguous [..., 2I], got {list(gate_up.shape)}")
    width = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], width, dtype=gate_up.dtype, device=gate_up.device)
    n = out.numel()
    _silu_mul_kernel[(triton.cdiv(n, 1024),)](gate_up, out, n, width, BLOCK=1024, ROUND=_rounding(gate_up.dtype))
    return out


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    # The decoder layer before this norm may have normed its output already, in its residual add's kernel.
    pending = vars(self).pop(PENDING, None)
    if pending is not None and pending[0] is hidden_states:
        return pending[1]
    x = hidden_states if token_stride(hidden_states) is not None else hidden_states.contiguous()
    return rms_norm(x, self.weight, self.variance_epsilon).view(hidden_states.shape)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    weight, bias, _ = self._rlcore_merged
    return self.down_proj(silu_mul(torch.nn.functional.linear(x, weight, bias)))


def _attention_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
    """The Llama / Qwen attention forward with :func:`rotary` (and the fused q/k norms, when the model has them);
    a transformers cache (``past_key_values``) is updated as the HF forward does, and the model's attention function
    does the rest."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    weight, bias, sizes = self._rlcore_merged
    query, key, value = torch.nn.functional.linear(hidden_states, weight, bias).split(sizes, dim=-1)
    query, key, value = query.view(hidden_shape), key.view(hidden_shape), value.view(hidden_shape)
    norms = _qk_norms(self)
    if norms is None and getattr(self, "q_norm", None) is not None:
        query, key = self.q_norm(query), self.k_norm(key)
    # The engine's decoding step: the rotary kernel writes the keys and values to the cache's pages itself.
    cache = kwargs.get(CACHE_KWARG)
    pages = None if cache is None else cache.decode_target(self.layer_idx, value.shape[-1])
    store = None if pages is None else (value, *pages)
    query, key = rotary(query, key, *position_embeddings, norms=norms, store=store)
    if store is not None:
        kwargs = {**kwargs, STORED_KWARG: True}
    value = value.transpose(1, 2)
    key = key.transpose(1, 2)
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, self.layer_idx)
    attention = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
    out, weights = attention(
        self, query.transpose(1, 2), key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
    )
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def _qk_norms(attention: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """The attention's q/k norms as :func:`rotary`'s ``norms``, when both are RMSNorms it fuses (weights in the
    projections' dtype, one epsilon); else None (no norms, or norms the rotary kernel cannot run)."""
    q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    if any(FUSED_FORWARDS.get(type(n).__name__) is not _norm_forward or not _applies(n, _norm_forward)
           for n in (q_norm, k_norm)):  # fmt: skip
        return None
    dtype = attention.o_proj.weight.dtype
    if {q_norm.weight.dtype, k_norm.weight.dtype} != {dtype} or q_norm.variance_epsilon != k_norm.variance_epsilon:
        return None
    return q_norm.weight, k_norm.weight, q_norm.variance_epsilon


def merge_projections(module: torch.nn.Module, names: tuple[str, ...]) -> tuple[torch.Tensor, ...] | None:
    """Concatenate the weights (and biases) of ``module``'s ``nn.Linear`` children ``names`` along their output rows
    into one tensor each and make every child's parameter a view of its rows of it; returns ``(weight, bias or None,
    output sizes)``, or None (nothing changed) unless the children are plain ``nn.Linear`` alike in input size,
    dtype, device and in having a bias."""
    linears = [getattr(module, name, None) for name in names]
    if not all(type(linear) is torch.nn.Linear for linear in linears):
        return None
    weights = [linear.weight for linear in linears]
    biases = [linear.bias for linear in linears]
    alike = {(w.shape[1], w.dtype, w.device, b is None) for w, b in zip(weights, biases, strict=True)}
    if len(alike) != 1:
        return None
    sizes = tuple(w.shape[0] for w in weights)
    with torch.no_grad():
        weight = torch.cat([w.detach() for w in weights])
        for param, rows in zip(weights, weight.split(sizes), strict=True):
            param.data = rows
        bias = None
        if biases[0] is not None:
            bias = torch.cat([b.detach() for b in biases])
            for param, rows in zip(biases, bias.split(sizes), strict=True):
                param.data = rows
    return weight, bias, sizes


def _decoder_layer_forward(
    self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
    position_embeddings=None, **kwargs,
):  # fmt: skip
    """The Llama / Qwen decoder layer (norm, attention, residual add, norm, MLP, residual add) with the residual add
    after the attention and the norm after it as one kernel (:func:`add_rms_norm`), and the residual add after the
    MLP and the norm that follows the layer (the next layer's input norm, or the model's final one: ``NEXT_NORM``,
    set by :func:`fuse_model`) as another: the layer hands that norm its output, which the norm returns when it is
    given the layer's output (the same tensor object) and nothing else."""
    norm = self.post_attention_layernorm
    attended, _ = self.self_attn(
        hidden_states=self.input_layernorm(hidden_states),
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    hidden_states, normed = add_rms_norm(hidden_states.contiguous(), attended, norm.weight, norm.variance_epsilon)
    delta = self.mlp(normed)
    following = vars(self).get(NEXT_NORM)
    if following is None or torch.compiler.is_compiling():  # compiled: the compiler fuses the add itself
        return hidden_states + delta
    total, normed = add_rms_norm(hidden_states, delta.contiguous(), following.weight, following.variance_epsilon)
    vars(following)[PENDING] = (total, normed)
    return total


# Held in a module's __dict__ (not registered as a submodule or a buffer): a fused decoder layer's following norm,
# and a norm's input and output computed ahead by the layer before it.
NEXT_NORM, PENDING = "_rlcore_next_norm", "_rlcore_pending"


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
    "LlamaDecoderLayer": _decoder_layer_forward,
    "Qwen2DecoderLayer": _decoder_layer_forward,
    "Qwen3DecoderLayer": _decoder_layer_forward,
    "MistralDecoderLayer": _decoder_layer_forward,
}


SILU = ("SiLU", "SiLUActivation")  # torch's module and transformers' ACT2FN["silu"]

# the fused forward -> the projections it runs as one matmul (merge_projections)
MERGED = {_attention_forward: ("q_proj", "k_proj", "v_proj"), _mlp_forward: ("gate_proj", "up_proj")}


def _applies(module: torch.nn.Module, forward) -> bool:
    if forward is _mlp_forward:
        return type(getattr(module, "act_fn", None)).__name__ in SILU
    if forward is _norm_forward:
        return hasattr(module, "variance_epsilon") and module.weight.dim() == 1
    if forward is _decoder_layer_forward:
        norm = getattr(module, "post_attention_layernorm", None)
        return FUSED_FORWARDS.get(type(norm).__name__) is _norm_forward and _applies(norm, _norm_forward)
    return True


def fuse_model(model: torch.nn.Module, *, on: bool = True) -> int:
    """Give the modules of ``model`` that :data:`FUSED_FORWARDS` names their fused forward (this instance only), with
    their :data:`MERGED` projections merged (:func:`merge_projections`), or with ``on=False`` their class's own
    forward again and no merged tensors held (the parameters stay views of them until the model moves); returns how
    many modules changed. Fusing needs Triton."""
    if on and triton is None:
        raise RuntimeError("fuse_model needs Triton")
    count = 0
    for module in model.modules():
        forward = FUSED_FORWARDS.get(type(module).__name__)
        if forward is None or not _applies(module, forward):
            continue
        if not on:
            vars(module).pop("forward", None)
            vars(module).pop("_rlcore_merged", None)
        else:
            merged = merge_projections(module, MERGED[forward]) if forward in MERGED else None
            if forward in MERGED and merged is None:
                continue
            module.forward = types.MethodType(forward, module)
            if merged is not None:
                module._rlcore_merged = merged
        count += 1
    _chain_norms(model, on=on)
    return count


def _chain_norms(model: torch.nn.Module, *, on: bool) -> None:
    """Give each fused decoder layer of a model's ``layers`` the fused norm that follows it (the next layer's
    ``input_layernorm``, or the model's ``norm`` after the last), so that it runs its last residual add and that
    norm as one kernel; with ``on=False`` take them (and any output handed ahead) back."""
    for module in model.modules():
        vars(module).pop(NEXT_NORM, None)
        vars(module).pop(PENDING, None)
    if not on:
        return
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if not isinstance(layers, torch.nn.ModuleList):
            continue
        following = [getattr(layer, "input_layernorm", None) for layer in list(layers)[1:]]
        following.append(getattr(module, "norm", None))
        for layer, norm in zip(layers, following, strict=True):
            fused_layer = getattr(vars(layer).get("forward"), "__func__", None) is _decoder_layer_forward
            fused_norm = getattr(vars(norm).get("forward"), "__func__", None) is _norm_forward if norm else False
            if fused_layer and fused_norm:
                vars(layer)[NEXT_NORM] = norm


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
    def _weigh(xf, inv_rms, w_ptr, cols, real, ROUND: tl.constexpr, ROUND_OUT: tl.constexpr):
        """RMSNorm's output for the columns ``cols`` of a row ``xf`` (float32) given its ``1 / rms``: normalised,
        rounded to the input dtype, times the weight, rounded to the output dtype (torch's eager ops); float32."""
        w = tl.load(w_ptr + cols, mask=real, other=0.0).to(tl.float32)
        return _round(w * _round(xf * inv_rms, ROUND), ROUND_OUT)

    @triton.jit
    def _normalize(xf, w_ptr, cols, real, eps, dim, ROUND: tl.constexpr, ROUND_OUT: tl.constexpr):
        """RMSNorm of one row ``xf`` (float32, zero beyond ``dim``) with weight ``w_ptr``, rounded as torch's
        eager ops round (module docstring); float32, to be stored in the output dtype."""
        inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / dim + eps)
        return _weigh(xf, inv_rms, w_ptr, cols, real, ROUND, ROUND_OUT)

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, w_ptr, out_ptr, eps, dim, heads, stride_token, BLOCK: tl.constexpr, ROUND: tl.constexpr,
        ROUND_OUT: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        real = cols < dim
        src = x_ptr + (row // heads) * stride_token + (row % heads) * dim
        xf = tl.load(src + cols, mask=real, other=0.0).to(tl.float32)
        out = _normalize(xf, w_ptr, cols, real, eps, dim, ROUND, ROUND_OUT)
        tl.store(out_ptr + row * dim + cols, out.to(out_ptr.dtype.element_ty), mask=real)

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr, d_ptr, total_ptr, w_ptr, out_ptr, eps, dim, BLOCK: tl.constexpr, ROUND: tl.constexpr,
        ROUND_OUT: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        real = cols < dim
        x = tl.load(x_ptr + row * dim + cols, mask=real, other=0.0).to(tl.float32)
        d = tl.load(d_ptr + row * dim + cols, mask=real, other=0.0).to(tl.float32)
        total = _round(x + d, ROUND)
        tl.store(total_ptr + row * dim + cols, total.to(total_ptr.dtype.element_ty), mask=real)
        out = _normalize(total, w_ptr, cols, real, eps, dim, ROUND, ROUND_OUT)
        tl.store(out_ptr + row * dim + cols, out.to(out_ptr.dtype.element_ty), mask=real)

    @triton.jit
    def _rotary_kernel(
        q_ptr, k_ptr, cos_ptr, sin_ptr, q_out, k_out, qw_ptr, kw_ptr, eps, hq, dim, stride_q, stride_k, v_ptr,
        stride_v, pk_ptr, pv_ptr, pages_ptr, offsets_ptr, HALF: tl.constexpr, BLOCK: tl.constexpr,
        ROUND: tl.constexpr, NORM: tl.constexpr, STORE: tl.constexpr, PAGE: tl.constexpr,
    ):  # fmt: skip
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        cols = tl.arange(0, BLOCK)
        real = cols < HALF
        if head < hq:
            src = q_ptr + token * stride_q + head * dim
            dst = q_out + (token * hq + head) * dim
            w_ptr = qw_ptr
        else:
            hk = tl.num_programs(1) - hq
            src = k_ptr + token * stride_k + (head - hq) * dim
            dst = k_out + (token * hk + head - hq) * dim
            w_ptr = kw_ptr
        x1 = tl.load(src + cols, mask=real, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + cols, mask=real, other=0.0).to(tl.float32)
        if NORM:  # the head's RMSNorm first, its output rounded to the dtype as the separate norm stores it
            inv_rms = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / dim + eps)
            x1 = _weigh(x1, inv_rms, w_ptr, cols, real, ROUND, ROUND)
            x2 = _weigh(x2, inv_rms, w_ptr, HALF + cols, real, ROUND, ROUND)
        c1 = tl.load(cos_ptr + token * dim + cols, mask=real, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + token * dim + HALF + cols, mask=real, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + token * dim + cols, mask=real, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + token * dim + HALF + cols, mask=real, other=0.0).to(tl.float32)
        # rotate_half(x) = cat(-x2, x1): the first half pairs with -x2, the second with x1.
        lo = _round(_round(x1 * c1, ROUND) + _round(-x2 * s1, ROUND), ROUND)
        hi = _round(_round(x2 * c2, ROUND) + _round(x1 * s2, ROUND), ROUND)
        tl.store(dst + cols, lo.to(q_out.dtype.element_ty), mask=real)
        tl.store(dst + HALF + cols, hi.to(q_out.dtype.element_ty), mask=real)
        if STORE:  # a decoding step: the key head, and the value head beside it, also go to the row's page
            if head >= hq:
                kv = head - hq
                page = tl.load(pages_ptr + token).to(tl.int64)
                slot = ((page * (tl.num_programs(1) - hq) + kv) * PAGE + tl.load(offsets_ptr + token)) * dim
                tl.store(pk_ptr + slot + cols, lo.to(pk_ptr.dtype.element_ty), mask=real)
                tl.store(pk_ptr + slot + HALF + cols, hi.to(pk_ptr.dtype.element_ty), mask=real)
                v_src = v_ptr + token * stride_v + kv * dim
                tl.store(pv_ptr + slot + cols, tl.load(v_src + cols, mask=real), mask=real)
                tl.store(pv_ptr + slot + HALF + cols, tl.load(v_src + HALF + cols, mask=real), mask=real)

    @triton.jit
    def _silu_mul_kernel(gate_up_ptr, out_ptr, n, width, BLOCK: tl.constexpr, ROUND: tl.constexpr):
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        real = at < n
        gate_at = (at // width) * 2 * width + at % width
        g = tl.load(gate_up_ptr + gate_at, mask=real, other=0.0).to(tl.float32)
        u = tl.load(gate_up_ptr + gate_at + width, mask=real, other=0.0).to(tl.float32)
        silu = _round(g / (1.0 + tl.exp(-g)), ROUND)
        tl.store(out_ptr + at, _round(silu * u, ROUND).to(out_ptr.dtype.element_ty), mask=real)
