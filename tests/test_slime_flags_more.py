"""slime's ``--log-correct-samples`` (against slime's quantile loop, transcribed as the reference, and through a real
job), ``--load-forge-rollout-data`` with slime's forge rollout (replayed samples trained while engines stay live), and
``--multimodal-keys`` refused as text-only."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from runtime.config import ConfigError, from_dict, parse_args, validate
from runtime.hooks import load_function
from runtime.logger import METRICS_FILE, read_metrics
from runtime.loop import run
from runtime.rollout import replay
from runtime.rollout.plugins import RolloutFnEvalOutput, RolloutFnTrainOutput
from runtime.rollout.sample import Sample
from runtime.train.step import correct_sample_metrics, correct_sample_sums

SMALL = {
    "rollout_batch_size": 4,
    "n_samples_per_prompt": 4,
    "rollout_max_response_len": 8,
    "global_batch_size": 16,
    "micro_batch_size": 8,
    "actor_num_gpus_per_node": 1,
    "use_tensorboard": False,
}


def _slime_quantile(total_value, n_quantiles, data):
    """slime's ``quantile`` of ``log_rollout_data`` (train_metric_utils.py), as it reads."""
    quantiles = [(i + 1) / n_quantiles for i in range(n_quantiles)]
    cut_points = [total_value * q for q in quantiles]
    cut_points[-1] = total_value
    count = [0] * n_quantiles
    for value in data:
        for i, point in enumerate(cut_points):
            if value <= point:
                count[i] += 1
                break
    total = sum(count) + 1e-9
    return {f"p{min(math.ceil(q * 100), 100)}": c / total for q, c in zip(quantiles, count, strict=True)}


@given(st.integers(1, 12), st.integers(1, 40), st.integers(0, 2**31 - 1), st.integers(1, 3))
def test_correct_sample_metrics_match_slimes_loop(n, max_len, seed, ranks):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (n,), generator=gen).float() / 2  # 0, 0.5 or 1: only 1 is correct
    lengths = torch.randint(1, max_len + 1, (n,), generator=gen)
    log_probs = -torch.rand(n, max_len, generator=gen, dtype=torch.float64) * 3
    mask = torch.arange(max_len) < lengths[:, None]
    mask[:, 0] &= torch.rand(n, generator=gen) > 0.2  # some tool-like holes
    # Ranks hold disjoint shards; the sums add up.
    cuts = sorted({0, n, *torch.randint(0, n + 1, (ranks - 1,), generator=gen).tolist()})
    sums = sum(
        correct_sample_sums(rewards[a:b], lengths[a:b], log_probs[a:b], mask[a:b], max_response_len=max_len)
        for a, b in zip(cuts, cuts[1:], strict=False)
    )
    got = correct_sample_metrics(sums)
    correct = [i for i in range(n) if rewards[i] == 1]
    expected = _slime_quantile(max_len, 4, [int(lengths[i]) for i in correct])
    for name, value in expected.items():
        assert got[f"rollout/correct_length/{name}"] == pytest.approx(value, abs=1e-12)
    means = [(-log_probs[i][mask[i]]).sum().item() / max(int(mask[i].sum()), 1) for i in correct]
    assert got["rollout/correct_entropy"] == pytest.approx(sum(means) / len(means) if means else 0.0, abs=1e-9)


def test_log_correct_samples_logs_from_the_trained_batch(ray_session, tmp_path):
    dump = str(tmp_path / "train_{rollout_id}.pt")
    cfg = validate(
        from_dict(
            None,
            output_dir=str(tmp_path / "out"),
            num_rollout=1,
            rm_type="random",
            log_correct_samples=True,
            get_mismatch_metrics=True,
            save_debug_train_data=dump,
            **SMALL,
        )
    )
    row = read_metrics(run(cfg, progress=False).output_dir / METRICS_FILE)[0]
    batch = torch.load(dump.format(rollout_id=0), weights_only=False)["batch"]
    sums = correct_sample_sums(
        batch["rewards"],
        batch["response_lengths"],
        batch["rollout_log_probs"],  # equal to the trainer's old log-probs here (same weights, sync)
        batch["mask"],
        max_response_len=8,
    )
    assert 0 < sums[4] < 16  # some samples correct, some not
    assert row["train/rollout_log_prob_abs_diff"] < 1e-5
    for name, value in correct_sample_metrics(sums).items():
        assert row[name] == pytest.approx(value, abs=1e-5), name
    assert sum(row[f"rollout/correct_length/p{q}"] for q in (25, 50, 75, 100)) == pytest.approx(1.0)


def _dump(tmp_path, name, rewards):
    samples = [
        Sample(
            group_index=i // 2,
            index=i,
            tokens=[1, 2, 3 + i],
            response_length=1,
            reward=r,
            status=Sample.Status.TRUNCATED if i == 0 else Sample.Status.COMPLETED,
        )
        for i, r in enumerate(rewards)
    ]
    replay.save_rollout_data(str(tmp_path / "{rollout_id}.pt"), name, samples)
    return samples


def test_forge_rollout_reads_slimes_paths(tmp_path):
    assert load_function("slime.rollout.forge_load.generate_rollout") is replay.forge_rollout
    first = _dump(tmp_path, 0, [1.0, 0.0, 0.0, 1.0])
    eval_samples = _dump(tmp_path, "eval_3", [1.0, 0.0])
    args = parse_args(
        [
            "--rollout-function-path",
            "slime.rollout.forge_load.generate_rollout",
            "--load-forge-rollout-data",
            str(tmp_path / "{rollout_id}.pt"),
        ]
    )
    out = replay.forge_rollout(args, 0, None)
    assert isinstance(out, RolloutFnTrainOutput) and out.samples == [first[:2], first[2:]]  # in their groups
    assert replay.forge_rollout(args, 7, None).samples == [first[:2], first[2:]]  # no 7.pt: rollout 0's
    ev = replay.forge_rollout(args, 3, None, evaluation=True)
    assert isinstance(ev, RolloutFnEvalOutput)
    assert ev.data["forge_eval"]["rewards"] == [1.0, 0.0] and ev.data["forge_eval"]["samples"] == eval_samples
    assert ev.data["forge_eval"]["truncated"] == [True, False]
    assert replay.forge_rollout(args, 4, None, evaluation=True).data == {}
    literal = parse_args(
        ["--rollout-function-path", "slime.rollout.forge_load.generate_rollout", "--load-forge-rollout-data",
         str(tmp_path / "0.pt")]
    )  # fmt: skip
    assert replay.forge_rollout(literal, 5, None).samples == [first[:2], first[2:]]
    assert replay.forge_rollout(literal, 5, None, evaluation=True).data == {}  # a literal path has no eval file


def test_forge_flags_go_together(tmp_path):
    with pytest.raises(ConfigError, match="--load-forge-rollout-data is read by slime's forge rollout"):
        parse_args(["--load-forge-rollout-data", "d/{rollout_id}.pt"])
    with pytest.raises(ConfigError, match="replays a saved rollout: it needs --load-forge-rollout-data"):
        parse_args(["--rollout-function-path", "slime.rollout.forge_load.generate_rollout"])


@pytest.mark.slow  # a job with live engines (~20 s); the replay without engines runs in test_runtime_loop.py
def test_forge_rollout_trains_saved_rollouts_with_live_engines(ray_session, tmp_path):
    saved = str(tmp_path / "rollout_{rollout_id}.pt")
    first = run(
        validate(
            from_dict(None, output_dir=str(tmp_path / "a"), num_rollout=2, save_debug_rollout_data=saved, **SMALL)
        ),
        progress=False,
    )
    before = read_metrics(first.output_dir / METRICS_FILE)
    cfg = validate(
        from_dict(
            None,
            output_dir=str(tmp_path / "b"),
            num_rollout=3,
            rollout_function_path="slime.rollout.forge_load.generate_rollout",
            load_forge_rollout_data=saved,
            **SMALL,
        )
    )
    rows = read_metrics(run(cfg, progress=False).output_dir / METRICS_FILE)
    # Rollouts 0 and 1 are the saved ones, rollout 2 has no file and replays rollout 0 (slime's fallback).
    assert [r["rollout/reward_mean"] for r in rows] == [before[i]["rollout/reward_mean"] for i in (0, 1, 0)]
    assert [r["rollout/response_len_mean"] for r in rows] == [
        before[i]["rollout/response_len_mean"] for i in (0, 1, 0)
    ]
    # Unlike --load-debug-rollout-data, the engines stay: weights are pushed to them after every step.
    assert all(r["perf/weight_sync_time"] > 0 for r in rows) and all(r["train/num_steps"] == 1 for r in rows)


def test_multimodal_keys_are_refused_as_text_only():
    with pytest.raises(ConfigError, match="--multimodal-keys .*text only"):
        parse_args(["--multimodal-keys", '{"image": "images"}'])
    assert parse_args([]).rollout.rollout_top_p == 1.0  # the default (None) is accepted
