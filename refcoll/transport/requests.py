"""What a simulated rank waits on: its posted sends and receives, its part in a split.

:class:`~refcoll.transport.sim.SimWorld` matches them; a :class:`Request` records
the round it matched in (the Lamport clock the ledger's ``step`` is) and the
thread blocked on it, so that a match wakes exactly that thread. When no rank can
go on, :func:`find_cycle` names the wait-for cycle the world reports.
"""

from __future__ import annotations

import gc
import threading
from collections import defaultdict

from .scheduler import Waiter

__all__ = ["Request", "SplitRequest", "find_cycle", "split_groups", "collector_paused"]


_PAUSES = [0]
_PAUSES_LOCK = threading.Lock()


class collector_paused:
    """Keep Python's cyclic garbage collector off while a simulated world runs.

    A large world makes millions of small records (requests, messages) that
    stay alive until it ends; each automatic collection walks all of them, so
    collections alone made a ring over 512 ranks several times slower. The
    records hold no cycles worth collecting meanwhile. Nested and concurrent
    worlds count: the collector comes back when the last one ends, if it was on.
    """

    def __enter__(self) -> None:
        with _PAUSES_LOCK:
            if _PAUSES[0] == 0:
                self.was_enabled = gc.isenabled()
                _PAUSES.append(self.was_enabled)
                gc.disable()
            _PAUSES[0] += 1

    def __exit__(self, *exc) -> bool:
        with _PAUSES_LOCK:
            _PAUSES[0] -= 1
            if _PAUSES[0] == 0 and _PAUSES.pop():
                gc.enable()
        return False


class Request:
    """One posted send or receive, in world ranks."""

    __slots__ = ("kind", "rank", "peer", "tag", "comm", "buf", "clock", "done", "step", "waiter")

    def __init__(self, kind, rank, peer, tag, comm, buf, clock):
        self.kind, self.rank, self.peer, self.tag = kind, rank, peer, tag
        self.comm, self.buf, self.clock = comm, buf, clock
        self.done = False
        self.step = 0
        self.waiter: Waiter | None = None  # the thread blocked on it, if any

    def describe(self) -> str:
        if self.kind == "send":
            return f"send of {self.buf.nbytes} B to rank {self.peer} (tag {self.tag})"
        return f"receive of {self.buf.nbytes} B from rank {self.peer} (tag {self.tag})"


class SplitRequest:
    """One rank's part in a collective ``split``: done once every member arrived."""

    kind = "split"
    __slots__ = ("rank", "comm", "rendezvous", "done", "waiter")

    def __init__(self, rank: int, comm: int):
        self.rank, self.comm = rank, comm  # the communicator being split
        self.rendezvous: dict = {}
        self.done = False
        self.waiter: Waiter | None = None

    def _missing(self) -> list[int]:
        return [w for w in self.rendezvous["members"] if w not in self.rendezvous["arrived"]]

    @property
    def peer(self) -> int:
        missing = self._missing()
        return missing[0] if missing else self.rank

    def describe(self) -> str:
        return f"split waiting for ranks {self._missing()}"


def find_cycle(edges: dict[int, int]) -> list[int]:
    """Return a cycle in a functional graph ``rank -> rank it waits on``, or []."""
    for start in edges:
        seen: list[int] = []
        node = start
        while node in edges and node not in seen:
            seen.append(node)
            node = edges[node]
        if node in seen:
            return seen[seen.index(node):] + [node]
    return []


def split_groups(arrived: dict, first_comm: int) -> tuple[dict, int]:
    """Return ``({world rank: (comm, members)}, next free comm)`` for a finished split.

    ``arrived`` maps each member's world rank to its ``(color, key, rank)``; each
    color (``None`` or negative: no group, as ``MPI_UNDEFINED``) becomes a new
    communicator, numbered from ``first_comm``, its members ordered by key, then rank.
    """
    groups: dict[int, list] = defaultdict(list)
    for w, (color, key, rank) in arrived.items():
        if color is not None and color >= 0:
            groups[color].append((key, rank, w))
    result: dict[int, tuple] = {}
    comm = first_comm
    for color in sorted(groups):
        members = [w for _, _, w in sorted(groups[color])]
        for w in members:
            result[w] = (comm, members)
        comm += 1
    return result, comm
