"""SGLang servers that die mid-job, and weight syncs that lose an engine mid-broadcast, through the CLI and the real
Ray: the fake SGLang server (``tests/fake_sglang.py``) is launched as ``--sglang-server-command`` behind the real
SGLang router, and processes are killed by pid (``tools/fault_drill.py``'s ``kill_when``).

A killed server is met by the health monitor (``--rollout-health-check-interval``) or by a request the router gives
up on; the engine group launches it again through its launcher, loads the trainers' weights into it over the gloo
weight-update group, and adds it to the router again. The requests the router could not serve are sent again, so
every prompt of the data schedule is trained, exactly once.
"""

import os
import signal
import sys
from pathlib import Path

import httpx
import pytest

from runtime.cli import EXIT_JOB_STOPPED, main
from runtime.logger import METRICS_FILE, read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.fault_drill import kill_when, ledger_prompts  # noqa: E402

pytest.importorskip("sglang_router", reason="the router tests need the sglang-router package (the dev extra)")

FAKE_SERVER = f"{sys.executable} {Path(__file__).with_name('fake_sglang.py')}"
SMALL = [
    "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
    "--micro-batch-size", "4", "--rollout-max-response-len", "5", "--no-use-tensorboard",
    "--rollout-health-check-interval", "1", "--rollout-health-check-timeout", "30",
]  # fmt: skip
SGLANG = [
    "--rollout-engine", "sglang", "--sglang-server-command", FAKE_SERVER, "--sglang-server-startup-timeout", "120",
]  # fmt: skip
ROUTER_GENERATING = "ray::SGLangEngine.generate"


# ray_session (tests/conftest.py) starts Ray with these; shared with neighbouring modules that ask for the same.
RAY_RESOURCES = {"num_cpus": 4}


@pytest.fixture(scope="module")
def baseline(ray_session, tmp_path_factory):
    """The prompts an uninterrupted 3-step job trains, step by step (the data schedule does not depend on the
    engine, so the embedded one runs it, faster)."""
    out = tmp_path_factory.mktemp("baseline") / "out"
    assert main([*SMALL, "--num-rollout", "3", "--output-dir", str(out)]) == 0
    return ledger_prompts(out)


def _run_killing(args, out, title, *, after_steps, target=None, sig=signal.SIGKILL):
    thread, kill = kill_when(os.getpid(), title, out, after_steps=after_steps, timeout=600, target=target, sig=sig)
    status = main(args)
    thread.join(timeout=1)
    return status, kill


def _lines(capsys):
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return captured.out, [line for line in captured.err.splitlines() if line.startswith("rlcore-run:")]


# Slow, not in the default suite: the two-server case took 7 min 44 s on a shared 2-core AMD EPYC (2026-11-27:
# 111 s for the baseline job, 321 s for the killed-server job); the one-server case, the cheaper, 113 s under load
# (2026-11-27, branch ci4: 40 s for the baseline job, 74 s for the killed-server job), which `make test`'s 30-minute
# budget has no room for. The router's worker add/remove calls below stay in the default suite.
@pytest.mark.slow
@pytest.mark.parametrize("servers", [2, 1], ids=["two-servers", "one-server"])
def test_a_server_killed_mid_rollout_is_relaunched_and_no_sample_is_lost(baseline, tmp_path, capsys, servers):
    out = tmp_path / "out"
    args = [*SMALL, *SGLANG, "--num-rollout", "3", "--rollout-num-gpus", str(servers), "--output-dir", str(out)]
    status, kill = _run_killing(args, out, ROUTER_GENERATING, after_steps=1, target="fake_sglang.py")
    assert kill.pid is not None and "fake_sglang.py" in kill.cmdline
    stdout, err = _lines(capsys)
    assert status == 0 and err == [], err
    assert "restarted (server http://" in stdout
    rows = read_metrics(out / METRICS_FILE)
    assert [r["step"] for r in rows] == [0, 1, 2]
    # One relaunch. The server is killed while the router's client is titled as generating, so a request may be in
    # flight or the last one just answered; the first path to meet the death reports it. Met by a failed request
    # (with one server the router had nowhere to send it, so it was sent again once the server was back; with two
    # the router itself retries on the live one): at least that request re-dispatched under one server. Met by the
    # health monitor or the next group call (the weight sync) after the last answer: nothing was in flight, so
    # nothing to re-dispatch is a legal outcome too (a request in flight then is re-dispatched without a line).
    assert sum(r["engines/restarts"] for r in rows) == 1
    redispatched = sum(r["engines/redispatched_requests"] for r in rows)
    (restart,) = [line for line in stdout.splitlines() if line.endswith("; restarting it")]
    met_by_request = "does not answer: the router failed a request" in restart
    assert redispatched >= (1 if servers == 1 and met_by_request else 0), restart
    assert ledger_prompts(out) == baseline
    assert all(r["reward/num_scored"] == 16 and r["rollout/groups_aborted"] == 0 for r in rows)
    # The servers sample with the trainer's weights after the relaunch too (the gloo group formed again).
    assert all(r["train/rollout_log_prob_abs_diff"] < 1e-4 for r in rows)


@pytest.mark.slow
def test_without_fault_tolerance_a_dead_server_stops_the_job_in_one_line(ray_session, tmp_path, capsys):
    out = tmp_path / "out"
    args = [*SMALL, *SGLANG, "--num-rollout", "3", "--rollout-num-gpus", "1", "--no-use-fault-tolerance",
            "--output-dir", str(out)]  # fmt: skip
    status, kill = _run_killing(args, out, ROUTER_GENERATING, after_steps=1, target="fake_sglang.py")
    assert kill.pid is not None and status == EXIT_JOB_STOPPED
    _, err = _lines(capsys)
    assert len(err) == 1, err
    assert err[0].startswith("rlcore-run: rollout engine 0 (SGLangEngine) ") and "does not answer" in err[0]
    assert err[0].endswith(
        ": the job stops (--use-fault-tolerance restarts dead engines and re-dispatches their requests)"
    )


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", "hung"])
def test_an_engine_lost_mid_broadcast_aborts_the_group_at_once_and_rejoins(baseline, tmp_path, capsys, how):
    # The embedded engines over the gloo weight-update group (--update-weight-transport nccl), small buckets so that
    # the broadcast takes many calls. Killed: gloo fails the broadcast at once. Hung (SIGSTOP): the broadcast waits
    # on it until the health monitor's check times out and the engine is killed; the trainer then aborts the group
    # instead of waiting for its timeout (600 s).
    out = tmp_path / "out"
    args = [
        *SMALL[:-2], "--rollout-health-check-timeout", "3", "--num-rollout", "3", "--rollout-num-gpus", "2",
        "--update-weight-transport", "nccl", "--update-weight-buffer-size", "4096", "--output-dir", str(out),
    ]  # fmt: skip
    sig = signal.SIGKILL if how == "killed" else signal.SIGSTOP
    status, kill = _run_killing(args, out, "ray::HFEngine.update_weights_from_distributed", after_steps=1, sig=sig)
    assert kill.pid is not None
    stdout, err = _lines(capsys)
    assert status == 0 and err == [], err
    rows = read_metrics(out / METRICS_FILE)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert sum(r["engines/restarts"] for r in rows) == 1
    assert ledger_prompts(out) == baseline
    # Every engine samples with the trainer's weights after the group is formed again.
    assert all(r["train/rollout_log_prob_abs_diff"] < 1e-4 for r in rows)
    synced = [r for r in rows if r["engines/restarts"]][0]
    # Far below the group's 600 s timeout: the health check's 3 s plus a restart.
    assert synced["perf/weight_sync_time"] < 120, synced["perf/weight_sync_time"]


def test_router_worker_helpers_add_and_remove_a_server(ray_session, tmp_path):
    """``launcher.remove_router_worker`` / ``add_router_workers`` / ``server_alive`` against the real router."""
    from runtime.demo import task
    from runtime.demo.tiny_model import make_tiny_model
    from runtime.engines import launcher

    model = str(make_tiny_model(tmp_path / "tiny", alphabet=task.ALPHABET, seed=0))
    server, router = launcher.ProcessLauncher(), launcher.ProcessLauncher()
    try:
        argv = launcher.server_argv(FAKE_SERVER, model_path=model, host="{host}", port="{port}", tp_size=1, seed=0)
        url = server.start(argv, health_path="/health_generate", timeout=120)
        assert launcher.server_alive(url, timeout=5)
        router_url = router.start(
            launcher.router_argv([url], host="{host}", port="{port}", request_timeout_secs=30),
            health_path="/health",
            timeout=60,
        )

        def urls():
            return [w["url"] for w in httpx.get(router_url + "/workers", timeout=10).json()["workers"]]

        assert urls() == [url]
        assert launcher.remove_router_worker(router_url, url)
        _eventually(lambda: urls() == [])
        assert not launcher.remove_router_worker(router_url, url)  # not there any more
        launcher.add_router_workers(router_url, [url])
        _eventually(lambda: urls() == [url])
        server.stop()
        assert not launcher.server_alive(url, timeout=5)
    finally:
        server.stop()
        router.stop()


def _eventually(condition, timeout=30.0):
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)


def _external_server(model: str, port: int):
    import subprocess

    from runtime.engines import launcher

    argv = launcher.server_argv(FAKE_SERVER, model_path=model, host="127.0.0.1", port=port, tp_size=1, seed=0)
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    _eventually(lambda: launcher.server_alive(url, timeout=5), timeout=120)
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("comes_back", [True, False], ids=["comes-back", "stays-dead"])
def test_an_external_server_that_dies_is_readded_when_it_answers_or_the_job_stops(
    baseline, tmp_path, capsys, comes_back
):
    # An external server (--rollout-external-engine-addrs) is not ours to relaunch: it leaves the router while dead and
    # joins again (with the trainers' weights) once it answers; one that stays dead stops the job with one line after
    # --sglang-server-startup-timeout.
    import threading
    import time

    from runtime.demo import task
    from runtime.demo.tiny_model import make_tiny_model
    from runtime.engines import launcher

    model = str(make_tiny_model(tmp_path / "tiny", alphabet=task.ALPHABET, seed=0))
    ports = [launcher.free_port(), launcher.free_port()]
    procs = [_external_server(model, p) for p in ports]
    out = tmp_path / "out"
    addrs = ",".join(f"127.0.0.1:{p}" for p in ports)
    args = [
        # The built-in job: the servers hold a model of its architecture; its weights come with the first sync.
        *SMALL, "--rollout-engine", "sglang", "--rollout-external-engine-addrs", addrs, "--num-rollout", "3",
        "--sglang-server-startup-timeout", "60" if comes_back else "5", "--output-dir", str(out),
    ]  # fmt: skip
    thread, kill = kill_when(
        os.getpid(), ROUTER_GENERATING, out, after_steps=1, timeout=600, target=f"--port {ports[1]} "
    )

    def bring_back():
        # Back 3 s after the kill: the health monitor (a check every second) or a failed request meets the death
        # first, which is the path this test is about. A server back before anything met its death is caught by the
        # health check's weight-version comparison instead (test_sglang_fleet's restarted-between-steps test).
        while kill.at is None:
            time.sleep(0.1)
        time.sleep(3)
        procs.append(_external_server(model, ports[1]))

    if comes_back:
        threading.Thread(target=bring_back, daemon=True).start()
    try:
        status = main(args)
    finally:
        thread.join(timeout=1)
        for p in procs:
            p.kill()
    assert kill.pid is not None
    stdout, err = _lines(capsys)
    if comes_back:
        assert status == 0 and err == [], err
        rows = read_metrics(out / METRICS_FILE)
        assert [r["step"] for r in rows] == [0, 1, 2]
        assert sum(r["engines/restarts"] for r in rows) == 1
        assert all(r["reward/num_scored"] == 16 for r in rows)
        assert all(r["train/rollout_log_prob_abs_diff"] < 1e-4 for r in rows)
    else:
        assert status == EXIT_JOB_STOPPED and len(err) == 1, err
        assert err[0] == (
            f"rlcore-run: rollout engine 1's server http://127.0.0.1:{ports[1]} (--rollout-external-engine-addrs) did "
            "not answer again within --sglang-server-startup-timeout 5 s: the job stops"
        )
