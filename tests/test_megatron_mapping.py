"""HF config.json -> Megatron shape, and HF <-> Megatron weights (TP and PP shards), as pure tensor operations.

The round trips are exact (``torch.equal``) on tiny random Llama, Qwen2 and Qwen3 models built by transformers; the
layout itself (QKV interleaving, gate/up fusion) is checked against megatron-core's own ``GPTModel`` in
``tests/test_megatron_backend.py``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from runtime.train.backends import megatron_config as mc
from runtime.train.backends import megatron_weights as mw

FAMILIES = {
    "llama": dict(num_key_value_heads=2, tie_word_embeddings=False),
    "qwen2": dict(num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": dict(num_key_value_heads=2, tie_word_embeddings=True, head_dim=24),
}


def hf_config(model_type: str, **overrides):
    from transformers import AutoConfig

    fields = dict(
        vocab_size=203,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        **FAMILIES[model_type],
    )
    fields.update(overrides)
    return AutoConfig.for_model(model_type, **fields)


def hf_state(config, seed: int = 0) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Norm weights start at one; random ones make a swapped norm visible.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    state = dict(model.state_dict())
    if config.tie_word_embeddings:
        state.pop(mw.LM_HEAD, None)
    return state


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_shape_from_hf_reads_each_family(model_type):
    config = hf_config(model_type)
    shape = mc.shape_from_hf(config.to_dict())
    assert shape.num_layers == 4 and shape.hidden_size == 48 and shape.ffn_hidden_size == 80
    assert shape.num_query_groups == 2 and shape.num_attention_heads == 4
    assert shape.kv_channels == (24 if model_type == "qwen3" else 12)
    assert shape.qk_layernorm == (model_type == "qwen3")
    assert shape.add_qkv_bias == (model_type == "qwen2")
    assert shape.tie_embeddings == config.tie_word_embeddings
    assert shape.rotary_base == config.to_dict()["rope_parameters"]["rope_theta"]
    assert shape.norm_epsilon == 1e-5


def test_shape_from_hf_refuses_what_it_cannot_build():
    base = hf_config("llama").to_dict()
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        mc.shape_from_hf({**base, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope scaling 'llama3'"):
        mc.shape_from_hf({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}})
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        mc.shape_from_hf({**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="attention_bias"):
        mc.shape_from_hf({**base, "attention_bias": True})


def test_shape_flags_agreeing_pass_and_each_mismatch_is_named():
    shape = mc.shape_from_hf(hf_config("qwen3").to_dict())
    agreeing = dict(
        num_layers=4,
        hidden_size=48,
        ffn_hidden_size=80,
        num_attention_heads=4,
        num_query_groups=2,
        group_query_attention=True,
        kv_channels=24,
        rotary_base=shape.rotary_base,
        qk_layernorm=True,
        vocab_size=203,
        untie_embeddings_and_output_weights=False,
        normalization="RMSNorm",
        swiglu=True,
        norm_epsilon=1e-5,
        disable_bias_linear=True,
        add_qkv_bias=False,
        position_embedding_type="rope",
    )
    assert mc.shape_flag_problems(agreeing, shape) == []
    wrong = {**agreeing, "hidden_size": 64, "kv_channels": 12, "untie_embeddings_and_output_weights": True}
    problems = mc.shape_flag_problems(wrong, shape)
    assert len(problems) == 3
    assert any(p.startswith("--hidden-size 64") and "hidden_size gives 48" in p for p in problems)
    assert any(p.startswith("--kv-channels 12") and "head_dim gives 24" in p for p in problems)
    assert any(p.startswith("--untie-embeddings-and-output-weights True") for p in problems)
    # A flag not given is not checked.
    assert mc.shape_flag_problems({"hidden_size": None}, shape) == []


@pytest.mark.parametrize("vocab,tp,want", [(203, 1, 256), (256, 1, 256), (257, 2, 512), (151936, 2, 152064)])
def test_padded_vocab_follows_megatrons_rule(vocab, tp, want):
    assert mc.padded_vocab_size(vocab, tp_size=tp) == want


def test_parallel_problems_name_the_flag():
    shape = mc.shape_from_hf(hf_config("llama").to_dict())
    assert mc.parallel_problems(shape, tp_size=2, pp_size=2) == []
    problems = mc.parallel_problems(shape, tp_size=4, pp_size=3)
    assert any("--tensor-model-parallel-size 4" in p and "num_key_value_heads 2" in p for p in problems)
    assert any("--pipeline-model-parallel-size 3" in p and "num_hidden_layers 4" in p for p in problems)


@pytest.mark.parametrize("model_type", list(FAMILIES))
@pytest.mark.parametrize("tp_size,pp_size", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_hf_megatron_hf_round_trip_is_exact(model_type, tp_size, pp_size):
    config = hf_config(model_type)
    shape = mc.shape_from_hf(config.to_dict())
    hf = hf_state(config)
    shards = [
        [mw.to_megatron(hf, shape, tp_rank=t, tp_size=tp_size, pp_rank=p, pp_size=pp_size) for t in range(tp_size)]
        for p in range(pp_size)
    ]
    back = mw.to_hf(shards, shape)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    # Tensor-parallel shards split the weights: a TP=2 rank holds about half of a TP=1 rank's elements.
    if tp_size == 2:
        one = mw.to_megatron(hf, shape, tp_rank=0, tp_size=1, pp_rank=0, pp_size=pp_size)
        split = {n: t.numel() for n, t in shards[0][0].items()}
        for name, tensor in one.items():
            if name.endswith("norm.weight"):
                assert split[name] == tensor.numel(), name
            else:
                assert split[name] * 2 == tensor.numel(), name


def test_megatron_shards_have_the_local_layer_numbers_and_stage_parts():
    config = hf_config("llama")
    shape = mc.shape_from_hf(config.to_dict())
    hf = hf_state(config)
    first = mw.to_megatron(hf, shape, tp_rank=0, tp_size=1, pp_rank=0, pp_size=2)
    last = mw.to_megatron(hf, shape, tp_rank=0, tp_size=1, pp_rank=1, pp_size=2)
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert "output_layer.weight" in last and "embedding.word_embeddings.weight" not in last
    assert {n.split(".")[2] for n in last if n.startswith("decoder.layers.")} == {"0", "1"}
    assert torch.equal(last["decoder.layers.0.input_layernorm.weight"], hf["model.layers.2.input_layernorm.weight"])


def test_qkv_is_interleaved_per_query_group_and_split_by_groups():
    config = hf_config("llama")
    shape = mc.shape_from_hf(config.to_dict())
    hf = hf_state(config)
    d, h = shape.kv_channels, shape.hidden_size
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    k = hf["model.layers.0.self_attn.k_proj.weight"]
    v = hf["model.layers.0.self_attn.v_proj.weight"]
    # tp rank 1 of 2 holds query group 1: query heads 2 and 3, key head 1, value head 1.
    fused = mw.to_megatron(hf, shape, tp_rank=1, tp_size=2, pp_rank=0, pp_size=1)[
        "decoder.layers.0.self_attention.linear_qkv.weight"
    ]
    want = torch.cat([q[2 * d : 4 * d], k[d : 2 * d], v[d : 2 * d]])
    assert fused.shape == (4 * d, h) and torch.equal(fused, want)
    fc1 = mw.to_megatron(hf, shape, tp_rank=1, tp_size=2, pp_rank=0, pp_size=1)[
        "decoder.layers.0.mlp.linear_fc1.weight"
    ]
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(fc1, torch.cat([gate[40:], up[40:]]))


def test_checkpoint_disagreeing_with_its_config_is_refused_naming_the_field():
    config = hf_config("qwen3")
    shape = mc.shape_from_hf(config.to_dict())
    hf = hf_state(config)
    narrower = mc.shape_from_hf({**config.to_dict(), "intermediate_size": 64})
    with pytest.raises(
        ValueError, match=r"mlp.gate_proj.weight has shape \(80, 48\), config.json \(intermediate_size"
    ):
        mw.to_megatron(hf, narrower, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    fewer_heads = mc.shape_from_hf({**config.to_dict(), "num_key_value_heads": 1})
    with pytest.raises(ValueError, match=r"k_proj.weight has shape \(48, 48\), config.json \(num_key_value_heads"):
        mw.to_megatron(hf, fewer_heads, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    untied = mc.shape_from_hf({**config.to_dict(), "tie_word_embeddings": False})
    with pytest.raises(ValueError, match="tie_word_embeddings false"):
        mw.to_megatron(hf, untied, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    with pytest.raises(ValueError, match="missing"):
        mw.to_megatron(
            {k: v for k, v in hf.items() if "layers.3." not in k}, shape, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1
        )
    # A tied checkpoint may carry the head only as the embedding itself.
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        mw.to_megatron({**hf, mw.LM_HEAD: hf[mw.EMBED] + 1}, shape, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)


def test_megatron_shard_of_another_shape_is_refused():
    config = hf_config("llama")
    shape = mc.shape_from_hf(config.to_dict())
    shard = mw.to_megatron(hf_state(config), shape, tp_rank=0, tp_size=2, pp_rank=0, pp_size=1)
    with pytest.raises(ValueError, match=r"word_embeddings.weight has shape \(128, 48\), the model wants \(256, 48\)"):
        mw.check_megatron_state(shard, shape, tp_size=1, pp_rank=0, pp_size=1, what="load")


def test_check_shapes_names_the_missing_the_unexpected_and_the_misshapen_tensors():
    expected = {"a": (2, 3), "b": (4,)}
    mw.check_shapes({"a": torch.zeros(2, 3), "b": torch.zeros(4)}, expected, what="load", kind="tensors")
    with pytest.raises(ValueError) as info:
        mw.check_shapes({"a": torch.zeros(2, 3), "c": torch.zeros(1)}, expected, what="load", kind="Megatron tensors")
    assert str(info.value) == "load: missing Megatron tensors ['b'] (1), unexpected ['c']"
    with pytest.raises(ValueError) as info:
        mw.check_shapes({"a": torch.zeros(3, 2), "b": torch.zeros(4)}, expected, what="x (critic)", kind="tensors")
    assert str(info.value) == "x (critic): a has shape (3, 2), the model wants (2, 3)"


SHAPES = st.dictionaries(
    st.text("abcdef.", min_size=1, max_size=6),
    st.lists(st.integers(1, 3), max_size=3).map(tuple),
    max_size=5,
)


@given(expected=SHAPES, drop=st.integers(0, 4), grow=st.integers(0, 4))
def test_check_shapes_accepts_exactly_the_expected_names_and_shapes(expected, drop, grow):
    state = {name: torch.zeros(shape) for name, shape in expected.items()}
    mw.check_shapes(state, expected, what="w", kind="tensors")
    names = sorted(expected)
    if names:
        missing = {k: v for k, v in state.items() if k != names[drop % len(names)]}
        with pytest.raises(ValueError, match=r"^w: missing tensors"):
            mw.check_shapes(missing, expected, what="w", kind="tensors")
        name = names[grow % len(names)]
        grown = {**state, name: torch.zeros((*expected[name], 2))}
        with pytest.raises(ValueError, match=r"the model wants"):
            mw.check_shapes(grown, expected, what="w", kind="tensors")
    with pytest.raises(ValueError, match=r"unexpected \['#'\]"):
        mw.check_shapes({**state, "#": torch.zeros(1)}, expected, what="w", kind="tensors")


# ---------------------------------------------------------------- the flags, through rlcore-run's parser


def _problems(argv):
    from runtime.config import ConfigError, parse_args

    with pytest.raises(ConfigError) as info:
        parse_args(argv)
    return info.value.problems


def _megatron_job(tmp_path, model_type="qwen3", **overrides):
    folder = tmp_path / "model"
    hf_config(model_type, **overrides).save_pretrained(folder)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1", "label": "2"}\n')
    return [
        "--hf-checkpoint",
        str(folder),
        "--prompt-data",
        str(prompts),
        "--rm-type",
        "math",
        "--output-dir",
        str(tmp_path / "out"),
    ]


def test_shape_flags_disagreeing_with_config_json_are_each_named(tmp_path):
    job = _megatron_job(tmp_path)
    problems = _problems(
        [*job, "--train-backend", "megatron", "--hidden-size", "64", "--num-query-groups", "4", "--swiglu"]
    )
    assert any(p.startswith("--hidden-size 64 disagrees with") and "hidden_size gives 48" in p for p in problems)
    assert any(p.startswith("--num-query-groups 4") and "num_key_value_heads gives 2" in p for p in problems)
    assert not any(p.startswith("--swiglu") for p in problems)  # agrees


def test_megatron_flags_under_the_torch_backend_are_named(tmp_path):
    argv = [*_megatron_job(tmp_path), "--train-backend", "torch", "--tensor-model-parallel-size", "2"]
    problems = _problems([*argv, "--lr-decay-style", "cosine"])
    for name in ("--tensor-model-parallel-size", "--lr-decay-style"):
        assert any(p.startswith(f"{name}: a Megatron flag") for p in problems), problems


def test_unsupported_megatron_combinations_are_refused_naming_the_flag(tmp_path):
    job = [*_megatron_job(tmp_path), "--train-backend", "megatron", "--actor-num-gpus-per-node", "4"]
    problems = _problems(
        [
            *job,
            "--tensor-model-parallel-size",
            "4",
            "--context-parallel-size",
            "2",
            "--recompute-granularity",
            "full",
            "--lr-warmup-iters",
            "3",
            "--lr-warmup-fraction",
            "0.1",
        ]
    )
    assert any(p.startswith("--tensor-model-parallel-size 4 must divide num_key_value_heads 2") for p in problems)
    assert any(p.startswith("--context-parallel-size 2") and "Transformer Engine" in p for p in problems)
    assert any(p.startswith("--recompute-granularity full needs --recompute-method") for p in problems)
    assert any(p.startswith("--lr-warmup-fraction and --lr-warmup-iters") for p in problems)


def test_bare_bf16_is_megatrons_switch():
    from runtime.config import build_parser

    parser = build_parser()
    assert parser.parse_args(["--bf16"]).bf16 == "true"
    assert parser.parse_args(["--bf16", "false"]).bf16 == "false"
    assert not hasattr(parser.parse_args([]), "bf16")  # absent: the default, auto
