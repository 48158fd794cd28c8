"""Nodes: which ranks of a transport share a machine, and the traffic between machines.

Shared by the algorithms that care where ranks live (the hierarchical
all-reduce) and the code that predicts them on the real nodes (the bench, the
battery). :func:`node_layout` splits a transport into its nodes once and keeps
the split in the transport's cache; :func:`node_traffic` splits a simulated
run's bytes into those inside and those between nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..core.errors import UsageError
from ..core.topology import from_env as topology_from_env
from ..transport.base import transport_cache
from .naive import naive_broadcast
from .ring import ring_allgather

__all__ = ["NodeLayout", "node_sizes", "node_layout", "node_traffic", "NOT_A_MEMBER", "LEVELS"]


#: The color that leaves a rank out of a ``split`` (``MPI_UNDEFINED``).
NOT_A_MEMBER = -1


@dataclass(frozen=True)
class NodeLayout:
    """This rank's place in the two-level shape, and the transports of its phases.

    Attributes:
        sizes: ranks on each node, by node index; the same tuple on every rank.
        node: this rank's node index.
        intra: the transport of this rank's node (``intra.rank`` is the local rank).
        cross: equal nodes: the ranks with this rank's local index, one per node,
            ordered by node; unequal nodes: the node leaders (local rank 0) ordered
            by node, and ``None`` on every other rank.
    """

    sizes: tuple
    node: int
    intra: object
    cross: object

    @property
    def equal(self) -> bool:
        """Whether every node has the same number of ranks (the sharded schedule runs)."""
        return len(set(self.sizes)) == 1


def node_sizes(p: int, ranks_per_node: int) -> tuple:
    """Return the node sizes of ``p`` ranks grouped ``ranks_per_node`` consecutive ranks a node.

    Rank ``r`` is on node ``r // ranks_per_node``; the last node holds the rest:
    ``node_sizes(7, 3) == (3, 3, 1)``, ``node_sizes(4, 6) == (4,)``.
    """
    return tuple(min(ranks_per_node, p - start) for start in range(0, p, ranks_per_node))


#: The groups :func:`node_layout` may split a transport into: its nodes (machines), or its
#: racks (the nodes behind one switch, from the topology file ``REFCOLL_TOPO_FILE`` names).
LEVELS = ("node", "rack")


def node_layout(t, ranks_per_node: int | None = None, level: str = "node") -> NodeLayout:
    """Return ``t``'s :class:`NodeLayout`, splitting ``t`` on the first call only.

    ``ranks_per_node=k`` puts consecutive ranks ``r // k`` on one node (nodes
    simulated on one machine); ``None`` asks the transport (``t.split_node()``:
    ``MPI_COMM_TYPE_SHARED`` under MPI, ``SimWorld(ranks_per_node=...)`` in the
    simulator). Splitting is collective over ``t`` and costs a communicator
    creation under MPI, so the layout is cached on ``t`` per node shape, as
    :func:`~refcoll.algorithms._util.workspace` caches buffers. Every rank of
    ``t`` must make the same calls in the same order (they do: the key is the same
    option on every rank).
    """
    real = getattr(t, "records", None)
    if real is not None:  # a plan's recorder: the real split, each part recorded alike
        layout = node_layout(real, ranks_per_node, level)
        return replace(layout, intra=t.sub(layout.intra),
                       cross=None if layout.cross is None else t.sub(layout.cross))
    cache = transport_cache(t, "node_layouts")
    key = ranks_per_node if level == "node" else (level,)
    if key not in cache:
        cache[key] = _split_nodes(t, ranks_per_node) if level == "node" else _split_racks(t)
    return cache[key]


def _split_nodes(t, ranks_per_node: int | None) -> NodeLayout:
    """Split ``t`` into its nodes and the cross-node transport of the phase in between."""
    if ranks_per_node is None:
        intra = t.split_node()
        sizes, node = _agree_on_nodes(t, intra)
    else:
        sizes = node_sizes(t.size, ranks_per_node)
        node = t.rank // ranks_per_node
        intra = t.split(node, t.rank)
    return _with_cross(t, sizes, node, intra)


def _with_cross(t, sizes: tuple, node: int, intra) -> NodeLayout:
    """Return the layout of this rank in group ``node`` (transport ``intra``), with the
    cross-group transport of the phase in between split from ``t``."""
    if len(set(sizes)) == 1:
        cross = t.split(intra.rank, node)  # same local index, one rank per node, in node order
    else:
        cross = t.split(0 if intra.rank == 0 else NOT_A_MEMBER, node)  # the node leaders
    return NodeLayout(sizes, node, intra, cross)


def _split_racks(t) -> NodeLayout:
    """Split ``t`` into its racks: the topology file's rack of each rank's host.

    Every rank looks its host up (``t.hosts``, the names the ranks exchanged when
    the transport was made) in the topology ``REFCOLL_TOPO_FILE`` names, then a
    ring allgather tells every rank every rank's rack, so a rank that finds none
    (no file, its host not in it, a file it cannot read) makes every rank raise
    the same :class:`UsageError` rather than leave the others in the split.
    Racks are numbered as the file numbers them; a rack's ranks need not be
    consecutive.
    """
    hosts = list(getattr(t, "hosts", None) or [])
    reason = ""
    racks = np.full(t.size, _NO_FILE, dtype=np.int64)
    try:
        topology = topology_from_env() if hosts else None
        rack = {node.host: node.rack for node in topology.nodes} if topology else {}
        racks[t.rank] = rack.get(hosts[t.rank], _NOT_LISTED) if topology else _NO_FILE
    except UsageError as exc:
        racks[t.rank], reason = _UNREADABLE, f" ({exc})"
    if t.size > 1:
        ring_allgather(t, racks)
    missing = {int(r): int(code) for r, code in enumerate(racks) if code < 0}
    if missing:
        what = {_NO_FILE: "no topology file (REFCOLL_TOPO_FILE) or no host names",
                _NOT_LISTED: "a host the topology file does not list",
                _UNREADABLE: "a topology file it cannot read"}
        if len(missing) == t.size and len(set(missing.values())) == 1:
            said = f"every rank has {what[racks[0]]}"
        else:
            said = "; ".join(f"rank {r}{f' ({hosts[r]})' if r < len(hosts) else ''} has "
                             f"{what[c]}" for r, c in list(missing.items())[:4])
        raise UsageError(f"rank {t.rank}: level='rack' groups the ranks by the racks of the "
                         f"topology file, and not every rank has one: {said}{reason}; write "
                         "the file (refcoll/core/topology.py; the simulator has no hosts: "
                         "give it ranks_per_node) or use level='node'")
    order, counts = np.unique(racks, return_counts=True)
    node = int(np.searchsorted(order, racks[t.rank]))
    return _with_cross(t, tuple(int(c) for c in counts), node, t.split(node, t.rank))


#: What a rank without a rack sends in :func:`_split_racks`' allgather.
_NO_FILE, _NOT_LISTED, _UNREADABLE = -1, -2, -3


def _agree_on_nodes(t, intra) -> tuple[tuple, int]:
    """Return ``(sizes, node)`` for the nodes ``t.split_node()`` found, the same on every rank.

    Each node's leader (local rank 0) tells its node its rank in ``t`` (a naive
    broadcast inside the node), then a ring allgather over ``t`` tells every rank
    every rank's leader. Nodes are numbered by their leader's rank in ``t``.
    Paid once per transport: ``p - g`` messages of 8 B inside the nodes and a
    ring allgather of ``p`` 8-byte blocks over ``t``. Nothing is sent when the
    node is all of ``t`` (one machine): then it is so on every rank.
    """
    if intra.size == t.size:
        return (t.size,), 0
    leader = np.array([t.rank], dtype=np.int64)
    naive_broadcast(intra, leader, root=0)  # the leader's rank in t -> every rank of the node
    leaders = np.empty(t.size, dtype=np.int64)
    leaders[t.rank] = leader[0]
    ring_allgather(t, leaders)  # every rank's leader -> every rank
    order, counts = np.unique(leaders, return_counts=True)
    node = int(np.searchsorted(order, leader[0]))
    return tuple(int(c) for c in counts), node


def node_traffic(ledger, ranks_per_node: int) -> tuple[int, int]:
    """Return ``(intra-node bytes, inter-node bytes)`` of a simulated run's ledger.

    Ranks ``a`` and ``b`` (world ranks) share a node when
    ``a // ranks_per_node == b // ranks_per_node``, the grouping of both the
    ``ranks_per_node`` option and ``SimWorld(p, ranks_per_node=...)``. Works for
    the ledger of any algorithm (so a flat ring can be compared with this one).
    :func:`refcoll.core.cost.hierarchical_traffic` predicts it for this algorithm.
    """
    if ranks_per_node < 1:
        raise UsageError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
    return ledger.split_bytes(lambda a, b: a // ranks_per_node == b // ranks_per_node)
