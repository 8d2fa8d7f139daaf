"""Time one weight sync per transport for tensor sets of real model shapes, and print GB/s.

    python tools/bench_weight_sync.py                                  # qwen3-0.6b and qwen3-4b, every CPU transport
    python tools/bench_weight_sync.py --models qwen3-0.6b --transports gloo disk
    python tools/bench_weight_sync.py --transports nccl                # two GPUs: NCCL broadcast between them
    python tools/bench_weight_sync.py --transports ipc                 # one GPU: CUDA IPC to a colocated process

The tensors are those of the ``runtime.demo.tiny_model`` presets (the models' real shapes, bf16, tied weights once),
cut into buckets of ``--bucket-mb`` MiB as ``TrainBackend.weight_buckets`` cuts them. Each transport moves every
bucket from a sender to one receiver the way the runtime does, and only the moving is timed (a bucket is built
before its clock starts, and the receiver confirms it has each bucket before the clock stops):

- ``disk``: safetensors written to a temporary folder and read back (``--update-weight-transport disk``);
- ``object_store``: ``ray.put`` and a Ray actor that reads the bucket (the embedded engine's default);
- ``ipc``: handles to the sender's memory (CUDA IPC on GPU 0, shared memory on the CPU) sent to another process,
  which copies each bucket before it answers (``--update-weight-transport ipc``, colocated engines);
- ``gloo`` / ``nccl``: a ``torch.distributed`` broadcast from rank 0 to rank 1 in another process, over the group
  ``runtime.engines.weight_transfer`` makes (``--update-weight-transport nccl``; gloo on the CPU), one flat buffer
  per bucket as the runtime sends it; ``nccl_per_tensor``: one broadcast per tensor instead, for comparison.

One bucket is in memory at a time on each side, so a 4B model needs about two buckets of memory, not 8 GB.
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from runtime.engines import weight_transfer
from runtime.engines.launcher import free_port

# Qwen3-4B's shape (Qwen/Qwen3-4B config.json); the other fields as Qwen3-0.6B's.
QWEN3_4B = {
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": True,
}
# For the table: the link each transport crosses.
LINKS = {
    "disk": "page cache / disk",
    "object_store": "shared memory",
    "gloo": "TCP loopback",
    "nccl": "NVLink, one flat buffer per bucket",
    "nccl_per_tensor": "NVLink, one broadcast per tensor",
    "ipc": "CUDA IPC (GPU) or shared memory (CPU), one device",
}


def model_fields(name: str) -> tuple[str, dict]:
    """The transformers model type and config fields of ``name``: a ``runtime.demo.tiny_model`` preset, or Qwen3-4B
    (its config.json's shape fields), which is not one."""
    from runtime.demo.tiny_model import PRESETS

    if name == "qwen3-4b":
        return "qwen3", {**PRESETS["qwen3-0.6b"].fields, **QWEN3_4B}
    if name not in PRESETS:
        raise SystemExit(f"unknown model {name!r}: qwen3-4b or one of {sorted(PRESETS)}")
    return PRESETS[name].model_type, dict(PRESETS[name].fields)


def model_shapes(name: str) -> list[tuple[str, tuple[int, ...]]]:
    """The weight names and shapes of ``name`` (tied weights once), from a ``meta``-device model: no memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields = model_fields(name)
    config = AutoConfig.for_model(model_type, **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    seen, out = set(), []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out.append((name, tuple(tensor.shape)))
    return out


def bucket_plan(shapes: list[tuple[str, tuple[int, ...]]], bucket_bytes: int, dtype: torch.dtype) -> list[list]:
    """The names and shapes of each bucket, cut as ``weight_buckets`` cuts them (a larger tensor goes alone)."""
    size_of = torch.empty((), dtype=dtype).element_size()
    buckets, current, size = [], [], 0
    for name, shape in shapes:
        nbytes = size_of * int(torch.Size(shape).numel())
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def materialise(plan: list, dtype: torch.dtype, device: str = "cpu") -> dict[str, torch.Tensor]:
    return {name: torch.ones(shape, dtype=dtype, device=device) for name, shape in plan}


def buckets_of(plans: list, dtype: torch.dtype, device: str = "cpu") -> Iterator[dict[str, torch.Tensor]]:
    for plan in plans:
        yield materialise(plan, dtype, device)


# ---------------------------------------------------------------- transports


def time_disk(plans: list, dtype: torch.dtype) -> float:
    from safetensors.torch import load_file, save_file

    folder = Path(tempfile.mkdtemp(prefix="bench-weights-"))
    total = 0.0
    try:
        for i, bucket in enumerate(buckets_of(plans, dtype)):
            path = folder / f"model-{i:05d}.safetensors"
            start = time.perf_counter()
            save_file(bucket, str(path))
            loaded = load_file(str(path))
            sum(t.nbytes for t in loaded.values())
            total += time.perf_counter() - start
            path.unlink()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return total


def time_object_store(plans: list, dtype: torch.dtype) -> float:
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Receiver:
        def load(self, bucket: dict[str, torch.Tensor]) -> int:
            return sum(t.clone().nbytes for t in bucket.values())

    receiver = Receiver.remote()
    ray.get(receiver.load.remote({}))
    total = 0.0
    for bucket in buckets_of(plans, dtype):
        start = time.perf_counter()
        ray.get(receiver.load.remote(ray.put(bucket)))
        total += time.perf_counter() - start
    if started:
        ray.shutdown()
    return total


def _receive(port: int, plans: list, dtype: torch.dtype, backend: str, rounds: int, load_format: str | None) -> None:
    device = "cuda:1" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(1)
    group = weight_transfer.init_weights_update_group(
        master_address="127.0.0.1", master_port=port, rank=1, world_size=2, backend=backend
    )
    # The engine's weights, which every received bucket is copied into (as HFEngine.load_weights copies it).
    model = {name: torch.empty(shape, dtype=dtype, device=device) for plan in plans for name, shape in plan}
    ack = torch.zeros(1, device=device)
    torch.distributed.broadcast(ack, src=1, group=group)  # the sender's untimed warm-up
    peak = torch.empty(PEAK_BYTES // dtype.itemsize, dtype=dtype, device=device)
    torch.distributed.broadcast(peak, src=0, group=group)
    torch.distributed.broadcast(ack, src=1, group=group)
    del peak
    for _ in range(rounds):
        for plan in plans:
            names = [n for n, _ in plan]
            dtypes = [weight_transfer.dtype_name(dtype)] * len(plan)
            shapes = [list(s) for _, s in plan]
            bucket = weight_transfer.receive_bucket(
                group, names, dtypes, shapes, device=device, load_format=load_format
            )
            for name, value in bucket.items():
                model[name].copy_(value)
        torch.distributed.broadcast(ack, src=1, group=group)  # every bucket is in the model
    weight_transfer.destroy_group(group)


# Bytes of the one broadcast that measures the link's peak (the floor's bandwidth).
PEAK_BYTES = 1 << 30


def time_broadcast(
    plans: list, dtype: torch.dtype, backend: str, rounds: int = 3, load_format: str | None = weight_transfer.FLAT
) -> tuple[float, float]:
    """Seconds of one push (the median of ``rounds``) and the link's peak bytes/s (one broadcast of
    ``PEAK_BYTES``). A push is what ``TrainerWorker.broadcast_buckets`` does over NCCL: each bucket cast from the
    trainer's float32 weights to ``dtype`` on its GPU, packed into one flat buffer (``load_format``, the runtime's;
    None: one broadcast per tensor, as before), its broadcast started, and only then the previous one waited on (so
    one bucket is cast while the other is in flight); the clock stops when the receiver has copied every bucket into
    its model."""
    device = "cuda:0" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(0)
    port = free_port()
    receiver = multiprocessing.get_context("spawn").Process(
        target=_receive, args=(port, plans, dtype, backend, rounds, load_format)
    )
    receiver.start()
    group = weight_transfer.init_weights_update_group(
        master_address="127.0.0.1", master_port=port, rank=0, world_size=2, backend=backend
    )
    sync = torch.cuda.synchronize if backend == "nccl" else (lambda: None)
    ack = torch.zeros(1, device=device)
    # One untimed broadcast first: NCCL builds its communicator on the first collective.
    torch.distributed.broadcast(ack, src=1, group=group)
    peak = torch.ones(PEAK_BYTES // dtype.itemsize, dtype=dtype, device=device)
    sync()
    start = time.perf_counter()
    torch.distributed.broadcast(peak, src=0, group=group)
    torch.distributed.broadcast(ack, src=1, group=group)
    sync()
    peak_rate = PEAK_BYTES / (time.perf_counter() - start)
    del peak
    # The trainer's float32 weights: all on the GPU (as a trainer holds them); on the CPU one bucket at a time, so that
    # a 4B model needs no 16 GB of host memory.
    on_gpu = backend == "nccl"
    masters = [materialise(p, torch.float32, device) for p in plans] if on_gpu else None
    times = []
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        in_flight = None
        for i, plan in enumerate(plans):
            master = masters[i] if on_gpu else materialise(plan, torch.float32)
            bucket = {name: value.to(dtype) for name, value in master.items()}
            started = weight_transfer.start_bucket(group, bucket, device=device, load_format=load_format)
            if in_flight is not None:
                weight_transfer.finish_bucket(group, in_flight)
            in_flight = started
        weight_transfer.finish_bucket(group, in_flight)
        torch.distributed.broadcast(ack, src=1, group=group)
        sync()
        times.append(time.perf_counter() - start)
    weight_transfer.destroy_group(group)
    receiver.join()
    return sorted(times)[len(times) // 2], peak_rate


def _take_handles(conn, dtype: torch.dtype) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        torch.zeros(1, device="cuda")  # the CUDA context, as a running engine has it
    conn.send(True)
    while (payload := conn.recv()) is not None:
        named = weight_transfer.deserialize_named_tensors(payload)
        # As the engine loads a bucket: a copy into its own weights, finished before it answers.
        copies = [t.clone() for _, t in named]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        del named, copies
        conn.send(True)


def time_ipc(plans: list, dtype: torch.dtype) -> float:
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    receiver = ctx.Process(target=_take_handles, args=(theirs, dtype))
    receiver.start()
    mine.recv()
    # One untimed bucket first: an engine has taken weights before (the first handle opened costs extra).
    warm = materialise(plans[0][:1], dtype, device)
    mine.send(weight_transfer.serialize_named_tensors(list(warm.items())))
    mine.recv()
    total = 0.0
    for bucket in buckets_of(plans, dtype, device):
        if device != "cpu":
            torch.cuda.synchronize()
        start = time.perf_counter()
        mine.send(weight_transfer.serialize_named_tensors(list(bucket.items())))
        mine.recv()
        total += time.perf_counter() - start
    mine.send(None)
    receiver.join()
    return total


TRANSPORTS = {
    "ipc": time_ipc,
    "disk": time_disk,
    "object_store": time_object_store,
    "gloo": lambda plans, dtype: time_broadcast(plans, dtype, "gloo", rounds=1),
    "nccl": lambda plans, dtype: time_broadcast(plans, dtype, "nccl"),
    # The same with one broadcast per tensor (the runtime before flat buckets), for comparison.
    "nccl_per_tensor": lambda plans, dtype: time_broadcast(plans, dtype, "nccl", load_format=None),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b", "qwen3-4b"])
    parser.add_argument("--transports", nargs="+", default=["disk", "object_store", "gloo"], choices=list(TRANSPORTS))
    parser.add_argument("--bucket-mb", type=int, default=512, help="bucket size (--update-weight-buffer-size)")
    args = parser.parse_args()
    if any(t.startswith("nccl") for t in args.transports) and torch.cuda.device_count() < 2:
        raise SystemExit("nccl needs two GPUs")
    dtype = torch.bfloat16
    print(
        "| model | transport | link | GB | buckets | seconds | GB/s | link peak GB/s | floor s (GB / peak) |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    for model in args.models:
        plans = bucket_plan(model_shapes(model), args.bucket_mb * 1024**2, dtype)
        gb = sum(torch.Size(s).numel() for p in plans for _, s in p) * dtype.itemsize / 1e9
        for transport in args.transports:
            measured = TRANSPORTS[transport](plans, dtype)
            # The broadcasts also measure their link's peak, whose floor is the least time the bytes can take.
            seconds, peak = measured if isinstance(measured, tuple) else (measured, None)
            floor = f"| {peak / 1e9:.1f} | {gb / (peak / 1e9):.4f} |" if peak else "| - | - |"
            print(
                f"| {model} | {transport} | {LINKS[transport]} | {gb:.2f} | {len(plans)} | {seconds:.4f} "
                f"| {gb / seconds:.2f} {floor}",
                flush=True,
            )


if __name__ == "__main__":
    main()
