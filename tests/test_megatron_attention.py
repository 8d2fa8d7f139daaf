"""The Megatron backend's SDPA core attention against megatron-core's unfused ``DotProductAttention`` on the CPU.

Module level: same outputs and input gradients on random inputs (float32 and float64, grouped-query and multi-head,
causal and explicit masks, query-key layer scaling). Trainer level: a tiny Llama and Qwen3 give the same log-probs,
loss and gradient norm with ``--attention-backend auto`` (SDPA) and ``local`` (unfused), also under selective
(core-attention) recompute.
"""

from __future__ import annotations

import socket

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("megatron.core")

from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from test_megatron_backend import LOGP_TOL, job, make_batch, save_model, train_once, trainer  # noqa: E402

from rlcore import keys  # noqa: E402
from runtime.config import ConfigError, validate  # noqa: E402
from runtime.train.backends.megatron_attention import (  # noqa: E402
    ATTENTION_IMPLEMENTATIONS,
    SDPADotProductAttention,
    causal_attention_mask,
    local_layer_spec,
    sdpa_core_attention,
)
from runtime.train.backends.megatron_build import _cpu_shims  # noqa: E402
from runtime.train.roles import ACTOR, REFERENCE  # noqa: E402

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-13)}


@pytest.fixture(scope="module")
def model_parallel():
    """One gloo rank with megatron-core's parallel state (TP=1), as DotProductAttention needs."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    try:
        with _cpu_shims():
            yield
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def transformer_config(*, heads: int, groups: int, head_dim: int, dtype: torch.dtype, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=4,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        params_dtype=dtype,
        use_cpu_initialization=True,
        masked_softmax_fusion=False,
        attention_softmax_in_fp32=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        **overrides,
    )


def pair(config, *, layer_number: int = 1):
    kw = dict(layer_number=layer_number, attn_mask_type=AttnMaskType.causal, attention_type="self")
    return DotProductAttention(config, **kw), SDPADotProductAttention(config, **kw)


def qkv(*, seq: int, batch: int, heads: int, groups: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(seq, batch, heads, head_dim, generator=gen, dtype=dtype).requires_grad_()
    k = torch.randn(seq, batch, groups, head_dim, generator=gen, dtype=dtype).requires_grad_()
    v = torch.randn(seq, batch, groups, head_dim, generator=gen, dtype=dtype).requires_grad_()
    return q, k, v


def causal(seq: int) -> torch.Tensor:
    return torch.ones(seq, seq, dtype=torch.bool).triu(1)[None, None]


def output_and_grads(module, q, k, v, mask):
    out = module(q, k, v, mask)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    return out, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (6, 1)])
def test_sdpa_equals_unfused_attention_causal(model_parallel, dtype, heads, groups):
    config = transformer_config(heads=heads, groups=groups, head_dim=16, dtype=dtype)
    unfused, sdpa = pair(config)
    q, k, v = qkv(seq=13, batch=3, heads=heads, groups=groups, head_dim=16, dtype=dtype)
    want, want_grads = output_and_grads(unfused, q, k, v, causal(13))
    assert want.shape == (13, 3, heads * 16)
    # Without a mask the SDPA attention masks causally itself (the backend's default path); with Megatron's
    # explicit causal mask it applies that mask.
    for mask in (None, causal(13)):
        got, grads = output_and_grads(sdpa, q, k, v, mask)
        torch.testing.assert_close(got, want, **TOL[dtype])
        for g, w in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(g, w, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sdpa_applies_an_explicit_mask_as_megatron_does(model_parallel, dtype):
    """A causal mask with padding keys masked out too (no row masked everywhere): the same mask, the same output."""
    config = transformer_config(heads=4, groups=2, head_dim=8, dtype=dtype)
    unfused, sdpa = pair(config)
    q, k, v = qkv(seq=9, batch=2, heads=4, groups=2, head_dim=8, dtype=dtype, seed=1)
    mask = causal(9).repeat(2, 1, 1, 1)
    mask[0, :, :, 6:] = True  # row 0: keys 6.. are padding
    mask[0, :, 6:, 0] = False  # the padding queries keep one key, as a left-most real token
    want, want_grads = output_and_grads(unfused, q, k, v, mask)
    got, grads = output_and_grads(sdpa, q, k, v, mask)
    torch.testing.assert_close(got, want, **TOL[dtype])
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, **TOL[dtype])


def test_query_key_layer_scaling_keeps_the_scale(model_parallel):
    """Megatron divides the scale by the layer number and its softmax multiplies it back; so does the SDPA module."""
    config = transformer_config(
        heads=4, groups=4, head_dim=8, dtype=torch.float32, apply_query_key_layer_scaling=True, fp16=True
    )
    unfused, sdpa = pair(config, layer_number=3)
    assert sdpa.softmax_scale == pytest.approx(8**-0.5 / 3)
    q, k, v = qkv(seq=7, batch=2, heads=4, groups=4, head_dim=8, dtype=torch.float32, seed=2)
    # Megatron's fp16 softmax returns half precision: compare against float32 SDPA at half's resolution.
    want = unfused(q.half(), k.half(), v.half(), causal(7)).float()
    got = sdpa(q, k, v, None)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


def test_native_and_repeated_grouped_heads_agree():
    q, k, v = qkv(seq=11, batch=2, heads=6, groups=2, head_dim=8, dtype=torch.float64, seed=3)
    native = sdpa_core_attention(q, k, v, scale=0.3, causal=True, native_gqa=True)
    repeated = sdpa_core_attention(q, k, v, scale=0.3, causal=True, native_gqa=False)
    torch.testing.assert_close(native, repeated, rtol=1e-12, atol=1e-13)


@settings(max_examples=25, deadline=None)
@given(
    seq=st.integers(2, 12),
    groups=st.sampled_from([1, 2, 4]),
    cut=st.integers(1, 11),
    seed=st.integers(0, 2**16),
)
def test_causal_attention_never_reads_later_tokens(seq, groups, cut, seed):
    """Changing the keys and values after position ``cut`` changes no output at or before it (right padding is
    invisible to real tokens)."""
    cut = min(cut, seq - 1)
    q, k, v = (t.detach() for t in qkv(seq=seq, batch=2, heads=4, groups=groups, head_dim=4, dtype=torch.float64))
    out = sdpa_core_attention(q, k, v, scale=0.5, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[cut:] = torch.randn_like(k2[cut:]) * 10
    v2[cut:] = torch.randn_like(v2[cut:]) * 10
    out2 = sdpa_core_attention(q, k2, v2, scale=0.5, causal=True)
    torch.testing.assert_close(out2[:cut], out[:cut], rtol=1e-12, atol=1e-13)


def test_bad_inputs_are_refused(model_parallel):
    q, k, v = (t.detach() for t in qkv(seq=5, batch=1, heads=4, groups=3, head_dim=4, dtype=torch.float32))
    with pytest.raises(ValueError, match="np % ng must be 0"):
        sdpa_core_attention(q, k, v, scale=1.0, causal=True)
    q, k, v = (t.detach() for t in qkv(seq=5, batch=1, heads=4, groups=2, head_dim=4, dtype=torch.float32))
    with pytest.raises(ValueError, match="mask must be bool"):
        sdpa_core_attention(q, k, v, scale=1.0, causal=True, mask=causal(5).float())
    with pytest.raises(ValueError, match="attention dropout 0.1"):
        SDPADotProductAttention(
            transformer_config(heads=4, groups=2, head_dim=4, dtype=torch.float32),
            layer_number=1,
            attn_mask_type=AttnMaskType.causal,
            attention_type="self",
            attention_dropout=0.1,
        )


def test_layer_spec_and_mask_follow_the_attention_backend():
    for name, implementation in ATTENTION_IMPLEMENTATIONS.items():
        spec = local_layer_spec(attention_backend=name, qk_layernorm=True, normalization="RMSNorm")
        core = spec.submodules.self_attention.submodules.core_attention
        mask = causal_attention_mask(5, attention_backend=name, device=torch.device("cpu"))
        if implementation == "sdpa":
            assert core is SDPADotProductAttention and mask is None
        else:
            assert core is DotProductAttention and torch.equal(mask, causal(5))
    with pytest.raises(ValueError, match="--attention-backend 'fused'"):
        local_layer_spec(attention_backend="fused", qk_layernorm=False, normalization="RMSNorm")


def test_config_takes_the_attention_backend(tmp_path):
    assert job(tmp_path).train.attention_backend == "auto"
    assert job(tmp_path, attention_backend="local").train.attention_backend == "local"
    # Megatron's fused (Transformer Engine) attention is not one of the choices.
    with pytest.raises(ConfigError, match="--attention-backend fused: fused is Transformer Engine's cuDNN attention"):
        validate(job(tmp_path, attention_backend="fused", train_backend="megatron"))
    with pytest.raises(ConfigError, match="--attention-backend: a Megatron flag, used by --train-backend megatron"):
        validate(job(tmp_path, attention_backend="local", train_backend="torch"))


RECOMPUTE = {
    None: {},
    "selective": dict(recompute_granularity="selective"),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


@pytest.mark.parametrize("model_type,recompute", [("llama", None), ("qwen3", None), ("qwen3", "selective")])
def test_trainer_gives_the_same_log_probs_loss_and_grad_norm_with_either_attention(model_type, recompute, tmp_path):
    path = save_model(model_type, tmp_path / model_type, num_attention_heads=4, num_key_value_heads=2)
    td = make_batch(203)
    mask = td[keys.MASK]
    results = {}
    for backend in ("auto", "local"):
        cfg = job(tmp_path, train_backend="megatron", attention_backend=backend, **RECOMPUTE[recompute])
        mega = trainer("megatron", path, cfg, roles=(ACTOR, REFERENCE))
        try:
            cores = {type(m) for m in mega.model.modules() if isinstance(m, DotProductAttention)}
            assert cores == {SDPADotProductAttention if backend == "auto" else DotProductAttention}
            log_probs = mega.compute_log_probs(td)
            metrics = train_once(mega, cfg, td)
            results[backend] = (log_probs, metrics, mega.get_weights())
        finally:
            mega.shutdown()
    (lp_sdpa, m_sdpa, w_sdpa), (lp_local, m_local, w_local) = results["auto"], results["local"]
    for key in (keys.OLD_LOG_PROBS, keys.REF_LOG_PROBS):
        torch.testing.assert_close(lp_sdpa[key][mask], lp_local[key][mask], **LOGP_TOL)
    for name in ("loss", "pg_loss", "entropy_loss", "kl_loss"):
        assert m_sdpa[name] == pytest.approx(m_local[name], rel=1e-5, abs=1e-7), name
    assert m_sdpa["grad_norm"] == pytest.approx(m_local["grad_norm"], rel=1e-5)
    for name, value in w_sdpa.items():
        torch.testing.assert_close(value, w_local[name], rtol=0, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_recompute_runs_in_training_steps_and_changes_nothing(tmp_path):
    """--recompute-granularity selective and full run the core attention again in the backward (twice per layer and
    micro-batch in a training step, once in a log-prob pass) and give the same loss, gradient norm and weights."""
    path = save_model("qwen3", tmp_path / "qwen3", num_attention_heads=4, num_key_value_heads=2)
    td = make_batch(203)
    results = {}
    for recompute, settings_ in RECOMPUTE.items():
        cfg = job(tmp_path, train_backend="megatron", **settings_)
        mega = trainer("megatron", path, cfg, roles=(ACTOR, REFERENCE))
        calls = []
        try:
            for module in mega.model.modules():
                if isinstance(module, SDPADotProductAttention):
                    module.register_forward_hook(lambda *_, calls=calls: calls.append(1))
            micro_batches = len(mega._micro_batches(td))
            metrics = train_once(mega, cfg, td)
            layers = mega.shape.num_layers
            assert len(calls) == layers * micro_batches * (1 + (2 if recompute else 1)), recompute
            results[recompute] = (metrics, mega.get_weights())
        finally:
            mega.shutdown()
    want_metrics, want_weights = results[None]
    for recompute in ("selective", "full"):
        metrics, weights = results[recompute]
        assert metrics["loss"] == pytest.approx(want_metrics["loss"], rel=1e-6), recompute
        assert metrics["grad_norm"] == pytest.approx(want_metrics["grad_norm"], rel=1e-6), recompute
        for name, value in weights.items():
            torch.testing.assert_close(value, want_weights[name], rtol=0, atol=1e-6)


def test_bf16_logits_stay_bf16_and_give_the_float32_cast_log_probs(tmp_path):
    """Under bf16 the logits reach rlcore's log-prob kernel in bf16 (no float32 copy from Megatron's Float16Module):
    the log-probs equal those of the same logits cast to float32, within one bf16 rounding of the logits."""
    from rlcore.kernels import logprobs_entropy
    from runtime.train.batch import PROMPT_LENGTHS, RESPONSE_TOKENS

    path = save_model("qwen3", tmp_path / "qwen3", num_attention_heads=4, num_key_value_heads=2)
    td = make_batch(203)
    cfg = job(tmp_path, train_backend="megatron", bf16="true")
    mega = trainer("megatron", path, cfg, roles=(ACTOR,))
    try:
        got = mega.compute_log_probs(td)[keys.OLD_LOG_PROBS]
        with torch.no_grad(), _cpu_shims():
            logits = mega._logits(mega.model, td)
            tokens, positions, mask = mega._inputs(td)
            fp32_logits = mega.model(input_ids=tokens, position_ids=positions, attention_mask=mask)
    finally:
        mega.shutdown()
    assert logits.dtype == torch.bfloat16 and fp32_logits.dtype == torch.float32
    torch.testing.assert_close(fp32_logits, logits.float(), rtol=0, atol=0)
    response = td[RESPONSE_TOKENS]
    at = (td[PROMPT_LENGTHS][:, None] - 1 + torch.arange(response.shape[1])).clamp(max=logits.shape[1] - 1)
    # Megatron pads the vocabulary (203 -> 256 columns); the padding columns are no tokens.
    picked = fp32_logits[..., :203].gather(1, at[..., None].expand(-1, -1, 203))
    want, _ = logprobs_entropy(picked.reshape(-1, 203), response.reshape(-1), temperature=0.9, with_entropy=False)
    mask = td[keys.MASK]
    # compute_log_probs runs the batch as micro-batches of other shapes than the whole-batch forward above, and a CPU's
    # bf16 matmul (oneDNN) picks its blocking by shape and instruction set: a logit may land one bf16 rounding
    # (relative 2**-8) apart. A log-softmax moves by at most twice its inputs' largest change, over the temperature.
    atol = 2 * 2**-8 * fp32_logits[..., :203].abs().max().item() / 0.9
    torch.testing.assert_close(got[mask], want.view(response.shape)[mask], rtol=0, atol=atol)


def test_sdpa_at_tp2_equals_unfused_at_tp1(tmp_path, gloo_ranks):
    """Two gloo ranks split the heads (4 query heads, 2 key/value groups: one group each) and run the SDPA attention:
    their log-probs, loss and gradient norm equal one rank's with Megatron's unfused attention."""
    from test_megatron_backend import _free_port, _tp_worker

    path = save_model("qwen3", tmp_path / "m", num_attention_heads=4, num_key_value_heads=2)
    out = str(tmp_path / "tp2.pt")
    gloo_ranks.run(_tp_worker, 2, _free_port(), path, tmp_path, out)
    tp2 = torch.load(out, weights_only=False)
    cfg = job(tmp_path, train_backend="megatron", attention_backend="local")
    one = trainer("megatron", path, cfg)
    try:
        td = make_batch(203)
        mask = td[keys.MASK]
        log_probs = one.compute_log_probs(td)
        metrics = train_once(one, cfg, td)
    finally:
        one.shutdown()
    torch.testing.assert_close(
        tp2["log_probs"][keys.OLD_LOG_PROBS][mask], log_probs[keys.OLD_LOG_PROBS][mask], **LOGP_TOL
    )
    assert tp2["metrics"]["loss"] == pytest.approx(metrics["loss"], rel=1e-4, abs=1e-6)
    assert tp2["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-4)
