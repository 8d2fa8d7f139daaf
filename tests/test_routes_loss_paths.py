"""Routing replay in every loss path of the torch backend, on the CPU with the tiny Qwen3-MoE preset: slime's custom
loss (``--loss-type custom_loss``) and ``--loss-type sft_loss`` on engine rollouts replay the engine's routes as the
policy loss does; R2 under ``--keep-old-actor`` records the old actor's routes; an SFT job refuses both flags."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlcore import keys
from rlcore.advantages import compute
from runtime.config import ConfigError, from_dict, validate
from runtime.demo import task
from runtime.demo.tiny_model import make_preset_model
from runtime.engines.routes import moe_routers
from runtime.train.algo import advantage_config, loss_config, model_roles
from runtime.train.backends.torch_backend import TorchTrainer
from runtime.train.batch import PROMPT_LENGTHS, RESPONSE_LENGTHS, ROUTED_EXPERTS, build_batch
from runtime.train.hooks import TrainHooks
from tests.test_routes_replay import (
    RESPONSES,
    SMALL,
    cfg_of,
    plain_routes,
    prompts_of,
    router_choices,
    samples_of,
)

PLUGIN = str(Path(__file__).parent / "fixtures" / "slime_style_plugin.py")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    """The tiny Qwen3-MoE preset with its routers drawn wide (default init nearly ties every expert)."""
    path = make_preset_model("tiny-qwen3-moe", tmp_path_factory.mktemp("moe"), alphabet=task.ALPHABET, seed=0)
    model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(1)
    with torch.no_grad():
        for _, router in moe_routers(model):
            router.weight.normal_(0.0, 1.0)
    model.save_pretrained(path)
    return str(path)


def engine_batch(path, seed):
    """A batch of four samples with the routes a plain transformers forward chooses (the engine's), and those
    routes one per sequence ``[len - 1, layers, topk]``."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    plain = AutoModelForCausalLM.from_pretrained(path)
    prompts = prompts_of(tokenizer, 4, seed=seed)
    routes = [plain_routes(plain, p + r)[:-1] for p, r in zip(prompts, RESPONSES, strict=True)]
    samples = samples_of(tokenizer, prompts, RESPONSES, [r.numpy() for r in routes])
    return build_batch(samples, pad_token_id=0, routed_experts=True), routes


def perturb_routers(model, seed):
    """Moves every router far enough that its own choices differ from the recorded ones on many tokens."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for _, router in moe_routers(model):
            router.weight.add_(torch.randn_like(router.weight))


def assert_routed_as(seen, routes, lengths, *, differs_from=None):
    """Every router call of ``seen`` (``router_choices``: one forward over the padded rows) took ``routes`` (one
    ``[len - 1, layers, topk]`` per sequence) at each sequence's routed tokens."""
    width = int(lengths.max())
    for layer, (_, experts, _) in seen.items():
        rows = experts.view(len(routes), width, -1)
        for i, want in enumerate(routes):
            assert torch.equal(rows[i, : len(want)], want[:, layer].long()), (layer, i)
    if differs_from is not None:  # the premise: without replay some of those tokens route elsewhere
        moved = sum(
            int((differs_from[layer][1].view(len(routes), width, -1)[i, : len(want)] != want[:, layer]).any())
            for layer in seen
            for i, want in enumerate(routes)
        )
        assert moved > 0


@pytest.mark.parametrize("loss_type", ["custom_loss", "sft_loss"])
def test_custom_and_sft_losses_replay_the_engines_routes(path, tmp_path, loss_type):
    # Catches: a loss path whose forward skips the replay (the routers left off, taking the perturbed router's own
    # experts, or left replaying the previous micro-batch's routes: a token-count mismatch), and the custom loss's
    # padded rows given the packed layout's routes under --use-dynamic-batch-size.
    # The custom loss under --use-dynamic-batch-size (its own padded rows against the packed layout elsewhere); the
    # SFT loss padded, so that one router call covers the rows as router_choices reads them.
    packed = loss_type == "custom_loss"
    cfg = cfg_of(tmp_path, use_dynamic_batch_size=packed, max_tokens_per_gpu=256 if packed else None)
    paths = {"custom_loss_function_path": f"{PLUGIN}:pg_loss_as_custom_loss"} if loss_type == "custom_loss" else {}
    hooks = TrainHooks(args=cfg, paths=paths, loss_type=loss_type, routing_replay="rollout")
    trainer = TorchTrainer(
        path, train_cfg=cfg.train, loss_cfg=loss_config(cfg), temperature=1.0, roles=model_roles(cfg), seed=0,
        hooks=hooks,
    )  # fmt: skip
    batch, routes = engine_batch(path, seed=8)
    batch = compute(batch.update(trainer.compute_log_probs(batch)), advantage_config(cfg))
    perturb_routers(trainer.model, seed=9)
    lengths = batch[PROMPT_LENGTHS] + batch[RESPONSE_LENGTHS]
    trainer.route_replay.off()
    own = router_choices(trainer.model, lambda: trainer.model(batch["tokens"][:, : int(lengths.max())]))
    norm = trainer._global_normalizer([batch])
    if loss_type == "custom_loss":
        seen = router_choices(trainer.model, lambda: trainer._custom_loss(batch.clone(), norm)[0].backward())
    else:
        seen = router_choices(trainer.model, lambda: trainer._sft_loss(batch.clone(), norm, mode="token_mean"))
    assert_routed_as(seen, routes, lengths, differs_from=own)


def test_r2_under_keep_old_actor_records_the_old_actors_routes_and_the_update_replays_them(path, tmp_path):
    # Catches: R2 refused with --keep-old-actor (as before), the routes recorded from the current weights instead of
    # the old actor's that the old log-probs come from, none recorded in that pass (the update then has nothing to
    # replay), and the old-actor swap leaving the recording on for the reference's forward.
    cfg = cfg_of(tmp_path, keep_old_actor=True, rollout_schedule="one_step", update_weights_interval=1)
    trainer = TorchTrainer(
        path, train_cfg=cfg.train, loss_cfg=loss_config(cfg), temperature=1.0, roles=model_roles(cfg), seed=0,
        hooks=TrainHooks(routing_replay="trainer"),
    )  # fmt: skip
    batch, old_routes = engine_batch(path, seed=10)  # the unperturbed weights are the old actor's
    batch = batch.exclude(ROUTED_EXPERTS)
    perturb_routers(trainer.model, seed=11)  # the current actor's routers only: the old actor's copy is kept apart
    lengths = batch[PROMPT_LENGTHS] + batch[RESPONSE_LENGTHS]
    out = trainer.compute_log_probs(batch)
    recorded = out[ROUTED_EXPERTS]
    for i, want in enumerate(old_routes):
        assert torch.equal(recorded[i, : len(want)], want), i
    # The old log-probs are the old actor's: the unperturbed model's own.
    plain = AutoModelForCausalLM.from_pretrained(path)
    prompt, total = int(batch[PROMPT_LENGTHS][0]), int(lengths[0])
    with torch.no_grad():
        logits = plain(batch["tokens"][:1, :total]).logits.log_softmax(-1)
    want = logits[0, prompt - 1 : total - 1].gather(-1, batch["tokens"][0, prompt:total, None])[:, 0]
    # float32 over another batch shape (the trainer's micro-batch of two rows): a few ulps of log-probs near 1.
    torch.testing.assert_close(out[keys.OLD_LOG_PROBS][0, : total - prompt], want, atol=1e-5, rtol=1e-5)

    first = compute(batch.update(out), advantage_config(cfg))[:2]  # one micro-batch: one router call a layer
    width = int(lengths[:2].max())
    current = router_choices(trainer.model, lambda: trainer.model(first["tokens"][:, :width]))
    seen = router_choices(trainer.model, lambda: trainer.train(first, per_step_rows=2))
    assert_routed_as(seen, old_routes[:2], lengths[:2], differs_from=current)


def test_an_sft_job_refuses_routing_replay_and_sft_loss_refuses_r2(path, tmp_path):
    # Catches: an SFT job (no engine, no old-log-prob pass) accepted with either flag, failing at the first batch far
    # from the cause, and --loss-type sft_loss on engine rollouts refused under R3, whose routes it replays.
    base = {**SMALL, "hf_checkpoint": path, "output_dir": str(tmp_path / "out"), "num_rollout": 1}
    for flag in ("use_rollout_routing_replay", "use_routing_replay"):
        with pytest.raises(ConfigError, match="an SFT job has neither"):
            validate(from_dict(None, **base, loss_type="sft_loss", **{flag: True}))
    engine_rollouts = {**base, "loss_type": "sft_loss", "rollout_function_path": f"{PLUGIN}:generate_rollout"}
    with pytest.raises(ConfigError, match="which --loss-type sft_loss does not run"):
        validate(from_dict(None, **engine_rollouts, use_routing_replay=True))
    validate(from_dict(None, **engine_rollouts, use_rollout_routing_replay=True))
