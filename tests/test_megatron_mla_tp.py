"""Multi-latent attention (the DeepSeek-V3 layout) over tensor-parallel ranks under --train-backend megatron: how each
rank holds the MLA tensors, what the flag check refuses, and megatron-core's model at TP=2 over gloo (two processes)
against transformers' on the same weights in float32, and against TP=1 through a train step."""

from __future__ import annotations

import pytest
import torch
from test_megatron_deepseek_v3 import LOGIT_TOL, MOONLIGHT, VARIANTS, deepseek_config, deepseek_model
from test_megatron_glm4_moe import checkpoint_state

from runtime.train.backends import megatron_config as mc
from runtime.train.backends import megatron_mla as mla
from runtime.train.backends import megatron_weights as mw


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_rank_holds_its_cut_and_the_cuts_join_back_exactly(variant):
    hf = checkpoint_state(deepseek_model(**VARIANTS[variant]))
    shape = mc.shape_from_hf(deepseek_config(**VARIANTS[variant]).to_dict())
    shards = [[mw.to_megatron(hf, shape, tp_rank=r, tp_size=2, pp_rank=0, pp_size=1) for r in range(2)]]
    attn, m = "model.layers.0.self_attn.", "decoder.layers.0.self_attention."
    # heads x (16 + 12) rows of kv_b_proj: rank 1 holds the last two heads' rows; o_proj is cut by columns; the
    # latent norms are whole on both ranks.
    kv_b = hf[attn + "kv_b_proj.weight"]
    assert torch.equal(shards[0][1][m + "linear_kv_up_proj.weight"], kv_b[kv_b.shape[0] // 2 :])
    o = hf[attn + "o_proj.weight"]
    assert torch.equal(shards[0][1][m + "linear_proj.weight"], o[:, o.shape[1] // 2 :])
    for r in range(2):
        assert torch.equal(shards[0][r][m + "kv_layernorm.weight"], hf[attn + "kv_a_layernorm.weight"])
    back = mw.to_hf(shards, shape)
    assert set(back) == set(hf)
    for name, value in hf.items():
        assert torch.equal(back[name], value), name


def test_tensor_parallel_sizes_that_do_not_divide_the_latent_or_the_heads_are_named():
    # Every layer dense: MoE layers at TP > 1 without --sequence-parallel are refused on their own.
    dense = dict(first_k_dense_replace=2)
    shape = mc.shape_from_hf(deepseek_config(**dense).to_dict())  # 4 heads, q_lora_rank 24, kv_lora_rank 32 + rope 8
    assert mc.parallel_problems(shape, tp_size=2, pp_size=1) == []
    problems = mc.parallel_problems(shape, tp_size=3, pp_size=1)
    assert any("num_attention_heads 4" in p for p in problems), problems
    assert any("kv_lora_rank + qk_rope_head_dim 40" in p for p in problems), problems
    odd = mc.shape_from_hf(deepseek_config(q_lora_rank=25, **dense).to_dict())
    (problem,) = mc.parallel_problems(odd, tp_size=2, pp_size=1)
    assert problem.startswith("--tensor-model-parallel-size 2 must divide q_lora_rank 25"), problem
    assert mla.tp_problems(shape.mla, heads=4, tp_size=1) == []
    moonlight = mc.shape_from_hf(deepseek_config(**MOONLIGHT, **dense).to_dict())
    assert mc.parallel_problems(moonlight, tp_size=2, pp_size=1) == []
    moonlight_moe = mc.shape_from_hf(deepseek_config(**MOONLIGHT).to_dict())
    (moe,) = mc.parallel_problems(moonlight_moe, tp_size=2, pp_size=1)
    assert "needs --sequence-parallel (megatron-core trains MoE layers over tensor-parallel ranks only" in moe
    assert mc.parallel_problems(moonlight_moe, tp_size=2, pp_size=1, sequence_parallel=True) == []


pytest.importorskip("megatron.core")


def _tp_worker(rank, port, path, tmp, out):
    from test_megatron_backend import job, make_batch, train_once, trainer
    from test_megatron_moe import routed_logits
    from test_megatron_sequence_parallel import tensor_grads
    from transformers import AutoModelForCausalLM

    cfg = job(tmp, tensor_model_parallel_size=2, train_backend="megatron", actor_num_gpus_per_node=2)
    mega = trainer("megatron", path, cfg, rank=rank, world_size=2, master_port=port)
    try:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        logits, want, got_routes, want_routes = routed_logits(mega, hf, make_batch(203)[:5])
        weights = mega.get_weights()
        metrics = train_once(mega, cfg, make_batch(203))
        grads = tensor_grads(mega)
        # Each rank's logits are its half of the (padded) vocabulary.
        result = dict(logits=logits, want=want, got_routes=got_routes, want_routes=want_routes)
        torch.save(
            {**result, "weights": weights, "metrics": metrics, "grads": grads, "dp": mega.dp_info()}, f"{out}.{rank}"
        )
    finally:
        mega.shutdown()


def test_mla_at_tp2_equals_transformers_and_trains_like_tp1(tmp_path, gloo_ranks):
    """TP=2 over gloo: logits equal transformers' (the sharded projections gathered as megatron-core's local spec
    does), the exported weights are the checkpoint's, and a train step's loss and gradient norm are TP=1's. Both layers
    dense, without --sequence-parallel (MoE layers at TP=2 with it: tests/test_megatron_sequence_parallel.py)."""
    from test_megatron_backend import _free_port, job, make_batch, train_once, trainer
    from test_megatron_sequence_parallel import assert_hf_grads_equal, tensor_grads

    hf = deepseek_model(first_k_dense_replace=2)
    path = tmp_path / "deepseek-v3"
    hf.save_pretrained(path)
    out = str(tmp_path / "tp2.pt")
    gloo_ranks.run(_tp_worker, _free_port(), str(path), tmp_path, out)
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    tp2 = ranks[0]
    assert [r["dp"] for r in ranks] == [(0, 1), (0, 1)]
    assert tp2["got_routes"] == tp2["want_routes"] == []
    logits = torch.cat([r["logits"] for r in ranks], dim=-1)
    torch.testing.assert_close(logits[..., :203], tp2["want"], **LOGIT_TOL)
    checkpoint = checkpoint_state(hf)
    assert set(tp2["weights"]) == set(checkpoint)
    for name, value in checkpoint.items():
        assert torch.equal(tp2["weights"][name], value), name
    cfg = job(tmp_path, train_backend="megatron")
    one = trainer("megatron", str(path), cfg)
    try:
        metrics = train_once(one, cfg, make_batch(203))
        # float32: the two sum the same products in different orders (the row-parallel output projection adds two
        # partial sums), a few ulps apart.
        assert tp2["metrics"]["loss"] == pytest.approx(metrics["loss"], rel=1e-4, abs=1e-6)
        assert tp2["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-4)
        # Every gradient, which the norm above hides (the key's rotary part summed over the ranks:
        # megatron_compat.whole_latent_mla_attention; the latent norms' whole on every rank, not summed).
        assert_hf_grads_equal(
            [r["grads"] for r in ranks], tensor_grads(one), mc.shape_from_hf(hf.config.to_dict()), what="MLA"
        )
    finally:
        one.shutdown()
