"""Recursive doubling and Rabenseifner's all-reduce, with MPICH's non-power-of-two fold.

Both pair rank ``i`` with ``i ^ mask`` (MPICH ``src/mpi/coll/allreduce/``
``allreduce_intra_recursive_doubling.c`` and
``allreduce_intra_reduce_scatter_allgather.c``; Thakur, Rabenseifner and Gropp,
"Optimization of Collective Communication Operations in MPICH", 2005):

* **recursive doubling** exchanges the whole buffer ``lg p`` times: few rounds,
  ``n·lg p`` bytes per rank. Short messages.
* **Rabenseifner** halves the buffer on the way down (a recursive-halving
  reduce-scatter: each step a rank keeps the half of its blocks that holds its
  own, sends the other half and reduces what comes back) and doubles it on the
  way up (a recursive-doubling allgather): ``2·lg p`` rounds and, like the ring,
  ``2·((p-1)/p)·n`` bytes per rank. Long messages.

**The fold**, for ``p`` not a power of two (MPICH's, in both files): let
``p' = pof2_below(p)`` and ``rem = p - p'``. Of the first ``2·rem`` ranks, each
even rank ``2i`` sends its buffer to its odd neighbour ``2i+1`` and sits out; the
odd rank reduces ``x(2i) op x(2i+1)`` and stands for both. The ``p'`` survivors
are renumbered ``0..p'-1`` in rank order (``new_rank``: ``2i+1 -> i``,
``r -> r - rem`` for ``r >= 2·rem``) and run the power-of-two algorithm; at the end
each odd rank sends the result back to the even rank it stood for. With ``p = 6``:

    ranks        0   1   2   3   4   5
    fold         0 ──> 1   2 ──> 3             (whole buffers; 0 and 2 sit out)
    survivors        0       1   2   3         (new ranks)
    unfold       0 <── 1   2 <── 3             (the result)

**Reduction order** (what makes every rank's result bitwise identical, and
predictable): a pair always combines ``lower-rank partial op higher-rank
partial``, whichever rank computes it. The leaves are the survivors' inputs
``L(i) = x(2i) op x(2i+1)`` for ``i < rem`` and ``L(i) = x(i + rem)`` otherwise.

* recursive doubling combines them in a balanced binary tree in rank order:
  ``((L0 op L1) op (L2 op L3)) op ((L4 op L5) op (L6 op L7))``;
* Rabenseifner (and its reduce-scatter) pairs the top bit first, so its balanced
  tree takes the leaves in bit-reversed order:
  ``((L0 op L4) op (L2 op L6)) op ((L1 op L5) op (L3 op L7))``, the same for
  every element.

Spec: spec/recursive_doubling.md, spec/rabenseifner.md
"""

from __future__ import annotations

import numpy as np

from ._util import copy_into, receive_into, view, workspace
from ..core.chunking import chunk_bounds

__all__ = [
    "SENDS",
    "ABSORBS",
    "STAYS",
    "pof2_below",
    "fold_role",
    "new_rank",
    "real_rank",
    "doubling_partner",
    "block_of",
    "survivor_ranges",
    "fold_in",
    "fold_out",
    "halving_reduce_scatter_steps",
    "doubling_allgather_steps",
    "recursive_doubling_allreduce",
    "rabenseifner_allreduce",
    "rabenseifner_reduce_scatter",
    "rabenseifner_allgather",
]

#: Fold roles (see :func:`fold_role`).
SENDS, ABSORBS, STAYS = "sends", "absorbs", "stays"


# ----------------------------------------------------------------- peer arithmetic

def pof2_below(p: int) -> int:
    """Return the largest power of two ``<= p`` (``p >= 1``)."""
    return 1 << (p.bit_length() - 1)


def fold_role(rank: int, size: int) -> tuple[str, int | None]:
    """Return ``(role, partner)`` of ``rank`` in the non-power-of-two fold.

    With ``rem = size - pof2_below(size)``:

    * ``SENDS``: an even rank ``< 2·rem``; sends its data to ``rank + 1``, sits
      out, and gets the result back from it;
    * ``ABSORBS``: an odd rank ``< 2·rem``; reduces ``rank - 1``'s data into its
      own and stands for both;
    * ``STAYS``: ``rank >= 2·rem`` (every rank when ``size`` is a power of two);
      partner ``None``.
    """
    rem = size - pof2_below(size)
    if rank >= 2 * rem:
        return STAYS, None
    if rank % 2 == 0:
        return SENDS, rank + 1
    return ABSORBS, rank - 1


def new_rank(rank: int, size: int) -> int | None:
    """Return ``rank``'s number among the survivors of the fold; ``None`` if it sits out."""
    rem = size - pof2_below(size)
    if rank >= 2 * rem:
        return rank - rem
    return rank // 2 if rank % 2 else None


def real_rank(new: int, size: int) -> int:
    """Return the rank of survivor ``new`` (the inverse of :func:`new_rank`)."""
    rem = size - pof2_below(size)
    return 2 * new + 1 if new < rem else new + rem


def doubling_partner(rank: int, mask: int) -> int:
    """Return the survivor ``rank`` exchanges with at distance ``mask``: ``rank ^ mask``."""
    return rank ^ mask


def block_of(rank: int, mask: int) -> int:
    """Return the first of the ``mask`` aligned positions holding ``rank``: ``rank & ~(mask-1)``."""
    return rank & ~(mask - 1)


def _span(ranges, first: int, count: int) -> tuple[int, int]:
    """Return the elements ``(start, stop)`` of positions ``first .. first+count-1``."""
    return ranges[first][0], ranges[first + count - 1][1]


def _blocks(buf: np.ndarray, ranges, first: int, count: int) -> np.ndarray:
    """Return positions ``first .. first+count-1`` of ``buf`` as one view."""
    start, stop = _span(ranges, first, count)
    return buf[start:stop]


def survivor_ranges(bounds, size: int) -> list[tuple[int, int]]:
    """Return, per survivor, the elements of the chunks of the ranks it stands for.

    ``bounds`` are the ``size`` chunks (``chunk_bounds(n, size)``). Survivor ``i``
    stands for ranks ``2i, 2i+1`` (``i < rem``) or ``i + rem``: consecutive ranks,
    so its chunks are one contiguous range, and the ranges are in survivor order.
    """
    pof2 = pof2_below(size)
    rem = size - pof2
    out = []
    for i in range(pof2):
        first = 2 * i if i < rem else i + rem
        out.append((bounds[first][0], bounds[real_rank(i, size)][1]))
    return out


def _reduce_in_rank_order(t, op, mine, theirs, out, *, theirs_lower: bool) -> None:
    """Set ``out = lower op higher``: the lower rank's partial is always the left operand."""
    if theirs_lower:
        t.reduce_local(op, theirs, mine, out)
    else:
        t.reduce_local(op, mine, theirs, out)


# --------------------------------------------------------------------- the fold

def fold_in(t, x: np.ndarray, *, op, into: np.ndarray, scratch: np.ndarray):
    """Run the fold's first half; return this rank's data for the power-of-two phase.

    A ``SENDS`` rank sends ``x`` to ``rank + 1`` and returns ``None`` (it sits
    out); an ``ABSORBS`` rank receives ``x(rank-1)`` (into ``into`` itself when
    that is not ``x``'s memory, else into ``scratch``) and returns
    ``into = x(rank-1) op x(rank)``; a ``STAYS`` rank returns ``x`` untouched.
    """
    role, partner = fold_role(t.rank, t.size)
    if role == SENDS:
        t.send(x, partner)  # whole buffer -> rank+1
        return None
    if role == ABSORBS:
        incoming = receive_into(into, scratch[: x.size], x)
        t.recv(incoming, partner)  # whole buffer <- rank-1
        t.reduce_local(op, incoming, x, into)  # x(rank-1) op x(rank): lower rank first
        return into
    return x


def fold_out(t, result: np.ndarray, dest: np.ndarray) -> None:
    """Run the fold's second half: each ``ABSORBS`` rank sends ``result`` to ``rank - 1``.

    The ``SENDS`` rank receives it into ``dest``; ``STAYS`` ranks do nothing.
    """
    role, partner = fold_role(t.rank, t.size)
    if role == ABSORBS:
        t.send(result, partner)  # result -> rank-1
    elif role == SENDS:
        t.recv(dest, partner)  # result <- rank+1


# ------------------------------------------------------- halving and doubling steps

def halving_reduce_scatter_steps(t, src: np.ndarray, ranges, me: int, *, op,
                                 acc: np.ndarray, scratch: np.ndarray,
                                 last: np.ndarray | None = None) -> None:
    """Run recursive halving among the ``p' = len(ranges)`` survivors (survivor ``me``).

    ``ranges[j]`` are the elements of position ``j``. Step ``k = 1..lg p'``, mask
    ``m = p'/2, p'/4, ..., 1``: exchange with ``peer = me ^ m``: send our partial of
    the ``m`` positions that hold the peer (``block_of(peer, m)``), receive its
    partial of the ``m`` positions that hold us (``block_of(me, m)``) and reduce,
    lower rank first, into ``acc`` at the same offsets. The first step reads
    ``src``, later ones ``acc``. Afterwards ``acc[ranges[me]]`` holds position
    ``me`` reduced over every survivor (or ``last``, when given, which receives
    the final step's reduction instead). A step receives straight into its
    target when that overlaps nothing it reads (the first step of an
    out-of-place call), else into ``scratch``.
    """
    mask = len(ranges) // 2
    while mask:
        peer = doubling_partner(me, mask)
        dest = real_rank(peer, t.size)
        keep_start, keep_stop = _span(ranges, block_of(me, mask), mask)
        target = last if mask == 1 and last is not None else acc[keep_start:keep_stop]
        incoming = receive_into(target, scratch[: keep_stop - keep_start], src)
        t.sendrecv(_blocks(src, ranges, block_of(peer, mask), mask), dest,
                   incoming, dest)  # partial of the peer's half -> peer; of ours <- peer
        _reduce_in_rank_order(t, op, src[keep_start:keep_stop], incoming, target,
                              theirs_lower=peer < me)
        src = acc
        mask //= 2


def doubling_allgather_steps(t, buf: np.ndarray, ranges, me: int) -> None:
    """Run the recursive-doubling allgather among the survivors, in place in ``buf``.

    On entry survivor ``me`` holds position ``me``. Step ``k = 1..lg p'``, mask
    ``m = 1, 2, ..., p'/2``: send our ``m`` positions (``block_of(me, m)``) to
    ``peer = me ^ m`` and receive its ``m`` (``block_of(peer, m)``) straight into
    place; we then hold ``2m``.
    """
    mask = 1
    while mask < len(ranges):
        peer = doubling_partner(me, mask)
        dest = real_rank(peer, t.size)
        t.sendrecv(_blocks(buf, ranges, block_of(me, mask), mask), dest,
                   _blocks(buf, ranges, block_of(peer, mask), mask),
                   dest)  # our m positions -> peer; its m positions <- peer
        mask *= 2


# --------------------------------------------------------------- the collectives

def recursive_doubling_allreduce(t, x: np.ndarray, out: np.ndarray, *, op) -> None:
    """Recursive-doubling all-reduce: ``lg p`` exchanges of the whole buffer.

    Schedule (p' = pof2_below(p), survivors numbered by :func:`new_rank`):
      0. fold (p not a power of two): rank 2i sends x to 2i+1, which reduces.
      1. step k = 1..lg p', mask m = 1, 2, ..., p'/2: send the whole partial to
         survivor ``me ^ m``, receive its partial, reduce lower rank first.
      2. unfold: rank 2i+1 sends the result to rank 2i.
    Reduction order: lower-rank partial op higher-rank partial, so every rank holds
      the balanced tree over the leaves in rank order,
      ``((L0 op L1) op (L2 op L3)) op ...``, with ``L(i) = x(2i) op x(2i+1)`` for
      ``i < rem`` and ``x(i + rem)`` otherwise; both partners compute the same bits.
    Cost: lg p·α + n·lg p·β + n·lg p·γ (MPICH; Thakur, Rabenseifner and Gropp 2005)
      for p a power of two; the fold adds 2α + 2n·β + n·γ (lg p -> floor(lg p)).
    Restrictions: none on p or n (n == 0 sends empty messages). The first
      reduction writes straight into ``out``: an out-of-place call never copies x,
      and receives its first partial straight into ``out`` too.
    Spec: spec/recursive_doubling.md
    """
    size = t.size
    if size == 1:
        copy_into(out, x)
        return
    scratch = workspace(t, x.size, x.dtype)
    current = fold_in(t, x, op=op, into=out, scratch=scratch)
    if current is not None:
        me, pof2 = new_rank(t.rank, size), pof2_below(size)
        mask = 1
        while mask < pof2:
            peer = doubling_partner(me, mask)
            dest = real_rank(peer, size)
            incoming = receive_into(out, scratch, current)
            t.sendrecv(current, dest, incoming, dest)  # whole partial -> peer; its partial <- peer
            _reduce_in_rank_order(t, op, current, incoming, out, theirs_lower=peer < me)
            current = out
            mask *= 2
    fold_out(t, out, out)


def rabenseifner_allreduce(t, x: np.ndarray, out: np.ndarray, *, op) -> None:
    """Rabenseifner's all-reduce: recursive-halving reduce-scatter, recursive-doubling allgather.

    Schedule (p' = pof2_below(p); positions = chunk_bounds(n, p'), the one rule):
      0. fold (p not a power of two): rank 2i sends x to 2i+1, which reduces.
      1. halving, step k = 1..lg p', mask m = p'/2, ..., 1: send the partial of the
         m positions holding survivor ``me ^ m`` to it, receive the partial of ours,
         reduce lower rank first into ``out``. Survivor i ends with position i.
      2. doubling, step k = 1..lg p', mask m = 1, ..., p'/2: swap our m positions
         for the peer's m.
      3. unfold: rank 2i+1 sends the result to rank 2i.
    MPICH's file pairs distance 1 first on the way down (so survivor i ends with
    position bitreverse(i)); pairing the top bit first instead leaves position i at
    survivor i, which makes the two halves exactly :func:`rabenseifner_reduce_scatter`
    and :func:`rabenseifner_allgather`. Message sizes, rounds and cost are the same.
    Reduction order: the balanced tree over the leaves in bit-reversed order of
      survivor: ``T(c, m) = T(c, 2m) op T(c+m, 2m)``, ``T(c, p') = L(c)``, result
      ``T(0, 1)``; for p' = 4: ``(L0 op L2) op (L1 op L3)``. Each element is reduced
      by one rank and copied to the others, so all ranks agree bitwise.
    Cost: 2·lg p·α + 2·((p-1)/p)·n·β + ((p-1)/p)·n·γ (Thakur, Rabenseifner and
      Gropp 2005; MPICH) for p a power of two; otherwise, with p' for p,
      (2·lg p'+2)·α + (2·((p'-1)/p') + 2)·n·β + (1 + (p'-1)/p')·n·γ.
    Restrictions: none (n < p' gives empty positions, sent as empty messages;
      MPICH instead requires n >= p'). The first reduction writes straight into
      ``out`` (no copy of x), on the partial received there (out of place);
      later receives go to one reused workspace; sends are views.
    Spec: spec/rabenseifner.md
    """
    size = t.size
    if size == 1:
        copy_into(out, x)
        return
    ranges = chunk_bounds(x.size, pof2_below(size))
    scratch = workspace(t, _largest_receive(x.size, ranges, t.rank, size), x.dtype)
    current = fold_in(t, x, op=op, into=out, scratch=scratch)
    if current is not None:
        me = new_rank(t.rank, size)
        halving_reduce_scatter_steps(t, current, ranges, me, op=op, acc=out, scratch=scratch)
        doubling_allgather_steps(t, out, ranges, me)
    fold_out(t, out, out)


def _largest_receive(n: int, ranges, rank: int, size: int) -> int:
    """Return the largest receive of a halving run: the fold's n, or the larger half."""
    if fold_role(rank, size)[0] == ABSORBS:
        return n
    half = len(ranges) // 2
    return max(stop - start for start, stop in (_span(ranges, 0, half), _span(ranges, half, half)))


def rabenseifner_reduce_scatter(t, x: np.ndarray, out: np.ndarray, *, op) -> None:
    """Recursive-halving reduce-scatter: rank r gets chunk r (``chunk_bounds(n, p)``).

    Schedule: the fold, then :func:`halving_reduce_scatter_steps` over the
      survivors' ranges (:func:`survivor_ranges`: survivor i's position is the
      chunks of the ranks it stands for, so it ends holding exactly those), then
      each absorbing rank 2i+1 sends chunk 2i to rank 2i. Positions are the p
      chunks of the one chunking rule, regrouped, so no ring fallback is needed.
    Reduction order: as :func:`rabenseifner_allreduce` (bit-reversed balanced tree
      over the leaves).
    Cost: lg p·α + ((p-1)/p)·n·β + ((p-1)/p)·n·γ for p a power of two (Thakur,
      Rabenseifner and Gropp 2005); the fold adds 2α + n·β + (n/p)·β + n·γ.
    Restrictions: none. Partials live in one n-element workspace (``acc``); the
      last step of a rank that stands for itself writes straight into ``out``.
    """
    size, rank = t.size, t.rank
    if size == 1:
        copy_into(out, x)
        return
    bounds = chunk_bounds(x.size, size)
    ranges = survivor_ranges(bounds, size)
    role, partner = fold_role(rank, size)
    scratch = workspace(t, _largest_receive(x.size, ranges, rank, size), x.dtype, slot=0)
    acc = workspace(t, x.size, x.dtype, slot=1)
    current = fold_in(t, x, op=op, into=acc, scratch=scratch)
    if current is not None:
        halving_reduce_scatter_steps(t, current, ranges, new_rank(rank, size), op=op, acc=acc,
                                     scratch=scratch, last=out if role == STAYS else None)
        if role == ABSORBS:
            copy_into(out, view(acc, bounds, rank))
    fold_out(t, view(acc, bounds, partner) if role == ABSORBS else out, out)


def rabenseifner_allgather(t, out: np.ndarray) -> None:
    """Recursive-doubling allgather, in place: ``out`` holds p equal blocks, block r filled.

    Schedule: fold (rank 2i sends block 2i to rank 2i+1, into place), then
      :func:`doubling_allgather_steps` over the survivors' ranges (survivor i's
      position is the blocks of the ranks it stands for), then unfold (rank 2i+1
      sends the whole buffer to rank 2i).
    Cost: lg p·α + (p-1)·m·β for p a power of two (Thakur, Rabenseifner and Gropp
      2005); the fold adds 2α + m·β + p·m·β.   Restrictions: none.
    """
    size, rank = t.size, t.rank
    if size == 1:
        return
    bounds = chunk_bounds(out.size, size)
    role, partner = fold_role(rank, size)
    if role == SENDS:
        t.send(view(out, bounds, rank), partner)  # own block -> rank+1
    elif role == ABSORBS:
        t.recv(view(out, bounds, partner), partner)  # block rank-1 <- rank-1
    if role != SENDS:
        doubling_allgather_steps(t, out, survivor_ranges(bounds, size), new_rank(rank, size))
    fold_out(t, out, out)
