"""slime's debug and replay modes: rollout data saved per step and read back, their flags' checks, the plan."""

import pytest

from runtime.cli import main
from runtime.cluster.placement import plan_bundles
from runtime.config import ConfigError, parse_args
from runtime.rollout.replay import ReplaySource, load_rollout_data, save_rollout_data
from runtime.rollout.sample import Sample


def _samples(n):
    return [
        Sample(
            group_index=i // 2,
            index=i // 2,
            prompt=f"p{i}",
            tokens=[1, 2, 3 + i],
            response="x",
            response_length=1,
            label="l",
            reward={"score": float(i % 2), "acc": True},
            loss_mask=[1],
            rollout_log_probs=[-0.5],
            status=Sample.Status.TRUNCATED,
            metadata={"k": i},
            weight_versions=["3"],
        )
        for i in range(n)
    ]


def test_rollout_data_round_trips_and_subsamples(tmp_path):
    template = str(tmp_path / "data" / "{rollout_id}.pt")
    samples = _samples(8)
    assert save_rollout_data(template, 5, samples) == tmp_path / "data" / "5.pt"
    assert load_rollout_data(template, 5) == samples
    half = load_rollout_data(template, 5, subsample=0.5)
    assert half == samples[:2] + samples[-2:]  # slime's: the front and the back
    rollout = ReplaySource(template).get(5)
    assert rollout.samples == samples and rollout.metrics["rollout/replayed_samples"] == 8
    assert rollout.metrics["rollout/reward_mean"] == 0.5
    with pytest.raises(FileNotFoundError, match="no rollout data for step 6"):
        ReplaySource(template).get(6)


def test_debug_flags_are_checked(tmp_path):
    def problems(argv):
        with pytest.raises(ConfigError) as info:
            parse_args(argv)
        return "\n".join(info.value.problems)

    assert "needs --load-debug-rollout-data" in problems(["--debug-train-only"])
    assert "exclude each other" in problems(["--debug-rollout-only", "--load-debug-rollout-data", "d/{rollout_id}"])
    assert "cannot go with --save" in problems(["--debug-rollout-only", "--save", str(tmp_path)])
    assert "formatted with {rollout_id}" in problems(["--save-debug-rollout-data", "d/{step}.pt"])
    assert "(0, 1]" in problems(
        ["--load-debug-rollout-data", "d/{rollout_id}", "--load-debug-rollout-data-subsample", "2"]
    )
    cfg = parse_args(["--dump-details", str(tmp_path / "dump")])
    assert cfg.debug.rollout_data_path == str(tmp_path / "dump" / "rollout_data" / "{rollout_id}.pt")
    assert cfg.debug.train_data_path == str(tmp_path / "dump" / "train_data" / "{rollout_id}.pt")


def test_opd_flags_are_checked(tmp_path):
    def problems(argv):
        with pytest.raises(ConfigError) as info:
            parse_args(argv)
        return "\n".join(info.value.problems)

    assert "--use-opd needs --opd-type" in problems(["--use-opd"])
    assert "teacher_log_probs, which a reward or generate function sets" in problems(
        ["--use-opd", "--opd-type", "sglang"]
    )
    assert "needs --opd-teacher-load" in problems(["--use-opd", "--opd-type", "megatron"])
    argv = ["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", str(tmp_path)]
    assert "not an HF model folder" in problems(argv)
    (tmp_path / "config.json").write_text("{}")
    assert parse_args(argv).algo.opd_kl_coef == 1.0  # slime's default
    assert "with --use-opd only" in problems(["--opd-type", "megatron"])


def test_debug_modes_place_one_side_only(capsys):
    train_only = parse_args(["--load-debug-rollout-data", "d/{rollout_id}.pt"])
    assert train_only.debug.train_only  # implied, as in slime
    plan = plan_bundles(train_only)
    assert (plan.trainer_bundles, plan.engine_bundles) == ([0], [])
    plan = plan_bundles(parse_args(["--debug-rollout-only"]))
    assert (plan.trainer_bundles, plan.engine_bundles) == ([], [0])
    assert main(["--debug-rollout-only", "--dry-run"]) == 0
    assert "trainer bundles        []" in capsys.readouterr().out


# ---------------------------------------------------------------- logging flags


def test_wandb_flags_reach_login_and_init(tmp_path, monkeypatch):
    import re
    import sys
    import types

    from runtime.logger import MetricsLogger, WandbOptions

    calls = {}
    fake = types.ModuleType("wandb")
    fake.login = lambda **kw: calls.setdefault("login", kw)

    class Run:
        def log(self, metrics, step):
            calls.setdefault("logged", []).append((step, metrics))

        def finish(self):
            calls["finished"] = True

    fake.init = lambda **kw: calls.setdefault("init", kw) and Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    options = WandbOptions(project="p", team="t", group="g", key="k", host="h", run_id="r1", dir=str(tmp_path / "wb"))
    with MetricsLogger(tmp_path, use_tensorboard=False, use_wandb=True, wandb_options=options) as logger:
        logger.log(0, {"a": 1.0})
    assert calls["login"] == {"key": "k", "host": "h"}
    init = calls["init"]
    assert (init["project"], init["entity"]) == ("p", "t") and init["name"] == init["group"]
    assert re.fullmatch(r"g_[a-z0-9]{8}", init["group"])  # slime's random suffix
    assert (init["id"], init["resume"], init["dir"]) == ("r1", "allow", str(tmp_path / "wb"))
    assert calls["logged"] == [(0, {"a": 1.0})] and calls["finished"]
    calls.clear()
    offline = WandbOptions(project="p", group="g", key="k", mode="offline", random_suffix=False)
    with MetricsLogger(tmp_path, use_tensorboard=False, use_wandb=True, wandb_options=offline):
        pass
    assert "login" not in calls and calls["init"]["mode"] == "offline" and calls["init"]["group"] == "g"
    cfg = parse_args(["--wandb-team", "t", "--wandb-mode", "offline", "--disable-wandb-random-suffix"])
    assert (cfg.log.wandb_team, cfg.log.wandb_mode, cfg.log.disable_wandb_random_suffix) == ("t", "offline", True)


def test_tensorboard_dir_follows_slime(tmp_path, monkeypatch):
    from runtime.logger import tensorboard_dir

    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    assert tensorboard_dir(tmp_path, project=None, experiment=None) == tmp_path / "tensorboard"
    assert str(tensorboard_dir(tmp_path, project="p", experiment="e")) == "tensorboard_log/p/e"
    assert str(tensorboard_dir(tmp_path, project="p", experiment=None)).startswith("tensorboard_log/p/20")
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    assert tensorboard_dir(tmp_path, project="p", experiment="e") == tmp_path / "tb"


def test_train_step_balances_rows_and_saves_the_batch(tmp_path):
    import torch

    from runtime.rollout.source import Rollout
    from runtime.train.algo import advantage_config
    from runtime.train.batch import RESPONSE_LENGTHS
    from runtime.train.driver import train_step

    class Trainers:
        def train_rollout(self, batch, **kwargs):
            self.batch = batch
            return {"approx_kl_old": 0.0, "advantage_abs_mean": 1.0}

        def call(self, method):
            raise AssertionError(method)

    class Tok:
        pad_token_id = 0

    samples = []
    for i, length in enumerate([1, 9, 2, 8, 3, 7, 4, 6]):
        samples.append(
            Sample(group_index=i // 2, index=i // 2, tokens=[5] * (2 + length), response_length=length,
                   reward=float(i % 2), loss_mask=[1] * length, rollout_log_probs=[-1.0] * length)
        )  # fmt: skip
    argv = ["--balance-data", "--actor-num-gpus-per-node", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt"]
    argv += ["2", "--global-batch-size", "8", "--micro-batch-size", "2", "--dump-details", str(tmp_path)]
    cfg = parse_args(argv)
    trainers = Trainers()
    metrics = train_step(cfg, trainers, Rollout(3, samples, {}), Tok(), advantage_config(cfg))
    assert metrics["rollout/advantage_abs_mean"] == 1.0
    lengths = trainers.batch[RESPONSE_LENGTHS].tolist()
    # shard_rows gives rank 0 the first 4 rows and rank 1 the last 4: each gets 20 of the 40 response tokens.
    assert sum(lengths[:4]) == sum(lengths[4:]) == 20
    saved = torch.load(tmp_path / "train_data" / "3.pt", weights_only=False)
    assert saved["rollout_id"] == 3 and saved["batch"][RESPONSE_LENGTHS].tolist() == lengths


def test_ref_load_takes_an_hf_folder_for_the_reference(tmp_path):
    from runtime.train.algo import role_paths

    with pytest.raises(ConfigError, match="--ref-load .*HF folder"):
        parse_args(["--ref-load", str(tmp_path)])  # slime's torch_dist folders have no config.json
    (tmp_path / "config.json").write_text("{}")
    cfg = parse_args(["--ref-load", str(tmp_path)])
    assert role_paths(cfg) == {"reference": str(tmp_path)}
