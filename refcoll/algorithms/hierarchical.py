"""Hierarchical (two-level) all-reduce: ring halves inside each node, any all-reduce across.

Links inside a node (shared memory, NVLink) are much faster than the links between
nodes, and a flat ring pushes ``2·((p-1)/p)·n`` through the one rank of each node
that talks to the next node. The two-level all-reduce (Horovod's
``HOROVOD_HIERARCHICAL_ALLREDUCE``; Cho et al., "BlueConnect", MLSys 2019;
msccl-tools ``examples/mscclang/hierarchical_allreduce.py``) instead splits the
buffer among the ``k`` ranks of a node, so that every rank sends only its
``n/k`` shard across nodes. With ``g`` nodes of ``k`` ranks, ``p = g·k``, rank
``(node i, local j)``:

    1. reduce-scatter inside node i (ring):  local j gets shard j summed over node i;
    2. all-reduce shard j across the g ranks with local index j (``inter``, default ring);
    3. allgather inside node i (ring):        every local rank gets every shard.

With 2 nodes of 4 ranks and shards ``A B C D`` of a node (``x0..x7`` the inputs):

    phase               rank 0 (node 0, local 0)    ...  rank 4 (node 1, local 0)
    1. reduce-scatter   A = x1+x2+x3+x0                  A = x5+x6+x7+x4
    2. inter all-reduce A over {0, 4}: both get A(node 0) and A(node 1) combined
    3. allgather        B, C, D from ranks 1, 2, 3       B, C, D from ranks 5, 6, 7

When the nodes differ in size (the last node of ``ranks_per_node=k`` smaller, or an
odd machine), the shards of different nodes would differ, so the algorithm falls
back to MPICH's SMP-aware all-reduce (``MPIR_Allreduce_intra_smp``,
``src/mpi/coll/allreduce/allreduce_intra_smp.c``): reduce to each node's leader,
all-reduce among the leaders, broadcast inside each node.

Both are compositions of existing halves over ``Transport.split``: the ring's
``ring_reduce_scatter_steps``/``ring_allgather_steps``, the naive reduce and
broadcast, and the registry's all-reduce on the sub-transport of the inter phase.

Spec: spec/hierarchical.md
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._util import copy_into, view, workspace
from .naive import naive_broadcast, naive_reduce
from .ring import ring_allgather, ring_allgather_steps, ring_reduce_scatter_steps
from ..core.chunking import chunk_bounds, max_chunk
from ..core.errors import UsageError
from ..transport.base import transport_cache

__all__ = [
    "NodeLayout",
    "node_sizes",
    "node_layout",
    "node_traffic",
    "hierarchical_allreduce",
]

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


def node_layout(t, ranks_per_node: int | None = None) -> NodeLayout:
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
    cache = transport_cache(t, "node_layouts")
    if ranks_per_node not in cache:
        cache[ranks_per_node] = _split_nodes(t, ranks_per_node)
    return cache[ranks_per_node]


def _split_nodes(t, ranks_per_node: int | None) -> NodeLayout:
    """Split ``t`` into its nodes and the cross-node transport of the phase in between."""
    if ranks_per_node is None:
        intra = t.split_node()
        sizes, node = _agree_on_nodes(t, intra)
    else:
        sizes = node_sizes(t.size, ranks_per_node)
        node = t.rank // ranks_per_node
        intra = t.split(node, t.rank)
    if len(set(sizes)) == 1:
        cross = t.split(intra.rank, node)  # same local index, one rank per node, in node order
    else:
        cross = t.split(0 if intra.rank == 0 else NOT_A_MEMBER, node)  # the node leaders
    return NodeLayout(sizes, node, intra, cross)


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


def _inter_implementation(inter: str):
    """Return the registry's all-reduce called ``inter`` (imported late: the registry imports us)."""
    from . import get, implementation

    if inter == "hierarchical":
        raise UsageError("inter='hierarchical' would split the inter-node ranks again without "
                         "end: choose a flat all-reduce such as 'ring'")
    found = implementation(inter, "allreduce")
    if get(inter).extra_ranks is not None:
        raise UsageError(f"inter={inter!r} needs processes beyond the data ranks, which the "
                         "inter-node group does not have: choose an all-reduce such as 'ring'")
    return found


def _check_ranks_per_node(t, ranks_per_node) -> None:
    if ranks_per_node is None:
        if not hasattr(t, "split_node"):
            raise UsageError(f"rank {t.rank}: {type(t).__name__} cannot find nodes "
                             "(no split_node): pass ranks_per_node=k")
        return
    if (isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, (int, np.integer))
            or ranks_per_node < 1):
        raise UsageError(f"rank {t.rank}: ranks_per_node must be a positive integer, "
                         f"got {ranks_per_node!r}")


def hierarchical_allreduce(t, x: np.ndarray, out: np.ndarray, *, op,
                           ranks_per_node: int | None = None, inter: str = "ring") -> None:
    """Two-level all-reduce: ring reduce-scatter in each node, all-reduce across, ring allgather.

    Schedule (nodes of ``k`` ranks, ``g`` nodes, rank = (node i, local j),
    shards = ``chunk_bounds(n, k)``):
      equal nodes:
        1. ring reduce-scatter over node i: local j ends with shard j reduced
           over its node, straight into ``out``;
        2. ``inter`` all-reduce of shard j over the g ranks with local index j
           (cross rank i = node i), in place in ``out``;
        3. ring allgather over node i: every shard to every local rank.
      unequal nodes (leader-based fallback, as MPICH's SMP-aware all-reduce):
        1. naive reduce of the whole buffer to local rank 0 (the leader);
        2. ``inter`` all-reduce of the whole buffer among the g leaders;
        3. naive broadcast from the leader inside node i.
    Reduction order (``P`` the partial of node i, combined in the ``inter``
      algorithm's order with node i as its rank i; for ``inter="ring"``, element
      e in chunk c of ``chunk_bounds(len, g)`` is ``((P(c+1) op P(c+2)) ...) op P(c)``):
      equal:   P = shard j's ring order in node i: ``((x(j+1) op x(j+2)) ...) op x(j)``
               over local ranks; ``len`` is the shard's length.
      unequal: P = ``((x(0) op x(1)) ...) op x(k_i-1)`` over local ranks;
               ``len`` is n.
    Cost (equal, ring inter): 2(k-1)·α + 2((k-1)/k)·n·β_intra + ((k-1)/k)·n·γ
      + 2(g-1)·α + 2((g-1)/g)·(n/k)·β_inter + ((g-1)/g)·(n/k)·γ;
      unequal: 2(k-1)·α + 2(k-1)·n·β_intra + (k-1)·n·γ + the inter all-reduce of n
      over g. Exact counts: :func:`refcoll.core.cost.hierarchical_allreduce`.
    Restrictions: none on p or n (any node shape; n < k gives empty shards, sent
      as empty messages); p == 1 copies; one node is the ring all-reduce; one
      rank a node is the ``inter`` all-reduce over all ranks. The nodes come from
      ``ranks_per_node`` or, when it is None, from ``t.split_node()`` (the first
      call then also agrees on the node sizes over ``t``; see
      :func:`node_layout`). ``inter`` may be any registered all-reduce but
      ``"hierarchical"`` and those with extra (switch) ranks.
    Spec: spec/hierarchical.md
    """
    _check_ranks_per_node(t, ranks_per_node)
    inter_allreduce = _inter_implementation(inter)
    if t.size == 1:
        copy_into(out, x)
        return
    layout = node_layout(t, ranks_per_node)
    if layout.equal:
        _sharded_allreduce(layout, x, out, op=op, inter_allreduce=inter_allreduce)
    else:
        _leader_allreduce(layout, x, out, op=op, inter_allreduce=inter_allreduce)


def _sharded_allreduce(layout: NodeLayout, x, out, *, op, inter_allreduce) -> None:
    """Equal nodes: ring reduce-scatter, ``inter`` all-reduce of one shard, ring allgather."""
    intra, cross = layout.intra, layout.cross
    bounds = chunk_bounds(x.size, intra.size)
    shard = intra.rank
    reduced = x  # a one-rank node has nothing to reduce: the inter phase reads x itself
    if intra.size > 1:
        scratch = workspace(intra, max_chunk(x.size, intra.size), x.dtype)
        with intra.call("hierarchical"):
            ring_reduce_scatter_steps(intra, x, bounds, op=op, scratch=scratch,
                                      target=lambda idx: view(out, bounds, idx))
        reduced = out
    with cross.call("allreduce"):
        inter_allreduce(cross, view(reduced, bounds, shard), view(out, bounds, shard),
                        op=op)  # shard j of node i <-> shard j of every other node
    with intra.call("hierarchical"):
        ring_allgather_steps(intra, out, bounds)


def _leader_allreduce(layout: NodeLayout, x, out, *, op, inter_allreduce) -> None:
    """Unequal nodes: naive reduce to the leader, ``inter`` all-reduce of leaders, naive broadcast."""
    intra, cross = layout.intra, layout.cross
    reduced = x
    if intra.size > 1:
        with intra.call("hierarchical"):
            naive_reduce(intra, x, out, op=op, root=0)  # whole buffer -> the leader
        reduced = out
    if cross is not None:  # leaders only
        with cross.call("allreduce"):
            inter_allreduce(cross, reduced, out, op=op)  # node partials <-> the other leaders
    with intra.call("hierarchical"):
        naive_broadcast(intra, out, root=0)  # the result -> every rank of the node


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
