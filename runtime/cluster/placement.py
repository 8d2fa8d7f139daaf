"""Ray placement: trainer and engine actors in one placement group, colocated or on separate devices.

A bundle is one device: ``{"GPU": 1, "CPU": 1}`` on a GPU cluster, ``{"CPU": 1}`` on a CPU-only machine (where
the ``*_num_gpus*`` flags count CPU slots). Trainer rank ``r`` takes bundle ``r``. Separate (the default), engine
``e`` takes bundle ``num_trainers + e``; with ``--colocate`` engine ``e`` shares bundle ``e`` with trainer ``e``,
each taking half of it, and the loop offloads one while the other works.

Which engines take bundles comes from the ``--rollout-engine`` registry entry (``runtime.engines.registry``), the one
source of truth that the engine group reads too. The groups of actors live in ``runtime.cluster.trainers`` and
``runtime.cluster.engines``.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from runtime.cluster.bundles import BundlePlan, plan_bundles  # noqa: F401 (re-exported: the plan is Ray-free)
from runtime.cluster.loopback import LOOPBACK, is_loopback
from runtime.config import Config, ConfigError
from runtime.errors import JobError

# No progress bars from actors (the console shows the loop's own), and idle OpenMP threads sleep instead of spinning:
# trainer and engine take turns on the same cores, and a spinning idle actor would slow the working one.
_ACTOR_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_WAIT_POLICY": "PASSIVE",
}


@dataclass
class Placement:
    group: PlacementGroup
    use_gpu: bool
    trainer_bundles: list[int]
    engine_bundles: list[int]
    share: float
    threads: int

    def options(self, bundle: int) -> dict[str, Any]:
        opts: dict[str, Any] = {
            "num_cpus": self.share,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=bundle),
            "runtime_env": {"env_vars": {**_ACTOR_ENV, "OMP_NUM_THREADS": str(self.threads)}},
        }
        if self.use_gpu:
            opts["num_gpus"] = self.share
        return opts


def create_placement(cfg: Config, *, timeout_s: float = 120.0) -> Placement:
    """Reserve the bundles of :func:`plan_bundles` (waits up to ``timeout_s`` for the cluster to have them)."""
    plan = plan_bundles(cfg)
    gpus = ray.cluster_resources().get("GPU", 0)
    use_gpu = gpus > 0
    hint = "lower --actor-num-gpus-per-node / --rollout-num-gpus, or add --colocate (trainer and engine take turns)"
    if use_gpu and gpus < plan.n_bundles:
        # Waiting cannot help a cluster that has fewer GPUs than the job asks for: say so at once.
        raise ConfigError(
            [
                f"the job needs {plan.n_bundles} GPUs ({len(plan.trainer_bundles)} for trainers, "
                f"{len(plan.engine_bundles)} for engines{', shared' if plan.share < 1 else ''}) and the Ray cluster "
                f"has {gpus:g}: {hint}"
            ]
        )
    bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
    group = placement_group([dict(bundle) for _ in range(plan.n_bundles)], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise JobError(
            f"Ray could not reserve {plan.n_bundles} bundles of {bundle} in {timeout_s:.0f}s (cluster has "
            f"{ray.cluster_resources()}): {hint}"
        )
    # Trainer and engines take turns (the loop is synchronous), so each may use every core of its share.
    cpus = int(ray.cluster_resources().get("CPU", 1))
    actors = max(len(plan.trainer_bundles), len(plan.engine_bundles), 1)
    threads = max(1, cpus // actors) if not use_gpu else 1
    return Placement(group, use_gpu, plan.trainer_bundles, plan.engine_bundles, plan.share, threads)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` of this machine now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rendezvous_address(trainer_nodes: Sequence[str], node_ips: Mapping[str, str]) -> str:
    """Where the trainer ranks' ``torch.distributed`` group meets: 127.0.0.1 when every trainer bundle lies on one
    node (the loopback rules, ``runtime.cluster.loopback``), else the IP of the node of rank 0's bundle.

    ``trainer_nodes`` are the Ray node ids of the trainer bundles in rank order, ``node_ips`` each node's IP.
    ``JobError`` when the ranks span nodes and rank 0's node has no address the others can reach."""
    if not trainer_nodes:
        raise ValueError("trainer_nodes is empty: a trainer group has at least one rank")
    if len(set(trainer_nodes)) == 1:
        return LOOPBACK
    missing = sorted(set(trainer_nodes) - set(node_ips))
    if missing:
        raise ValueError(f"no IP for the Ray nodes {missing} of the trainer bundles")
    address = node_ips[trainer_nodes[0]]
    if is_loopback(address):
        raise JobError(
            f"the trainer ranks span {len(set(trainer_nodes))} nodes, but rank 0's node has the loopback address "
            f"{address}: the other nodes cannot reach it (start the Ray cluster with each node's routable IP)"
        )
    return address


def _port_on_this_node() -> int:
    return free_port("0.0.0.0")


def trainer_rendezvous(placement: Placement) -> tuple[str, int]:
    """``(address, port)`` of the trainers' rendezvous: :func:`rendezvous_address` of the nodes Ray placed the
    trainer bundles on; on several nodes the port is picked free on rank 0's node (by a task in its bundle)."""
    table = ray.util.placement_group_table(placement.group)
    by_bundle = table.get("bundles_to_node_id", {})
    nodes = [by_bundle.get(bundle, "") for bundle in placement.trainer_bundles]
    ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes() if node.get("Alive")}
    address = rendezvous_address(nodes, ips)
    if address == LOOPBACK:
        return address, free_port()
    probe = ray.remote(num_cpus=0)(_port_on_this_node).options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement.group, placement_group_bundle_index=placement.trainer_bundles[0]
        )
    )
    return address, ray.get(probe.remote())
