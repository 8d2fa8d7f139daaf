"""Engines and trainers that die mid-job, through the CLI and the real Ray: processes are killed by pid (SIGKILL).

The jobs run in-process (``runtime.cli.main``) on one Ray session for the module, so the processes to kill are this
process's descendants, found by their Ray process title (``tools/fault_drill.py``: ``ray::HFEngine.generate`` is an
engine while it generates, ``ray::TrainerWorker.train_rollout`` a trainer while it trains).
"""

import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest
import ray

from runtime.cli import EXIT_JOB_STOPPED, main
from runtime.cluster.health import HealthMonitor
from runtime.logger import METRICS_FILE, read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.fault_drill import kill_when, ledger_prompts  # noqa: E402

# The built-in job, small: 4 prompts x 4 samples a step, responses of up to 5 tokens; health checks every second.
SMALL = [
    "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
    "--micro-batch-size", "4", "--rollout-max-response-len", "5", "--no-use-tensorboard",
    "--rollout-health-check-interval", "1", "--rollout-health-check-timeout", "10",
]  # fmt: skip
ENGINE_GENERATING = "ray::HFEngine.generate"
TRAINER_TRAINING = "ray::TrainerWorker.train_rollout"
# Metrics that differ between two runs of the same steps for reasons other than the math: wall-clock times.
TIMING = ("perf/", "reward/time")


# ray_session (tests/conftest.py) starts Ray with these; shared with neighbouring modules that ask for the same.
RAY_RESOURCES = {"num_cpus": 4}


@pytest.fixture(scope="module")
def baseline(ray_session, tmp_path_factory):
    """An uninterrupted 4-step job: the prompts it trains, step by step."""
    out = tmp_path_factory.mktemp("baseline") / "out"
    assert main([*SMALL, "--num-rollout", "4", "--output-dir", str(out)]) == 0
    return ledger_prompts(out)


# How a killed engine's death can be met first (its "restarting it" line), and what each path re-dispatches.
MET_BY = {
    # the generate call in flight fails: its requests (up to the step's 16) are sent again
    "generate": r"rlcore-run: rollout engine \d+ died during generate \(ActorDiedError.*",
    # the health monitor's check, with the call in flight (it then fails and re-dispatches, silently: the engine is
    # restarting already) or just returned (nothing to re-dispatch). Seen in CI at f5deb1c.
    "health check": r"rlcore-run: rollout engine \d+ the health check failed \(ActorDiedError.*",
    # the next group call (the weight sync), after the rollout: no generate call is in flight. Seen once at 238e3ba.
    "group call": r"rlcore-run: rollout engine \d+ died \(ActorDiedError.*\) during \w+; restarting it",
}
REDISPATCHED = {"generate": (1, 16), "health check": (0, 16), "group call": (0, 0)}


def _run_killing(args, out, title, *, after_steps):
    thread, kill = kill_when(os.getpid(), title, out, after_steps=after_steps, timeout=300)
    status = main(args)
    thread.join(timeout=1)
    return status, kill


def _stderr_lines(capsys):
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return captured.out, [line for line in captured.err.splitlines() if line.startswith("rlcore-run:")]


# Two engines repeat the one-engine drill with a survivor beside the restart (under a minute, slow-marked to keep
# `make test` under 30 minutes; `make test-slow` runs it).
@pytest.mark.parametrize("engines", [pytest.param(2, marks=pytest.mark.slow), 1], ids=["two-engines", "one-engine"])
def test_an_engine_killed_mid_rollout_is_restarted_and_no_sample_is_lost(baseline, tmp_path, capsys, engines):
    out = tmp_path / "out"
    args = [*SMALL, "--num-rollout", "4", "--rollout-num-gpus", str(engines), "--output-dir", str(out)]
    status, kill = _run_killing(args, out, ENGINE_GENERATING, after_steps=1)
    assert kill.pid is not None and status == 0
    stdout, err = _stderr_lines(capsys)
    assert err == []
    # The engine is killed while its process is titled as generating, so the call may be in flight or just returned;
    # the first path to meet the death reports it (the engine index: two engines may lose either), the others find it
    # restarting and say nothing. Each path's own outcome:
    (restart,) = [line for line in stdout.splitlines() if line.endswith("; restarting it")]
    met = next((path for path, pattern in MET_BY.items() if re.fullmatch(pattern, restart)), None)
    assert met is not None, restart
    assert "restarted" in stdout
    rows = read_metrics(out / METRICS_FILE)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    # Exactly one restart, in the step that was rolling out when the engine was killed or a later one (met after the
    # call returned); the killed engine's requests went elsewhere (two engines: to the live one; one engine: to
    # itself, restarted).
    assert sum(r["engines/restarts"] for r in rows) == 1
    hit = next(r for r in rows if r["engines/restarts"])
    assert hit["step"] >= kill.steps_before
    redispatched = hit["engines/redispatched_requests"]
    low, high = REDISPATCHED[met]
    assert low <= redispatched <= high, (met, redispatched, restart)
    assert sum(r["engines/redispatched_requests"] for r in rows) == redispatched
    # Every prompt of the data schedule trained exactly once, as in the uninterrupted run; every step full.
    assert ledger_prompts(out) == baseline
    assert all(r["reward/num_scored"] == 16 and r["rollout/groups_aborted"] == 0 for r in rows)


def test_without_fault_tolerance_a_dead_engine_stops_the_job_in_one_line(ray_session, tmp_path, capsys):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    args = [*SMALL, "--num-rollout", "4", "--no-use-fault-tolerance", "--output-dir", str(out), "--save", str(ckpt)]
    status, kill = _run_killing(args, out, ENGINE_GENERATING, after_steps=1)
    assert kill.pid is not None and status == EXIT_JOB_STOPPED
    stdout, err = _stderr_lines(capsys)
    assert len(err) == 1, err
    # Killed while it generated; its death is met by that call, or by the next group call (the weight sync).
    assert err[0].startswith("rlcore-run: rollout engine 0 (HFEngine) died ") and "(ActorDiedError: " in err[0]
    assert err[0].endswith(
        ": the job stops (--use-fault-tolerance restarts dead engines and re-dispatches their requests)"
    )
    # Met while generating, the last completed step is saved first, so the job resumes with --load (met in the weight
    # sync after a step trained, the trainers are ahead of the last completed step and nothing is saved).
    if " died during generate " in err[0]:
        done = len(read_metrics(out / METRICS_FILE))
        assert (ckpt / "latest").read_text() == f"step_{done:06d}"
        assert f"resume with --load {ckpt}" in stdout


def _comparable(row):
    return {k: v for k, v in row.items() if not k.startswith(TIMING)}


def test_a_trainer_killed_mid_step_is_rebuilt_from_the_checkpoint(ray_session, tmp_path, capsys):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    args = [*SMALL, "--num-rollout", "4", "--output-dir", str(out), "--save", str(ckpt), "--save-interval", "1"]
    status, kill = _run_killing(args, out, TRAINER_TRAINING, after_steps=2)
    assert kill.pid is not None and status == 0
    stdout, err = _stderr_lines(capsys)
    assert err == []
    (line,) = [x for x in stdout.splitlines() if "restart 1 of --max-trainer-restarts 2" in x]
    resumed_at = int(line.rsplit("(step ", 1)[1].rstrip(")"))
    assert line.startswith("rlcore-run: trainer rank 0 died (ActorDiedError: ")
    assert resumed_at >= kill.steps_before >= 2
    rows = read_metrics(out / METRICS_FILE)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]

    # A run resumed by hand from the same checkpoint logs the same metrics from the restored step on.
    by_hand = tmp_path / "by_hand"
    resume = [
        *SMALL,
        "--num-rollout",
        "4",
        "--output-dir",
        str(by_hand),
        "--load",
        str(ckpt / f"step_{resumed_at:06d}"),
    ]
    assert main(resume) == 0
    expected = [_comparable(r) for r in read_metrics(by_hand / METRICS_FILE)]
    assert [r["step"] for r in expected] == list(range(resumed_at, 4))
    assert [_comparable(r) for r in rows[resumed_at:]] == expected


def test_a_dead_trainer_without_save_or_restarts_left_stops_the_job(ray_session, tmp_path, capsys):
    out = tmp_path / "out"
    status, kill = _run_killing([*SMALL, "--num-rollout", "3", "--output-dir", str(out)], out, TRAINER_TRAINING,
                                after_steps=1)  # fmt: skip
    assert kill.pid is not None and status == EXIT_JOB_STOPPED
    _, err = _stderr_lines(capsys)
    assert len(err) == 1 and err[0].startswith("rlcore-run: trainer rank 0 died (ActorDiedError: ")
    assert err[0].endswith("the job stops (with --save, up to --max-trainer-restarts 2 restarts resume it)")

    out, ckpt = tmp_path / "out2", tmp_path / "ckpt"
    args = [*SMALL, "--num-rollout", "3", "--output-dir", str(out), "--save", str(ckpt), "--max-trainer-restarts", "0"]
    status, kill = _run_killing(args, out, TRAINER_TRAINING, after_steps=1)
    assert kill.pid is not None and status == EXIT_JOB_STOPPED
    _, err = _stderr_lines(capsys)
    assert len(err) == 1
    assert err[0].endswith(f"the job stops, --max-trainer-restarts 0 restarts used (resume with --load {ckpt})")


# ---------------------------------------------------------------- the health monitor, on actors of its own


@ray.remote
class _Engine:
    def __init__(self, answer):
        self.answer = answer

    def health(self):
        if self.answer == "hang":
            time.sleep(60)
        return self.answer


def test_the_health_monitor_reports_unhealthy_and_silent_engines_and_pauses(ray_session):
    actors = {0: _Engine.remote(True), 1: _Engine.remote(False), 2: _Engine.remote("hang")}
    ray.get([a.__ray_ready__.remote() for a in actors.values()])  # built (a health check waits behind it)
    reports = []
    done = threading.Event()

    def on_unhealthy(index, actor, reason):
        reports.append((index, reason))
        if len(reports) == 2:
            done.set()

    monitor = HealthMonitor(lambda: actors, on_unhealthy, interval=60, timeout=1, first_wait=0)
    try:
        time.sleep(0.5)
        assert monitor.checks == 0  # starts paused
        monitor.resume()
        assert done.wait(timeout=60)
        assert reports == [
            (1, "the health check answered unhealthy"),
            (2, "no answer to a health check in --rollout-health-check-timeout 1 s"),
        ]
        monitor.pause()
        checks = monitor.checks
        time.sleep(1.0)
        assert monitor.checks == checks
    finally:
        monitor.stop()
    # A check of a dead actor says why. ray.kill does not wait for the actor to die: a check sent before the kill has
    # landed can still be answered, so check until the actor is gone (at most 30 s).
    ray.kill(actors[0])
    deadline = time.monotonic() + 30
    while (reason := monitor.check(actors[0])) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert reason is not None and reason.startswith("the health check failed (ActorDiedError")


def test_ledger_prompts_reads_each_steps_last_row(tmp_path):
    rows = [{"step": 0, "trained": [3, 1]}, {"step": 1, "trained": [9]}, {"step": 1, "trained": [4, 2]}]
    (tmp_path / "rollout_ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert ledger_prompts(tmp_path) == [3, 1, 4, 2]


def _log_probs_under(model_dir, samples, temperature=1.0):
    """Each sample's response log-probs recomputed with the HF model in ``model_dir`` (float64 reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s["tokens"]])
            logits = model(ids).logits[0, :-1].double() / temperature
            lp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
            out.append(lp[-s["response_length"] :])
    return out


def test_async_an_engine_killed_mid_rollout_loses_nothing_and_versions_stay_honest(baseline, tmp_path, capsys):
    # --async (one_step): the next step's rollout runs while the trainers train, so the killed engine is restarted
    # and takes weights while they may be changing. Every sample's recorded weight version must be the weights that
    # sampled it: its log-probs are recomputed with that version's weights (the built-in model before training, then
    # the HF export of every step) and compared.
    import torch

    out, hf = tmp_path / "out", tmp_path / "hf"
    args = [
        *SMALL, "--num-rollout", "4", "--rollout-num-gpus", "2", "--async", "--output-dir", str(out),
        "--save-hf", str(hf / "v{rollout_id}"), "--save-interval", "1",
        "--save-debug-rollout-data", str(tmp_path / "rollout_{rollout_id}.pt"),
    ]  # fmt: skip
    status, kill = _run_killing(args, out, ENGINE_GENERATING, after_steps=1)
    assert kill.pid is not None and status == 0
    stdout, err = _stderr_lines(capsys)
    assert err == [] and "restarted" in stdout
    rows = read_metrics(out / METRICS_FILE)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert sum(r["engines/restarts"] for r in rows) == 1
    assert ledger_prompts(out) == baseline
    assert all(r["reward/num_scored"] == 16 for r in rows)
    # Version v's weights: the starting model for 0, the HF export after step v - 1 (--save-hf v{rollout_id}).
    by_version = {}
    for step in range(4):
        for s in torch.load(tmp_path / f"rollout_{step}.pt", weights_only=False)["samples"]:
            (version,) = {int(v) for v in s["weight_versions"]}
            assert step - 1 <= version <= step  # one_step: at most one step behind
            by_version.setdefault(version, []).append(s)
    assert len(by_version) >= 3
    for version, samples in by_version.items():
        folder = str(out / "base_model") if version == 0 else str(hf / f"v{version - 1}")  # the built-in model
        for s, expected in zip(samples, _log_probs_under(folder, samples), strict=True):
            got = torch.tensor(s["rollout_log_probs"], dtype=torch.float64)
            assert torch.allclose(got, expected, atol=2e-4), (version, (got - expected).abs().max())


def test_a_trainer_that_fails_to_start_is_reported_with_the_constructors_error():
    from runtime.cluster.trainers import TrainerDied

    err = RuntimeError(
        "The actor died because of an error raised in its creation task, ray::TrainerWorker.__init__() (pid=1)\n"
        "TypeError: MegatronTrainer.__init__() got an unexpected keyword argument 'x'\n"
    )
    assert str(TrainerDied(0, err)) == (
        "trainer rank 0 died (RuntimeError: its start failed: TypeError: MegatronTrainer.__init__() got an "
        "unexpected keyword argument 'x')"
    )
    assert str(TrainerDied(1, RuntimeError("killed\nmore"))) == "trainer rank 1 died (RuntimeError: killed)"
