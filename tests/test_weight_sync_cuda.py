"""Weight sync between processes on one GPU (CUDA IPC handles, ``--update-weight-transport ipc``), and the whole
colocated job on one GPU with the weights checked after the sync. Skipped without CUDA."""

import json
import multiprocessing
import subprocess
import sys

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


def test_the_default_job_colocates_on_one_gpu_and_syncs_by_ipc(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "runtime.cli", "--num-rollout", "3", "--check-weight-update-equal",
           "--output-dir", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:
        print({k: round(v, 3) for k, v in row.items() if k.startswith("perf/") and isinstance(v, float)})
