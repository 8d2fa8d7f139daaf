"""Convert an HF checkpoint (Llama, Qwen2, Qwen3) into a Megatron ``torch_dist`` checkpoint: the job of slime's
``tools/convert_hf_to_torch_dist.py``, on one process and the CPU (no GPU, no torchrun).

    python tools/convert_hf_to_megatron.py --hf-checkpoint /models/Qwen3-4B --save /ckpt/Qwen3-4B_torch_dist \\
        [MODEL_ARGS ...]

The output is laid out as Megatron-LM's save root: ``release/`` (the checkpoint) and
``latest_checkpointed_iteration.txt`` holding ``release``; ``rlcore-run --train-backend megatron`` takes it as
``--load`` or ``--ref-load``, and so does slime. Tensors are stored whole (float32, as the HF weights are read), so it
loads at any TP/PP layout. slime's model-shape flags (``--num-layers``, ``--hidden-size``, ...) may be passed as its
run scripts do: each must agree with ``config.json``, which builds the model; other Megatron flags are ignored, with a
note. The model is built once in float32 on the CPU (about twice the model's float32 size in memory).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

SHAPE_ONLY = "the model is built from config.json"
# slime's converter flags that are rlcore-run's train flags too: the weight mapping's name and the vocabulary rows.
CONVERTER_TRAIN_FIELDS = ("model_name", "padded_vocab_size")


def parse(argv: Sequence[str] | None) -> tuple[str, str, dict, bool, list[str]]:
    """``(hf_checkpoint, save, model flags given, force, notes)``: the model flags are the shape flags and slime's
    ``--model-name`` and ``--padded-vocab-size``; ``SystemExit(2)`` with one line per problem."""
    from runtime import slime_flags
    from runtime.config import MODEL_SHAPE_FIELDS, build_parser
    from runtime.train.backends.megatron_options import MEGATRON_TRAIN_FIELDS

    parser = build_parser()
    parser.prog = "convert_hf_to_megatron.py"
    parser.usage = "convert_hf_to_megatron.py --hf-checkpoint HF_DIR --save OUT_DIR [-f] [MODEL_ARGS ...]"
    parser.add_argument("-f", "--force", action="store_true", help="replace --save if it exists")
    parsed, extras = parser.parse_known_args(argv)
    given = vars(parsed)
    problems, notes = [], slime_flags.pop_megatron_switches(given)
    for arg in slime_flags.unknown_flags(extras):
        name = arg.split("=", 1)[0]
        if name in slime_flags.MEGATRON_FLAGS:
            notes.append(name)
        else:
            problems.append(slime_flags.unknown_flag_problem(arg))
    for name in ("hf_checkpoint", "save"):
        if given.get(name) is None:
            problems.append(f"--{name.replace('_', '-')} is required")
    used = {"hf_checkpoint", "save", "force", *MODEL_SHAPE_FIELDS, *CONVERTER_TRAIN_FIELDS}
    # torch_dist is layout-free: a checkpoint converted once loads at any TP and any (even or uneven) pipeline stages.
    layout = {
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "decoder_first_pipeline_num_layers",
        "decoder_last_pipeline_num_layers",
    }
    # Megatron's training flags that slime's MODEL_ARGS carry (--moe-grouped-gemm, --moe-router-bias-update-rate):
    # noted and ignored, as its other Megatron flags are.
    training = sorted(set(given) & set(MEGATRON_TRAIN_FIELDS) - used - layout)
    notes += [f"--{n.replace('_', '-')}" for n in training]
    ignored = sorted(set(given) - used - layout - set(training))
    if ignored:
        problems.append("not used by the converter: " + ", ".join(f"--{n.replace('_', '-')}" for n in ignored))
    if problems:
        print("convert_hf_to_megatron.py: " + "\n  ".join(problems), file=sys.stderr)
        raise SystemExit(2)
    shape_flags = {name: given[name] for name in (*MODEL_SHAPE_FIELDS, *CONVERTER_TRAIN_FIELDS) if name in given}
    return given["hf_checkpoint"], given["save"], shape_flags, bool(given.get("force")), notes


def convert(hf_checkpoint: str, save: str, *, shape_flags: dict | None = None, force: bool = False) -> Path:
    """Write ``save/release`` and ``save/latest_checkpointed_iteration.txt`` from ``hf_checkpoint``; returns the
    checkpoint folder. ``ValueError`` naming the field for a checkpoint or a flag that disagrees with config.json."""
    import json
    import shutil

    from rlcore.losses import LossConfig
    from runtime.cluster.placement import free_port
    from runtime.config import from_dict
    from runtime.train.backends import megatron_checkpoint as mck
    from runtime.train.backends import megatron_config as mc
    from runtime.train.backends.megatron_backend import MegatronTrainer

    source = os.path.join(hf_checkpoint, "config.json")
    if not os.path.isfile(source):
        raise ValueError(f"--hf-checkpoint {hf_checkpoint}: no config.json")
    with open(source) as fh:
        shape = mc.shape_from_hf(json.load(fh), source=source)
    shape_flags = dict(shape_flags or {})
    train_flags = {name: shape_flags.pop(name) for name in CONVERTER_TRAIN_FIELDS if name in shape_flags}
    problems = mc.shape_flag_problems(shape_flags, shape, source=source)
    if problems:
        raise ValueError("; ".join(problems))
    root = Path(save)
    if root.exists() and any(root.iterdir()):
        if not force:
            raise ValueError(f"--save {save} exists and is not empty (add -f to replace it)")
        shutil.rmtree(root)
    cfg = from_dict(None, train_backend="megatron", hf_checkpoint=hf_checkpoint, **train_flags)
    trainer = MegatronTrainer(
        hf_checkpoint,
        train_cfg=cfg.train,
        loss_cfg=LossConfig(),
        temperature=1.0,
        seed=0,
        master_port=free_port(),
        device="cpu",
    )
    try:
        folder = mck.iteration_folder(root, "release")
        trainer.save_model(str(folder))
    finally:
        trainer.shutdown()
    (root / mck.TRACKER).write_text("release")
    return folder


def main(argv: Sequence[str] | None = None) -> None:
    hf_checkpoint, save, shape_flags, force, notes = parse(argv)
    if notes:
        print(f"convert_hf_to_megatron.py: ignored ({SHAPE_ONLY}): {' '.join(notes)}", file=sys.stderr)
    try:
        folder = convert(hf_checkpoint, save, shape_flags=shape_flags, force=force)
    except (ValueError, OSError) as err:
        print(f"convert_hf_to_megatron.py: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {folder}")


if __name__ == "__main__":
    main()
