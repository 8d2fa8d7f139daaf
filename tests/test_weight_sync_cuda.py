"""Weight sync between processes on one GPU (CUDA IPC handles, ``--update-weight-transport ipc``), and the whole
colocated job on one GPU with the weights checked after the sync. Skipped without CUDA."""

import json
import multiprocessing
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from runtime.demo import task
from runtime.demo.tiny_model import make_preset_model
from runtime.engines import weight_transfer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _engine_process(path: str, conn) -> None:
    from runtime.engines import HFEngine

    engine = HFEngine(path, seed=0)
    while (msg := conn.recv()) is not None:
        payload, version = msg
        engine.update_weights_from_tensor(payload, weight_version=version)
        conn.send(engine.weight_version())
    # As plain arrays: a CPU tensor sent through a pipe would point at this process's memory, gone once it exits.
    conn.send({k: v.float().numpy() for k, v in engine.get_weights().items()})


def test_ipc_handles_load_the_trainers_weights_into_an_engine_process(tmp_path):
    path = str(make_preset_model("qwen3-0.6b", tmp_path / "m", alphabet=task.ALPHABET, seed=0, num_hidden_layers=2))
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    weights, seen = {}, set()
    for name, t in trainer.state_dict().items():  # tied weights once, as weight_buckets sends them
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            weights[name] = t.to(torch.bfloat16)
    names = list(weights)
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_engine_process, args=(path, theirs))
    proc.start()
    try:
        half = len(names) // 2
        for part, version in ((names[:half], None), (names[half:], 3)):
            bucket = [(n, weights[n]) for n in part]
            mine.send((weight_transfer.serialize_named_tensors(bucket), version))
            assert mine.recv() == (0 if version is None else 3)
        mine.send(None)
        got = mine.recv()
    finally:
        proc.join(timeout=60)
    for name, value in weights.items():
        assert torch.equal(torch.from_numpy(got[name]), value.float().cpu()), name


def test_the_default_job_colocates_on_one_gpu_and_syncs_by_ipc(tmp_path, monkeypatch):
    """The default job on one GPU: the weight sync it builds is IPC (no other transport is built), every push moves
    the whole model, and ``--check-weight-update-equal`` finds the engine's weights equal to the trainer's."""
    from runtime.cluster import weight_sync
    from runtime.config import parse_args
    from runtime.loop import run

    built, pushed = [], []

    def recording(kind, make):
        def build(*args, **kwargs):
            sync = make(*args, **kwargs)
            built.append(kind)
            push = sync.push

            def push_and_record(version):
                push(version)
                pushed.append((kind, version, getattr(sync, "bytes_sent", None)))

            sync.push = push_and_record
            return sync

        return build

    for kind, make in list(weight_sync.WEIGHT_SYNCS.items()):
        monkeypatch.setitem(weight_sync.WEIGHT_SYNCS, kind, recording(kind, make))
    # One GPU: on more, the default plan splits trainer and engine and syncs by NCCL (runtime/cluster/plan.py).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    out = tmp_path / "out"
    cfg = parse_args(["--num-rollout", "3", "--check-weight-update-equal", "--output-dir", str(out)])
    result = run(cfg, progress=False)
    assert built == ["ipc"], built
    assert len(pushed) >= 3 and {kind for kind, _, _ in pushed} == {"ipc"}, pushed
    sizes = {size for _, _, size in pushed}
    assert len(sizes) == 1 and sizes.pop() > 0, pushed  # the whole model each time, not a part or nothing
    rows = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        print({k: round(v, 3) for k, v in row.items() if k.startswith("perf/") and isinstance(v, float)})
