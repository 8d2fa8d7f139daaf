"""The ``qwen3-0.6b`` preset of runtime.demo.tiny_model: its config against Qwen3-0.6B's config.json, its parameter
count against a closed form, its padded tokenizer against the tiny one, and a shrunk build through the same code path.

The full-size build (1.2 GB, about 20 s) runs only with ``-m slow``.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

from runtime.demo import task
from runtime.demo.tiny_model import build_tokenizer, make_preset_model, preset_config

# Qwen/Qwen3-0.6B's config.json, the fields that fix the shape (sources in runtime/demo/tiny_model.py's docstring).
QWEN3_0_6B = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
    "attention_bias": False,
    "use_sliding_window": False,
}
QWEN3_0_6B_ROPE_THETA = 1_000_000
QWEN3_0_6B_PARAMETERS = 596_049_920

# A 1-layer, 64-wide model with the full 151936-token vocabulary: the preset's code path at test speed.
SHRUNK = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
}


def qwen3_parameter_count(*, vocab_size, hidden_size, intermediate_size, num_hidden_layers, head_dim, **sizes) -> int:
    """Parameters of a tied-embedding Qwen3 counted by hand: embedding, per layer q/k/v/o, QK-norm, MLP, two norms."""
    q_width = sizes["num_attention_heads"] * head_dim
    kv_width = sizes["num_key_value_heads"] * head_dim
    attention = hidden_size * q_width + 2 * hidden_size * kv_width + q_width * hidden_size + 2 * head_dim
    mlp = 3 * hidden_size * intermediate_size
    layer = attention + mlp + 2 * hidden_size
    return vocab_size * hidden_size + num_hidden_layers * layer + hidden_size


def test_preset_config_matches_qwen3_0_6b():
    config, tokenizer = preset_config("qwen3-0.6b", alphabet=task.ALPHABET)
    assert isinstance(config, Qwen3Config)
    assert {field: getattr(config, field) for field in QWEN3_0_6B} == QWEN3_0_6B
    assert config.rope_parameters["rope_theta"] == QWEN3_0_6B_ROPE_THETA
    assert config.rope_parameters["rope_type"] == "default"
    assert config.dtype == torch.bfloat16
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )


def test_preset_parameter_count():
    config, _ = preset_config("qwen3-0.6b", alphabet=task.ALPHABET)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (128,)
    assert sum(p.numel() for p in model.parameters()) == QWEN3_0_6B_PARAMETERS
    assert qwen3_parameter_count(**QWEN3_0_6B) == QWEN3_0_6B_PARAMETERS


def test_preset_tokenizer_is_padded_to_the_vocab_and_encodes_like_the_tiny_one():
    _, tokenizer = preset_config("qwen3-0.6b", alphabet=task.ALPHABET)
    tiny = build_tokenizer(task.ALPHABET)
    assert len(tokenizer) == QWEN3_0_6B["vocab_size"]
    prompts = [r["prompt"] for r in task.make_records(50, seed=0, spec=task.TaskSpec(min_len=1, max_len=6, ops="cru"))]
    assert tokenizer(prompts)["input_ids"] == tiny(prompts)["input_ids"]
    assert tokenizer.convert_ids_to_tokens([len(tiny), len(tokenizer) - 1]) == [
        "<extra_0>",
        f"<extra_{len(tokenizer) - len(tiny) - 1}>",
    ]


@given(text=st.text(alphabet=task.ALPHABET, max_size=20), vocab_size=st.integers(len(task.ALPHABET) + 4, 500))
def test_padded_tokenizer_round_trip(text, vocab_size):
    tokenizer = build_tokenizer(task.ALPHABET, vocab_size=vocab_size)
    ids = tokenizer(text)["input_ids"]
    assert len(tokenizer) == vocab_size
    assert ids == build_tokenizer(task.ALPHABET)(text)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_preset_arguments_are_checked():
    with pytest.raises(ValueError, match="unknown preset"):
        preset_config("qwen3-7b", alphabet=task.ALPHABET)
    with pytest.raises(ValueError, match="num_layers"):
        preset_config("qwen3-0.6b", alphabet=task.ALPHABET, num_layers=1)
    with pytest.raises(ValueError, match="vocab_size must be at least"):
        build_tokenizer(task.ALPHABET, vocab_size=len(task.ALPHABET))


def test_cli_rejects_tiny_sizes_with_a_preset(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(
        "make_tiny_model", Path(__file__).parents[1] / "tools/make_tiny_model.py"
    )
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    with pytest.raises(SystemExit):
        cli.main([str(tmp_path), "--preset", "qwen3-0.6b", "--layers", "1"])
    assert "--layers size the tiny Llama" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.fixture(scope="module")
def shrunk_model(tmp_path_factory) -> Path:
    return make_preset_model("qwen3-0.6b", tmp_path_factory.mktemp("shrunk"), alphabet=task.ALPHABET, seed=0, **SHRUNK)


def test_shrunk_build_loads_and_generates(shrunk_model):
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(shrunk_model)
    load_s = time.perf_counter() - start
    model = AutoModelForCausalLM.from_pretrained(shrunk_model)
    saved = json.loads((shrunk_model / "config.json").read_text())
    generation = json.loads((shrunk_model / "generation_config.json").read_text())

    assert load_s < 3.0
    assert len(tokenizer) == model.config.vocab_size == QWEN3_0_6B["vocab_size"]
    assert (saved["model_type"], saved["dtype"], saved["tie_word_embeddings"]) == ("qwen3", "bfloat16", True)
    assert generation["eos_token_id"] == tokenizer.eos_token_id
    assert model.dtype == torch.bfloat16
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == qwen3_parameter_count(**{**QWEN3_0_6B, **SHRUNK})

    batch = tokenizer(["c123=", "r45="], return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=6, do_sample=False)
    assert out.shape == (2, batch["input_ids"].shape[1] + 6)


def test_shrunk_build_is_seeded(shrunk_model, tmp_path):
    def weights(folder: Path) -> dict[str, torch.Tensor]:
        with safe_open(folder / "model.safetensors", framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}

    again = weights(make_preset_model("qwen3-0.6b", tmp_path / "a", alphabet=task.ALPHABET, seed=0, **SHRUNK))
    other = weights(make_preset_model("qwen3-0.6b", tmp_path / "b", alphabet=task.ALPHABET, seed=1, **SHRUNK))
    first = weights(shrunk_model)
    assert {t.dtype for t in first.values()} == {torch.bfloat16}
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


@pytest.mark.slow
def test_full_size_build(tmp_path):
    start = time.perf_counter()
    folder = make_preset_model("qwen3-0.6b", tmp_path / "qwen3-0.6b", alphabet=task.ALPHABET, seed=0)
    build_s = time.perf_counter() - start
    size = sum(f.stat().st_size for f in folder.iterdir())
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    print(f"qwen3-0.6b: built in {build_s:.1f} s, {size / 1e9:.2f} GB")

    assert sum(p.numel() for p in model.parameters()) == QWEN3_0_6B_PARAMETERS
    assert 2 * QWEN3_0_6B_PARAMETERS < size < 2 * QWEN3_0_6B_PARAMETERS + 20_000_000
    batch = tokenizer(["c123=", "r45="], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], QWEN3_0_6B["vocab_size"])
    assert torch.isfinite(logits).all()


# ---------------------------------------------------------------- MoE and GLM presets (issue 27)

# slime's scripts/models/qwen3-30B-A3B.sh (the fields that fix the shape), cut to 2 of its 48 layers.
QWEN3_30B_A3B = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "norm_topk_prob": True,
}


def qwen3_moe_parameter_count(config) -> int:
    """Parameters of an untied Qwen3-MoE counted by hand: embedding and LM head, per layer q/k/v/o, QK-norm, router,
    experts (gate, up, down each), two norms; the final norm."""
    h, layers = config.hidden_size, config.num_hidden_layers
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    attention = h * q + 2 * h * kv + q * h + 2 * config.head_dim
    moe = config.num_experts * h + config.num_experts * 3 * h * config.moe_intermediate_size
    return 2 * config.vocab_size * h + layers * (attention + moe + 2 * h) + h


def test_qwen3_30b_a3b_cut_to_two_layers():
    config, tokenizer = preset_config("qwen3-30b-a3b-2layers", alphabet=task.ALPHABET)
    assert config.model_type == "qwen3_moe" and config.num_hidden_layers == 2
    assert {field: getattr(config, field) for field in QWEN3_30B_A3B} == QWEN3_30B_A3B
    assert config.rope_parameters["rope_theta"] == 1_000_000 and len(tokenizer) == 151936
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == qwen3_moe_parameter_count(config)


def test_moonlight_cut_to_two_layers_keeps_its_dense_first_layer():
    config, _ = preset_config("moonlight-16b-a3b-2layers", alphabet=task.ALPHABET)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    dense, moe = model.model.layers
    assert not hasattr(dense.mlp, "experts") and moe.mlp.experts.gate_up_proj.shape == (64, 2 * 1408, 2048)
    assert moe.mlp.shared_experts.gate_proj.weight.shape == (2 * 1408, 2048)
    assert config.q_lora_rank is None and (config.kv_lora_rank, config.v_head_dim) == (512, 128)


TINY_FAMILIES = {
    "tiny-qwen3-moe": "qwen3_moe",
    "tiny-glm4-moe": "glm4_moe",
    "tiny-deepseek-v3": "deepseek_v3",
    "tiny-moonlight": "deepseek_v3",
    "tiny-glm4": "glm4",
}


@pytest.mark.parametrize("name", sorted(TINY_FAMILIES))
def test_tiny_family_presets_have_their_family_parts(name, tmp_path):
    config, tokenizer = preset_config(name, alphabet=task.ALPHABET)
    assert config.model_type == TINY_FAMILIES[name] and config.vocab_size == len(tokenizer)
    folder = make_preset_model(name, tmp_path / name, alphabet=task.ALPHABET, seed=0)
    model = AutoModelForCausalLM.from_pretrained(folder)
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        saved = set(f.keys())
    layers = model.model.layers
    if name == "tiny-glm4":
        assert layers[0].post_self_attn_layernorm is not None and config.partial_rotary_factor == 0.5
        assert layers[0].self_attn.q_proj.bias is not None
    else:
        moe = layers[-1].mlp
        experts = moe.experts.gate_up_proj.shape[0]
        # The checkpoint names one tensor per expert and projection, as real checkpoints do.
        assert f"model.layers.{len(layers) - 1}.mlp.experts.{experts - 1}.up_proj.weight" in saved
        assert not any("gate_up_proj" in key for key in saved)
    if name in ("tiny-glm4-moe", "tiny-deepseek-v3", "tiny-moonlight"):
        assert not hasattr(layers[0].mlp, "experts")  # the first layer dense
        assert layers[1].mlp.gate.e_score_correction_bias.shape == (config.n_routed_experts,)
        assert layers[1].mlp.shared_experts is not None
    if TINY_FAMILIES[name] == "deepseek_v3":
        assert config.v_head_dim != config.qk_nope_head_dim + config.qk_rope_head_dim
        assert (config.q_lora_rank is None) == (name == "tiny-moonlight")
        # Megatron scores a group by the sum of its top (topk // group_topk) experts, transformers by its top 2.
        assert config.n_group == 1 or config.num_experts_per_tok // config.topk_group == 2
    batch = tokenizer(["c123=", "r45="], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], len(tokenizer)) and torch.isfinite(logits).all()
