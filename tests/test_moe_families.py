"""The MoE families (Qwen3-MoE, GLM-4.5, DeepSeek-V3/Moonlight) and GLM-4 under the torch backend and the embedded
engine, on the tiny presets of ``runtime.demo.tiny_model``.

The weights travel in the checkpoint's layout (one tensor per expert and projection) and are converted to and from
transformers' fused expert tensors at the edges (``runtime.engines.checkpoint_layout``); transformers' own
``save_pretrained`` and ``revert_weight_conversion`` are the independent reference of that layout.
"""

from __future__ import annotations

import pytest
import ray
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.core_model_loading import revert_weight_conversion

from rlcore import keys
from rlcore.advantages import compute, sequence_advantages
from runtime import demo
from runtime.cluster.placement import create_placement
from runtime.cluster.trainers import TrainerGroup
from runtime.config import from_dict, parse_args, validate
from runtime.demo import task
from runtime.demo.tiny_model import make_preset_model
from runtime.engines import HFEngine, SamplingParams
from runtime.engines.checkpoint_layout import CheckpointLayout, load_checkpoint_state_dict
from runtime.logger import METRICS_FILE, read_metrics
from runtime.loop import run
from runtime.rollout.sample import Sample
from runtime.train.algo import advantage_config, loss_config, model_roles
from runtime.train.backends.torch_backend import TorchTrainer
from runtime.train.batch import build_batch

MOE = ["tiny-qwen3-moe", "tiny-glm4-moe", "tiny-deepseek-v3", "tiny-moonlight"]
FAMILIES = [*MOE, "tiny-glm4"]
SMALL = {
    "rollout_batch_size": 4,
    "n_samples_per_prompt": 4,
    "rollout_max_response_len": 5,
    "num_rollout": 2,
    "global_batch_size": 8,
    "micro_batch_size": 4,
    "lr": 1e-3,
    "actor_num_gpus_per_node": 1,
}


def small_cfg(tmp_path, **overrides):
    return validate(from_dict(None, output_dir=str(tmp_path / "out"), **{**SMALL, **overrides}))


@pytest.fixture(scope="module")
def presets(tmp_path_factory):
    root = tmp_path_factory.mktemp("presets")
    return {name: str(make_preset_model(name, root / name, alphabet=task.ALPHABET, seed=0)) for name in FAMILIES}


def trainer_of(path, cfg, **kwargs):
    return TorchTrainer(
        path, train_cfg=cfg.train, loss_cfg=loss_config(cfg), temperature=1.0, roles=model_roles(cfg), seed=0, **kwargs
    )


def scored_samples(tokenizer, gens, prompts):
    samples = []
    for i, (prompt, gen) in enumerate(zip(prompts, gens, strict=True)):
        samples.append(
            Sample(
                group_index=i // 2,
                index=i // 2,
                tokens=prompt + gen.token_ids,
                response_length=len(gen.token_ids),
                rollout_log_probs=gen.log_probs,
                reward=float(i % 2),
            )
        )
    return build_batch(samples, pad_token_id=tokenizer.pad_token_id)


@pytest.mark.parametrize("name", FAMILIES)
def test_checkpoint_layout_is_transformers_own(presets, name):
    model = AutoModelForCausalLM.from_pretrained(presets[name])
    layout = CheckpointLayout(model)
    ours = layout.state_dict(model.state_dict())
    saved = load_file(f"{presets[name]}/model.safetensors")  # transformers' save_pretrained
    reverted = revert_weight_conversion(model, dict(model.state_dict()))
    assert layout.fused == (name in MOE)
    assert set(ours) == set(saved) == set(reverted) == set(layout.slots)
    for key in saved:
        assert torch.equal(ours[key], saved[key]) and torch.equal(ours[key], reverted[key]), key
        assert layout.shapes()[key] == tuple(saved[key].shape)
    # And back: a fresh model of the architecture loads the checkpoint names into its fused tensors.
    fresh = AutoModelForCausalLM.from_config(model.config)
    assert load_checkpoint_state_dict(fresh, saved) == ([], [])
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_checkpoint_layout_names_what_is_missing_and_unexpected(presets):
    model = AutoModelForCausalLM.from_pretrained(presets["tiny-qwen3-moe"])
    saved = load_file(f"{presets['tiny-qwen3-moe']}/model.safetensors")
    gone = "model.layers.1.mlp.experts.5.up_proj.weight"
    partial = {k: v for k, v in saved.items() if k != gone}
    assert load_checkpoint_state_dict(model, {**partial, "model.extra": torch.zeros(1)}) == ([gone], ["model.extra"])


# Multi-latent attention (tiny-deepseek-v3, tiny-moonlight) included: the engine's attention output is sized by the
# value head dim, which MLA makes narrower than the query/key head.
@pytest.mark.parametrize("name", FAMILIES)
def test_engine_log_probs_match_trainer_recompute(presets, name, tmp_path):
    path = presets[name]
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = HFEngine(path, seed=0)
    trainer = trainer_of(path, small_cfg(tmp_path))
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in task.make_records(4, seed=3)]
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0))
    td = scored_samples(tokenizer, gens, prompts)
    old = trainer.compute_log_probs(td)[keys.OLD_LOG_PROBS]
    mask = td[keys.MASK]
    # float32 on both sides, the same model code: only the attention kernels and summation orders differ.
    torch.testing.assert_close(old[mask], td[keys.ROLLOUT_LOG_PROBS][mask], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", MOE)
def test_trained_weights_reach_the_engine_in_checkpoint_names(presets, name, tmp_path):
    path = presets[name]
    tokenizer = AutoTokenizer.from_pretrained(path)
    cfg = small_cfg(tmp_path, lr=1e-2)
    trainer = trainer_of(path, cfg)
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in task.make_records(4, seed=4)]
    reference = AutoModelForCausalLM.from_pretrained(path)
    gens = [
        type("G", (), {"token_ids": [5, 6, 7][: 1 + i % 3], "log_probs": [-1.0] * (1 + i % 3)})() for i in range(4)
    ]
    td = scored_samples(tokenizer, gens, prompts)
    td.update(trainer.compute_log_probs(td))
    metrics = trainer.train(compute(td, advantage_config(cfg)), per_step_rows=4)
    assert metrics["grad_norm"] > 0
    trained = trainer.model.state_dict()
    fused = [k for k in trained if k.endswith("experts.gate_up_proj")]
    assert fused and any(not torch.equal(trained[k], reference.state_dict()[k]) for k in fused)

    # Small buckets: an MoE layer's experts are spread over several buckets.
    buckets = list(trainer.weight_buckets(dtype=torch.float32, bucket_bytes=4096))
    names = [n for b in buckets for n in b]
    assert len(names) == len(set(names)) and len(buckets) > 3
    expected = CheckpointLayout(reference).slots
    assert set(names) == set(expected) and not any("gate_up_proj" in n for n in names)

    engine = HFEngine(path, seed=0)
    for i, bucket in enumerate(buckets):
        engine.load_weights(bucket, weight_version=3 if i == len(buckets) - 1 else None)
    assert engine.weight_version() == 3
    for key, value in engine.model.state_dict().items():
        assert torch.equal(value, trained[key]), key
    assert set(engine.get_weights()) == set(expected)
    one = next(n for n in names if ".experts.3.down_proj" in n)
    assert engine.get_weights_by_name(one, truncate_size=2) == trainer.get_weights()[one][:2].tolist()

    # An update that misses one expert is refused at its last bucket.
    gone = "model.layers.1.mlp.experts.2.gate_proj.weight"
    with pytest.raises(ValueError, match=rf"incomplete: 1 of {len(expected)} weights missing: {gone}"):
        for i, bucket in enumerate(buckets):
            bucket = {k: v for k, v in bucket.items() if k != gone}
            engine.load_weights(bucket, weight_version=4 if i == len(buckets) - 1 else None)

    # The HF export writes the checkpoint layout, which transformers loads back into the trained model.
    trainer.save_hf(str(tmp_path / "hf"))
    assert set(load_file(str(tmp_path / "hf" / "model.safetensors"))) == set(expected)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    for key, value in trained.items():
        assert torch.equal(exported[key], value), key


def test_two_fsdp_trainers_over_moe_layers_give_the_single_trainer_step(ray_session, presets, tmp_path):
    path = presets["tiny-qwen3-moe"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    cfg = small_cfg(tmp_path, actor_num_gpus_per_node=2, rollout_num_gpus=2, colocate=True, micro_batch_size=2)
    kwargs = dict(train_cfg=cfg.train, loss_cfg=loss_config(cfg), temperature=1.0, roles=model_roles(cfg), seed=0)
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in task.make_records(8, seed=5)]
    gens = [
        type("G", (), {"token_ids": [5, 9, 7, 11][: 1 + i % 4], "log_probs": [-1.5] * (1 + i % 4)})() for i in range(8)
    ]
    td = scored_samples(tokenizer, gens, prompts)
    single = TorchTrainer(path, **kwargs)
    td_single = td.clone()
    td_single.update(single.compute_log_probs(td))
    expected = single.train(compute(td_single, advantage_config(cfg)), per_step_rows=8)
    placement = create_placement(cfg)
    group = TrainerGroup(placement, backend="torch", model_path=path, **kwargs)
    try:
        adv_cfg = advantage_config(cfg)
        got = group.train_rollout(sequence_advantages(td, adv_cfg), global_batch_size=8, adv_cfg=adv_cfg)
        for name in ("grad_norm", "pg_loss", "loss", "entropy"):
            # float32 sums over two shards instead of one: a few ulps of the loss's magnitude.
            assert got[name] == pytest.approx(expected[name], rel=1e-4, abs=1e-6), name
        full, expected_weights = group.get_weights(), single.get_weights()
        assert set(full) == set(expected_weights) and any(".experts.7.gate_proj" in k for k in full)
        for name, value in full.items():
            torch.testing.assert_close(value, expected_weights[name], atol=1e-5, rtol=1e-4)
    finally:
        group.shutdown()
        ray.util.remove_placement_group(placement.group)


def _default_job_on(monkeypatch, tmp_path, preset, *args):
    """The built-in task's job with the tiny preset ``preset`` as its base model instead of the tiny Llama."""

    def base_model(output_dir, *, seed):
        return str(make_preset_model(preset, f"{output_dir}/base_model", alphabet=task.ALPHABET, seed=seed))

    monkeypatch.setattr(demo, "base_model", base_model)
    return run(parse_args(["--output-dir", str(tmp_path / "job"), *args]), progress=False)


def test_default_job_runs_on_the_tiny_qwen3_moe(ray_session, monkeypatch, tmp_path):
    small = ["--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4"]
    result = _default_job_on(monkeypatch, tmp_path, "tiny-qwen3-moe", *small)
    rows = read_metrics(result.output_dir / METRICS_FILE)
    assert [r["step"] for r in rows] == [0, 1]
    # The engine samples with the weights the trainer recomputes with: synced in the checkpoint layout.
    assert all(r["train/rollout_log_prob_abs_diff"] < 1e-4 for r in rows)
    final = AutoModelForCausalLM.from_pretrained(result.output_dir / "final_model").state_dict()
    base = AutoModelForCausalLM.from_pretrained(result.output_dir / "base_model").state_dict()
    assert any(not torch.equal(final[k], base[k]) for k in final if "experts" in k)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_default_job_learns_on_the_tiny_qwen3_moe(monkeypatch, tmp_path):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        result = _default_job_on(monkeypatch, tmp_path, "tiny-qwen3-moe")
    finally:
        ray.shutdown()
    rewards = [r["rollout/reward_mean"] for r in read_metrics(result.output_dir / METRICS_FILE)]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"tiny-qwen3-moe default job: {len(rewards)} steps, first-10 reward {first:.3f}, last-10 {last:.3f}")
    assert last - first >= 0.3
