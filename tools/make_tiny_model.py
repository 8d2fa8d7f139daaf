"""Build the tiny HF-format causal LM of the default job (random-init Llama + character tokenizer) into a folder.

    python tools/make_tiny_model.py OUTPUT_DIR [--hidden-size 64 --layers 2 --heads 4 --alphabet 0123456789cru=]

The folder loads with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained`` and can be passed
to ``rlcore-run --hf-checkpoint``. The logic lives in ``runtime.demo.tiny_model`` (the runtime builds the same).
"""

from __future__ import annotations

import argparse

from runtime.demo import task
from runtime.demo.tiny_model import TinyModelSpec, make_tiny_model


def main(argv: list[str] | None = None) -> None:
    defaults = TinyModelSpec()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir")
    parser.add_argument("--alphabet", default=task.ALPHABET, help="characters of the tokenizer (default: the task's)")
    parser.add_argument("--hidden-size", type=int, default=defaults.hidden_size)
    parser.add_argument("--intermediate-size", type=int, default=defaults.intermediate_size)
    parser.add_argument("--layers", type=int, default=defaults.num_hidden_layers)
    parser.add_argument("--heads", type=int, default=defaults.num_attention_heads)
    parser.add_argument("--max-positions", type=int, default=defaults.max_position_embeddings)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    spec = TinyModelSpec(
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        max_position_embeddings=args.max_positions,
    )
    path = make_tiny_model(args.output_dir, alphabet=args.alphabet, spec=spec, seed=args.seed)
    print(f"tiny model written to {path}")


if __name__ == "__main__":
    main()
