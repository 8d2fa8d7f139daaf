"""A single-node job listens on 127.0.0.1 only: Ray's servers and agents, and the trainers' torch rendezvous.

- Ray 2.60 binds its gRPC servers, agents and metrics pages to the node's IP, most of them on every interface, and
  ``ray.init(_node_ip_address="127.0.0.1")`` does not help: Ray replaces a loopback address by the machine's
  routable one. What it does honour is its own single-machine mode (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, the
  default on Windows and macOS): the node's IP is then 127.0.0.1 and every Ray listener binds there.
  :func:`confine_ray` turns it on for a Ray this process starts, unless the environment sets it.
- torch's ``TCPStore`` (the ``init_process_group`` rendezvous) listens on every interface whatever host it is given;
  :func:`rendezvous_store` hands rank 0's store a socket bound to 127.0.0.1 instead, and :func:`confine_collectives`
  binds gloo's and NCCL's own sockets to the loopback interface.
- A job that joins a Ray cluster (``RAY_ADDRESS``, nodes started with ``ray start``) listens where that cluster
  does; trainer ranks on several nodes meet at rank 0's node IP (``runtime.cluster.placement.rendezvous_address``).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from typing import Any

RAY_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# Set (Ray's own variable): rlcore-run joins that Ray cluster instead of starting a confined one-node Ray.
RAY_ADDRESS_ENV = "RAY_ADDRESS"
LOOPBACK = "127.0.0.1"


def is_loopback(address: str) -> bool:
    """Whether a listening address is on the loopback interface (``127.0.0.0/8``, ``::1``, ``::ffff:127.x``)."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def confine_ray() -> bool:
    """Before ``ray.init`` starts a local Ray: make every Ray process listen on 127.0.0.1 (see the module docstring).

    Returns whether Ray is confined: False when the environment sets ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` to
    anything but ``0`` (the user asked for Ray's cluster mode).
    """
    from ray._private import ray_constants

    if os.environ.setdefault(RAY_CLUSTER_ENV, "0") != "0":
        return False
    # Ray read the variable when it was imported; the processes it starts read it from the environment.
    ray_constants.ENABLE_RAY_CLUSTER = False
    return True


def loopback_interface() -> str | None:
    """The name of the network interface holding 127.0.0.1 (``lo`` on Linux), None if there is none."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == LOOPBACK for a in addresses):
            return name
    return None


def confine_collectives() -> None:
    """Bind gloo's and NCCL's sockets to the loopback interface (unless the environment names interfaces)."""
    interface = loopback_interface()
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)


def rendezvous_store(port: int, *, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    """The ``TCPStore`` of a single-node process group at 127.0.0.1:``port``: rank 0 serves it on a socket bound to
    127.0.0.1 (torch's own listener would bind every interface), the other ranks connect to it."""
    import torch.distributed as dist

    if rank != 0:
        return dist.TCPStore(LOOPBACK, port, world_size, False, timeout=timeout)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((LOOPBACK, port))
    listener.listen()
    return dist.TCPStore(LOOPBACK, port, world_size, True, timeout=timeout, master_listen_fd=listener.detach())
