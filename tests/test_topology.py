"""Two levels: the topology file, the two-level calibration, and auto and the model across nodes.

Nothing here needs namespaces or MPI: the choices are the cost model's, the
bits the simulator's (tests/test_cluster.py runs them across emulated nodes).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import refcoll
from refcoll import algorithms
from refcoll.algorithms.registry import NodeShape
from refcoll.calls import auto
from refcoll.cluster.emulate import Cluster, ClusterSpec, parse_rate
from refcoll.core import topology
from refcoll.core.calibration import DEFAULT, Calibration
from refcoll.core.errors import UsageError

#: Shared memory inside a node, a 1 Gbit/s link across: the emulated cluster's two levels.
TWO_LEVEL = Calibration(alpha=6e-6, beta=3e-10, gamma=2.4e-10, inter_alpha=140e-6,
                        inter_beta=8 / 0.93e9, nodes=2, per_node=2)


def test_a_one_level_calibration_prices_every_link_alike():
    assert not DEFAULT.two_level
    for kind in ("intra", "inter", "flat", "slowest"):
        assert DEFAULT.link(kind, 4) == (DEFAULT.alpha, DEFAULT.beta)
    assert DEFAULT.link("local", 4) == (0.0, 0.0)


def test_two_levels_share_a_node_link_among_the_ranks_that_cross_it():
    c = TWO_LEVEL
    assert c.two_level
    assert c.link("intra", 2) == (c.alpha, c.beta)
    assert c.link("inter", 2) == (c.inter_alpha, 2 * c.inter_beta)  # both ranks cross at once
    assert c.link("flat", 2) == (c.inter_alpha, c.inter_beta)  # one rank of a node crosses
    assert c.link("slowest", 3) == (c.inter_alpha, 3 * c.inter_beta)


def test_price_adds_each_phase_at_its_links_figures():
    parts = algorithms.get("hierarchical").price(NodeShape(2, 2), 1 << 20, 4)
    expected = sum(p.cost.rounds * TWO_LEVEL.link(p.link, 2)[0]
                   + p.cost.critical_bytes * TWO_LEVEL.link(p.link, 2)[1]
                   + p.cost.reduced * TWO_LEVEL.gamma for p in parts)
    assert TWO_LEVEL.price(parts, 2, 4) == pytest.approx(expected)
    # What one node's link carries: each phase's bytes times the ranks that cross at once
    # (one for the flat ring's step, both ranks in the others). n = 4 MiB: hierarchical
    # sends n across, the flat ring 1.5 n, Rabenseifner 2 n.
    n = 4 << 20
    node_bytes = {name: sum(p.cost.critical_bytes * (1 if p.link == "flat" else 2)
                            for p in algorithms.get(name).price(NodeShape(2, 2), n // 4, 4)
                            if p.link != "intra")
                  for name in ("hierarchical", "ring", "rabenseifner")}
    assert node_bytes == {"hierarchical": n, "ring": 3 * n // 2, "rabenseifner": 2 * n}


@pytest.mark.parametrize("nodes,per_node", [(2, 2), (3, 2), (2, 3), (4, 2)])
@pytest.mark.parametrize("nbytes", [1 << 16, 1 << 20, 1 << 26])
def test_across_nodes_auto_picks_the_cheapest_of_every_algorithm_and_inter(nodes, per_node,
                                                                           nbytes):
    shape = NodeShape(nodes, per_node)
    name, options, seconds = auto.two_level_choice(nbytes // 4, 4, TWO_LEVEL, shape)
    priced = {}
    for candidate in auto.candidates("allreduce") + auto.node_aware():
        algo = algorithms.get(candidate)
        for opts in auto.across_options(candidate, nbytes) if algo.node_option else [{}]:
            priced[candidate, tuple(opts.items())] = TWO_LEVEL.price(
                algo.price(shape, nbytes // 4, 4, **opts), per_node, 4)
    assert seconds == pytest.approx(min(priced.values()))
    assert priced[name, tuple(options.items())] == seconds
    # On these links the node-aware all-reduce wins: it sends least across the nodes.
    assert name == "hierarchical"


def test_the_inter_phase_is_chosen_per_shape_and_size():
    small = auto.two_level_choice(1 << 14, 4, TWO_LEVEL, NodeShape(2, 2))
    large = auto.two_level_choice(1 << 24, 4, TWO_LEVEL, NodeShape(2, 2))
    # two nodes: one exchange (recursive doubling) saves a 140 µs round on a small buffer,
    # where one segment is cheapest (each more costs its rounds again)
    assert small[:2] == ("hierarchical", {"inter": "recursive_doubling"})
    # on a large one, segments overlap the node phases with the network's
    assert large[0] == "hierarchical" and large[1].get("pipeline", 1) > 1
    # unpipelined, the ring wins there: it reduces half as much per rank
    plain = {inter: TWO_LEVEL.price(algorithms.get("hierarchical").price(
        NodeShape(2, 2), 1 << 24, 4, inter=inter), 2, 4)
        for inter in ("ring", "recursive_doubling")}
    assert plain["ring"] < plain["recursive_doubling"]
    assert large[2] < plain["ring"]


def test_one_level_or_one_node_leaves_auto_as_it_was():
    for cal, shape in ((DEFAULT, NodeShape(2, 2)), (TWO_LEVEL, None), (TWO_LEVEL, NodeShape(1, 4))):
        for count in (1 << 8, 1 << 20):
            assert auto.choose("allreduce", 4, count, 4, cal, shape=shape) == \
                auto.choose("allreduce", 4, count, 4, cal)


def test_refcoll_algo_limits_the_choice_across_nodes_too():
    name, _, _ = auto.two_level_choice(1 << 20, 4, TWO_LEVEL, NodeShape(2, 2),
                                       ["ring", "rabenseifner"])
    assert name == "ring"  # 1.5 n across per node beats Rabenseifner's 2 n


def test_unequal_nodes_leave_the_node_aware_algorithms_out():
    shape = NodeShape(2, 3, equal=False)
    name, _, _ = auto.two_level_choice(1 << 20, 4, TWO_LEVEL, shape)
    assert not algorithms.get(name).node_option


def test_the_node_shape_comes_from_the_hosts():
    assert auto.node_shape(["a", "a", "b", "b"]) == NodeShape(2, 2)
    assert auto.node_shape(["a", "a", "a", "b", "b"]) == NodeShape(2, 3, equal=False)
    assert auto.node_shape(["a", "a"]) is None


def test_the_simulator_predicts_what_auto_runs_across_nodes():
    """A simulated world with nodes and the job's two-level calibration picks as the job does,
    so the oracle predicts its bits: auto's result is hierarchical's with the chosen inter."""
    p, count = 4, (1 << 20) // 4
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal(count).astype(np.float32) for _ in range(p)]
    name, options, _ = auto.two_level_choice(count, 4, TWO_LEVEL, NodeShape(2, 2))
    got = refcoll.simulate("allreduce", inputs, algorithm="auto", node_size=2,
                           calibration=TWO_LEVEL)
    want = refcoll.simulate("allreduce", inputs, algorithm=name, node_size=2, **options)
    for a, b in zip(got.outputs, want.outputs):
        assert a.tobytes() == b.tobytes()
    flat = refcoll.simulate("allreduce", inputs, algorithm="ring", node_size=2)
    assert got.ledger.split_bytes(lambda a, b: a // 2 == b // 2)[1] < \
        flat.ledger.split_bytes(lambda a, b: a // 2 == b // 2)[1]


# --------------------------------------------------------------------------- the file

def _example(tmp_path, **extra):
    spec = ClusterSpec(nodes=4, ranks_per_node=2, link="1gbit", node_links={4: "100mbit"},
                       racks=2, oversubscription=4, **extra)
    cluster = Cluster(spec)
    cluster.prefix = "rcabcdef"
    return cluster, cluster.topology().write(tmp_path / "topo.json")


def test_the_cluster_writes_its_topology_and_it_reads_back(tmp_path):
    cluster, path = _example(tmp_path)
    topo = topology.read(path)
    assert [n.host for n in topo.nodes] == [cluster.host(i) for i in range(1, 5)]
    assert [n.rack for n in topo.nodes] == [1, 1, 2, 2]
    assert [n.link_bits_per_s for n in topo.nodes] == [1e9, 1e9, 1e9, 1e8]
    assert topo.uplinks == {1: 2 * 1e9 / 4, 2: 2 * 1e9 / 4}  # two nodes' links over 4
    assert topo == topology.read(topo.write(tmp_path / "again.json"))


def test_the_slowest_link_counts_a_shared_uplink_per_node(tmp_path):
    cluster, path = _example(tmp_path)
    topo = topology.read(path)
    hosts = [cluster.host(i) for i in (1, 2)]
    assert topo.slowest_link(hosts) == 1e9  # one rack: no uplink crossed
    assert topo.slowest_link([cluster.host(1), cluster.host(3)]) == 2.5e8  # 500 Mbit/s over 2
    assert topo.slowest_link([cluster.host(i) for i in range(1, 5)]) == 1e8  # node 4's


def test_auto_takes_the_second_level_from_the_topology(tmp_path):
    cluster, path = _example(tmp_path)
    topo = topology.read(path)
    hosts = [cluster.host(1)] * 2 + [cluster.host(2)] * 2
    levels = topology.inter_levels(topo, hosts)
    assert levels == {"inter_alpha": topology.DEFAULT_LATENCY, "inter_beta": 8 / 1e9,
                      "nodes": 2, "per_node": 2}
    assert topology.inter_levels(topo, [cluster.host(1)] * 4) == {}  # one node
    assert topology.inter_levels(topo, ["elsewhere", "other"]) == {}  # not its hosts
    assert topology.inter_levels(None, hosts) == {}


@pytest.mark.parametrize("text,said", [("{", "not valid JSON"),
                                       ('{"nodes": []}', "lists no node"),
                                       ('{"nodes": [{"rack": 1}]}', r"nodes\[0\]\.host: must be")])
def test_a_bad_topology_file_is_a_clear_usage_error(tmp_path, text, said):
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(UsageError, match=said):
        topology.read(path)
    with pytest.raises(UsageError, match="the topology file .* does not exist"):
        topology.read(tmp_path / "absent.json")


def test_the_model_reads_the_topology(tmp_path):
    _, path = _example(tmp_path)
    options = topology.model_options(topology.read(path))
    assert options["nodes"] == "4" and options["gpus_per_node"] == "2"
    assert parse_rate("100mbit") / 8 == pytest.approx(float(options["inter_bw"][:-3]))
    assert options["rail"] is False and options["nics_per_node"] == "1"
    res = subprocess.run([sys.executable, "-m", "refcoll", "model", "--topology", str(path),
                          "--intra-bw", "4GB/s", "--intra-quoted", "unidirectional", "--params",
                          "1e6", "--no-search"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "4 nodes × 2 GPUs" in res.stdout and "12.5 MB/s" in res.stdout, res.stdout


def _calibration_json(tmp_path, **fields):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"ranks": 4, "calibration": {**TWO_LEVEL.to_json(), **fields}}))
    return path


def test_the_model_is_written_from_a_two_level_calibration(tmp_path):
    path = _calibration_json(tmp_path)
    res = subprocess.run([sys.executable, "-m", "refcoll", "model", "--from-calibration",
                          str(path), "--params", "16777216", "--no-search", "--algorithm",
                          "ring,hierarchical,rabenseifner"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "2 nodes × 2 GPUs" in res.stdout, res.stdout
    rows = {line.split()[0]: line for line in res.stdout.splitlines()
            if line.startswith("  ") and line.split()[0] in ("ring", "hierarchical",
                                                              "rabenseifner")}
    order = [line.split()[0] for line in res.stdout.splitlines() if line.split()
             and line.split()[0] in rows]
    assert order[:3] == ["hierarchical", "ring", "rabenseifner"], res.stdout  # fastest first


def test_a_one_level_calibration_file_is_refused_with_the_fix(tmp_path):
    path = _calibration_json(tmp_path, nodes=0, inter_beta=0.0)
    res = subprocess.run([sys.executable, "-m", "refcoll", "model", "--from-calibration",
                          str(path), "--params", "1e6"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2 and "measured on one node" in res.stderr, res.stderr


def test_auto_runs_the_options_it_chose_not_the_algorithms_defaults():
    # 4 nodes of 2: auto's choice across nodes carries options (the algorithm between the
    # nodes, the segments); the call must run them, and the simulator predicts that run.
    xs = [np.random.default_rng(r).standard_normal(1 << 16).astype(np.float32) for r in range(8)]
    name, options, _ = auto.two_level_choice(1 << 16, 4, TWO_LEVEL, NodeShape(4, 2))
    assert name == "hierarchical" and options not in ({}, {"inter": "ring"}), options
    ran = refcoll.simulate("allreduce", xs, algorithm="auto", node_size=2,
                           calibration=TWO_LEVEL).outputs[0]
    chosen = refcoll.simulate("allreduce", xs, algorithm="hierarchical", ranks_per_node=2,
                              **options).outputs[0]
    plain = refcoll.simulate("allreduce", xs, algorithm="hierarchical", ranks_per_node=2).outputs[0]
    assert ran.tobytes() == chosen.tobytes()
    assert ran.tobytes() != plain.tobytes()


def test_auto_pipelines_only_segments_of_the_smallest_size_or_more():
    every = auto.across_options("hierarchical")
    assert {o.get("pipeline", 1) for o in every} == set(auto.PIPELINES)
    for nbytes in (64 << 10, auto.PIPELINE_SEGMENT, 1 << 20, 64 << 20):
        counts = {o.get("pipeline", 1) for o in auto.across_options("hierarchical", nbytes)}
        assert counts == {s for s in auto.PIPELINES
                          if s == 1 or nbytes // s >= auto.PIPELINE_SEGMENT}
        name, options, _ = auto.two_level_choice(nbytes // 4, 4, TWO_LEVEL, NodeShape(2, 2))
        assert nbytes // options.get("pipeline", 1) >= min(nbytes, auto.PIPELINE_SEGMENT)
    assert auto.across_options("ring", 1 << 20) == [{}]
