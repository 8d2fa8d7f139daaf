"""Routing replay under --train-backend megatron (runtime/train/backends/megatron_replay.py) on the CPU: the routes'
layout in megatron-core's token order, and the tiny Qwen3-MoE (every layer MoE, softmax router) and GLM-4.5 (the
first layer dense, sigmoid router with expert bias) models replaying routes through megatron-core's RouterReplay.

R3 (--use-rollout-routing-replay) replays a batch's ``routed_experts``; R2 (--use-routing-replay) records the actor's
own routes in the old-log-prob pass and replays them in the update.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.train.backends import megatron_replay as mr

# ------------------------------------------------------------------ the layout (pure)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 4),
    length=st.integers(1, 9),
    extra=st.integers(-3, 4),
    layers=st.integers(1, 3),
    topk=st.integers(1, 3),
    sp_size=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
)
def test_token_routes_are_megatrons_sequence_major_tokens(rows, length, extra, layers, topk, sp_size, seed):
    """Router ``j`` of the micro-batch sees token ``s * b + i`` (row ``i``'s position ``s``, of this
    sequence-parallel rank's chunk): it gets row ``i``'s routes at ``s`` for layer ``j``, and the dummy experts past
    the routes' length. Catches a batch-major order, a layer axis taken from the wrong dimension, a chunk of the wrong
    rank, and padding other than the dummy experts."""
    width = max(sp_size, ((length + extra) // sp_size) * sp_size)
    gen = torch.Generator().manual_seed(seed)
    routes = torch.randint(0, 64, (rows, length, layers, topk), generator=gen, dtype=torch.int32)
    chunks = [mr.token_routes(routes, width=width, sp_rank=r, sp_size=sp_size) for r in range(sp_size)]
    chunk = width // sp_size
    for r, got in enumerate(chunks):
        assert got.shape == (layers, chunk * rows, topk) and got.dtype == torch.int64
        for j in range(layers):
            for s_local in range(chunk):
                s = r * chunk + s_local
                for i in range(rows):
                    want = routes[i, s, j].long() if s < length else torch.arange(topk)
                    assert torch.equal(got[j, s_local * rows + i], want)
    # The chunks in rank order are the whole sequence, and rows_of undoes the layout.
    whole = torch.cat(chunks, dim=1)
    back = mr.rows_of(whole, rows=rows)
    assert torch.equal(back[:, : min(length, width)], routes[:, :width].long())


def test_check_routes_names_what_is_wrong():
    pattern = (0, 1, 1)  # a dense first layer: its slice is not read (SGLang leaves it 0)
    good = torch.tensor([[[[0, 0], [0, 3], [5, 1]]]], dtype=torch.int32)  # [1 row, 1 token, 3 layers, top 2]
    check = dict(num_experts=8, layer_pattern=pattern, topk=2, flag="--x")
    mr.check_routes(good, **check)
    with pytest.raises(ValueError, match=r"--x: routed_experts of shape \(1, 1, 3, 2\), want \[rows, tokens, 4 de"):
        mr.check_routes(good, **(check | dict(layer_pattern=(0, 1, 1, 1))))
    high = good.clone()
    high[0, 0, 2, 0] = 8
    with pytest.raises(ValueError, match="expert ids 0..8, outside 0..7"):
        mr.check_routes(high, **check)
    repeated = good.clone()
    repeated[0, 0, 2] = torch.tensor([4, 4])
    with pytest.raises(ValueError, match=r"row 0, token 0, decoder layer 2 names an expert twice: \[4, 4\]"):
        mr.check_routes(repeated, **check)
    with pytest.raises(ValueError, match="dtype torch.float32"):
        mr.check_routes(good.float(), **check)


def test_layer_slots_skip_dense_layers():
    pattern = (0, 1, 0, 1, 1)  # megatron-core numbers layers from 1
    assert [mr.layer_slot(n, pattern) for n in (2, 4, 5)] == [1, 3, 4]
    with pytest.raises(ValueError, match="decoder layer 2 is dense"):
        mr.layer_slot(3, pattern)


def test_replay_is_refused_on_a_dense_model_only():
    assert mr.replay_problems("rollout", None) == [
        "--use-rollout-routing-replay: routing replay needs a MoE model (this one is dense: no router to replay)"
    ]
    assert mr.replay_problems("rollout", object()) == [] and mr.replay_problems(None, None) == []
    assert "not one of ['rollout', 'trainer']" in mr.replay_problems("r3", object())[0]


# ------------------------------------------------------------------ megatron-core's models

pytest.importorskip("megatron.core")

from test_megatron_backend import job, make_batch, trainer  # noqa: E402
from test_megatron_moe import save_qwen3_moe  # noqa: E402

from rlcore import keys  # noqa: E402
from rlcore.advantages import compute  # noqa: E402
from runtime.train.algo import advantage_config  # noqa: E402
from runtime.train.batch import PROMPT_LENGTHS, RESPONSE_LENGTHS, ROUTED_EXPERTS  # noqa: E402
from runtime.train.hooks import train_hooks  # noqa: E402
from runtime.train.roles import ACTOR  # noqa: E402

VOCAB = 203


def _save_glm4_moe(folder) -> str:
    from test_megatron_glm4_moe import glm4_moe_model

    glm4_moe_model().save_pretrained(folder)
    return str(folder)


# family -> (a saved tiny model, its MoE layers (decoder layer indices), its decoder layers, top k, experts)
FAMILIES = {
    "qwen3_moe": (lambda folder: save_qwen3_moe(folder), [0, 1], 2, 2, 8),
    "glm4_moe": (_save_glm4_moe, [1, 2], 3, 2, 8),  # the first layer dense
}


def _job(tmp_path, **overrides):
    """The backend tests' job without the KL loss (the actor runs alone: no reference log-probs)."""
    return job(tmp_path, use_kl_loss=False, **overrides)


# The replay mode -> slime's flag that selects it.
FLAGS = {"rollout": "use_rollout_routing_replay", "trainer": "use_routing_replay"}


def _trainer(path, cfg, mode: str | None, **kw):
    """A Megatron trainer of ``cfg`` with slime's flag of replay ``mode`` set (through the driver's TrainHooks)."""
    flags = {FLAGS[mode]: True} if mode else {}
    hooks = train_hooks(dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, **flags)))
    assert hooks.routing_replay == mode
    return trainer("megatron", path, cfg, hooks=hooks, **kw)


def _with_advantages(td, cfg, log_probs, *, first_row: int = 0):
    """``td`` (rows from ``first_row`` of a batch) with ``log_probs`` and GRPO advantages, the old log-probs nudged by
    a function of the batch's row and position, so that the ratio is not one."""
    td = td.clone()
    td.update(log_probs)
    rows, width = td[keys.MASK].shape
    where = torch.arange(first_row * width, (first_row + rows) * width).view(rows, width)
    td.set(keys.OLD_LOG_PROBS, td[keys.OLD_LOG_PROBS] + 0.05 * torch.sin(where))
    return compute(td, advantage_config(cfg))


def _step(backend, cfg, td):
    """Log-probs, one optimizer step over ``td`` (8 rows), and the exported weights."""
    log_probs = backend.compute_log_probs(td)
    metrics = backend.train(_with_advantages(td, cfg, log_probs), per_step_rows=8)
    return log_probs, metrics, backend.get_weights()


def _foreign_routes(td, *, layers: int, topk: int, experts: int, seed: int = 1):
    """Distinct random experts for every token of ``td`` (not the model's own choices)."""
    gen = torch.Generator().manual_seed(seed)
    rows, length = td["tokens"].shape
    return torch.rand(rows, length, layers, experts, generator=gen).argsort(-1)[..., :topk].to(torch.int32)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_replaying_the_models_own_routes_changes_nothing_bitwise(family, tmp_path):
    """R2 records the actor's routes in the old-log-prob pass and replays them in the update; R3 replays those same
    routes from the batch: log-probs, loss, gradient norm and the weights after a step are bitwise those of no
    replay (the gate weights are the same gathers of the same scores). Catches routes handed to the wrong layer, in
    batch-major order, or recorded rows put back in the wrong order."""
    save, _, layers, _, _ = FAMILIES[family]
    path = save(tmp_path / "m")
    cfg = _job(tmp_path)
    td = make_batch(VOCAB)
    results = {}
    for mode in (None, "trainer"):
        backend = _trainer(path, cfg, mode, roles=(ACTOR,))
        try:
            results[mode] = _step(backend, cfg, td)
        finally:
            backend.shutdown()
    recorded = results["trainer"][0][ROUTED_EXPERTS]
    assert recorded.dtype == torch.int32 and recorded.shape == (*td["tokens"].shape, layers, 2)
    r3 = _trainer(path, cfg, "rollout", roles=(ACTOR,))
    try:
        with_routes = td.clone()
        with_routes.set(ROUTED_EXPERTS, recorded)
        results["rollout"] = _step(r3, cfg, with_routes)
    finally:
        r3.shutdown()
    (want_lp, want_metrics, want_weights) = results[None]
    for mode in ("trainer", "rollout"):
        log_probs, metrics, weights = results[mode]
        assert torch.equal(log_probs[keys.OLD_LOG_PROBS], want_lp[keys.OLD_LOG_PROBS]), mode
        for name in ("loss", "pg_loss", "grad_norm"):
            assert metrics[name] == want_metrics[name], (mode, name)
        assert all(torch.equal(weights[k], want_weights[k]) for k in want_weights), mode


def _router_calls(model, sink: list) -> list:
    """Forward hooks keeping each megatron-core router's input and output ``(hidden [s, b, h], probs [s*b, E],
    routing_map [s*b, E])``, in call order."""
    hooks = []
    for name, sub in model.named_modules():
        if name.endswith("mlp.router"):
            hooks.append(sub.register_forward_hook(lambda mod, args, out: sink.append((mod, args[0], *out))))
    return hooks


def _gate_weights(router, hidden, experts, family) -> torch.Tensor:
    """float64 reference of the gate weights ``[tokens, topk]`` of the given experts under ``router``'s current
    weights: Qwen3-MoE's softmax over the chosen experts' logits; GLM-4.5's sigmoid scores renormalised over them and
    scaled by routed_scaling_factor (the expert bias chooses, it does not weigh)."""
    logits = hidden.reshape(-1, hidden.shape[-1]).double() @ router.weight.double().T
    picked = logits.gather(1, experts)
    if family == "qwen3_moe":
        return torch.softmax(picked, dim=-1)
    scores = torch.sigmoid(picked)
    return scores / scores.sum(-1, keepdim=True) * router.config.moe_router_topk_scaling_factor


@pytest.mark.parametrize("family", list(FAMILIES))
def test_replay_restores_the_routes_after_a_perturbed_router(family, tmp_path):
    """The routes recorded from the original weights, replayed (R3) by an actor whose routers were perturbed: every
    router picks exactly the recorded experts (without replay it picks others), the gate weights are the perturbed
    router's scores at those experts (float64 reference), and the update moves the routers (their gradient flows).
    Catches replay not reaching a router, a layer's routes from another layer, and gate weights that do not follow
    the current router."""
    save, moe_layers, _, topk, experts = FAMILIES[family]
    path = save(tmp_path / "m")
    cfg = _job(tmp_path)
    td = make_batch(VOCAB)
    r2 = _trainer(path, cfg, "trainer", roles=(ACTOR,))
    try:
        recorded = r2.compute_log_probs(td)[ROUTED_EXPERTS]
    finally:
        r2.shutdown()
    dense = [i for i in range(recorded.shape[2]) if i not in moe_layers]
    recorded[:, :, dense] = 0  # as SGLang reports a dense layer: not read
    td.set(ROUTED_EXPERTS, recorded)
    backend = _trainer(path, cfg, "rollout", roles=(ACTOR,))
    try:
        gen = torch.Generator().manual_seed(7)
        routers = [m for n, m in backend.model.named_modules() if n.endswith("mlp.router")]
        assert len(routers) == len(moe_layers)
        with torch.no_grad():
            for router in routers:
                router.weight.add_(torch.randn(router.weight.shape, generator=gen))
        before = [router.weight.detach().clone() for router in routers]
        mb = td[:3]  # one micro-batch: rows of different lengths (right padding)
        calls = []
        hooks = _router_calls(backend.model, calls)
        try:
            with backend._shims(), torch.no_grad():
                backend._logits(backend.model, mb)  # outside any pass: the routers choose
                with backend._replay_pass("train"):
                    backend._logits(backend.model, mb)
        finally:
            for hook in hooks:
                hook.remove()
        own, replayed = calls[: len(moe_layers)], calls[len(moe_layers) :]
        seq_lens = mb[PROMPT_LENGTHS] + mb[RESPONSE_LENGTHS]
        width = int(seq_lens.max())
        differs = False
        for layer, (_, _, _, own_map), (router, hidden, probs, routing_map) in zip(
            moe_layers, own, replayed, strict=True
        ):
            # megatron-core's routers see the tokens sequence-major: token s * rows + i is row i's position s.
            want = mb[ROUTED_EXPERTS][:, :width, layer].long().transpose(0, 1).reshape(-1, topk)
            expected = torch.zeros(width * 3, experts, dtype=torch.bool).scatter(1, want, True)
            assert torch.equal(routing_map, expected), layer
            differs |= not torch.equal(own_map, expected)
            gates = _gate_weights(router, hidden, want, family)
            # float32 router against the float64 reference: a few ulps of O(1) values.
            torch.testing.assert_close(probs.gather(1, want).double(), gates, rtol=1e-5, atol=1e-6)
        assert differs, "the perturbation changed no route: the test would not see a replay that does nothing"
        backend.train(_with_advantages(td, cfg, backend.compute_log_probs(td)), per_step_rows=8)
        for router, old in zip(routers, before, strict=True):
            assert not torch.equal(router.weight.detach(), old)  # a zero gradient would leave Adam's step at zero
    finally:
        backend.shutdown()


def test_the_sft_loss_on_engine_rollouts_replays_the_engines_routes(tmp_path):
    """--loss-type sft_loss on engine rollouts (a rollout function of its own, so not slime's SFT job, which is
    refused) under R3: every router call of the optimizer step takes the batch's routes, micro-batch by micro-batch,
    after a perturbed router would choose others. Catches the SFT loss's step left out of the replay pass."""
    save, moe_layers, _, topk, experts = FAMILIES["qwen3_moe"]
    path = save(tmp_path / "m")
    cfg = _job(tmp_path)
    td = make_batch(VOCAB)
    r2 = _trainer(path, cfg, "trainer", roles=(ACTOR,))
    try:
        td.set(ROUTED_EXPERTS, r2.compute_log_probs(td)[ROUTED_EXPERTS])
    finally:
        r2.shutdown()
    sft = dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, loss_type="sft_loss"))
    backend = _trainer(path, sft, "rollout", roles=(ACTOR,))
    try:
        gen = torch.Generator().manual_seed(8)
        with torch.no_grad():
            for name, router in backend.model.named_modules():
                if name.endswith("mlp.router"):
                    router.weight.add_(torch.randn(router.weight.shape, generator=gen))
        calls = []
        hooks = _router_calls(backend.model, calls)
        try:
            backend.train(td, per_step_rows=8)
        finally:
            for hook in hooks:
                hook.remove()
        parts = backend._micro_batches(td)
        assert len(parts) > 1 and len(calls) == len(parts) * len(moe_layers)
        differs = False
        for i, (router, hidden, _, routing_map) in enumerate(calls):
            mb, layer = parts[i // len(moe_layers)], moe_layers[i % len(moe_layers)]
            width = int((mb[PROMPT_LENGTHS] + mb[RESPONSE_LENGTHS]).max())
            rows = mb[ROUTED_EXPERTS].shape[0]
            want = mb[ROUTED_EXPERTS][:, :width, layer].long().transpose(0, 1).reshape(-1, topk)
            assert torch.equal(
                routing_map, torch.zeros(width * rows, experts, dtype=torch.bool).scatter(1, want, 1)
            ), i
            own = (hidden.reshape(-1, hidden.shape[-1]) @ router.weight.T).topk(topk, -1).indices
            differs |= not torch.equal(own.sort(-1).values, want.sort(-1).values)
        assert differs, "the perturbation changed no route: the test would not see a replay that does nothing"
    finally:
        backend.shutdown()


def test_padding_rows_route_only_padding(tmp_path):
    """Replayed routes whose padding rows (and the positions past a row's tokens) hold the dummy experts
    ``0 .. topk - 1`` or any other experts: the real tokens get exactly their recorded experts and the same log-probs
    either way (an expert's tokens are computed row by row), the padding tokens the dummies. Catches padding rows
    shifted onto real tokens (an off-by-one in the layout) and padding that routes by the router."""
    path = save_qwen3_moe(tmp_path / "m")
    cfg = _job(tmp_path)
    td = make_batch(VOCAB)
    rows, length = td["tokens"].shape
    seq_lens = td[PROMPT_LENGTHS] + td[RESPONSE_LENGTHS]
    real = torch.arange(length)[None, :] < seq_lens[:, None] - 1  # the engine reports no row for the last token
    routes = _foreign_routes(td, layers=2, topk=2, experts=8)
    dummy = torch.where(real[..., None, None], routes, mr.dummy_routes((rows, length, 2), topk=2).to(routes.dtype))
    other = torch.where(real[..., None, None], routes, torch.tensor([7, 5], dtype=routes.dtype))
    backend = _trainer(path, cfg, "rollout", roles=(ACTOR,))
    try:
        out = {}
        for name, padding in (("dummy", dummy), ("other", other)):
            batch = td.clone()
            batch.set(ROUTED_EXPERTS, padding)
            calls = []
            hooks = _router_calls(backend.model, calls)
            try:
                out[name] = backend.compute_log_probs(batch)[keys.OLD_LOG_PROBS]
            finally:
                for hook in hooks:
                    hook.remove()
            out[name + "_calls"] = calls
        mask = td[keys.MASK]
        # float32: an expert's matrix product over more or fewer padding rows may block its sums differently.
        torch.testing.assert_close(out["dummy"][mask], out["other"][mask], rtol=1e-6, atol=1e-6)
        # The first micro-batch (3 rows): each router's map, row by row, in megatron's sequence-major order.
        width = int(seq_lens[:3].max())
        for slot, (_, hidden, _, routing_map) in enumerate(out["dummy_calls"][:2]):
            assert hidden.shape[:2] == (width, 3)
            chosen = routing_map.view(width, 3, 8).transpose(0, 1)  # [row, position, experts]
            for i in range(3):
                for s in range(width):
                    experts = chosen[i, s].nonzero().flatten().tolist()
                    want = sorted(routes[i, s, slot].tolist()) if real[i, s] else [0, 1]
                    assert experts == want, (slot, i, s)
    finally:
        backend.shutdown()


def test_a_reference_model_in_the_same_process_does_not_replay(tmp_path):
    """R3 with foreign routes moves the actor's log-probs away from no replay, while the reference model built by the
    same trainer (same process, same weights) gives exactly no replay's; megatron-core's process-global list holds
    the actor's routers only, and loses them at shutdown. Catches replay switched on for every model built (or set
    through RouterReplay's global methods)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    path = save_qwen3_moe(tmp_path / "m")
    cfg = _job(tmp_path)
    td = make_batch(VOCAB)
    td.set(ROUTED_EXPERTS, _foreign_routes(td, layers=2, topk=2, experts=8))
    off = _trainer(path, cfg, None)
    try:
        want = off.compute_log_probs(td)
    finally:
        off.shutdown()
    before = list(RouterReplay.global_router_replay_instances)
    r3 = _trainer(path, cfg, "rollout")
    try:
        added = [r for r in RouterReplay.global_router_replay_instances if all(r is not b for b in before)]
        assert len(added) == 2 and {id(r) for r in added} == {id(r) for r in r3.routers.replays}
        got = r3.compute_log_probs(td)
    finally:
        r3.shutdown()
    assert all(all(r is not a for a in added) for r in RouterReplay.global_router_replay_instances)
    mask = td[keys.MASK]
    assert torch.equal(got[keys.REF_LOG_PROBS], want[keys.REF_LOG_PROBS])
    assert not torch.allclose(got[keys.OLD_LOG_PROBS][mask], want[keys.OLD_LOG_PROBS][mask], atol=1e-3)


def test_activation_recompute_replays_the_same_routes(tmp_path):
    """R3 with foreign routes under --recompute-granularity full (every layer rerun in the backward, the routers
    with it) after an R3 log-prob pass over other micro-batches (--log-probs-max-tokens-per-gpu): the same loss,
    gradient norm and weights as without recompute (the recompute pops each micro-batch's routes,
    REPLAY_BACKWARD). Catches a recompute that routes by the router's own choice, or pops routes the log-prob pass
    left behind."""
    path = save_qwen3_moe(tmp_path / "m")
    td = make_batch(VOCAB)
    td.set(ROUTED_EXPERTS, _foreign_routes(td, layers=2, topk=2, experts=8))
    results = []
    for recompute in ({}, dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)):
        cfg = _job(tmp_path, log_probs_max_tokens_per_gpu=24, **recompute)
        backend = _trainer(path, cfg, "rollout", roles=(ACTOR,))
        try:
            results.append(_step(backend, cfg, td))
        finally:
            backend.shutdown()
    (_, plain, plain_weights), (_, rerun, rerun_weights) = results
    for name in ("loss", "pg_loss", "grad_norm"):
        # The recompute reruns the same operations on the same inputs: the same values.
        assert rerun[name] == plain[name], name
    assert all(torch.equal(rerun_weights[k], plain_weights[k]) for k in plain_weights)


def test_recompute_after_later_forwards_pops_each_micro_batchs_own_routes(tmp_path):
    """Forwards and backwards as a 1F1B pipeline interleaves them (two micro-batches' forwards, then their backwards
    in order) under full recompute with R3: each backward's gradients equal that micro-batch's alone (forward then
    backward). Catches a recompute that takes the latest forward's routes (REPLAY_FORWARD's target) instead of
    popping its own (REPLAY_BACKWARD, switched on by the output's gradient hook)."""
    path = save_qwen3_moe(tmp_path / "m")
    cfg = _job(tmp_path, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    td = _routed_batch()
    first, second = td[:3], td[3:5]
    backend = _trainer(path, cfg, "rollout", roles=(ACTOR,))
    params = [p for p in backend.model.parameters() if p.requires_grad]

    def grads(output):
        for p in params:
            p.grad = None
        output.float().square().mean().backward()
        return [p.grad.clone() for p in params]

    try:
        backend.model.train()  # megatron-core recomputes in training mode only
        with backend._shims(), backend._replay_pass("train"):
            alone = [grads(backend._logits(backend.model, mb)) for mb in (first, second)]
            outputs = [backend._logits(backend.model, mb) for mb in (first, second)]
            interleaved = [grads(output) for output in outputs]
    finally:
        backend.shutdown()
    for want, got in zip(alone, interleaved, strict=True):
        # The same operations on the same inputs: the same gradients.
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_recorded_routes_follow_the_shards_rows_under_dynamic_batches(tmp_path):
    """R2 under --use-dynamic-batch-size (rows regrouped into micro-batches by their tokens): the routes recorded for
    each row's tokens are the experts the routers choose for that row in a plain forward of the whole shard. Catches
    recorded micro-batches left in their regrouped order, and rows and positions swapped."""
    path = save_qwen3_moe(tmp_path / "m")
    cfg = _job(tmp_path, use_dynamic_batch_size=True, max_tokens_per_gpu=16)
    td = make_batch(VOCAB)
    backend = _trainer(path, cfg, "trainer", roles=(ACTOR,))
    try:
        groups = backend._token_groups(td, log_probs=True)
        assert [i for rows in groups for i in rows] != list(range(8))  # regrouped, or the test would see nothing
        recorded = backend.compute_log_probs(td)[ROUTED_EXPERTS]
        calls = []
        hooks = _router_calls(backend.model, calls)
        try:
            with backend._shims(), torch.no_grad():
                backend._logits(backend.model, td)
        finally:
            for hook in hooks:
                hook.remove()
    finally:
        backend.shutdown()
    seq_lens = (td[PROMPT_LENGTHS] + td[RESPONSE_LENGTHS]).tolist()
    width = max(seq_lens)
    for slot, (_, _, _, routing_map) in enumerate(calls):
        chosen = routing_map.view(width, 8, 8).transpose(0, 1)  # [row, position, experts]
        for i, n in enumerate(seq_lens):
            for s in range(n):
                assert chosen[i, s].nonzero().flatten().tolist() == sorted(recorded[i, s, slot].tolist()), (slot, i, s)


def test_replay_refuses_a_batch_without_routes_and_a_dense_model(tmp_path):
    path = save_qwen3_moe(tmp_path / "m")
    cfg = _job(tmp_path)
    backend = _trainer(path, cfg, "rollout", roles=(ACTOR,))
    try:
        missing = "--use-rollout-routing-replay: the batch has no routed_experts .the routes to replay: the rollout"
        with pytest.raises(ValueError, match=missing):
            backend.compute_log_probs(make_batch(VOCAB))
    finally:
        backend.shutdown()
    from test_megatron_backend import save_model

    dense = save_model("qwen3", tmp_path / "dense")
    with pytest.raises(ValueError, match="--use-routing-replay: routing replay needs a MoE model"):
        _trainer(dense, cfg, "trainer", roles=(ACTOR,))


def _routed_batch():
    td = make_batch(VOCAB)
    td.set(ROUTED_EXPERTS, _foreign_routes(td, layers=2, topk=2, experts=8))
    return td


def _ep_worker(rank, port, path, tmp, out):
    cfg = _job(tmp, expert_model_parallel_size=2, actor_num_gpus_per_node=2)
    backend = _trainer(path, cfg, "rollout", roles=(ACTOR,), rank=rank, world_size=2, master_port=port)
    try:
        part = _routed_batch()[4 * rank : 4 * rank + 4]  # each data-parallel rank one group of 4
        log_probs = backend.compute_log_probs(part)
        metrics = backend.train(_with_advantages(part, cfg, log_probs, first_row=4 * rank), per_step_rows=4)
        torch.save({"log_probs": log_probs[keys.OLD_LOG_PROBS], "metrics": metrics}, f"{out}.{rank}")
    finally:
        backend.shutdown()


@pytest.mark.slow  # two processes spawned: about 100 s on two loaded CPU cores
def test_expert_parallel_replay_equals_one_rank(tmp_path, gloo_ranks):
    """R3 with foreign routes at EP=2 over gloo (two processes, each a data-parallel rank holding half the experts
    and half the rows; the routes name global experts, dispatched to the rank that holds them) against EP=1: the same
    log-probs, loss and gradient norm. Catches routes taken as local expert ids or sliced by expert rank."""
    from test_megatron_backend import _free_port

    path = save_qwen3_moe(tmp_path / "m")
    out = str(tmp_path / "ep2.pt")
    gloo_ranks.run(_ep_worker, _free_port(), path, tmp_path, out)
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    cfg = _job(tmp_path)
    one = _trainer(path, cfg, "rollout", roles=(ACTOR,))
    try:
        td = _routed_batch()
        log_probs = one.compute_log_probs(td)
        want = one.train(_with_advantages(td, cfg, log_probs), per_step_rows=8)
    finally:
        one.shutdown()
    mask = td[keys.MASK]
    got = torch.cat([r["log_probs"] for r in ranks])
    # float32 both: the same experts compute the same tokens in other batches (summation order only).
    torch.testing.assert_close(got[mask], log_probs[keys.OLD_LOG_PROBS][mask], rtol=1e-5, atol=2e-5)
    for name in ("loss", "pg_loss", "grad_norm"):
        assert {r["metrics"][name] for r in ranks} == {ranks[0]["metrics"][name]}  # reduced over the DP ranks
        assert ranks[0]["metrics"][name] == pytest.approx(want[name], rel=1e-4, abs=1e-6), name
