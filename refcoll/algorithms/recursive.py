"""The steps recursive doubling and Rabenseifner share: the fold, halving, doubling.

The algorithms are :mod:`~refcoll.algorithms.recursive_doubling` and
:mod:`~refcoll.algorithms.rabenseifner`; this module registers none.

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
* Rabenseifner (and its reduce-scatter) pairs the top bit first by default
  (``pairing="far"``), so its balanced tree takes the leaves in bit-reversed order:
  ``((L0 op L4) op (L2 op L6)) op ((L1 op L5) op (L3 op L7))``, the same for
  every element. ``pairing="near"`` pairs distance 1 first, as MPICH's and Open
  MPI's files and Rabenseifner's paper do (:func:`halving_windows`): the
  rank-order tree of recursive doubling.

Spec: spec/recursive_doubling.md, spec/rabenseifner.md
"""

from __future__ import annotations

import itertools

import numpy as np

from ..core.errors import UsageError
from ._util import receive_into

__all__ = [
    "SENDS",
    "PAIRINGS",
    "check_pairing",
    "halving_windows",
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
    "reduce_in_rank_order",
    "largest_receive",
    "pof2_fold",
    "own_blocks",
    "halving_rounds",
    "doubling_rounds",
    "sum_of_largest",
    "survivor_sizes",
]

#: Fold roles (see :func:`fold_role`).
SENDS, ABSORBS, STAYS = "sends", "absorbs", "stays"

#: Rabenseifner's pairings (:func:`halving_windows`), the default first.
PAIRINGS = ("far", "near")


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


def reduce_in_rank_order(t, op, mine, theirs, out, *, theirs_lower: bool) -> None:
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

def check_pairing(pairing: str) -> None:
    """Refuse a ``pairing`` other than :data:`PAIRINGS`."""
    if pairing not in PAIRINGS:
        raise UsageError(f"pairing must be one of {', '.join(PAIRINGS)} (far: the top bit "
                         f"first; near: distance 1 first, as MPICH and Open MPI), got {pairing!r}")


def halving_windows(me: int, pof2: int, pairing: str = "far") -> list[tuple[int, ...]]:
    """Return survivor ``me``'s halving steps: ``(peer, keep_lo, keep_hi, send_lo, send_hi)``.

    In positions. The window starts as all ``pof2`` positions; each step, mask
    ``m = p'/2, ..., 1`` (``far``) or ``m = 1, ..., p'/2`` (``near``), the lower
    of ``me`` and ``peer = me ^ m`` keeps the window's lower half and the other
    the upper half; each sends the half it gives up. ``far`` leaves position
    ``me`` at survivor ``me``; ``near`` leaves position ``bitreverse(me)`` there
    (MPICH's ``allreduce_intra_reduce_scatter_allgather.c``, Open MPI's
    ``coll_base_allreduce_intra_redscat_allgather``).
    """
    masks = []
    mask = pof2 // 2 if pairing == "far" else 1
    while 0 < mask < pof2:
        masks.append(mask)
        mask = mask // 2 if pairing == "far" else mask * 2
    lo, hi, steps = 0, pof2, []
    for mask in masks:
        peer, mid = me ^ mask, (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if me < peer else ((mid, hi), (lo, mid))
        steps.append((peer, *keep, *give))
        lo, hi = keep
    return steps


def halving_reduce_scatter_steps(t, src: np.ndarray, ranges, me: int, *, op,
                                 acc: np.ndarray, scratch: np.ndarray,
                                 last: np.ndarray | None = None, pairing: str = "far") -> None:
    """Run recursive halving among the ``p' = len(ranges)`` survivors (survivor ``me``).

    ``ranges[j]`` are the elements of position ``j``. Each step of
    :func:`halving_windows` (``far``: mask ``m = p'/2, p'/4, ..., 1``, so the
    window kept is the ``m`` positions holding ``me``): exchange with ``peer``:
    send our partial of the half we give up, receive its partial of the half we
    keep and reduce, lower rank first, into ``acc`` at the same offsets. The first
    step reads ``src``, later ones ``acc``. Afterwards ``acc`` holds the last
    window kept (position ``me`` when ``far``) reduced over every survivor (or
    ``last``, when given, receives the final step's reduction instead). A step
    receives straight into its target when that overlaps nothing it reads (the
    first step of an out-of-place call), else into ``scratch``.
    """
    steps = halving_windows(me, len(ranges), pairing)
    for i, (peer, keep_lo, keep_hi, send_lo, send_hi) in enumerate(steps):
        dest = real_rank(peer, t.size)
        keep_start, keep_stop = _span(ranges, keep_lo, keep_hi - keep_lo)
        final = i == len(steps) - 1 and last is not None
        target = last if final else acc[keep_start:keep_stop]
        incoming = receive_into(target, scratch[: keep_stop - keep_start], src)
        t.sendrecv(_blocks(src, ranges, send_lo, send_hi - send_lo), dest,
                   incoming, dest)  # partial of the half we give up -> peer; of ours <- peer
        reduce_in_rank_order(t, op, src[keep_start:keep_stop], incoming, target,
                             theirs_lower=peer < me)
        src = acc


def doubling_allgather_steps(t, buf: np.ndarray, ranges, me: int, pairing: str = "far") -> None:
    """Run the recursive-doubling allgather among the survivors, in place in ``buf``.

    The halving's steps (:func:`halving_windows`) backwards: on entry survivor
    ``me`` holds the last window it kept; each step it sends that window to the
    peer and receives, straight into place, the half it gave up there, which the
    peer kept; it then holds the window before. ``far``: mask ``m = 1, 2, ...,
    p'/2``, our ``m`` positions (``block_of(me, m)``) for the peer's ``m``.
    """
    for peer, keep_lo, keep_hi, send_lo, send_hi in reversed(halving_windows(me, len(ranges),
                                                                              pairing)):
        dest = real_rank(peer, t.size)
        t.sendrecv(_blocks(buf, ranges, keep_lo, keep_hi - keep_lo), dest,
                   _blocks(buf, ranges, send_lo, send_hi - send_lo),
                   dest)  # the window we hold -> peer; the half it holds <- peer


def largest_receive(n: int, ranges, rank: int, size: int) -> int:
    """Return the largest receive of a halving run: the fold's n, or the larger half."""
    if fold_role(rank, size)[0] == ABSORBS:
        return n
    half = len(ranges) // 2
    return max(stop - start for start, stop in (_span(ranges, 0, half), _span(ranges, half, half)))


# ------------------------------------------------- the costs' fold arithmetic
#
# p' = 2^floor(lg p) survivors, rem = p - p' (the fold of MPICH's recursive
# doubling and Rabenseifner files: ranks 2i -> 2i+1 for i < rem, then back).
# Survivor i of the halving and doubling steps owns "position" i: the elements
# ``sizes[i]``. Ranks that stood in the fold start one round late (Lamport step
# 1 was the fold), so a message's round is its step number plus one when the
# group of survivors it depends on contains a folded one; after ``lg p'`` steps
# every group is everyone, and the rounds line up again.

def pof2_fold(p: int) -> tuple[int, int, int]:
    """Return ``(p', rem, lg p')`` of the non-power-of-two fold."""
    pof2 = 1 << (p.bit_length() - 1)
    return pof2, p - pof2, pof2.bit_length() - 1


def _sums(sizes: list[int]):
    """Return ``between(a, b)``: ``sum(sizes[a:b])`` from prefix sums, in O(1) (a cost
    at thousands of ranks sums p'·lg p' blocks; summed one by one, p'² elements)."""
    prefix = [0, *itertools.accumulate(sizes)]
    return lambda a, b: prefix[min(b, len(sizes))] - prefix[a]


def own_blocks(sizes: list[int]) -> list[int]:
    """Per position ``i``: elements of the aligned blocks of 1, 2, ..., p'/2 positions
    that hold ``i``.

    What survivor ``i`` reduces in a recursive halving (it keeps those blocks), and
    what it sends in a recursive-doubling allgather (it passes them on).
    """
    between = _sums(sizes)
    out = []
    for i in range(len(sizes)):
        total, mask = 0, 1
        while mask < len(sizes):
            first = i & ~(mask - 1)
            total += between(first, first + mask)
            mask *= 2
        out.append(total)
    return out


def halving_rounds(sizes: list[int], rem: int, start: int) -> dict[int, int]:
    """Return ``{round: largest message}`` (elements) of recursive halving over ``sizes``.

    Step ``k`` (mask ``m = p'/2^k``) links survivors that agree modulo ``m``; the
    group holds a folded survivor (``< rem``) when its smallest member ``i % m`` does.
    """
    between = _sums(sizes)
    largest: dict[int, int] = {}
    pof2, mask, k = len(sizes), len(sizes) // 2, 1
    while mask:
        for i in range(pof2):
            first = (i ^ mask) & ~(mask - 1)  # the peer's half, which we send
            step = start + k + (1 if i % mask < rem else 0)
            largest[step] = max(largest.get(step, 0), between(first, first + mask))
        mask, k = mask // 2, k + 1
    return largest


def doubling_rounds(sizes: list[int], rem: int, start: int) -> dict[int, int]:
    """Return ``{round: largest message}`` (elements) of a recursive-doubling allgather.

    Step ``k`` (mask ``m = 2^(k-1)``) links the aligned groups of ``2m`` survivors;
    the group holds a folded survivor when its first member does (``rem = 0``:
    none lags).
    """
    between = _sums(sizes)
    largest: dict[int, int] = {}
    pof2, mask, k = len(sizes), 1, 1
    while mask < pof2:
        for i in range(pof2):
            first = i & ~(mask - 1)  # our block, which we send
            step = start + k + (1 if i & ~(2 * mask - 1) < rem else 0)
            largest[step] = max(largest.get(step, 0), between(first, first + mask))
        mask, k = mask * 2, k + 1
    return largest


def sum_of_largest(*rounds: dict[int, int]) -> int:
    """Return the sum over rounds of the largest message in any of ``rounds``."""
    largest: dict[int, int] = {}
    for table in rounds:
        for step, size in table.items():
            largest[step] = max(largest.get(step, 0), size)
    return sum(largest.values())


def survivor_sizes(per_rank: list[int], p: int) -> list[int]:
    """Return, per survivor, the elements of the ranks it stands for (2i and 2i+1, or i+rem)."""
    pof2, rem, _ = pof2_fold(p)
    return [per_rank[2 * i] + per_rank[2 * i + 1] if i < rem else per_rank[i + rem]
            for i in range(pof2)]
