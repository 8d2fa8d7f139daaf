"""Build a random-init HF-format causal LM and its character tokenizer into a folder: the tiny Llama or a preset.

Without ``--preset`` it is the tiny Llama of the default job; ``--preset`` picks a full-size shape for benchmarks.

    python tools/make_tiny_model.py OUTPUT_DIR [--hidden-size 64 --layers 2 --heads 4 --alphabet 0123456789cru=]
    python tools/make_tiny_model.py --preset qwen3-0.6b OUTPUT_DIR

The folder loads with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained`` and can be passed
to ``rlcore-run --hf-checkpoint``. The logic lives in ``runtime.demo.tiny_model`` (the runtime builds the same tiny
model); its docstring describes the presets.
"""

from __future__ import annotations

import argparse
import time

from runtime.demo import task
from runtime.demo.tiny_model import PRESETS, TinyModelSpec, make_preset_model, make_tiny_model

# Flag -> TinyModelSpec field; these size the tiny Llama and do not apply to a preset.
TINY_FLAGS = {
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "max_positions": "max_position_embeddings",
}


def main(argv: list[str] | None = None) -> None:
    defaults = TinyModelSpec()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a full-size preset instead of the tiny Llama")
    parser.add_argument("--alphabet", default=task.ALPHABET, help="characters of the tokenizer (default: the task's)")
    parser.add_argument("--seed", type=int, default=0)
    tiny = parser.add_argument_group("tiny Llama sizes (without --preset)")
    for flag, field in TINY_FLAGS.items():
        tiny.add_argument(f"--{flag.replace('_', '-')}", type=int, help=f"default {getattr(defaults, field)}")
    args = parser.parse_args(argv)
    given = [flag for flag in TINY_FLAGS if getattr(args, flag) is not None]
    start = time.perf_counter()
    if args.preset is None:
        spec = TinyModelSpec(**{TINY_FLAGS[flag]: getattr(args, flag) for flag in given})
        path = make_tiny_model(args.output_dir, alphabet=args.alphabet, spec=spec, seed=args.seed)
    elif given:
        flags = ", ".join(f"--{flag.replace('_', '-')}" for flag in given)
        parser.error(f"{flags} size the tiny Llama and do not apply to --preset {args.preset}")
    else:
        path = make_preset_model(args.preset, args.output_dir, alphabet=args.alphabet, seed=args.seed)
    print(f"{args.preset or 'tiny model'} written to {path} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
