"""Random-init HF-format causal LMs with a character-level tokenizer: the tiny one of the default job, and presets.

The model is a randomly initialised transformers ``LlamaForCausalLM``; the tokenizer is built with the ``tokenizers``
library (one token per character of an alphabet, plus ``<pad>``, ``<bos>``, ``<eos>``, ``<unk>``) and wrapped in a
``PreTrainedTokenizerFast``. Both are written with ``save_pretrained`` so that the runtime loads them from the folder
exactly like a downloaded checkpoint (``AutoModelForCausalLM`` / ``AutoTokenizer``). ``tools/make_tiny_model.py`` is
the command-line front end.

``PRESETS`` adds random-init models of other shapes and families; ``make_preset_model`` builds one. Besides
``qwen3-0.6b`` (below): tiny models of the MoE and GLM families (``tiny-qwen3-moe``, ``tiny-glm4-moe``,
``tiny-deepseek-v3``, ``tiny-moonlight``, ``tiny-glm4``: 64 wide, 2 layers, float32, the character tokenizer unpadded,
each with its family's distinguishing parts: routers, shared experts, dense first layers, MLA with and without a query
LoRA, partial rotary, YaRN), and real shapes cut to 2 layers for GPU tests and benchmarks (``qwen3-30b-a3b-2layers``,
``moonlight-16b-a3b-2layers``; shapes from slime's ``scripts/models/qwen3-30B-A3B.sh`` and ``moonlight.sh``). A
preset's ``vocab_size`` of None means the character tokenizer's own size.

``qwen3-0.6b``: a transformers ``Qwen3ForCausalLM`` with Qwen3-0.6B's shape, 596,049,920 parameters (155,582,464 of
them in the embedding, which the LM head shares), saved in bfloat16 safetensors (1.19 GB). Checked against
Qwen/Qwen3-0.6B's ``config.json``: https://huggingface.co/Qwen/Qwen3-0.6B/tree/main lists it at 726 bytes, and the
726-byte copy at https://huggingface.co/TensorStack/TextEncoder/blob/main/Qwen-3-06B/config.json reads hidden_size
1024, intermediate_size 3072, num_hidden_layers 28, num_attention_heads 16, num_key_value_heads 8, head_dim 128,
rms_norm_eps 1e-6, rope_theta 1e6, max_position_embeddings 40960, tie_word_embeddings true, vocab_size 151936,
hidden_act silu, attention_bias false, use_sliding_window false. Qwen3's QK-norm is part of ``Qwen3Attention`` and
needs no field. ``max_position_embeddings`` costs no memory: rotary angles are computed for the positions in use.
Building takes about 20 s and 3.3 GiB of memory on two CPU cores (float32 init, then cast).

The tokenizer is the character tokenizer over the task alphabet, its WordLevel vocabulary padded with ``<extra_N>``
tokens up to the model's vocab size, so that ``len(tokenizer) == config.vocab_size`` and the task's prompts encode to
the same ids as with the tiny tokenizer. The filler lives in the vocabulary, not in added tokens: with 150k added
tokens ``AutoTokenizer.from_pretrained`` takes about 7 s, with the padded vocabulary about 0.5 s.

The model is not kept from emitting EOS; it is merely improbable. EOS is one token in V = 151,936 and the random init
gives it no special weight: over 8 sampled responses of 128 tokens from the seed-0 build the mean probability of EOS
per step was 6.7e-6, i.e. 1/V. A response of T tokens therefore ends early with a probability of about
1 - (1 - 1/V)^T (0.7% for T = 1024), and benchmarks run their responses to the maximum length but for that rare case.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)


@dataclass(frozen=True)
class TinyModelSpec:
    """Sizes of the tiny model. The defaults train at a few steps per second on two CPU cores."""

    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    max_position_embeddings: int = 64


def build_tokenizer(alphabet: str, *, vocab_size: int | None = None):
    """Return a ``PreTrainedTokenizerFast`` with one token per character of ``alphabet``.

    Encoding prepends ``<bos>``; decoding concatenates characters without separators, so ``decode(encode(s))``
    gives ``s`` back for any string over the alphabet. With ``vocab_size``, filler tokens ``<extra_0>``, ``<extra_1>``,
    ... follow the characters until ``len(tokenizer) == vocab_size``; encoding never produces them, so the ids of any
    string are those without filler.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if not isinstance(alphabet, str) or not alphabet:
        raise ValueError(f"alphabet must be a non-empty string, got {alphabet!r}")
    chars = list(dict.fromkeys(alphabet))
    tokens = [*SPECIAL_TOKENS, *chars]
    if vocab_size is not None:
        if vocab_size < len(tokens):
            raise ValueError(f"vocab_size must be at least {len(tokens)} (specials + alphabet), got {vocab_size}")
        tokens += [f"<extra_{i}>" for i in range(vocab_size - len(tokens))]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK, padding_side="left"
    )


def make_tiny_model(
    output_dir: str | Path, *, alphabet: str, spec: TinyModelSpec | None = None, seed: int = 0
) -> Path:
    """Build a random-init tiny Llama and its tokenizer and save both to ``output_dir``; return the folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = spec or TinyModelSpec()
    tokenizer = build_tokenizer(alphabet)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # The model is built on the CPU: leave every CUDA device's RNG alone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return _save(model, tokenizer, output_dir)


@dataclass(frozen=True)
class ModelPreset:
    """A named model shape: the transformers ``model_type``, the config fields that give the shape, the saved dtype."""

    model_type: str
    fields: Mapping[str, Any]
    dtype: str = "bfloat16"


def _fields(**fields: Any) -> Mapping[str, Any]:
    return MappingProxyType(fields)


# The tiny shared sizes of the MoE-family presets: trained on two CPU cores in the tests (vocab_size None: the
# character tokenizer's own size). Experts: 8 of width 32, 2 per token (DeepSeek-style: 16 in 4 groups, 4 per token,
# so that Megatron's group score, the sum of the top topk // group_topk = 2, is transformers' top-2 sum).
_TINY = {
    "vocab_size": None,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
_TINY_DEEPSEEK = {
    **_TINY,
    "num_key_value_heads": 4,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    # Unlike the query/key head (16 + 8), as in DeepSeek-V3 (128 vs 192): the attention output is sized by v_head_dim.
    "v_head_dim": 12,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
}

_MOE_PRESETS: dict[str, ModelPreset] = {
    # Qwen3-MoE (Qwen3-30B-A3B's layout): softmax router, top-k renormalised, QK-norm, every layer MoE.
    "tiny-qwen3-moe": ModelPreset(
        model_type="qwen3_moe",
        dtype="float32",
        fields=_fields(
            **_TINY,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        ),
    ),
    # GLM-4.5 (glm4_moe): sigmoid router with expert bias, a shared expert, the first layer dense, partial rotary 0.5,
    # a bias on q/k/v.
    "tiny-glm4-moe": ModelPreset(
        model_type="glm4_moe",
        dtype="float32",
        fields=_fields(
            **_TINY,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            partial_rotary_factor=0.5,
            attention_bias=True,
            use_qk_norm=False,
        ),
    ),
    # DeepSeek-V3: MLA with a query LoRA, group-limited sigmoid routing with expert bias, a shared expert, the first
    # layer dense, YaRN rotary.
    "tiny-deepseek-v3": ModelPreset(
        model_type="deepseek_v3",
        dtype="float32",
        fields=_fields(
            **_TINY_DEEPSEEK,
            q_lora_rank=32,
            n_group=4,
            topk_group=2,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10_000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        ),
    ),
    # Moonlight-16B-A3B's layout (deepseek_v3 without a query LoRA, one expert group).
    "tiny-moonlight": ModelPreset(
        model_type="deepseek_v3",
        dtype="float32",
        fields=_fields(
            **_TINY_DEEPSEEK,
            q_lora_rank=None,
            n_group=1,
            topk_group=1,
            rope_parameters={"rope_type": "default", "rope_theta": 50_000.0},
        ),
    ),
    # GLM-4 dense (GLM-4-9B's layout): norms after attention and after the MLP, interleaved partial rotary 0.5,
    # QKV bias.
    "tiny-glm4": ModelPreset(
        model_type="glm4",
        dtype="float32",
        fields=_fields(
            **_TINY,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            partial_rotary_factor=0.5,
            attention_bias=True,
        ),
    ),
    # Real shapes cut to a few layers, for GPU benchmarks and tests (the full models do not fit 1-4 GPUs for RL).
    # Qwen3-30B-A3B (slime's scripts/models/qwen3-30B-A3B.sh): 2 of its 48 layers.
    "qwen3-30b-a3b-2layers": ModelPreset(
        model_type="qwen3_moe",
        fields=_fields(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=2,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            hidden_act="silu",
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            max_position_embeddings=40960,
            tie_word_embeddings=False,
        ),
    ),
    # Moonlight-16B-A3B (slime's scripts/models/moonlight.sh): its first, dense layer and one MoE layer of 27.
    "moonlight-16b-a3b-2layers": ModelPreset(
        model_type="deepseek_v3",
        fields=_fields(
            vocab_size=163840,
            hidden_size=2048,
            intermediate_size=11264,
            moe_intermediate_size=1408,
            num_hidden_layers=2,
            num_attention_heads=16,
            num_key_value_heads=16,
            n_routed_experts=64,
            num_experts_per_tok=6,
            n_shared_experts=2,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.446,
            norm_topk_prob=True,
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 50_000.0},
            max_position_embeddings=8192,
            tie_word_embeddings=False,
        ),
    ),
}

PRESETS: Mapping[str, ModelPreset] = MappingProxyType(
    {
        "qwen3-0.6b": ModelPreset(
            model_type="qwen3",
            fields=MappingProxyType(
                {
                    "vocab_size": 151936,
                    "hidden_size": 1024,
                    "intermediate_size": 3072,
                    "num_hidden_layers": 28,
                    "num_attention_heads": 16,
                    "num_key_value_heads": 8,
                    "head_dim": 128,
                    "hidden_act": "silu",
                    "rms_norm_eps": 1e-6,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
                    "max_position_embeddings": 40960,
                    "attention_bias": False,
                    "use_sliding_window": False,
                    "tie_word_embeddings": True,
                }
            ),
        ),
        **_MOE_PRESETS,
    }
)


def preset_config(name: str, *, alphabet: str, **overrides: Any):
    """Return ``(config, tokenizer)`` of preset ``name``: its transformers config and the padded character tokenizer.

    ``overrides`` replace preset fields (e.g. ``num_hidden_layers=1`` for a shrunk model of the same code path); the
    tokenizer is padded to the resulting ``vocab_size`` and its special-token ids are written into the config.
    """
    from transformers import AutoConfig

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    preset = PRESETS[name]
    unknown = set(overrides) - set(preset.fields)
    if unknown:
        raise ValueError(
            f"overrides must be fields of preset {name!r} ({sorted(preset.fields)}), got {sorted(unknown)}"
        )
    fields = {**preset.fields, **overrides}
    tokenizer = build_tokenizer(alphabet, vocab_size=fields["vocab_size"])
    fields["vocab_size"] = len(tokenizer)
    config = AutoConfig.for_model(
        preset.model_type,
        **fields,
        dtype=preset.dtype,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return config, tokenizer


def make_preset_model(name: str, output_dir: str | Path, *, alphabet: str, seed: int = 0, **overrides: Any) -> Path:
    """Build preset ``name`` with random weights (CPU, ``seed``) and its tokenizer into ``output_dir``; return it.

    ``overrides`` are passed to ``preset_config``. The weights are initialised in float32 by the model's own
    ``_init_weights`` and saved in the preset's dtype.
    """
    import torch
    from transformers import AutoModelForCausalLM

    config, tokenizer = preset_config(name, alphabet=alphabet, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return _save(model.to(getattr(torch, PRESETS[name].dtype)), tokenizer, output_dir)


def _save(model, tokenizer, output_dir: str | Path) -> Path:
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    return out
