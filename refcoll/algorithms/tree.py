"""Binomial tree collectives: MPICH's binomial reduce and broadcast, and their all-reduce.

**Binomial tree** (MPICH ``reduce/reduce_intra_binomial.c`` and
``bcast/bcast_intra_binomial.c``; Thakur, Rabenseifner and Gropp 2005). Ranks
are renumbered by their *position* ``(rank - root) % p``, so the root is
position 0. Position ``q`` with lowest set bit ``2^j`` has parent ``q - 2^j``
and children ``q+1, q+2, ..., q+2^(j-1)`` (those below ``p``). With ``p = 5``,
root 0::

    0 ── 1          reduce:     step 1: 1->0, 3->2     broadcast: step 1: 0->4
    ├── 2 ── 3                  step 2: 2->0                      step 2: 0->2
    └── 4                       step 3: 4->0                      step 3: 0->1, 2->3

**k-nomial trees** (options ``radix``, ``subtrees``, ``first``; the shapes are in
:mod:`~refcoll.algorithms.knomial`): MPICH's ``knomial_1`` and ``knomial_2`` trees
of any radix (``src/mpi/coll/algorithms/treealgo/treeutil.c``, folded as
``allreduce_intra_tree.c`` does). With ``p = 4``, root 0 (``+`` the op)::

    default (binomial)             (x0+x1)+(x2+x3)      MPICH reduce_intra_binomial.c
    first="farthest"               (x0+(x2+x3))+x1      MPICH tree, knomial_2, k = 2
    subtrees="shrinking"           (x0+(x1+x2))+x3      MPICH tree, knomial_1, k = 2 (its default)
    radix=3, subtrees="shrinking"  x0+((x1+x2)+x3)      MPICH tree, knomial_1, k = 3
    radix=3, first="farthest"      ((x0+x3)+x2)+x1      MPICH tree, knomial_2, k = 3

**k-ary trees** (option ``shape``): ``shape="kary"``, MPICH's heap-ordered k-ary
tree (``treeutil.c``, ``MPII_Treeutil_tree_kary_init``; children of ``q`` are
``k·q+1 .. k·q+k``), and ``shape="strided"``, the level-by-level k-ary tree of Open
MPI's binary reduce (``coll_base_topo.c``, ``ompi_coll_base_topo_build_tree``;
``coll_base_reduce.c``, ``ompi_coll_base_reduce_intra_binary``), both folded
nearest child first, as the two libraries do. With ``p = 4``, ``radix=2``, both are
``(x0+(x1+x3))+x2``; they part from ``p = 5`` on.

Their cost: the root receives (reduce) or sends (broadcast) the whole buffer to
each of its up to ``(k-1)·⌈log_k p⌉`` children, one a round; taking the largest
subtree first, as MPICH does, makes the root wait for it, so the rounds exceed
the binomial tree's (6 against 3 for knomial_1 at p = 8). The cost functions
replay such a tree's schedule exactly.

Segments: every function takes ``segment``, the most elements one message
carries; a buffer (a half, for the double tree) is cut into
``S = ceil(n / segment)`` pieces by :func:`~refcoll.core.chunking.chunk_bounds`, which
flow through the tree one after another. Defaults: no segmentation for the
binomial tree (MPICH's choice: its root sends the whole buffer ``⌈log2 p⌉``
times however it is cut, so pieces only add α); the double binary tree
(:mod:`~refcoll.algorithms.dbtree`) pipelines its segments.

Spec: spec/tree.md
"""

from __future__ import annotations

import numpy as np

from ..core.chunking import chunk_bounds
from ..core.cost import ZERO, Cost
from ..core.errors import UsageError
from ._util import copy_into, is_count, workspace
from .knomial import (
    FIRSTS,
    SHAPES,
    SUBTREES,
    check_tree_options,
    distinct_orders,
    largest_first,
    node_children,
    node_parent,
    replay_cost,
)
from .registry import Algorithm, LinkCost, over_racks, register

__all__ = [
    "segment_bounds",
    "tree_reduce_steps",
    "tree_broadcast_steps",
    "tree_position",
    "tree_rank",
    "binomial_parent",
    "binomial_children",
    "tree_reduce",
    "tree_broadcast",
    "tree_allreduce",
    "tree_reduce_cost",
    "tree_broadcast_cost",
    "tree_allreduce_cost",
    "tree_price",
    "tree_links",
    "tree_orders",
]



def segment_bounds(n: int, segment: int | None) -> list[tuple[int, int]]:
    """Return the pipeline pieces of ``n`` elements, at most ``segment`` each.

    ``S = ceil(n / segment)`` pieces cut by the one chunking rule
    (:func:`~refcoll.core.chunking.chunk_bounds`), so they differ by at most one
    element, the longer ones first. ``segment=None``: one piece. ``n == 0``: no
    pieces at all (nothing moves).
    """
    if segment is not None and (not is_count(segment) or segment < 1):
        raise UsageError(f"segment must be a positive element count or None, got {segment!r}")
    if n == 0:
        return []
    if segment is None:
        return [(0, n)]
    return chunk_bounds(n, -(-n // segment))


# ------------------------------------------------------------- steps of any tree

def tree_reduce_steps(t, x: np.ndarray, *, op, parent: int | None, left, right, segments,
                      target, scratch, tag: int = 0) -> None:
    """Reduce ``x`` up a tree, one segment after another.

    For each segment ``[start, stop)``: receive the partial of each child in
    ``left`` and then ``right`` (in list order) into ``scratch``, fold it into
    ``target(start, stop)``: a ``left`` child's partial on the left of ours, a
    ``right`` child's on the right; then send our partial to ``parent``. A leaf
    sends straight from ``x``; ``target`` is only written by ranks with children
    (and by a lone root, which copies ``x`` there).

    Reduction order: ``acc = L op acc`` for each ``left`` child, then
    ``acc = acc op R`` for each ``right`` child, in list order, starting from
    ``acc = x``. With at most one left child (every tree here) a rank's partial
    is ``L op x op R1 op R2 ...`` folded left to right.
    """
    for start, stop in segments:
        partial = x[start:stop]
        for child in left:
            incoming = scratch[: stop - start]
            t.recv(incoming, child, tag)  # left subtree's partial of this segment <- child
            acc = target(start, stop)
            t.reduce_local(op, incoming, partial, acc)
            partial = acc
        for child in right:
            incoming = scratch[: stop - start]
            t.recv(incoming, child, tag)  # right subtree's partial of this segment <- child
            acc = target(start, stop)
            t.reduce_local(op, partial, incoming, acc)
            partial = acc
        if parent is not None:
            t.send(partial, parent, tag)  # our subtree's partial of this segment -> parent
        elif not left and not right:
            copy_into(target(start, stop), partial)  # a tree of one rank: the input is the result


def tree_broadcast_steps(t, buf: np.ndarray, *, parent: int | None, children, segments,
                         tag: int = 0) -> None:
    """Broadcast ``buf`` in place down a tree: per segment, receive from the parent, then
    send to each child in list order."""
    for start, stop in segments:
        piece = buf[start:stop]
        if parent is not None:
            t.recv(piece, parent, tag)  # this segment <- parent
        for child in children:
            t.send(piece, child, tag)  # this segment -> child


# ------------------------------------------------------------------ binomial tree

def tree_position(rank: int, size: int, root: int) -> int:
    """Return ``rank``'s position in a tree rooted at ``root``: ``(rank - root) % size``."""
    return (rank - root) % size


def tree_rank(position: int, size: int, root: int) -> int:
    """Return the rank at ``position`` of a tree rooted at ``root`` (inverse of tree_position)."""
    return (position + root) % size


def lowest_bit(position: int, size: int) -> int:
    """Return the lowest set bit of ``position``; for 0, the first power of two >= size."""
    mask = 1
    while mask < size and not position & mask:
        mask <<= 1
    return mask


def binomial_parent(rank: int, size: int, root: int) -> int | None:
    """Return the parent in the binomial tree rooted at ``root``: position ``q - lowbit(q)``.

    ``None`` for the root.
    """
    position = tree_position(rank, size, root)
    if position == 0:
        return None
    return tree_rank(position - lowest_bit(position, size), size, root)


def binomial_children(rank: int, size: int, root: int) -> list[int]:
    """Return the children, nearest first: positions ``q+1, q+2, q+4, ...`` below ``lowbit(q)``
    and below ``size``.

    The child at ``q + m`` roots the subtree of positions ``q+m .. q+2m-1`` (cut
    at ``size``), so the root has ``⌈log2 size⌉`` children.
    """
    position = tree_position(rank, size, root)
    lowest = lowest_bit(position, size)
    children = []
    mask = 1
    while mask < lowest and position + mask < size:
        children.append(tree_rank(position + mask, size, root))
        mask <<= 1
    return children


def tree_links(rank: int, size: int, root: int = 0, *, radix: int = 2,
               subtrees: str = "growing", first: str = "nearest",
               shape: str = "knomial") -> tuple[int | None, list[int]]:
    """Return ``(parent, children)`` of ``rank`` in the tree rooted at ``root``, as ranks.

    The children are in the order ``first`` gives (:mod:`~refcoll.algorithms.knomial`);
    the defaults are the binomial tree (:func:`binomial_parent`, :func:`binomial_children`).
    """
    position = tree_position(rank, size, root)
    parent = node_parent(position, size, radix, subtrees, shape)
    children = node_children(position, size, radix, subtrees, first, shape)
    return (None if parent is None else tree_rank(parent, size, root),
            [tree_rank(c, size, root) for c in children])


def tree_reduce(t, x: np.ndarray, out: np.ndarray | None, *, op, root: int = 0,
                segment: int | None = None, radix: int = 2, subtrees: str = "growing",
                first: str = "nearest", shape: str = "knomial") -> None:
    """Binomial-tree (or k-nomial, or k-ary) reduce to any root, optionally pipelined in segments.

    Schedule (q = this rank's position, per segment in order): receive the
      partials of children ``q+1, q+2, q+4, ...`` in that order and fold each on
      the right of ours, then send to parent ``q - lowbit(q)``.
    Reduction order: positions ``0, 1, ..., p-1`` (ranks ``root, root+1, ...,
      root-1``) left to right, bracketed by the tree: ``((x0 op x1) op (x2 op x3))
      op x4`` for p = 5, root 0.
    Cost: ⌈log2 p⌉·α + ⌈log2 p⌉·n·β + ⌈log2 p⌉·n·γ (MPICH's binomial reduce,
      Thakur et al. 2005); with S segments ⌈log2 p⌉·S·α and the same β and γ terms.
    Restrictions: none. Any p: positions past p-1 do not exist, so the last
      subtrees are cut short. ``n == 0``: nothing moves. ``p == 1``: a copy.
      ``out`` is written on the root only; other ranks keep their partial in a
      segment-sized workspace.
    Options ``radix``, ``subtrees``, ``first``: a k-nomial tree instead
      (:mod:`~refcoll.algorithms.knomial`), its children folded in the order
      ``first`` gives, each on the right of the partial.
    Option ``shape``: ``"kary"`` (MPICH's k-ary tree) or ``"strided"`` (Open MPI's
      binary reduce for ``radix=2``), children folded nearest first.   Spec: spec/tree.md
    """
    check_tree_options(radix, subtrees, first, shape)
    size, rank = t.size, t.rank
    segments = segment_bounds(x.size, segment)
    largest = max((stop - start for start, stop in segments), default=0)
    scratch = workspace(t, largest, x.dtype, slot=0)
    if rank == root:
        target = lambda start, stop: out[start:stop]  # noqa: E731 - the result
    else:
        partial = workspace(t, largest, x.dtype, slot=1)
        target = lambda start, stop: partial[: stop - start]  # noqa: E731 - reused per segment
    parent, children = tree_links(rank, size, root, radix=radix, subtrees=subtrees, first=first,
                                  shape=shape)
    tree_reduce_steps(t, x, op=op, parent=parent, left=(), right=children, segments=segments,
                      target=target, scratch=scratch)


def tree_broadcast(t, buf: np.ndarray, *, root: int = 0, segment: int | None = None,
                   radix: int = 2, subtrees: str = "growing", shape: str = "knomial") -> None:
    """Binomial-tree broadcast from any root, in place, optionally pipelined in segments.

    Schedule (per segment in order): receive it from parent ``q - lowbit(q)``,
      then send it to children ``..., q+4, q+2, q+1``: the largest subtree first,
      as MPICH does.
    Cost: ⌈log2 p⌉·α + ⌈log2 p⌉·n·β (MPICH's binomial broadcast); with S
      segments ⌈log2 p⌉·S·α + ⌈log2 p⌉·n·β.
    Restrictions: none (any p; ``n == 0``: nothing moves; ``p == 1``: nothing).
    Options ``radix``, ``subtrees``: a k-nomial tree, its children sent to
      largest subtree first, as MPICH's tree algorithms do. Option ``shape``: a k-ary
      tree, children sent to nearest (the largest subtree) first.   Spec: spec/tree.md
    """
    check_tree_options(radix, subtrees, "nearest", shape)
    size, rank = t.size, t.rank
    parent, children = tree_links(rank, size, root, radix=radix, subtrees=subtrees,
                                  first=largest_first(subtrees, shape), shape=shape)
    tree_broadcast_steps(t, buf, parent=parent, children=children,
                         segments=segment_bounds(buf.size, segment))


def tree_allreduce(t, x: np.ndarray, out: np.ndarray, *, op, segment: int | None = None,
                   radix: int = 2, subtrees: str = "growing", first: str = "nearest",
                   shape: str = "knomial") -> None:
    """Tree all-reduce: binomial reduce to rank 0, then binomial broadcast from rank 0.

    Every rank folds its partials straight into ``out`` (the broadcast then
    overwrites it), so no input is copied and no workspace but one segment of
    scratch is needed.
    Reduction order: ``x0 op x1 op ... op x(p-1)`` left to right, bracketed by
      the binomial tree, the same bits on every rank.
    Cost: 2⌈log2 p⌉·α + 2⌈log2 p⌉·n·β + ⌈log2 p⌉·n·γ (MPICH's reduce +
      broadcast); with S segments 2⌈log2 p⌉·S·α. Few rounds, not
      bandwidth-optimal: for long messages use ``ring`` or ``rabenseifner``.
    Restrictions: none, as :func:`tree_reduce`.
    Options ``radix``, ``subtrees``, ``first``: MPICH's ``tree`` all-reduce
      (``allreduce_intra_tree.c``) on its ``knomial_1`` (``subtrees="shrinking"``) or
      ``knomial_2`` (``first="farthest"``) tree of radix ``MPIR_CVAR_ALLREDUCE_TREE_KVAL``;
      the broadcast sends to the largest subtree first. ``shape="kary"``: MPICH's tree
      all-reduce on its ``kary`` tree (``MPIR_CVAR_ALLREDUCE_TREE_TYPE=kary``), children
      folded nearest first.   Spec: spec/tree.md
    """
    check_tree_options(radix, subtrees, first, shape)
    size, rank = t.size, t.rank
    segments = segment_bounds(x.size, segment)
    largest = max((stop - start for start, stop in segments), default=0)
    parent, children = tree_links(rank, size, 0, radix=radix, subtrees=subtrees, first=first,
                                  shape=shape)
    tree_reduce_steps(t, x, op=op, parent=parent, left=(), right=children, segments=segments,
                      target=lambda start, stop: out[start:stop],
                      scratch=workspace(t, largest, x.dtype))
    down = tree_links(rank, size, 0, radix=radix, subtrees=subtrees,
                      first=largest_first(subtrees, shape), shape=shape)[1]
    tree_broadcast_steps(t, out, parent=parent, children=down, segments=segments)


# ------------------------------------------------------------------ cost
#
# Binomial trees (MPICH; Thakur, Rabenseifner and Gropp 2005): the root of a
# reduce receives ⌈lg p⌉ partials per segment, and of a broadcast sends ⌈lg p⌉
# copies, one per round. With S = ⌈n/segment⌉ segments (1 unsegmented; 0 when
# n = 0, and nothing moves) the root is busy in each of the ⌈lg p⌉·S rounds, and
# the largest message of each round is the root's current segment, so the β term
# stays ⌈lg p⌉·n however the buffer is cut.

def _segment_count(n: int, segment: int | None) -> int:
    return len(segment_bounds(n, segment))


def _knomial(radix: int, subtrees: str, first: str, shape: str) -> bool:
    """Return whether the options name a tree other than the binomial one (then: replayed)."""
    check_tree_options(radix, subtrees, first, shape)
    return (radix, subtrees, first, shape) != (2, SUBTREES[0], FIRSTS[0], SHAPES[0])


def _tree_programs(p: int, n: int, segment, radix: int, subtrees: str, first: str, shape: str,
                   phases: tuple[str, ...]):
    """Return every rank's calls (:func:`~refcoll.algorithms.knomial.replay_cost`) and γ.

    ``phases``: ``"reduce"`` (per segment: a receive from each child in ``first``
    order, then a send to the parent) and ``"broadcast"`` (per segment: a receive
    from the parent, then a send to each child, largest subtree first), in order.
    """
    segments = segment_bounds(n, segment)
    programs, reduced = [[] for _ in range(p)], [0] * p
    for rank in range(p):
        for phase in phases:
            order = first if phase == "reduce" else largest_first(subtrees, shape)
            parent, children = tree_links(rank, p, 0, radix=radix, subtrees=subtrees, first=order,
                                          shape=shape)
            for start, stop in segments:
                size = stop - start
                if phase == "reduce":
                    programs[rank] += [[("recv", child, size)] for child in children]
                    reduced[rank] += size * len(children)
                    programs[rank] += [[("send", parent, size)]] if parent is not None else []
                else:
                    programs[rank] += [[("recv", parent, size)]] if parent is not None else []
                    programs[rank] += [[("send", child, size)] for child in children]
    return programs, max(reduced)


def _knomial_cost(p, n, itemsize, segment, radix, subtrees, first, shape, phases,
                  formula) -> Cost:
    if p == 1:
        return ZERO
    programs, reduced = _tree_programs(p, n, segment, radix, subtrees, first, shape, phases)
    return replay_cost(programs, itemsize, reduced, formula)


_KNOMIAL = "the root's partials of n (k-nomial: (k-1)·⌈log_k p⌉; k-ary: k), rounds replayed"


def tree_reduce_cost(p: int, n: int, itemsize: int, *, segment: int | None = None,
                     radix: int = 2, subtrees: str = "growing", first: str = "nearest",
                     shape: str = "knomial") -> Cost:
    """Binomial reduce: ``⌈lg p⌉·S`` rounds; the root folds ``⌈lg p⌉`` whole buffers.

    A k-nomial or k-ary tree (any other options): its schedule replayed exactly.
    """
    if _knomial(radix, subtrees, first, shape):
        return _knomial_cost(p, n, itemsize, segment, radix, subtrees, first, shape,
                             ("reduce",), "tree reduce: " + _KNOMIAL)
    if p == 1:
        return ZERO
    segments = _segment_count(n, segment)
    lg, b = (p - 1).bit_length(), n * itemsize
    return Cost(rounds=lg * segments, messages=(p - 1) * segments, bytes=(p - 1) * b,
                max_rank_messages=segments, max_rank_bytes=b, critical_bytes=lg * b,
                reduced=lg * n,
                formula="⌈lg p⌉·S·α + ⌈lg p⌉·n·β + ⌈lg p⌉·n·γ (S segments; 1 unsegmented)")


def tree_broadcast_cost(p: int, n: int, itemsize: int, *, segment: int | None = None,
                        radix: int = 2, subtrees: str = "growing",
                        shape: str = "knomial") -> Cost:
    """Binomial broadcast: ``⌈lg p⌉·S`` rounds; the root sends ``⌈lg p⌉`` whole buffers.

    A k-nomial or k-ary tree: its schedule replayed exactly.
    """
    if _knomial(radix, subtrees, "nearest", shape):
        return _knomial_cost(p, n, itemsize, segment, radix, subtrees, "nearest", shape,
                             ("broadcast",), "tree broadcast: a copy of n to each child, replayed")
    if p == 1:
        return ZERO
    segments = _segment_count(n, segment)
    lg, b = (p - 1).bit_length(), n * itemsize
    return Cost(rounds=lg * segments, messages=(p - 1) * segments, bytes=(p - 1) * b,
                max_rank_messages=lg * segments, max_rank_bytes=lg * b, critical_bytes=lg * b,
                reduced=0, formula="⌈lg p⌉·S·α + ⌈lg p⌉·n·β (S segments; 1 unsegmented)")


def tree_allreduce_cost(p: int, n: int, itemsize: int, *, segment: int | None = None,
                        radix: int = 2, subtrees: str = "growing",
                        first: str = "nearest", shape: str = "knomial") -> Cost:
    """Binomial reduce to rank 0, then binomial broadcast: the two add up round for round.

    The broadcast starts when the root has its result, so its rounds follow the
    reduce's. A rank at position q sends ``S`` messages up and ``S`` to each of
    its ``c(q) < ⌈lg p⌉`` children, so the root, with ``⌈lg p⌉·S``, is the busiest.
    A k-nomial or k-ary tree: its schedule replayed exactly.
    """
    if _knomial(radix, subtrees, first, shape):
        return _knomial_cost(p, n, itemsize, segment, radix, subtrees, first, shape,
                             ("reduce", "broadcast"), "tree reduce + broadcast: 2·" + _KNOMIAL)
    if p == 1:
        return ZERO
    segments = _segment_count(n, segment)
    lg, b = (p - 1).bit_length(), n * itemsize
    return Cost(rounds=2 * lg * segments, messages=2 * (p - 1) * segments,
                bytes=2 * (p - 1) * b, max_rank_messages=lg * segments, max_rank_bytes=lg * b,
                critical_bytes=2 * lg * b, reduced=lg * n,
                formula="2⌈lg p⌉·S·α + 2⌈lg p⌉·n·β + ⌈lg p⌉·n·γ (S segments; 1 unsegmented)")


def tree_price(shape, count: int, itemsize: int, *, inter: str = "ring") -> list[LinkCost]:
    """Price it on a cluster: when the levels split, inside the nodes, then across, then back.

    On racks the part across nodes is the same tree among the nodes, priced with
    the racks as its nodes (:func:`~refcoll.algorithms.registry.over_racks`).
    """
    g, m, levels = shape.per_node, shape.nodes, shape.levels()
    if shape.racks > 1 and g == 1:  # one rank a node: the racks are the only split
        return over_racks(tree_price(shape.among_nodes(), count, itemsize), shape)
    p = shape.ranks
    if levels != "split":
        uplink = shape.all_cross
        return [LinkCost("binomial reduce", levels, tree_reduce_cost(p, count, itemsize),
                         uplink=uplink),
                LinkCost("binomial broadcast", levels, tree_broadcast_cost(p, count, itemsize),
                         uplink=uplink)]
    if shape.racks > 1:
        across = over_racks(tree_price(shape.among_nodes(), count, itemsize), shape)
    else:
        across = [LinkCost("inter reduce", "inter", tree_reduce_cost(m, count, itemsize)),
                  LinkCost("inter broadcast", "inter", tree_broadcast_cost(m, count, itemsize))]
    return [LinkCost("intra reduce", "intra", tree_reduce_cost(g, count, itemsize)), *across,
            LinkCost("intra broadcast", "intra", tree_broadcast_cost(g, count, itemsize))]


def tree_orders(collective: str, p: int) -> list[dict]:
    """Return the option sets whose reduction orders differ on ``p`` ranks (the first ``{}``).

    MPICH's ``knomial_1`` (``subtrees="shrinking"``) and ``knomial_2``
    (``first="farthest"``) trees of radix 2, 3 and 4, MPICH's binary ``kary`` tree and
    Open MPI's binary ``strided`` one, each kept only when its fold differs from every
    one before it (:func:`~refcoll.algorithms.knomial.distinct_orders`); a broadcast
    reduces nothing.
    """
    return [{}] if collective == "broadcast" else distinct_orders(p)


register(Algorithm(
    "tree",
    "binomial reduce to rank 0 + binomial broadcast (MPICH): 2⌈lg p⌉ rounds of the whole buffer",
    {
        "allreduce": tree_allreduce,
        "reduce": tree_reduce,
        "broadcast": tree_broadcast,
    },
    {
        "allreduce": tree_allreduce_cost,
        "reduce": tree_reduce_cost,
        "broadcast": tree_broadcast_cost,
    },
    "spec/tree.md",
    order=50,
    battery_options=({}, {"segment": 1024}),
    vector_variants=({}, {"segment": 4}),
    replayable=True,
    auto=True,
    price=tree_price,
    across_nodes=True,
    orders=tree_orders,
))
