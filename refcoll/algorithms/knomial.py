"""k-nomial trees (MPICH's ``knomial_1`` and ``knomial_2``) and the exact replay of a schedule.

The ``tree`` algorithm (:mod:`~refcoll.algorithms.tree`) takes three options that
choose its tree; this module holds their shapes, and registers nothing.

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

__all__ = ["SUBTREES", "FIRSTS", "check_tree_options", "knomial_parent", "knomial_children",
           "largest_first", "replay_cost"]

#: The values of the tree options (the first is the default).
SUBTREES = ("growing", "shrinking")
FIRSTS = ("nearest", "farthest")


def check_tree_options(radix, subtrees: str, first: str) -> None:
    """Refuse a radix below 2 or a value of ``subtrees``/``first`` not in the lists above."""
    if isinstance(radix, bool) or not isinstance(radix, int) or radix < 2:
        raise UsageError(f"radix must be an integer >= 2 (2: the binomial tree), got {radix!r}")
    if subtrees not in SUBTREES:
        raise UsageError(f"subtrees must be one of {', '.join(SUBTREES)}, got {subtrees!r}")
    if first not in FIRSTS:
        raise UsageError(f"first must be one of {', '.join(FIRSTS)}, got {first!r}")


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
            if child < size:
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
            out += [position + v * weight for v in range(1, radix)
                    if position + v * weight < size]
            weight *= radix
    return out[::-1] if first == "farthest" else out


def largest_first(subtrees: str) -> str:
    """Return the ``first`` that lists a node's children largest subtree first (a broadcast's)."""
    return "farthest" if subtrees == "growing" else "nearest"


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
        return ZERO if reduced == 0 else Cost(0, 0, 0, 0, 0, 0, reduced, formula)
    largest: dict[int, int] = defaultdict(int)
    sent: dict[int, int] = defaultdict(int)
    count: dict[int, int] = defaultdict(int)
    for step, source, elements in messages:
        largest[step] = max(largest[step], elements)
        sent[source] += elements
        count[source] += 1
    return Cost(max(largest), len(messages), sum(e for _, _, e in messages) * itemsize,
                max(count.values()), max(sent.values()) * itemsize,
                sum(largest.values()) * itemsize, reduced, formula)
