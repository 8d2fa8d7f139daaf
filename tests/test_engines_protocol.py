"""Conformance of every rollout engine to :class:`RolloutEngine`: each test runs on the embedded engine (in process)
and on the SGLang adapter (against ``tests/fake_sglang.py``), and together they call every method of the protocol.

A test declares the protocol methods it exercises with ``@covers``; the engine it gets records the calls, so a
declaration that the test does not make fails, and a protocol method that no test declares fails
:func:`test_every_protocol_method_is_covered`. Log-probs are checked against a float64 forward pass of the weights the
engine samples with.
"""

from __future__ import annotations

import copy
import inspect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from fake_sglang import FakeSGLangServer
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from runtime.demo import task
from runtime.demo.tiny_model import make_tiny_model
from runtime.engines import HFEngine, RolloutEngine, SamplingParams, SGLangEngine

PROTOCOL_METHODS = sorted(n for n, _ in inspect.getmembers(RolloutEngine, inspect.isfunction) if not n.startswith("_"))
ENGINE_CLASSES = {"hf": HFEngine, "sglang": SGLangEngine}
# Which tests call each protocol method, filled by @covers as the module is read.
COVERED: dict[str, list[str]] = {}


def covers(*methods: str) -> Callable:
    """Declare the protocol methods a test calls (checked against the calls it makes)."""
    unknown = set(methods) - set(PROTOCOL_METHODS)
    if unknown:
        raise ValueError(f"not methods of RolloutEngine: {sorted(unknown)}")

    def mark(test: Callable) -> Callable:
        test.protocol_methods = methods
        for m in methods:
            COVERED.setdefault(m, []).append(test.__name__)
        return test

    return mark


class Recorder:
    """Passes every attribute through to ``engine`` and notes which protocol methods were looked up."""

    def __init__(self, engine: RolloutEngine):
        self._engine, self.called = engine, set()

    def __getattr__(self, name: str):
        if name in PROTOCOL_METHODS:
            self.called.add(name)
        return getattr(self._engine, name)


@dataclass
class Rig:
    """An engine under test, the torch model that samples for it, and the checkpoints it can switch between."""

    engine: Recorder
    inner: RolloutEngine
    model: torch.nn.Module
    eos: int
    prompts: list[list[int]]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("protocol")
    return (
        make_tiny_model(root / "a", alphabet=task.ALPHABET, seed=0),
        make_tiny_model(root / "b", alphabet=task.ALPHABET, seed=1),
    )


@pytest.fixture(scope="module")
def other_weights(model_dirs) -> dict[str, torch.Tensor]:
    """Checkpoint B's weights as a trainer sends them: HF names, the tied lm_head once (as embed_tokens)."""
    state = AutoModelForCausalLM.from_pretrained(model_dirs[1]).state_dict()
    return {k: v.clone() for k, v in state.items() if k != "lm_head.weight"}


@pytest.fixture(params=sorted(ENGINE_CLASSES))
def rig(request, model_dirs):
    tokenizer = AutoTokenizer.from_pretrained(model_dirs[0])
    prompts = [tokenizer(text)["input_ids"] for text in ("12+3=", "7*8=", "45-9=", "6=")]
    if request.param == "hf":
        inner = HFEngine(str(model_dirs[0]), seed=0)
        yield from _run(request, Rig(Recorder(inner), inner, inner.model, tokenizer.eos_token_id, prompts))
    else:
        with FakeSGLangServer(model_dirs[0], seed=0) as server:
            inner = SGLangEngine(server.url, seed=0, timeout=60, startup_timeout=10)
            try:
                yield from _run(request, Rig(Recorder(inner), inner, server.model, tokenizer.eos_token_id, prompts))
            finally:
                inner.close()


def _run(request, rig: Rig):
    yield rig
    declared = set(getattr(request.function, "protocol_methods", ()))
    assert declared <= rig.engine.called, (
        f"declared with @covers but not called: {sorted(declared - rig.engine.called)}"
    )


@torch.no_grad()
def reference_log_probs(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """float64 ``log_softmax(logits / temperature)`` of each response token over the whole vocabulary."""
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def check_generations(rig: Rig, gens, temperature: float, *, max_new_tokens: int, version: int) -> None:
    """Each generation is consistent and its log-probs are the float64 recompute of the engine's current weights."""
    reference = copy.deepcopy(rig.model).to(torch.float64)
    assert len(gens) == len(rig.prompts)
    for prompt, g in zip(rig.prompts, gens, strict=True):
        assert len(g.token_ids) == len(g.log_probs) <= max_new_tokens and g.weight_version == version
        assert rig.eos not in g.token_ids[:-1]
        if g.finish_reason == "stop":
            assert g.token_ids[-1] == rig.eos
        elif g.finish_reason == "length":
            assert len(g.token_ids) == max_new_tokens
        else:
            assert g.finish_reason == "abort"
        if g.token_ids:
            got = torch.tensor(g.log_probs, dtype=torch.float64)
            torch.testing.assert_close(
                got, reference_log_probs(reference, prompt, g.token_ids, temperature), atol=1e-5, rtol=0
            )


def assert_weights_equal(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value.to(state[name].dtype), rtol=0, atol=0, msg=name)
    # Tied: lm_head is the embedding that was sent.
    torch.testing.assert_close(state["lm_head.weight"], state["model.embed_tokens.weight"], rtol=0, atol=0)


def test_every_protocol_method_is_covered():
    uncovered = sorted(set(PROTOCOL_METHODS) - set(COVERED))
    assert not uncovered, f"RolloutEngine methods no conformance test calls: {uncovered}"
    assert len(PROTOCOL_METHODS) >= 12 and "generate" in PROTOCOL_METHODS


@pytest.mark.parametrize("kind", sorted(ENGINE_CLASSES))
def test_implementations_take_the_protocols_arguments(kind):
    cls = ENGINE_CLASSES[kind]
    for name in PROTOCOL_METHODS:
        wanted = inspect.signature(getattr(RolloutEngine, name)).parameters
        got = inspect.signature(getattr(cls, name)).parameters
        for p in wanted.values():
            assert p.name in got and got[p.name].kind == p.kind, f"{cls.__name__}.{name} lacks {p}"
        extra = [p for n, p in got.items() if n not in wanted]
        assert all(p.default is not p.empty for p in extra), f"{cls.__name__}.{name}: {extra} have no default"


def test_engine_is_a_rollout_engine(rig):
    assert isinstance(rig.inner, RolloutEngine)


@covers("generate", "weight_version", "weight_dtype", "health")
def test_generate_samples_with_the_models_log_probs(rig):
    assert rig.engine.health() and rig.engine.weight_version() == 0
    assert rig.engine.weight_dtype() == str(next(rig.model.parameters()).dtype).removeprefix("torch.") == "float32"
    gens = rig.engine.generate(rig.prompts, SamplingParams(max_new_tokens=6, temperature=0.8))
    check_generations(rig, gens, 0.8, max_new_tokens=6, version=0)
    assert {g.finish_reason for g in gens} <= {"stop", "length"}


@covers("load_weights", "weight_version", "generate")
def test_load_weights_in_buckets_switches_to_the_new_weights(rig, other_weights):
    names = sorted(other_weights)
    first = {k: other_weights[k] for k in names[: len(names) // 2]}
    # The second bucket in float64: the engine converts to its own dtype.
    second = {k: other_weights[k].double() for k in names[len(names) // 2 :]}
    rig.engine.load_weights(first)
    assert rig.engine.weight_version() == 0
    rig.engine.load_weights(second, weight_version=3)
    assert rig.engine.weight_version() == 3
    assert_weights_equal(rig.model, other_weights)
    gens = rig.engine.generate(rig.prompts, SamplingParams(max_new_tokens=5, temperature=1.2))
    check_generations(rig, gens, 1.2, max_new_tokens=5, version=3)
    # The tied weight may come under its other name too.
    head = {**{k: v for k, v in first.items() if k != "model.embed_tokens.weight"}, "lm_head.weight": first[names[0]]}
    assert names[0] == "model.embed_tokens.weight"
    rig.engine.load_weights(head)
    rig.engine.load_weights(second, weight_version=4)
    assert rig.engine.weight_version() == 4
    assert_weights_equal(rig.model, other_weights)


@covers("update_weights_from_tensor", "weight_version", "generate")
def test_weights_shared_as_handles_switch_to_the_new_weights(rig, other_weights):
    from runtime.engines import weight_transfer

    names = sorted(other_weights)
    parts = [names[: len(names) // 2], names[len(names) // 2 :]]
    for part, version in zip(parts, (None, 6), strict=True):
        payload = weight_transfer.serialize_named_tensors([(n, other_weights[n]) for n in part])
        rig.engine.update_weights_from_tensor(payload, weight_version=version)
    assert rig.engine.weight_version() == 6
    assert_weights_equal(rig.model, other_weights)
    gens = rig.engine.generate(rig.prompts, SamplingParams(max_new_tokens=4, temperature=1.1))
    check_generations(rig, gens, 1.1, max_new_tokens=4, version=6)


@covers("load_weights", "weight_version")
def test_load_weights_refuses_buckets_that_do_not_fit_and_partial_updates(rig, other_weights):
    with pytest.raises(ValueError, match="does not have: model.extra.weight"):
        rig.engine.load_weights({"model.extra.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \[3\], the model's is \[64\]"):
        rig.engine.load_weights({"model.norm.weight": torch.zeros(3)})
    partial = {k: v for k, v in other_weights.items() if "layers.1." not in k}
    with pytest.raises(ValueError, match=r"9 of 20 weights missing: model.layers.1.input_layernorm.weight.* 4 more"):
        rig.engine.load_weights(partial, weight_version=5)
    assert rig.engine.weight_version() == 0
    # A failed update leaves nothing behind that the next one would count.
    with pytest.raises(ValueError, match="weights missing"):
        rig.engine.load_weights({}, weight_version=5)
    rig.engine.load_weights(other_weights, weight_version=6)
    assert rig.engine.weight_version() == 6
    assert_weights_equal(rig.model, other_weights)


@covers("update_weights_from_disk", "weight_version", "generate")
def test_update_weights_from_disk_loads_a_sharded_hf_folder(rig, model_dirs, other_weights, tmp_path):
    folder = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(model_dirs[1]).save_pretrained(folder, max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) > 1
    (folder / "stray.safetensors").write_bytes(b"not listed in the index, never read")
    rig.engine.update_weights_from_disk(str(folder), weight_version=5)
    assert rig.engine.weight_version() == 5
    assert_weights_equal(rig.model, other_weights)
    gens = rig.engine.generate(rig.prompts, SamplingParams(max_new_tokens=4))
    check_generations(rig, gens, 1.0, max_new_tokens=4, version=5)
    partial = tmp_path / "partial"
    partial.mkdir()
    save_file({k: v for k, v in other_weights.items() if "mlp" not in k}, str(partial / "model.safetensors"))
    with pytest.raises(ValueError, match="6 of 20 weights missing: model.layers.0.mlp.down_proj.weight"):
        rig.engine.update_weights_from_disk(str(partial), weight_version=6)
    assert rig.engine.weight_version() == 5


@covers("abort", "generate")
def _send_as_trainer(port: int, buckets: list[dict[str, torch.Tensor]]) -> None:
    """Trainer rank 0 of a weight-update group of two, in its own process: broadcast ``buckets`` in order."""
    from runtime.engines import weight_transfer

    group = weight_transfer.init_weights_update_group(
        master_address="127.0.0.1", master_port=port, rank=0, world_size=2, group_name="test_group", backend="gloo"
    )
    for bucket in buckets:
        weight_transfer.send_bucket(group, bucket)
    weight_transfer.destroy_group(group)


@covers(
    "tp_size",
    "init_weights_update_group",
    "update_weights_from_distributed",
    "destroy_weights_update_group",
    "get_weights_by_name",
    "weight_version",
)
def test_weights_arrive_over_a_weight_update_group(rig, other_weights):
    import multiprocessing

    from runtime.engines import weight_transfer
    from runtime.engines.launcher import free_port

    assert rig.engine.tp_size() == 1
    names = sorted(other_weights)
    buckets = [
        {n: other_weights[n] for n in names[: len(names) // 2]},
        {n: other_weights[n] for n in names[len(names) // 2 :]},
    ]
    port = free_port()
    trainer = multiprocessing.get_context("spawn").Process(target=_send_as_trainer, args=(port, buckets))
    trainer.start()
    try:
        rig.engine.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="test_group", backend="gloo")
        for i, bucket in enumerate(buckets):
            meta = weight_transfer.bucket_meta(bucket)
            version = 4 if i == len(buckets) - 1 else None
            rig.engine.update_weights_from_distributed(*meta, group_name="test_group", weight_version=version)
            assert rig.engine.weight_version() == (4 if version else 0)
        rig.engine.destroy_weights_update_group("test_group")
    finally:
        trainer.join(60)
    assert trainer.exitcode == 0
    assert_weights_equal(rig.model, other_weights)
    rows = rig.engine.get_weights_by_name("model.embed_tokens.weight", truncate_size=3)
    torch.testing.assert_close(torch.tensor(rows), other_weights["model.embed_tokens.weight"][:3], rtol=0, atol=0)


def test_abort_from_another_thread_returns_the_partial_responses(rig):
    max_new_tokens, delay = 50, 0.02
    decoding = threading.Event()
    calls = []

    def slow_step(module, args, output):
        calls.append(None)
        if len(calls) == 4:
            decoding.set()
        time.sleep(delay)

    hook = rig.model.register_forward_hook(slow_step)
    result = []
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0)
    worker = threading.Thread(target=lambda: result.extend(rig.engine.generate(rig.prompts, params)))
    try:
        start = time.monotonic()
        worker.start()
        assert decoding.wait(30)
        rig.engine.abort()
        worker.join(30)
        elapsed = time.monotonic() - start
    finally:
        hook.remove()
    assert not worker.is_alive() and elapsed < max_new_tokens * delay
    check_generations(rig, result, 1.0, max_new_tokens=max_new_tokens, version=0)
    assert any(g.finish_reason == "abort" for g in result)
    assert any(g.finish_reason == "abort" and g.token_ids for g in result)  # cut mid-way, not only queued
    assert all(len(g.token_ids) < max_new_tokens for g in result)
    # An abort with nothing running is a no-op: it does not cut the next call.
    rig.engine.abort()
    gens = rig.engine.generate(rig.prompts, SamplingParams(max_new_tokens=4))
    assert {g.finish_reason for g in gens} <= {"stop", "length"}


@covers("release_memory", "resume_memory", "health", "generate")
def test_release_and_resume_memory(rig):
    rig.engine.release_memory()
    assert not rig.engine.health()
    with pytest.raises(RuntimeError, match="resume_memory"):
        rig.engine.generate(rig.prompts, SamplingParams(max_new_tokens=2))
    rig.engine.resume_memory()
    assert rig.engine.health()
    check_generations(
        rig, rig.engine.generate(rig.prompts, SamplingParams(max_new_tokens=3)), 1.0, max_new_tokens=3, version=0
    )
    # Staged, as the loop does around training (--offload-rollout): weights first, then the caches.
    rig.engine.release_memory(["weights", "kv_cache", "cuda_graph"])
    rig.engine.resume_memory(["weights"])
    with pytest.raises(RuntimeError, match="resume_memory"):
        rig.engine.generate(rig.prompts, SamplingParams(max_new_tokens=2))
    rig.engine.resume_memory(["kv_cache", "cuda_graph"])
    assert rig.engine.health()
    check_generations(
        rig, rig.engine.generate(rig.prompts, SamplingParams(max_new_tokens=3)), 1.0, max_new_tokens=3, version=0
    )
    with pytest.raises(ValueError, match="tags"):
        rig.engine.release_memory(["optimizer"])


@covers("get_rng_state", "set_rng_state", "generate")
def test_restored_rng_state_samples_alike(rig):
    params = SamplingParams(max_new_tokens=8, temperature=1.5)
    state = rig.engine.get_rng_state()
    first = [g.token_ids for g in rig.engine.generate(rig.prompts, params)]
    second = [g.token_ids for g in rig.engine.generate(rig.prompts, params)]
    assert first != second
    rig.engine.set_rng_state(state)
    assert [g.token_ids for g in rig.engine.generate(rig.prompts, params)] == first
    assert [g.token_ids for g in rig.engine.generate(rig.prompts, params)] == second


@covers("close", "health")
def test_close_makes_the_engine_unhealthy(rig):
    assert rig.engine.health()
    rig.engine.close()
    assert not rig.engine.health()
