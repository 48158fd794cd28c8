"""Bruck's allgather with its dimensions reversed, and its reduce-scatter dual: ⌈lg p⌉ steps, any p.

Bruck et al. ("Efficient algorithms for all-to-all communications in
multiport message-passing systems", IEEE TPDS 1997) gather in ``⌈lg p⌉`` steps
for any ``p``: at the step of distance ``d``, rank ``r`` passes everything it
holds to rank ``r - d``. Taking the distances from the largest down
(``2^(L-1), ..., 2, 1``, ``L = ⌈lg p⌉``) keeps the last, largest messages
between neighbours: the schedule of NCCL 2.23's PAT (Jeaugey, "PAT: a new
algorithm for all-gather and reduce-scatter operations at scale", 2025) when its
intermediate buffers are large enough to hold what it aggregates. PAT then
caps the ranks aggregated at once to bound its buffers; this module does not.

Offsets: rank ``r`` holds block ``(r + a) % p`` as offset ``a``. Before the step
of distance ``2^k`` a rank holds the offsets ``A(k+1)``, where ``A(k)`` is the
multiples of ``2^k`` below ``p``; the step adds ``2^k + A(k+1)``, so ``A(L) = {0}``
grows to ``A(0) = 0..p-1``. With ``p = 5`` (``L = 3``), rank 0:

    step  distance  holds before  receives from  offsets it receives
    1     4         {0}           rank 4         {4}
    2     2         {0, 4}        rank 2         {2}       (2 + 4 = 6 >= 5: none)
    3     1         {0, 2, 4}     rank 1         {1, 3}

The reduce-scatter is the same schedule run backwards: distances ``1, 2, ...,
2^(L-1)``, data flowing the other way, and partials of the same offsets summed
where they meet, so rank ``r`` ends with block ``r`` reduced over every rank.

Spec: spec/bruck.md
"""

from __future__ import annotations

import numpy as np

from ..core.chunking import chunk_bounds, max_chunk
from ..core.cost import ZERO, Cost
from ._util import copy_into, view, workspace
from .registry import Algorithm, register

__all__ = ["bruck_steps", "moving_offsets", "bruck_allgather", "bruck_reduce_scatter",
           "bruck_allgather_cost", "bruck_reduce_scatter_cost"]


def bruck_steps(size: int) -> int:
    """Return ``L = ⌈lg p⌉``: the steps of either collective on ``size`` ranks."""
    return (size - 1).bit_length()


def moving_offsets(size: int, k: int) -> list[int]:
    """Return the offsets ``a`` in ``A(k+1)`` with ``2^k + a < p``: what the step of ``2^k`` moves.

    At that step of the allgather, rank ``r`` sends blocks ``(r + a) % p`` to
    rank ``r - 2^k`` and receives blocks ``(r + 2^k + a) % p`` from rank
    ``r + 2^k``, for each such ``a``, in increasing order. Offset 0 always moves,
    so every rank sends one message a step.
    """
    distance = 1 << k
    return list(range(0, size - distance, 2 * distance))


def _pack(buf: np.ndarray, bounds, blocks: list[int], packed: np.ndarray) -> np.ndarray:
    """Copy ``buf``'s ``blocks`` one after another into ``packed``; return the filled part."""
    offset = 0
    for block in blocks:
        piece = view(buf, bounds, block)
        packed[offset:offset + piece.size] = piece
        offset += piece.size
    return packed[:offset]


def _packed_size(bounds, blocks: list[int]) -> int:
    return sum(bounds[b][1] - bounds[b][0] for b in blocks)


def bruck_allgather(t, out: np.ndarray) -> None:
    """Bruck allgather, distances largest first, in place: block ``r`` of ``out`` filled on entry.

    Schedule (p = t.size, r = t.rank, blocks = chunk_bounds(len(out), p),
      L = ⌈lg p⌉), step k = L-1, ..., 0 (distance d = 2^k), for the offsets
      ``a`` of :func:`moving_offsets`: send blocks ``(r + a) % p``, packed in
      offset order, to rank ``r - d``; receive blocks ``(r + d + a) % p`` from
      rank ``r + d`` and unpack them into place.
    Cost: ⌈lg p⌉·α + (p-1)·m·β (every rank receives every other block once);
      exact counts: :func:`bruck_allgather_cost`.
    Restrictions: none on p or n (any p: the offsets stop below p; empty
      blocks travel as empty pieces). Messages are packed: each step copies what
      it sends into one buffer and what it receives out of another.
    Spec: spec/bruck.md
    """
    size, rank = t.size, t.rank
    if size == 1:
        return
    bounds = chunk_bounds(out.size, size)
    largest = max_chunk(out.size, size) * (size // 2 + 1)
    outgoing = workspace(t, largest, out.dtype, slot=0)
    incoming = workspace(t, largest, out.dtype, slot=1)
    for k in reversed(range(bruck_steps(size))):
        distance = 1 << k
        offsets = moving_offsets(size, k)
        send_blocks = [(rank + a) % size for a in offsets]
        recv_blocks = [(rank + distance + a) % size for a in offsets]
        sending = _pack(out, bounds, send_blocks, outgoing)
        landing = incoming[:_packed_size(bounds, recv_blocks)]
        t.sendrecv(sending, (rank - distance) % size,  # blocks r+a -> rank r-d
                   landing, (rank + distance) % size)  # blocks r+d+a <- rank r+d
        start = 0
        for block in recv_blocks:
            piece = view(out, bounds, block)
            copy_into(piece, landing[start:start + piece.size])
            start += piece.size


def bruck_reduce_scatter(t, x: np.ndarray, out: np.ndarray, *, op) -> None:
    """Bruck reduce-scatter, the allgather run backwards: rank ``r`` gets block ``r`` reduced.

    Schedule (blocks = chunk_bounds(len(x), p), L = ⌈lg p⌉), step k = 0, ...,
      L-1 (distance d = 2^k), for the offsets ``a`` of :func:`moving_offsets`:
      send the partials of blocks ``(r + d + a) % p``, packed in offset order, to
      rank ``r + d``; receive the partials of blocks ``(r + a) % p`` from rank
      ``r - d`` and combine each with ours: ``received op ours``. Partials live
      in an n-element accumulator; the last step writes block ``r`` into ``out``.
    Reduction order: block ``q``'s partial held at rank ``r`` covers the ranks
      ``r-2^k+1 .. r`` after step k-1; the step puts the ranks ``r-2^(k+1)+1 ..
      r-2^k`` (received) on its left. So block ``q`` is combined in the cyclic
      order ``q+1, q+2, ..., q-1, q`` (the ring's) as a tree of doubling halves:
      for p = 4, ``(x(q+1) op x(q+2)) op (x(q+3) op x(q))``; for p not a power of
      two the halves the offsets cut off are missing.
    Cost: ⌈lg p⌉·α + ((p-1)/p)·n·β + ((p-1)/p)·n·γ; exact counts:
      :func:`bruck_reduce_scatter_cost`.
    Restrictions: none on p or n. Messages are packed, as in the allgather.
    Spec: spec/bruck.md
    """
    size, rank = t.size, t.rank
    if size == 1:
        copy_into(out, x)
        return
    bounds = chunk_bounds(x.size, size)
    largest = max_chunk(x.size, size) * (size // 2 + 1)
    outgoing = workspace(t, largest, x.dtype, slot=0)
    incoming = workspace(t, largest, x.dtype, slot=1)
    partials = workspace(t, x.size, x.dtype, slot=2)
    last = bruck_steps(size) - 1
    current = x  # step 0 reads our input; later steps our partials
    for k in range(last + 1):
        distance = 1 << k
        offsets = moving_offsets(size, k)
        send_blocks = [(rank + distance + a) % size for a in offsets]
        recv_blocks = [(rank + a) % size for a in offsets]
        sending = _pack(current, bounds, send_blocks, outgoing)
        landing = incoming[:_packed_size(bounds, recv_blocks)]
        t.sendrecv(sending, (rank + distance) % size,  # partials of r+d+a -> rank r+d
                   landing, (rank - distance) % size)  # partials of r+a <- rank r-d
        if k == 0 and size % 2:  # odd p: offset p-1 is kept but receives nothing now
            kept = (rank - 1) % size  # block r+p-1
            copy_into(view(partials, bounds, kept), view(x, bounds, kept))
        start = 0
        for block in recv_blocks:
            mine = view(current, bounds, block)
            target = out if k == last else view(partials, bounds, block)
            t.reduce_local(op, landing[start:start + mine.size], mine, target)  # theirs op ours
            start += mine.size
        current = partials


# ------------------------------------------------------------------ cost

def _counts(p: int, n: int, itemsize: int, *, reduce: bool, formula: str) -> Cost:
    """Count either collective: the same blocks move at each step, in opposite directions.

    At the step of distance ``d`` the blocks ``(r + a) % p`` of the moving offsets
    travel from rank ``r`` to rank ``r - d`` (allgather) or from rank ``r - d`` to
    rank ``r`` (reduce-scatter, which combines each element it receives once).
    Every rank sends one message a step, all in lockstep: a step is a round.
    """
    if p == 1:
        return ZERO
    steps = bruck_steps(p)
    bounds = chunk_bounds(n, p)
    sent, received, largest = [0] * p, [0] * p, [0] * steps
    for k in range(steps):
        for r in range(p):
            elements = sum(bounds[(r + a) % p][1] - bounds[(r + a) % p][0]
                           for a in moving_offsets(p, k))
            source, dest = ((r - (1 << k)) % p, r) if reduce else (r, (r - (1 << k)) % p)
            sent[source] += elements
            received[dest] += elements
            largest[k] = max(largest[k], elements)
    return Cost(rounds=steps, messages=p * steps, bytes=sum(sent) * itemsize,
                max_rank_messages=steps, max_rank_bytes=max(sent) * itemsize,
                critical_bytes=sum(largest) * itemsize,
                reduced=max(received) if reduce else 0, formula=formula)


def bruck_allgather_cost(p: int, m: int, itemsize: int) -> Cost:
    """Bruck allgather of ``m`` elements per rank: ``⌈lg p⌉`` rounds, each rank gets ``(p-1)·m``."""
    return _counts(p, p * m, itemsize, reduce=False, formula="⌈lg p⌉·α + (p-1)·m·β")


def bruck_reduce_scatter_cost(p: int, n: int, itemsize: int) -> Cost:
    """Bruck reduce-scatter of ``n`` elements: ``⌈lg p⌉`` rounds, ``((p-1)/p)·n`` each way."""
    return _counts(p, n, itemsize, reduce=True,
                   formula="⌈lg p⌉·α + ((p-1)/p)·n·β + ((p-1)/p)·n·γ")


register(Algorithm(
    "bruck",
    "Bruck allgather (distances largest first, PAT's schedule) and its reduce-scatter dual",
    {"reduce_scatter": bruck_reduce_scatter, "allgather": bruck_allgather},
    {"reduce_scatter": bruck_reduce_scatter_cost, "allgather": bruck_allgather_cost},
    "spec/bruck.md",
    order=45,
))
