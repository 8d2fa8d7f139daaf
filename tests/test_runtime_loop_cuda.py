"""The runtime's GPU paths (bf16 engine and trainer, FSDP2 over NCCL), in-process without Ray. Skipped without CUDA.

These run on a GPU machine (``pytest -q tests/test_runtime_loop_cuda.py``); CI has none and skips them.
"""

import io
import socket

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoTokenizer

from rlcore import keys
from rlcore.advantages import compute
from runtime.config import from_dict, validate
from runtime.demo import task
from runtime.demo.tiny_model import make_tiny_model
from runtime.engines import HFEngine, SamplingParams
from runtime.rollout.sample import Sample
from runtime.train.algo import advantage_config, loss_config, model_roles
from runtime.train.backends.torch_backend import TorchTrainer
from runtime.train.batch import build_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SMALL = {"rollout_batch_size": 4, "n_samples_per_prompt": 4, "global_batch_size": 16, "micro_batch_size": 4}


def _cfg(tmp_path, **overrides):
    return validate(from_dict(None, output_dir=str(tmp_path / "out"), lr=1e-3, **{**SMALL, **overrides}))


def _rollout_batch(engine, tokenizer, *, seed):
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in task.make_records(4, seed=seed) for _ in range(4)]
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=6))
    samples = []
    for i, (prompt, g) in enumerate(zip(prompts, gens, strict=True)):
        s = Sample(group_index=i // 4, tokens=prompt + g.token_ids, response_length=len(g.token_ids))
        s.rollout_log_probs = g.log_probs
        s.reward = float(i % 4) / 3
        samples.append(s)
    return build_batch(samples, pad_token_id=tokenizer.pad_token_id)


def test_bf16_engine_and_trainer_on_one_gpu(tmp_path):
    path = str(make_tiny_model(tmp_path / "tiny", alphabet=task.ALPHABET, seed=0))
    tokenizer = AutoTokenizer.from_pretrained(path)
    cfg = _cfg(tmp_path, use_kl_loss=True)
    engine = HFEngine(path, seed=0)
    assert engine.device.type == "cuda" and next(engine.model.parameters()).dtype == torch.bfloat16
    trainer = TorchTrainer(
        path, train_cfg=cfg.train, loss_cfg=loss_config(cfg), temperature=1.0, roles=model_roles(cfg), seed=0
    )
    assert trainer.bf16
    td = _rollout_batch(engine, tokenizer, seed=1)
    td.update(trainer.compute_log_probs(td))
    mask = td[keys.MASK]
    # bf16 engine weights vs fp32 weights under bf16 autocast: close, not equal (what --use-tis corrects for).
    gap = (td[keys.OLD_LOG_PROBS] - td[keys.ROLLOUT_LOG_PROBS])[mask].abs().mean()
    assert gap < 0.05
    metrics = trainer.train(compute(td, advantage_config(cfg)), per_step_rows=16)
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0
    weights = trainer.get_weights()
    for bucket in trainer.weight_buckets(dtype=torch.bfloat16, bucket_bytes=1 << 20):
        engine.load_weights(bucket)
    engine.load_weights({}, weight_version=1)
    assert engine.weight_version() == 1
    for name, value in engine.get_weights().items():
        source = weights.get(name, weights.get("model.embed_tokens.weight"))
        assert torch.equal(value, source.to(value.dtype)), name
    engine.release_memory()
    held = torch.cuda.memory_allocated()
    moved = trainer.release_memory()  # bucketed copies to pinned host buffers (runtime.train.offload)
    assert trainer.host_offload is not None and moved["perf/offload_train_bytes"] > 0
    assert torch.cuda.memory_allocated() <= held - moved["perf/offload_train_bytes"] + (1 << 20)
    assert set(trainer.resume_memory()) == {"perf/offload_train_resume_time"}
    for name, value in trainer.get_weights().items():
        assert torch.equal(value, weights[name]), name
    engine.resume_memory()
    assert engine.generate([tokenizer("c12=")["input_ids"]], SamplingParams(max_new_tokens=3))[0].token_ids


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fsdp_rank(rank, world_size, port, path, cfg, td, out):
    # One GPU per process, as Ray gives each trainer actor (CUDA is already initialised: pick it by index).
    torch.cuda.set_device(rank)
    trainer = TorchTrainer(
        path,
        train_cfg=cfg.train,
        loss_cfg=loss_config(cfg),
        temperature=1.0,
        roles=model_roles(cfg),
        seed=0,
        rank=rank,
        world_size=world_size,
        master_port=port,
    )
    per_rank = td.batch_size[0] // world_size
    shard = td[rank * per_rank : (rank + 1) * per_rank]
    metrics = trainer.train(shard, per_step_rows=per_rank)
    weights = trainer.get_weights()
    if rank == 0:
        # As bytes, not tensors: a queued tensor is shared through a file descriptor that this process must still
        # be alive to hand over, and it may exit before the parent reads the queue (FileNotFoundError, seen on four
        # H200s at a2a812d).
        buffer = io.BytesIO()
        torch.save((metrics, {k: v.detach().cpu() for k, v in weights.items()}), buffer)
        out.put(buffer.getvalue())
    trainer.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_fsdp_over_nccl_gives_the_single_gpu_gradient(tmp_path):
    path = str(make_tiny_model(tmp_path / "tiny", alphabet=task.ALPHABET, seed=0))
    tokenizer = AutoTokenizer.from_pretrained(path)
    cfg = _cfg(tmp_path, bf16="false", actor_num_gpus_per_node=2, micro_batch_size=2)
    engine = HFEngine(path, seed=0, dtype="float32")
    td = _rollout_batch(engine, tokenizer, seed=2)
    single = TorchTrainer(
        path, train_cfg=cfg.train, loss_cfg=loss_config(cfg), temperature=1.0, roles=model_roles(cfg), seed=0
    )
    td.update(single.compute_log_probs(td))
    td = compute(td, advantage_config(cfg))
    expected = single.train(td, per_step_rows=16)

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_fsdp_rank, args=(r, 2, port, path, cfg, td, out)) for r in range(2)]
    for p in procs:
        p.start()
    got, weights = torch.load(io.BytesIO(out.get(timeout=300)))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for name in ("grad_norm", "pg_loss", "loss", "clipfrac"):
        assert got[name] == pytest.approx(expected[name], rel=1e-4, abs=1e-6), name
    assert set(weights) == set(single.get_weights())
