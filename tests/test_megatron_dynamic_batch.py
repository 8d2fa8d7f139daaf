"""--use-dynamic-batch-size under --train-backend megatron on the CPU (gloo), and data parallelism's gradient.

Without Transformer Engine there is no packed (THD) attention: rows are grouped into micro-batches of at most
--max-tokens-per-gpu real tokens (slime's first-fit count, balanced), each right-padded to its own longest row. The
loss uses the global batch's Normalizer, so the grouping must not change the step: the same log-probs, metrics and
weights after a step as fixed micro-batches. Two DP ranks (spawned processes) equal one rank, with the dynamic
grouping (ranks that need 4 and 3 micro-batches both run 4) and without it.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("megatron.core")

from test_megatron_backend import _free_port, job, save_model, trainer  # noqa: E402

from rlcore import keys  # noqa: E402
from rlcore.advantages import compute  # noqa: E402
from runtime.rollout.sample import Sample  # noqa: E402
from runtime.train.algo import advantage_config  # noqa: E402
from runtime.train.batch import PROMPT_LENGTHS, RESPONSE_LENGTHS, build_batch, shard_rows  # noqa: E402
from runtime.train.packing import min_micro_batches, pack_by_tokens  # noqa: E402
from runtime.train.roles import ACTOR, REFERENCE  # noqa: E402

VOCAB = 203
# Rank 0's rows (0-3) need 4 micro-batches of 10 tokens (first fit), rank 1's (4-7) 3.
LENGTHS = [9, 8, 7, 6, 6, 5, 7, 4]
BUDGET = 10
# Adam's first step is about lr x sign(gradient): where a gradient is near zero, float32 rounding of its sum can move
# an element by a fraction of the step. At 1e-4 that stays under the 1e-6 the weights are compared to, while every
# weight that trains moves by about 1e-4.
LR = 1e-4


# ---------------------------------------------------------------- the partition


@given(st.lists(st.integers(1, 40), min_size=1, max_size=30), st.integers(40, 120), st.integers(1, 40))
def test_pack_by_tokens_at_least_keeps_every_row_once_within_the_budget(lengths, budget, at_least):
    bins = pack_by_tokens(lengths, max_tokens=budget, at_least=at_least)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= budget for b in bins)
    assert len(bins) >= max(min_micro_batches(lengths, max_tokens=budget), min(at_least, len(lengths)))


def test_min_micro_batches_is_first_fit_and_at_least_raises_the_count():
    assert min_micro_batches(LENGTHS[:4], max_tokens=BUDGET) == 4
    assert min_micro_batches(LENGTHS[4:], max_tokens=BUDGET) == 3  # [6, 4], [5], [7]
    assert pack_by_tokens(LENGTHS[4:], max_tokens=BUDGET) == [[0], [1, 3], [2]]  # balanced: 6, 9, 7
    assert pack_by_tokens(LENGTHS[4:], max_tokens=BUDGET, at_least=4) == [[0], [1], [2], [3]]
    assert len(pack_by_tokens([1, 1], max_tokens=BUDGET, at_least=5)) == 2  # one row per micro-batch at most
    with pytest.raises(ValueError, match="at_least must be >= 1"):
        pack_by_tokens([1], max_tokens=BUDGET, at_least=0)
    with pytest.raises(ValueError, match="sample 0 has 11 tokens, over --max-tokens-per-gpu 10"):
        min_micro_batches([11], max_tokens=BUDGET)


# ---------------------------------------------------------------- one rank: dynamic equals fixed


def batch_of(lengths: list[int], *, seed: int = 0):
    """Rows of the given total lengths (prompt about half), four samples per prompt group."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i, length in enumerate(lengths):
        prompt_len = max(1, length // 2)
        tokens = torch.randint(1, VOCAB, (length,), generator=gen).tolist()
        samples.append(
            Sample(
                index=i // 4,
                group_index=i // 4,
                tokens=tokens,
                response_length=length - prompt_len,
                reward=float(i % 3) / 2,
                rollout_log_probs=[-1.0] * (length - prompt_len),
            )
        )
    return build_batch(samples, pad_token_id=0)


def prepared(backend, cfg, td):
    """``td`` with the old and reference log-probs of ``backend`` (old ones perturbed, so the ratio is not 1) and
    advantages; the log-probs as computed."""
    td = td.clone()
    log_probs = backend.compute_log_probs(td)
    td.update(log_probs)
    td.set(
        keys.OLD_LOG_PROBS,
        td[keys.OLD_LOG_PROBS] + 0.05 * torch.sin(torch.arange(td[keys.MASK].numel())).view_as(td[keys.MASK]),
    )
    return compute(td, advantage_config(cfg)), log_probs


def _lengths(mb) -> list[int]:
    return (mb[PROMPT_LENGTHS] + mb[RESPONSE_LENGTHS]).tolist()


def run_one(path, cfg, td):
    mega = trainer("megatron", path, cfg, roles=(ACTOR, REFERENCE))
    try:
        ready, log_probs = prepared(mega, cfg, td)
        train_parts = mega._micro_batches(ready)
        log_prob_parts = mega._micro_batches(ready, log_probs=True)
        widths = [mega._inputs(mb)[0].shape[1] for mb in train_parts]
        start = mega.get_weights()
        metrics = mega.train(ready, per_step_rows=td.batch_size[0])
        moved = max(float((after - start[name]).abs().max()) for name, after in mega.get_weights().items())
        assert moved > 0.5 * LR  # the step trains: the 1e-6 comparisons below can fail
        return log_probs, metrics, mega.get_weights(), train_parts, log_prob_parts, widths
    finally:
        mega.shutdown()


def test_dynamic_micro_batches_give_the_fixed_step(tmp_path):
    path = save_model("qwen3", tmp_path / "m")
    td = batch_of([11, 3, 8, 5, 10, 4, 7, 9])
    dynamic_cfg = job(
        tmp_path,
        lr=LR,
        train_backend="megatron",
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=16,
        log_probs_max_tokens_per_gpu=30,
    )
    fixed_cfg = job(tmp_path, lr=LR, train_backend="megatron", max_tokens_per_gpu=20, log_probs_max_tokens_per_gpu=40)
    dyn_lp, dyn_metrics, dyn_weights, train_parts, lp_parts, widths = run_one(path, dynamic_cfg, td)
    fix_lp, fix_metrics, fix_weights, fix_train, fix_lp_parts, _ = run_one(path, fixed_cfg, td)

    # The flags' effect: groups of at most 16 (training) and 30 (log-probs) real tokens, as many as first fit
    # needs, every row once; each padded to its own longest row.
    lengths = _lengths(td)
    for parts, budget in ((train_parts, 16), (lp_parts, 30)):
        assert len(parts) == min_micro_batches(lengths, max_tokens=budget)
        assert all(sum(_lengths(mb)) <= budget for mb in parts)
        assert sorted(n for mb in parts for n in _lengths(mb)) == sorted(lengths)
    assert len(train_parts) > len(lp_parts)
    assert widths == [max(_lengths(mb)) for mb in train_parts]
    assert widths != [max(lengths)] * len(widths)  # not padded to the batch's longest
    # Fixed micro-batches under Megatron read --log-probs-max-tokens-per-gpu too (rows x longest).
    assert all(mb.batch_size[0] * max(_lengths(mb)) <= 20 for mb in fix_train)
    assert all(mb.batch_size[0] * max(_lengths(mb)) <= 40 for mb in fix_lp_parts)
    assert len(fix_lp_parts) < len(fix_train)

    mask = td[keys.MASK]
    for key in (keys.OLD_LOG_PROBS, keys.REF_LOG_PROBS):
        torch.testing.assert_close(dyn_lp[key][mask], fix_lp[key][mask], rtol=0, atol=1e-6)
    assert set(dyn_metrics) == set(fix_metrics) and {"loss", "pg_loss", "kl_loss", "grad_norm"} <= set(dyn_metrics)
    for name, value in fix_metrics.items():
        assert dyn_metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-9), name
    assert dyn_metrics["grad_norm"] > 0
    for name, value in dyn_weights.items():
        torch.testing.assert_close(value, fix_weights[name], rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------- two DP ranks equal one


def _dp_worker(rank, world, port, path, tmp, batch_file, out, dynamic):
    knobs = dict(use_dynamic_batch_size=True, max_tokens_per_gpu=BUDGET) if dynamic else {}
    cfg = job(tmp, lr=LR, train_backend="megatron", actor_num_gpus_per_node=world, **knobs)
    mega = trainer("megatron", path, cfg, rank=rank, world_size=world, master_port=port, roles=(ACTOR, REFERENCE))
    ready = torch.load(batch_file, weights_only=False)
    dp_rank, dp_size = mega.dp_info()
    shard = ready[shard_rows(ready.batch_size[0], global_batch_size=8, dp_rank=dp_rank, dp_size=dp_size)]
    counts = len(mega._micro_batches(shard)), len(mega._micro_batches(shard, log_probs=True))
    log_probs = mega.compute_log_probs(shard)
    metrics = mega.train(shard, per_step_rows=shard.batch_size[0])
    weights = mega.get_weights()
    torch.save(
        {"log_probs": log_probs, "metrics": metrics, "weights": weights, "dp": (dp_rank, dp_size), "counts": counts},
        f"{out}.{rank}",
    )
    mega.shutdown()


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "fixed"])
def test_two_data_parallel_ranks_equal_one(dynamic, tmp_path, gloo_ranks):
    path = save_model("llama", tmp_path / "m")
    knobs = dict(use_dynamic_batch_size=True, max_tokens_per_gpu=BUDGET) if dynamic else {}
    cfg = job(tmp_path, lr=LR, train_backend="megatron", **knobs)
    td = batch_of(LENGTHS)
    one = trainer("megatron", path, cfg, roles=(ACTOR, REFERENCE))
    try:
        ready, log_probs = prepared(one, cfg, td)
        metrics = one.train(ready, per_step_rows=8)
        weights = one.get_weights()
    finally:
        one.shutdown()
    batch_file, out = str(tmp_path / "batch.pt"), str(tmp_path / "dp2")
    torch.save(ready, batch_file)
    gloo_ranks.run(_dp_worker, 2, _free_port(), path, tmp_path, batch_file, out, dynamic)
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    assert [r["dp"] for r in ranks] == [(0, 2), (1, 2)]
    if dynamic:
        assert min_micro_batches(LENGTHS[:4], max_tokens=BUDGET) == 4
        assert min_micro_batches(LENGTHS[4:], max_tokens=BUDGET) == 3
        assert [r["counts"] for r in ranks] == [(4, 4), (4, 4)]  # the most any rank needs
    else:
        assert [r["counts"] for r in ranks] == [(2, 2), (2, 2)]  # --micro-batch-size 3 over 4 rows
    mask = td[keys.MASK]
    for r, rank in enumerate(ranks):
        rows = shard_rows(8, global_batch_size=8, dp_rank=r, dp_size=2)
        for key in (keys.OLD_LOG_PROBS, keys.REF_LOG_PROBS):
            torch.testing.assert_close(
                rank["log_probs"][key][mask[rows]], log_probs[key][rows][mask[rows]], rtol=0, atol=1e-6
            )
        assert set(rank["metrics"]) == set(metrics) and {"loss", "pg_loss", "kl_loss", "grad_norm"} <= set(metrics)
        for name, value in metrics.items():
            assert rank["metrics"][name] == pytest.approx(value, rel=1e-5, abs=1e-9), name
    assert metrics["grad_norm"] > 0
    for name, value in weights.items():
        torch.testing.assert_close(
            ranks[0]["weights"][name], value, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


# ---------------------------------------------------------------- a failed build


def test_a_trainer_whose_build_fails_tears_down_its_process_group(tmp_path):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    path = save_model("llama", tmp_path / "m")
    config_path = tmp_path / "m" / "config.json"
    config_path.write_text(config_path.read_text().replace('"intermediate_size": 80', '"intermediate_size": 96'))
    cfg = job(tmp_path, train_backend="megatron")
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"gate_proj.weight has shape \(80, 48\)"):
        trainer("megatron", path, cfg, roles=(ACTOR,))
    assert not dist.is_initialized()
    assert not ps.model_parallel_is_initialized()
