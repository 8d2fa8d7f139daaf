"""Flat buckets in the NCCL weight sync (``runtime.engines.weight_transfer.FLAT``, SGLang 0.5.23's
``load_format="flattened_bucket"``): each bucket crosses as one ``uint8`` buffer of its tensors' bytes back to back,
one broadcast per bucket, and the engine unpacks views of it. On the CPU over gloo, where the same code runs."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.engines import weight_transfer

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8]


def _bytes_back_to_back(bucket: dict[str, torch.Tensor]) -> torch.Tensor:
    # SGLang's FlattenedTensorBucket layout, written independently: each tensor's bytes, in order, no padding.
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in bucket.values()])


@st.composite
def buckets(draw):
    dtype = draw(st.sampled_from(DTYPES))  # one dtype, as the trainer sends (the engines' dtype)
    n = draw(st.integers(1, 6))
    shapes = draw(st.lists(st.lists(st.integers(0, 5), max_size=3), min_size=n, max_size=n))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    bucket = {}
    for i, shape in enumerate(shapes):
        raw = torch.randint(-100, 100, shape, generator=gen) if not dtype.is_floating_point else torch.randn(shape)
        value = raw.to(dtype) if dtype != torch.uint8 else raw.abs().to(dtype)
        # A transposed (non-contiguous) tensor as the trainer may hold one.
        bucket[f"w{i}"] = value.t() if value.dim() == 2 and draw(st.booleans()) else value
    return bucket


@settings(max_examples=60, deadline=None)
@given(bucket=buckets())
def test_a_packed_bucket_is_its_tensors_bytes_back_to_back_and_unpacks_bit_for_bit(bucket):
    flat = weight_transfer.pack_bucket(bucket)
    assert flat.dtype == torch.uint8 and torch.equal(flat, _bytes_back_to_back(bucket))
    out = weight_transfer.unpack_bucket(flat, *weight_transfer.bucket_meta(bucket))
    assert list(out) == list(bucket)
    for name, value in bucket.items():
        assert out[name].dtype == value.dtype and out[name].shape == value.shape and torch.equal(out[name], value)
        assert out[name].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()  # a view, no copy


def test_a_flat_bucket_refuses_what_sglang_refuses():
    with pytest.raises(ValueError, match="at least one tensor"):
        weight_transfer.flat_layout([], [], [])
    # A bf16 tensor of 3 elements leaves the float32 after it at byte 6, which cannot be viewed as float32.
    bucket = {"a": torch.zeros(3, dtype=torch.bfloat16), "b": torch.zeros(2)}
    with pytest.raises(ValueError, match="tensor 'b' of a flat bucket starts at byte 6"):
        weight_transfer.pack_bucket(bucket)
    with pytest.raises(ValueError, match="load_format must be one of"):
        weight_transfer.start_bucket(None, {"a": torch.zeros(1)}, load_format="flat")
    with pytest.raises(ValueError, match="is 8 uint8 bytes"):
        weight_transfer.unpack_bucket(torch.zeros(7, dtype=torch.uint8), ["b"], ["float32"], [[2]])


def _send(port: int, buckets: list, load_format: str | None) -> None:
    group = weight_transfer.init_weights_update_group(
        master_address="127.0.0.1", master_port=port, rank=0, world_size=2, group_name="flat", backend="gloo"
    )
    in_flight = None
    for bucket in buckets:  # the next bucket's broadcast starts before the one before it is waited on
        started = weight_transfer.start_bucket(group, bucket, load_format=load_format)
        if in_flight is not None:
            weight_transfer.finish_bucket(group, in_flight)
        in_flight = started
    weight_transfer.finish_bucket(group, in_flight)
    weight_transfer.destroy_group(group)


@pytest.mark.parametrize("load_format", [weight_transfer.FLAT, None])
def test_one_broadcast_per_flat_bucket_over_gloo(load_format, monkeypatch):
    from runtime.engines.launcher import free_port

    gen = torch.Generator().manual_seed(0)
    buckets = [
        {"embed": torch.randn(64, 16, generator=gen).to(torch.bfloat16)},  # a tensor that is a bucket of its own
        {f"layer.{i}": torch.randn(i + 1, 8, generator=gen).to(torch.bfloat16) for i in range(5)},
    ]
    port = free_port()
    sender = multiprocessing.get_context("spawn").Process(target=_send, args=(port, buckets, load_format))
    sender.start()
    calls = []
    broadcast = torch.distributed.broadcast
    monkeypatch.setattr(
        torch.distributed, "broadcast", lambda t, *a, **k: calls.append(t.numel()) or broadcast(t, *a, **k)
    )
    try:
        group = weight_transfer.init_weights_update_group(
            master_address="127.0.0.1", master_port=port, rank=1, world_size=2, group_name="flat", backend="gloo"
        )
        got = [
            weight_transfer.receive_bucket(group, *weight_transfer.bucket_meta(b), load_format=load_format)
            for b in buckets
        ]
        weight_transfer.destroy_group(group)
    finally:
        sender.join(60)
    assert sender.exitcode == 0
    for bucket, received in zip(buckets, got, strict=True):
        assert list(received) == list(bucket) and all(torch.equal(received[n], bucket[n]) for n in bucket)
    per_bucket = [sum(t.nbytes for t in b.values()) for b in buckets]
    expected = per_bucket if load_format else [t.numel() for b in buckets for t in b.values()]
    assert calls == expected  # flat: one broadcast of each bucket's bytes; else one per tensor


@pytest.mark.slow  # about 100 s on a loaded 2-core machine (four Ray actors); the unit tests above run by default
def test_dp_trainers_push_flat_buckets_to_two_engines(tmp_path):
    """Two data-parallel trainers (FSDP over gloo) and two embedded engines loaded from another checkpoint: one push
    over the weight-update group leaves both engines holding the trainers' weights bit for bit in their dtype, with
    buckets no larger than the limit unless one tensor is (then it goes alone), the tied embedding sent once."""
    import ray

    from runtime.cluster.engines import EngineGroup
    from runtime.cluster.placement import create_placement
    from runtime.cluster.trainers import TrainerGroup
    from runtime.cluster.weight_sync import DistributedSync, make_weight_sync
    from runtime.config import from_dict, validate
    from runtime.demo import task
    from runtime.demo.tiny_model import make_tiny_model
    from runtime.train.algo import loss_config, model_roles, role_paths

    trainer_path = str(make_tiny_model(tmp_path / "a", alphabet=task.ALPHABET, seed=0))
    engine_path = str(make_tiny_model(tmp_path / "b", alphabet=task.ALPHABET, seed=1))
    settings = {"hf_checkpoint": trainer_path, "actor_num_gpus_per_node": 2, "rollout_num_gpus": 2, "num_rollout": 1}
    settings.update(rollout_max_response_len=2, rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=4)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        cfg = validate(from_dict(None, output_dir=str(tmp_path / "out"), **settings))
        placement = create_placement(cfg)
        trainers = TrainerGroup(
            placement,
            backend="torch",
            model_path=trainer_path,
            roles=model_roles(cfg),
            role_paths=role_paths(cfg),
            train_cfg=cfg.train,
            loss_cfg=loss_config(cfg),
            temperature=1.0,
            seed=0,
        )
        engines = EngineGroup(cfg, placement, engine_path)
        weights = trainers.get_weights()
        dtype = getattr(torch, engines.weight_dtype())
        embed = weights["model.embed_tokens.weight"].to(dtype)
        assert "lm_head.weight" not in weights  # tied: the embedding stands for both
        # A limit one byte under the largest tensors (the MLP's): each of them is a bucket of its own, over it.
        sizes = {k: v.to(dtype).nbytes for k, v in weights.items()}
        limit = max(sizes.values()) - 1
        big = [s for s in sizes.values() if s > limit]
        sync = make_weight_sync(trainers, engines, bucket_bytes=limit, kind="nccl")
        try:
            assert isinstance(sync, DistributedSync) and sync.backend == "gloo"
            before = ray.get(engines.actors[0].get_weights.remote())
            assert not torch.equal(before["model.embed_tokens.weight"], embed)
            sync.push(3)
            for engine_weights in ray.get([a.get_weights.remote() for a in engines.actors]):
                for name, value in weights.items():
                    assert torch.equal(engine_weights[name], value.to(dtype)), name
            assert engines.weight_versions() == [3, 3]
            assert sum(sync.bucket_sizes) == sum(v.to(dtype).nbytes for v in weights.values())
            over = [s for s in sync.bucket_sizes if s > limit]
            assert over == big and len(sync.bucket_sizes) > len(big)  # one bucket per tensor larger than a bucket
        finally:
            sync.close()
            engines.shutdown()
            trainers.shutdown()
    finally:
        ray.shutdown()
