"""Naive collectives: everything through rank 0, in rank order. The reference.

Every other algorithm is checked against these. They are as simple as a
collective can be: the root talks to each rank in turn, and a reduction folds the
ranks' buffers strictly left to right, ``((x0 op x1) op x2) op ...``. Slow
(``O(p)`` rounds of whole buffers), obviously right.

Reduction orders: the reductions (reduce, all-reduce, reduce-scatter) take
``fold``, whatever the root:

* ``"left"`` (the default): ``((x0 op x1) op x2) ... op x(p-1)``: the root
  receives from ranks 0, 1, ..., p-1 in turn.
* ``"right"``: ``x0 op (x1 op (... op (x(p-2) op x(p-1))))``: the root starts
  from rank p-1's buffer and receives from ranks p-2, ..., 0, each new buffer
  the left operand. Open MPI's basic linear reduce
  (``ompi/mca/coll/base/coll_base_reduce.c``,
  ``ompi_coll_base_reduce_intra_basic_linear``), and so its basic linear
  all-reduce (``coll_base_allreduce.c``, ``ompi_coll_base_allreduce_intra_basic_linear``:
  that reduce to 0, then a broadcast) and its ``nonoverlapping`` all-reduce
  (the same file) when its reduce is the linear one.

Both folds cost the same: the root receives the same ``p-1`` buffers.

Spec: spec/naive.md
"""

from __future__ import annotations

import numpy as np

from ..core.chunking import chunk_bounds, chunk_sizes
from ..core.cost import ZERO, Cost
from ..core.errors import UsageError
from ._util import copy_into, same_memory, view, workspace
from .registry import Algorithm, register

__all__ = [
    "FOLDS",
    "naive_orders",
    "naive_reduce",
    "naive_broadcast",
    "naive_allreduce",
    "naive_reduce_scatter",
    "naive_allgather",
    "naive_reduce_cost",
    "naive_broadcast_cost",
    "naive_allreduce_cost",
    "naive_reduce_scatter_cost",
    "naive_allgather_cost",
]


#: ``fold``: the orders the reductions fold in (the default first).
FOLDS = ("left", "right")


def _check_fold(fold) -> None:
    if fold not in FOLDS:
        raise UsageError(f"naive fold must be one of {', '.join(FOLDS)}, got {fold!r}")


def naive_reduce(t, x: np.ndarray, out: np.ndarray | None, *, op, root: int = 0,
                 fold: str = "left") -> None:
    """Linear reduce: the root folds every rank's buffer in rank order.

    Schedule: rank ``i != root`` sends its whole buffer to the root; the root
      receives from ranks 0, 1, ..., p-1 in that order (its own buffer it has);
      ``fold="right"``: from ranks p-1, p-2, ..., 0.
    Reduction order: ``((x0 op x1) op x2) ... op x(p-1)``, whatever the root;
      ``fold="right"``: ``x0 op (x1 op (... op x(p-1)))``, Open MPI's basic linear.
    Cost: (p-1)·α + (p-1)·n·β + (p-1)·n·γ (the root receives everything).
    Restrictions: none; ``out`` is only written on the root.
    """
    _check_fold(fold)
    size, rank = t.size, t.rank
    if rank != root:
        t.send(x, root)  # whole buffer -> root
        return
    if size == 1:
        copy_into(out, x)
        return
    right = fold == "right"
    first = size - 1 if right else 0
    # The running partial lives in out and starts as the first rank's buffer: the
    # root's own input when the root is that rank, else that rank's buffer, received
    # straight into out (an in-place root first keeps its own input aside, as out is
    # about to change).
    if root == first:
        partial = x
    else:
        if same_memory(out, x):
            x = x.copy()
        t.recv(out, first)  # whole buffer <- the first rank
        partial = out
    incoming = workspace(t, x.size, x.dtype)
    for src in (range(size - 2, -1, -1) if right else range(1, size)):
        if src == root:
            contribution = x
        else:
            t.recv(incoming, src)  # whole buffer <- rank src
            contribution = incoming
        if right:
            t.reduce_local(op, contribution, partial, out)  # x(src) op (x(src+1) op ...)
        else:
            t.reduce_local(op, partial, contribution, out)  # ((x0 op x1) ...) op x(src)
        partial = out


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


def naive_allreduce(t, x: np.ndarray, out: np.ndarray, *, op, fold: str = "left") -> None:
    """Naive all-reduce: :func:`naive_reduce` to rank 0, then :func:`naive_broadcast`.

    Reduction order: ``((x0 op x1) op x2) ... op x(p-1)`` for every element;
    ``fold="right"``: ``x0 op (x1 op (... op x(p-1)))``.
    Cost: 2(p-1)·α + 2(p-1)·n·β + (p-1)·n·γ.
    """
    naive_reduce(t, x, out, op=op, root=0, fold=fold)
    naive_broadcast(t, out, root=0)


def naive_reduce_scatter(t, x: np.ndarray, out: np.ndarray, *, op, fold: str = "left") -> None:
    """Naive reduce-scatter: :func:`naive_reduce` to rank 0, which sends chunk i to rank i.

    Reduction order: :func:`naive_reduce`'s, by ``fold``.
    Cost: 2(p-1)·α + (p-1)·n·β + ((p-1)/p)·n·β + (p-1)·n·γ.
    """
    size, rank = t.size, t.rank
    bounds = chunk_bounds(x.size, size)
    if rank != 0:
        naive_reduce(t, x, None, op=op, root=0, fold=fold)
        t.recv(out, 0)  # chunk rank <- rank 0
        return
    full = np.empty_like(x)
    naive_reduce(t, x, full, op=op, root=0, fold=fold)
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


def naive_orders(collective: str, p: int) -> list[dict]:
    """Return the option sets of distinct orders: the right fold differs from ``p = 3`` on."""
    if p <= 2 or collective not in ("allreduce", "reduce_scatter", "reduce"):
        return [{}]
    return [{}, {"fold": "right"}]


# ------------------------------------------------------------------ cost

def naive_reduce_cost(p: int, n: int, itemsize: int, *, fold: str = "left") -> Cost:
    """Linear reduce: the root receives ``p-1`` whole buffers, one after another (either fold)."""
    _check_fold(fold)
    if p == 1:
        return ZERO
    b = n * itemsize
    return Cost(rounds=p - 1, messages=p - 1, bytes=(p - 1) * b, max_rank_messages=1,
                max_rank_bytes=b, critical_bytes=(p - 1) * b, reduced=(p - 1) * n,
                formula="(p-1)·α + (p-1)·n·β + (p-1)·n·γ")


def naive_broadcast_cost(p: int, n: int, itemsize: int) -> Cost:
    """Linear broadcast: the root sends the whole buffer to each rank in turn."""
    if p == 1:
        return ZERO
    b = n * itemsize
    return Cost(rounds=p - 1, messages=p - 1, bytes=(p - 1) * b, max_rank_messages=p - 1,
                max_rank_bytes=(p - 1) * b, critical_bytes=(p - 1) * b, reduced=0,
                formula="(p-1)·α + (p-1)·n·β")


def naive_allreduce_cost(p: int, n: int, itemsize: int, *, fold: str = "left") -> Cost:
    """Linear reduce to rank 0, then linear broadcast from it."""
    _check_fold(fold)
    if p == 1:
        return ZERO
    b = n * itemsize
    return Cost(rounds=2 * (p - 1), messages=2 * (p - 1), bytes=2 * (p - 1) * b,
                max_rank_messages=p - 1, max_rank_bytes=(p - 1) * b,
                critical_bytes=2 * (p - 1) * b, reduced=(p - 1) * n,
                formula="2(p-1)·α + 2(p-1)·n·β + (p-1)·n·γ")


def naive_reduce_scatter_cost(p: int, n: int, itemsize: int, *, fold: str = "left") -> Cost:
    """Linear reduce to rank 0, then rank 0 sends chunk i to rank i."""
    _check_fold(fold)
    if p == 1:
        return ZERO
    b = n * itemsize
    scattered = (n - chunk_sizes(n, p)[0]) * itemsize
    return Cost(rounds=2 * (p - 1), messages=2 * (p - 1), bytes=(p - 1) * b + scattered,
                max_rank_messages=p - 1, max_rank_bytes=max(b, scattered),
                critical_bytes=(p - 1) * b + scattered, reduced=(p - 1) * n,
                formula="2(p-1)·α + (p-1)·n·β + ((p-1)/p)·n·β + (p-1)·n·γ")


def naive_allgather_cost(p: int, m: int, itemsize: int) -> Cost:
    """Linear gather of ``m`` elements per rank to rank 0, then linear broadcast of all ``p·m``."""
    if p == 1:
        return ZERO
    b = m * itemsize
    return Cost(rounds=2 * (p - 1), messages=2 * (p - 1), bytes=(p - 1) * b + (p - 1) * p * b,
                max_rank_messages=p - 1, max_rank_bytes=(p - 1) * p * b,
                critical_bytes=(p - 1) * b + (p - 1) * p * b, reduced=0,
                formula="2(p-1)·α + (p-1)·m·β + (p-1)·p·m·β")


register(Algorithm(
    "naive",
    "everything through rank 0 in rank order: the reference every variant is checked against",
    {
        "allreduce": naive_allreduce,
        "reduce_scatter": naive_reduce_scatter,
        "allgather": naive_allgather,
        "broadcast": naive_broadcast,
        "reduce": naive_reduce,
    },
    {
        "allreduce": naive_allreduce_cost,
        "reduce_scatter": naive_reduce_scatter_cost,
        "allgather": naive_allgather_cost,
        "broadcast": naive_broadcast_cost,
        "reduce": naive_reduce_cost,
    },
    "spec/naive.md",
    order=0,
    orders=naive_orders,
))
