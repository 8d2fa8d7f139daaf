"""The runtime's seams: every TrainBackend and WeightSync method on every implementation, the registries the flags
read, one trip per step, and lossless resume after a SIGKILL in every rollout schedule (real Ray, real tiny models)."""

import dataclasses
import importlib
import inspect
import json
import os
import signal
import subprocess
import sys
import time
import typing

import pytest
import ray
import torch
import torch.distributed.checkpoint as dcp
from suite_tools import kill_and_wait_gone
from tensordict import TensorDict
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlcore import keys
from rlcore.advantages import compute, sequence_advantages
from runtime.cli import main
from runtime.cluster.engines import EngineGroup
from runtime.cluster.placement import create_placement
from runtime.cluster.trainers import TrainerGroup
from runtime.cluster.weight_sync import WEIGHT_SYNCS, WeightSync, make_weight_sync
from runtime.config import SECTIONS, from_dict, validate
from runtime.demo import task
from runtime.demo.tiny_model import make_tiny_model
from runtime.engines.registry import ROLLOUT_ENGINES, engine_kind
from runtime.logger import LEDGER_FILE, read_metrics
from runtime.loop import run
from runtime.rollout.sample import Sample
from runtime.train.algo import advantage_config, loss_config, model_roles
from runtime.train.backends import TRAIN_BACKENDS, backend_class
from runtime.train.backends.base import TrainBackend
from runtime.train.batch import build_batch
from runtime.train.roles import ACTOR, CRITIC, REFERENCE, TEACHER
from runtime.train.step import critic_targets

SMALL = {
    "rollout_batch_size": 2,
    "n_samples_per_prompt": 4,
    "global_batch_size": 8,
    "micro_batch_size": 4,
    "use_tensorboard": False,
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), alphabet=task.ALPHABET, seed=0))


def _batch(model_path, n_groups=2, group=4, seed=0):
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i, rec in enumerate(task.make_records(n_groups * group, seed=seed)):
        prompt = tokenizer(rec["prompt"])["input_ids"]
        response = torch.randint(4, len(tokenizer), (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen)
        samples.append(
            Sample(
                index=i // group,
                group_index=i // group,
                tokens=prompt + response.tolist(),
                response_length=len(response),
                reward=float(i % 3) / 2,
                rollout_log_probs=[-1.0] * len(response),
            )
        )
    return build_batch(samples, pad_token_id=tokenizer.pad_token_id)


def _protocol_methods(protocol):
    return {n for n, _ in inspect.getmembers(protocol, inspect.isfunction) if not n.startswith("_")}


# ---------------------------------------------------------------- registries: the flags take exactly their names


def test_flag_choices_are_the_registries():
    rollout_hints = typing.get_type_hints(SECTIONS["rollout"])
    train_hints = typing.get_type_hints(SECTIONS["train"])
    assert typing.get_args(rollout_hints["rollout_engine"]) == tuple(ROLLOUT_ENGINES)
    assert typing.get_args(train_hints["train_backend"]) == tuple(TRAIN_BACKENDS)
    for name in TRAIN_BACKENDS:
        assert isinstance(backend_class(name), type)
    for name, kind in ROLLOUT_ENGINES.items():
        assert (
            kind.weight_sync(from_dict(None, rollout_engine=name), False) in WEIGHT_SYNCS and engine_kind(name) is kind
        )
    with pytest.raises(ValueError, match="--train-backend 'fsdp' is not one of torch, megatron"):
        backend_class("fsdp")
    with pytest.raises(ValueError, match="--rollout-engine 'vllm' is not one of hf, sglang"):
        engine_kind("vllm")


def test_model_roles_follow_the_algorithm(tmp_path):
    def roles(**kw):
        return model_roles(from_dict(None, output_dir=str(tmp_path), **kw))

    assert roles(use_kl_loss=False) == (ACTOR,)  # the built-in job keeps a reference by default
    assert roles(use_kl_loss=False, kl_coef=0.1) == (ACTOR,)  # grpo ignores --kl-coef, as slime does
    assert roles(use_kl_loss=False, kl_coef=0.1, advantage_estimator="reinforce_plus_plus") == (ACTOR, REFERENCE)
    opd = {"use_opd": True, "opd_type": "megatron", "opd_teacher_load": "teacher"}
    assert roles(use_kl_loss=False, **opd) == (ACTOR, TEACHER)
    assert roles(use_kl_loss=True, advantage_estimator="ppo") == (ACTOR, REFERENCE, CRITIC)
    assert roles(use_kl_loss=False, advantage_estimator="on_policy_distillation") == (ACTOR, TEACHER)


# ---------------------------------------------------------------- TrainBackend conformance


@pytest.mark.parametrize("backend", list(TRAIN_BACKENDS))
def test_every_train_backend_method(backend, model_path, tmp_path):
    # ppo with a KL loss: the actor, the reference and the critic, which every backend runs (and validation takes).
    cls = backend_class(backend)
    assert CRITIC in importlib.import_module(cls.__module__).SUPPORTED_ROLES
    cfg = validate(
        from_dict(
            None, output_dir=str(tmp_path), train_backend=backend, use_kl_loss=True, advantage_estimator="ppo", **SMALL
        )
    )
    with pytest.raises(ValueError, match="the actor always"):
        cls(model_path, train_cfg=cfg.train, loss_cfg=loss_config(cfg), temperature=1.0, seed=0, roles=(CRITIC,))
    # --ref-load: the reference from another folder (same tokenizer), so its log-probs differ from the actor's.
    ref_model = make_tiny_model(tmp_path / "ref", alphabet=task.ALPHABET, seed=5)
    with_ref = cls(
        model_path,
        train_cfg=cfg.train,
        loss_cfg=loss_config(cfg),
        temperature=1.0,
        seed=0,
        roles=(ACTOR, REFERENCE),
        role_paths={"reference": str(ref_model)},
    )
    moved = with_ref.compute_log_probs(_batch(model_path))
    assert not torch.equal(moved[keys.OLD_LOG_PROBS], moved[keys.REF_LOG_PROBS])
    with_ref.shutdown()
    other = make_tiny_model(tmp_path / "other_vocab", alphabet="0123456789", seed=1)
    with pytest.raises(ValueError, match="must share a tokenizer"):
        cls(
            model_path,
            train_cfg=cfg.train,
            loss_cfg=loss_config(cfg),
            temperature=1.0,
            seed=0,
            roles=(ACTOR, TEACHER),
            role_paths={"teacher": str(other)},
        )
    trainer = cls(
        model_path, train_cfg=cfg.train, loss_cfg=loss_config(cfg), temperature=1.0, seed=0, roles=model_roles(cfg)
    )
    called = set()

    def call(name, *args, **kwargs):
        called.add(name)
        return getattr(trainer, name)(*args, **kwargs)

    assert isinstance(trainer, TrainBackend)
    assert call("dp_info") == (0, 1) and call("dp_group") is None
    td = _batch(model_path)
    logps = call("compute_log_probs", td)
    assert CRITIC in model_roles(cfg)
    assert set(logps.keys()) == {keys.OLD_LOG_PROBS, keys.REF_LOG_PROBS, keys.VALUES}
    torch.testing.assert_close(logps[keys.OLD_LOG_PROBS], logps[keys.REF_LOG_PROBS])  # nothing trained yet
    td.update(logps)
    critic = call(
        "train_critic", critic_targets(compute(td, advantage_config(cfg)), advantage_config(cfg)), per_step_rows=8
    )
    assert critic["critic/num_steps"] == 1 and critic["critic/grad_norm"] > 0
    assert not torch.equal(trainer.compute_log_probs(td)[keys.VALUES], logps[keys.VALUES])
    before = {
        k: v.clone()
        for bucket in call("weight_buckets", dtype=torch.float32, bucket_bytes=1)
        for k, v in bucket.items()
    }
    metrics = call("train", compute(td, advantage_config(cfg)), per_step_rows=8)
    assert metrics["num_steps"] == 1 and metrics["grad_norm"] > 0
    # --reset-optimizer-states: the moments are gone (and training goes on); --ref-update-interval: the reference
    # becomes the actor.
    assert trainer.optimizer.state
    call("reset_optimizer")
    assert not trainer.optimizer.state
    moved = trainer.compute_log_probs(td)
    assert not torch.equal(moved[keys.OLD_LOG_PROBS], moved[keys.REF_LOG_PROBS])
    call("update_reference")
    synced = trainer.compute_log_probs(td)
    torch.testing.assert_close(synced[keys.REF_LOG_PROBS], synced[keys.OLD_LOG_PROBS], rtol=0, atol=0)
    assert call("sft_train", td)["sft_loss"] > 0
    # Buckets: HF names, the asked dtype, tied weights once, each within the size unless one tensor is bigger.
    buckets = list(call("weight_buckets", dtype=torch.bfloat16, bucket_bytes=8192))
    names = [k for b in buckets for k in b]
    assert len(names) == len(set(names)) and "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert all(v.dtype == torch.bfloat16 and v.device.type == "cpu" for b in buckets for v in b.values())
    assert all(sum(v.nbytes for v in b.values()) <= 8192 or len(b) == 1 for b in buckets)
    assert set(names) == set(before) and any(
        not torch.equal(before[k].bfloat16(), v) for b in buckets for k, v in b.items()
    )
    call("save", str(tmp_path / "no_optim"), with_optimizer=False)  # --no-save-optim
    saved = dcp.FileSystemReader(str(tmp_path / "no_optim")).read_metadata().state_dict_metadata
    assert saved and not [key for key in saved if key.startswith("optim")]
    trainer.load(str(tmp_path / "no_optim"))  # the model's weights, the optimizer as it was
    call("save", str(tmp_path / "ckpt"))
    state = call("get_rng_state")
    draw = torch.rand(3)
    call("set_rng_state", state)
    assert torch.equal(torch.rand(3), draw)
    trained = trainer.get_weights()
    call("load", str(tmp_path / "ckpt"))
    call("save_hf", str(tmp_path / "hf"))
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert all(torch.equal(saved[k], v) for k, v in trained.items())
    call("release_memory")
    with pytest.raises(RuntimeError, match="resume_memory"):
        trainer.compute_log_probs(td)
    call("resume_memory")
    call("shutdown")
    # --keep-old-actor: the old log-probs come from the old actor's copy, which each sync moves one step on.
    keeper = cls(
        model_path,
        train_cfg=dataclasses.replace(cfg.train, keep_old_actor=True),
        loss_cfg=loss_config(cfg),
        temperature=1.0,
        seed=0,
    )
    trainer = keeper
    start = keeper.compute_log_probs(td)[keys.OLD_LOG_PROBS]
    keeper.train(compute(td, advantage_config(cfg)), per_step_rows=8)
    if backend != "torch":  # (--keep-old-actor is the torch backend's; validation refuses the flag elsewhere)
        with pytest.raises(RuntimeError):
            call("advance_old_actor")
    else:
        call("advance_old_actor")  # old <- the engines' weights (the start), engines' <- the trained ones
        assert torch.equal(keeper.compute_log_probs(td)[keys.OLD_LOG_PROBS], start)
        keeper.advance_old_actor()
        assert not torch.equal(keeper.compute_log_probs(td)[keys.OLD_LOG_PROBS], start)
    keeper.shutdown()
    assert called == _protocol_methods(TrainBackend)


# ---------------------------------------------------------------- WeightSync conformance


SYNC_KINDS = [k for k in WEIGHT_SYNCS if k != "lora_adapter"]


@pytest.fixture(scope="class")
def sync_rig(ray_session, model_path, tmp_path_factory):
    """One trainer group and one engine group for every sync kind's test: each builds its own sync over them, trains,
    pushes, kills an engine and sees it rejoin. Their start-up (two actor processes loading the model) is paid once
    instead of per kind: the four took 169 s against 210 s with a rig each, back to back on a loaded 2-core machine.
    Class-scoped, so that its placement group is gone before the module's next Ray test asks for the CPUs."""
    cfg = validate(from_dict(None, output_dir=str(tmp_path_factory.mktemp("sync")), **SMALL))
    placement = create_placement(cfg)
    trainers = TrainerGroup(
        placement,
        backend="torch",
        model_path=model_path,
        roles=model_roles(cfg),
        train_cfg=cfg.train,
        loss_cfg=loss_config(cfg),
        temperature=1.0,
        seed=0,
    )
    engines = EngineGroup(cfg, placement, model_path)
    try:
        yield cfg, trainers, engines
    finally:
        trainers.shutdown()
        engines.shutdown()
        ray.util.remove_placement_group(placement.group)


class TestWeightSyncs:
    """The WeightSync kinds over one rig (``sync_rig``)."""

    # (lora_adapter moves adapters into SGLang engines: its conformance test is in tests/test_sglang_lora.py.)
    @pytest.mark.parametrize("kind", SYNC_KINDS)
    def test_every_weight_sync_moves_the_trained_weights_into_the_engines(self, kind, sync_rig, model_path):
        cfg, trainers, engines = sync_rig
        engines.pop_metrics()  # (a kind before this one may have left its counts)
        # Versions rise from kind to kind over the shared groups, as they do over a job's steps.
        base = 10 * SYNC_KINDS.index(kind)
        sync = make_weight_sync(trainers, engines, bucket_bytes=4096, kind=kind)
        try:
            assert isinstance(sync, WeightSync) and _protocol_methods(WeightSync) == {"push", "rejoin", "close"}
            adv_cfg = advantage_config(cfg)
            trainers.train_rollout(
                sequence_advantages(_batch(model_path), adv_cfg), global_batch_size=8, adv_cfg=adv_cfg
            )
            weights = trainers.get_weights()
            assert any(not torch.equal(v, engines.get_weights()[k]) for k, v in weights.items())
            sync.push(base + 5)
            assert engines.weight_versions() == [base + 5]
            got = engines.get_weights()
            for name, value in weights.items():
                assert torch.equal(got[name], value), name
            # A killed engine is restarted by the next group call and rejoins with the trainers' weights and version.
            kill_and_wait_gone(engines.actors[0])
            trainers.version = base + 7
            assert engines.weight_versions() == [base + 7]
            got = engines.get_weights()
            assert all(torch.equal(got[name], value) for name, value in weights.items())
            assert engines.pop_metrics() == {"engines/restarts": 1, "engines/redispatched_requests": 0}
        finally:
            sync.close()


# ---------------------------------------------------------------- one trip per step


def test_each_batch_goes_to_the_trainers_once(ray_session, tmp_path, monkeypatch):
    puts = []
    real_put = ray.put

    def counting_put(value, *args, **kwargs):
        puts.append(type(value).__name__)
        return real_put(value, *args, **kwargs)

    monkeypatch.setattr(ray, "put", counting_put)
    cfg = validate(from_dict(None, output_dir=str(tmp_path), num_rollout=3, **SMALL))
    run(cfg, progress=False)
    # The driver puts each rollout batch once (the trainers' ranks all read that one ref), and nothing else of
    # the batch crosses: weights go trainer -> engine without the driver.
    assert puts.count(TensorDict.__name__) == 3 and len(puts) == 3


# ---------------------------------------------------------------- lossless resume after SIGKILL


def _prompt_file(tmp_path, n=6):
    path = tmp_path / "prompts.jsonl"
    with open(path, "w") as fh:
        for rec in task.make_records(n, seed=11):
            fh.write(json.dumps({"prompt": rec["prompt"], "label": rec["label"]}) + "\n")
    return path


def _job(tmp_path, name, prompts, schedule, extra=()):
    return [
        sys.executable, "-m", "runtime.cli", "--prompt-data", str(prompts), "--rm-type", "exact_match",
        "--rollout-max-response-len", "4", "--num-rollout", "6", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--micro-batch-size", "2", "--lr", "1e-3",
        "--no-use-tensorboard", "--rollout-schedule", schedule, "--output-dir", str(tmp_path / name),
        "--input-key", "prompt", "--label-key", "label", "--actor-num-gpus-per-node", "1", *extra,
    ]  # fmt: skip


def _trained(folder):
    rows = read_metrics(folder / LEDGER_FILE)
    return [i for row in rows for i in row["trained"]], [row["step"] for row in rows]


# One schedule in the default suite (fully_async: the most in flight at the kill, groups of a later version and
# partial ones); sync and one_step drive the same ledger and resume, at 90 s each on a 2-core machine:
# `pytest -m slow tests/test_runtime_seams.py` runs them.
_SLOW_SCHEDULE = pytest.mark.slow(reason="same kill-and-resume mechanism as fully_async; 90 s each")


@pytest.mark.parametrize(
    "schedule",
    [pytest.param("sync", marks=_SLOW_SCHEDULE), pytest.param("one_step", marks=_SLOW_SCHEDULE), "fully_async"],
)
def test_sigkill_mid_step_then_load_trains_every_prompt_exactly_as_the_uninterrupted_run(
    schedule, ray_session, tmp_path
):
    prompts = _prompt_file(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    # The uninterrupted run beside the one to be killed (each a job of its own: its own Ray, output folder and data
    # position): on two cores the pair takes less wall time than one after the other.
    whole_log = tmp_path / "whole.stderr"
    with open(whole_log, "w") as log:
        whole = subprocess.Popen(_job(tmp_path, "whole", prompts, schedule), env=env, stdout=log, stderr=log)
    try:
        ckpt = tmp_path / "ckpt"
        cmd = _job(tmp_path, "killed", prompts, schedule, ["--save", str(ckpt), "--save-interval", "2"])
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        ledger = tmp_path / "killed" / LEDGER_FILE
        deadline = time.time() + 240
        # Killed once step 2 (the first epoch's last) is trained: the checkpoint step_000002 (2 done) is written,
        # step 3 (the second epoch's first) runs, and in the async schedules later groups are in flight; the resume
        # redoes step 2 and crosses into the second epoch. (Was 9 steps killed after 5: about 6 more steps over the
        # three jobs for the same crossings.)
        while time.time() < deadline and proc.poll() is None:
            if ledger.exists() and len(ledger.read_text().splitlines()) >= 3:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert (ckpt / "latest").read_text().strip() in ("step_000002", "step_000004")
        assert whole.wait(timeout=600) == 0, whole_log.read_text()[-2000:]
    finally:
        if whole.poll() is None:
            whole.kill()
            whole.wait()
    expected, steps = _trained(tmp_path / "whole")
    assert steps == list(range(6)) and len(expected) == 12  # 2 epochs of 6 prompts, 3 steps each
    # The resume in this process, on the module's Ray (a third ``python -m runtime.cli`` paid its own Python and Ray
    # start; the kill needs a process of its own, the resume does not).
    resume = _job(tmp_path, "killed", prompts, schedule, ["--save", str(ckpt), "--load", str(ckpt)])
    assert resume[1:3] == ["-m", "runtime.cli"]
    assert main(resume[3:]) == 0
    got, steps = _trained(tmp_path / "killed")
    assert steps == list(range(6))
    assert got == expected
