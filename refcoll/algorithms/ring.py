"""Ring collectives: reduce-scatter and allgather around a ring, and their composition.

The bandwidth-optimal all-reduce (Patarasuk and Yuan 2009; baidu-allreduce;
NCCL's ``RING``). With ``p = 4``, chunks ``A B C D`` and ``+`` the op, the
reduce-scatter moves one chunk right per step:

    step  rank 0 sends   rank 1 sends   rank 2 sends   rank 3 sends
    0     D  (x0)        A  (x1)        B  (x2)        C  (x3)
    1     C  (x3+x0)     D  (x0+x1)     A  (x1+x2)     B  (x2+x3)
    2     B  (x2+x3+x0)  C  (x3+x0+x1)  D  (x0+x1+x2)  A  (x1+x2+x3)

after which rank r holds chunk r reduced over all ranks; the allgather then
passes the finished chunks around the same ring.

Spec: spec/ring.md
"""

from __future__ import annotations

import numpy as np

from ..core.chunking import chunk_bounds, chunk_sizes, max_chunk
from ..core.cost import ZERO, Cost
from ._util import copy_into, receive_into, view, workspace
from .registry import Algorithm, LinkCost, register

__all__ = [
    "ring_peers",
    "ring_reduce_scatter_steps",
    "ring_allgather_steps",
    "ring_allreduce",
    "ring_reduce_scatter",
    "ring_allgather",
    "ring_reduce_scatter_cost",
    "ring_allgather_cost",
    "ring_allreduce_cost",
    "ring_price",
]


def ring_peers(rank: int, size: int) -> tuple[int, int]:
    """Return ``(left, right)``: the ranks this rank receives from and sends to."""
    return (rank - 1) % size, (rank + 1) % size


def ring_reduce_scatter_steps(t, x: np.ndarray, bounds, *, op, target, scratch) -> None:
    """Run the ring reduce-scatter's ``p-1`` steps over chunks ``bounds`` of ``x``.

    Step ``s``: send the partial of chunk ``r-s-1`` right, receive the partial of
    chunk ``r-s-2`` from the left and combine it with our own chunk:
    ``target(idx) = incoming op x[idx]``. ``target(r)``, written in the last
    step, is this rank's finished chunk; the others are partials in flight. The
    partial lands straight in ``target(idx)`` when that overlaps neither the
    chunk being sent nor ``x`` (an out-of-place all-reduce), else in ``scratch``.

    Reduction order: chunk ``c`` is combined ``c+1, c+2, ..., p-1, 0, ..., c``,
    each step appending one rank on the right of the running partial.
    """
    size, rank = t.size, t.rank
    left, right = ring_peers(rank, size)
    finished = None  # the partial this rank combined in the previous step
    for step in range(size - 1):
        send_idx = (rank - step - 1) % size  # our own input at step 0, then last step's partial
        recv_idx = (rank - step - 2) % size
        sending = view(x, bounds, send_idx) if finished is None else finished
        start, stop = bounds[recv_idx]
        dst, own = target(recv_idx), x[start:stop]
        incoming = receive_into(dst, scratch[: stop - start], sending, own)
        t.sendrecv(sending, right, incoming, left)  # partial of send_idx -> right; of recv_idx <- left
        t.reduce_local(op, incoming, own, dst)  # chunk recv_idx: the left's partial, then ours
        finished = dst


def ring_allgather_steps(t, buf: np.ndarray, bounds) -> None:
    """Run the ring allgather's ``p-1`` steps in place: rank r's chunk r goes round.

    Step ``s``: send chunk ``r-s`` right, receive chunk ``r-s-1`` from the left
    straight into its place in ``buf``.
    """
    size, rank = t.size, t.rank
    left, right = ring_peers(rank, size)
    for step in range(size - 1):
        send_idx = (rank - step) % size
        recv_idx = (rank - step - 1) % size
        t.sendrecv(view(buf, bounds, send_idx), right,
                   view(buf, bounds, recv_idx), left)  # chunk send_idx -> right; recv_idx <- left


def ring_allreduce(t, x: np.ndarray, out: np.ndarray, *, op) -> None:
    """Ring all-reduce: a ring reduce-scatter, then a ring allgather.

    Schedule (p = t.size, r = t.rank, chunks = chunk_bounds(len(x), p)):
      1. reduce-scatter, step s = 0..p-2: send chunk (r-s-1) right, receive chunk
         (r-s-2) from the left, reduce it with ours straight into ``out``.
      2. allgather,     step s = 0..p-2: send chunk (r-s) right, receive chunk (r-s-1).
    Reduction order: chunk c is reduced c+1, c+2, ..., c (around the ring).
    Cost: 2(p-1)·α + 2·((p-1)/p)·n·β + ((p-1)/p)·n·γ
    Restrictions: none on p or n (n < p gives empty chunks, sent as empty messages).
    The first step sends straight from ``x``, so an out-of-place call never copies
    its input, and each partial is received straight into its chunk of ``out``
    (in place: into one chunk of scratch).   Spec: spec/ring.md
    """
    size = t.size
    if size == 1:
        copy_into(out, x)
        return
    bounds = chunk_bounds(x.size, size)
    scratch = workspace(t, max_chunk(x.size, size), x.dtype)
    ring_reduce_scatter_steps(t, x, bounds, op=op, scratch=scratch,
                              target=lambda idx: view(out, bounds, idx))
    ring_allgather_steps(t, out, bounds)


def ring_reduce_scatter(t, x: np.ndarray, out: np.ndarray, *, op) -> None:
    """Ring reduce-scatter: rank r gets chunk r of the reduction, ``chunk_bounds`` rule.

    Partials in flight live in one chunk-sized accumulator; only the last step
    writes ``out``. Cost: (p-1)·α + ((p-1)/p)·n·β + ((p-1)/p)·n·γ.
    """
    size, rank = t.size, t.rank
    if size == 1:
        copy_into(out, x)
        return
    bounds = chunk_bounds(x.size, size)
    largest = max_chunk(x.size, size)
    scratch = workspace(t, largest, x.dtype, slot=0)
    partial = workspace(t, largest, x.dtype, slot=1)

    def target(idx: int) -> np.ndarray:
        start, stop = bounds[idx]
        return out if idx == rank else partial[: stop - start]

    ring_reduce_scatter_steps(t, x, bounds, op=op, scratch=scratch, target=target)


def ring_allgather(t, out: np.ndarray) -> None:
    """Ring allgather, in place: ``out`` holds ``p`` equal blocks, block ``rank`` filled.

    Cost: (p-1)·α + (p-1)·m·β.
    """
    if t.size > 1:
        ring_allgather_steps(t, out, chunk_bounds(out.size, t.size))


# ------------------------------------------------------------------ cost

def ring_reduce_scatter_cost(p: int, n: int, itemsize: int) -> Cost:
    """Ring reduce-scatter: ``p-1`` rounds, each rank passes one chunk right per round."""
    if p == 1:
        return ZERO
    sizes = chunk_sizes(n, p)
    # Rank r sends every chunk but its own (chunk r) and reduces every chunk but r-1.
    return Cost(p - 1, p * (p - 1), (p - 1) * n * itemsize, p - 1,
                (n - min(sizes)) * itemsize, (p - 1) * max_chunk(n, p) * itemsize,
                n - min(sizes), "(p-1)·α + ((p-1)/p)·n·β + ((p-1)/p)·n·γ")


def ring_allgather_cost(p: int, m: int, itemsize: int) -> Cost:
    """Ring allgather of ``m`` elements per rank: ``p-1`` rounds of one block each."""
    if p == 1:
        return ZERO
    b = m * itemsize
    return Cost(p - 1, p * (p - 1), p * (p - 1) * b, p - 1, (p - 1) * b, (p - 1) * b, 0,
                "(p-1)·α + (p-1)·m·β")


def ring_allreduce_cost(p: int, n: int, itemsize: int) -> Cost:
    """Ring all-reduce: ring reduce-scatter then ring allgather of the chunks."""
    if p == 1:
        return ZERO
    sizes = chunk_sizes(n, p)
    # Rank r sends all chunks but r in the reduce-scatter, all but r+1 in the allgather.
    busiest = max(2 * n - sizes[r] - sizes[(r + 1) % p] for r in range(p))
    return Cost(2 * (p - 1), 2 * p * (p - 1), 2 * (p - 1) * n * itemsize, 2 * (p - 1),
                busiest * itemsize, 2 * (p - 1) * max_chunk(n, p) * itemsize, n - min(sizes),
                "2(p-1)·α + 2((p-1)/p)·n·β + ((p-1)/p)·n·γ")


def ring_price(shape, count: int, itemsize: int, *, inter: str = "ring") -> list[LinkCost]:
    """Price the flat ring on a cluster: each step waits for the slowest link it uses."""
    p, link = shape.ranks, shape.flat_ring_link()
    return [LinkCost("reduce-scatter", link, ring_reduce_scatter_cost(p, count, itemsize)),
            LinkCost("allgather", link, ring_allgather_cost(p, max_chunk(count, p), itemsize))]


register(Algorithm(
    "ring",
    "ring reduce-scatter + ring allgather: bandwidth-optimal, 2(p-1) rounds",
    {
        "allreduce": ring_allreduce,
        "reduce_scatter": ring_reduce_scatter,
        "allgather": ring_allgather,
    },
    {
        "allreduce": ring_allreduce_cost,
        "reduce_scatter": ring_reduce_scatter_cost,
        "allgather": ring_allgather_cost,
    },
    "spec/ring.md",
    order=10,
    replayable=True,
    auto=True,
    price=ring_price,
    across_nodes=True,
))
