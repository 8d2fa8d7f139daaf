"""One job across two Ray nodes, on this machine: ``ray start --head`` on 127.0.0.2 and ``ray start --address`` on
127.0.0.3 (each with its own CPUs), ``rlcore-run`` joining through ``RAY_ADDRESS`` with ``--actor-num-nodes 2``.

The trainer ranks land one on each node and meet at rank 0's node; the weights reach the engine over a gloo group
that spans the nodes (``--update-weight-transport nccl``, gloo on the CPU); a checkpoint saved by both ranks resumes.
Ray's cluster mode (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1``, which several nodes need) replaces 127.0.0.1 by the
machine's routable IP, but not 127.0.0.2 or 127.0.0.3, which are loopback addresses as well: every node address stays
on the loopback interface, the cluster takes a token of its own, and every port is picked free (other tests run Ray
beside this one). The cluster is torn down in the fixture's finalizer, by the ids of the processes it started.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

HEAD, WORKER = "127.0.0.2", "127.0.0.3"
RAY = str(Path(sys.executable).parent / "ray")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _node_ports(host: str) -> list[str]:
    # Every port a node would otherwise take at a fixed default, picked free.
    flags = ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--metrics-export-port")
    return [arg for flag in (*flags, "--runtime-env-agent-port") for arg in (flag, str(_free_port(host)))]


def _wait_for(check, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(1)
    raise TimeoutError(f"{what} within {timeout:g} s")


def _listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((host, port)) == 0


def _alive_nodes(env: dict[str, str]) -> int:
    probe = "import ray; ray.init(log_to_driver=False); print(sum(n['Alive'] for n in ray.nodes()))"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else 0


def _stop(procs: list[subprocess.Popen], temp_dir: str) -> None:
    """End the nodes: each ``ray start --block`` (its own session) and its process group, then any Ray process left
    that belongs to this cluster (its temp dir on the command line), each by its id."""
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
    # A node that has not stopped within a second is killed: the cluster is thrown away, and waiting out Ray's own
    # graceful stop took 30 s of the suite's time (5 s of grace still cost 5 s: the nodes never stop sooner).
    deadline = time.monotonic() + 1
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    for p in psutil.process_iter(["cmdline"]):
        if any(temp_dir in part for part in p.info["cmdline"] or []):
            try:
                p.kill()
            except psutil.Error:
                pass
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """The environment a process joins the two-node cluster with (``RAY_ADDRESS``, the token)."""
    logs = tmp_path_factory.mktemp("ray-nodes")
    token = secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])
    # Short: Ray's unix sockets live under it.
    temp_dir = tempfile.mkdtemp(prefix="r2n", dir="/tmp")
    port = _free_port(HEAD)
    common = ["--num-cpus", "2", "--num-gpus", "0", "--disable-usage-stats", "--block", "--temp-dir", temp_dir]
    head_cmd = [RAY, "start", "--head", "--node-ip-address", HEAD, "--port", str(port), "--include-dashboard", "false",
                "--ray-client-server-port", str(_free_port(HEAD)), *_node_ports(HEAD), *common]  # fmt: skip
    worker_cmd = [RAY, "start", "--address", f"{HEAD}:{port}", "--node-ip-address", WORKER, *_node_ports(WORKER),
                  *common]  # fmt: skip
    procs: list[subprocess.Popen] = []
    try:
        with open(logs / "head.log", "w") as log:
            procs.append(
                subprocess.Popen(head_cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )
        _wait_for(lambda: _listening(HEAD, port), "the head node's GCS to listen")
        with open(logs / "worker.log", "w") as log:
            procs.append(
                subprocess.Popen(worker_cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )
        env["RAY_ADDRESS"] = f"{HEAD}:{port}"
        _wait_for(lambda: _alive_nodes(env) == 2, "two live Ray nodes")
        yield env
    finally:
        _stop(procs, temp_dir)


def _run(env, out: Path, ckpt: Path, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "runtime.cli", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "1",
           "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
           "--micro-batch-size", "8", "--update-weight-transport", "nccl", "--check-weight-update-equal",
           "--save", str(ckpt), "--output-dir", str(out), *flags]  # fmt: skip
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def test_a_job_spans_two_ray_nodes_and_resumes_there(two_nodes, tmp_path):
    # In the default suite (issue 26): one step, saved, then one resumed step; each run is mostly its start.
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    first = _run(two_nodes, out, ckpt, "--num-rollout", "1")
    placed = [line for line in first.stdout.splitlines() if "placement over 2 Ray nodes" in line]
    assert placed, first.stdout[-2000:]
    # One trainer rank on each node (the engine on either).
    trainers = placed[0].split("trainer ranks on ")[1].split("]")[0]
    assert HEAD in trainers and WORKER in trainers, placed[0]
    second = _run(two_nodes, out, ckpt, "--num-rollout", "2", "--load", str(ckpt))
    assert "placement over 2 Ray nodes" in second.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # Step 0 from the first run, step 1 from the resume: nothing repeated, nothing lost.
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert row["train/num_steps"] == 1 and row["train/grad_norm"] > 0
        # The engine's log-probs equal the trainers' recompute (both float32 on the CPU): the weights crossed whole.
        assert row["train/rollout_log_prob_abs_diff"] < 1e-4
    ledger = [json.loads(line) for line in (out / "rollout_ledger.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ledger] == [0, 1]
