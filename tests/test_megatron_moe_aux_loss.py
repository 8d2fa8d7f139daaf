"""--moe-aux-loss-coeff under --train-backend megatron on the CPU: megatron-core's balancing loss on a tiny Qwen3-MoE,
against an independent float64 computation of the Switch-style loss over the real (non-padding) tokens.

The reference: for each MoE layer and micro-batch, the router's input ``h`` (captured by a hook) and weight ``W``
give scores ``softmax(h W^T)`` over the real tokens only; ``f_e`` is the fraction of the ``T x k`` top-k choices of
those scores that went to expert ``e`` (a constant), ``P_e`` the mean score of expert ``e``, and the loss
``coeff x E x sum_e f_e P_e``; the step's loss is the sum over layers of the mean over micro-batches. Data-parallel
ranks (DP=2 over gloo) are held to one rank over the same global batch.

Tolerances: the model runs in float32 and the reference in float64 on the same captured inputs, so they differ by
float32 rounding of a softmax and a sum over a few dozen tokens (relative ~1e-6); 1e-5 relative leaves margin and is
far below any counting mistake (a token more or less moves the loss by ~1/T, T < 50).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from test_megatron_backend import job, trainer  # noqa: E402
from test_megatron_moe import save_qwen3_moe  # noqa: E402

from runtime.rollout.sample import Sample  # noqa: E402
from runtime.train.backends import megatron_moe as moe  # noqa: E402
from runtime.train.batch import PROMPT_LENGTHS, RESPONSE_LENGTHS, TOKENS, build_batch  # noqa: E402
from runtime.train.roles import ACTOR  # noqa: E402

VOCAB = 203
EXPERTS, TOPK = 8, 2
COEFF = 0.05
TOL = dict(rtol=1e-5, atol=1e-9)


def _batch(lengths: list[int], *, seed: int = 0):
    """Rows of ``lengths`` tokens (the last two of each the response)."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i, n in enumerate(lengths):
        tokens = torch.randint(1, VOCAB, (n,), generator=gen).tolist()
        samples.append(
            Sample(
                index=i, group_index=i, tokens=tokens, response_length=2, reward=0.0, rollout_log_probs=[-1.0, -1.0]
            )
        )
    return build_batch(samples, pad_token_id=0)


def _real(mb) -> torch.Tensor:
    seq = mb[PROMPT_LENGTHS] + mb[RESPONSE_LENGTHS]
    return ~moe.padding_mask(seq, int(seq.max()))


def _token_loss(total_tokens: int):
    """A loss over the real tokens only, each micro-batch its share of the batch's (so micro-batches add up)."""

    def loss_fn(logits, mb):
        real = _real(mb).to(logits.device)
        return logits[..., :VOCAB].float().logsumexp(-1)[real].sum() / total_tokens, {}

    return loss_fn


def _capture(model, sink: list):
    """Hooks recording each router call's input ``[s, b, H]`` with its layer's router weight's name."""
    hooks = []
    for name, sub in model.named_modules():
        if name.endswith("mlp.router"):
            hooks.append(sub.register_forward_hook(lambda m, args, out, n=name: sink.append((n, args[0].detach()))))
    return hooks


def _switch(h: torch.Tensor, w: torch.Tensor, real: torch.Tensor, *, per_row: bool = False) -> torch.Tensor:
    """float64 Switch loss (without the coefficient) of router input ``h [s, b, H]`` and weight ``w [E, H]`` over the
    ``real [b, s]`` tokens; ``per_row``: the mean over rows of each row's own loss (seq_aux_loss)."""
    hb = h.transpose(0, 1).double()  # batch-major, as ``real``
    groups = [hb[i][real[i]] for i in range(hb.shape[0])] if per_row else [hb[real]]
    losses = []
    for x in groups:
        scores = torch.softmax(x @ w.double().T, dim=-1)
        chosen = torch.zeros_like(scores).scatter(1, scores.topk(TOPK, dim=-1).indices, 1.0)
        tokens = x.shape[0]
        f = chosen.sum(0) / (tokens * TOPK)
        p = scores.sum(0) / tokens
        losses.append(EXPERTS * (f * p).sum())
    return torch.stack(losses).mean()


def _run_step(mega, td, calls: list):
    """One optimizer step (no clipping) over ``td``'s micro-batches; its metrics, the router weights before it and
    their gradients."""
    model = mega._module(mega.model)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("router.weight")}
    parts = mega._micro_batches(td)
    total = torch.tensor(int(sum(_real(mb).sum() for mb in parts)), device=mega.device)
    if mega.dp_group() is not None:  # the loss is each rank's share of the global batch's
        torch.distributed.all_reduce(total, group=mega.dp_group())
    total = int(total)
    hooks = _capture(mega.model, calls)
    try:
        with mega._shims():
            metrics = mega._step(parts, _token_loss(total))
    finally:
        for hook in hooks:
            hook.remove()
    # (On GPUs Megatron's DDP keeps the gradients in its buffers, not in .grad.)
    grads = {
        n: p.grad.detach().clone()
        for n, p in model.named_parameters()
        if n.endswith("router.weight") and p.grad is not None
    }
    return metrics, before, grads, parts


def _weight_of(module_name: str, weights: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
    (name,) = [n for n in weights if n.endswith(module_name.split("module.")[-1] + ".weight")]
    return name, weights[name]


def _reference(calls, parts, weights, *, per_row: bool = False):
    """``(the step's loss, its gradient on each router weight)``, float64, from the captured router inputs."""
    ws = {n: w.double().requires_grad_(True) for n, w in weights.items()}
    layers = len(calls) // len(parts)
    loss = torch.zeros((), dtype=torch.float64)
    for i, (module_name, h) in enumerate(calls):
        mb = parts[i // layers]
        _, w = _weight_of(module_name, ws)
        loss = loss + COEFF * _switch(h, w, _real(mb), per_row=per_row) / len(parts)
    grads = torch.autograd.grad(loss, list(ws.values()))
    return loss.detach(), dict(zip(ws, grads, strict=True))


def _trainer(
    tmp_path, path, *, coeff: float, micro_batch_size: int, balancing: str = "aux_loss", device="cpu", **flags
):
    settings = dict(clip_grad=0.0, use_kl_loss=False)
    settings.update(flags)
    cfg = job(
        tmp_path,
        train_backend="megatron",
        moe_aux_loss_coeff=coeff,
        moe_router_load_balancing_type=balancing,
        micro_batch_size=micro_batch_size,
        **settings,
    )
    return trainer("megatron", path, cfg, roles=(ACTOR,), device=device)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return save_qwen3_moe(tmp_path_factory.mktemp("qwen3_moe") / "m", num_hidden_layers=2)


def test_megatron_core_padding_mask_marks_padding_not_valid_tokens():
    """megatron-core 0.16.1's docstrings call ``padding_mask`` True for valid tokens, its code drops the True rows
    from the balancing statistics: rlcore passes True at padding (:func:`megatron_moe.padding_mask`). Fails if a
    version bump makes the code follow the docstring."""
    from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss

    logits = torch.randn(6, EXPERTS, generator=torch.Generator().manual_seed(0))
    marked = torch.tensor([False, False, False, False, True, True])
    routing_map, scores = compute_routing_scores_for_aux_loss(logits, TOPK, "softmax", padding_mask=marked)
    assert not routing_map[marked].any() and not scores[marked].any()
    assert routing_map[~marked].sum() == 4 * TOPK
    torch.testing.assert_close(scores[~marked], torch.softmax(logits[~marked], -1))
    seq = torch.tensor([3, 5])
    assert moe.padding_mask(seq, 5).tolist() == [[False] * 3 + [True] * 2, [False] * 5]


def test_aux_loss_value_and_gradient_equal_the_switch_loss_over_real_tokens(tmp_path, model_path):
    """Rows of unequal lengths (padding in every micro-batch but one) over 3 micro-batches: the reported
    ``moe_aux_loss`` equals the float64 Switch loss over the real tokens (the sum over layers of the micro-batches'
    mean), and each router weight's gradient with the coefficient equals its gradient without it plus that loss's own
    autograd gradient. Catches: padding counted (no or inverted padding_mask), the loss scale not set to
    1 / micro-batches (x3), top-k or E or coeff dropped, the metric not reported, or the loss not added to the
    gradient."""
    td = _batch([5, 9, 7, 4, 8, 6, 9, 5])
    results = {}
    for coeff in (COEFF, 0.0):
        mega = _trainer(tmp_path, model_path, coeff=coeff, micro_batch_size=3)
        try:
            calls = []
            results[coeff] = (*_run_step(mega, td, calls), calls)
        finally:
            mega.shutdown()
    metrics, before, grads, parts, calls = results[COEFF]
    _, before0, grads0, _, _ = results[0.0]
    assert len(parts) == 3 and "moe_aux_loss" not in results[0.0][0]
    for name in before:
        assert torch.equal(before[name], before0[name])
    want_loss, want_grads = _reference(calls, parts, before)
    assert metrics["moe_aux_loss"] == pytest.approx(float(want_loss), rel=1e-5)
    # The last layer's router: the balancing loss reaches it directly only (an earlier router's gradient also takes the
    # later layers' loss through its layer's output, which the reference holds fixed).
    (last,) = [n for n in grads if f"layers.{len(calls) // len(parts) - 1}." in n]
    grad, grad0 = grads[last].double(), grads0[last].double()
    # The gradient without the coefficient is of order 1e-2; the sum keeps float32's ~1e-7 relative error of it.
    torch.testing.assert_close(grad, grad0 + want_grads[last], rtol=1e-5, atol=1e-7)
    assert (grad - grad0).abs().max() > 1e-4  # the balancing loss moved the router: the check can fail


def test_two_micro_batches_equal_one(tmp_path, model_path):
    """The same two rows in one micro-batch or in two: the same metric and router gradients (Switch's fractions of
    two copies of a row are that row's). Catches a loss scale that is not 1 / micro-batch count (x2)."""
    td = _batch([6, 6], seed=1)
    td[TOKENS][1] = td[TOKENS][0]
    out = {}
    for size in (2, 1):
        mega = _trainer(tmp_path, model_path, coeff=COEFF, micro_batch_size=size)
        try:
            metrics, _, grads, parts = _run_step(mega, td, [])
            assert len(parts) == 2 // size
            out[size] = (metrics["moe_aux_loss"], grads)
        finally:
            mega.shutdown()
    assert out[1][0] == pytest.approx(out[2][0], rel=1e-6)
    for name, grad in out[2][1].items():
        torch.testing.assert_close(out[1][1][name], grad, rtol=1e-5, atol=1e-8)


def test_padding_tokens_change_nothing(tmp_path, model_path):
    """Other token ids in the padding after the short rows (routed elsewhere) leave the balancing loss and the router
    gradients as they were. Catches padding_mask not handed to the routers."""
    td = _batch([4, 9, 5], seed=2)
    noisy = td.clone()
    seq = td[PROMPT_LENGTHS] + td[RESPONSE_LENGTHS]
    pad = moe.padding_mask(seq, td[TOKENS].shape[1])
    noisy[TOKENS][pad] = torch.randint(1, VOCAB, (int(pad.sum()),), generator=torch.Generator().manual_seed(3))
    assert not torch.equal(noisy[TOKENS], td[TOKENS])
    out = []
    for batch in (td, noisy):
        mega = _trainer(tmp_path, model_path, coeff=COEFF, micro_batch_size=3)
        try:
            metrics, _, grads, _ = _run_step(mega, batch, [])
            out.append((metrics["moe_aux_loss"], grads))
        finally:
            mega.shutdown()
    # Same real tokens, same arithmetic on them; only the padded rows' own (discarded) values differ.
    assert out[1][0] == pytest.approx(out[0][0], rel=1e-6)
    for name, grad in out[0][1].items():
        torch.testing.assert_close(out[1][1][name], grad, rtol=1e-5, atol=1e-8)


def test_seq_aux_loss_is_the_mean_of_each_rows_switch_loss(tmp_path, model_path):
    """--moe-router-load-balancing-type seq_aux_loss over rows of one length: the metric is the float64 mean over
    rows of each row's own Switch loss, summed over layers. Catches the batch-level loss reported instead."""
    td = _batch([7, 7, 7], seed=4)
    mega = _trainer(tmp_path, model_path, coeff=COEFF, micro_batch_size=3, balancing="seq_aux_loss")
    try:
        calls = []
        metrics, before, _, parts = _run_step(mega, td, calls)
    finally:
        mega.shutdown()
    want_loss, _ = _reference(calls, parts, before, per_row=True)
    batch_loss, _ = _reference(calls, parts, before)
    assert abs(float(want_loss) - float(batch_loss)) > 1e-3 * float(want_loss)  # the two kinds differ here
    assert metrics["moe_aux_loss"] == pytest.approx(float(want_loss), rel=1e-5)


def _global_reference(calls, parts, weights):
    """``(the step's loss, its gradient on each router weight)``, float64, of megatron-core 0.16.1's global_aux_loss
    (``router.py`` ``_apply_global_aux_loss``, one data-parallel rank): micro-batch ``m``'s Switch loss of its own
    scores against the tokens per expert averaged over micro-batches ``1..m`` of the step,
    ``coeff x E / (k x T_m^2) x sum_e P_e x mean_{j <= m} c_je`` (``P_e`` the sum of expert ``e``'s scores over the
    ``T_m`` real tokens of ``m``, ``c_je`` the real tokens of ``j`` whose top-k took ``e``), per layer; the step's loss
    is the sum over layers of the micro-batches' mean."""
    ws = {n: w.double().requires_grad_(True) for n, w in weights.items()}
    layers = len(calls) // len(parts)
    counts: dict[str, list[torch.Tensor]] = {}
    loss = torch.zeros((), dtype=torch.float64)
    for i, (module_name, h) in enumerate(calls):
        mb = parts[i // layers]
        name, w = _weight_of(module_name, ws)
        x = h.transpose(0, 1).double()[_real(mb)]
        scores = torch.softmax(x @ w.T, dim=-1)
        chosen = torch.zeros_like(scores).scatter(1, scores.topk(TOPK, dim=-1).indices, 1.0)
        counts.setdefault(name, []).append(chosen.sum(0).detach())
        running = torch.stack(counts[name]).mean(0)
        tokens = x.shape[0]
        loss = loss + COEFF * EXPERTS * (scores.sum(0) * running).sum() / (TOPK * tokens * tokens) / len(parts)
    grads = torch.autograd.grad(loss, list(ws.values()))
    return loss.detach(), dict(zip(ws, grads, strict=True))


def test_global_aux_loss_is_the_switch_loss_against_the_steps_running_counts(tmp_path, model_path):
    """--moe-router-load-balancing-type global_aux_loss over 3 micro-batches of unequal lengths, two steps: each step's
    metric and last router gradient equal the float64 loss against the step's running average of tokens per expert,
    and the counts start again at each step. Catches: the running count not reset after a step (on the CPU megatron-
    core's finalize_model_grads does not run: the second step would average in the first's counts), the batch-level
    loss taken instead (the two differ here), padding counted, and the metric divided by the data-parallel size."""
    td = _batch([5, 9, 7, 4, 8, 6, 9, 5], seed=5)
    results = {}
    for coeff in (COEFF, 0.0):
        mega = _trainer(tmp_path, model_path, coeff=coeff, micro_batch_size=3, balancing="global_aux_loss")
        try:
            steps = []
            for _ in range(2):
                calls = []
                steps.append((*_run_step(mega, td, calls), calls))
            results[coeff] = steps
        finally:
            mega.shutdown()
    for step, (metrics, before, grads, parts, calls) in enumerate(results[COEFF]):
        want_loss, want_grads = _global_reference(calls, parts, before)
        batch_loss, _ = _reference(calls, parts, before)
        assert abs(float(want_loss) - float(batch_loss)) > 1e-4 * float(want_loss), step  # the kinds differ here
        assert metrics["moe_aux_loss"] == pytest.approx(float(want_loss), rel=1e-5), step
        if step == 0:  # (the next step starts from other weights with and without the coefficient)
            _, before0, grads0, _, _ = results[0.0][0]
            assert all(torch.equal(before[n], before0[n]) for n in before)
            (last,) = [n for n in grads if f"layers.{len(calls) // len(parts) - 1}." in n]
            grad, grad0 = grads[last].double(), grads0[last].double()
            # As for aux_loss: float32's ~1e-7 relative error of a gradient of order 1e-2.
            torch.testing.assert_close(grad, grad0 + want_grads[last], rtol=1e-5, atol=1e-7)
            assert (grad - grad0).abs().max() > 1e-4


@pytest.mark.parametrize(
    ("coeff", "balancing", "named"),
    [(-0.1, "aux_loss", "must be >= 0"), (0.01, "sinkhorn", "sinkhorn with --moe-aux-loss-coeff")],
)
def test_refuses_what_is_not_built(coeff, balancing, named):
    from types import SimpleNamespace

    problems = moe.aux_loss_problems(
        SimpleNamespace(moe_aux_loss_coeff=coeff, moe_router_load_balancing_type=balancing)
    )
    assert len(problems) == 1 and named in problems[0]
    for ok in ("aux_loss", "seq_aux_loss", "global_aux_loss", "none"):
        assert moe.aux_loss_problems(SimpleNamespace(moe_aux_loss_coeff=0.01, moe_router_load_balancing_type=ok)) == []


def test_the_job_takes_a_coefficient_under_megatron_only(tmp_path):
    from test_megatron_moe import _moe_job, _problems

    job = _moe_job(tmp_path)
    assert _problems([*job, "--moe-aux-loss-coeff", "0.01", "--moe-router-load-balancing-type", "seq_aux_loss"]) == []
    (problem,) = _problems([*job, "--moe-aux-loss-coeff", "-0.5"])
    assert problem == "--moe-aux-loss-coeff must be >= 0, got -0.5"
    torch_job = [*job, "--train-backend", "torch", "--moe-aux-loss-coeff", "0.01"]
    assert _problems(torch_job) == ["--moe-aux-loss-coeff: a Megatron flag, used by --train-backend megatron only"]


def test_the_expert_bias_count_of_megatron_core_misaligns_the_padding_mask_until_worked_around():
    """megatron-core 0.16.1's ``TopKRouter._apply_expert_bias`` masks the ``[tokens, experts]`` routing map with the
    ``[tokens]`` padding mask unaligned (an error here); the workaround (megatron_compat) counts the real tokens'
    routes only. Fails once a version aligns the mask itself, so the workaround is dropped."""
    import inspect
    from types import SimpleNamespace

    from runtime.train.backends import megatron_compat

    routes = torch.tensor([[True, False], [True, True], [False, True]])
    marked = torch.tensor([False, True, False])
    probe = SimpleNamespace(enable_expert_bias=True, local_tokens_per_expert=torch.zeros(2))
    with pytest.raises(RuntimeError, match="must match the size"):
        inspect.unwrap(megatron_compat.original_expert_bias())(probe, routes, padding_mask=marked)
    megatron_compat.apply_no_te_workarounds()
    from megatron.core.transformer.moe.router import TopKRouter

    with torch.enable_grad():
        TopKRouter._apply_expert_bias(probe, routes, padding_mask=marked)
    assert probe.local_tokens_per_expert.tolist() == [1.0, 1.0]
    assert routes.tolist() == [[True, False], [True, True], [False, True]]  # the caller's map is left as it was


def _ep_worker(rank, port, path, tmp, out):
    cfg = job(
        tmp,
        train_backend="megatron",
        moe_aux_loss_coeff=COEFF,
        micro_batch_size=3,
        clip_grad=0.0,
        use_kl_loss=False,
        expert_model_parallel_size=2,
        actor_num_gpus_per_node=2,
    )
    mega = trainer("megatron", path, cfg, rank=rank, world_size=2, master_port=port, roles=(ACTOR,))
    try:
        metrics, _, grads, _ = _run_step(mega, _batch([5, 9, 7, 4, 8], seed=5), [])
        torch.save({"metric": metrics["moe_aux_loss"], "grads": grads}, f"{out}.{rank}")
    finally:
        mega.shutdown()


@pytest.mark.slow
def test_expert_parallel_ranks_with_one_shard_each_equal_one_rank(tmp_path, model_path, gloo_ranks):
    """EP=2 over gloo, both data-parallel ranks given the same rows: the reported loss (the DP mean) and the routers'
    DP-averaged gradients equal one rank's over those rows at EP=1. Catches a metric summed, not averaged, over DP
    ranks (x2), and a balancing-loss gradient that tokens dispatched to the other rank's experts change."""
    from test_megatron_backend import _free_port

    out = str(tmp_path / "ep2.pt")
    gloo_ranks.run(_ep_worker, _free_port(), model_path, tmp_path, out)
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    mega = _trainer(tmp_path, model_path, coeff=COEFF, micro_batch_size=3)
    try:
        metrics, _, grads, _ = _run_step(mega, _batch([5, 9, 7, 4, 8], seed=5), [])
    finally:
        mega.shutdown()
    for got in ranks:
        assert got["metric"] == pytest.approx(metrics["moe_aux_loss"], rel=1e-5)
        for name, grad in grads.items():
            # float32 both sides; the experts' outputs come back through the alltoall in another order of sums.
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-7)


# ------------------------------------------------------------------ DP=2 over gloo against DP=1

# Each rank's rows: two micro-batches of two rows of unequal lengths (padding in every micro-batch).
DP_SHARDS = ([5, 9, 7, 4], [8, 6, 9, 5])
# A clipping bound no step reaches: the gradient norm is computed (Megatron's optimizers on GPUs skip it at 0) and
# never applied.
NO_CLIP = 1e6


def _dp_batch(rank: int | None):
    """Rank ``rank``'s shard of the global batch, or (``None``) the global batch for one rank with the ranks' k-th
    micro-batches next to each other: rows ``[r0 mb0, r1 mb0, r0 mb1, r1 mb1]``, so that one rank's micro-batches of
    four rows are the union of the ranks' k-th micro-batches (what global_aux_loss counts together) and its
    micro-batches of two rows the ranks' own (what aux_loss and seq_aux_loss average)."""
    td = _batch([n for shard in DP_SHARDS for n in shard], seed=7)
    if rank is not None:
        return td[4 * rank : 4 * rank + 4]
    return td[torch.tensor([0, 1, 4, 5, 2, 3, 6, 7])]


def _dp_worker(rank, port, kind, coeff, device, path, tmp, out):
    if device == "cuda":
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False
        device = f"cuda:{rank}"
    cfg = job(
        tmp,
        train_backend="megatron",
        moe_aux_loss_coeff=coeff,
        moe_router_load_balancing_type=kind,
        micro_batch_size=2,
        clip_grad=NO_CLIP,
        use_kl_loss=False,
        bf16="false",
        actor_num_gpus_per_node=2,
    )
    mega = trainer("megatron", path, cfg, rank=rank, world_size=2, master_port=port, roles=(ACTOR,), device=device)
    try:
        metrics, _, grads, parts = _run_step(mega, _dp_batch(rank), [])
        assert len(parts) == 2
        torch.save({"metrics": metrics, "grads": grads}, f"{out}.{rank}")
        if kind == "global_aux_loss":
            # Its counts are all-reduced over the DP ranks in every router forward: ranks with other micro-batch
            # counts are refused before any forward, on every rank (not left waiting in the collective).
            refusal = "global_aux_loss: the data-parallel ranks' shards split into 1 to 2"
            with mega._shims(), pytest.raises(ValueError, match=refusal):
                mega._run(mega.model, parts[: 1 + rank], forward_only=False, loss_fn=_token_loss(1))
    finally:
        mega.shutdown()


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


@pytest.mark.parametrize(
    ("kind", "device", "coeff"),
    [
        ("global_aux_loss", "cpu", COEFF),
        ("seq_aux_loss", "cpu", COEFF),
        # Each rank's own loss, its gradient averaged over the ranks as megatron-core's, as seq_aux_loss's (EP=2's
        # test, -m slow too, holds aux_loss at DP=2).
        pytest.param("aux_loss", "cpu", COEFF, marks=pytest.mark.slow),
        # Megatron's DDP and finalize_model_grads over NCCL (which reset the running counts themselves): the metric
        # and the gradient norm, which a coefficient of 1 makes mostly the balancing loss's (25.5 on the CPU against
        # 12.8 with half its gradient and 0.26 without it), so that a DP scale missing from it shows.
        pytest.param("global_aux_loss", "cuda", 1.0, marks=TWO_GPUS),
    ],
    ids=["global_aux_loss", "seq_aux_loss", "aux_loss", "global_aux_loss-cuda"],
)
def test_data_parallel_ranks_equal_one_rank_over_the_global_batch(
    kind, device, coeff, tmp_path, model_path, gloo_ranks, no_tf32
):
    """DP=2 over gloo, each rank its own shard, against one rank over the whole global batch (micro-batches of four
    rows for global_aux_loss, the union of the ranks' k-th micro-batches; of two rows for aux_loss and seq_aux_loss,
    the ranks' own): the same ``moe_aux_loss`` and gradient norm on both ranks and the same DP-averaged router
    gradients (one rank is held to a float64 formula by the tests above). Catches: global_aux_loss's gradient left
    at megatron-core 0.16.1's 1 / DP of the global batch's (Megatron-LM#3672; this fails too once a version fixes
    that, and megatron_moe.megatron_aux_loss_coeff's scaling is then dropped), its metric averaged over the ranks
    rather than summed (each rank holds a share), aux_loss's metric summed (x2), and the counts not reduced over
    DP."""
    from test_megatron_backend import _free_port

    out = str(tmp_path / "dp2.pt")
    gloo_ranks.run(_dp_worker, _free_port(), kind, coeff, device, model_path, tmp_path, out)
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    size = 4 if kind == "global_aux_loss" else 2
    on = "cuda:0" if device == "cuda" else "cpu"
    mega = _trainer(
        tmp_path,
        model_path,
        coeff=coeff,
        micro_batch_size=size,
        balancing=kind,
        device=on,
        bf16="false",
        clip_grad=NO_CLIP,
    )
    try:
        calls = []
        metrics, before, grads, parts = _run_step(mega, _dp_batch(None), calls)
    finally:
        mega.shutdown()
    assert len(parts) == 8 // size
    if device == "cpu" and kind == "global_aux_loss":
        # The balancing loss's part of the last router's gradient is far above the tolerance below: a DP scale
        # missing from it (x1/2) shows.
        _, want_grads = _global_reference(calls, parts, before)
        (last,) = [n for n in grads if f"layers.{len(calls) // len(parts) - 1}." in n]
        assert want_grads[last].abs().max() > 1e-4
    if device == "cpu":
        assert grads  # (on GPUs the gradients stay in Megatron's DDP buffers: the norm stands for them)
    for got in ranks:
        assert got["metrics"]["moe_aux_loss"] == pytest.approx(metrics["moe_aux_loss"], rel=1e-5)
        # float32 both sides: the DP all-reduce sums the ranks' tokens in another order.
        assert got["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5)
        if device != "cpu":
            continue
        assert set(got["grads"]) == set(grads)
        for name, grad in grads.items():
            torch.testing.assert_close(
                got["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}"
            )


def test_megatron_cores_process_wide_state_is_renewed_for_each_model():
    """megatron-core keeps the balancing loss's gradient scale and its per-layer record once per process: the
    backend's step renews both, so that a model trained after another one in the same process (the test suite; a
    job's critic after its actor) neither breaks the pipeline schedules' copy of their scale (a ``[1]`` tensor into
    a 0-d one) nor writes a layer past the record of a shallower model. Catches a 0-d scale and a record zeroed
    rather than dropped."""
    from megatron.core.transformer.moe.moe_utils import (
        MoEAuxLossAutoScaler,
        get_moe_layer_wise_logging_tracker,
        save_to_aux_losses_tracker,
    )

    moe.set_aux_loss_scale(0.5, device=torch.device("cpu"))
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1) / 3)  # as megatron-core's schedules set it, over stages
    assert MoEAuxLossAutoScaler.main_loss_backward_scale.tolist() == [pytest.approx(1 / 3)]
    moe.set_aux_loss_scale(0.25, device=torch.device("cpu"))
    assert MoEAuxLossAutoScaler.main_loss_backward_scale.tolist() == [0.25]
    name = moe.AUX_LOSS_TRACKED["aux_loss"]
    save_to_aux_losses_tracker(name, torch.tensor(1.0), layer_number=2, num_layers=2)
    moe.clear_aux_loss()
    save_to_aux_losses_tracker(name, torch.tensor(2.0), layer_number=3, num_layers=3)
    assert get_moe_layer_wise_logging_tracker()[name]["values"].tolist() == [0.0, 0.0, 2.0]
    moe.clear_aux_loss()
    assert name not in get_moe_layer_wise_logging_tracker()


def test_only_global_aux_loss_scales_its_coefficient_by_the_data_parallel_size():
    """megatron-core is handed ``coeff x DP`` for global_aux_loss only (each rank's loss a share of the global
    batch's, whose gradient its DP average would divide by DP), the flag's coefficient for the others."""
    for dp in (1, 2, 8):
        assert moe.megatron_aux_loss_coeff("global_aux_loss", 0.01, dp_size=dp) == pytest.approx(0.01 * dp)
        for kind in ("aux_loss", "seq_aux_loss", "none"):
            assert moe.megatron_aux_loss_coeff(kind, 0.01, dp_size=dp) == 0.01
    with pytest.raises(ValueError, match="dp_size must be >= 1, got 0"):
        moe.megatron_aux_loss_coeff("global_aux_loss", 0.01, dp_size=0)
