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

import numpy as np

from ..core.chunking import chunk_bounds, chunk_sizes, max_chunk
from ..core.cost import ZERO, Cost
from ..core.errors import UsageError
from ._nodes import LEVELS, NodeLayout, node_layout, node_sizes, node_traffic
from ._pipeline import run_pipelined
from ._util import copy_into, is_count, view, workspace
from .naive import naive_broadcast, naive_broadcast_cost, naive_reduce, naive_reduce_cost
from .registry import REGISTRY, Algorithm, LinkCost, get, implementation, over_racks, register
from .ring import (
    ring_allgather_cost,
    ring_allgather_steps,
    ring_allreduce_cost,
    ring_reduce_scatter_cost,
    ring_reduce_scatter_steps,
)

__all__ = [
    "NodeLayout",
    "node_sizes",
    "node_layout",
    "node_traffic",
    "hierarchical_allreduce",
    "hierarchical_allreduce_cost",
    "hierarchical_traffic",
    "hierarchical_price",
]


def _inter_implementation(inter: str):
    """Return the registry's all-reduce called ``inter``."""
    if inter == "hierarchical":
        raise UsageError("inter='hierarchical' would split the inter-node ranks again without "
                         "end: choose a flat all-reduce such as 'ring'")
    found = implementation(inter, "allreduce")
    if get(inter).extra_ranks is not None:
        raise UsageError(f"inter={inter!r} needs processes beyond the data ranks, which the "
                         "inter-node group does not have: choose an all-reduce such as 'ring'")
    return found


def _check_options(ranks_per_node, inter, pipeline, level, where: str = ""):
    """Refuse options no run could take (``where`` names the rank: ``rank 2: ``); return
    ``inter``'s all-reduce. The run and the cost formula check alike."""
    if level not in LEVELS:
        raise UsageError(f"{where}level must be one of {', '.join(LEVELS)} (the "
                         f"groups of the two levels), got {level!r}")
    if level != "node" and ranks_per_node is not None:
        raise UsageError(f"{where}level={level!r} groups the ranks by the "
                         "topology file's racks; ranks_per_node groups consecutive ranks "
                         "as nodes: give one of them")
    if ranks_per_node is not None and not _positive(ranks_per_node):
        raise UsageError(f"{where}ranks_per_node must be a positive integer, "
                         f"got {ranks_per_node!r}")
    if not _positive(pipeline) or pipeline > MAX_PIPELINE:
        raise UsageError(f"{where}pipeline must be a whole number of segments from 1 to "
                         f"{MAX_PIPELINE}, got {pipeline!r}")
    return _inter_implementation(inter)


#: The most segments ``pipeline`` cuts a buffer into: each is a round of messages at both
#: levels (empty ones past the elements), and its schedule and cost walk every one.
MAX_PIPELINE = 1 << 16


def _positive(value) -> bool:
    return is_count(value) and value >= 1


def hierarchical_allreduce(t, x: np.ndarray, out: np.ndarray, *, op,
                           ranks_per_node: int | None = None, inter: str = "ring",
                           pipeline: int = 1, level: str = "node") -> None:
    """Two-level all-reduce: ring reduce-scatter in each node, all-reduce across, ring allgather.

    Schedule (nodes of ``k`` ranks, ``g`` nodes, rank = (node i, local j)), for
    each segment ``chunk_bounds(n, pipeline)[s]`` of the buffer, its elements
    cut into shards ``chunk_bounds(len(segment), k)``:
      equal nodes:
        1. ring reduce-scatter over node i: local j ends with shard j reduced
           over its node, straight into ``out``;
        2. ``inter`` all-reduce of shard j over the g ranks with local index j
           (cross rank i = node i), in place in ``out``;
        3. ring allgather over node i: every shard to every local rank.
      unequal nodes (leader-based fallback, as MPICH's SMP-aware all-reduce):
        1. naive reduce of the segment to local rank 0 (the leader);
        2. ``inter`` all-reduce of the segment among the g leaders;
        3. naive broadcast from the leader inside node i.
      With ``pipeline=S > 1`` and a library that runs two threads at once
      (``MPI_THREAD_MULTIPLE``), phase 2 of segment s runs on a second thread
      while phase 1 of later segments and phase 3 of earlier ones run on the
      caller's (:func:`~refcoll.algorithms._pipeline.run_pipelined`).
    Reduction order, per segment (``P`` the partial of node i, combined in the
      ``inter`` algorithm's order with node i as its rank i; for ``inter="ring"``,
      element e in chunk c of ``chunk_bounds(len, g)`` is
      ``((P(c+1) op P(c+2)) ...) op P(c)``):
      equal:   P = shard j's ring order in node i: ``((x(j+1) op x(j+2)) ...) op x(j)``
               over local ranks; ``len`` is the shard's length.
      unequal: P = ``((x(0) op x(1)) ...) op x(k_i-1)`` over local ranks;
               ``len`` is the segment's length.
    Cost (equal, ring inter, one segment): 2(k-1)·α + 2((k-1)/k)·n·β_intra
      + ((k-1)/k)·n·γ + 2(g-1)·α + 2((g-1)/g)·(n/k)·β_inter + ((g-1)/g)·(n/k)·γ;
      unequal: 2(k-1)·α + 2(k-1)·n·β_intra + (k-1)·n·γ + the inter all-reduce of n
      over g. S segments: S times the α terms; overlapped, the time tends to
      the slowest phase's. Exact counts: :func:`hierarchical_allreduce_cost`.
    Restrictions: none on p or n (any node shape; n < k gives empty shards, sent
      as empty messages); p == 1 copies; one node is the ring all-reduce; one
      rank a node is the ``inter`` all-reduce over all ranks. The nodes come from
      ``ranks_per_node`` or, when it is None, from ``t.split_node()`` (the first
      call then also agrees on the node sizes over ``t``; see
      :func:`node_layout`). ``level="rack"`` groups the ranks by the racks of
      the topology file ``REFCOLL_TOPO_FILE`` names instead (a rack's nodes in
      place of a node's ranks: the phase between the groups crosses the
      uplinks); it needs the ranks' host names (MPI) and takes no
      ``ranks_per_node``. ``inter`` may be any registered all-reduce but
      ``"hierarchical"`` and those with extra (switch) ranks. ``pipeline`` is a
      positive integer (segments beyond n are empty).
    Spec: spec/hierarchical.md
    """
    inter_allreduce = _check_options(ranks_per_node, inter, pipeline, level, f"rank {t.rank}: ")
    if level == "node" and ranks_per_node is None and not hasattr(
            getattr(t, "records", t), "split_node"):  # a plan's recorder: its transport
        raise UsageError(f"rank {t.rank}: {type(t).__name__} cannot find nodes "
                         "(no split_node): pass ranks_per_node=k")
    if t.size == 1:
        copy_into(out, x)
        return
    layout = node_layout(t, ranks_per_node, level)
    segments = chunk_bounds(x.size, pipeline)
    phases = _sharded_phases if layout.equal else _leader_phases
    first, middle, last = phases(layout, x, out, segments, op=op,
                                 inter_allreduce=inter_allreduce)
    run_pipelined(t, len(segments), first, middle, last)


def _sharded_phases(layout: NodeLayout, x, out, segments, *, op, inter_allreduce):
    """Equal nodes: ring reduce-scatter, ``inter`` all-reduce of one shard, ring allgather."""
    intra, cross = layout.intra, layout.cross
    longest = max(stop - start for start, stop in segments)
    scratch = workspace(intra, max_chunk(longest, intra.size), x.dtype) if intra.size > 1 else None
    shard = intra.rank
    parts = [_segment(x, out, bounds, intra.size) for bounds in segments]

    def first(s: int) -> None:
        xs, outs, bounds = parts[s]
        if intra.size > 1:
            with intra.call("hierarchical"):
                ring_reduce_scatter_steps(intra, xs, bounds, op=op, scratch=scratch,
                                          target=lambda idx: view(outs, bounds, idx))

    def middle(s: int) -> None:
        xs, outs, bounds = parts[s]
        # a one-rank node has nothing to reduce: the inter phase reads x itself
        reduced = outs if intra.size > 1 else xs
        with cross.call("allreduce"):  # shard j of node i <-> shard j of every other node
            inter_allreduce(cross, view(reduced, bounds, shard), view(outs, bounds, shard),
                            op=op)

    def last(s: int) -> None:
        _, outs, bounds = parts[s]
        with intra.call("hierarchical"):
            ring_allgather_steps(intra, outs, bounds)

    return first, middle, last


def _leader_phases(layout: NodeLayout, x, out, segments, *, op, inter_allreduce):
    """Unequal nodes: naive reduce to leaders, ``inter`` all-reduce among them, naive broadcast."""
    intra, cross = layout.intra, layout.cross
    parts = [_segment(x, out, bounds, 1) for bounds in segments]

    def first(s: int) -> None:
        if intra.size > 1:
            xs, outs, _ = parts[s]
            with intra.call("hierarchical"):
                naive_reduce(intra, xs, outs, op=op, root=0)  # the segment -> the leader

    def middle(s: int) -> None:
        if cross is not None:  # leaders only
            xs, outs, _ = parts[s]
            with cross.call("allreduce"):  # node partials <-> the other leaders
                inter_allreduce(cross, outs if intra.size > 1 else xs, outs, op=op)

    def last(s: int) -> None:
        _, outs, _ = parts[s]
        with intra.call("hierarchical"):
            naive_broadcast(intra, outs, root=0)  # the result -> every rank of the node

    return first, middle, last


def _segment(x, out, bounds, shards: int):
    """Return segment ``bounds`` of ``x`` and ``out`` and the segment's shard bounds."""
    start, stop = bounds
    return x[start:stop], out[start:stop], chunk_bounds(stop - start, shards)


# ------------------------------------------------------------------ cost

def _hierarchical_parts(p: int, n: int, itemsize: int, ranks_per_node, inter: str):
    """Return ``(sizes, intra costs, inter costs, inter's formula)`` of the phases.

    Equal nodes: intra is one ring all-reduce per node (its reduce-scatter and
    allgather halves), inter one ``inter`` all-reduce per shard ``j``. Unequal:
    intra is a naive reduce and a naive broadcast per node, inter one
    all-reduce of the whole buffer among the leaders.
    """
    sizes = node_sizes(p, ranks_per_node or p)
    g = len(sizes)
    inter_cost = get(inter).costs["allreduce"]
    if len(set(sizes)) == 1:
        intra = [ring_allreduce_cost(sizes[0], n, itemsize)] * g
        across = [inter_cost(g, shard, itemsize) for shard in chunk_sizes(n, sizes[0])]
    else:
        intra = [naive_reduce_cost(m, n, itemsize) for m in sizes] + \
                [naive_broadcast_cost(m, n, itemsize) for m in sizes]
        across = [inter_cost(g, n, itemsize)]
    return sizes, intra, across, inter_cost(2, 1, itemsize).formula  # general even when g == 1


def hierarchical_allreduce_cost(p: int, n: int, itemsize: int, *, ranks_per_node: int | None = None,
                           inter: str = "ring", pipeline: int = 1, level: str = "node") -> Cost:
    """Two-level all-reduce: ``g`` nodes of ``k`` ranks (``None``: one node of ``p``).

    Equal nodes: a ring all-reduce's two halves inside each node around an
    ``inter`` all-reduce of each shard ``j`` (``chunk_sizes(n, k)[j]`` elements)
    over ``g`` ranks, the ``k`` shards' all-reduces running side by side.
    Unequal nodes (the last one smaller): a naive reduce to each leader, an
    ``inter`` all-reduce of ``n`` among the ``g`` leaders, a naive broadcast.
    ``pipeline=S``: the same for each of the ``S`` segments ``chunk_sizes(n, S)``,
    one after another (the counts do not depend on whether a second thread
    overlaps them). ``level`` says where a transport's groups come from; here a
    group is ``ranks_per_node`` ranks whatever it names (a rack's ranks for ``"rack"``).

    Rank (node i, local j) sends ``2n - n_j - n_(j+1)`` elements and reduces
    ``n - n_(j-1)`` inside an equal node (the ring's counts), a leader ``k-1``
    whole buffers each way inside an unequal one.

    Only ``inter``'s totals are known here, not its per-rank or per-round counts,
    so the composition is exact when ``inter`` (1) runs the same rounds for every
    shard size, with messages that do not shrink as ``n`` grows, (2) ends in the
    same round on every rank, and (3) has cross rank 0 among its busiest ranks.
    ``ring``, ``recursive_doubling``, ``rabenseifner`` and ``tree`` are held to the
    ledger exactly. ``naive`` breaks (2): a node that finishes early overlaps its
    allgather with the others' inter rounds, so ``critical_bytes`` (and, with
    unequal nodes, ``rounds``) are upper bounds. ``dbtree`` breaks (1) and (3): its
    counts here are estimates.
    """
    _check_options(ranks_per_node, inter, pipeline, level)
    if p == 1:
        return ZERO
    parts = [_segment_cost(p, m, itemsize, ranks_per_node, inter)
             for m in chunk_sizes(n, pipeline)]
    costs = [cost for cost, _, _ in parts]
    k = len(parts[0][1])
    return Cost(
        rounds=sum(c.rounds for c in costs),
        messages=sum(c.messages for c in costs),
        bytes=sum(c.bytes for c in costs),
        max_rank_messages=sum(c.max_rank_messages for c in costs),
        max_rank_bytes=max(sum(sent[j] for _, sent, _ in parts) for j in range(k)),
        critical_bytes=sum(c.critical_bytes for c in costs),
        reduced=max(sum(reduced[j] for _, _, reduced in parts) for j in range(k)),
        formula=costs[0].formula + (f"; {pipeline} segments of n/{pipeline}, each all of it"
                                    if pipeline > 1 else ""),
    )


def _segment_cost(p: int, n: int, itemsize: int, ranks_per_node, inter: str):
    """Return one segment's ``(Cost, bytes each local rank sends, elements it reduces)``.

    The per-rank lists let :func:`hierarchical_allreduce_cost` find the busiest
    rank over every segment (which shard is largest changes from one to the next).
    """
    sizes, intra, across, inter_formula = _hierarchical_parts(p, n, itemsize, ranks_per_node,
                                                              inter)
    k, g = sizes[0], len(sizes)
    if len(set(sizes)) == 1:
        shards = chunk_sizes(n, k)
        # Rank j sends every shard but j (reduce-scatter) and but j+1 (allgather) inside its
        # node and reduces every shard but j-1; the shards' all-reduces run side by side.
        sent = [(2 * n - shards[j] - shards[(j + 1) % k]) * itemsize + across[j].max_rank_bytes
                for j in range(k)]
        reduced = [n - shards[j - 1] + across[j].reduced for j in range(k)]
        return Cost(
            rounds=intra[0].rounds + max(c.rounds for c in across),
            messages=sum(c.messages for c in intra) + sum(c.messages for c in across),
            bytes=sum(c.bytes for c in intra) + sum(c.bytes for c in across),
            max_rank_messages=(intra[0].max_rank_messages
                               + max(c.max_rank_messages for c in across)),
            max_rank_bytes=max(sent),
            critical_bytes=intra[0].critical_bytes + max(c.critical_bytes for c in across),
            reduced=max(reduced),
            formula=(f"k={k} ranks per node, g={g} nodes: 2(k-1)·α + 2((k-1)/k)·n·β "
                     f"+ ((k-1)/k)·n·γ inside the nodes + {inter} all-reduce of n/k over g "
                     f"[{inter_formula}, p=g, n=n/k]"),
        ), sent, reduced
    reduce_k, bcast_k = intra[0], intra[g]  # the first node is a full one: the slowest
    cost = Cost(
        rounds=reduce_k.rounds + across[0].rounds + bcast_k.rounds,
        messages=sum(c.messages for c in intra) + across[0].messages,
        bytes=sum(c.bytes for c in intra) + across[0].bytes,
        max_rank_messages=bcast_k.max_rank_messages + across[0].max_rank_messages,
        max_rank_bytes=bcast_k.max_rank_bytes + across[0].max_rank_bytes,
        critical_bytes=(reduce_k.critical_bytes + across[0].critical_bytes
                        + bcast_k.critical_bytes),
        reduced=reduce_k.reduced + across[0].reduced,
        formula=(f"nodes {'+'.join(map(str, sizes))} (unequal: leader-based), k={k}, g={g}: "
                 f"2(k-1)·α + 2(k-1)·n·β + (k-1)·n·γ inside the nodes + {inter} all-reduce "
                 f"of n over the g leaders [{inter_formula}, p=g]"),
    )
    return cost, [cost.max_rank_bytes], [cost.reduced]  # the leader is the busiest rank


def hierarchical_traffic(p: int, n: int, itemsize: int, *, ranks_per_node: int | None = None,
                         inter: str = "ring", pipeline: int = 1,
                         level: str = "node") -> tuple[int, int]:
    """Return the hierarchical all-reduce's ``(intra-node bytes, inter-node bytes)``.

    Every byte of the inter phase crosses nodes and no other byte does, so with
    ``g`` nodes of ``k`` ranks and ``inter="ring"`` the inter-node total is
    ``2(g-1)·n`` bytes·itemsize (each rank sends ``2((g-1)/g)·(n/k)``), and the
    intra-node total ``2g(k-1)·n``, summed over the segments of a pipeline.
    :func:`node_traffic` measures the same split on a ledger.
    """
    if p == 1:
        return 0, 0
    intra_bytes = inter_bytes = 0
    for m in chunk_sizes(n, pipeline):
        _, intra, across, _ = _hierarchical_parts(p, m, itemsize, ranks_per_node, inter)
        intra_bytes += sum(c.bytes for c in intra)
        inter_bytes += sum(c.bytes for c in across)
    return intra_bytes, inter_bytes


# ------------------------------------------------------------ cluster pricing

def hierarchical_price(shape, count: int, itemsize: int, *, inter: str = "ring",
                       pipeline: int = 1, level: str = "node",
                       ranks_per_node: int | None = None) -> list[LinkCost]:
    """Price the two levels on a cluster: ring halves inside the nodes, ``inter`` across them.

    With ``g`` ranks a node and ``m`` nodes each rank sends ``(g-1)/g·n`` in each
    ring half and its shard's ``inter`` all-reduce across nodes (``2(m-1)/m·n/g``
    for a ring). ``pipeline=S``: the phases of one segment of ``n/S``, marked as
    overlapping over ``S`` segments: the phases inside the groups run on the
    caller's thread, one stage, and the phase across on the other.

    Without racks, ``level`` and ``ranks_per_node`` are taken as the call takes
    them: ``shape`` says what the groups are. On a shape with racks, groups of
    a rack's ranks (``level="rack"``, or ``ranks_per_node`` = the ranks of a
    rack) ring inside each rack over the nodes' links and run ``inter`` across
    the racks, every rank of a rack at once on its uplink (:func:`_rack_groups`);
    groups of a node run ``inter`` among the nodes, crossing the racks as that
    algorithm does (:func:`~refcoll.algorithms.registry.over_racks`).
    """
    g, m = shape.per_node, shape.nodes
    if shape.racks > 1 and (level == "rack" or ranks_per_node == shape.rack_ranks):
        return _rack_groups(shape, count, itemsize, inter, pipeline)
    segment = max_chunk(count, pipeline)
    shard = max_chunk(segment, g)
    across_algo = _across(shape, inter)
    if shape.racks > 1 and across_algo.price is not None:
        across = over_racks(across_algo.price(shape.among_nodes(), shard, itemsize), shape,
                            parallel=g, segments=pipeline)
    else:
        across = [LinkCost(f"inter {inter} all-reduce", "inter",
                           across_algo.flat_cost(m, shard, itemsize), pipeline, stage="across")]
    return [LinkCost("intra reduce-scatter", "intra",
                     ring_reduce_scatter_cost(g, segment, itemsize), pipeline, stage="inside"),
            *across,
            LinkCost("intra allgather", "intra", ring_allgather_cost(g, shard, itemsize),
                     pipeline, stage="inside")]


def _across(shape, inter: str):
    """Return the record of the algorithm across the groups, refused where it cannot run."""
    across_algo = get(inter)
    if across_algo.needs_in_network and not shape.in_network:
        usable = [a.name for a in REGISTRY.values() if a.across_nodes and not a.needs_in_network]
        raise UsageError(f"inter-node algorithm {inter!r} (--inter) needs in-network "
                         f"reduction: add --in-network, or choose one of {', '.join(usable)}")
    return across_algo


def _rack_groups(shape, count: int, itemsize: int, inter: str, pipeline: int) -> list[LinkCost]:
    """Price groups of a rack's ranks: the ring halves cross the nodes' links inside the
    rack (one flow a link, as a flat ring), and each rank's shard crosses the racks in
    ``inter``, all ``G`` ranks of a rack at once: ``G`` flows on its uplink."""
    group, racks = shape.rack_ranks, shape.racks
    segment = max_chunk(count, pipeline)
    shard = max_chunk(segment, group)
    inside = "flat" if shape.per_rack > 1 else "intra"
    return [LinkCost("rack reduce-scatter", inside,
                     ring_reduce_scatter_cost(group, segment, itemsize), pipeline, stage="inside"),
            LinkCost(f"inter-rack {inter} all-reduce", "inter",
                     _across(shape, inter).flat_cost(racks, shard, itemsize), pipeline,
                     uplink=group, stage="across"),
            LinkCost("rack allgather", inside, ring_allgather_cost(group, shard, itemsize),
                     pipeline, stage="inside")]


def hierarchical_replayable(t, *, ranks_per_node: int | None = None, inter: str = "ring",
                            pipeline: int = 1, level: str = "node") -> bool:
    """Return whether a plan may record this all-reduce on ``t`` and replay it.

    On equal nodes the ring halves and a replayable ``inter`` algorithm touch
    the data only through the transports (the phases' sub-transports recorded
    into one schedule); the leader-based schedule of unequal nodes copies
    locally, so it runs again at every call. Asked after the call has split
    ``t`` (or, for a plan made before any call, splitting it: every rank makes
    the plan).
    """
    if inter == "hierarchical" or get(inter).replayable is not True:
        return False
    if level == "node" and ranks_per_node is None and not hasattr(t, "split_node"):
        return False
    return node_layout(t, ranks_per_node, level).equal


def hierarchical_orders(collective: str, p: int) -> list[dict]:
    """Return the node shapes and across-node algorithms that order ``p`` ranks distinctly.

    Every proper divisor of ``p`` as the node size, with each algorithm that may
    run across nodes (in-network ones need switches the ranks do not have).
    """
    across = [a.name for a in REGISTRY.values() if a.across_nodes and not a.needs_in_network]
    return [{}] + [{"ranks_per_node": k, "inter": name}
                   for k in range(2, p) if p % k == 0 for name in across]


register(Algorithm(
    "hierarchical",
    "ring reduce-scatter in each node, all-reduce across nodes, ring allgather in each node",
    {"allreduce": hierarchical_allreduce},
    {"allreduce": hierarchical_allreduce_cost},
    "spec/hierarchical.md",
    order=20,
    battery_options=({"ranks_per_node": 2}, {"ranks_per_node": 3}, {},
                     {"ranks_per_node": 2, "pipeline": 3}),
    vector_variants=({"ranks_per_node": 2}, {"ranks_per_node": 3}),
    node_option="ranks_per_node",
    node_traffic=hierarchical_traffic,
    price=hierarchical_price,
    orders=hierarchical_orders,
    replayable=hierarchical_replayable,
))
