"""The engine's decode attention (``runtime.engines.decode_attention``) against a float64 attention written row by
row: each sample's query against its group's real prompt keys then its own real response keys; and the engine's
fused Triton norms, MLP and rotary (``runtime.engines.fused``) against transformers' own modules.

The Triton kernel runs on a GPU, or on the CPU in Triton's interpreter: Triton fixes interpreter-or-compiler when
it is imported, so ``test_triton_kernel_under_the_interpreter`` reruns this module in a fresh process with
``TRITON_INTERPRET=1``.
"""

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from suite_tools import run_interpreted

from runtime.engines.decode import engine_attention
from runtime.engines.decode_attention import decode_attention_reference, decode_attention_triton, triton

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _case(seed: int, *, groups, per_group, kv_heads, query_group, width, columns, dk, dv, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    rows = groups * per_group
    return {
        "query": randn(rows, kv_heads * query_group, dk),
        "prefix_k": randn(groups, kv_heads, width, dk),
        "prefix_v": randn(groups, kv_heads, width, dv),
        "prefix_start": torch.randint(0, width, (groups,), generator=gen),
        "resp_k": randn(groups, kv_heads, per_group, columns, dk),
        "resp_v": randn(groups, kv_heads, per_group, columns, dv),
        "resp_len": torch.randint(0, columns + 1, (rows,), generator=gen),
    }


def _paged(case: dict, *, page: int, seed: int = 0) -> dict:
    """The dense ``case`` in the engine's paged layout: the prompt left-padded to whole pages, every page of the
    prompts and responses at a random id of a pool whose other pages (spares, and page 0) hold NaN, so that a read
    of any page the tables do not hand out spoils the output."""
    gen = torch.Generator().manual_seed(seed)
    groups, kv_heads, width, dk = case["prefix_k"].shape
    per_group, columns, dv = case["resp_k"].shape[2], case["resp_k"].shape[3], case["resp_v"].shape[-1]
    rows = groups * per_group
    pb, mb = -(-width // page), -(-columns // page)
    pad = pb * page - width
    total = 1 + groups * pb + rows * mb + 3
    ids = (1 + torch.randperm(total - 1, generator=gen))[: groups * pb + rows * mb].to(torch.int32)
    prefix_pages, resp_pages = ids[: groups * pb].view(groups, pb), ids[groups * pb :].view(rows, mb)
    dtype = case["prefix_k"].dtype
    pools = []
    for prefix, resp, dim in (("prefix_k", "resp_k", dk), ("prefix_v", "resp_v", dv)):
        pool = torch.full((total, kv_heads, page, dim), float("nan"), dtype=dtype)
        dense_prefix = F.pad(case[prefix], (0, 0, pad, 0)).unflatten(2, (pb, page)).transpose(1, 2)
        pool[prefix_pages.long()] = dense_prefix
        dense_resp = F.pad(case[resp].transpose(1, 2).flatten(0, 1), (0, 0, 0, mb * page - columns))
        pool[resp_pages.long()] = dense_resp.unflatten(2, (mb, page)).transpose(1, 2)
        pools.append(pool)
    return {
        "query": case["query"],
        "pool_k": pools[0],
        "pool_v": pools[1],
        "prefix_pages": prefix_pages,
        "prefix_start": case["prefix_start"] + pad,
        "resp_pages": resp_pages,
        "resp_len": case["resp_len"],
    }


def _float64_rows(case: dict, scale: float) -> torch.Tensor:
    """Row by row, head by head, in float64: softmax over the real prompt keys then the real response keys."""
    q = case["query"].double()
    rows, heads, _ = q.shape
    groups, kv_heads = case["prefix_k"].shape[:2]
    per_group = rows // groups
    out = torch.zeros(rows, heads, case["prefix_v"].shape[-1], dtype=torch.float64)
    for s in range(rows):
        g, j = divmod(s, per_group)
        start, length = int(case["prefix_start"][g]), int(case["resp_len"][s])
        for h in range(heads):
            kv = h // (heads // kv_heads)
            keys = torch.cat([case["prefix_k"][g, kv, start:], case["resp_k"][g, kv, j, :length]]).double()
            values = torch.cat([case["prefix_v"][g, kv, start:], case["resp_v"][g, kv, j, :length]]).double()
            out[s, h] = torch.softmax(keys @ q[s, h] * scale, 0) @ values
    return out


SHAPES = st.fixed_dictionaries(
    {
        "groups": st.integers(1, 3),
        "per_group": st.integers(1, 4),
        "kv_heads": st.integers(1, 3),
        "query_group": st.sampled_from([1, 2, 4]),
        "width": st.integers(1, 40),
        "columns": st.integers(1, 70),
        "dk": st.sampled_from([8, 16, 24]),
        "dv": st.sampled_from([8, 16, 20]),
    }
)


@settings(max_examples=30, deadline=None)
@given(shape=SHAPES, seed=st.integers(0, 2**31 - 1))
def test_reference_equals_float64_attention_over_the_real_keys(shape, seed):
    case = _case(seed, **shape)
    paged = _paged(case, page=16, seed=seed)
    # The reference reads every column of the pages it is handed (masking the unreal ones): no NaN pages here.
    for name in ("pool_k", "pool_v"):
        paged[name] = torch.nan_to_num(paged[name], nan=7.0)
    out = decode_attention_reference(**paged, scale=0.4)
    assert out.shape == (shape["groups"] * shape["per_group"], shape["kv_heads"] * shape["query_group"], shape["dv"])
    # float32 scores and sums over at most 110 keys: a few float32 ulps of values of order 1.
    torch.testing.assert_close(out.double(), _float64_rows(case, 0.4), rtol=0, atol=2e-5)


def test_the_engine_attention_output_is_sized_by_the_value_head_dim():
    """MLA models (DeepSeek-V3) have v_head_dim != qk_head_dim: the output's last dim is the values'."""
    query, key, value = torch.randn(2, 4, 1, 24), torch.randn(2, 4, 5, 24), torch.randn(2, 4, 5, 16)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    module = torch.nn.Module()
    out, _ = engine_attention(module, query, key, value, mask, scaling=0.2)
    assert out.shape == (2, 1, 4, 16)
    ref = torch.softmax(query @ key.transpose(-1, -2) * 0.2, -1) @ value
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=0, atol=1e-6)


needs_triton = pytest.mark.skipif(
    triton is None or not (INTERPRETED or torch.cuda.is_available()), reason="needs Triton's interpreter or a GPU"
)


@needs_triton
@pytest.mark.parametrize(
    "shape",
    [
        pytest.param(
            {
                "groups": 2,
                "per_group": 3,
                "kv_heads": 2,
                "query_group": 2,
                "width": 40,
                "columns": 70,
                "dk": 16,
                "dv": 16,
            },
            marks=pytest.mark.slow,  # about 15 s in Triton's interpreter
        ),
        {"groups": 3, "per_group": 1, "kv_heads": 1, "query_group": 4, "width": 5, "columns": 7, "dk": 24, "dv": 20},
        {"groups": 1, "per_group": 8, "kv_heads": 2, "query_group": 2, "width": 3, "columns": 33, "dk": 16, "dv": 32},
    ],
)
def test_triton_kernel_equals_the_reference(shape):
    device = "cpu" if INTERPRETED else "cuda"
    case = {k: v.to(device) for k, v in _paged(_case(11, **shape), page=16).items()}
    # Parts of 32 columns in pages of 16, so that the prompt and the responses span several parts and pages.
    got = decode_attention_triton(**case, scale=0.35, chunk=32)
    torch.testing.assert_close(got.double().cpu(), _float64_rows(_case(11, **shape), 0.35), rtol=0, atol=2e-5)


@needs_triton
def test_triton_kernel_never_reads_padding_or_unwritten_columns():
    """NaN in the prompt's padding columns, in every row's columns at or beyond its length and in every page the
    tables do not hand out change nothing: the kernel reads only the real columns of its own pages (the
    reference's masked_fill would let 0 * NaN through)."""
    device = "cpu" if INTERPRETED else "cuda"
    case = _case(3, groups=2, per_group=3, kv_heads=2, query_group=2, width=9, columns=40, dk=16, dv=16)
    spoiled = {k: v.clone() for k, v in case.items()}
    for g in range(2):
        spoiled["prefix_k"][g, :, : int(case["prefix_start"][g])] = float("nan")
        spoiled["prefix_v"][g, :, : int(case["prefix_start"][g])] = float("nan")
    for s in range(6):
        g, j = divmod(s, 3)
        spoiled["resp_k"][g, :, j, int(case["resp_len"][s]) :] = float("nan")
        spoiled["resp_v"][g, :, j, int(case["resp_len"][s]) :] = float("nan")
    paged = _paged(spoiled, page=16, seed=4)
    got = decode_attention_triton(**{k: v.to(device) for k, v in paged.items()}, scale=0.3, chunk=32)
    torch.testing.assert_close(got.double().cpu(), _float64_rows(case, 0.3), rtol=0, atol=2e-5)


@needs_triton
def test_triton_kernel_stores_each_rows_key_and_value_at_its_page_and_offset():
    """The one-kernel store against torch's indexed assignment: rows' keys (a strided view, as the projection
    leaves them) and values land at their (page, offset), MLA-like head dims (Dk != Dv, not powers of two), and
    nothing else in the pools changes (they start as NaN)."""
    from runtime.engines.decode_attention import store_decode_kv_torch, store_decode_kv_triton

    device = "cpu" if INTERPRETED else "cuda"
    gen = torch.Generator().manual_seed(9)
    rows, kv_heads, page, dk, dv = 5, 2, 16, 24, 20
    pool_k = torch.full((7, kv_heads, page, dk), float("nan"))
    pool_v = torch.full((7, kv_heads, page, dv), float("nan"))
    key = torch.randn(rows, kv_heads, 2 * dk, generator=gen)[..., :dk]
    value = torch.randn(rows, kv_heads, dv, generator=gen)
    pages = torch.tensor([3, 1, 6, 3, 2])
    offsets = torch.tensor([0, 15, 7, 9, 4])
    want_k, want_v = pool_k.clone(), pool_v.clone()
    store_decode_kv_torch(want_k, want_v, key, value, pages, offsets)
    got_k, got_v = pool_k.to(device), pool_v.to(device)
    store_decode_kv_triton(got_k, got_v, key.to(device), value.to(device), pages.to(device), offsets.to(device))
    torch.testing.assert_close(got_k.cpu(), want_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got_v.cpu(), want_v, rtol=0, atol=0, equal_nan=True)
    assert int((~want_k.isnan()).sum()) == rows * kv_heads * dk


@needs_triton
def test_triton_kernel_rotary_stores_the_decode_keys_and_values_in_their_pages():
    """With ``store``, the rotary kernel writes each row's rotated (and q/k-normed) key and its value to its page and
    offset, exactly what rotary without it followed by the torch store writes, and nothing else (NaN elsewhere
    stays); its query and key outputs do not change. The key and value are views of one merged projection."""
    from runtime.engines.decode_attention import store_decode_kv_torch
    from runtime.engines.fused import rotary

    device = "cpu" if INTERPRETED else "cuda"
    gen = torch.Generator().manual_seed(5)
    rows, hq, hk, dim, page = 5, 4, 2, 16, 8
    merged = torch.randn(rows, 1, (hq + 2 * hk) * dim, generator=gen).to(device)
    q, k, v = (t.view(rows, 1, -1, dim) for t in merged.split([hq * dim, hk * dim, hk * dim], dim=-1))
    cos, sin = torch.randn(2, rows, 1, dim, generator=gen).to(device)
    norms = (torch.randn(dim, generator=gen).to(device), torch.randn(dim, generator=gen).to(device), 1e-6)
    pages, offsets = torch.tensor([3, 1, 6, 3, 2], device=device), torch.tensor([0, 7, 5, 2, 4], device=device)
    pool_k = torch.full((7, hk, page, dim), float("nan"), device=device)
    pool_v = pool_k.clone()
    want_k, want_v = pool_k.clone(), pool_v.clone()
    plain_q, plain_k = rotary(q, k, cos, sin, norms=norms)
    store_decode_kv_torch(want_k, want_v, plain_k[:, 0], v[:, 0], pages, offsets)
    got_q, got_k = rotary(q, k, cos, sin, norms=norms, store=(v, pool_k, pool_v, pages, offsets))
    assert torch.equal(got_q, plain_q) and torch.equal(got_k, plain_k)
    torch.testing.assert_close(pool_k, want_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(pool_v, want_v, rtol=0, atol=0, equal_nan=True)
    assert int((~want_k.isnan()).sum()) == rows * hk * dim


def _tiny(family: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    from runtime.engines.decode import ATTENTION, register_attention

    sizes = {"vocab_size": 50, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2}
    heads = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    config = {"qwen3": Qwen3Config, "llama": LlamaConfig}[family](**sizes, **heads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    register_attention()
    model.set_attn_implementation(ATTENTION)
    return model


@needs_triton
@pytest.mark.parametrize("family", [pytest.param("qwen3", marks=pytest.mark.slow), "llama"])  # qwen3: 30 s interpreted
def test_triton_kernel_fused_model_computes_what_the_hf_modules_compute(family):
    """Every norm, MLP, attention and decoder layer of the model fused (15 modules in two Qwen3 layers: four norms,
    the MLP, the attention and the layer itself per layer, and the final norm), each layer's last residual add and
    the norm after it one kernel; logits with and without a transformers cache equal the HF forward's to float32
    rounding, and fusing off again restores the HF forwards."""
    from runtime.engines import fused as fused_module
    from runtime.engines.fused import fuse_model

    device = "cpu" if INTERPRETED else "cuda"
    model = _tiny(family).to(device)
    ids = torch.randint(0, 50, (2, 4), device=device)
    plain_norms = []
    real_rms_norm = fused_module.rms_norm
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
        fused_count = fuse_model(model)
        fused_module.rms_norm = lambda x, *a: plain_norms.append(x.shape) or real_rms_norm(x, *a)
        try:
            fused = model(input_ids=ids, use_cache=False).logits
        finally:
            fused_module.rms_norm = real_rms_norm
        cached = model(input_ids=ids).logits  # through a DynamicCache, as generate() runs
        assert fuse_model(model, on=False) == fused_count
        assert not any("forward" in vars(m) for m in model.modules())
    assert fused_count == (15 if family == "qwen3" else 11)
    # Only the first layer's input norm runs alone: every later norm runs in the residual add before it.
    assert plain_norms == [(2, 4, 64)]
    torch.testing.assert_close(fused, plain, rtol=0, atol=1e-5)
    torch.testing.assert_close(cached, plain, rtol=0, atol=1e-5)


@pytest.mark.slow  # about 30 s in Triton's interpreter
@needs_triton
def test_triton_kernel_fused_engine_decodes_the_hf_modules_tokens():
    """decode() with the fused model draws the tokens the HF modules draw (float32; log-probs to rounding)."""
    from runtime.engines.decode import decode
    from runtime.engines.fused import fuse_model

    device = "cpu" if INTERPRETED else "cuda"
    model = _tiny("qwen3").to(device)
    ids = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11], [8, 9, 10, 11]], device=device)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]], device=device)
    kw = {"max_new_tokens": 6, "temperature": 0.9, "top_k": -1, "top_p": 1.0, "stop_ids": [], "pad_id": 0}
    kw |= {"seeds": [1, 2, 3], "cuda_graph": False, "kernel": "torch"}
    plain = decode(model, ids, mask, **kw)
    fuse_model(model)
    fused = decode(model, ids, mask, **kw)
    for a, b in zip(plain.tokens, fused.tokens, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(plain.log_probs, fused.log_probs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@needs_triton
def test_triton_kernel_fused_ops_round_as_torch_does_in_bf16():
    """bf16 in, bf16 out: rotary, RMSNorm (alone and after a residual add) and SiLU x up equal torch's eager ops
    (rounded where they round); the norms and the SiLU may differ by one bf16 step in rare elements (float32
    summation order, Triton's fast exp/rsqrt)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    from runtime.engines.fused import add_rms_norm, rms_norm, rotary, silu_mul

    device = "cpu" if INTERPRETED else "cuda"
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).bfloat16().to(device)

    q, k, cos, sin = randn(2, 3, 4, 16), randn(2, 3, 2, 16), randn(2, 3, 16), randn(2, 3, 16)
    rq, rk = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    fq, fk = rotary(q, k, cos, sin)
    assert torch.equal(fq, rq.transpose(1, 2)) and torch.equal(fk, rk.transpose(1, 2))
    norm = Qwen3RMSNorm(64, eps=1e-6).bfloat16().to(device)
    norm.weight.data = randn(64, scale=0.3) + 1
    x, gate_up, delta = randn(6, 64, scale=2.0), randn(4, 200, scale=3.0), randn(6, 64)
    gate, up = gate_up.chunk(2, dim=-1)
    total, normed = add_rms_norm(x, delta, norm.weight, 1e-6)
    assert torch.equal(total, x + delta)  # one float32 add rounded to bf16, as torch's
    pairs = (
        (rms_norm(x, norm.weight, 1e-6), norm(x)),
        (silu_mul(gate_up), F.silu(gate) * up),
        (normed, norm(x + delta)),
    )
    for got, want in pairs:
        step = torch.exp2(torch.floor(torch.log2(want.float().abs().clamp(min=1e-30))) - 7)  # one bf16 step
        assert (got == want).float().mean() > 0.99 and bool(((got.float() - want.float()).abs() <= step).all())
    _check_norm_rotary(randn, device)


def _check_norm_rotary(randn, device: str) -> None:
    """Qwen3's q/k norms fused into the rotary kernel against the norm modules then transformers' rotary, in bf16:
    the norm's 1/rms sums the squares in another float32 order, which moves a normalised element by one bf16 step
    in rare elements; through a rotation (|cos|, |sin| <= 1) that is at most two steps of the head's largest
    normalised value, plus the output's own rounding."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    from runtime.engines.fused import rotary

    q, k = randn(3, 5, 4, 64, scale=2.0), randn(3, 5, 2, 64)
    angles = randn(3, 5, 64, scale=3.0).float()
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    norms = [Qwen3RMSNorm(64, eps=1e-6).bfloat16().to(device) for _ in range(2)]
    for norm in norms:
        norm.weight.data = randn(64, scale=0.3) + 1
    nq, nk = norms[0](q), norms[1](k)
    want_q, want_k = apply_rotary_pos_emb(nq.transpose(1, 2), nk.transpose(1, 2), cos, sin)
    got_q, got_k = rotary(q, k, cos, sin, norms=(norms[0].weight, norms[1].weight, 1e-6))
    for got, want, normed in ((got_q, want_q.transpose(1, 2), nq), (got_k, want_k.transpose(1, 2), nk)):
        top = normed.float().abs().amax(-1, keepdim=True)
        step = torch.exp2(torch.floor(torch.log2(top.clamp(min=1e-30))) - 7)
        assert (got == want).float().mean() > 0.98
        assert bool(((got.float() - want.float()).abs() <= 3 * step).all())


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_plain_sampling_draws_the_inverse_cdf_token(dtype):
    """The one-kernel plain sampler against a float64 inverse CDF over 1000 tokens in blocks of 128: the same token
    wherever the uniform's target is farther than float32 rounding from a boundary between two tokens, the
    untruncated log-prob to float32 rounding, and never a token of probability zero (logit -inf), even for uniforms
    next to 0 and 1."""
    from runtime.engines.sampling import plain_sample_triton

    device = "cpu" if INTERPRETED else "cuda"
    gen = torch.Generator().manual_seed(5)
    rows, vocab, temperature = 48, 1000, 0.7
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    logits[:, torch.randperm(vocab, generator=gen)[:300]] = float("-inf")
    logits[0, :-1] = float("-inf")  # one token left
    uniforms = torch.rand(rows, generator=gen)
    uniforms[1:4] = torch.tensor([0.0, 1 - 2**-24, 0.5])
    tokens, log_probs = plain_sample_triton(logits.to(device), uniforms.to(device), temperature=temperature, block=128)
    tokens, log_probs = tokens.cpu(), log_probs.cpu()
    scaled = logits.double() / temperature
    probs = torch.softmax(scaled, -1)
    cdf = probs.cumsum(-1)
    target = uniforms.double() * cdf[:, -1]
    want = ((cdf > target[:, None]) & (probs > 0)).int().argmax(-1)
    # A float32 running sum of 1000 terms of total 1 is within 1000 x float32 epsilon (6e-5) of float64's.
    clear = ((cdf - target[:, None]).abs() > 6e-5).all(-1)
    assert clear.sum() > rows // 2
    assert torch.equal(tokens[clear], want[clear])
    assert bool((logits.gather(1, tokens[:, None]) > float("-inf")).all())
    want_lp = torch.log_softmax(scaled, -1).gather(1, tokens[:, None])[:, 0]
    # float32 log-softmax of values of order 10: a few float32 ulps.
    torch.testing.assert_close(log_probs.double(), want_lp, rtol=0, atol=1e-5)
    assert int(tokens[0]) == vocab - 1


@pytest.mark.skipif(INTERPRETED or triton is None, reason="this process already runs interpreted, or no Triton")
def test_triton_kernel_under_the_interpreter():
    select = "triton_kernel and not under_the_interpreter"  # (this test is skipped in an interpreted process)
    run_interpreted(Path(__file__).name, select=select, expect_passed=9, timeout=600)


@pytest.mark.skipif(triton is None, reason="fuse_model needs Triton")
def test_merged_projections_follow_every_weight_update(tmp_path):
    """fuse_model runs q/k/v and gate/up as one matmul each over one merged tensor; the engine's update paths write
    the modules' parameters, which are views of it, so after a weight update the merged weights are the new ones
    (a merge that copied the weights instead would keep sampling the old ones); unfusing drops the merged tensors."""
    from runtime.demo import task
    from runtime.demo.tiny_model import make_tiny_model
    from runtime.engines import HFEngine
    from runtime.engines.fused import fuse_model

    engine = HFEngine(str(make_tiny_model(tmp_path / "m", alphabet=task.ALPHABET, seed=0)), seed=0)
    layers = engine.model.model.layers
    assert fuse_model(engine.model) > 0
    gen = torch.Generator().manual_seed(1)
    new = {name: torch.randn(t.shape, generator=gen) for name, t in engine.get_weights().items()}
    engine.load_weights(new, weight_version=1)

    def same(got: torch.Tensor, sent: torch.Tensor) -> bool:
        """On a GPU the engine holds bf16 on the device: the update is the sent tensor cast to it, exactly."""
        return torch.equal(got.cpu(), sent.to(got.dtype))

    for i, layer in enumerate(layers):
        at = f"model.layers.{i}."
        weight, bias, sizes = layer.self_attn._rlcore_merged
        want = torch.cat([new[at + f"self_attn.{p}_proj.weight"] for p in "qkv"])
        assert same(weight, want) and sizes == tuple(len(new[at + f"self_attn.{p}_proj.weight"]) for p in "qkv")
        weight, _, _ = layer.mlp._rlcore_merged
        assert same(weight, torch.cat([new[at + "mlp.gate_proj.weight"], new[at + "mlp.up_proj.weight"]]))
        assert layer.mlp.up_proj.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    assert all(same(v, new[k]) for k, v in engine.get_weights().items() if ".layers." in k)  # untied ones
    fuse_model(engine.model, on=False)
    assert not any("_rlcore_merged" in vars(m) for m in engine.model.modules())


def test_a_merged_projection_with_biases_computes_each_projection():
    """Qwen2's q/k/v carry biases: merged, one matmul over the merged weight and bias gives each projection's output
    (float32: the same dot products, summed in the order a wider matmul picks: float32 rounding of values of order 1),
    and every parameter, bias included, is a view of the merged tensors."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from runtime.engines.fused import merge_projections

    config = Qwen2Config(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    attention = AutoModelForCausalLM.from_config(config).model.layers[0].self_attn
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        separate = [getattr(attention, f"{p}_proj")(x) for p in "qkv"]
        weight, bias, sizes = merge_projections(attention, ("q_proj", "k_proj", "v_proj"))
        merged = F.linear(x, weight, bias).split(sizes, dim=-1)
    assert bias is not None and sizes == (64, 32, 32)
    for got, want in zip(merged, separate, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for p in "qkv":
        for param, whole in (
            (attention.get_submodule(f"{p}_proj").weight, weight),
            (attention.get_submodule(f"{p}_proj").bias, bias),
        ):
            assert param.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
