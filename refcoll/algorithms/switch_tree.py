"""The switch tree of in-network all-reduce: its shape, its packets and its message order.

Pure arithmetic, no transport: how many switches a radix-``R`` tree over ``W``
workers needs (:func:`switch_count`), who is whose parent (:func:`switch_links`),
how a buffer is cut into packets (:func:`packet_bounds`), and every message of a
run in one global order (:func:`switch_schedule`), which the run
(:mod:`~refcoll.algorithms.switch`) and its cost replay.

Spec: spec/switch.md
"""

from __future__ import annotations

import numpy as np

from ..core.chunking import chunk_bounds
from ..core.errors import UsageError
from ._util import is_count

__all__ = ["RADIX", "PACKET", "SLOTS", "MODES", "is_count", "check_radix", "switch_levels",
           "switch_count", "switch_workers", "switch_links", "packet_count", "packet_bounds",
           "switch_schedule"]

#: Default children per switch.
RADIX = 4
#: Default packet size, in elements.
PACKET = 256
#: Default size of a switch's aggregation pool, in packets.
SLOTS = 8
#: ``float``: SHARP, reduce in the buffer's dtype; ``int``: SwitchML, int32 fixed point.
MODES = ("float", "int")


def check_radix(radix) -> int:
    if not is_count(radix) or radix < 2:
        raise UsageError(f"switch radix must be an integer >= 2 (children per switch), "
                         f"got {radix!r}")
    return int(radix)


def switch_levels(workers: int, *, radix: int = RADIX) -> list[int]:
    """Return the node count of each tree level: ``[W, ceil(W/R), ..., 1]``.

    Level 0 is the workers; each level above has ``ceil(m / radix)`` switches over
    the ``m`` nodes below, up to a single root. One worker needs no switch: ``[1]``.
    """
    radix = check_radix(radix)
    if workers < 1:
        raise UsageError(f"the switch tree needs at least one worker, got {workers}")
    levels = [int(workers)]
    while levels[-1] > 1:
        levels.append(-(-levels[-1] // radix))
    return levels


def switch_count(workers: int, *, radix: int = RADIX) -> int:
    """Return how many switch processes a radix-``radix`` tree over ``workers`` needs.

    The internal nodes of the tree of :func:`switch_levels`:
    ``ceil(W/R) + ceil(W/R^2) + ... + 1`` for ``W >= 2``, and 0 for ``W == 1``
    (a lone worker's all-reduce is a copy; no switch, no message).
    """
    return sum(switch_levels(workers, radix=radix)[1:])


def switch_workers(total: int, *, radix: int = RADIX) -> int:
    """Return the largest ``W`` with ``W + switch_count(W) <= total``: the workers among ``total``.

    ``W + switch_count(W)`` grows strictly with ``W``, so this inverts
    :func:`switch_count`: ``switch_workers(W + switch_count(W)) == W``. Ranks past
    ``W + switch_count(W)`` are spares that take no part. Every ``total >= 1``
    has at least one worker.
    """
    radix = check_radix(radix)
    if total < 1:
        raise UsageError(f"a switch all-reduce needs at least one rank, got {total}")
    fewest, most = 1, total  # W + switch_count(W) <= total holds at 1 (by fiat) and grows
    while fewest < most:  # the largest W where it holds, by bisection: W + count(W) grows
        middle = (fewest + most + 1) // 2
        if middle + switch_count(middle, radix=radix) <= total:
            fewest = middle
        else:
            most = middle - 1
    return fewest


def switch_links(rank: int, workers: int, *, radix: int = RADIX) -> tuple[int | None, list[int]]:
    """Return ``(parent, children)`` of ``rank`` in the tree (``parent`` None at the root).

    Ranks are numbered level by level: workers ``0..W-1``, then the level-1
    switches, and so on; the root is the last. The ``m`` nodes of a level are
    shared among the switches above it by :func:`~refcoll.core.chunking.chunk_bounds`:
    switch ``j`` of level ``k+1`` has children chunk ``j`` of level ``k``.
    """
    levels = switch_levels(workers, radix=radix)
    starts = np.concatenate(([0], np.cumsum(levels))).tolist()
    level = next(k for k in range(len(levels)) if rank < starts[k + 1])
    index = rank - starts[level]
    parent = None
    if level + 1 < len(levels):
        groups = chunk_bounds(levels[level], levels[level + 1])
        parent = starts[level + 1] + next(j for j, (lo, hi) in enumerate(groups)
                                          if lo <= index < hi)
    children = []
    if level > 0:
        lo, hi = chunk_bounds(levels[level - 1], levels[level])[index]
        children = list(range(starts[level - 1] + lo, starts[level - 1] + hi))
    return parent, children


def packet_count(count: int, packet: int) -> int:
    """Return how many packets carry ``count`` elements: ``ceil(count / packet)``."""
    return -(-count // packet)


def packet_bounds(count: int, packet: int) -> list[tuple[int, int]]:
    """Return the packets of a buffer: ``ceil(count/packet)`` chunks, each at most ``packet``.

    The chunking rule cuts the buffer, so packets differ by at most one element,
    the longer ones first.
    """
    return chunk_bounds(count, packet_count(count, packet)) if count else []


def switch_schedule(workers: int, count: int, *, radix: int = RADIX, packet: int = PACKET,
                    slots: int = SLOTS, mode: str = "float") -> list[tuple[tuple, int]]:
    """Return every message of one call in one global order, as runs of identical ticks.

    Each run is ``(transfers, repeat)``: the tick ``transfers``, a tuple of
    ``(source, dest, elements)`` in order (``elements`` on the wire: int mode
    counts int32, its exponent included), happens ``repeat`` times in a row.

    Tick ``b`` (``lag = slots - 1``): packet ``b`` goes up level by level, each
    switch taking its children in order; then the result of packet ``b - lag``
    comes down level by level, each switch sending to its children in order.
    Int mode's exponent exchange is one such tick first.

    The order is the proof of deadlock freedom: every rank's own sends and
    receives appear in it in that rank's program order, so running the messages
    one at a time in this order is an execution of the rendezvous program, which
    therefore cannot wait forever. :func:`refcoll.core.cost.switch_allreduce` replays
    its Lamport clock; the spec's step table is its first ticks.
    """
    levels = switch_levels(workers, radix=radix)
    packets = packet_count(count, packet)
    if workers == 1 or packets == 0:
        return []
    shortest, longer = divmod(count, packets)  # chunking: the first count % P are one longer
    starts = np.concatenate(([0], np.cumsum(levels))).tolist()
    tree = [(switch, switch_links(switch, workers, radix=radix)[1])
            for k in range(1, len(levels)) for switch in range(starts[k], starts[k + 1])]

    def tick(up: int | None, down: int | None) -> tuple:
        going_up = [(child, switch, up) for switch, children in tree for child in children]
        coming_down = [(switch, child, down) for switch, children in reversed(tree)
                       for child in children]
        return tuple((going_up if up is not None else [])
                     + (coming_down if down is not None else []))

    def wire(b: int) -> int:  # elements of packet b on the wire (int mode: + its exponent)
        return shortest + (b < longer) + (mode == "int")

    lag = slots - 1
    runs = [(tick(min(slots, packets), min(slots, packets)), 1)] if mode == "int" else []
    # A tick's shape changes only where a packet's size does (after the long
    # packets) or where the up or the down stream starts or stops.
    edges = sorted({0, lag, longer, longer + lag, packets, packets + lag})
    for first, stop in zip(edges, edges[1:]):
        if first >= packets + lag:
            break
        done = first - lag
        runs.append((tick(wire(first) if first < packets else None,
                          wire(done) if done >= 0 else None), stop - first))
    return runs
