"""Megatron torch_dist checkpoints on the CPU (gloo): a resume continues exactly, TP=1 saves load at TP=2 (with a
vocabulary padded differently), the folder layouts Megatron-LM and slime write are found, and the job manifest still
covers the files."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("megatron.core")

from test_megatron_backend import _free_port, make_batch, save_model, train_once, trainer  # noqa: E402

from rlcore import keys  # noqa: E402
from runtime.cluster.checkpoint import verify, write_manifest  # noqa: E402
from runtime.train.backends import megatron_checkpoint as mck  # noqa: E402
from runtime.train.roles import ACTOR  # noqa: E402


def job(tmp, **overrides):
    """The backend tests' job, actor only (no reference model, so no KL loss)."""
    from test_megatron_backend import job as backend_job

    return backend_job(tmp, use_kl_loss=False, **overrides)


# The tiny models' vocabulary: padded to 128 rows at TP=1 and to 256 at TP=2.
VOCAB = 100


@given(
    vocab=st.integers(1, 40),
    saved_pad=st.integers(0, 20),
    tp=st.integers(1, 4),
    rank=st.integers(0, 3),
    rest=st.integers(1, 3),
)
def test_vocab_shard_rows_equals_padding_the_tokens_rows_then_splitting(vocab, saved_pad, tp, rank, rest):
    rank = rank % tp
    full = torch.randn(vocab + saved_pad, rest, dtype=torch.float64)
    padded = -(-vocab // (8 * tp)) * 8 * tp
    reference = torch.zeros(padded, rest, dtype=torch.float64)
    reference[:vocab] = full[:vocab]
    count = padded // tp
    got = mck.vocab_shard_rows(full, vocab_size=vocab, padded_rows=padded, start=rank * count, count=count)
    assert torch.equal(got, reference.chunk(tp)[rank])


def test_vocab_shard_rows_refuses_rows_outside_the_vocabulary():
    with pytest.raises(ValueError, match="fewer than the vocabulary"):
        mck.vocab_shard_rows(torch.zeros(5, 2), vocab_size=8, padded_rows=8, start=0, count=8)
    with pytest.raises(ValueError, match="do not lie"):
        mck.vocab_shard_rows(torch.zeros(8, 2), vocab_size=8, padded_rows=8, start=4, count=8)


def _fake_checkpoint(folder):
    folder.mkdir(parents=True)
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    (folder / ".metadata").write_bytes(b"")
    return folder


def test_find_checkpoint_resolves_megatron_lm_save_roots(tmp_path):
    assert mck.find_checkpoint(tmp_path) is None  # no checkpoint at all
    release = _fake_checkpoint(tmp_path / "release")
    it = _fake_checkpoint(tmp_path / "iter_0000012")
    assert mck.find_checkpoint(release) == release
    (tmp_path / mck.TRACKER).write_text("release\n")
    assert mck.find_checkpoint(tmp_path) == release
    (tmp_path / mck.TRACKER).write_text("12")
    assert mck.find_checkpoint(tmp_path) == it
    assert mck.find_checkpoint(tmp_path, step=12) == it
    with pytest.raises(ValueError, match=r"--ref-load .*iter_0000003 is no torch_dist"):
        mck.find_checkpoint(tmp_path, step=3, flag="--ref-load")
    (tmp_path / mck.TRACKER).write_text("twelve")
    with pytest.raises(ValueError, match="neither a step nor 'release'"):
        mck.find_checkpoint(tmp_path)


def _state(backend):
    """Weights and the optimizer's moments (by parameter), on the CPU."""
    params = dict(backend._module(backend.model).named_parameters())
    moments = {name: {k: v.clone() for k, v in backend.optimizer.state[p].items()} for name, p in params.items()}
    return {n: p.detach().clone() for n, p in params.items()}, moments


def test_a_resumed_trainer_continues_exactly_and_the_manifest_covers_the_checkpoint(tmp_path):
    path = save_model("qwen3", tmp_path / "m", vocab_size=VOCAB)
    cfg = job(tmp_path, lr_decay_style="cosine", lr_decay_iters=5, lr_warmup_iters=1)
    td = make_batch(VOCAB)
    first = trainer("megatron", path, cfg, roles=(ACTOR,))
    try:
        train_once(first, cfg, td)
        folder = tmp_path / "ckpt"
        first.save(str(folder))
        assert mck.is_checkpoint_folder(folder) and (folder / "rng_rank0.pt").is_file()
        write_manifest(folder, 1)
        assert verify(folder) == 1
        want = train_once(first, cfg, td)
        want_weights, want_moments = _state(first)
    finally:
        first.shutdown()
    second = trainer("megatron", path, cfg, roles=(ACTOR,))
    try:
        second.load(str(folder))
        got = train_once(second, cfg, td)
        got_weights, got_moments = _state(second)
    finally:
        second.shutdown()
    assert got["lr"] == want["lr"] and got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
    for name, value in want_weights.items():
        assert torch.equal(got_weights[name], value), name
        for k, moment in want_moments[name].items():
            assert torch.equal(got_moments[name][k], moment), (name, k)


def test_the_rng_state_comes_back(tmp_path):
    path = save_model("llama", tmp_path / "m", vocab_size=VOCAB)
    cfg = job(tmp_path)
    backend = trainer("megatron", path, cfg, roles=(ACTOR,))
    try:
        torch.manual_seed(7)
        backend.save(str(tmp_path / "ckpt"), with_optimizer=False)
        want = torch.rand(4)
        torch.manual_seed(8)
        backend.load(str(tmp_path / "ckpt"))
        assert torch.equal(torch.rand(4), want)
    finally:
        backend.shutdown()


def _load_tp2_worker(rank, world, port, path, tmp, folder, out):
    cfg = job(tmp, tensor_model_parallel_size=2, train_backend="megatron", actor_num_gpus_per_node=2)
    mega = trainer("megatron", path, cfg, roles=(ACTOR,), rank=rank, world_size=world, master_port=port)
    mega.load(folder)
    td = make_batch(VOCAB)
    log_probs = mega.compute_log_probs(td)
    metrics = train_once(mega, cfg, td)
    weights = mega.get_weights()
    mega.save(os.path.join(tmp, "ckpt_tp2"))
    if rank == 0:
        torch.save({"log_probs": log_probs, "metrics": metrics, "weights": weights}, out)
    mega.shutdown()


@pytest.mark.slow  # ~30 s of gloo ranks; test_megatron_cuda.py resumes a one-GPU checkpoint at TP=2 on GPUs
def test_a_tp1_checkpoint_resumes_at_tp2_and_back(tmp_path, gloo_ranks):
    """Saved at TP=1 (vocabulary padded to 128 rows) after a step, loaded at TP=2 (256 rows): the next step's
    log-probs, loss, gradient norm and weights equal those of the TP=1 trainer that goes on; what TP=2 saves then
    loads at TP=1 with the same weights."""
    path = save_model("qwen3", tmp_path / "m", vocab_size=VOCAB)
    cfg = job(tmp_path, train_backend="megatron")
    td = make_batch(VOCAB)
    one = trainer("megatron", path, cfg, roles=(ACTOR,))
    try:
        train_once(one, cfg, td)
        folder = str(tmp_path / "ckpt")
        one.save(folder)
        log_probs = one.compute_log_probs(td)
        want = train_once(one, cfg, td)
        weights = one.get_weights()
    finally:
        one.shutdown()
    out = str(tmp_path / "tp2.pt")
    gloo_ranks.run(_load_tp2_worker, 2, _free_port(), path, tmp_path, folder, out)
    tp2 = torch.load(out, weights_only=False)
    mask = td[keys.MASK]
    torch.testing.assert_close(
        tp2["log_probs"][keys.OLD_LOG_PROBS][mask], log_probs[keys.OLD_LOG_PROBS][mask], rtol=1e-5, atol=2e-5
    )
    assert tp2["metrics"]["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-6)
    assert tp2["metrics"]["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    for name, value in weights.items():
        torch.testing.assert_close(tp2["weights"][name], value, rtol=0, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")
    back = trainer("megatron", path, cfg, roles=(ACTOR,))
    try:
        back.load(str(tmp_path / "ckpt_tp2"))
        for name, value in back.get_weights().items():
            assert torch.equal(value, tp2["weights"][name]), name
    finally:
        back.shutdown()


def test_a_checkpoint_of_another_model_is_refused_by_tensor_name(tmp_path):
    small = save_model("llama", tmp_path / "small", vocab_size=VOCAB)
    wide = save_model("llama", tmp_path / "wide", vocab_size=VOCAB, intermediate_size=96)
    cfg = job(tmp_path)
    backend = trainer("megatron", small, cfg, roles=(ACTOR,))
    try:
        backend.save(str(tmp_path / "ckpt"), with_optimizer=False)
    finally:
        backend.shutdown()
    other = trainer("megatron", wide, cfg, roles=(ACTOR,))
    try:
        with pytest.raises(ValueError, match=r"linear_fc\d.weight is saved with shape"):
            other.load(str(tmp_path / "ckpt"))
    finally:
        other.shutdown()


def test_loading_a_folder_that_is_no_checkpoint_names_it(tmp_path):
    path = save_model("llama", tmp_path / "m", vocab_size=VOCAB)
    backend = trainer("megatron", path, job(tmp_path), roles=(ACTOR,))
    try:
        with pytest.raises(ValueError, match="is no Megatron torch_dist checkpoint"):
            backend.load(str(tmp_path))
    finally:
        backend.shutdown()
    assert os.path.isdir(path)


def _parse(*argv):
    from runtime.config import parse_args

    return parse_args(list(argv))


def test_ref_load_and_load_take_megatron_checkpoints_by_slimes_rule(tmp_path):
    from runtime.config import ConfigError
    from runtime.train.algo import role_paths

    ref = _fake_checkpoint(tmp_path / "ref")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    # Given the torch backend, a torch_dist --ref-load is refused (unset, it selects megatron: runtime.slime_compat).
    with pytest.raises(ConfigError, match="Megatron torch_dist checkpoints need --train-backend megatron"):
        _parse("--train-backend", "torch", "--ref-load", str(ref))
    assert _parse("--ref-load", str(ref)).train.train_backend == "megatron"
    mega = ("--train-backend", "megatron")
    # No --load: the actor starts from the reference's checkpoint, as in slime.
    assert role_paths(_parse(*mega, "--ref-load", str(ref))) == {"reference": str(ref), "actor": str(ref)}
    # --load the --save folder of a first run (not written yet): the same.
    missing = str(tmp_path / "save")
    cfg = _parse(*mega, "--ref-load", str(ref), "--load", missing, "--save", missing)
    assert role_paths(cfg)["actor"] == str(ref)
    # A Megatron --load: the actor's start; an HF --ref-load stays the reference's.
    start = _fake_checkpoint(tmp_path / "start")
    assert role_paths(_parse(*mega, "--load", str(start), "--ref-load", str(hf))) == {
        "reference": str(hf),
        "actor": str(start),
    }
    # A --load folder that does not exist yet starts afresh, as slime's; a folder holding something else is refused.
    assert _parse(*mega, "--load", missing).ckpt.load == missing
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match="--load: .*junk' is neither a checkpoint folder nor a --save root"):
        _parse(*mega, "--load", str(tmp_path / "junk"))
    root = tmp_path / "root"
    root.mkdir()
    (root / mck.TRACKER).write_text("7")
    with pytest.raises(ConfigError, match=r"--ref-load .*root: iter_0000007 is no torch_dist checkpoint"):
        _parse(*mega, "--ref-load", str(root))
    with pytest.raises(ConfigError, match="neither an HF folder .* nor a Megatron torch_dist checkpoint"):
        _parse(*mega, "--ref-load", str(tmp_path / "hf_without_config_missing"))


def test_a_trainer_restart_before_the_first_save_starts_a_megatron_load_afresh(tmp_path):
    from runtime.cluster.trainers import TrainerDied
    from runtime.faults import restart_config

    start = _fake_checkpoint(tmp_path / "start")
    cfg = _parse("--train-backend", "megatron", "--load", str(start), "--save", str(tmp_path / "save"))
    again, step = restart_config(cfg, TrainerDied(0, RuntimeError("killed")), restarts=0)
    assert step == 0 and again.ckpt.load == str(start)
    # A --load that does not exist yet (slime's first run of a script whose --load is its --save): step 0 again.
    fresh = str(tmp_path / "fresh")
    cfg = _parse("--load", fresh, "--save", str(tmp_path / "save"))
    again, step = restart_config(cfg, TrainerDied(0, RuntimeError("killed")), restarts=0)
    assert step == 0 and again.ckpt.load == fresh


@pytest.mark.slow
def test_rlcore_run_saves_and_resumes_a_megatron_job(tmp_path):
    """rlcore-run --train-backend megatron --save, then --load to one step further: the resumed job runs the last
    step only, from a checkpoint that passed its manifest check."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    base = [sys.executable, "-m", "runtime.cli", "--train-backend", "megatron", "--output-dir", out, "--save", ckpt]
    first = subprocess.run(base + ["--num-rollout", "2"], capture_output=True, text=True, env=env, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert mck.is_checkpoint_folder(tmp_path / "ckpt" / "step_000002" / "trainer")
    second = subprocess.run(
        base + ["--num-rollout", "3", "--load", ckpt], capture_output=True, text=True, env=env, timeout=600
    )
    assert second.returncode == 0, second.stderr[-3000:]
    text = second.stdout + second.stderr
    assert "step 3/3" in text and "step 1/3" not in text and "done, 3 steps" in text
    assert verify(tmp_path / "ckpt" / "step_000003") == 3


def test_ref_ckpt_step_picks_a_step_of_the_ref_load_root(tmp_path):
    from runtime.config import ConfigError
    from runtime.train.algo import role_paths

    root = tmp_path / "ref"
    _fake_checkpoint(root / "iter_0000004")
    latest = _fake_checkpoint(root / "iter_0000008")
    (root / mck.TRACKER).write_text("8")
    mega = ("--train-backend", "megatron", "--ref-load", str(root))
    step4 = str(root / "iter_0000004")
    assert role_paths(_parse(*mega, "--ref-ckpt-step", "4")) == {"reference": step4, "actor": step4}
    assert mck.find_checkpoint(role_paths(_parse(*mega))["reference"]) == latest
    with pytest.raises(ConfigError, match=r"iter_0000005 is no torch_dist checkpoint .*\(--ref-ckpt-step 5\)"):
        _parse(*mega, "--ref-ckpt-step", "5")
    with pytest.raises(ConfigError, match="--ref-ckpt-step picks a step of a Megatron --ref-load"):
        _parse("--ref-ckpt-step", "4")


def test_a_chained_optimizers_state_is_optimizer_state(tmp_path):
    """On GPUs a MoE model's optimizer is megatron-core's ChainedOptimizer (dense and expert parts), whose keys carry
    ``chained_<i>.``: a resume must see them as the optimizer's (it restored the model alone and restarted Adam
    before, found by tests/test_megatron_moe_cuda.py's resume at EP=2), and the converter must leave them out."""
    import torch.distributed.checkpoint as dcp

    model_key = "decoder.layers.0.mlp.experts.experts.linear_fc1.weight"
    keys = [f"chained_{i}.optimizer.state.exp_avg.{model_key}" for i in (0, 1)] + ["optimizer.state.exp_avg.x"]
    assert all(mck.is_optimizer_key(k) for k in keys)
    assert not any(mck.is_optimizer_key(k) for k in (model_key, "embedding.word_embeddings.weight"))
    state = {model_key: torch.arange(6.0).view(2, 3), **{k: torch.zeros(2, 3) for k in keys}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    tensors = mck.read_model_tensors(tmp_path)
    assert set(tensors) == {model_key} and torch.equal(tensors[model_key], state[model_key])
