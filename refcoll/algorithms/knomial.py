"""The shapes of the ``tree`` algorithm's trees, their reduction orders, and schedule replay.

The ``tree`` algorithm (:mod:`~refcoll.algorithms.tree`) takes four options that
choose its tree; this module holds their shapes, and registers nothing.

* ``shape``: the family of trees.

  - ``"knomial"`` (default): the k-nomial trees below, chosen by ``radix`` and
    ``subtrees``; with the defaults, the binomial tree.
  - ``"kary"``: the heap-ordered k-ary tree, ``k = radix`` children per node: the
    children of position ``q`` are ``k·q + 1 .. k·q + k`` and its parent is
    ``(q - 1) // k``. MPICH's ``kary`` tree (``MPIR_CVAR_ALLREDUCE_TREE_TYPE=kary``;
    ``src/mpi/coll/algorithms/treealgo/treeutil.c``, ``MPII_Treeutil_tree_kary_init``).
  - ``"strided"``: the k-ary tree that Open MPI builds level by level
    (``ompi/mca/coll/base/coll_base_topo.c``, ``ompi_coll_base_topo_build_tree``;
    with ``k = 2`` the tree of its ``binary`` reduce, ``coll_base_reduce.c``,
    ``ompi_coll_base_reduce_intra_binary``). Level ``L`` holds positions
    ``(k^L - 1)/(k - 1)`` on, ``k^L`` of them; the children of position ``q`` on
    level ``L`` are ``q + k^L, q + 2·k^L, ..., q + k·k^L``: each node takes one
    child from each of the next level's ``k`` blocks of ``k^L``. The same levels
    as ``kary``, interleaved: at ``p = 7``, ``k = 2`` position 1 has children 3
    and 5 (``kary``: 3 and 4). For ``p <= k + 2`` the two trees are one.

  Both k-ary trees list the children nearest first, which is also the largest
  subtree first; MPICH's tree all-reduce (``allreduce_intra_tree.c``) and Open
  MPI's generic reduce (``ompi_coll_base_reduce_generic``) fold them in that order,
  and the library outputs recorded at ``p = 4`` are ``(x0+(x1+x3))+x2`` bit for bit.
  ``subtrees`` belongs to ``"knomial"`` alone.

* ``radix`` ``k >= 2`` (default 2, the binomial tree): a rank has up to ``k-1``
  children per level, and the tree ``⌈log_k p⌉`` levels.
* ``subtrees``: where the children's subtrees lie, by position ``q = (rank - root) % p``.

  - ``"growing"`` (default): the subtrees grow with the distance from the parent.
    The parent of ``q`` is ``q`` with its lowest nonzero base-``k`` digit cleared;
    the children of ``q`` are ``q + v·k^j`` (``v = 1..k-1``) for every digit ``j``
    below that one, the child at ``q + v·k^j`` rooting ``k^j`` positions. With
    ``k = 2`` this is the binomial tree of MPICH's ``reduce_intra_binomial.c``;
    for any ``k`` it is MPICH's ``knomial_2`` tree
    (``src/mpi/coll/algorithms/treealgo/treeutil.c``,
    ``MPII_Treeutil_tree_knomial_2_init``: "grows starting from the right of the root").
  - ``"shrinking"``: the nearest child roots the largest subtree. With ``m``
    base-``k`` digits in ``p - 1``, a node at depth ``s`` roots ``k^(m-s)``
    consecutive positions ``c, c+1, ...``; its children are, from ``c + 1`` on,
    ``k - 1`` subtrees of ``k^(m-s-1)`` positions, then ``k - 1`` of
    ``k^(m-s-2)``, ..., then ``k - 1`` single positions (those below ``p``).
    MPICH's ``knomial_1`` tree (``MPII_Treeutil_tree_knomial_1_init``: "grows
    starting from the left of the root"), the default of its ``tree`` all-reduce.

* ``first``: the child whose partial is folded in first, ``"nearest"`` (default)
  or ``"farthest"``. MPICH's tree all-reduce (``allreduce_intra_tree.c``) folds
  its children in the order ``treeutil.c`` lists them, the largest subtree
  first: farthest first in ``knomial_2``, nearest first in ``knomial_1``.

A partial is always ``x(q) op c1 op c2 ...``, folded left to right in that
order, the child's partial on the right. MPICH, for a commutative op, passes the
child's partial first (``MPIR_Reduce_local(child, acc)``); IEEE addition and
multiplication commute bit for bit, so the bits are the same for ``sum``,
``prod`` and ``avg`` (and for ``min``/``max`` but for which NaN's payload survives).

At ``p = 4``, root 0 (``+`` the op):

======================================  ====================  ==========================
options                                 tree (children)       every element
======================================  ====================  ==========================
default (binomial)                      0: 1, 2;  2: 3        ``(x0+x1)+(x2+x3)``
``first="farthest"`` (MPICH knomial_2)  0: 2, 1;  2: 3        ``(x0+(x2+x3))+x1``
``subtrees="shrinking"`` (knomial_1)    0: 1, 3;  1: 2        ``(x0+(x1+x2))+x3``
``radix=3, subtrees="shrinking"``       0: 1;  1: 2, 3        ``x0+((x1+x2)+x3)``
``radix=3, first="farthest"``           0: 3, 2, 1            ``((x0+x3)+x2)+x1``
======================================  ====================  ==========================

and at ``p = 5``: default (0: 1, 2, 4; 2: 3) ``((x0+x1)+(x2+x3))+x4``; knomial_2
(0: 4, 2, 1; 2: 3) ``((x0+x4)+(x2+x3))+x1``; knomial_1 (0: 1; 1: 2, 4; 2: 3)
``x0+((x1+(x2+x3))+x4)``; ``spec/tree.md`` draws them.

Costs: the root has ``(k-1)·⌈log_k p⌉`` children at most and receives (reduce)
or sends (broadcast) the whole buffer to each, one a round; the rounds on the
critical path depend on the order the children are taken in, so the cost of a
non-default tree is computed exactly by replaying its schedule
(:func:`replay_cost`) with the simulator's clock rule.

Spec: spec/tree.md
"""

from __future__ import annotations

from collections import defaultdict, deque

from ..core.cost import ZERO, Cost
from ..core.errors import UsageError
from ._util import is_count

__all__ = ["SHAPES", "SUBTREES", "FIRSTS", "check_tree_options", "knomial_parent",
           "knomial_children", "kary_parent", "kary_children", "strided_parent",
           "strided_children", "node_parent", "node_children", "largest_first",
           "order_candidates", "distinct_orders", "replay_cost"]

#: The values of the tree options (the first is the default).
SHAPES = ("knomial", "kary", "strided")
SUBTREES = ("growing", "shrinking")
FIRSTS = ("nearest", "farthest")


def check_tree_options(radix, subtrees: str, first: str, shape: str = SHAPES[0]) -> None:
    """Refuse a radix below 2, a value of ``shape``/``subtrees``/``first`` not in the lists
    above, and ``subtrees`` on a k-ary tree (it names k-nomial trees only)."""
    if shape not in SHAPES:
        raise UsageError(f"shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    if not is_count(radix) or radix < 2:
        raise UsageError(f"radix must be an integer >= 2 (2: the binomial tree), got {radix!r}")
    if subtrees not in SUBTREES:
        raise UsageError(f"subtrees must be one of {', '.join(SUBTREES)}, got {subtrees!r}")
    if first not in FIRSTS:
        raise UsageError(f"first must be one of {', '.join(FIRSTS)}, got {first!r}")
    if shape != SHAPES[0] and subtrees != SUBTREES[0]:
        raise UsageError(f"subtrees applies to shape={SHAPES[0]} only, not to shape={shape}")


def _digits(size: int, radix: int) -> int:
    """Return ``m``: how many base-``radix`` digits ``size - 1`` has (0 for one rank)."""
    m, rest = 0, size - 1
    while rest:
        rest //= radix
        m += 1
    return m


def _shrinking_children(node: int, depth: int, size: int, radix: int) -> list[tuple[int, int]]:
    """Return ``(child, its depth)`` of a ``shrinking`` node, nearest first."""
    m = _digits(size, radix)
    out, child = [], node + 1
    for level in range(depth, m):
        width = radix ** (m - level - 1)  # positions each child of this level roots
        for _ in range(radix - 1):
            if child >= size:  # (and every later one: a radix past size costs nothing)
                break
            out.append((child, level + 1))
            child += width
    return out


def _shrinking_place(position: int, size: int, radix: int) -> tuple[int | None, int]:
    """Return ``(parent, depth)`` of ``position`` in the ``shrinking`` tree, by descent."""
    m = _digits(size, radix)
    node, depth, parent = 0, 0, None
    while node != position:
        for child, level in _shrinking_children(node, depth, size, radix):
            if child <= position < child + radix ** (m - level):
                parent, node, depth = node, child, level
                break
    return parent, depth


def _lowest_weight(position: int, size: int, radix: int) -> int:
    """Return ``k^j`` of ``position``'s lowest nonzero base-``k`` digit (for 0: ``k^m >= size``)."""
    weight = 1
    while weight < size and (position // weight) % radix == 0:
        weight *= radix
    return weight


def knomial_parent(position: int, size: int, radix: int = 2,
                   subtrees: str = "growing") -> int | None:
    """Return the parent position of ``position`` (``None`` for the root, position 0)."""
    if position == 0:
        return None
    if subtrees == "shrinking":
        return _shrinking_place(position, size, radix)[0]
    weight = _lowest_weight(position, size, radix)
    return position - (position // weight) % radix * weight


def knomial_children(position: int, size: int, radix: int = 2, subtrees: str = "growing",
                     first: str = "nearest") -> list[int]:
    """Return the children positions of ``position``, in the order they are folded in.

    ``growing``: ``q + v·k^j`` for the digits ``j`` below ``q``'s lowest nonzero one,
    ``v = 1..k-1`` (below ``size``); ``shrinking``: as the module says. ``first``
    orders them by distance, nearest or farthest first.
    """
    if subtrees == "shrinking":
        depth = _shrinking_place(position, size, radix)[1]
        out = [c for c, _ in _shrinking_children(position, depth, size, radix)]
    else:
        out, weight, limit = [], 1, _lowest_weight(position, size, radix)
        while weight < limit:
            for v in range(1, radix):
                if position + v * weight >= size:  # (the later ones too: a radix past size
                    break                          # costs nothing)
                out.append(position + v * weight)
            weight *= radix
    return out[::-1] if first == "farthest" else out


def kary_parent(position: int, size: int, radix: int = 2) -> int | None:
    """Return the parent of ``position`` in the heap-ordered k-ary tree: ``(q - 1) // k``."""
    return None if position == 0 else (position - 1) // radix


def kary_children(position: int, size: int, radix: int = 2) -> list[int]:
    """Return the children of ``position`` in the heap-ordered k-ary tree, nearest first:
    ``k·q + 1 .. k·q + k`` below ``size``."""
    return list(range(radix * position + 1, min(radix * position + radix + 1, size)))


def _level_start(position: int, radix: int) -> tuple[int, int]:
    """Return ``(first position, width k^L)`` of the level ``position`` lies on."""
    start, width = 0, 1
    while start + width <= position:
        start, width = start + width, width * radix
    return start, width


def strided_parent(position: int, size: int, radix: int = 2) -> int | None:
    """Return the parent of ``position`` in Open MPI's level-by-level k-ary tree.

    A position at offset ``j`` of level ``L`` hangs under offset ``j mod k^(L-1)`` of
    level ``L - 1`` (``coll_base_topo.c`` walks there by steps of ``k^(L-1)``).
    """
    if position == 0:
        return None
    start, width = _level_start(position, radix)
    above = width // radix
    return start - above + (position - start) % above


def strided_children(position: int, size: int, radix: int = 2) -> list[int]:
    """Return the children of ``position`` on level ``L``, nearest first:
    ``q + v·k^L`` for ``v = 1..k``, below ``size``."""
    width = _level_start(position, radix)[1]
    return [c for c in (position + v * width for v in range(1, radix + 1)) if c < size]


_KARY = {"kary": (kary_parent, kary_children), "strided": (strided_parent, strided_children)}


def node_parent(position: int, size: int, radix: int = 2, subtrees: str = SUBTREES[0],
                shape: str = SHAPES[0]) -> int | None:
    """Return the parent position of ``position`` in the tree ``shape`` names."""
    if shape in _KARY:
        return _KARY[shape][0](position, size, radix)
    return knomial_parent(position, size, radix, subtrees)


def node_children(position: int, size: int, radix: int = 2, subtrees: str = SUBTREES[0],
                  first: str = FIRSTS[0], shape: str = SHAPES[0]) -> list[int]:
    """Return the children positions of ``position``, in the order they are folded in."""
    if shape in _KARY:
        out = _KARY[shape][1](position, size, radix)
        return out[::-1] if first == "farthest" else out
    return knomial_children(position, size, radix, subtrees, first)


def largest_first(subtrees: str, shape: str = SHAPES[0]) -> str:
    """Return the ``first`` that lists a node's children largest subtree first (a broadcast's)."""
    return "farthest" if subtrees == "growing" and shape == SHAPES[0] else "nearest"


# ------------------------------------------------------------ distinct reduction orders

def _order_text(p: int, options: dict) -> str:
    """Return the fold the root's result is, as text: the key that tells orders apart."""
    radix, subtrees = options.get("radix", 2), options.get("subtrees", SUBTREES[0])
    first, shape = options.get("first", FIRSTS[0]), options.get("shape", SHAPES[0])

    def partial(q: int) -> str:
        text = f"x{q}"
        for child in node_children(q, p, radix, subtrees, first, shape):
            text = "(" + "+".join(sorted((text, partial(child)))) + ")"  # sums commute bitwise
        return text
    return partial(0)


def order_candidates() -> tuple[dict, ...]:
    """Return the option sets worth trying, in order: MPICH's knomial_1 and knomial_2 of
    radix 2, 3 and 4, MPICH's binary ``kary`` tree and Open MPI's binary ``strided`` one."""
    knomial = tuple({"radix": k, **variant} if k != 2 else variant
                    for k in (2, 3, 4)
                    for variant in ({"subtrees": "shrinking"}, {"first": "farthest"}))
    return knomial + ({"shape": "kary"}, {"shape": "strided"})


def distinct_orders(p: int) -> list[dict]:
    """Return ``{}`` and each of :func:`order_candidates` whose fold on ``p`` ranks differs
    from every one before it (sums commute bit for bit, so operand order is ignored)."""
    seen, out = {_order_text(p, {})}, [{}]
    for options in order_candidates():
        text = _order_text(p, options)
        if text not in seen:
            seen.add(text)
            out.append(options)
    return out


# ------------------------------------------------------------ exact schedule replay

def replay_cost(programs, itemsize: int, reduced: int, formula: str) -> Cost:
    """Return the ledger counts a schedule gives on the simulator, by replaying it.

    ``programs[r]`` is rank ``r``'s calls in order; a call is a list of requests
    ``("send" | "recv", peer, elements)`` that it posts at once and waits for (a
    ``sendrecv`` is one call of two). A send matches the oldest unmatched receive
    between the same two ranks; a message's step is one more than the later of
    the clocks its two calls were posted at, and a rank's clock after a call is
    its latest step: the simulator's rule (:class:`~refcoll.transport.SimWorld`).
    ``reduced`` (the busiest rank's γ elements) and ``formula`` are the caller's.
    """
    size = len(programs)
    clock, at = [0] * size, [0] * size
    waiting = [0] * size
    steps: list[list[int]] = [[] for _ in range(size)]
    queues: dict = defaultdict(deque)  # (kind, source, dest) -> posted, unmatched (clock, n)
    messages = []  # (step, source, elements)

    def post(rank: int) -> list[int]:
        """Post rank's next call; return the ranks whose calls completed."""
        call = programs[rank][at[rank]]
        waiting[rank], steps[rank] = len(call), []
        finished = []
        for kind, peer, elements in call:
            source, dest = (rank, peer) if kind == "send" else (peer, rank)
            other = queues["recv" if kind == "send" else "send", source, dest]
            if other:
                peer_clock, _ = other.popleft()
                step = max(clock[rank], peer_clock) + 1
                messages.append((step, source, elements))
                for r in (rank, peer):
                    steps[r].append(step)
                    waiting[r] -= 1
                    if waiting[r] == 0:
                        finished.append(r)
            else:
                queues[kind, source, dest].append((clock[rank], elements))
        return finished

    ready = [r for r in range(size) if programs[r]]
    while ready:
        rank = ready.pop()
        done = post(rank)
        for r in dict.fromkeys(done):
            clock[r] = max([clock[r], *steps[r]])
            at[r] += 1
            if at[r] < len(programs[r]):
                ready.append(r)
    if any(at[r] < len(programs[r]) for r in range(size)):
        raise AssertionError("the replayed schedule deadlocks")  # a bug in the program builder
    if not messages:
        return ZERO if reduced == 0 else Cost(
            rounds=0, messages=0, bytes=0, max_rank_messages=0, max_rank_bytes=0,
            critical_bytes=0, reduced=reduced, formula=formula)
    largest: dict[int, int] = defaultdict(int)
    sent: dict[int, int] = defaultdict(int)
    count: dict[int, int] = defaultdict(int)
    for step, source, elements in messages:
        largest[step] = max(largest[step], elements)
        sent[source] += elements
        count[source] += 1
    return Cost(rounds=max(largest), messages=len(messages),
                bytes=sum(e for _, _, e in messages) * itemsize,
                max_rank_messages=max(count.values()),
                max_rank_bytes=max(sent.values()) * itemsize,
                critical_bytes=sum(largest.values()) * itemsize, reduced=reduced,
                formula=formula)
