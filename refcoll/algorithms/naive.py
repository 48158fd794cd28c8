"""Naive collectives: everything through rank 0, in rank order. The reference.

Every other algorithm is checked against these. They are as simple as a
collective can be: the root talks to each rank in turn, and a reduction folds the
ranks' buffers strictly left to right, ``((x0 op x1) op x2) op ...``. Slow
(``O(p)`` rounds of whole buffers), obviously right.

Spec: spec/naive.md
"""

from __future__ import annotations

import numpy as np

from ._util import copy_into, same_memory, view, workspace
from ..core.chunking import chunk_bounds

__all__ = [
    "naive_reduce",
    "naive_broadcast",
    "naive_allreduce",
    "naive_reduce_scatter",
    "naive_allgather",
]


def naive_reduce(t, x: np.ndarray, out: np.ndarray | None, *, op, root: int = 0) -> None:
    """Linear reduce: the root folds every rank's buffer in rank order.

    Schedule: rank ``i != root`` sends its whole buffer to the root; the root
      receives from ranks 0, 1, ..., p-1 in that order (its own buffer it has).
    Reduction order: ``((x0 op x1) op x2) ... op x(p-1)``, whatever the root.
    Cost: (p-1)·α + (p-1)·n·β + (p-1)·n·γ (the root receives everything).
    Restrictions: none; ``out`` is only written on the root.
    """
    size, rank = t.size, t.rank
    if rank != root:
        t.send(x, root)  # whole buffer -> root
        return
    if size == 1:
        copy_into(out, x)
        return
    if root != 0 and same_memory(out, x):
        x = x.copy()  # rank 0's buffer lands in out before the root's own is folded
    incoming = workspace(t, x.size, x.dtype)
    for src in range(size):
        if src == root:
            contribution = x
        else:
            contribution = out if src == 0 else incoming
            t.recv(contribution, src)  # whole buffer <- rank src
        if src == 1:
            first = x if root == 0 else out
            t.reduce_local(op, first, contribution, out)
        elif src > 1:
            t.reduce_local(op, out, contribution, out)


def naive_broadcast(t, buf: np.ndarray, *, root: int = 0) -> None:
    """Linear broadcast: the root sends its buffer to ranks 0, 1, ..., p-1 in turn.

    Cost: (p-1)·α + (p-1)·n·β.  Restrictions: none.
    """
    if t.rank == root:
        for dest in range(t.size):
            if dest != root:
                t.send(buf, dest)  # whole buffer -> rank dest
    else:
        t.recv(buf, root)  # whole buffer <- root


def naive_allreduce(t, x: np.ndarray, out: np.ndarray, *, op) -> None:
    """Naive all-reduce: :func:`naive_reduce` to rank 0, then :func:`naive_broadcast`.

    Reduction order: ``((x0 op x1) op x2) ... op x(p-1)`` for every element.
    Cost: 2(p-1)·α + 2(p-1)·n·β + (p-1)·n·γ.
    """
    naive_reduce(t, x, out, op=op, root=0)
    naive_broadcast(t, out, root=0)


def naive_reduce_scatter(t, x: np.ndarray, out: np.ndarray, *, op) -> None:
    """Naive reduce-scatter: :func:`naive_reduce` to rank 0, which sends chunk i to rank i.

    Cost: 2(p-1)·α + (p-1)·n·β + ((p-1)/p)·n·β + (p-1)·n·γ.
    """
    size, rank = t.size, t.rank
    bounds = chunk_bounds(x.size, size)
    if rank != 0:
        naive_reduce(t, x, None, op=op, root=0)
        t.recv(out, 0)  # chunk rank <- rank 0
        return
    full = np.empty_like(x)
    naive_reduce(t, x, full, op=op, root=0)
    for dest in range(1, size):
        t.send(view(full, bounds, dest), dest)  # chunk dest -> rank dest
    copy_into(out, view(full, bounds, 0))


def naive_allgather(t, out: np.ndarray) -> None:
    """Naive allgather, in place: rank 0 gathers every block in rank order, then broadcasts.

    ``out`` holds ``p`` blocks of equal size; block ``rank`` is filled on entry.
    Cost: 2(p-1)·α + (p-1)·m·β + (p-1)·p·m·β.
    """
    size, rank = t.size, t.rank
    bounds = chunk_bounds(out.size, size)
    if rank == 0:
        for src in range(1, size):
            t.recv(view(out, bounds, src), src)  # block src <- rank src
    else:
        t.send(view(out, bounds, rank), 0)  # own block -> rank 0
    naive_broadcast(t, out, root=0)
