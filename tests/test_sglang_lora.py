"""LoRA adapters pushed to SGLang as adapters (``--update-weight-transport lora_adapter``): the engine's
``/load_lora_adapter`` / ``/unload_lora_adapter`` calls and ``lora_path`` in ``/generate``, against the fake server
(whose request fields are SGLang 0.5.23's ``LoadLoRAAdapterReqInput`` / ``UnloadLoRAAdapterReqInput``), and a whole job
whose servers sample with base + adapter."""

import sys
from pathlib import Path

import pytest
import ray
import torch
from fake_sglang import FakeSGLangServer
from suite_tools import kill_and_wait_gone
from transformers import AutoModelForCausalLM

from runtime.config import ConfigError, from_dict, validate
from runtime.demo import task
from runtime.demo.tiny_model import make_tiny_model
from runtime.engines import SamplingParams
from runtime.engines.sglang_engine import SGLangEngine, SGLangHTTPError
from runtime.logger import METRICS_FILE, read_metrics
from runtime.loop import run

FAKE_SERVER = f"{sys.executable} {Path(__file__).with_name('fake_sglang.py')}"
# ray_session (tests/conftest.py) starts Ray with these; shared with neighbouring modules that ask for the same.
# 4 CPUs, more than the 2 slots a job here takes: the fault-tolerance modules' size, so one Ray serves all four.
RAY_RESOURCES = {"num_cpus": 4}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), alphabet=task.ALPHABET, seed=0))


def _adapter(model_path, folder, *, seed):
    """A peft adapter folder over ``model_path`` with random (non-zero) A and B, and the merged float64 model."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    peft_model.save_pretrained(folder)
    return peft_model.merge_and_unload().double().eval()


@torch.no_grad()
def _log_probs(model, prompt, tokens):
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def test_the_engine_loads_each_version_as_an_adapter_and_generates_with_it(model_path, tmp_path):
    merged = {v: _adapter(model_path, tmp_path / f"v{v}", seed=v) for v in (1, 2)}
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64).eval()
    prompt = [1, 5, 6, 7]
    with FakeSGLangServer(model_path, enable_lora=True) as server:
        engine = SGLangEngine(server.url, timeout=30, max_retries=0)
        for version in (1, 2):
            engine.load_lora_adapter(str(tmp_path / f"v{version}"), weight_version=version)
            assert set(server.adapters) == {f"rlcore-v{version}"}  # the previous version is unloaded
            assert engine.weight_version() == version
            (out,) = engine.generate([prompt], SamplingParams(max_new_tokens=4, temperature=1.0))
            want = _log_probs(merged[version], prompt, out.token_ids)
            torch.testing.assert_close(torch.tensor(out.log_probs, dtype=torch.float64), want, atol=1e-4, rtol=0)
            assert not torch.allclose(_log_probs(base, prompt, out.token_ids), want, atol=1e-3)
        # (Unloads: a fresh client's of the name it is about to load, which the server did not hold, then v1's.)
        assert server.requests["/load_lora_adapter"] == 2 and server.requests["/unload_lora_adapter"] == 2
        engine.close()


def test_the_servers_refusals_are_raised_with_their_message(model_path, tmp_path):
    _adapter(model_path, tmp_path / "a", seed=0)
    with FakeSGLangServer(model_path) as server:  # launched without --enable-lora
        engine = SGLangEngine(server.url, timeout=30, max_retries=0)
        with pytest.raises(SGLangHTTPError, match="--enable-lora"):
            engine.load_lora_adapter(str(tmp_path / "a"), weight_version=1)
        engine.close()
    with FakeSGLangServer(model_path, enable_lora=True) as server:
        engine = SGLangEngine(server.url, timeout=30, max_retries=0)
        with pytest.raises(SGLangHTTPError, match="failed to load the LoRA adapter"):
            engine.load_lora_adapter(str(tmp_path / "missing"), weight_version=1)
        engine.lora_name = "never-loaded"
        with pytest.raises(SGLangHTTPError, match="not loaded"):
            engine.generate([[1, 5]], SamplingParams(max_new_tokens=1))
        engine.close()


def _cfg(tmp_path, model_path, **overrides):
    settings = {
        "output_dir": str(tmp_path),
        "hf_checkpoint": model_path,
        "rollout_max_response_len": 3,
        "rollout_batch_size": 4,
        "n_samples_per_prompt": 4,
        "global_batch_size": 16,
        "micro_batch_size": 8,
        "num_rollout": 2,
        "lr": 1e-2,
        "actor_num_gpus_per_node": 1,
        "rollout_engine": "sglang",
        "rollout_num_gpus": 1,
        "sglang_server_command": FAKE_SERVER,
        "sglang_server_startup_timeout": 120.0,
        "use_tensorboard": False,
        "lora_rank": 4,
        "lora_alpha": 8.0,
        "update_weight_transport": "lora_adapter",
        "use_kl_loss": True,  # (the reference, the base under the adapters, measures how far they moved)
    }
    return validate(from_dict(None, **{**settings, **overrides}))


def test_lora_adapter_transport_is_checked(tmp_path, model_path):
    for overrides, message in (
        ({"lora_rank": 0}, "it needs --lora-rank and --rollout-engine sglang"),
        ({"rollout_engine": "hf"}, "it needs --lora-rank and --rollout-engine sglang"),
        ({"lora_modules_to_save": "embed_tokens"}, "sends the adapters only"),
        ({"check_weight_update_equal": True}, "hold the adapter apart"),
    ):
        with pytest.raises(ConfigError) as info:
            _cfg(tmp_path, model_path, **overrides)
        assert any(message in p for p in info.value.problems), (overrides, info.value.problems)


@pytest.mark.slow  # (the conformance test below covers the same path, the router included, in less time)
def test_a_lora_job_samples_with_base_plus_adapter_on_launched_servers(ray_session, tmp_path, model_path):
    pytest.importorskip("sglang_router", reason="a launched fleet runs behind the router (the dev extra)")
    result = run(_cfg(tmp_path, model_path), progress=False)
    rows = read_metrics(result.output_dir / METRICS_FILE)
    assert [r["step"] for r in rows] == [0, 1]
    # Step 1 samples after the first adapter push: the server's base + adapter log-probs equal the trainer's.
    assert abs(rows[1]["train/approx_kl_ref"]) > 1e-4  # the adapters moved the policy away from the base
    assert all(r["train/rollout_log_prob_abs_diff"] < 1e-4 for r in rows)


def test_the_lora_adapter_weight_sync_conformance(ray_session, tmp_path, model_path):
    """WeightSync's methods on lora_adapter: a push leaves every server sampling with base + the trained adapter
    (its log-probs are the trainer's), and a restarted engine rejoins with the adapter the others serve."""
    import asyncio

    from rlcore import keys
    from rlcore.advantages import sequence_advantages
    from runtime.cluster.engines import EngineGroup
    from runtime.cluster.placement import create_placement
    from runtime.cluster.trainers import TrainerGroup
    from runtime.cluster.weight_sync import WeightSync, make_weight_sync
    from runtime.rollout.sample import Sample
    from runtime.train.algo import advantage_config, loss_config, model_roles
    from runtime.train.batch import build_batch

    cfg = _cfg(tmp_path, model_path, rollout_batch_size=2, global_batch_size=8, lr=5e-2)
    placement = create_placement(cfg)
    trainers = TrainerGroup(
        placement,
        backend="torch",
        model_path=model_path,
        roles=model_roles(cfg),
        train_cfg=cfg.train,
        loss_cfg=loss_config(cfg),
        temperature=1.0,
        seed=0,
    )
    engines = EngineGroup(cfg, placement, model_path)
    sync = make_weight_sync(trainers, engines, bucket_bytes=4096)
    prompt = [1, 5, 6, 7]

    def engine_matches_trainer() -> bool:
        # Through the engine group, as the rollout asks: its router client names the adapter too.
        (out,) = asyncio.run(engines.generate([prompt], SamplingParams(max_new_tokens=4)))
        tokens, n = prompt + out.token_ids, len(out.token_ids)
        sample = Sample(index=0, group_index=0, tokens=tokens, response_length=n, reward=0.0)
        td = build_batch([sample], pad_token_id=0)
        want = trainers.call("compute_log_probs", td)[0][keys.OLD_LOG_PROBS][0, : len(out.token_ids)]
        return torch.allclose(torch.tensor(out.log_probs), want, atol=1e-4)

    try:
        assert isinstance(sync, WeightSync) and type(sync).__name__ == "LoraAdapterSync"
        assert engines.router is not None
        adv_cfg = advantage_config(cfg)
        gen = torch.Generator().manual_seed(0)
        samples = [
            Sample(
                index=i,
                group_index=i // 4,
                tokens=prompt + torch.randint(4, 18, (3,), generator=gen).tolist(),
                response_length=3,
                reward=float(i % 2),
            )
            for i in range(8)
        ]
        batch = sequence_advantages(build_batch(samples, pad_token_id=0), adv_cfg)
        trainers.train_rollout(batch, global_batch_size=8, adv_cfg=adv_cfg)
        assert not engine_matches_trainer()  # the servers still sample with the base weights
        sync.push(5)
        assert engines.weight_versions() == [5] and engine_matches_trainer()
        kill_and_wait_gone(engines.actors[0])
        assert engines.weight_versions() == [5] and engine_matches_trainer()  # the adapter the others serve
    finally:
        sync.close()
        trainers.shutdown()
        engines.shutdown()
        ray.util.remove_placement_group(placement.group)
