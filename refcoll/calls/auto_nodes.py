"""``auto`` across nodes: the ranks' node shape, and each all-reduce priced level by level.

With a two-level calibration (:meth:`~refcoll.core.calibration.Calibration.link`)
and ranks on more than one node, :func:`two_level_choice` prices every candidate
through its registry record's ``price`` (its phases, each on the link it uses)
and adds the node-aware all-reduces (``hierarchical``), trying each algorithm
they may run between the nodes (:func:`across_options`).
"""

from __future__ import annotations

import functools
from dataclasses import replace

from .. import algorithms
from ..algorithms.registry import NodeShape
from ..core.calibration import Calibration
from .calibration import host_counts

__all__ = ["candidates", "two_level_choice", "node_aware", "across_options", "node_shape",
           "shape_of", "priced_shape", "PIPELINES", "PIPELINE_SEGMENT"]


def candidates(collective: str) -> list[str]:
    """Return the algorithms auto chooses among for ``collective``."""
    names = [n for n in algorithms.names(collective) if algorithms.get(n).auto
             and collective in algorithms.get(n).costs]
    return names or ["naive"]


def _two_level(collective: str, calibration: Calibration, shape) -> bool:
    return (collective == "allreduce" and shape is not None and shape.nodes > 1
            and calibration.two_level)


def node_aware() -> list[str]:
    """Return the all-reduces auto adds across nodes: those that take the node shape and are
    priced on a cluster (their record's ``node_option`` and ``price``), in registry order."""
    return [a.name for a in algorithms.REGISTRY.values()
            if a.node_option and a.price is not None and not a.needs_in_network
            and "allreduce" in a.implementations]


#: The segment counts auto tries for an all-reduce that pipelines its levels (``pipeline``).
PIPELINES = (1, 2, 4, 8)

#: The smallest segment auto pipelines, bytes. Each segment pays its phases' calls again
#: and hands its network phase to the other thread: on 2 emulated nodes x 2 ranks at
#: 1 Gbit/s, 8 segments of 32 KiB took 3.4 times as long as one of 256 KiB, while 8 of
#: 128 KiB beat one of 1 MiB (benchmarks/nodes.py). The α-β price sees neither cost.
PIPELINE_SEGMENT = 256 << 10


def across_options(name: str, nbytes: int | None = None, shape: NodeShape | None = None
                   ) -> list[dict]:
    """Return the option sets auto tries for ``name`` across nodes: each algorithm it may run
    between the nodes (``inter``) with each segment count of :data:`PIPELINES` that leaves
    segments of :data:`PIPELINE_SEGMENT` or more of ``nbytes`` (all of them when None), or
    ``[{}]`` for an algorithm without those choices.

    On a ``shape`` with racks, an algorithm that can group by racks (its ``level``
    option) is tried with groups of a node and with groups of a rack. The rack's
    groups are named by the record's node option (``ranks_per_node`` = the ranks
    of a rack), consecutive ranks as the racks are where auto prices them, so
    the simulator, which has no racks, runs the same choice."""
    known = algorithms.options(name, "allreduce")
    inters = [{"inter": a.name} for a in algorithms.REGISTRY.values()
              if a.across_nodes and not a.needs_in_network and a.price is not None] \
        if "inter" in known else [{}]
    if shape is not None and shape.racks > 1 and "level" in known:
        rack = {algorithms.get(name).node_option: shape.rack_ranks}
        inters = [{**group, **inter} for group in ({}, rack) for inter in inters]
    if "pipeline" not in known:
        return inters
    counts = [s for s in PIPELINES if s == 1 or nbytes is None or nbytes // s >= PIPELINE_SEGMENT]
    return [{**inter, **({"pipeline": s} if s > 1 else {})} for inter in inters for s in counts]


def priced_shape(calibration: Calibration, shape: NodeShape) -> NodeShape:
    """Return ``shape`` with the racks of ``calibration`` (its ``rack_nodes``), where they
    divide its equal nodes into two or more racks; else ``shape`` as it is."""
    per_rack = calibration.rack_nodes
    if (not per_rack or not calibration.rack_beta or not shape.equal
            or shape.nodes % per_rack or shape.nodes // per_rack < 2):
        return shape
    return replace(shape, racks=shape.nodes // per_rack)


@functools.lru_cache(maxsize=4096)
def _two_level_choice(count: int, itemsize: int, calibration: Calibration, shape: NodeShape,
                      allowed: tuple | None) -> tuple[str, tuple, float]:
    pool = list(candidates("allreduce") if allowed is None else allowed)
    if allowed is None:
        pool += [n for n in node_aware() if n not in pool]
    shape = priced_shape(calibration, shape)
    best = None
    for name in pool:
        algo = algorithms.get(name)
        if algo.price is None or (algo.node_option and not shape.equal):
            continue  # unpriced, or node-aware on unequal nodes, which its price cannot shape
        for options in (across_options(name, count * itemsize, shape) if algo.node_option
                        else [{}]):
            seconds = calibration.price(algo.price(shape, count, itemsize, **options),
                                        shape.per_node, itemsize)
            if best is None or seconds < best[2]:
                best = (name, tuple(sorted(options.items())), seconds)
    return best or (pool[0], (), float("nan"))


def two_level_choice(count: int, itemsize: int, calibration: Calibration, shape: NodeShape,
                     allowed: list[str] | None = None) -> tuple[str, dict, float]:
    """Return the all-reduce auto runs across nodes, its options and its modelled seconds.

    Every allowed candidate, and (unless ``REFCOLL_ALGO`` names the pool) every
    :func:`node_aware` algorithm with each algorithm it may run between the nodes
    (:func:`across_options`), is priced by its record's ``price`` on ``shape``
    (with the calibration's racks, :func:`priced_shape`): each phase at the α
    and β of its link, inside the nodes or across them
    (:meth:`~refcoll.core.calibration.Calibration.link`), and across the racks'
    uplinks where it crosses them. The cheapest wins
    (ties: registry order, then the ``inter`` options' order).
    """
    name, options, seconds = _two_level_choice(count, itemsize, calibration, shape,
                                               None if allowed is None else tuple(allowed))
    return name, dict(options), seconds



def node_shape(hosts) -> NodeShape | None:
    """Return the nodes of ranks on ``hosts`` (one host name a rank), or None on one node.

    ``NodeShape(nodes, most ranks on one node)``, with ``equal`` False where the
    nodes hold different numbers of ranks.
    """
    counts = host_counts(hosts)
    if len(counts) < 2:
        return None
    return NodeShape(len(counts), max(counts.values()), equal=len(set(counts.values())) == 1)


def shape_of(t) -> NodeShape | None:
    """Return ``t``'s node shape: its hosts under MPI, its world's nodes in the simulator."""
    hosts = getattr(t, "hosts", None)
    if hosts:
        return node_shape(hosts)
    world = getattr(t, "world", None)
    k = getattr(world, "ranks_per_node", None)
    if world is None or not k or k >= t.size:
        return None
    sizes = [min(k, t.size - start) for start in range(0, t.size, k)]
    return NodeShape(len(sizes), k, equal=len(set(sizes)) == 1)
