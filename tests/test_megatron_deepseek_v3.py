"""The DeepSeek-V3 layout (``deepseek_v3``: DeepSeek-V3/R1, and Moonlight without a query LoRA) under
--train-backend megatron on the CPU: config.json and slime's MLA flags, the weights both ways, and megatron-core's
model (``MLASelfAttention`` on the local spec, the sigmoid router with expert bias and group-limited routing, a shared
expert, the first layer dense) against transformers' on the same weights in float32, with identical expert choices.
"""

from __future__ import annotations

import pytest
import torch
from test_megatron_glm4_moe import checkpoint_state
from test_megatron_moe import routed_logits, widen

from runtime.train.backends import megatron_config as mc
from runtime.train.backends import megatron_mla as mla
from runtime.train.backends import megatron_weights as mw

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10_000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
DEEPSEEK_V3 = dict(
    vocab_size=203,
    hidden_size=48,
    intermediate_size=80,
    moe_intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=4,
    n_shared_experts=1,
    first_k_dense_replace=1,
    # 4 groups of 2 experts, a token's 4 experts from the best 2 groups: Megatron's group score (the sum of the top
    # topk // topk_group = 2) is transformers' (the top 2).
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    q_lora_rank=24,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    # Unlike the query/key head (16 + 8), as DeepSeek-V3's (128 vs 192).
    v_head_dim=12,
    rope_parameters=YARN,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    pad_token_id=0,
    tie_word_embeddings=False,
)
# Moonlight-16B-A3B's layout: no query LoRA, one expert group, plain rotary.
MOONLIGHT = dict(
    q_lora_rank=None,
    n_group=1,
    topk_group=1,
    rope_parameters={"rope_type": "default", "rope_theta": 5e4},
    # Moonlight's epsilon; transformers' latent norms keep 1e-6 (megatron_layers.LatentNorm).
    rms_norm_eps=1e-5,
)
# float32 against float32: two implementations of one model sum in different orders (a few ulps of values of order 1,
# compounded over two layers); a token sent to another expert, or a rotary pair misplaced, moves logits by O(0.1).
LOGIT_TOL = dict(rtol=1e-5, atol=1e-5)


def deepseek_config(**overrides):
    from transformers import AutoConfig

    return AutoConfig.for_model("deepseek_v3", **{**DEEPSEEK_V3, **overrides})


def deepseek_model(seed: int = 0, **overrides):
    """A random tiny DeepSeek-V3: routers drawn wide, expert biases large enough to change choices, norms away from
    one."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(deepseek_config(**overrides), dtype=torch.float32)
    return widen(model, norm_std=0.2, expert_bias_std=0.3)


VARIANTS = {"deepseek-v3": {}, "moonlight": MOONLIGHT}


# ------------------------------------------------------------------ config.json and flags


def test_shape_reads_mla_and_yarn():
    shape = mc.shape_from_hf(deepseek_config().to_dict())
    assert shape.mla == mla.MLAShape(
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_head_dim=16,
        qk_pos_emb_head_dim=8,
        v_head_dim=12,
        rope_type="yarn",
        rotary_scaling_factor=4.0,
        original_max_position_embeddings=16,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    )
    assert shape.moe.layer_pattern == (0, 1) and (shape.moe.num_groups, shape.moe.group_topk) == (4, 2)
    assert shape.moe.shared_ffn_hidden_size == 24 and shape.moe.expert_bias
    moonlight = mc.shape_from_hf(deepseek_config(**MOONLIGHT).to_dict())
    assert moonlight.mla.q_lora_rank is None and moonlight.mla.rope_type == "rope"
    assert moonlight.rotary_base == 5e4 and moonlight.moe.num_groups is None


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope_type 'linear'"),
        ({"rope_interleave": False}, "rope_interleave false"),
        ({"topk_group": 1}, "megatron-core scores a group by its top 4 experts, transformers by its top 2"),
    ],
)
def test_refuses_what_megatron_computes_differently(fields, named):
    with pytest.raises(ValueError, match="cannot build this model") as err:
        mc.shape_from_hf(deepseek_config().to_dict() | fields, source="ckpt/config.json")
    assert named in str(err.value)


def test_slimes_mla_flags_agree_or_are_named():
    shape = mc.shape_from_hf(deepseek_config().to_dict())
    slime = dict(
        multi_latent_attention=True,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_head_dim=16,
        qk_pos_emb_head_dim=8,
        v_head_dim=12,
        moe_router_num_groups=4,
        moe_router_group_topk=2,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
    )
    assert mc.shape_flag_problems(slime, shape) == []
    problems = mc.shape_flag_problems(slime | dict(kv_lora_rank=512, v_head_dim=16), shape)
    assert [p.split()[0] for p in problems] == ["--kv-lora-rank", "--v-head-dim"], problems
    from test_megatron_mapping import hf_config

    dense = mc.shape_from_hf(hf_config("qwen3").to_dict())
    assert mc.shape_flag_problems({"multi_latent_attention": True}, dense)[0].startswith("--multi-latent-attention")
    assert mc.weight_mapping(mc.default_model_name("deepseek_v3"), shape) == "deepseek_v3"


def test_slimes_rotary_flags_agree_with_yarn_or_plain_rotary():
    """slime's MLA scripts pass Megatron-LM's YaRN flags (MLA takes YaRN by default): DeepSeek-V3's match its
    rope_scaling; Moonlight's factor 1 is plain rotary, where the mscales scale nothing. Under MLA --kv-channels is
    not read, and the latent norms are --qk-layernorm."""
    yarn = mc.shape_from_hf(deepseek_config().to_dict())
    given = dict(rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=1.0, rope_type="yarn", qk_layernorm=True)
    assert mc.shape_flag_problems(given | dict(kv_channels=16), yarn) == []
    problems = mc.shape_flag_problems(
        given | dict(rotary_scaling_factor=40.0, mscale_all_dim=0.0, rope_type="rope"), yarn
    )
    assert [p.split()[0] for p in problems] == ["--rope-type", "--rotary-scaling-factor", "--mscale-all-dim"], problems
    plain = mc.shape_from_hf(deepseek_config(**MOONLIGHT).to_dict())
    moonlight = dict(
        rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=1.0, kv_channels=16, qk_layernorm=True,
        moe_router_num_groups=1, moe_router_group_topk=1,
    )  # fmt: skip
    assert mc.shape_flag_problems(moonlight, plain) == []
    assert mc.shape_flag_problems(moonlight | dict(rope_type="rope"), plain) == []
    (problem,) = mc.shape_flag_problems(moonlight | dict(rotary_scaling_factor=40.0), plain)
    assert problem.startswith(
        "--rotary-scaling-factor 40.0 disagrees with config.json: rope_scaling's factor gives 1.0"
    )
    # A model without MLA: plain rotary, and --kv-channels is its head_dim.
    from test_megatron_mapping import hf_config

    dense = mc.shape_from_hf(hf_config("qwen3").to_dict())
    assert mc.shape_flag_problems(dict(rotary_scaling_factor=1.0, rope_type="rope"), dense) == []
    problems = mc.shape_flag_problems(dict(rope_type="yarn", kv_channels=dense.kv_channels + 1), dense)
    assert [p.split()[0] for p in problems] == ["--kv-channels", "--rope-type"], problems


# ------------------------------------------------------------------ weights


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize(("pp", "ep"), [(1, 1), (2, 1), (1, 2)])
def test_weights_round_trip_exactly(variant, pp, ep):
    hf = checkpoint_state(deepseek_model(**VARIANTS[variant]))
    shape = mc.shape_from_hf(deepseek_config(**VARIANTS[variant]).to_dict())
    mw.check_hf_state(hf, shape)
    shards = [
        [mw.to_megatron(hf, shape, tp_rank=0, tp_size=1, pp_rank=p, pp_size=pp, ep_rank=r, ep_size=ep)]
        for p in range(pp)
        for r in range(ep)
    ]
    first = shards[0][0]
    down = "linear_q_down_proj" if variant == "deepseek-v3" else "linear_q_proj"
    q = "q_a_proj" if variant == "deepseek-v3" else "q_proj"
    assert torch.equal(
        first[f"decoder.layers.0.self_attention.{down}.weight"], hf[f"model.layers.0.self_attn.{q}.weight"]
    )
    assert torch.equal(
        first["decoder.layers.0.self_attention.kv_layernorm.weight"],
        hf["model.layers.0.self_attn.kv_a_layernorm.weight"],
    )
    if ep == 1:
        back = mw.to_hf(shards, shape)
        assert set(back) == set(hf)
        for name, value in hf.items():
            assert torch.equal(back[name], value), name
    else:
        # Rank r holds experts [4r, 4r + 4) of the MoE layer as local 0..3.
        for r in range(2):
            got = shards[r][0]["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"]
            assert torch.equal(got, hf[f"model.layers.1.mlp.experts.{4 * r + 3}.down_proj.weight"])


def test_the_checkpoints_mtp_layer_is_neither_read_nor_refused():
    # DeepSeek-V3/R1's checkpoints store their multi-token-prediction layer after the decoder's (model.layers.61 of
    # 61 layers, with its eh_proj, enorm, hnorm and shared_head beside a decoder layer's tensors); transformers skips
    # it, and so does the reader. Catches: a real checkpoint refused for those tensors at load, the MTP layer read as
    # a decoder layer, and a checkpoint whose config.json declares no MTP layer accepted with an extra layer.
    hf = checkpoint_state(deepseek_model())
    layers = DEEPSEEK_V3["num_hidden_layers"]
    extra = {
        f"model.layers.{layers}.{name}": torch.randn(3)
        for name in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "self_attn.kv_a_layernorm.weight")
    }
    with_mtp = mc.shape_from_hf(deepseek_config(num_nextn_predict_layers=1).to_dict())
    assert with_mtp.checkpoint_mtp_layers == 1 and with_mtp.num_layers == layers
    shard = mw.to_megatron({**hf, **extra}, with_mtp, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    assert shard.keys() == mw.to_megatron(hf, with_mtp, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1).keys()
    without = mc.shape_from_hf(deepseek_config(num_nextn_predict_layers=0).to_dict())
    assert without.checkpoint_mtp_layers == 0
    with pytest.raises(ValueError, match=rf"unexpected \['model\.layers\.{layers}\."):
        mw.check_hf_state({**hf, **extra}, without)
    beyond = {f"model.layers.{layers + 1}.enorm.weight": torch.randn(3)}  # past the one MTP layer declared
    with pytest.raises(ValueError, match="unexpected"):
        mw.check_hf_state({**hf, **beyond}, with_mtp)


# ------------------------------------------------------------------ megatron-core's model

pytest.importorskip("megatron.core")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_and_expert_choices_equal_transformers(variant, tmp_path):
    from test_megatron_backend import job, make_batch, trainer

    from runtime.train.roles import ACTOR

    hf = deepseek_model(**VARIANTS[variant])
    path = tmp_path / variant
    hf.save_pretrained(path)
    mega = trainer("megatron", str(path), job(tmp_path, train_backend="megatron"), roles=(ACTOR,))
    try:
        logits, want, got_routes, want_routes = routed_logits(mega, hf, make_batch(203)[:5])
        assert len(got_routes) == len(want_routes) == 1  # the MoE layer; the first is dense
        assert torch.equal(got_routes[0], want_routes[0])
        torch.testing.assert_close(logits[..., :203], want, **LOGIT_TOL)
        exported, checkpoint = mega.get_weights(), checkpoint_state(hf)
        assert set(exported) == set(checkpoint)
        for name, value in checkpoint.items():
            assert torch.equal(exported[name], value), name
    finally:
        mega.shutdown()


def test_the_job_takes_slimes_mla_flags_and_names_each_disagreement(tmp_path):
    from test_megatron_moe import _problems

    folder = tmp_path / "hf"
    deepseek_config().save_pretrained(folder)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"input": "1+1", "label": "2"}\n')
    job = [
        *("--train-backend", "megatron", "--hf-checkpoint", str(folder), "--prompt-data", str(prompts)),
        *("--rm-type", "math", "--rollout-max-response-len", "8", "--rollout-batch-size", "2"),
        *("--n-samples-per-prompt", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "2"),
    ]
    slime = [
        "--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "32", "--qk-head-dim", "16",
        "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12", "--moe-router-num-groups", "4",
        "--moe-router-group-topk", "2", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0",
        "--moe-shared-expert-intermediate-size", "24", "--moe-router-topk-scaling-factor", "2.5",
        "--moe-router-score-function", "sigmoid", "--moe-layer-freq", "[0]*1+[1]*1", "--expert-model-parallel-size",
        "2",
    ]  # fmt: skip
    assert _problems([*job, *slime]) == []
    problems = _problems([*job, "--q-lora-rank", "1536", "--rotary-scaling-factor", "40", "--mscale-all-dim", "1"])
    assert sorted(p.split()[0] for p in problems) == ["--q-lora-rank", "--rotary-scaling-factor"], problems
    assert _problems([*job, "--rotary-scaling-factor", "4"]) == []
    # MoE layers at TP > 1 need sequence parallelism (megatron-core's own requirement).
    (problem,) = _problems([*job, "--tensor-model-parallel-size", "2"])
    assert problem.startswith("--tensor-model-parallel-size 2 with the MoE layers of")
    assert "needs --sequence-parallel" in problem
    assert _problems([*job, "--tensor-model-parallel-size", "2", "--sequence-parallel"]) == []
