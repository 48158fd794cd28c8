"""NCCL's double binary tree all-reduce: two complementary trees, a half of the buffer each.

**Double binary tree** (Sanders, Speck and Träff 2009; NCCL's ``ncclGetBtree``
and ``ncclGetDtree`` in ``src/graph/trees.cc``): two binary trees over all
ranks, each carrying half the buffer. Tree 0 is NCCL's in-order "balanced" tree
rooted at rank 0, whose leaves are the odd ranks; tree 1 is its mirror
``r -> p-1-r`` when ``p`` is even and its shift ``r -> r+1`` when ``p`` is odd.
So a rank that is a leaf of one tree is interior in the other, and every rank
has at most two children over both trees together (the one exception to "interior
in one tree only" is rank 0 for odd ``p``: the root of tree 0 with one child, and
an interior node with one child in tree 1). With ``p = 6``::

    tree 0:  0 ── 4 ┬─ 2 ┬─ 1        tree 1:  5 ── 1 ┬─ 3 ┬─ 4
                    │    └─ 3                        │    └─ 2
                    └─ 5                             └─ 0

Each half is cut into segments of :data:`DBTREE_SEGMENT` elements (by default)
that flow up each tree (a pipelined reduce) and back down (a pipelined
broadcast), the steps of :mod:`~refcoll.algorithms.tree`.

Spec: spec/double_binary_tree.md
"""

from __future__ import annotations

import functools
from typing import Iterator

import numpy as np

from ..core.chunking import chunk_bounds
from ..core.cost import ZERO, Cost, lamport_replay
from ._util import copy_into, workspace
from .registry import Algorithm, LinkCost, register
from .tree import lowest_bit, segment_bounds, tree_broadcast_steps, tree_reduce_steps

__all__ = [
    "DBTREE_SEGMENT",
    "btree_links",
    "dbtree_position",
    "dbtree_rank",
    "dbtree_links",
    "dbtree_messages",
    "dbtree_allreduce",
    "dbtree_allreduce_cost",
    "dbtree_model_cost",
    "dbtree_price",
    "rack_crossings",
]

#: Elements per pipeline segment of the double binary tree when the caller gives
#: none (256 KiB of float32); halves up to this size move in one piece.
DBTREE_SEGMENT = 1 << 16


def btree_links(position: int, size: int) -> tuple[int | None, list[int]]:
    """Return ``(parent, children)`` of a position in NCCL's in-order binary tree.

    Position 0 is the root; its one child is the largest power of two below
    ``size``. Position ``q`` with lowest set bit ``b`` has parent ``(q ^ b) | 2b``,
    or ``q ^ b`` when that is past the end, and children ``q - b/2`` and the
    first of ``q + b/2, q + b/4, ..., q + 1`` below ``size``; odd positions are
    leaves. In order: a left subtree holds smaller positions, a right one larger.
    Children are listed left first.
    """
    if position == 0:
        return None, ([lowest_bit(0, size) >> 1] if size > 1 else [])
    bit = lowest_bit(position, size)
    parent = (position ^ bit) | (bit << 1)
    if parent >= size:
        parent = position ^ bit
    half = bit >> 1
    if not half:
        return parent, []
    children = [position - half]
    while half and position + half >= size:
        half >>= 1
    if half:
        children.append(position + half)
    return parent, children


def dbtree_position(rank: int, size: int, tree: int) -> int:
    """Return ``rank``'s position in tree 0 (the rank itself) or tree 1 (mirror / shift)."""
    if tree == 0:
        return rank
    return size - 1 - rank if size % 2 == 0 else (rank - 1) % size


def dbtree_rank(position: int, size: int, tree: int) -> int:
    """Return the rank at ``position`` of tree 0 or 1 (inverse of :func:`dbtree_position`)."""
    if tree == 0:
        return position
    return size - 1 - position if size % 2 == 0 else (position + 1) % size


def dbtree_links(rank: int, size: int, tree: int) -> tuple[int | None, list[int], list[int]]:
    """Return ``(parent, left, right)`` of ``rank`` in tree ``tree`` (0 or 1), as ranks.

    ``left`` and ``right`` hold the child (at most one each) whose subtree comes
    before, and after, this rank in the tree's position order; the root has only
    a right child.
    """
    position = dbtree_position(rank, size, tree)
    parent, children = btree_links(position, size)
    ranks = {q: dbtree_rank(q, size, tree) for q in children}
    return (None if parent is None else dbtree_rank(parent, size, tree),
            [ranks[q] for q in children if q < position],
            [ranks[q] for q in children if q > position])


def _btree_orders(size: int) -> tuple[list[int], list[int]]:
    """Return the positions of the in-order binary tree in pre-order and in post-order."""
    pre, post = [], []

    def visit(position: int) -> None:
        pre.append(position)
        for child in btree_links(position, size)[1]:
            visit(child)
        post.append(position)

    visit(0)
    return pre, post


def _half_segments(n: int, segment: int | None) -> list[list[tuple[int, int]]]:
    """Return the segments of each half: tree ``h`` carries ``chunk_bounds(n, 2)[h]``."""
    return [[(lo + start, lo + stop) for start, stop in segment_bounds(hi - lo, segment)]
            for lo, hi in chunk_bounds(n, 2)]


def dbtree_messages(size: int, n: int, segment: int | None = DBTREE_SEGMENT
                    ) -> Iterator[tuple[int, str, int, int, int]]:
    """Yield every message of :func:`dbtree_allreduce`: ``(tree, phase, source, dest, elements)``.

    ``phase`` is ``"reduce"`` (a partial going up) or ``"broadcast"``.

    The order is one global order in which every rank meets its own sends and
    receives in program order (that is why the schedule cannot deadlock): tree 0
    then tree 1; in each, the reduce of every segment, children before parents
    (post-order), then the broadcast of every segment, parents before children
    (pre-order). Replaying it with the simulator's clock rule gives the ledger.
    """
    if size == 1:
        return
    pre, post = _btree_orders(size)
    parent = {q: btree_links(q, size)[0] for q in pre}
    for tree, segments in enumerate(_half_segments(n, segment)):
        ranks = [dbtree_rank(q, size, tree) for q in range(size)]
        for start, stop in segments:
            for q in post[:-1]:  # the root (last in post-order) sends nothing up
                yield tree, "reduce", ranks[q], ranks[parent[q]], stop - start  # partial up
        for start, stop in segments:
            for q in pre[1:]:
                yield tree, "broadcast", ranks[parent[q]], ranks[q], stop - start  # result down


def dbtree_allreduce(t, x: np.ndarray, out: np.ndarray, *, op,
                     segment: int | None = DBTREE_SEGMENT) -> None:
    """Double-binary-tree all-reduce (NCCL's ``TREE``): each tree reduces and broadcasts a half.

    Schedule: half ``h = chunk_bounds(n, 2)[h]`` belongs to tree ``h``. For tree 0,
      then tree 1: for each segment of the half, receive the left child's
      partial, then the right child's, fold, send to the parent (the reduce);
      then for each segment, receive it from the parent and send it to the left
      child, then the right one (the broadcast). Tag ``h`` marks tree ``h``.
      A rank that is a leaf of a tree only sends its input up and receives the
      result; its work is in the other tree. NCCL runs the two trees at once on
      separate channels; with one blocking thread per rank refcoll runs them one
      after another, which keeps the order global (see :func:`dbtree_messages`),
      and therefore free of deadlock under rendezvous sends.
    Reduction order: half ``h`` is folded over tree ``h``'s positions 0..p-1 left
      to right, bracketed by the in-order tree (left subtree op node op right
      subtree): ranks 0..p-1 for tree 0; p-1..0 (even p) or 1..p-1, 0 (odd p) for tree 1.
    Cost: S segments per half through two trees of depth ~log2 p, one tree after
      the other: ≈ (8·lg p - 4 + 12(S-1))·α + (8·lg p - 4 + 12(S-1))·(n/2S)·β
      + n·γ, exact in rounds for p a power of two >= 4; exact counts for any p in
      :func:`refcoll.core.cost.dbtree_allreduce` (replayed from the schedule). Every
      rank sends at most 2n elements in all (interior: n/2 up and twice n/2
      down; leaf: n/2 up).
    Restrictions: none. Any p: the in-order tree cuts its right edge at p (NCCL's
      rule). ``n < 2``: tree 1 carries nothing. ``n == 0``: nothing moves.
      ``p == 1``: a copy.   Spec: spec/double_binary_tree.md
    """
    size, rank = t.size, t.rank
    halves = _half_segments(x.size, segment)  # (a bad segment is refused at p = 1 too)
    if size == 1:
        copy_into(out, x)
        return
    largest = max((stop - start for segments in halves for start, stop in segments), default=0)
    scratch = workspace(t, largest, x.dtype)
    for tree, segments in enumerate(halves):
        parent, left, right = dbtree_links(rank, size, tree)
        tree_reduce_steps(t, x, op=op, parent=parent, left=left, right=right, segments=segments,
                          target=lambda start, stop: out[start:stop], scratch=scratch, tag=tree)
        tree_broadcast_steps(t, out, parent=parent, children=left + right, segments=segments,
                             tag=tree)


# ------------------------------------------------------------------ cost

def dbtree_allreduce_cost(p: int, n: int, itemsize: int, *, segment: int | None = 1 << 16) -> Cost:
    """Double binary tree: replay the schedule's messages with the simulator's clock rule.

    The two trees' pipelines meet at the ranks they share, so their rounds have
    no short closed form for every ``p``; they are computed here from
    :func:`dbtree_messages` (every message in a global
    order each rank follows): a message's round is one more than the later of its
    two ranks' previous rounds. ``segment``'s default is
    :data:`DBTREE_SEGMENT`. Cost of the replay:
    ``4(p-1)·S`` steps of Python. For ``p`` a power of two >= 4, rounds are
    exactly ``4(2 lg p - 1) + 12(S-1)`` with ``S`` segments per half.
    """
    segment_bounds(n, segment)  # a bad segment is refused at p = 1 too
    if p == 1:
        return ZERO
    clock = [0] * p
    sent, msgs, reduced = [0] * p, [0] * p, [0] * p
    largest: dict[int, int] = {}
    messages = total = 0
    for _tree, phase, source, dest, elements in dbtree_messages(p, n, segment):
        step = max(clock[source], clock[dest]) + 1
        clock[source] = clock[dest] = step
        largest[step] = max(largest.get(step, 0), elements)
        sent[source] += elements
        msgs[source] += 1
        if phase == "reduce":
            reduced[dest] += elements  # every partial received is folded once
        messages += 1
        total += elements
    return Cost(rounds=max(clock), messages=messages, bytes=total * itemsize,
                max_rank_messages=max(msgs), max_rank_bytes=max(sent) * itemsize,
                critical_bytes=sum(largest.values()) * itemsize, reduced=max(reduced),
                formula="two trees, each a pipelined reduce + broadcast of n/2 in S segments: "
                "≈ (8·lg p - 4 + 12(S-1))·α + (8·lg p - 4 + 12(S-1))·(n/2S)·β + n·γ")


@functools.lru_cache(maxsize=64)
def _dbtree_pairs(p: int) -> dict[tuple[int, str], tuple[tuple[int, int], ...]]:
    """Return the ``(source, dest)`` of every message of one segment, by tree and phase."""
    pairs: dict[tuple[int, str], list[tuple[int, int]]] = {}
    for tree, phase, source, dest, _ in dbtree_messages(p, 2, None):  # one segment a half
        pairs.setdefault((tree, phase), []).append((source, dest))
    return {key: tuple(v) for key, v in pairs.items()}


def dbtree_model_cost(p: int, count: int, itemsize: int) -> Cost:
    """Return :func:`dbtree_allreduce_cost`'s counts, without a replay per segment.

    The schedule (:func:`dbtree_messages`) is, for each
    tree, the reduce of every segment then the broadcast of every segment, each
    segment the same messages; segments of a half differ by at most one element
    (the longer first). So it is at most eight runs of one repeated group of
    messages, which :func:`refcoll.core.cost.lamport_replay` replays with the
    simulator's clock rule, jumping over a run's remaining repeats once a repeat
    leaves the clocks as it found them (shifted). The other counts are sums.
    Equal to ``dbtree_allreduce_cost(p, count, itemsize)`` (held by the tests), at the
    default segment :data:`DBTREE_SEGMENT`.
    """
    if p == 1 or count == 0:
        return ZERO
    pairs = _dbtree_pairs(p)
    runs = []
    sent, sends, reduced = [0] * p, [0] * p, [0] * p
    messages = elements = 0
    for tree, (start, stop) in enumerate(((0, (count + 1) // 2), ((count + 1) // 2, count))):
        half = stop - start
        if half == 0:
            continue
        pieces = -(-half // DBTREE_SEGMENT)
        size, longer = divmod(half, pieces)  # ``longer`` pieces of size + 1, then the rest
        for phase in ("reduce", "broadcast"):
            group = pairs[tree, phase]
            for elems, repeat in ((size + 1, longer), (size, pieces - longer)):
                if repeat:
                    runs.append((tuple((a, b, elems) for a, b in group), repeat))
            for source, dest in group:
                sent[source] += half
                sends[source] += pieces
                if phase == "reduce":
                    reduced[dest] += half  # every partial received is folded once
            messages += len(group) * pieces
            elements += len(group) * half
    rounds, critical = lamport_replay(runs, itemsize)
    return Cost(rounds=rounds, messages=messages, bytes=elements * itemsize,
                max_rank_messages=max(sends), max_rank_bytes=max(sent) * itemsize,
                critical_bytes=critical, reduced=max(reduced), formula=_dbtree_formula())


@functools.lru_cache(maxsize=1)
def _dbtree_formula() -> str:
    return dbtree_allreduce_cost(2, 2, 1).formula  # the registry's own text, for display


def dbtree_price(shape, count: int, itemsize: int, *, inter: str = "ring") -> list[LinkCost]:
    """Price it on a cluster: tree edges join ranks at every distance, so like a ring step
    a round waits for the slowest link unless the cluster has only one kind. On racks,
    each tree edge that leaves a rack is a flow on its uplink while the trees pipeline
    (:func:`rack_crossings`)."""
    uplink = rack_crossings(shape.ranks, shape.rack_ranks) if shape.racks > 1 else 0
    return [LinkCost("two pipelined trees (reduce + broadcast)", shape.ring_link(),
                     dbtree_model_cost(shape.ranks, count, itemsize), uplink=uplink)]


@functools.lru_cache(maxsize=256)
def rack_crossings(p: int, per_rack: int) -> int:
    """Return the most edges of the two trees on ``p`` ranks that leave one rack of
    ``per_rack`` consecutive ranks: the flows on its uplink, each way, once the
    reduction and the broadcast pipeline."""
    crossing = [0] * -(-p // per_rack)
    for tree in (0, 1):
        for rank in range(p):
            parent = dbtree_links(rank, p, tree)[0]
            if parent is not None and rank // per_rack != parent // per_rack:
                crossing[rank // per_rack] += 1
                crossing[parent // per_rack] += 1
    return max(crossing)


register(Algorithm(
    "dbtree",
    "NCCL's double binary tree: two complementary in-order trees, a half each, pipelined",
    {"allreduce": dbtree_allreduce},
    {"allreduce": dbtree_allreduce_cost},
    "spec/double_binary_tree.md",
    order=60,
    battery_options=({}, {"segment": 1024}),
    vector_variants=({}, {"segment": 4}),
    replayable=True,
    auto=True,
    price=dbtree_price,
    model_cost=dbtree_model_cost,
    model_cost_exact=True,
    across_nodes=True,
))
