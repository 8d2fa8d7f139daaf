"""GLM-4 (dense, ``glm4``: GLM-4-9B's layout) under --train-backend megatron on the CPU: config.json and slime's flags,
the weights both ways, and megatron-core's model (the local spec with the backend's post-norm layer) against
transformers' on the same weights, in float32.

GLM-4's layer differs from Llama's by a bias on q/k/v, RMSNorms after attention and after the MLP (before each
residual add), rotary embeddings over half of each head with interleaved pairs, and one fused ``gate_up_proj``.
"""

from __future__ import annotations

import pytest
import torch

from runtime.train.backends import megatron_config as mc
from runtime.train.backends import megatron_weights as mw

GLM4 = dict(
    vocab_size=203,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    partial_rotary_factor=0.5,
    attention_bias=True,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    pad_token_id=0,
    tie_word_embeddings=False,
)
# float32 against float32: two implementations of one model sum in different orders (a few ulps of values of order 1,
# compounded over the layers); a misplaced norm, bias or rotary pair moves logits by O(0.1).
LOGIT_TOL = dict(rtol=1e-5, atol=1e-5)


def glm4_config(**overrides):
    from transformers import AutoConfig

    return AutoConfig.for_model("glm4", **{**GLM4, **overrides})


def glm4_model(seed: int = 0, **overrides):
    """A random tiny GLM-4: norms drawn away from one and biases away from zero (a misplaced one shows)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(glm4_config(**overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
    return model


# ------------------------------------------------------------------ config.json and flags


def test_shape_reads_glm4():
    hf = glm4_config().to_dict()
    shape = mc.shape_from_hf(hf)
    assert (shape.rotary_percent, shape.post_norms, shape.rotary_interleaved) == (0.5, True, True)
    assert shape.add_qkv_bias and not shape.qk_layernorm and shape.hf_gate_up_fused and shape.moe is None
    # GLM-4-9B's released config.json gives partial_rotary_factor at the top level only, transformers 5 in
    # rope_parameters too; attention_bias false: no bias on q/k/v.
    nested = {k: v for k, v in hf.items() if k != "partial_rotary_factor"}
    assert nested["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert mc.shape_from_hf(nested) == shape
    assert not mc.shape_from_hf(hf | {"attention_bias": False}).add_qkv_bias


def test_other_families_still_refuse_partial_rotary_and_attention_bias():
    from test_megatron_mapping import hf_config

    llama = hf_config("llama").to_dict()
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5"):
        mc.shape_from_hf(llama | {"partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="attention_bias true"):
        mc.shape_from_hf(llama | {"attention_bias": True})


def test_slimes_glm4_shape_flags_agree_or_are_named():
    shape = mc.shape_from_hf(glm4_config().to_dict())
    glm_flags = dict(
        post_self_attn_layernorm=True, post_mlp_layernorm=True, rotary_interleaved=True, rotary_percent=0.5
    )
    assert mc.shape_flag_problems({**glm_flags, "add_qkv_bias": True}, shape) == []
    from test_megatron_mapping import hf_config

    qwen3 = mc.shape_from_hf(hf_config("qwen3").to_dict())
    problems = mc.shape_flag_problems(glm_flags, qwen3)
    assert [p.split()[0] for p in problems] == [
        "--rotary-percent",
        "--post-self-attn-layernorm",
        "--post-mlp-layernorm",
        "--rotary-interleaved",
    ], problems


def test_model_name_picks_slimes_glm4_mapping():
    shape = mc.shape_from_hf(glm4_config().to_dict())
    assert mc.weight_mapping(mc.default_model_name("glm4"), shape) == "glm4"
    assert mc.weight_mapping("GLM-4-9B-0414", shape) == "glm4"
    # slime's qwen2 mapping has q/k/v biases but no name for the post-norms.
    with pytest.raises(ValueError, match="post_self_attn_layernorm"):
        mc.weight_mapping("qwen2.5", shape)


# ------------------------------------------------------------------ weights


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (2, 2)])
def test_weights_round_trip_exactly(tp, pp):
    hf = {k: v for k, v in glm4_model().state_dict().items()}
    shape = mc.shape_from_hf(glm4_config().to_dict())
    mw.check_hf_state(hf, shape)
    shards = [
        [mw.to_megatron(hf, shape, tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp) for t in range(tp)] for p in range(pp)
    ]
    # GLM-4's extra norms travel under their own names; the fused gate_up_proj becomes [gate; up] per TP rank.
    assert "decoder.layers.0.post_self_attn_layernorm.weight" in shards[0][0]
    assert "decoder.layers.0.post_mlp_layernorm.weight" in shards[0][0]
    gate, up = hf["model.layers.0.mlp.gate_up_proj.weight"].chunk(2)
    fc1 = shards[0][0]["decoder.layers.0.mlp.linear_fc1.weight"]
    rows = 80 // tp
    assert torch.equal(fc1, torch.cat([gate[:rows], up[:rows]]))
    back = mw.to_hf(shards, shape)
    assert set(back) == set(hf)
    for name, value in hf.items():
        assert torch.equal(back[name], value), name


def test_a_checkpoint_without_the_post_norms_is_named():
    hf = dict(glm4_model().state_dict())
    del hf["model.layers.2.post_mlp_layernorm.weight"]
    shape = mc.shape_from_hf(glm4_config().to_dict())
    with pytest.raises(ValueError, match="post_mlp_layernorm"):
        mw.check_hf_state(hf, shape)


# ------------------------------------------------------------------ megatron-core's model

pytest.importorskip("megatron.core")


def _job(tmp_path, **overrides):
    from test_megatron_backend import job

    return job(tmp_path, train_backend="megatron", **overrides)


@pytest.mark.parametrize("attention_backend", ["auto", "local"])
def test_logits_equal_transformers(attention_backend, tmp_path):
    from test_megatron_backend import make_batch, trainer

    from runtime.train.roles import ACTOR

    hf = glm4_model()
    path = tmp_path / "glm4"
    hf.save_pretrained(path)
    mega = trainer("megatron", str(path), _job(tmp_path, attention_backend=attention_backend), roles=(ACTOR,))
    try:
        mb = make_batch(203)[:5]
        with mega._shims(), torch.no_grad():
            logits = mega._logits(mega.model, mb)
            tokens, _, _ = mega._inputs(mb)
            want = hf(input_ids=tokens).logits
        torch.testing.assert_close(logits[..., :203], want, **LOGIT_TOL)
        # The exported weights are the checkpoint's, names and values.
        exported = mega.get_weights()
        assert set(exported) == set(hf.state_dict())
        for name, value in hf.state_dict().items():
            assert torch.equal(exported[name], value), name
    finally:
        mega.shutdown()


def test_the_post_norms_act_before_the_residual_add(tmp_path):
    """Mutation guard at the layer: with the post-norms' weights at zero, each sublayer adds nothing, so the logits
    are those of the embeddings through the final norm alone."""
    from test_megatron_backend import make_batch, trainer

    from runtime.train.roles import ACTOR

    hf = glm4_model()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "post_self_attn_layernorm" in name or "post_mlp_layernorm" in name:
                p.zero_()
    path = tmp_path / "glm4"
    hf.save_pretrained(path)
    mega = trainer("megatron", str(path), _job(tmp_path), roles=(ACTOR,))
    try:
        mb = make_batch(203)[:3]
        with mega._shims(), torch.no_grad():
            logits = mega._logits(mega.model, mb)
            tokens, _, _ = mega._inputs(mb)
        x = hf.model.embed_tokens(tokens)
        want = hf.lm_head(hf.model.norm(x))
        torch.testing.assert_close(logits[..., :203], want, **LOGIT_TOL)
    finally:
        mega.shutdown()
