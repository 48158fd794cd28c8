"""Tree collectives: MPICH's binomial reduce and broadcast, and NCCL's double binary tree.

**Binomial tree** (MPICH ``reduce/reduce_intra_binomial.c`` and
``bcast/bcast_intra_binomial.c``; Thakur, Rabenseifner and Gropp 2005). Ranks
are renumbered by their *position* ``(rank - root) % p``, so the root is
position 0. Position ``q`` with lowest set bit ``2^j`` has parent ``q - 2^j``
and children ``q+1, q+2, ..., q+2^(j-1)`` (those below ``p``). With ``p = 5``,
root 0::

    0 ── 1          reduce:     step 1: 1->0, 3->2     broadcast: step 1: 0->4
    ├── 2 ── 3                  step 2: 2->0                      step 2: 0->2
    └── 4                       step 3: 4->0                      step 3: 0->1, 2->3

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

Segments: every function takes ``segment``, the most elements one message
carries; a buffer (a half, for the double tree) is cut into
``S = ceil(n / segment)`` pieces by :func:`~refcoll.core.chunking.chunk_bounds`, which
flow through the tree one after another. Defaults: no segmentation for the
binomial tree (MPICH's choice: its root sends the whole buffer ``⌈log2 p⌉``
times however it is cut, so pieces only add α), :data:`DBTREE_SEGMENT` elements
for the double binary tree (its pipeline pays).

Spec: spec/tree.md, spec/double_binary_tree.md
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from ._util import copy_into, workspace
from ..core.chunking import chunk_bounds

__all__ = [
    "DBTREE_SEGMENT",
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
    "btree_links",
    "dbtree_position",
    "dbtree_rank",
    "dbtree_links",
    "dbtree_messages",
    "dbtree_allreduce",
]

#: Elements per pipeline segment of the double binary tree when the caller gives
#: none (256 KiB of float32); halves up to this size move in one piece.
DBTREE_SEGMENT = 1 << 16


def segment_bounds(n: int, segment: int | None) -> list[tuple[int, int]]:
    """Return the pipeline pieces of ``n`` elements, at most ``segment`` each.

    ``S = ceil(n / segment)`` pieces cut by the one chunking rule
    (:func:`~refcoll.core.chunking.chunk_bounds`), so they differ by at most one
    element, the longer ones first. ``segment=None``: one piece. ``n == 0``: no
    pieces at all (nothing moves).
    """
    if segment is not None and segment < 1:
        raise ValueError(f"segment must be a positive element count or None, got {segment}")
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


def _lowest_bit(position: int, size: int) -> int:
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
    return tree_rank(position - _lowest_bit(position, size), size, root)


def binomial_children(rank: int, size: int, root: int) -> list[int]:
    """Return the children, nearest first: positions ``q+1, q+2, q+4, ...`` below ``lowbit(q)``
    and below ``size``.

    The child at ``q + m`` roots the subtree of positions ``q+m .. q+2m-1`` (cut
    at ``size``), so the root has ``⌈log2 size⌉`` children.
    """
    position = tree_position(rank, size, root)
    lowest = _lowest_bit(position, size)
    children = []
    mask = 1
    while mask < lowest and position + mask < size:
        children.append(tree_rank(position + mask, size, root))
        mask <<= 1
    return children


def tree_reduce(t, x: np.ndarray, out: np.ndarray | None, *, op, root: int = 0,
                segment: int | None = None) -> None:
    """Binomial-tree reduce to any root, optionally pipelined in segments.

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
      segment-sized workspace.   Spec: spec/tree.md
    """
    size, rank = t.size, t.rank
    segments = segment_bounds(x.size, segment)
    largest = max((stop - start for start, stop in segments), default=0)
    scratch = workspace(t, largest, x.dtype, slot=0)
    if rank == root:
        target = lambda start, stop: out[start:stop]  # noqa: E731 - the result
    else:
        partial = workspace(t, largest, x.dtype, slot=1)
        target = lambda start, stop: partial[: stop - start]  # noqa: E731 - reused per segment
    tree_reduce_steps(t, x, op=op, parent=binomial_parent(rank, size, root), left=(),
                      right=binomial_children(rank, size, root), segments=segments,
                      target=target, scratch=scratch)


def tree_broadcast(t, buf: np.ndarray, *, root: int = 0, segment: int | None = None) -> None:
    """Binomial-tree broadcast from any root, in place, optionally pipelined in segments.

    Schedule (per segment in order): receive it from parent ``q - lowbit(q)``,
      then send it to children ``..., q+4, q+2, q+1``: the largest subtree first,
      as MPICH does.
    Cost: ⌈log2 p⌉·α + ⌈log2 p⌉·n·β (MPICH's binomial broadcast); with S
      segments ⌈log2 p⌉·S·α + ⌈log2 p⌉·n·β.
    Restrictions: none (any p; ``n == 0``: nothing moves; ``p == 1``: nothing).
    Spec: spec/tree.md
    """
    size, rank = t.size, t.rank
    tree_broadcast_steps(t, buf, parent=binomial_parent(rank, size, root),
                         children=binomial_children(rank, size, root)[::-1],
                         segments=segment_bounds(buf.size, segment))


def tree_allreduce(t, x: np.ndarray, out: np.ndarray, *, op, segment: int | None = None) -> None:
    """Tree all-reduce: binomial reduce to rank 0, then binomial broadcast from rank 0.

    Every rank folds its partials straight into ``out`` (the broadcast then
    overwrites it), so no input is copied and no workspace but one segment of
    scratch is needed.
    Reduction order: ``x0 op x1 op ... op x(p-1)`` left to right, bracketed by
      the binomial tree, the same bits on every rank.
    Cost: 2⌈log2 p⌉·α + 2⌈log2 p⌉·n·β + ⌈log2 p⌉·n·γ (MPICH's reduce +
      broadcast); with S segments 2⌈log2 p⌉·S·α. Few rounds, not
      bandwidth-optimal: for long messages use ``ring`` or ``rabenseifner``.
    Restrictions: none, as :func:`tree_reduce`.   Spec: spec/tree.md
    """
    size, rank = t.size, t.rank
    segments = segment_bounds(x.size, segment)
    largest = max((stop - start for start, stop in segments), default=0)
    parent, children = binomial_parent(rank, size, 0), binomial_children(rank, size, 0)
    tree_reduce_steps(t, x, op=op, parent=parent, left=(), right=children, segments=segments,
                      target=lambda start, stop: out[start:stop],
                      scratch=workspace(t, largest, x.dtype))
    tree_broadcast_steps(t, out, parent=parent, children=children[::-1], segments=segments)


# ------------------------------------------------------------ double binary tree

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
        return None, ([_lowest_bit(0, size) >> 1] if size > 1 else [])
    bit = _lowest_bit(position, size)
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
    if size == 1:
        copy_into(out, x)
        return
    halves = _half_segments(x.size, segment)
    largest = max((stop - start for segments in halves for start, stop in segments), default=0)
    scratch = workspace(t, largest, x.dtype)
    for tree, segments in enumerate(halves):
        parent, left, right = dbtree_links(rank, size, tree)
        tree_reduce_steps(t, x, op=op, parent=parent, left=left, right=right, segments=segments,
                          target=lambda start, stop: out[start:stop], scratch=scratch, tag=tree)
        tree_broadcast_steps(t, out, parent=parent, children=left + right, segments=segments,
                             tag=tree)
