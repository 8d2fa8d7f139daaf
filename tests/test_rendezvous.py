"""Where a trainer group's torch.distributed ranks meet: 127.0.0.1 on one node (the loopback rules), rank 0's node IP
when Ray placed the trainer bundles on several nodes."""

from __future__ import annotations

import pytest
import ray
from hypothesis import given
from hypothesis import strategies as st

from runtime.cluster.loopback import LOOPBACK
from runtime.cluster.placement import Placement, rendezvous_address, spread_over_nodes, trainer_rendezvous
from runtime.errors import JobError

IPS = {"node-a": "10.0.0.1", "node-b": "10.0.0.2", "node-c": "10.0.0.3"}


@given(nodes=st.lists(st.sampled_from(sorted(IPS)), min_size=1, max_size=8))
def test_one_node_meets_on_loopback_several_at_rank_zeros_node(nodes):
    got = rendezvous_address(nodes, IPS)
    if len(set(nodes)) == 1:
        assert got == LOOPBACK
    else:
        assert got == IPS[nodes[0]]


def test_a_spread_group_whose_rank_zero_node_is_loopback_is_refused():
    with pytest.raises(JobError, match="span 2 nodes, but rank 0's node has the loopback address 127.0.0.1"):
        rendezvous_address(["a", "b"], {"a": "127.0.0.1", "b": "10.0.0.2"})
    with pytest.raises(ValueError, match="no IP for the Ray nodes"):
        rendezvous_address(["a", "b"], {"a": "10.0.0.1"})
    with pytest.raises(ValueError, match="at least one rank"):
        rendezvous_address([], IPS)


def test_a_one_node_placement_meets_on_loopback_at_a_free_port(ray_session):
    import socket

    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="PACK")
    try:
        ray.get(group.ready())
        address, port = trainer_rendezvous(Placement(group, False, [0, 1], [], 1.0, 1))
        assert address == LOOPBACK
        with socket.socket() as s:
            s.bind((LOOPBACK, port))  # free
    finally:
        remove_placement_group(group)


def test_nodes_that_all_have_loopback_addresses_meet_at_rank_zeros():
    # Several Ray nodes of one machine (127.0.0.2, 127.0.0.3: tests/test_two_nodes.py) reach each other's loopback.
    assert rendezvous_address(["a", "b"], {"a": "127.0.0.2", "b": "127.0.0.3"}) == "127.0.0.2"


@given(
    bundle_nodes=st.lists(st.sampled_from("abc"), min_size=1, max_size=10),
    nodes=st.integers(1, 3),
    per_node=st.integers(1, 3),
    engines=st.integers(0, 4),
    shared=st.booleans(),
)
def test_trainers_spread_node_by_node(bundle_nodes, nodes, per_node, engines, shared):
    counts = {n: bundle_nodes.count(n) for n in set(bundle_nodes)}
    if sum(c >= per_node for c in counts.values()) < nodes:
        with pytest.raises(JobError, match=f"--actor-num-nodes {nodes} x --actor-num-gpus-per-node {per_node}"):
            spread_over_nodes(bundle_nodes, nodes=nodes, per_node=per_node, engines=engines, shared=shared)
        return
    trainers, engine_bundles = spread_over_nodes(
        bundle_nodes, nodes=nodes, per_node=per_node, engines=engines, shared=shared
    )
    on = [bundle_nodes[b] for b in trainers]
    # per_node consecutive ranks on each of `nodes` distinct nodes, and no bundle taken twice.
    assert len(trainers) == nodes * per_node == len(set(trainers))
    runs = [on[i * per_node : (i + 1) * per_node] for i in range(nodes)]
    assert all(len(set(run)) == 1 for run in runs) and len({run[0] for run in runs}) == nodes
    if shared:
        assert engine_bundles == trainers[:engines]
    else:
        assert not set(engine_bundles) & set(trainers)
        assert len(engine_bundles) == min(engines, len(bundle_nodes) - len(trainers))
