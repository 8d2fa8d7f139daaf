"""GLM-4 dense, GLM-4.5 and the DeepSeek-V3 layout (MLA; Moonlight too) under --train-backend megatron on a GPU
(skipped without one): bf16 logits against transformers' on the same weights, and the DeepSeek-V3 layout at TP=2
with sequence parallelism over NCCL in float32.

Run: ``python -m pytest -q tests/test_megatron_families_cuda.py``. Written without a GPU to run it on: the CPU tests
(``tests/test_megatron_glm4.py``, ``tests/test_megatron_glm4_moe.py``, ``tests/test_megatron_deepseek_v3.py``) check
the same models in float32 to 1e-5 with
identical expert choices; the bounds here are ``tests/test_megatron_moe_cuda.py``'s bf16 bounds for Qwen3-MoE, which
:func:`bf16_gaps` on the CPU shows these families within too (bf16 both sides, numbers in the test's docstring).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from test_megatron_deepseek_v3 import MOONLIGHT, deepseek_model  # noqa: E402
from test_megatron_glm4 import glm4_model  # noqa: E402
from test_megatron_glm4_moe import GROUPED, glm4_moe_model  # noqa: E402

MODELS = {
    "glm4": lambda: glm4_model(),
    "glm4_moe": lambda: glm4_moe_model(),
    "glm4_moe-grouped-qk-norm": lambda: glm4_moe_model(**GROUPED),
    "deepseek_v3": lambda: deepseek_model(),
    "moonlight": lambda: deepseek_model(**MOONLIGHT),
}


def bf16_gaps(name: str, tmp_path, *, device: str) -> tuple[float, float, float]:
    """(mean and largest |Megatron bf16 - transformers bf16| logit gap, mean |transformers bf16 - float32| gap) of
    model ``name`` on ``device`` over four rows of the backend tests' batch."""
    from test_megatron_backend import job, make_batch, trainer

    from runtime.train.roles import ACTOR

    path = tmp_path / name
    MODELS[name]().save_pretrained(path)
    from transformers import AutoModelForCausalLM

    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
    cfg = job(tmp_path, train_backend="megatron", bf16="true")
    mega = trainer("megatron", str(path), cfg, roles=(ACTOR,), device=device)
    mb = make_batch(203)[:4]
    try:
        with mega._shims(), torch.no_grad():
            logits = mega._logits(mega.model, mb)[..., :203].float()
            tokens, _, _ = mega._inputs(mb)
            tokens = tokens.to(device)
            exact = hf32(input_ids=tokens).logits.float()
            rounded = hf16(input_ids=tokens).logits.float()
    finally:
        mega.shutdown()
    gap = (logits - rounded).abs()
    return float(gap.mean()), float(gap.max()), float((rounded - exact).abs().mean())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("name", list(MODELS))
def test_bf16_logits_are_near_transformers(name, tmp_path):
    """bf16 Megatron (Float16Module, SDPA attention; GLM-4's post-norms, the sigmoid router with its float32
    expert bias, MLA) against transformers' bf16 model on the same weights: the mean absolute logit gap within 1.5 x
    the gap between transformers' bf16 and float32 models plus 1e-3, the largest within 5e-2 (a token routed to
    another expert, or a misplaced norm, would add gaps of order 0.1). Measured with :func:`bf16_gaps` on the CPU (an
    AMD EPYC, bf16 both sides, 2026-11-27), as (mean, largest, transformers' bf16-vs-float32 mean): glm4 (9.8e-4,
    5.9e-3, 1.0e-3); glm4_moe (7.9e-4, 1.2e-2, 7.5e-4); grouped with QK-norm (7.2e-4, 3.9e-3, 8.5e-4); deepseek_v3
    (7.5e-4, 5.9e-3, 8.2e-4); moonlight (6.9e-4, 4.9e-3, 7.6e-4). GPU kernels round differently, hence the room."""
    mean, largest, baseline = bf16_gaps(name, tmp_path, device="cuda")
    print(f"{name}: megatron-hf bf16 mean {mean:.3e} max {largest:.3e}; hf bf16-fp32 mean {baseline:.3e}")
    assert mean <= 1.5 * baseline + 1e-3 and largest < 5e-2


def _mla_tp2_worker(rank, port, path, tmp, out):
    from test_megatron_backend import job, make_batch, trainer

    from runtime.train.roles import ACTOR

    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = job(
        tmp,
        train_backend="megatron",
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        actor_num_gpus_per_node=2,
        bf16="false",
    )
    mega = trainer(
        "megatron", path, cfg, rank=rank, world_size=2, master_port=port, roles=(ACTOR,), device=f"cuda:{rank}"
    )
    try:
        with mega._shims(), torch.no_grad():
            logits = mega._logits(mega.model, make_batch(203)[:4]).float().cpu()
        torch.save(logits, f"{out}.{rank}")  # this rank's half of the padded vocabulary
        mega.get_weights()
    finally:
        mega.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("name", ["deepseek_v3", "moonlight"])
def test_mla_with_experts_at_tp2_over_nccl_equals_transformers_in_float32(name, tmp_path):
    """The DeepSeek-V3 layout, its MoE layer included, over two tensor-parallel GPUs with --sequence-parallel, float32
    with TF32 off: logits equal transformers' to the CPU tests' tolerance (``tests/test_megatron_sequence_parallel.py``
    runs the same layout at TP=2 over gloo through a train step)."""
    import torch.multiprocessing as mp
    from test_megatron_backend import _free_port, make_batch
    from test_megatron_deepseek_v3 import LOGIT_TOL
    from transformers import AutoModelForCausalLM

    from runtime.train.batch import TOKENS

    path = tmp_path / name
    MODELS[name]().save_pretrained(path)
    out = str(tmp_path / "tp2")
    mp.spawn(_mla_tp2_worker, args=(_free_port(), str(path), tmp_path, out), nprocs=2, join=True)
    got = torch.cat([torch.load(f"{out}.{rank}") for rank in range(2)], dim=-1)[..., :203]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    tokens = make_batch(203)[TOKENS][:4, : got.shape[1]].cuda()
    with torch.no_grad():
        want = hf(input_ids=tokens).logits.cpu()
    torch.testing.assert_close(got, want, **LOGIT_TOL)
