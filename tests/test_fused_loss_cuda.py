"""linear_rl_loss compiled on a CUDA GPU: against the float64 reference in float32, and fused vs unfused in bf16.

Skipped without CUDA (CI has none; ``test_fused_loss.py`` runs the same op there through Triton's interpreter).
"""

import pytest
import torch
from tensordict import TensorDict

from rlcore import keys
from rlcore.kernels import linear_logprobs_entropy, linear_rl_loss, logprobs_entropy, reference
from rlcore.losses import LossConfig, rl_loss

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# The stated bf16 tolerance of fused vs unfused: both round logits and d(logits) to bf16 and differ only in the
# order of accumulation (row chunks here, vocabulary pieces there, and the weight gradient rounded once per chunk),
# so the loss agrees within 1e-3 relative and each gradient's norm within 1e-2 relative.
BF16_LOSS_RTOL = 1e-3
BF16_GRAD_NORM_RTOL = 1e-2

CONFIGS = {
    "ppo+tis+low_var_kl+entropy": LossConfig(
        eps_clip_high=0.28,
        use_tis=True,
        use_kl_loss=True,
        kl_loss_coef=0.05,
        kl_loss_type="low_var_kl",
        entropy_coef=0.01,
    ),
    "gspo+seq_mean_token_mean": LossConfig(
        policy_loss="gspo", eps_clip=3e-3, eps_clip_high=4e-3, loss_agg_mode="seq_mean_token_mean"
    ),
    "cispo+icepop+unbiased_k3": LossConfig(
        policy_loss="cispo",
        eps_clip_high=0.2,
        use_tis=True,
        tis_mode="icepop",
        tis_level="geometric",
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_loss_type="k3",
        use_unbiased_kl=True,
        loss_agg_mode="seq_mean_token_sum_norm",
    ),
}


def make_case(batch, seq_len, hidden_size, vocab, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(batch * seq_len, hidden_size, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=gen) * 3 / hidden_size**0.5).to(dtype)
    targets = torch.randint(0, vocab, (batch * seq_len,), device="cuda", generator=gen)
    mask = torch.rand(batch, seq_len, device="cuda", generator=gen) < 0.85
    mask[0, 0] = True
    with torch.no_grad():
        lp = reference.linear_logprobs_entropy(hidden.double(), weight.double(), targets)[0].float()
    lp = lp.view(batch, seq_len)

    def near(scale):
        return lp + scale * torch.randn(batch, seq_len, device="cuda", generator=gen)

    td = TensorDict(
        {
            keys.MASK: mask,
            keys.ADVANTAGES: torch.randn(batch, seq_len, device="cuda", generator=gen),
            keys.OLD_LOG_PROBS: near(0.2),
            keys.ROLLOUT_LOG_PROBS: near(0.3),
            keys.REF_LOG_PROBS: near(0.5),
        },
        batch_size=[batch],
    )
    return hidden, weight, targets, td


def run_fused(hidden, weight, targets, td, cfg, **kwargs):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, metrics = linear_rl_loss(h, w, targets, td, cfg, **kwargs)
    loss.backward()
    return loss.detach(), metrics, h.grad, w.grad


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize(("batch", "seq_len", "vocab", "chunk_rows"), [(4, 33, 5003, 40), (2, 300, 32007, 128)])
def test_cuda_float32_matches_float64_reference(name, batch, seq_len, vocab, chunk_rows):
    """float32 on the GPU against float64: the matmuls run in true float32 (TF32 off), so errors are float32's."""
    cfg = CONFIGS[name]
    hidden, weight, targets, td = make_case(batch, seq_len, 64, vocab, torch.float32, seed=vocab + batch)
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        loss, metrics, grad_h, grad_w = run_fused(hidden, weight, targets, td, cfg, chunk_bytes=chunk_rows * vocab * 4)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref_loss, ref_metrics = reference.linear_rl_loss(h64, w64, targets, td, cfg)
    ref_loss.backward()
    torch.testing.assert_close(loss.double(), ref_loss.detach(), rtol=1e-4, atol=1e-5)
    for key in ("pg_loss", "clipfrac", "entropy", "ratio_mean"):
        torch.testing.assert_close(metrics[key].double(), ref_metrics[key].double(), rtol=1e-4, atol=1e-5)
    for actual, expected in ((grad_h, h64.grad), (grad_w, w64.grad)):
        torch.testing.assert_close(actual.double(), expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize(
    "options", [{}, {"grad_weight_dtype": torch.float32}, {"float32_logits": True}], ids=["bf16", "fp32acc", "fp32lg"]
)
def test_cuda_bf16_fused_equals_unfused(name, options):
    """The loss and gradient-norm equality test: same batch, fused vs ``linear_logprobs_entropy`` + ``rl_loss``."""
    cfg = CONFIGS[name]
    hidden, weight, targets, td = make_case(8, 256, 512, 50257, torch.bfloat16, seed=7)
    loss, _, grad_h, grad_w = run_fused(hidden, weight, targets, td, cfg, chunk_bytes=512 * 50257 * 2, **options)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    if options.get("float32_logits"):
        lp, ent = logprobs_entropy(h.float() @ w.float().T, targets)  # the same convention, unfused
    else:
        lp, ent = linear_logprobs_entropy(h, w, targets)
    full = td.clone(recurse=False)
    full.set(keys.LOG_PROBS, lp.view(8, 256))
    full.set(keys.ENTROPY, ent.view(8, 256))
    unfused, _ = rl_loss(full, cfg)
    unfused.backward()
    tol = BF16_LOSS_RTOL * float(unfused.detach().abs())
    torch.testing.assert_close(loss, unfused.detach(), rtol=BF16_LOSS_RTOL, atol=tol)
    for actual, expected in ((grad_h, h.grad), (grad_w, w.grad)):
        assert actual.dtype == torch.bfloat16 and torch.isfinite(actual).all()
        ratio = float(actual.float().norm()) / float(expected.float().norm())
        assert abs(ratio - 1) < BF16_GRAD_NORM_RTOL, ratio
        cosine = torch.nn.functional.cosine_similarity(actual.float().flatten(), expected.float().flatten(), dim=0)
        assert float(cosine) > 0.999


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cuda_forward_queues_its_work_without_a_host_sync(name):
    """With ``seq_lengths`` from the host, the forward (every chunk's three matmuls, the statistics, the mismatch
    weights) is queued without waiting for the device: CUDA's sync debug mode raises on any synchronising call. The
    checks that read device values wait on events after everything is queued, and equal the counted path."""
    cfg = CONFIGS[name]
    hidden, weight, targets, td = make_case(4, 300, 256, 32007, torch.bfloat16, seed=11)
    lengths = td[keys.MASK].sum(-1).tolist()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    linear_rl_loss(h, w, targets, td, cfg, seq_lengths=lengths, chunk_bytes=128 * 32007 * 2)  # warm: compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, metrics = linear_rl_loss(h, w, targets, td, cfg, seq_lengths=lengths, chunk_bytes=128 * 32007 * 2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    loss.backward()
    counted, _, grad_h, grad_w = run_fused(hidden, weight, targets, td, cfg, chunk_bytes=128 * 32007 * 2)
    torch.testing.assert_close(loss.detach(), counted, rtol=0, atol=0)
    torch.testing.assert_close(h.grad, grad_h, rtol=0, atol=0)
    torch.testing.assert_close(w.grad, grad_w, rtol=0, atol=0)
    wrong = [lengths[0] + 1, *lengths[1:]]
    with pytest.raises(ValueError, match="seq_lengths"):
        linear_rl_loss(hidden, weight, targets, td, cfg, seq_lengths=wrong)
