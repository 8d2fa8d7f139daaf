"""Routing replay under --train-backend megatron on two GPUs (skipped without them): R3 through PP=2's 1F1B schedule
(each stage's MoE layers take their slice; the backward's recompute pops each micro-batch's own routes) and through
TP=2 with ``--sequence-parallel`` (each rank its chunk of the sequence; the same runs on the CPU over gloo:
tests/test_megatron_sequence_parallel.py), and R2's recording at TP=2, each against one GPU's replay, in float32 with
TF32 off.

Run: ``python -m pytest -q tests/test_megatron_replay_cuda.py``. The CPU tests (``tests/test_megatron_replay.py``)
check the replay itself: own routes bitwise, a perturbed router restored, padding, the reference model, recompute.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from test_megatron_backend import _free_port, make_batch  # noqa: E402
from test_megatron_moe import save_qwen3_moe  # noqa: E402
from test_megatron_replay import VOCAB, _foreign_routes, _job, _trainer, _with_advantages  # noqa: E402

from rlcore import keys  # noqa: E402
from runtime.train.batch import PROMPT_LENGTHS, RESPONSE_LENGTHS, ROUTED_EXPERTS  # noqa: E402
from runtime.train.roles import ACTOR  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

LAYOUTS = {
    "pp2": dict(pipeline_model_parallel_size=2),
    "tp2-sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
    # Full recompute under PP=2: the backward's recompute of a micro-batch runs after later forwards.
    "pp2-recompute": dict(
        pipeline_model_parallel_size=2,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
    ),
}


def _routed_batch():
    td = make_batch(VOCAB)
    td.set(ROUTED_EXPERTS, _foreign_routes(td, layers=2, topk=2, experts=8))
    return td


def _run(rank, world, port, path, tmp, out, mode, layout):
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = _job(tmp, bf16="false", lr=1e-4, train_backend="megatron", actor_num_gpus_per_node=world, **layout)
    kw = dict(rank=rank, world_size=world, master_port=port) if world > 1 else {}
    backend = _trainer(path, cfg, mode, roles=(ACTOR,), device=f"cuda:{rank}", **kw)
    try:
        td = _routed_batch() if mode == "rollout" else make_batch(VOCAB)
        log_probs = backend.compute_log_probs(td)
        metrics = backend.train(_with_advantages(td, cfg, log_probs), per_step_rows=8)
        weights = backend.get_weights()
        if rank == 0:
            recorded = log_probs.get(ROUTED_EXPERTS, None)
            torch.save({"log_probs": log_probs[keys.OLD_LOG_PROBS], "metrics": metrics, "weights": weights,
                        "recorded": recorded}, out)  # fmt: skip
    finally:
        backend.shutdown()


def _two_against_one(tmp_path, mode, layout):
    import torch.multiprocessing as mp

    path = save_qwen3_moe(tmp_path / "m")
    two, one = str(tmp_path / "two.pt"), str(tmp_path / "one.pt")
    mp.spawn(_run, args=(2, _free_port(), path, tmp_path, two, mode, layout), nprocs=2, join=True)
    _run(0, 1, _free_port(), path, tmp_path, one, mode, {})
    return torch.load(two, weights_only=False), torch.load(one, weights_only=False)


def _assert_same_step(got, want):
    mask = make_batch(VOCAB)[keys.MASK]
    # float32 both (TF32 off): the same experts compute the same tokens, split over ranks (summation order only).
    torch.testing.assert_close(got["log_probs"][mask], want["log_probs"][mask], rtol=1e-5, atol=2e-5)
    for name in ("loss", "pg_loss", "grad_norm"):
        assert got["metrics"][name] == pytest.approx(want["metrics"][name], rel=1e-4, abs=1e-6), name
    for name, value in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, rtol=0, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rollout_routes_replay_over_two_gpus_as_on_one(layout, tmp_path):
    """R3 with foreign routes (not the model's own choices, so a route given to the wrong token, layer or chunk
    changes the outputs): two GPUs under ``layout`` equal one GPU's log-probs, loss, gradient norm and weights."""
    got, want = _two_against_one(tmp_path, "rollout", LAYOUTS[layout])
    _assert_same_step(got, want)


def test_recorded_routes_at_tp2_equal_one_gpus(tmp_path):
    """R2 at TP=2: the routes recorded in the old-log-prob pass come back whole, equal to one GPU's recording, and the
    replayed update equals one GPU's."""
    got, want = _two_against_one(tmp_path, "trainer", LAYOUTS["tp2-sp"])
    assert got["recorded"] is not None and got["recorded"].shape == want["recorded"].shape
    # Positions of real tokens but the last (whose prediction no loss reads): padding positions hold whatever each
    # layout pads with.
    real = torch.zeros(want["recorded"].shape[:2], dtype=torch.bool)
    td = make_batch(VOCAB)
    for i, n in enumerate((td[PROMPT_LENGTHS] + td[RESPONSE_LENGTHS]).tolist()):
        real[i, : n - 1] = True
    assert torch.equal(got["recorded"][real], want["recorded"][real])
    _assert_same_step(got, want)
