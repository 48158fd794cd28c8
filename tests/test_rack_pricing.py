"""auto across racks: each phase priced with the flows it puts on the racks' uplinks.

A fat tree's aggregation layer: racks of nodes joined by uplinks that may be
oversubscribed. The prices here are the registry's (``price`` on a
:class:`NodeShape` with ``racks``), put on a calibration's links by
:meth:`Calibration.price`; the choices are :func:`auto.two_level_choice`'s.
"""

import numpy as np
import pytest

import refcoll
import refcoll.algorithms as algorithms
from refcoll.algorithms import NodeShape
from refcoll.algorithms.dbtree import dbtree_links, rack_crossings
from refcoll.calls import auto
from refcoll.core.calibration import Calibration
from refcoll.core.topology import NodeLink, Topology, inter_levels, rack_levels

LINK = 1e9  # bits per second, each node's own link


def racked(oversubscription: float, nodes_per_rack: int = 2, per_node: int = 1) -> Calibration:
    """Nodes on 1 Gbit/s links, racks whose uplink is their nodes' links over
    ``oversubscription``."""
    uplink = nodes_per_rack * LINK / oversubscription
    return Calibration(alpha=5e-6, beta=1 / 4e9, gamma=1e-9, inter_alpha=5e-5,
                       inter_beta=8 / LINK, nodes=4, per_node=per_node,
                       rack_beta=8 / uplink, rack_nodes=nodes_per_rack)


def price(calibration, name, shape, count, **options):
    shape = auto.priced_shape(calibration, shape)
    return calibration.price(algorithms.get(name).price(shape, count, 4, **options),
                             shape.per_node, 4)


def test_the_racks_come_from_the_calibration_only_where_they_divide_equal_nodes():
    cal = racked(4)
    assert auto.priced_shape(cal, NodeShape(4, 1)).racks == 2
    assert auto.priced_shape(cal, NodeShape(6, 2)).racks == 3
    assert auto.priced_shape(cal, NodeShape(3, 1)).racks == 1  # 2 does not divide 3
    assert auto.priced_shape(cal, NodeShape(2, 2)).racks == 1  # one rack
    assert auto.priced_shape(cal, NodeShape(4, 2, equal=False)).racks == 1
    no_racks = Calibration(**{**cal.__dict__, "rack_beta": 0.0, "rack_nodes": 0})
    assert auto.priced_shape(no_racks, NodeShape(4, 1)).racks == 1


@pytest.mark.parametrize("per_node", [1, 2])
def test_each_phase_says_how_many_flows_share_an_uplink(per_node):
    shape = NodeShape(4, per_node, racks=2)  # 2 racks of 2 nodes
    rack_ranks = 2 * per_node
    assert {p.uplink for p in algorithms.get("ring").price(shape, 1 << 20, 4)} == {1}
    rack = algorithms.get("hierarchical").price(shape, 1 << 20, 4, ranks_per_node=rack_ranks)
    assert [p.uplink for p in rack] == [0, rack_ranks, 0]  # the ring halves stay in the rack
    assert [p.uplink for p in algorithms.get("hierarchical").price(shape, 1 << 20, 4)] == \
        [0, per_node, per_node, 0]  # a ring among the nodes: one flow per instance per uplink
    # Rabenseifner halves at the largest distance first: that exchange crosses the racks
    # with every rank of the rack; the next stays inside
    crossing = [p.uplink for p in algorithms.get("rabenseifner").price(shape, 1 << 20, 4)
                if p.link != "intra"]
    assert sorted(crossing) == [0, 0, rack_ranks, rack_ranks]


@pytest.mark.parametrize("name", ["rabenseifner", "recursive_doubling", "tree", "ring"])
def test_racks_split_the_phases_but_move_the_same_bytes(name):
    flat, racks = NodeShape(8, 2), NodeShape(8, 2, racks=2)
    total = [sum(p.cost.critical_bytes for p in algorithms.get(name).price(s, 1 << 20, 4))
             for s in (flat, racks)]
    assert total[0] == total[1]


def test_an_oversubscribed_uplink_makes_auto_group_by_racks():
    # 2 racks x 2 nodes x 1 rank. At 4x the uplinks bind: a flat ring runs at half a node
    # link, the rack's groups send each shard across the racks once. At 2x the node links
    # bind first and the ring is as good, so auto keeps it.
    n = (16 << 20) // 4
    name, options, seconds = auto.two_level_choice(n, 4, racked(4), NodeShape(4, 1))
    assert name == "hierarchical" and options["ranks_per_node"] == 2, options
    assert seconds < 0.8 * price(racked(4), "ring", NodeShape(4, 1), n)
    assert seconds < 0.5 * price(racked(4), "rabenseifner", NodeShape(4, 1), n)
    assert auto.two_level_choice(n, 4, racked(2), NodeShape(4, 1))[0] == "ring"
    # the same calibration without racks prices the uplinks nowhere
    flat = Calibration(**{**racked(4).__dict__, "rack_beta": 0.0, "rack_nodes": 0})
    assert "ranks_per_node" not in auto.two_level_choice(n, 4, flat, NodeShape(4, 1))[1]


def test_a_pipeline_pays_for_a_node_link_its_stages_share():
    # Without oversubscription the rack's groups put 1.5 n on each node link (the ring
    # halves in the rack and the shard across), as a flat ring does: pipelining the
    # stages cannot beat that link.
    n = (64 << 20) // 4
    cal = racked(1)
    link_bound = 1.5 * n * 4 * cal.inter_beta
    for pipeline in (1, 2, 8):
        seconds = price(cal, "hierarchical", NodeShape(4, 1), n, ranks_per_node=2,
                        pipeline=pipeline)
        assert seconds >= link_bound


def test_the_simulator_runs_the_rack_groups_auto_chose():
    # auto names the rack's groups by ranks_per_node, consecutive ranks as the racks are,
    # so a simulator without racks given the same calibration runs the same choice.
    n = (4 << 20) // 4
    xs = [np.random.default_rng(r).standard_normal(n).astype(np.float32) for r in range(4)]
    name, options, _ = auto.two_level_choice(n, 4, racked(4), NodeShape(4, 1))
    assert options.get("ranks_per_node") == 2
    ran = refcoll.simulate("allreduce", xs, algorithm="auto", node_size=1,
                           calibration=racked(4)).outputs
    chosen = refcoll.simulate("allreduce", xs, algorithm=name, **options).outputs
    assert all(a.tobytes() == b.tobytes() for a, b in zip(ran, chosen))


def test_dbtree_counts_the_tree_edges_that_leave_a_rack():
    # on 4 ranks the trees' edges are 1-2, 2-0, 3-2 and 0-1, 1-3, 2-1: four of them join
    # the racks {0, 1} and {2, 3}, each a flow out of each rack while the trees pipeline
    edges = {tree: [(r, dbtree_links(r, 4, tree)[0]) for r in range(4)]
             for tree in (0, 1)}
    crossing = [(a, b) for tree in edges.values() for a, b in tree
                if b is not None and a // 2 != b // 2]
    assert rack_crossings(4, 2) == len(crossing) == 4
    assert rack_crossings(8, 8) == 0  # one rack
    assert 0 < rack_crossings(16, 8) <= rack_crossings(16, 4)


def topology(racks, uplink=5e8):
    nodes = tuple(NodeLink(f"n{i + 1}", rack, 1, LINK) for i, rack in enumerate(racks))
    return Topology(nodes, {r: uplink for r in set(racks)} if uplink else {})


def test_rack_levels_need_equal_racks_of_consecutive_ranks_with_uplinks():
    hosts = ["n1", "n2", "n3", "n4"]
    assert rack_levels(topology([1, 1, 2, 2]), hosts) == {"rack_beta": 8 / 5e8, "rack_nodes": 2}
    assert rack_levels(topology([1, 2, 1, 2]), hosts) == {}  # a rack's ranks not consecutive
    assert rack_levels(topology([1, 1, 1, 2]), hosts) == {}  # unequal racks
    assert rack_levels(topology([1, 1, 2, 2], uplink=0), hosts) == {}  # no uplink rate
    assert rack_levels(topology([1, 1, 1, 1]), hosts) == {}  # one rack
    assert rack_levels(topology([1, 1, 2, 2]), ["n1", "n1", "n3", "n3"]) == \
        {"rack_beta": 8 / 5e8, "rack_nodes": 1}
    assert rack_levels(topology([1, 1, 2, 2]), ["n1", "x", "n3", "n4"]) == {}  # unlisted host
    assert rack_levels(None, hosts) == {}


def test_with_racks_priced_apart_the_level_across_nodes_is_the_nodes_own_link():
    hosts = ["n1", "n2", "n3", "n4"]
    assert inter_levels(topology([1, 1, 2, 2], uplink=5e8), hosts)["inter_beta"] == 8 / LINK
    # interleaved racks cannot be priced apart: the uplink's share per node binds instead
    assert inter_levels(topology([1, 2, 1, 2], uplink=5e8), hosts)["inter_beta"] == 8 / 2.5e8


def test_the_calibration_record_carries_its_racks():
    record = racked(4).to_json()
    assert record["rack_nodes"] == 2 and record["rack_beta"] == pytest.approx(8 / 5e8)
