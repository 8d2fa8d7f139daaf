"""The Megatron backend's PPO critic on the CPU (gloo) against the torch backend's, in float32.

Same HF weights, seed and batch: the values, the value loss, its clip fraction, the gradient norm and the values after
one optimizer step of the Megatron critic (a ``GPTModel`` whose output layer is slime's value head) equal the torch
backend's (a transformers model with a value head), on a Llama and a tied-embedding Qwen3. TP=2, DP=2 and PP=2 over
uneven stages (every gradient too) equal one rank; a resumed critic (model, optimizer, LR schedule) trains on exactly
as an uninterrupted one; what is not built is refused naming the flag.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("megatron.core")

from test_megatron_backend import _free_port, job, make_batch, save_model, trainer  # noqa: E402

from rlcore import keys  # noqa: E402
from rlcore.advantages import compute  # noqa: E402
from runtime.config import validate  # noqa: E402
from runtime.train.algo import advantage_config  # noqa: E402
from runtime.train.backends import megatron_checkpoint as mck  # noqa: E402
from runtime.train.backends import megatron_critic as mcritic  # noqa: E402
from runtime.train.roles import ACTOR, CRITIC  # noqa: E402
from runtime.train.step import critic_targets  # noqa: E402

VALUE_TOL = dict(rtol=1e-5, atol=2e-5)
# Adam's first step moves each weight by about lr (1e-3) x sign(gradient): where a gradient is near zero the two
# implementations' rounding can move a weight differently, which shows in the values by a fraction of that.
STEPPED_TOL = dict(rtol=0, atol=2e-4)
ROLES = (ACTOR, CRITIC)
# On a GPU (Megatron's DDP and distributed optimizer around the value head): skipped without CUDA.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


pytestmark = pytest.mark.usefixtures("no_tf32")  # float32 matmuls in true float32 (tests/conftest.py)


@given(
    lengths=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 5)), min_size=1, max_size=4),
    extra=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_response_values_reads_the_position_before_each_response_token(lengths, extra, seed):
    prompts = torch.tensor([p for p, _ in lengths])
    response_len = max(r for _, r in lengths) + extra
    width = int(max(p + r for p, r in lengths))
    output = torch.randn(len(lengths), width, 1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    got = mcritic.response_values(output, prompts, response_len)
    assert got.shape == (len(lengths), response_len) and got.dtype == torch.float32
    for b, (prompt, _) in enumerate(lengths):
        for t in range(response_len):
            position = min(prompt - 1 + t, width - 1)
            assert got[b, t] == output[b, position, 0].float()


def ppo_job(tmp_path, **overrides):
    settings = dict(advantage_estimator="ppo", use_kl_loss=False, clip_grad=0.5, value_clip=0.2)
    settings.update(overrides)
    return job(tmp_path, **settings)


def critic_batch(td, values, cfg):
    """The critic's training batch: GAE returns of ``values``, and old values moved off them so that the value clip
    (0.2) holds some tokens and not others."""
    td = td.clone()
    td.set(keys.VALUES, values)
    targets = critic_targets(compute(td, advantage_config(cfg)), advantage_config(cfg))
    shift = 0.3 * torch.sin(torch.arange(values.numel(), dtype=torch.float32)).view_as(values)
    targets.set(keys.OLD_VALUES, targets[keys.OLD_VALUES] + shift)
    return targets


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_values_loss_clipfrac_grad_norm_and_step_match_the_torch_critic(model_type, device, tmp_path):
    path = save_model(model_type, tmp_path / model_type)
    cfg = ppo_job(tmp_path, bf16="false")
    td = make_batch(203)
    torch_backend = trainer("torch", path, cfg, roles=ROLES, device=device)
    mega = trainer("megatron", path, cfg, roles=ROLES, device=device)
    try:
        mask = td[keys.MASK]
        want_values = torch_backend.compute_log_probs(td)[keys.VALUES]
        got_values = mega.compute_log_probs(td)[keys.VALUES]
        assert got_values.shape == mask.shape and got_values.dtype == torch.float32
        torch.testing.assert_close(got_values[mask], want_values[mask], **VALUE_TOL)
        assert want_values[mask].std() > 1e-3  # the head reads the hidden states, not a constant
        batch = critic_batch(td, want_values, cfg)
        want = torch_backend.train_critic(batch, per_step_rows=8)
        got = mega.train_critic(batch, per_step_rows=8)
        assert set(got) == set(want)
        for name in ("critic/value_loss", "critic/value_clipfrac", "critic/values_mean", "critic/grad_norm"):
            assert got[name] == pytest.approx(want[name], rel=1e-4, abs=1e-6), name
        assert 0 < got["critic/value_clipfrac"] < 1  # the clip held some tokens, not all
        assert got["critic/grad_norm"] > cfg.train.clip_grad  # clipping was exercised
        assert got["critic/num_steps"] == 1
        stepped = mega.compute_log_probs(td)[keys.VALUES]
        assert (stepped[mask] - got_values[mask]).abs().max() > 1e-3  # the step moved the values
        torch.testing.assert_close(
            stepped[mask], torch_backend.compute_log_probs(td)[keys.VALUES][mask], **STEPPED_TOL
        )
    finally:
        mega.shutdown()
        torch_backend.shutdown()


def test_value_clip_flag_changes_the_clip_fraction_and_the_loss(tmp_path):
    path = save_model("llama", tmp_path / "m")
    results = {}
    for clip in (0.2, 10.0):
        cfg = ppo_job(tmp_path, value_clip=clip)
        mega = trainer("megatron", path, cfg, roles=ROLES)
        try:
            td = make_batch(203)
            values = mega.compute_log_probs(td)[keys.VALUES]
            results[clip] = mega.train_critic(critic_batch(td, values, cfg), per_step_rows=8)
        finally:
            mega.shutdown()
    assert results[10.0]["critic/value_clipfrac"] == 0 < results[0.2]["critic/value_clipfrac"]
    assert results[10.0]["critic/value_loss"] != pytest.approx(results[0.2]["critic/value_loss"])


def _resume_run(path, cfg, td, *, ckpt, steps, load, device="cpu"):
    """Critic steps on ``td`` (two per call of 4 rows each), saving after the first call when ``ckpt`` is given and
    ``load`` is False, or loading ``ckpt`` first when it is True; the values at the end."""
    mega = trainer("megatron", path, cfg, roles=ROLES, device=device)
    try:
        if load:
            mega.load(ckpt)
        for i in range(steps):
            values = mega.compute_log_probs(td)[keys.VALUES]
            mega.train_critic(critic_batch(td, values, cfg), per_step_rows=4)
            if i == 0 and ckpt is not None and not load:
                mega.save(ckpt)
        return mega.compute_log_probs(td)[keys.VALUES]
    finally:
        mega.shutdown()


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=DEVICES[1].marks)])
@pytest.mark.parametrize("bf16", ["false", "true"])
def test_on_a_gpu_a_resumed_critic_trains_on_as_an_uninterrupted_one(bf16, device, tmp_path):
    path = save_model("qwen3", tmp_path / "m")
    cfg = ppo_job(tmp_path, bf16=bf16, lr_warmup_iters=4, lr_decay_style="linear", lr_decay_iters=10, min_lr=1e-5)
    td = make_batch(203)
    ckpt = str(tmp_path / "ckpt")
    whole = _resume_run(path, cfg, td, ckpt=ckpt, steps=3, load=False, device=device)
    resumed = _resume_run(path, cfg, td, ckpt=ckpt, steps=2, load=True, device=device)
    torch.testing.assert_close(resumed, whole, rtol=0, atol=1e-6)


def test_a_resumed_critic_trains_on_exactly_as_an_uninterrupted_one(tmp_path):
    path = save_model("qwen3", tmp_path / "m")
    # A warm-up schedule: a resumed run that restarted the schedule would take other steps.
    cfg = ppo_job(tmp_path, lr_warmup_iters=4, lr_decay_style="linear", lr_decay_iters=10, min_lr=1e-5)
    td = make_batch(203)
    ckpt = str(tmp_path / "ckpt")
    whole = _resume_run(path, cfg, td, ckpt=ckpt, steps=3, load=False)
    resumed = _resume_run(path, cfg, td, ckpt=ckpt, steps=2, load=True)
    assert torch.equal(resumed, whole)
    assert mck.is_checkpoint_folder(os.path.join(ckpt, mcritic.CRITIC_DIR))
    # Without the critic's optimizer (--no-save-optim) the resumed critic takes another step.
    fresh = trainer("megatron", path, cfg, roles=ROLES)
    try:
        values = fresh.compute_log_probs(td)[keys.VALUES]
        fresh.train_critic(critic_batch(td, values, cfg), per_step_rows=4)
        fresh.save(str(tmp_path / "no_optim"), with_optimizer=False)
        from megatron.core import dist_checkpointing

        saved = dist_checkpointing.load_tensors_metadata(str(tmp_path / "no_optim" / mcritic.CRITIC_DIR))
        assert "output_layer.weight" in saved and not [k for k in saved if k.startswith("optimizer.")]
        assert fresh.critic.optimizer.state
        fresh.reset_optimizer()  # --reset-optimizer-states: the critic's moments go too
        assert not fresh.critic.optimizer.state and not fresh.optimizer.state
    finally:
        fresh.shutdown()
    partial = _resume_run(path, cfg, td, ckpt=str(tmp_path / "no_optim"), steps=2, load=True)
    assert not torch.equal(partial, whole)
    # A checkpoint of a job without a critic.
    actor_only = trainer("megatron", path, cfg, roles=(ACTOR,))
    try:
        actor_only.save(str(tmp_path / "actor_only"))
    finally:
        actor_only.shutdown()
    critic = trainer("megatron", path, cfg, roles=ROLES)
    try:
        with pytest.raises(RuntimeError, match="holds no critic"):
            critic.load(str(tmp_path / "actor_only"))
    finally:
        critic.shutdown()


def test_value_head_is_slimes_and_the_same_as_the_torch_critics(tmp_path):
    path = save_model("qwen3", tmp_path / "m")
    cfg = ppo_job(tmp_path)
    mega = trainer("megatron", path, cfg, roles=ROLES)
    torch_backend = trainer("torch", path, cfg, roles=ROLES)
    try:
        head = mega._module(mega.critic.model).output_layer
        assert isinstance(head, mcritic.ValueHead) and tuple(head.weight.shape) == (1, 48)
        assert torch.equal(head.bias, torch.zeros(1))
        assert 0.01 < float(head.weight.std()) < 0.03  # N(0, 0.02^2)
        torch.testing.assert_close(head.weight, torch_backend.critic.get_output_embeddings().weight, rtol=0, atol=0)
        # Untied: the critic's embedding is the actor's, trained apart from it.
        params = dict(mega._module(mega.critic.model).named_parameters())
        actor = dict(mega._module(mega.model).named_parameters())
        emb = "embedding.word_embeddings.weight"
        assert torch.equal(params[emb], actor[emb]) and params[emb] is not actor[emb]
        assert "output_layer.weight" not in actor  # the tied actor has no LM head of its own
    finally:
        mega.shutdown()
        torch_backend.shutdown()


def test_what_is_not_built_is_refused(tmp_path):
    # ppo is taken at any Megatron layout (pipeline stages on GPUs).
    layout = dict(train_backend="megatron", pipeline_model_parallel_size=2, actor_num_gpus_per_node=2)
    assert (
        validate(ppo_job(tmp_path, micro_batch_size=2, kl_loss_coef=0.0, **layout)).train.pipeline_model_parallel_size
        == 2
    )
    path = save_model("llama", tmp_path / "m")
    mega = trainer("megatron", path, ppo_job(tmp_path), roles=(ACTOR,))
    try:
        mega.save_model(str(tmp_path / "torch_dist"))
    finally:
        mega.shutdown()
    with pytest.raises(ValueError, match="critic starts from the HF model"):
        trainer("megatron", path, ppo_job(tmp_path), roles=ROLES, role_paths={"critic": str(tmp_path / "torch_dist")})
    mega = trainer("megatron", path, ppo_job(tmp_path), roles=(ACTOR,))
    try:
        with pytest.raises(RuntimeError, match="runs no critic"):
            mega.train_critic(make_batch(203), per_step_rows=8)
    finally:
        mega.shutdown()


def _parallel_worker(rank, world, port, path, tmp, out, overrides, device):
    if device == "cuda":
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False
        device = f"cuda:{rank}"
    cfg = ppo_job(tmp, bf16="false", train_backend="megatron", actor_num_gpus_per_node=world, **overrides)
    mega = trainer("megatron", path, cfg, roles=ROLES, rank=rank, world_size=world, master_port=port, device=device)
    td = make_batch(203)
    dp_rank, dp_size = mega.dp_info()
    rows = slice(dp_rank * 8 // dp_size, (dp_rank + 1) * 8 // dp_size)
    values = mega.compute_log_probs(td[rows])[keys.VALUES]
    whole = mega.compute_log_probs(td)[keys.VALUES]
    metrics = mega.train_critic(critic_batch(td, whole, cfg)[rows], per_step_rows=8 // dp_size)
    # On GPUs Megatron's DDP keeps gradients in its own buffers (no .grad): the gradients are compared on the CPU.
    grads = critic_grads(mega) if device == "cpu" else {}
    stepped = mega.compute_log_probs(td)[keys.VALUES]
    torch.save({"values": values, "metrics": metrics, "grads": grads, "stepped": stepped}, out.format(rank=rank))
    mega.shutdown()


def critic_grads(mega) -> dict[str, torch.Tensor]:
    """The critic's gradients of its last step (clipped as the step applied them), by Megatron name with each decoder
    layer under its global number (a pipeline stage numbers its own layers from 0)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    model = mega._module(mega.critic.model)
    offset = get_transformer_layer_offset(model.config, pp_rank=mega.pp_rank)
    out = {}
    for name, p in model.named_parameters():
        if name.startswith("decoder.layers."):
            _, _, number, rest = name.split(".", 3)
            name = f"decoder.layers.{int(number) + offset}.{rest}"
        out[name] = p.grad.detach().clone()
    return out


TP2, PP2, DP2 = {"tensor_model_parallel_size": 2}, {"pipeline_model_parallel_size": 2}, {}
# Uneven stages of the 4-layer model (1 and 3 layers): the value head on the last, deeper stage.
PP2_UNEVEN = {**PP2, "decoder_first_pipeline_num_layers": 1}
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


@pytest.mark.parametrize(
    "layout,device",
    [
        (TP2, "cpu"),
        # The value head's gather of the sequence chunks and its weights' gradients summed over TP (marked
        # sequence_parallel): a repeat of tp2's mechanism with the sequence cut.
        pytest.param({**TP2, "sequence_parallel": True}, "cpu", marks=pytest.mark.slow),
        (DP2, "cpu"),
        (PP2_UNEVEN, "cpu"),
        pytest.param(TP2, "cuda", marks=TWO_GPUS),
        pytest.param(PP2, "cuda", marks=TWO_GPUS),
        pytest.param(DP2, "cuda", marks=TWO_GPUS),
    ],
    ids=["tp2", "tp2-sp", "dp2", "pp2-uneven", "tp2-cuda", "pp2-cuda", "dp2-cuda"],
)
def test_two_ranks_equal_one(layout, device, tmp_path, gloo_ranks):
    path = save_model("qwen3", tmp_path / "m")
    out = str(tmp_path / "rank{rank}.pt")
    gloo_ranks.run(_parallel_worker, 2, _free_port(), path, tmp_path, out, layout, device)
    ranks = [torch.load(out.format(rank=r), weights_only=False) for r in range(2)]
    cfg = ppo_job(tmp_path, bf16="false", train_backend="megatron")
    td = make_batch(203)
    mask = td[keys.MASK]
    one = trainer("megatron", path, cfg, roles=ROLES, device="cuda:0" if device == "cuda" else "cpu")
    try:
        values = one.compute_log_probs(td)[keys.VALUES]
        metrics = one.train_critic(critic_batch(td, values, cfg), per_step_rows=8)
        grads = critic_grads(one) if device == "cpu" else {}
        stepped = one.compute_log_probs(td)[keys.VALUES]
    finally:
        one.shutdown()
    got_values = ranks[0]["values"] if layout else torch.cat([r["values"] for r in ranks])
    torch.testing.assert_close(got_values[mask], values[mask], **VALUE_TOL)
    for r in ranks:
        for name in ("critic/value_loss", "critic/value_clipfrac", "critic/values_mean", "critic/grad_norm"):
            assert r["metrics"][name] == pytest.approx(metrics[name], rel=1e-4, abs=1e-6), name
        torch.testing.assert_close(r["stepped"][mask], stepped[mask], **STEPPED_TOL)
    if "pipeline_model_parallel_size" in layout and device == "cpu":
        # Every gradient once, on the stage that holds it (the value head and the final norm on the last): float32,
        # the same sums in another order, relative to each tensor's largest entry.
        got = {**ranks[0]["grads"], **ranks[1]["grads"]}
        assert not set(ranks[0]["grads"]) & set(ranks[1]["grads"]) and set(got) == set(grads)
        assert set(mcritic.HEAD_NAMES) <= set(ranks[1]["grads"])
        stage_layers = [{int(n.split(".")[2]) for n in r["grads"] if n.startswith("decoder.layers.")} for r in ranks]
        assert stage_layers == [{0}, {1, 2, 3}]  # the stages' depths follow --decoder-first-pipeline-num-layers
        for name, value in grads.items():
            scale = float(value.abs().max()) or 1.0
            torch.testing.assert_close(
                got[name], value, rtol=1e-4, atol=1e-4 * scale, msg=lambda m, n=name: f"{n}: {m}"
            )


def test_the_critic_trains_without_the_reference_and_with_it(tmp_path):
    path = save_model("llama", tmp_path / "m")
    cfg = ppo_job(tmp_path, use_kl_loss=True)
    from runtime.train.algo import model_roles
    from runtime.train.roles import REFERENCE

    assert model_roles(cfg) == (ACTOR, REFERENCE, CRITIC)
    mega = trainer("megatron", path, cfg, roles=model_roles(cfg))
    try:
        out = mega.compute_log_probs(make_batch(203))
        assert set(out.keys()) == {keys.OLD_LOG_PROBS, keys.REF_LOG_PROBS, keys.VALUES}
    finally:
        mega.shutdown()


@pytest.mark.slow
def test_a_ppo_job_through_rlcore_run_resumes_as_the_uninterrupted_one(tmp_path):
    """rlcore-run --train-backend megatron --advantage-estimator ppo: the critic trains alone for the first rollout,
    then beside the actor; a job saved after two rollouts and resumed with --load logs the third step's critic and
    actor metrics of the uninterrupted job (the critic's model, optimizer and schedule come back from its folder)."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}

    def job_run(name, *extra):
        argv = [sys.executable, "-m", "runtime.cli", "--train-backend", "megatron", "--advantage-estimator", "ppo"]
        argv += ["--num-critic-only-steps", "1", "--no-use-tensorboard", "--output-dir", str(tmp_path / name), *extra]
        result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return {row["step"]: row for row in map(json.loads, filter(None, lines))}

    whole = job_run("whole", "--num-rollout", "3")
    assert sorted(whole) == [0, 1, 2]
    assert "train/critic/value_loss" in whole[0] and "train/pg_loss" not in whole[0]  # critic only at first
    assert "train/critic/value_loss" in whole[2] and "train/pg_loss" in whole[2]
    ckpt = str(tmp_path / "ckpt")
    job_run("first", "--num-rollout", "2", "--save", ckpt)
    assert mck.is_checkpoint_folder(tmp_path / "ckpt" / "step_000002" / "trainer" / mcritic.CRITIC_DIR)
    resumed = job_run("first", "--num-rollout", "3", "--save", ckpt, "--load", ckpt)
    for name in ("train/critic/value_loss", "train/critic/values_mean", "train/critic/grad_norm", "train/pg_loss"):
        assert resumed[2][name] == pytest.approx(whole[2][name], rel=1e-5, abs=1e-7), name


def test_dynamic_micro_batches_keep_the_values_in_row_order_and_the_critic_trains_in_training_mode(tmp_path):
    """Under --use-dynamic-batch-size the rows are regrouped: the critic's values come back in the batch's row order
    (from compute_log_probs and from MegatronCritic.values alike), equal to fixed micro-batches'. Its optimizer steps
    run the model in training mode, where Megatron recomputes activations (as the actor's do)."""
    path = save_model("qwen3", tmp_path / "m")
    td = make_batch(203)
    fixed = trainer("megatron", path, ppo_job(tmp_path, bf16="false"), roles=ROLES)
    try:
        want = fixed.compute_log_probs(td)[keys.VALUES]
    finally:
        fixed.shutdown()
    cfg = ppo_job(tmp_path, bf16="false", use_dynamic_batch_size=True, max_tokens_per_gpu=12)
    mega = trainer("megatron", path, cfg, roles=ROLES)
    try:
        groups = mega._token_groups(td, log_probs=True)
        assert [i for rows in groups for i in rows] != list(range(td.batch_size[0]))  # the rows are regrouped
        mask = td[keys.MASK]
        torch.testing.assert_close(mega.compute_log_probs(td)[keys.VALUES][mask], want[mask], rtol=0, atol=1e-6)
        with mega._shims():
            torch.testing.assert_close(mega.critic.values(td)[mask], want[mask], rtol=0, atol=1e-6)
        modes = []
        hook = mega.critic.model.register_forward_pre_hook(lambda module, args: modes.append(module.training))
        try:
            mega.train_critic(critic_batch(td, want, cfg), per_step_rows=8)
        finally:
            hook.remove()
        assert modes and all(modes) and not mega.critic.model.training
    finally:
        mega.shutdown()
