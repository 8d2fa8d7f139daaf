"""--train-backend megatron on the CPU (gloo): megatron-core's GPTModel against the torch backend on the same weights.

Same HF weights and batch, float32: the log-probs, the loss, the gradient norm and the weights after an optimizer step
of the Megatron backend equal the torch backend's (a transformers model); TP=2 equals TP=1 (two processes over
gloo). Pipeline parallelism runs on GPUs only (tests/test_megatron_cuda.py).
"""

from __future__ import annotations

import dataclasses
import os
import socket

import pytest
import torch

pytest.importorskip("megatron.core")

from test_megatron_mapping import FAMILIES, hf_config  # noqa: E402

from rlcore import keys  # noqa: E402
from rlcore.advantages import compute  # noqa: E402
from runtime.config import from_dict  # noqa: E402
from runtime.rollout.sample import Sample  # noqa: E402
from runtime.train.algo import advantage_config, loss_config  # noqa: E402
from runtime.train.backends import backend_class  # noqa: E402
from runtime.train.batch import build_batch  # noqa: E402
from runtime.train.roles import ACTOR, REFERENCE  # noqa: E402

# Tolerances of float32 against float32: two implementations of the same model sum in different orders.
LOGP_TOL = dict(rtol=1e-5, atol=2e-5)


def save_model(model_type: str, folder, *, seed: int = 0, **overrides) -> str:
    from transformers import AutoModelForCausalLM

    config = hf_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)  # not all ones: a norm mapped to the wrong place shows
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    return str(folder)


def make_batch(vocab: int, *, n: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        prompt = torch.randint(1, vocab, (int(torch.randint(2, 7, (1,), generator=gen)),), generator=gen).tolist()
        response = torch.randint(1, vocab, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
        samples.append(
            Sample(
                index=i // 4,
                group_index=i // 4,
                tokens=prompt + response,
                response_length=len(response),
                reward=float(i % 3) / 2,
                rollout_log_probs=[-1.0] * len(response),
            )
        )
    return build_batch(samples, pad_token_id=0)


def job(tmp_path, **overrides):
    settings = dict(
        rollout_batch_size=2,
        n_samples_per_prompt=4,
        global_batch_size=8,
        micro_batch_size=3,
        lr=1e-3,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        entropy_coef=0.01,
        clip_grad=0.5,
        output_dir=str(tmp_path / "out"),
        # A placement flag, so that the built-in job's default plan (runtime.cluster.plan) stays out: on two visible
        # GPUs it runs one step apart and switches TIS on, whose weights read make_batch's rollout log-probs. The
        # trainers' losses would then follow the machine (a second trainer on two H200s reported -0.0512 against
        # 0.0899, 2026-11-27): test_the_trainers_loss_settings_do_not_follow_the_gpu_count.
        rollout_schedule="sync",
    )
    settings.update(overrides)
    # The trainers read the train and algorithm sections only (the job's validation wants data and a task).
    return from_dict(None, **settings)


@pytest.mark.parametrize("gpus", [2, 4])
def test_the_trainers_loss_settings_do_not_follow_the_gpu_count(gpus, tmp_path, monkeypatch):
    """The GPU tests compare trainers built by :func:`job` in one process and across processes: their loss settings
    must be one machine's as another's."""
    import runtime.config.resolve as resolve

    one = loss_config(job(tmp_path))
    monkeypatch.setattr(resolve, "_local_gpus", lambda: gpus)
    assert loss_config(job(tmp_path)) == one
    assert loss_config(job(tmp_path, actor_num_gpus_per_node=gpus)) == one


def trainer(name, path, cfg, *, roles=(ACTOR, REFERENCE), **kw):
    return backend_class(name)(
        path, train_cfg=cfg.train, loss_cfg=loss_config(cfg), temperature=0.9, seed=0, roles=roles, **kw
    )


def train_once(backend, cfg, td):
    td = td.clone()
    td.update(backend.compute_log_probs(td))
    # The reference differs from the actor once the actor has trained: perturb the old log-probs instead.
    td.set(
        keys.OLD_LOG_PROBS,
        td[keys.OLD_LOG_PROBS] + 0.05 * torch.sin(torch.arange(td[keys.MASK].numel())).view_as(td[keys.MASK]),
    )
    td = compute(td, advantage_config(cfg))
    return backend.train(td, per_step_rows=8)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_log_probs_loss_grad_norm_and_step_match_the_torch_backend(model_type, tmp_path):
    path = save_model(model_type, tmp_path / model_type)
    cfg = job(tmp_path)
    td = make_batch(203)
    torch_backend = trainer("torch", path, cfg)
    mega = trainer("megatron", path, cfg)
    try:
        ref_lp = torch_backend.compute_log_probs(td)
        got_lp = mega.compute_log_probs(td)
        mask = td[keys.MASK]
        for key in (keys.OLD_LOG_PROBS, keys.REF_LOG_PROBS):
            torch.testing.assert_close(got_lp[key][mask], ref_lp[key][mask], **LOGP_TOL)
        want = train_once(torch_backend, cfg, td)
        got = train_once(mega, cfg, td)
        for name in ("loss", "pg_loss", "entropy_loss", "kl_loss", "pg_clipfrac"):
            if name in want:
                assert got[name] == pytest.approx(want[name], rel=1e-4, abs=1e-6), name
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
        assert got["grad_norm"] > cfg.train.clip_grad  # clipping was exercised
        after_torch = torch_backend.get_weights()
        after_mega = mega.get_weights()
        assert set(after_mega) == set(after_torch) - (
            {"lm_head.weight"} if FAMILIES[model_type]["tie_word_embeddings"] else set()
        )
        for name, value in after_mega.items():
            # Adam's first step is about lr x sign(gradient): where a gradient is near zero (float32 rounding)
            # the two may move an element differently, by a fraction of one step (lr 1e-3).
            torch.testing.assert_close(value, after_torch[name], rtol=0, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")
    finally:
        mega.shutdown()
        torch_backend.shutdown()


def test_weight_buckets_are_hf_named_and_equal_the_checkpoint_before_training(tmp_path):
    from safetensors.torch import load_file

    path = save_model("qwen2", tmp_path / "m")
    cfg = job(tmp_path)
    mega = trainer("megatron", path, cfg, roles=(ACTOR,))
    try:
        buckets = list(mega.weight_buckets(dtype=torch.bfloat16, bucket_bytes=4096))
        weights = {k: v for b in buckets for k, v in b.items()}
        saved = load_file(os.path.join(path, "model.safetensors"))
        saved.pop("lm_head.weight", None)
        assert set(weights) == set(saved)
        for name, value in weights.items():
            assert value.dtype == torch.bfloat16 and torch.equal(value, saved[name].bfloat16()), name
        assert all(sum(v.nbytes for v in b.values()) <= 4096 or len(b) == 1 for b in buckets)
    finally:
        mega.shutdown()


def test_the_logits_are_computed_batch_major_and_never_copied(tmp_path):
    """The output layer computes ``[b, s, V]`` and GPTModel's transpose back to batch-major copies nothing: the
    model's logits are the output layer's own storage (megatron_build.batch_major_logits); the same logits as
    transformers' are checked by the match tests above."""
    path = save_model("qwen3", tmp_path / "m")
    cfg = job(tmp_path)
    mega = trainer("megatron", path, cfg, roles=(ACTOR,))
    try:
        seen = []
        layer = next(m for n, m in mega.model.named_modules() if n.endswith("output_layer"))
        handle = layer.register_forward_hook(lambda mod, args, out: seen.append(out[0]))
        mb = make_batch(mega.shape.vocab_size)[:2]
        with mega._shims():
            logits = mega._logits(mega.model, mb)
        handle.remove()
        assert logits.is_contiguous() and logits.shape[0] == 2
        assert seen[0].shape[1] == 2 and logits.data_ptr() == seen[0].data_ptr()
    finally:
        mega.shutdown()


def test_refuses_a_checkpoint_whose_config_disagrees(tmp_path):
    path = save_model("llama", tmp_path / "m")
    config_path = os.path.join(path, "config.json")
    text = open(config_path).read().replace('"intermediate_size": 80', '"intermediate_size": 96')
    open(config_path, "w").write(text)
    cfg = job(tmp_path)
    with pytest.raises(ValueError, match=r"gate_proj.weight has shape \(80, 48\), config.json \(intermediate_size"):
        trainer("megatron", path, cfg, roles=(ACTOR,))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_worker(rank, world, port, path, tmp, out):
    cfg = job(
        tmp,
        tensor_model_parallel_size=2,
        train_backend="megatron",
        actor_num_gpus_per_node=2,
    )
    mega = trainer("megatron", path, cfg, rank=rank, world_size=world, master_port=port)
    td = make_batch(203)
    log_probs = mega.compute_log_probs(td)
    metrics = train_once(mega, cfg, td)
    weights = mega.get_weights()
    if rank == 0:
        torch.save({"log_probs": log_probs, "metrics": metrics, "weights": weights, "dp": mega.dp_info()}, out)
    mega.shutdown()


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_tensor_parallel_two_ranks_equal_one(model_type, tmp_path, gloo_ranks):
    path = save_model(model_type, tmp_path / "m", num_attention_heads=4, num_key_value_heads=2)
    out = str(tmp_path / "tp2.pt")
    gloo_ranks.run(_tp_worker, 2, _free_port(), path, tmp_path, out)
    tp2 = torch.load(out, weights_only=False)
    assert tp2["dp"] == (0, 1)
    cfg = job(tmp_path, train_backend="megatron")
    one = trainer("megatron", path, cfg)
    try:
        td = make_batch(203)
        mask = td[keys.MASK]
        log_probs = one.compute_log_probs(td)
        torch.testing.assert_close(
            tp2["log_probs"][keys.OLD_LOG_PROBS][mask], log_probs[keys.OLD_LOG_PROBS][mask], **LOGP_TOL
        )
        metrics = train_once(one, cfg, td)
        assert tp2["metrics"]["loss"] == pytest.approx(metrics["loss"], rel=1e-4, abs=1e-6)
        assert tp2["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-4)
        weights = one.get_weights()
        for name, value in weights.items():
            torch.testing.assert_close(
                tp2["weights"][name], value, rtol=0, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}"
            )
    finally:
        one.shutdown()


def test_rlcore_run_trains_the_builtin_job_with_megatron(ray_session, tmp_path, capsys):
    """A few GRPO steps of the built-in job through rlcore-run's entry point with --train-backend megatron (Ray, the
    embedded engine, the object-store weight sync); the final HF export loads with transformers. In this process on
    the module's Ray (a subprocess paid its own Python and Ray start, about 10 s; tests/test_signals.py and
    tests/test_runtime_seams.py run ``python -m runtime.cli`` itself)."""
    import json

    from transformers import AutoModelForCausalLM

    from runtime.cli import main

    out = tmp_path / "out"
    assert main(["--train-backend", "megatron", "--num-rollout", "2", "--output-dir", str(out)]) == 0
    captured = capsys.readouterr()
    assert "done, 2 steps" in captured.out + captured.err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) >= 2
    AutoModelForCausalLM.from_pretrained(out / "final_model")


def test_slime_trainer_hooks_freeze_lists_and_sft_loss_run_under_megatron(tmp_path):
    """slime's Megatron-side hooks are called as slime calls them (init once; before each log-prob pass with the
    store prefix; before each train step with the rollout id and step), --freeze-params-name-list keeps the matched
    weights, and --loss-type sft_loss trains the NLL exactly as the torch backend does."""
    from runtime.train.hooks import train_hooks

    calls = tmp_path / "calls.txt"
    hook_file = tmp_path / "hooks.py"
    hook_file.write_text(
        f"LOG = {str(calls)!r}\n"
        "def _log(line):\n"
        "    with open(LOG, 'a') as fh:\n"
        "        fh.write(line + '\\n')\n"
        "def init(args):\n"
        "    _log(f'init {args.train.lr}')\n"
        "def before_log_prob(args, model, store_prefix):\n"
        "    _log(f'log_prob {store_prefix!r} {model.training}')\n"
        "def before_step(args, rollout_id, step_id, model, optimizer, scheduler):\n"
        "    _log(f'step {rollout_id} {step_id} {optimizer is not None}')\n"
    )
    path = save_model("llama", tmp_path / "llama")
    cfg = job(
        tmp_path,
        custom_megatron_init_path=f"{hook_file}:init",
        custom_megatron_before_log_prob_hook_path=f"{hook_file}:before_log_prob",
        custom_megatron_before_train_step_hook_path=f"{hook_file}:before_step",
        # Matched against Megatron's parameter names, as in slime.
        freeze_params_name_list=["word_embeddings"],
        loss_type="sft_loss",
        use_kl_loss=False,
        entropy_coef=0.0,
    )
    td = make_batch(203)
    hooks = train_hooks(cfg)
    mega = trainer("megatron", path, cfg, hooks=hooks)
    torch_backend = trainer("torch", path, cfg, hooks=dataclasses.replace(hooks, paths={}, freeze=()))
    try:
        before = mega.get_weights()["model.embed_tokens.weight"].clone()
        mega_norm_before = mega.get_weights()["model.norm.weight"].clone()
        start = mega.compute_log_probs(td)[keys.OLD_LOG_PROBS].double()
        got = train_once(mega, cfg, td)
        want = train_once(torch_backend, cfg, td)
        # The NLL of the response tokens under the starting weights, over every token of the batch (the job's
        # token_mean), in float64.
        mask = td[keys.MASK]
        nll = -start[mask].mean()
        assert loss_config(cfg).loss_agg_mode == "token_mean"
        assert got["loss"] == pytest.approx(nll.item(), rel=1e-5)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        after = mega.get_weights()
        torch.testing.assert_close(after["model.embed_tokens.weight"], before, rtol=0, atol=0)
        assert not torch.equal(after["model.norm.weight"], mega_norm_before)
    finally:
        mega.shutdown()
        torch_backend.shutdown()
    passes = ["log_prob '' False", "log_prob 'ref_' False"]  # two log-prob passes: `start`, then train_once's
    assert calls.read_text().splitlines() == ["init 0.001", *passes, *passes, "step None 0 True"]
