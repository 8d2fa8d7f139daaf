"""Convert a Megatron ``torch_dist`` checkpoint (Llama, Qwen2, Qwen3; ours or slime's) into an HF folder that
``AutoModelForCausalLM.from_pretrained`` loads: the job of slime's ``tools/convert_torch_dist_to_hf.py``, with its
flags, in one process without megatron-core or a GPU.

    python tools/convert_megatron_to_hf.py --input-dir /ckpt/iter_0000100 --output-dir /models/out \\
        [--origin-hf-dir /models/Qwen3-4B] [--chunk-size BYTES] [--vocab-size N] [--dtype bfloat16] [-f]

``--input-dir`` is a checkpoint folder or a Megatron-LM save root (its ``latest_checkpointed_iteration.txt``).
The architecture comes from ``--origin-hf-dir``'s ``config.json`` (whose tokenizer and other files are copied too),
or, for checkpoints written by rlcore, from the HF config kept in ``common.pt``. Every tensor is checked for name and
shape against that config; a mismatch stops the conversion naming the tensor and the config field. Weights keep the
checkpoint's dtype unless ``--dtype`` (ours) casts them; the vocabulary padding is cut off.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

DTYPES = ("bfloat16", "float16", "float32")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="convert_megatron_to_hf.py", description=__doc__.splitlines()[0])
    parser.add_argument("--input-dir", required=True, help="the torch_dist folder (or a Megatron-LM save root)")
    parser.add_argument("--output-dir", required=True, help="the HF folder to write")
    parser.add_argument(
        "--origin-hf-dir", default=None, help="HF folder whose config.json, tokenizer and other files go along"
    )
    parser.add_argument(
        "--model-name",
        default=None,
        help="slime's: the weight mapping by slime's name rules (llama, qwen2, qwen3; e.g. qwen3config), checked "
        "against config.json; MoE names are refused",
    )
    parser.add_argument("-f", "--force", action="store_true", help="replace --output-dir if it exists")
    parser.add_argument(
        "--chunk-size", type=int, default=5 * 1024**3, help="bytes per safetensors file (default 5 GiB)"
    )
    parser.add_argument(
        "--vocab-size", type=int, default=None, help="the vocabulary without padding (default: config.json's)"
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="ours: cast the weights (default: keep the checkpoint's; rlcore's converter stores float32)",
    )
    return parser


def _hf_config(input_folder: Path, origin: str | None) -> dict:
    from runtime.train.backends import megatron_checkpoint as mck

    if origin is not None:
        path = os.path.join(origin, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"--origin-hf-dir {origin}: no config.json")
        with open(path) as fh:
            return json.load(fh)
    common = mck.read_common(input_folder)
    if "hf_config" not in common:
        raise ValueError(
            f"--input-dir {input_folder}: not written by rlcore (no HF config in it): pass --origin-hf-dir"
        )
    return common["hf_config"]


def write_safetensors(state: dict, output: Path, *, chunk_size: int) -> None:
    """``state`` as ``model-0000i-of-0000n.safetensors`` files of up to ``chunk_size`` bytes (a larger tensor gets a
    file of its own) and their ``model.safetensors.index.json``."""
    from safetensors.torch import save_file

    chunks: list[dict] = [{}]
    size = total = 0
    for name, tensor in state.items():
        if chunks[-1] and size + tensor.nbytes > chunk_size:
            chunks.append({})
            size = 0
        chunks[-1][name] = tensor.contiguous()
        size += tensor.nbytes
        total += tensor.nbytes
    weight_map = {}
    for i, chunk in enumerate(chunks):
        filename = f"model-{i + 1:05d}-of-{len(chunks):05d}.safetensors"
        save_file(chunk, str(output / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, filename))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (output / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def convert(
    input_dir: str,
    output_dir: str,
    *,
    origin_hf_dir: str | None = None,
    model_name: str | None = None,
    vocab_size: int | None = None,
    chunk_size: int = 5 * 1024**3,
    force: bool = False,
    dtype: str | None = None,
) -> Path:
    """Write the HF folder ``output_dir`` from the checkpoint ``input_dir``; ``ValueError`` naming the flag or the
    tensor on bad input."""
    from runtime.train.backends import megatron_checkpoint as mck
    from runtime.train.backends import megatron_config as mc

    if chunk_size < 1:
        raise ValueError(f"--chunk-size must be >= 1, got {chunk_size}")
    folder = mck.find_checkpoint(input_dir, flag="--input-dir")
    if folder is None:
        raise ValueError(f"--input-dir {input_dir}: no torch_dist checkpoint (no metadata.json, no {mck.TRACKER})")
    config = _hf_config(folder, origin_hf_dir)
    if model_name is not None:
        mc.mapping_of_name(model_name)  # a family rlcore does not build is refused before config.json is read
    if vocab_size is not None:
        config = {**config, "vocab_size": vocab_size}
    shape = mc.shape_from_hf(config, source=f"{origin_hf_dir or folder}/config.json")
    if model_name is not None:
        mc.weight_mapping(model_name, shape)
    state = mck.hf_state_from_checkpoint(folder, shape)
    if dtype is not None:
        import torch

        if dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        state = {name: tensor.to(getattr(torch, dtype)) for name, tensor in state.items()}
    output = Path(output_dir)
    if output.exists():
        if not force:
            raise ValueError(f"--output-dir {output_dir} exists (add -f to replace it)")
        shutil.rmtree(output)
    output.mkdir(parents=True)
    write_safetensors(state, output, chunk_size=chunk_size)
    if origin_hf_dir is not None:
        for entry in sorted(Path(origin_hf_dir).iterdir()):
            weights = entry.suffix == ".safetensors" or entry.name == "model.safetensors.index.json"
            if entry.is_file() and not weights and not entry.name.endswith(".bin"):
                shutil.copy(entry, output / entry.name)
    if not (output / "config.json").exists():
        (output / "config.json").write_text(json.dumps(config, indent=2))
    return output


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        output = convert(
            args.input_dir,
            args.output_dir,
            origin_hf_dir=args.origin_hf_dir,
            model_name=args.model_name,
            vocab_size=args.vocab_size,
            chunk_size=args.chunk_size,
            force=args.force,
            dtype=args.dtype,
        )
    except (ValueError, OSError) as err:
        print(f"convert_megatron_to_hf.py: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
