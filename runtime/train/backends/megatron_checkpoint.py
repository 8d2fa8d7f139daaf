"""Megatron distributed checkpoints (``torch_dist``, megatron-core's ``dist_checkpointing``): where they are, and how
one saved at one tensor/pipeline layout loads at another.

A ``torch_dist`` folder holds ``.metadata``, ``__*_*.distcp`` shards, ``common.pt`` (what is not sharded: here the
LR schedule, the optimizer's step, ``args`` and the HF ``config.json``) and ``metadata.json``. Tensors are stored
whole, under the names of megatron-core's Transformer Engine layer spec (the local spec maps its own names onto them),
so a checkpoint saved at TP=1 loads at TP=2, and checkpoints of slime (``tools/convert_hf_to_torch_dist.py``,
``--save``) load here and ours there. Megatron-LM's save roots hold ``latest_checkpointed_iteration.txt`` (a step,
or ``release``) and ``iter_0000012/`` or ``release/`` folders: :func:`find_checkpoint` resolves them as Megatron does.

One thing is not independent of the layout: Megatron pads the vocabulary to a multiple of 128 x TP, so the embedding
and output layer of a checkpoint saved at another TP may have other row counts. :func:`load_sharded` reads those whole
and cuts this rank's rows (:func:`vocab_shard_rows`); the padding rows carry no token.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from runtime.train.backends.megatron_config import ModelShape, padded_vocab_size
from runtime.train.backends.megatron_moe import split_whole_experts

# Where checkpoints are (torch-free: the config checks read them): megatron_paths; re-exported here.
from runtime.train.backends.megatron_paths import (  # noqa: E402, F401
    COMMON_FILE,
    FORMAT_FILE,
    TRACKER,
    find_checkpoint,
    is_checkpoint_folder,
    iteration_folder,
)


def vocab_shard_rows(full: torch.Tensor, *, vocab_size: int, padded_rows: int, start: int, count: int) -> torch.Tensor:
    """Rows ``[start, start + count)`` of ``full`` (``[saved_rows, ...]``, a vocabulary padded to any size
    >= ``vocab_size``) re-padded to ``padded_rows``: the first ``vocab_size`` rows are the tokens', the rest zeros.

    Shapes: ``full [R_saved, *rest]`` -> ``[count, *rest]``."""
    if full.shape[0] < vocab_size:
        raise ValueError(f"the saved tensor has {full.shape[0]} rows, fewer than the vocabulary of {vocab_size}")
    if not 0 <= start <= start + count <= padded_rows or padded_rows < vocab_size:
        raise ValueError(
            f"rows [{start}, {start + count}) do not lie in a padded vocabulary of {padded_rows} >= {vocab_size}"
        )
    out = full.new_zeros(count, *full.shape[1:])
    stop = min(start + count, vocab_size)
    if stop > start:
        out[: stop - start] = full[start:stop]
    return out


def model_args(shape: ModelShape, *, tp_size: int, pp_size: int, padded_vocab_size: int) -> argparse.Namespace:
    """The Megatron-LM ``args`` kept in ``common.pt`` (slime's ``convert_torch_dist_to_hf.py`` reads them)."""
    return argparse.Namespace(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        group_query_attention=shape.num_query_groups != shape.num_attention_heads,
        kv_channels=shape.kv_channels,
        vocab_size=shape.vocab_size,
        padded_vocab_size=padded_vocab_size,
        max_position_embeddings=shape.max_position_embeddings,
        rotary_base=shape.rotary_base,
        norm_epsilon=shape.norm_epsilon,
        qk_layernorm=shape.qk_layernorm,
        add_qkv_bias=shape.add_qkv_bias,
        untie_embeddings_and_output_weights=not shape.tie_embeddings,
        normalization=shape.normalization,
        swiglu=shape.swiglu,
        num_experts=None,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        decoder_first_pipeline_num_layers=shape.first_stage_layers,
        decoder_last_pipeline_num_layers=shape.last_stage_layers,
        ckpt_format="torch_dist",
    )


def _walk(tree: Any, visit: Callable[[tuple[Any, ...], Any], Any], path: tuple[Any, ...] = ()) -> Any:
    """``tree`` (nested dicts and lists) with every leaf replaced by ``visit(its path, leaf)``."""
    if isinstance(tree, dict):
        return {k: _walk(v, visit, (*path, k)) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_walk(v, visit, (*path, i)) for i, v in enumerate(tree)]
    return visit(path, tree)


def save_sharded(sharded: dict[str, Any], folder: str | os.PathLike[str]) -> None:
    """Write the sharded state dict ``sharded`` (every rank its own shards, one copy of each replica) into the empty
    or missing folder ``folder`` (a collective)."""
    from megatron.core import dist_checkpointing

    Path(folder).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(sharded, str(folder))


def load_sharded(sharded: dict[str, Any], folder: str | os.PathLike[str], *, vocab_size: int) -> dict[str, Any]:
    """Load the sharded state dict ``sharded`` from ``folder`` (a collective); returns it with tensors in place of
    shards. Tensors whose saved global shape differs from the requested one in its first axis only (a vocabulary
    padded for another TP) are read whole and cut with :func:`vocab_shard_rows`; any other difference raises
    ``ValueError`` naming the tensor."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    saved = dist_checkpointing.load_tensors_metadata(str(folder))
    refit: dict[tuple[Any, ...], ShardedTensor] = {}

    def plan(path: tuple[Any, ...], leaf: Any) -> Any:
        if not isinstance(leaf, ShardedTensor) or leaf.key not in saved:
            return leaf
        want, have = tuple(leaf.global_shape), tuple(saved[leaf.key].global_shape)
        if want == have:
            return leaf
        if len(want) != len(have) or want[1:] != have[1:]:
            raise ValueError(
                f"{folder}: {leaf.key} is saved with shape {have}, this model wants {want} (another model?)"
            )
        if leaf.flattened_range is not None:
            raise ValueError(
                f"{folder}: {leaf.key} is the distributed optimizer's state of a vocabulary padded to {have[0]} rows "
                f"(another TP), this layout pads to {want[0]}: Megatron's flattened optimizer shards cannot be "
                f"re-padded; resume with --padded-vocab-size {have[0]} (when it splits over this TP), at a TP whose "
                "padded vocabulary matches, or from a checkpoint saved without the optimizer (--no-save-optim)"
            )
        refit[path] = leaf
        # Every rank reads the whole tensor: one of them (rank 0) is its main replica, the others copies.
        return ShardedTensor.from_rank_offsets(
            leaf.key,
            torch.empty(have, dtype=saved[leaf.key].dtype, device=leaf.data.device),
            replica_id=dist.get_rank() if dist.is_initialized() else 0,
        )

    request = _walk(sharded, plan)
    loaded = dist_checkpointing.load(request, str(folder))
    if not refit:
        return loaded

    def cut(path: tuple[Any, ...], leaf: Any) -> Any:
        if path in refit:
            want = refit[path]
            rows = vocab_shard_rows(
                leaf,
                vocab_size=vocab_size,
                padded_rows=want.global_shape[0],
                start=want.global_offset[0],
                count=want.local_shape[0],
            )
            return rows.to(want.data.dtype)
        return leaf

    return _walk(loaded, cut)


# Names in a torch_dist checkpoint (Transformer Engine's spec) of the local spec's per-layer norms.
_TE_LAYER_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


# An optimizer entry of a torch_dist checkpoint: ``optimizer.state.<moment>.<tensor>``, or under a chained optimizer's
# part (megatron-core's ChainedOptimizer prefixes each part's keys, ``chained_<i>.``: on GPUs a MoE model's optimizer
# is two parts, dense and experts).
_OPTIMIZER_KEY = re.compile(r"(chained_\d+\.)?optimizer\.")


def is_optimizer_key(key: str) -> bool:
    """Whether ``key`` of a ``torch_dist`` checkpoint is optimizer state (a chained part's too)."""
    return _OPTIMIZER_KEY.match(key) is not None


def read_model_tensors(folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every model tensor of the ``torch_dist`` folder, whole, by its checkpoint name (optimizer state and
    non-tensor entries left out), in one process: no process group, no megatron-core."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(folder))
    metadata = reader.read_metadata().state_dict_metadata
    state = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in metadata.items()
        if isinstance(entry, TensorStorageMetadata) and not is_optimizer_key(key)
    }
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def local_state_from_whole(tensors: Mapping[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """The state of a TP=1, PP=1 ``GPTModel`` (local spec names, one entry per layer, the vocabulary padded to a
    multiple of 128) from a checkpoint's whole tensors (Transformer Engine names, decoder tensors stacked over layers
    in their first axis or one per layer, a layer's experts stacked, the vocabulary padded for any TP).
    ``ValueError`` naming a tensor whose layer count differs from ``shape``'s."""
    padded = padded_vocab_size(shape.vocab_size, tp_size=1)
    out: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if key.startswith("decoder.layers."):
            rest = key[len("decoder.layers.") :]
            head, _, tail = rest.partition(".")
            if head.isdigit():
                # One tensor per layer: megatron-core's non-homogeneous layers (a MoE model's list --moe-layer-freq).
                layers = [(int(head), _TE_LAYER_NAMES.get(tail, tail), value)]
            elif value.shape[0] != shape.num_layers:
                raise ValueError(f"{key} stacks {value.shape[0]} layers, config.json has {shape.num_layers}")
            else:
                rest = _TE_LAYER_NAMES.get(rest, rest)
                layers = [(layer, rest, value[layer]) for layer in range(shape.num_layers)]
            for layer, name, tensor in layers:
                # A layer's experts are one tensor in the checkpoint, one each in the model.
                for local, part in (split_whole_experts(name, tensor) or {name: tensor}).items():
                    out[f"decoder.layers.{layer}.{local}"] = part
        elif key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            out[key] = vocab_shard_rows(value, vocab_size=shape.vocab_size, padded_rows=padded, start=0, count=padded)
        else:
            out[key] = value
    return out


def hf_state_from_checkpoint(folder: str | os.PathLike[str], shape: ModelShape) -> dict[str, torch.Tensor]:
    """The HF state dict (tied weights once) of the ``torch_dist`` folder, checked tensor by tensor against
    ``shape`` (:func:`runtime.train.backends.megatron_weights.to_hf`)."""
    from runtime.train.backends.megatron_weights import to_hf

    return to_hf([[local_state_from_whole(read_model_tensors(folder), shape)]], shape)


def read_common(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """``common.pt`` of the ``torch_dist`` folder (the LR schedule, ``args``, and ours also the HF config)."""
    return torch.load(Path(folder) / COMMON_FILE, map_location="cpu", weights_only=False)


__all__ = [
    "TRACKER",
    "find_checkpoint",
    "hf_state_from_checkpoint",
    "is_checkpoint_folder",
    "is_optimizer_key",
    "iteration_folder",
    "load_sharded",
    "local_state_from_whole",
    "model_args",
    "read_common",
    "read_model_tensors",
    "save_sharded",
    "vocab_shard_rows",
]
