"""A tiny HF-format causal LM with its own character-level tokenizer, for the default CPU job and tests.

The model is a randomly initialised transformers ``LlamaForCausalLM``; the tokenizer is built with the ``tokenizers``
library (one token per character of an alphabet, plus ``<pad>``, ``<bos>``, ``<eos>``, ``<unk>``) and wrapped in a
``PreTrainedTokenizerFast``. Both are written with ``save_pretrained`` so that the runtime loads them from the folder
exactly like a downloaded checkpoint (``AutoModelForCausalLM`` / ``AutoTokenizer``). ``tools/make_tiny_model.py`` is
the command-line front end.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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


def build_tokenizer(alphabet: str):
    """Return a ``PreTrainedTokenizerFast`` with one token per character of ``alphabet``.

    Encoding prepends ``<bos>``; decoding concatenates characters without separators, so ``decode(encode(s))``
    gives ``s`` back for any string over the alphabet.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if not isinstance(alphabet, str) or not alphabet:
        raise ValueError(f"alphabet must be a non-empty string, got {alphabet!r}")
    chars = list(dict.fromkeys(alphabet))
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *chars])}
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
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    return out
