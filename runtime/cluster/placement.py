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


def spread_over_nodes(
    bundle_nodes: Sequence[str], *, nodes: int, per_node: int, engines: int, shared: bool
) -> tuple[list[int], list[int]]:
    """``(trainer_bundles, engine_bundles)`` of a placement group whose bundle ``b`` Ray put on node
    ``bundle_nodes[b]``: ``per_node`` trainer ranks on each of ``nodes`` nodes (``--actor-num-nodes`` x
    ``--actor-num-gpus-per-node``, consecutive ranks on one node, as slime's and Megatron's rank layout has them; the
    nodes in the order of their first bundle), and ``engines`` engine bundles from the rest in bundle order
    (``shared``, under ``--colocate``: engine ``e`` shares trainer ``e``'s bundle). ``JobError`` when fewer than
    ``nodes`` nodes hold ``per_node`` bundles each."""
    by_node: dict[str, list[int]] = {}
    for bundle, node in enumerate(bundle_nodes):
        by_node.setdefault(node, []).append(bundle)
    roomy = [held for held in by_node.values() if len(held) >= per_node][:nodes]
    if len(roomy) < nodes:
        counts = {node: len(held) for node, held in by_node.items()}
        raise JobError(
            f"--actor-num-nodes {nodes} x --actor-num-gpus-per-node {per_node}: Ray placed the job's bundles on "
            f"{len(by_node)} node(s) with {counts} bundles each; {nodes} nodes of {per_node} free devices are needed"
        )
    trainers = [bundle for held in roomy for bundle in held[:per_node]]
    if shared:
        return trainers, trainers[:engines]
    rest = [b for b in range(len(bundle_nodes)) if b not in set(trainers)]
    return trainers, rest[:engines]


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
    res = cfg.resources
    # Trainers on several nodes: bundles spread over the nodes (then ranks are laid out node by node), else packed.
    several_nodes = res.actor_num_nodes > 1 and bool(plan.trainer_bundles)
    strategy = "SPREAD" if several_nodes else "PACK"
    group = placement_group([dict(bundle) for _ in range(plan.n_bundles)], strategy=strategy)
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
    trainer_bundles, engine_bundles = plan.trainer_bundles, plan.engine_bundles
    if several_nodes:
        nodes_of = bundle_nodes(group)
        trainer_bundles, engine_bundles = spread_over_nodes(
            nodes_of,
            nodes=res.actor_num_nodes,
            per_node=res.actor_num_gpus_per_node,
            engines=len(plan.engine_bundles),
            shared=plan.share < 1,
        )
        ips = node_ips()
        print(
            f"rlcore-run: placement over {len(set(nodes_of))} Ray nodes: trainer ranks on "
            f"{[ips.get(nodes_of[b], nodes_of[b]) for b in trainer_bundles]}, engines on "
            f"{[ips.get(nodes_of[b], nodes_of[b]) for b in engine_bundles]}",
            flush=True,
        )
    return Placement(group, use_gpu, trainer_bundles, engine_bundles, plan.share, threads)


def bundle_nodes(group: PlacementGroup) -> list[str]:
    """The Ray node id of each bundle of the ready placement ``group``, in bundle order."""
    by_bundle = ray.util.placement_group_table(group).get("bundles_to_node_id", {})
    return [by_bundle.get(b, "") for b in range(len(group.bundle_specs))]


def node_ips() -> dict[str, str]:
    """Each live Ray node's id -> its IP."""
    return {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes() if node.get("Alive")}


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
    # Nodes that all have loopback addresses (127.0.0.2, 127.0.0.3: several Ray nodes of one machine) reach each other.
    if is_loopback(address) and not all(is_loopback(node_ips[node]) for node in trainer_nodes):
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
    nodes_of = bundle_nodes(placement.group)
    address = rendezvous_address([nodes_of[b] for b in placement.trainer_bundles], node_ips())
    if address == LOOPBACK:
        return address, free_port()
    probe = ray.remote(num_cpus=0)(_port_on_this_node).options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement.group, placement_group_bundle_index=placement.trainer_bundles[0]
        )
    )
    return address, ray.get(probe.remote())
