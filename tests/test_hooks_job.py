"""slime's hooks in whole jobs: real Ray, the tiny model on the CPU, the hooks of
``tests/fixtures/slime_style_plugin.py`` (written as a slime user writes them)."""

import json

import pytest
import ray
import torch

from runtime.config import from_dict, parse_args, validate
from runtime.demo import task
from runtime.demo.tiny_model import make_tiny_model
from runtime.logger import METRICS_FILE, read_metrics
from runtime.loop import run

PLUGIN = "tests/fixtures/slime_style_plugin.py"
SMALL = {
    "rollout_batch_size": 2,
    "n_samples_per_prompt": 2,
    "rollout_max_response_len": 3,
    "global_batch_size": 4,
    "micro_batch_size": 2,
    "lr": 1e-3,
    "actor_num_gpus_per_node": 1,
}
# A chat template over the tiny model's alphabet: "=" opens an assistant turn, <eos> ends it.
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}={{ m['content'] }}<eos>{% else %}{{ m['content'] }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}={% endif %}"
)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """The tiny model with a chat template."""
    from transformers import AutoTokenizer

    folder = make_tiny_model(tmp_path_factory.mktemp("chat"), alphabet=task.ALPHABET, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture
def plugin():
    from runtime.hooks import resolve_hook

    module = __import__(resolve_hook("--x", f"{PLUGIN}:on_init").fn.__module__)
    module.CALLS.clear()
    return module


def _cfg(tmp_path, **overrides):
    return validate(from_dict(None, output_dir=str(tmp_path / "out"), **{**SMALL, **overrides}))


def test_rollout_function_with_a_data_source_saved_and_loaded(ray_session, tmp_path, plugin):
    """--rollout-function-path + --data-source-path (slime's DataSource, saving its own state under --save) +
    --eval-function-path + the log hooks, then a resume from the checkpoint continues the data source."""
    hooks = {
        "rollout_function_path": f"{PLUGIN}:generate_rollout",
        "data_source_path": f"{PLUGIN}:CountingDataSource",
        "custom_rm_path": f"{PLUGIN}:exact_digit",
        "custom_rollout_log_function_path": f"{PLUGIN}:log_rollout",
        "custom_eval_rollout_log_function_path": f"{PLUGIN}:log_eval_rollout",
        "eval_interval": 2,
        "skip_eval_before_train": True,
    }
    save = tmp_path / "ckpt"
    result = run(_cfg(tmp_path / "a", num_rollout=2, save=str(save), save_interval=1, **hooks), progress=False)
    rows = read_metrics(result.output_dir / METRICS_FILE)
    assert [r["step"] for r in rows] == [0, 1] and all("train/loss" in r for r in rows)
    assert "eval/digits/reward_mean" in rows[1]
    assert [c["rollout_id"] for c in plugin.CALLS["rollout"]] == [0, 1, 2]  # two steps, then evaluation after 2
    assert [c["evaluation"] for c in plugin.CALLS["rollout"]] == [False, False, True]
    assert [c["rollout_id"] for c in plugin.CALLS["log_rollout"]] == [0, 1]
    assert plugin.CALLS["log_eval"] == [{"rollout_id": 2, "names": ["digits"]}]
    assert [c["rollout_id"] for c in plugin.CALLS["save"]] == [0, 1]  # slime's ids: the step just trained
    assert (save / "rollout" / "counting_state_1.pt").exists()
    # Resume from step 1: the data source loads its own state of rollout 0 and goes on from there.
    plugin.CALLS.clear()
    resumed = run(
        _cfg(tmp_path / "b", num_rollout=2, load=str(save / "step_000001"), **{**hooks, "eval_interval": None}),
        progress=False,
    )
    assert [r["step"] for r in resumed.history] == [1]
    assert plugin.CALLS["load"] == [{"rollout_id": 0, "position": 2}]
    assert plugin.CALLS["get_samples"][0]["position"] == 4


def test_built_in_rollout_with_fan_out_sample_hooks_and_all_samples(ray_session, tmp_path, plugin):
    cfg = _cfg(
        tmp_path,
        num_rollout=1,
        custom_generate_function_path=f"{PLUGIN}:generate_fan_out",
        rollout_sample_hook_path=[f"{PLUGIN}:tag_sample", f"{PLUGIN}:count_sample"],
        rollout_all_samples_process_path=f"{PLUGIN}:see_all_samples",
        rollout_sample_filter_path=f"{PLUGIN}:remove_second_turn",
        custom_reward_post_process_path=f"{PLUGIN}:reward_post_process",
        dump_details=str(tmp_path / "dump"),
    )
    (row,) = read_metrics(run(cfg, progress=False).output_dir / METRICS_FILE)

    assert "train/loss" in row and row["train/num_steps"] == 1
    assert len(plugin.CALLS["tag"]) == 8 and {c["rollout_id"] for c in plugin.CALLS["tag"]} == {0}
    assert plugin.CALLS["all_samples"] == [{"groups": 2, "data_source": "BufferedPromptSource"}]
    assert plugin.CALLS["sample_filter"] == [{"groups": 2}]
    assert plugin.CALLS["reward_post_process"] == [{"n": 8}]
    # What the hooks did reached the trained batch (the step's dumps, --dump-details):
    samples = torch.load(tmp_path / "dump" / "rollout_data" / "0.pt", weights_only=False)["samples"]
    batch = torch.load(tmp_path / "dump" / "train_data" / "0.pt", weights_only=False)["batch"]
    assert batch["response_lengths"].tolist() == [s["response_length"] for s in samples] == [1, 2] * 4
    assert all(s["metadata"]["tagged"] for s in samples)  # the sample hook's mark
    # The filter removed each second turn: kept in the batch, with no token trained.
    assert [s["remove_sample"] for s in samples] == [s["metadata"]["turn"] == 1 for s in samples] == [False, True] * 4
    assert batch["mask"].sum(1).tolist() == [1, 0] * 4
    # The post-process's rewards (2 r - 1) replace the group normalisation as the advantages.
    want = [2.0 * s["reward"] - 1.0 for s in samples]
    assert batch["rewards"].tolist() == want and batch["sequence_advantages"].tolist() == want


def _conversations(n, *, seed):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        a, b = (int(x) for x in torch.randint(0, 5, (2,), generator=g))
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"{a}c{b}"},
                    {"role": "assistant", "content": str(a + b)},
                    {"role": "user", "content": f"{b}c{a}"},
                    {"role": "assistant", "content": str(a + b)},
                ]
            }
        )
    return rows


def test_sft_job_from_the_command_line(ray_session, chat_model, tmp_path):
    """slime's SFT flags: --rollout-function-path slime.rollout.sft_rollout.generate_rollout --loss-type sft_loss
    --calculate-per-token-loss --disable-compute-advantages-and-returns; the loss falls."""
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _conversations(64, seed=0)))
    argv = ["--hf-checkpoint", chat_model, "--prompt-data", str(data), "--input-key", "messages"]
    argv += ["--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout", "--loss-type", "sft_loss"]
    argv += ["--calculate-per-token-loss", "--disable-compute-advantages-and-returns", "--loss-mask-type", "qwen"]
    argv += ["--rollout-batch-size", "16", "--n-samples-per-prompt", "1", "--global-batch-size", "16"]
    argv += [
        "--num-rollout",
        "12",
        "--lr",
        "1e-2",
        "--actor-num-gpus-per-node",
        "1",
        "--rollout-max-response-len",
        "4",
    ]
    argv += ["--output-dir", str(tmp_path / "out")]
    rows = read_metrics(run(parse_args(argv), progress=False).output_dir / METRICS_FILE)
    losses = [r["train/loss"] for r in rows]
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3


def test_slimes_sft_script_shape_starts_no_engine_and_logs_to_wandb(ray_session, chat_model, tmp_path, monkeypatch):
    """As slime's run-qwen3-4B-base-sft.sh: --debug-train-only with slime's sft_rollout and --num-epoch, no response
    length. No engine starts, the epochs set the steps, and W&B (offline) gets what metrics.jsonl holds."""
    from test_slime_scripts import offline_run, wandb_history

    from runtime import job
    from runtime.cluster.engines import EngineGroup

    groups = []

    class Recorded(EngineGroup):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            groups.append(self)

    monkeypatch.setattr(job, "EngineGroup", Recorded)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _conversations(40, seed=1)))
    argv = ["--hf-checkpoint", chat_model, "--prompt-data", str(data), "--input-key", "messages"]
    argv += ["--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout", "--loss-type", "sft_loss"]
    argv += ["--calculate-per-token-loss", "--disable-compute-advantages-and-returns", "--debug-train-only"]
    argv += ["--rollout-batch-size", "16", "--global-batch-size", "16", "--num-epoch", "2", "--lr", "1e-2"]
    argv += ["--actor-num-gpus-per-node", "1", "--output-dir", str(tmp_path / "out")]
    argv += ["--use-wandb", "--wandb-project", "p", "--wandb-group", "sft", "--wandb-dir", str(tmp_path / "wb")]
    rows = read_metrics(run(parse_args(argv), progress=False).output_dir / METRICS_FILE)
    assert len(rows) == 2 * (40 // 16)  # slime: num_epoch x whole rollouts per pass
    (group,) = groups
    assert group.actors == [] and group.launchers == []
    history = wandb_history(offline_run(tmp_path / "wb"))
    assert [h["_step"] for h in history] == [r["step"] for r in rows]
    for h, r in zip(history, rows, strict=True):
        # The same float through two JSON writers (repr round-trips a float exactly).
        assert h["train/loss"] == r["train/loss"] and h["train/grad_norm"] == r["train/grad_norm"]


def test_two_fsdp_trainers_with_fan_out_rows_give_the_single_trainers_step(ray_session, chat_model, tmp_path):
    """Rollouts split into several rows land whole on one rank (steps and shards by rollout); the per-rollout
    denominators and the global sequence count make two FSDP ranks train exactly as one trainer."""
    from rlcore.advantages import sequence_advantages
    from runtime.cluster.placement import create_placement
    from runtime.cluster.trainers import TrainerGroup
    from runtime.rollout.sample import Sample
    from runtime.train.algo import advantage_config, loss_config, model_roles
    from runtime.train.backends.torch_backend import TorchTrainer
    from runtime.train.batch import build_batch
    from runtime.train.step import train_rollout

    cfg = _cfg(
        tmp_path,
        actor_num_gpus_per_node=2,
        rollout_num_gpus=2,
        colocate=True,
        rollout_batch_size=4,
        n_samples_per_prompt=4,
        global_batch_size=8,
        num_rollout=1,
    )
    g = torch.Generator().manual_seed(3)
    samples = []
    for i in range(16):
        pieces = 1 + (i % 3 == 1) + (i % 5 == 2)
        for _ in range(pieces):
            r = int(torch.randint(1, 5, (), generator=g))
            s = Sample(
                group_index=i // 4, index=i, tokens=[1, 4, 5] + torch.randint(4, 14, (r,), generator=g).tolist()
            )
            s.response_length, s.reward = r, float(torch.rand((), generator=g))
            s.rollout_id = 1000 + i if pieces > 1 else None
            samples.append(s)
    batch = build_batch(samples, pad_token_id=0)
    assert batch.batch_size[0] > 16
    adv_cfg = advantage_config(cfg)
    batch = sequence_advantages(batch, adv_cfg)
    kwargs = dict(train_cfg=cfg.train, loss_cfg=loss_config(cfg), temperature=1.0, roles=model_roles(cfg), seed=0)
    single = TorchTrainer(chat_model, **kwargs)
    expected = train_rollout(single, batch, global_batch_size=8, adv_cfg=adv_cfg)
    assert expected["num_steps"] == 2
    placement = create_placement(cfg)
    group = TrainerGroup(placement, backend="torch", model_path=chat_model, **kwargs)
    try:
        got = group.train_rollout(batch, global_batch_size=8, adv_cfg=adv_cfg)
        for name in ("grad_norm", "pg_loss", "loss", "num_steps"):
            assert got[name] == pytest.approx(expected[name], rel=1e-4, abs=1e-6), name
        full, want = group.get_weights(), single.get_weights()
        # (Two AdamW steps of lr 1e-3: a near-zero gradient summed in another order moves a weight ~1e-5 apart.)
        for name, value in full.items():
            torch.testing.assert_close(value, want[name], atol=1e-4, rtol=1e-4)
    finally:
        group.shutdown()
        ray.util.remove_placement_group(placement.group)


def test_a_rollout_function_without_the_global_dataset(ray_session, tmp_path, plugin):
    """--disable-rollout-global-dataset: the default data source holds no prompt data (slime's args.
    rollout_global_dataset False, len 0, get_samples beyond its buffer raises); the rollout makes its own prompts and
    trains again on the group it put back."""
    cfg = _cfg(
        tmp_path,
        num_rollout=2,
        disable_rollout_global_dataset=True,
        rollout_function_path=f"{PLUGIN}:self_prompting_rollout",
        custom_rm_path=f"{PLUGIN}:exact_digit",
    )
    rows = read_metrics(run(cfg, progress=False).output_dir / METRICS_FILE)
    assert [r["step"] for r in rows] == [0, 1] and all("train/loss" in r for r in rows)
    first, second = plugin.CALLS["self_prompting"]
    assert (first["global_dataset"], first["len"], first["from_buffer"]) == (False, 0, [])
    assert "--disable-rollout-global-dataset" in first["error"]
    assert second["from_buffer"] == ["0="] and "error" not in second
