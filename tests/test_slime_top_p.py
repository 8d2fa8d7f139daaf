"""slime's top-p nucleus replay through the real loop (Ray, the embedded engine, the torch backend): with
``--rollout-top-p`` below 1 the trainer's log-probs are taken over the nucleus each token was sampled from, so that
they equal the engine's; ``--no-rollout-top-p-replay`` (ours) keeps the untruncated contract. The math is tested in
``tests/test_nucleus.py``, the engine and the trainer in ``tests/test_runtime_engine.py``."""

import pytest
import torch

from runtime.config import ConfigError, from_dict, parse_args, validate
from runtime.engines import SamplingParams
from runtime.job import sampling_params
from runtime.logger import METRICS_FILE, read_metrics
from runtime.loop import run
from runtime.rollout.sample import Sample

SMALL = {
    "rollout_batch_size": 4,
    "n_samples_per_prompt": 4,
    "rollout_max_response_len": 5,
    "global_batch_size": 16,
    "micro_batch_size": 8,
    "actor_num_gpus_per_node": 1,
    "use_tensorboard": False,
    "rollout_temperature": 0.8,
    "rollout_top_p": 0.5,
    "get_mismatch_metrics": True,
}


def test_the_engine_is_asked_for_the_nucleus_only_under_replay():
    params = sampling_params(parse_args(["--rollout-top-p", "0.9"]))
    assert params.return_top_p_token_ids
    # A custom generate function gets slime's sampling-params dict, which asks its patched SGLang this way.
    assert params.to_dict()["custom_params"] == {"return_top_p_token_ids": True}
    assert SamplingParams.from_dict(params.to_dict()) == params
    assert "custom_params" not in sampling_params(parse_args([])).to_dict()
    assert not sampling_params(
        parse_args(["--rollout-top-p", "0.9", "--no-rollout-top-p-replay"])
    ).return_top_p_token_ids
    assert not sampling_params(parse_args([])).return_top_p_token_ids  # top-p 1: the untruncated contract


def test_replay_is_refused_where_the_nucleus_is_not_reported():
    with pytest.raises(ConfigError, match="--rollout-top-p 0.9 replays .* which --rollout-engine sglang does not do"):
        parse_args(["--rollout-top-p", "0.9", "--rollout-engine", "sglang", "--sglang-url", "http://127.0.0.1:1"])
    cfg = parse_args(["--rollout-top-p", "0.9", "--rollout-engine", "sglang", "--sglang-url", "http://127.0.0.1:1",
                      "--no-rollout-top-p-replay"])  # fmt: skip
    assert cfg.rollout.rollout_top_p == 0.9
    # The Megatron backend declares no nucleus replay (runtime.train.backends.megatron_options).
    with pytest.raises(ConfigError, match="which --train-backend megatron does not do .its loss takes log-probs"):
        parse_args(["--rollout-top-p", "0.9", "--train-backend", "megatron"])


def test_train_log_probs_equal_the_engines_over_the_nucleus(ray_session, tmp_path):
    dumps = {}
    for replay in (True, False):
        out = tmp_path / f"replay_{replay}"
        dump = str(out / "rollout_{rollout_id}.pt")
        cfg = validate(
            from_dict(
                None,
                output_dir=str(out),
                num_rollout=2,
                rollout_top_p_replay=replay,
                save_debug_rollout_data=dump,
                **SMALL,
            )
        )
        rows = read_metrics(run(cfg, progress=False).output_dir / METRICS_FILE)
        # Sync schedule: each rollout is sampled by the weights the trainer recomputes with, so the trainer's
        # log-probs equal the engine's, over the nucleus under replay and untruncated without.
        assert max(row["train/rollout_log_prob_abs_diff"] for row in rows) < 1e-4, rows
        dumps[replay] = [
            Sample.from_dict(d) for d in torch.load(dump.format(rollout_id=0), weights_only=False)["samples"]
        ]
    # The same seed draws the same tokens either way; under replay each log-prob is over the nucleus, so higher.
    for with_replay, without in zip(dumps[True], dumps[False], strict=True):
        assert with_replay.tokens == without.tokens
        assert len(with_replay.rollout_top_p_token_offsets) == with_replay.response_length + 1
        assert without.rollout_top_p_token_ids is None
        gain = torch.tensor(with_replay.rollout_log_probs) - torch.tensor(without.rollout_log_probs)
        assert gain.min() > -1e-6 and gain.mean() > 0.3, gain
