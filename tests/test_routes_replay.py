"""MoE routing replay on the CPU: the embedded engine reports the experts a plain transformers forward chooses, and the
torch backend replays given experts (its own recorded ones change nothing, bitwise; after a perturbed router the
engine's are restored while the gate weights follow the new router; padding never routes a real token)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlcore import keys
from rlcore.advantages import compute
from runtime.config import from_dict, validate
from runtime.demo import task
from runtime.demo.tiny_model import make_preset_model
from runtime.engines.base import SamplingParams
from runtime.engines.hf_engine import HFEngine
from runtime.engines.routes import moe_routers
from runtime.rollout.sample import Sample
from runtime.train.algo import advantage_config, loss_config, model_roles
from runtime.train.backends.torch_backend import TorchTrainer
from runtime.train.backends.torch_replay import routes_for_inputs
from runtime.train.batch import PROMPT_LENGTHS, RESPONSE_LENGTHS, ROUTED_EXPERTS, build_batch
from runtime.train.hooks import TrainHooks

FAMILIES = ["tiny-qwen3-moe", "tiny-glm4-moe", "tiny-deepseek-v3"]
SMALL = {
    "rollout_batch_size": 2,
    "n_samples_per_prompt": 2,
    "rollout_max_response_len": 6,
    "global_batch_size": 4,
    "micro_batch_size": 2,
    "lr": 1e-2,
    "actor_num_gpus_per_node": 1,
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The MoE presets with routers drawn wide (default init nearly ties every expert, so a rounding difference
    could flip a choice) and, where there is one, a non-zero expert bias (it chooses but does not weigh)."""
    root = tmp_path_factory.mktemp("routes")
    paths = {}
    torch.manual_seed(1)
    for name in FAMILIES:
        path = make_preset_model(name, root / name, alphabet=task.ALPHABET, seed=0)
        model = AutoModelForCausalLM.from_pretrained(path)
        with torch.no_grad():
            for key, p in model.named_parameters():
                if key.endswith("mlp.gate.weight"):
                    p.normal_(0.0, 1.0)
            for key, b in model.named_buffers():
                if key.endswith("e_score_correction_bias"):
                    b.normal_(0.0, 0.3)
        model.save_pretrained(path)
        paths[name] = str(path)
    return paths


def cfg_of(tmp_path, **overrides):
    return validate(from_dict(None, output_dir=str(tmp_path / "out"), **{**SMALL, **overrides}))


def trainer_of(path, cfg, replay=None):
    return TorchTrainer(
        path,
        train_cfg=cfg.train,
        loss_cfg=loss_config(cfg),
        temperature=1.0,
        roles=model_roles(cfg),
        seed=0,
        hooks=TrainHooks(routing_replay=replay),
    )


def router_choices(model, run):
    """``{layer: (inputs [N, H], experts [N, topk], weights [N, topk])}`` of every router during ``run()``."""
    seen = {}

    def keep(layer):
        return lambda module, args, out: seen.__setitem__(layer, (args[0].detach(), out[2].detach(), out[1].detach()))

    handles = [router.register_forward_hook(keep(layer)) for layer, router in moe_routers(model)]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return seen


def plain_routes(model, tokens):
    """``[len(tokens), num_layers, topk]``: a plain transformers forward's experts for each token (dense layers 0)."""
    config = model.config
    out = torch.zeros(len(tokens), config.num_hidden_layers, config.num_experts_per_tok, dtype=torch.int32)
    with torch.no_grad():
        seen = router_choices(model, lambda: model(torch.tensor([tokens])))
    for layer, (_, experts, _) in seen.items():
        out[:, layer] = experts.int()
    return out


def samples_of(tokenizer, prompts, responses, routes=None):
    return [
        Sample(
            group_index=i // 2,
            index=i,
            tokens=prompt + response,
            response_length=len(response),
            rollout_log_probs=[-1.0] * len(response),
            reward=float(i % 2),
            rollout_routed_experts=None if routes is None else routes[i],
        )
        for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True))
    ]


def prompts_of(tokenizer, n, seed):
    return [tokenizer(r["prompt"])["input_ids"] for r in task.make_records(n, seed=seed)]


RESPONSES = [[5, 9, 7], [11, 6], [8, 12, 9, 10], [13]]


@pytest.mark.parametrize("name", FAMILIES)
def test_engine_routes_equal_a_plain_forwards_router_choices(models, name):
    # Catches: a decode column off by one (token t's routes stored as t+1's), the left padding kept in the prompt's
    # rows, a shared prompt's routes not copied to each of its samples or left stale when a group row is refilled,
    # and the last token given a row.
    path = models[name]
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = HFEngine(path, seed=0, max_running_requests=2)
    plain = AutoModelForCausalLM.from_pretrained(path)
    prompts = [p for p in prompts_of(tokenizer, 3, seed=2) for _ in range(2)]  # groups of two samples a prompt
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=6, return_routed_experts=True))
    dense = [i for i in range(plain.config.num_hidden_layers) if i not in dict(moe_routers(plain))]
    for prompt, gen in zip(prompts, gens, strict=True):
        tokens = prompt + gen.token_ids
        routes = torch.as_tensor(gen.extra["routed_experts"])
        assert routes.dtype == torch.int32 and routes.shape[0] == len(tokens) - 1
        want = plain_routes(plain, tokens)[:-1]
        # The set of experts is the contract (the top-k order is each kernel's own: sorted=False in sigmoid routers).
        assert torch.equal(routes.sort(-1).values, want.sort(-1).values)
        assert not routes[:, dense].any()
    plain_gens = engine.generate(prompts[:2], SamplingParams(max_new_tokens=3))
    assert all("routed_experts" not in g.extra for g in plain_gens)


def test_engine_without_routes_installs_no_hooks(models):
    # Catches: router hooks (a Python call per router per step) installed on a job that never replays.
    engine = HFEngine(models["tiny-qwen3-moe"], seed=0)
    engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2))
    assert all(not r._forward_hooks for _, r in moe_routers(engine.model))


@pytest.mark.parametrize(("name", "dynamic"), [*((name, False) for name in FAMILIES), ("tiny-qwen3-moe", True)])
def test_replaying_own_recorded_routes_changes_nothing_bitwise(models, name, dynamic, tmp_path):
    # Catches: gate weights recomputed differently from the family's router (softmax/sigmoid, the renormalisation,
    # the scaling factor, the dtype), the expert bias used as a weight, routes laid out against another token order
    # (padded vs packed), and R2's recorded routes misplaced when mapped back to the batch layout.
    path = models[name]
    tokenizer = AutoTokenizer.from_pretrained(path)
    cfg = cfg_of(tmp_path, use_dynamic_batch_size=dynamic, max_tokens_per_gpu=64 if dynamic else None)
    batch = build_batch(samples_of(tokenizer, prompts_of(tokenizer, 4, seed=3), RESPONSES), pad_token_id=0)
    plain, recording = trainer_of(path, cfg), trainer_of(path, cfg, replay="trainer")
    expected = plain.compute_log_probs(batch)
    recorded = recording.compute_log_probs(batch)
    mask = batch[keys.MASK]  # (padding positions hold whatever the padding tokens computed: dummy experts there)
    assert torch.equal(recorded[keys.OLD_LOG_PROBS], expected[keys.OLD_LOG_PROBS])
    routes = recorded[ROUTED_EXPERTS]
    assert routes.shape[:2] == batch["tokens"].shape and routes.dtype == torch.int32
    replaying = trainer_of(path, cfg, replay="rollout")
    replayed = replaying.compute_log_probs(batch.clone().set(ROUTED_EXPERTS, routes))
    assert torch.equal(replayed[keys.OLD_LOG_PROBS][mask], expected[keys.OLD_LOG_PROBS][mask])

    adv = advantage_config(cfg)
    plain_metrics = plain.train(compute(batch.clone().update(expected), adv), per_step_rows=4)
    replay_metrics = replaying.train(compute(batch.clone().update(recorded), adv), per_step_rows=4)
    assert plain_metrics["grad_norm"] == replay_metrics["grad_norm"] > 0
    for (key, p), q in zip(plain.model.named_parameters(), replaying.model.parameters(), strict=True):
        assert torch.equal(p, q), key


@pytest.mark.parametrize("name", FAMILIES)
def test_after_a_perturbed_router_replay_restores_the_engines_routes(models, name, tmp_path):
    # Catches: replay that keeps the router's own top-k (the experts drift with the router), gate weights taken from
    # the old router or detached from it (no gradient reaches the router), and a sigmoid router weighed with its
    # expert bias.
    path = models[name]
    tokenizer = AutoTokenizer.from_pretrained(path)
    plain = AutoModelForCausalLM.from_pretrained(path)
    prompts = prompts_of(tokenizer, 4, seed=5)
    routes = [plain_routes(plain, p + r)[:-1].numpy() for p, r in zip(prompts, RESPONSES, strict=True)]
    batch = build_batch(samples_of(tokenizer, prompts, RESPONSES, routes), pad_token_id=0, routed_experts=True)
    trainer = trainer_of(path, cfg_of(tmp_path), replay="rollout")
    torch.manual_seed(7)
    with torch.no_grad():
        for _, router in moe_routers(trainer.model):
            router.weight.add_(torch.randn_like(router.weight))
    lengths = batch[PROMPT_LENGTHS] + batch[RESPONSE_LENGTHS]
    want = routes_for_inputs(batch[ROUTED_EXPERTS], lengths, packed=False).long()
    real = (torch.arange(batch["tokens"].shape[1])[None] < lengths[:, None] - 1)[:, : int(lengths.max())].reshape(-1)

    seen = router_choices(trainer.model, lambda: trainer._forward(trainer.model, batch, with_entropy=False)[0].sum())
    trainer.route_replay.off()
    own = router_choices(trainer.model, lambda: trainer.model(batch["tokens"][:, : int(lengths.max())]))
    moved = 0
    for layer, router in moe_routers(trainer.model):
        hidden, experts, weights = seen[layer]
        assert torch.equal(experts[real], want[real, layer])
        moved += int((own[layer][1][real].sort(-1).values != want[real, layer].sort(-1).values).any(-1).sum())
        # The gate weights at the replayed experts, from the perturbed router in float64 (the family's formula).
        logits = hidden.reshape(-1, hidden.shape[-1]).double() @ router.weight.detach().double().T
        if name == "tiny-qwen3-moe":
            reference = logits.softmax(-1).gather(1, experts)
            reference = reference / reference.sum(-1, keepdim=True)
        else:
            reference = logits.sigmoid().gather(1, experts)
            reference = reference / (reference.sum(-1, keepdim=True) + 1e-20) * router.routed_scaling_factor
        # float32 logits over a 64-wide dot product and a softmax/sigmoid: a few float32 ulps of values near 1.
        torch.testing.assert_close(weights.double(), reference, atol=1e-5, rtol=1e-5)
    assert moved > 0  # the perturbation changed the router's own choices, which replay overrode

    log_probs, _ = trainer._forward(trainer.model, batch, with_entropy=False)
    log_probs[batch[keys.MASK]].sum().backward()
    for _, router in moe_routers(trainer.model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("dynamic", [False, True])
def test_padding_and_last_token_rows_never_route_a_real_token(models, dynamic, tmp_path):
    # Catches: packed sequences given the padded layout's routes (or the reverse), routes shifted across sequence
    # boundaries, and a real token routed by a dummy row.
    path = models["tiny-qwen3-moe"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    plain = AutoModelForCausalLM.from_pretrained(path)
    prompts = prompts_of(tokenizer, 4, seed=6)
    routes = [plain_routes(plain, p + r)[:-1].numpy() for p, r in zip(prompts, RESPONSES, strict=True)]
    batch = build_batch(samples_of(tokenizer, prompts, RESPONSES, routes), pad_token_id=0, routed_experts=True)
    trainer = trainer_of(path, cfg_of(tmp_path, use_dynamic_batch_size=dynamic, max_tokens_per_gpu=256), "rollout")
    seen = router_choices(trainer.model, lambda: trainer._forward(trainer.model, batch, with_entropy=False))
    lengths = (batch[PROMPT_LENGTHS] + batch[RESPONSE_LENGTHS]).tolist()
    width = max(lengths)
    topk = plain.config.num_experts_per_tok
    for layer, (_, experts, _) in seen.items():
        rows = experts.view(-1, width, topk).unbind(0) if not dynamic else experts.split(lengths)
        for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
            assert torch.equal(row[: n - 1], torch.as_tensor(routes[i][:, layer]).long()), (layer, i)
            assert (row[n - 1 :] == torch.arange(topk)).all(), (layer, i)
    # And the real tokens' log-probs are each sequence's alone: as with the sequence by itself in the batch.
    log_probs, _ = trainer._forward(trainer.model, batch, with_entropy=False)
    for i in range(len(prompts)):
        alone, _ = trainer._forward(trainer.model, batch[i : i + 1], with_entropy=False)
        mask = batch[keys.MASK][i]
        # float32 experts over a different token count per expert: the grouped matmuls may round differently.
        torch.testing.assert_close(log_probs[i][mask], alone[0][mask], atol=1e-5, rtol=0)
