"""Launching SGLang servers and the SGLang router: the command lines, and a Ray actor that owns one process.

:class:`ProcessLauncher` is the actor: placed in the job's placement group (a server's launcher on its engine's
first bundle), it starts one process with ``subprocess.Popen``, waits until an HTTP health route answers 200, and
stops the process when the job ends (:meth:`ProcessLauncher.stop`, or the actor's own death: the child is asked to
end with it through ``PR_SET_PDEATHSIG``). A server is ``--sglang-server-command`` (default ``python -m
sglang.launch_server``) plus the flags of :func:`server_argv`; tests launch their fake server through the same path
by pointing ``--sglang-server-command`` at it. The router is ``python -m sglang_router.launch_router`` plus
:func:`router_argv`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from runtime.engines import sglang_flags

_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_argv(
    command: str,
    *,
    model_path: str,
    host: str,
    port: int | str,
    tp_size: int,
    seed: int,
    server_args: Mapping[str, Any] | None = None,
) -> list[str]:
    """The command line of one SGLang server: ``command`` split as a shell would, the flags the launcher owns
    (:data:`runtime.engines.sglang_flags.SERVER_OWNED`), then the ``--sglang-*`` passthrough values."""
    server_args = dict(server_args or {})
    problems = sglang_flags.passthrough_problems("server", server_args)
    if problems:
        raise ValueError("; ".join(problems))
    return [
        *shlex.split(command),
        "--model-path", model_path,
        "--host", host,
        "--port", str(port),
        "--tp-size", str(tp_size),
        "--random-seed", str(seed),
        *sglang_flags.to_argv("server", server_args),
    ]  # fmt: skip


def router_argv(
    worker_urls: Sequence[str],
    *,
    host: str,
    port: int | str,
    request_timeout_secs: int,
    router_args: Mapping[str, Any] | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The command line of the SGLang router in front of ``worker_urls``: slime's default overrides
    (:data:`runtime.engines.sglang_flags.ROUTER_DEFAULT_OVERRIDES`) under the ``--router-*`` passthrough values."""
    router_args = {**sglang_flags.ROUTER_DEFAULT_OVERRIDES, **(router_args or {})}
    problems = sglang_flags.passthrough_problems("router", router_args)
    if problems:
        raise ValueError("; ".join(problems))
    return [
        python, "-m", "sglang_router.launch_router",
        "--host", host,
        "--port", str(port),
        "--worker-urls", *worker_urls,
        "--request-timeout-secs", str(request_timeout_secs),
        *sglang_flags.to_argv("router", router_args),
    ]  # fmt: skip


def _die_with_parent() -> None:
    # The child gets SIGTERM when the launcher's process dies (ray.kill included), so no server outlives its job.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def add_router_workers(router_url: str, worker_urls: Sequence[str], *, timeout: float = 30.0) -> None:
    """Register ``worker_urls`` with a running SGLang router (``POST /workers``, sglang-router 0.3.2)."""
    with httpx.Client(base_url=router_url, timeout=timeout) as client:
        for url in worker_urls:
            response = client.post("/workers", json={"url": url})
            if response.is_error:
                raise RuntimeError(
                    f"router {router_url} refused worker {url}: HTTP {response.status_code} {response.text}"
                )


def remove_router_worker(router_url: str, worker_url: str, *, timeout: float = 30.0) -> bool:
    """Take ``worker_url`` out of a running SGLang router (``GET /workers`` for its id, then ``DELETE
    /workers/{id}``, sglang-router 0.3.2; the router removes it in the background). False when it was not there."""
    with httpx.Client(base_url=router_url, timeout=timeout) as client:
        response = client.get("/workers")
        if response.is_error:
            raise RuntimeError(f"router {router_url} did not list its workers: HTTP {response.status_code}")
        ids = [w["id"] for w in response.json().get("workers", []) if w.get("url") == worker_url]
        for worker_id in ids:
            response = client.delete(f"/workers/{worker_id}")
            if response.is_error and response.status_code != 404:
                raise RuntimeError(
                    f"router {router_url} did not remove worker {worker_url}: HTTP {response.status_code} "
                    f"{response.text}"
                )
    return bool(ids)


def server_alive(url: str, *, timeout: float) -> bool:
    """Whether the SGLang server at ``url`` answers at all (``GET /model_info``: no generation, so a server whose
    memory is released answers too)."""
    try:
        return httpx.get(url.rstrip("/") + "/model_info", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def _node_address() -> str:
    """This node's address as other nodes reach it (Ray's view; loopback outside Ray)."""
    try:
        import ray

        return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    except ImportError:
        return "127.0.0.1"


class ProcessLauncher:
    """One server or router process (see the module docstring); ``env`` is added to the process's environment."""

    def __init__(self, *, env: Mapping[str, str] | None = None):
        self.env = {**os.environ, **(env or {})}
        self.argv: list[str] = []
        self.process: subprocess.Popen | None = None
        self.log = Path(tempfile.mkstemp(prefix="rlcore-launch-", suffix=".log")[1])

    def start(self, argv: Sequence[str], *, health_path: str, timeout: float) -> str:
        """Start ``argv`` and wait until ``health_path`` answers 200; returns the process's base URL.

        ``{host}`` and ``{port}`` in ``argv`` become this node's address and a free port on it. Raises
        ``RuntimeError`` (with the end of the process's output) if the process exits first, ``TimeoutError`` after
        ``timeout`` seconds (the process is stopped then).
        """
        if not argv:
            raise ValueError("argv must not be empty")
        host = _node_address()
        port = free_port(host)
        self.argv = [a.replace("{host}", host).replace("{port}", str(port)) for a in argv]
        url = f"http://{host}:{port}"
        self.health_url = url + health_path
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5.0) as client:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"{shlex.join(self.argv)} exited with status {self.process.returncode} before it was healthy; "
                        f"its output ends:\n{self.output_tail()}"
                    )
                with contextlib.suppress(httpx.TransportError):
                    if client.get(self.health_url).status_code == 200:
                        return url
                if time.monotonic() >= deadline:
                    self.stop()
                    raise TimeoutError(
                        f"{shlex.join(self.argv)} not healthy at {self.health_url} after {timeout:.0f}s; its output "
                        f"ends:\n{self.output_tail()}"
                    )
                time.sleep(0.2)

    def output_tail(self, n_bytes: int = 4000) -> str:
        data = self.log.read_bytes()
        return data[-n_bytes:].decode(errors="replace")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM to the process group, SIGKILL after ``grace`` seconds; idempotent."""
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
