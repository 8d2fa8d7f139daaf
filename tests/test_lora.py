"""LoRA in the torch backend (peft): only adapters train, the reference is the base, merged exports equal base+LoRA.

In-process trainers on the CPU with the tiny model; the learning run is ``-m slow``.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlcore import keys
from rlcore.advantages import compute
from runtime.config import ConfigError, from_dict, parse_args, validate
from runtime.demo import task
from runtime.demo.tiny_model import make_tiny_model
from runtime.rollout.sample import Sample
from runtime.train.algo import advantage_config, loss_config, model_roles
from runtime.train.backends import lora
from runtime.train.backends.torch_backend import TorchTrainer
from runtime.train.batch import TOKENS, build_batch

SMALL = {"rollout_batch_size": 2, "n_samples_per_prompt": 4, "global_batch_size": 8, "micro_batch_size": 4}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), alphabet=task.ALPHABET, seed=0))


def _cfg(tmp_path, **overrides):
    settings = {**SMALL, "use_kl_loss": True, "lr": 1e-2, "lora_rank": 4, "lora_alpha": 8.0, **overrides}
    settings.setdefault("lora_modules_to_save", "")  # (the built-in job's own default trains the embedding too)
    return validate(from_dict(None, output_dir=str(tmp_path / "out"), **settings))


def _trainer(model_path, cfg):
    return TorchTrainer(
        model_path, train_cfg=cfg.train, loss_cfg=loss_config(cfg), temperature=1.0, seed=0, roles=model_roles(cfg)
    )


def _batch(model_path, seed=0):
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i, rec in enumerate(task.make_records(8, seed=seed)):
        prompt = tokenizer(rec["prompt"])["input_ids"]
        response = torch.randint(4, len(tokenizer), (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen)
        samples.append(
            Sample(
                index=i // 4,
                group_index=i // 4,
                tokens=prompt + response.tolist(),
                response_length=len(response),
                reward=float(i % 3) / 2,
                rollout_log_probs=[-1.0] * len(response),
            )
        )
    return build_batch(samples, pad_token_id=tokenizer.pad_token_id)


def _train(trainer, cfg, td, steps=2):
    for _ in range(steps):
        td.update(trainer.compute_log_probs(td))
        trainer.train(compute(td, advantage_config(cfg)), per_step_rows=8)
    return td


@pytest.mark.parametrize("saved", ["", "embed_tokens"])
def test_only_adapters_train_and_the_reference_is_the_base_model(model_path, tmp_path, saved):
    cfg = _cfg(tmp_path, lora_modules_to_save=saved)
    trainer = _trainer(model_path, cfg)
    assert trainer.frozen == {} and trainer.base_is_reference  # no second copy of the model for the reference
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    adapters = {n for n in trainable if ".lora_A." in n or ".lora_B." in n}
    # --lora-modules-to-save: one trained copy of the tied embedding (the LM head shares it), nothing else.
    assert adapters and trainable - adapters == (
        {"base_model.model.model.embed_tokens.modules_to_save.default.weight"} if saved else set()
    )
    if saved:
        head = trainer.model.base_model.model.lm_head.modules_to_save["default"].weight
        assert head is trainer.model.base_model.model.model.embed_tokens.modules_to_save["default"].weight
    assert {id(p) for g in trainer.optimizer.param_groups for p in g["params"]} == {
        id(p) for p in trainer.model.parameters() if p.requires_grad
    }
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    td = _batch(model_path)
    # With B = 0 the adapted model is the base: old and reference log-probs agree before training.
    first = trainer.compute_log_probs(td)
    torch.testing.assert_close(first[keys.OLD_LOG_PROBS], first[keys.REF_LOG_PROBS], rtol=0, atol=0)
    _train(trainer, cfg, td)
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable
    assert any(".lora_B." in n for n in changed) and (trainable - adapters) <= changed
    # The reference (adapters disabled) still computes the untouched base model; the actor has moved.
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    plain = TorchTrainer.__new__(TorchTrainer)
    plain.__dict__.update(trainer.__dict__)
    after = trainer.compute_log_probs(td)
    expected, _ = plain._forward(base, td, with_entropy=False)
    torch.testing.assert_close(after[keys.REF_LOG_PROBS], expected, rtol=1e-5, atol=1e-5)
    assert (after[keys.OLD_LOG_PROBS] - after[keys.REF_LOG_PROBS]).abs().max() > 1e-3


def _optimizer_state_numel(trainer):
    return sum(v.numel() for state in trainer.optimizer.state.values() for v in state.values() if torch.is_tensor(v))


def test_optimizer_state_scales_with_the_rank(model_path, tmp_path):
    sizes = {}
    for rank in (2, 4, 8):
        cfg = _cfg(tmp_path, lora_rank=rank)
        trainer = _trainer(model_path, cfg)
        _train(trainer, cfg, _batch(model_path), steps=1)
        sizes[rank] = _optimizer_state_numel(trainer)
    # AdamW keeps two moments per adapter element (plus a scalar step each); adapters are rank x (in + out).
    steps = len(trainer.optimizer.state)
    moments = {rank: size - steps for rank, size in sizes.items()}
    assert moments[4] == 2 * moments[2] and moments[8] == 4 * moments[2]
    full = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_path).parameters())
    assert moments[8] < 2 * full


@pytest.mark.parametrize("saved", ["", "embed_tokens"])
def test_merged_weights_equal_base_plus_adapter_and_load_in_transformers(model_path, tmp_path, saved):
    cfg = _cfg(tmp_path, lora_target_modules="q_proj,v_proj,down_proj", lora_modules_to_save=saved)
    trainer = _trainer(model_path, cfg)
    td = _train(trainer, cfg, _batch(model_path))
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    weights = trainer.get_weights()
    # Every base weight under its own name, tied weights once; adapted ones merged.
    assert set(weights) == {n for n, _ in base.named_parameters()}
    for name, layer in lora.lora_layers(trainer.model):
        hf = lora.hf_name(name + ".base_layer.weight")
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        expected = base.state_dict()[hf] + layer.scaling["default"] * (b @ a).detach()
        torch.testing.assert_close(weights[hf], expected, rtol=0, atol=1e-6)
    names = {lora.hf_name(n + ".base_layer.weight").split(".")[-2] for n, _ in lora.lora_layers(trainer.model)}
    assert names == {"q_proj", "v_proj", "down_proj"}
    embedding = trainer.model.get_input_embeddings().weight  # the trained copy under --lora-modules-to-save
    torch.testing.assert_close(weights["model.embed_tokens.weight"], embedding.detach(), rtol=0, atol=0)
    assert torch.equal(embedding, base.get_input_embeddings().weight) != bool(saved)
    # Buckets respect the byte limit and carry the same tensors.
    buckets = list(trainer.weight_buckets(dtype=torch.float32, bucket_bytes=4096))
    assert len(buckets) > 1 and sum(len(b) for b in buckets) == len(weights)

    merged_dir, adapter_dir = tmp_path / "merged", tmp_path / "adapter"
    trainer.save_hf(str(merged_dir))
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    tokens = td[TOKENS]
    with torch.no_grad():
        want = trainer.model(input_ids=tokens, use_cache=False).logits
        torch.testing.assert_close(merged(input_ids=tokens).logits, want, rtol=1e-4, atol=1e-4)

    from peft import PeftModel

    adapter_cfg = _cfg(
        tmp_path, lora_target_modules="q_proj,v_proj,down_proj", lora_modules_to_save=saved, lora_export="adapter"
    )
    trainer.cfg = adapter_cfg.train
    trainer.save_hf(str(adapter_dir))
    assert (adapter_dir / "adapter_config.json").exists() and not (adapter_dir / "model.safetensors").exists()
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["r"] == 4
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), adapter_dir
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=tokens).logits, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("saved", ["", "embed_tokens"])
def test_checkpoint_holds_the_adapters_only_and_resumes_exactly(model_path, tmp_path, saved):
    cfg = _cfg(tmp_path, lora_modules_to_save=saved)
    trainer = _trainer(model_path, cfg)
    td = _train(trainer, cfg, _batch(model_path), steps=1)
    ckpt = tmp_path / "ckpt"
    trainer.save(str(ckpt))
    import torch.distributed.checkpoint as dcp

    entries = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    model_keys = {k.removeprefix("model.") for k in entries if k.startswith("model.")}
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert model_keys == trainable  # no base weight, not even the tied LM head
    assert all(".lora_" in k or ".modules_to_save." in k for k in entries if k.startswith("optim.state."))

    _train(trainer, cfg, td, steps=1)
    expected = trainer.get_weights()
    restored = _trainer(model_path, cfg)
    restored.load(str(ckpt))
    _train(restored, cfg, td, steps=1)
    for name, value in restored.get_weights().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0)


def test_lora_dropout_acts_only_while_training(model_path, tmp_path):
    cfg = _cfg(tmp_path, lora_dropout=0.5)
    trainer = _trainer(model_path, cfg)
    td = _train(trainer, cfg, _batch(model_path), steps=1)  # adapters non-zero from here on
    layers = [layer for _, layer in lora.lora_layers(trainer.model)]
    assert all(not layer.lora_dropout["default"].training for layer in layers)
    once, twice = trainer.compute_log_probs(td), trainer.compute_log_probs(td)
    torch.testing.assert_close(once[keys.OLD_LOG_PROBS], twice[keys.OLD_LOG_PROBS], rtol=0, atol=0)
    lora.set_dropout(trainer.model, active=True)
    assert all(layer.lora_dropout["default"].training for layer in layers)
    lora.set_dropout(trainer.model, active=False)


def test_lora_flags_are_checked(tmp_path):
    cfg = parse_args(["--lora-rank", "8", "--lora-alpha", "32", "--lora-target-modules", "q_proj,v_proj"])
    t = cfg.train
    assert (t.lora_rank, t.lora_alpha, t.lora_target_modules, t.lora_export) == (8, 32.0, "q_proj,v_proj", "merged")
    with pytest.raises(ConfigError) as err:
        validate(from_dict(None, lora_rank=4, lora_alpha=0, lora_dropout=1.0, lora_target_modules=" , "))
    text = str(err.value)
    assert "--lora-alpha must be > 0" in text and "--lora-dropout must be in [0, 1)" in text
    assert "--lora-target-modules" in text
    with pytest.raises(ConfigError, match="--lora-rank must be >= 0"):
        validate(from_dict(None, lora_rank=-1))


def test_unknown_target_module_is_named(model_path, tmp_path):
    cfg = _cfg(tmp_path, lora_target_modules="no_such_proj")
    with pytest.raises(ValueError, match="--lora-target-modules 'no_such_proj'"):
        _trainer(model_path, cfg)


@pytest.mark.slow
def test_lora_grpo_learns_the_default_task(tmp_path):
    # The built-in job trains the tied embedding beside the adapters (--lora-modules-to-save embed_tokens, its
    # default): with adapters alone the frozen embedding / LM head caps every token's probability near 0.2.
    # Measured figures: docs/runtime.md, LoRA.
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "runtime.cli", "--output-dir", str(out), "--no-use-tensorboard"]
    cmd += ["--lora-rank", "32", "--lora-alpha", "64", "--lr", "2e-3", "--num-rollout", "250"]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [row["rollout/reward_mean"] for row in rows if "rollout/reward_mean" in row]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"LoRA on the default task: first-10 mean reward {first:.3f}, last-10 {last:.3f}")
    assert last >= first + 0.2, (first, last)
