"""Rabenseifner's all-reduce: a recursive-halving reduce-scatter, a recursive-doubling allgather.

The buffer halves on the way down (each step a rank keeps the half of its
blocks that holds its own, sends the other half and reduces what comes back)
and doubles on the way up: ``2·lg p`` rounds and, like the ring,
``2·((p-1)/p)·n`` bytes per rank. Long messages (MPICH
``src/mpi/coll/allreduce/allreduce_intra_reduce_scatter_allgather.c``; Thakur,
Rabenseifner and Gropp 2005). For ``p`` not a power of two MPICH's fold
(:mod:`~refcoll.algorithms.recursive`) first leaves ``p' = 2^⌊lg p⌋`` survivors.
Reduction order: pairing the top bit first (the default, ``pairing="far"``), the
balanced tree takes the leaves in bit-reversed order:
``((L0 op L4) op (L2 op L6)) op ((L1 op L5) op (L3 op L7))``, the same for every
element; at ``p = 4``, ``(x0+x2)+(x1+x3)``. MPICH's and Open MPI's MPI_Reduce_scatter
(recursive halving) reduce in this order.

``pairing="near"`` pairs neighbours first (mask 1, 2, ..., p'/2), as MPICH
(``src/mpi/coll/allreduce/allreduce_intra_reduce_scatter_allgather.c``), Open MPI
(``ompi/mca/coll/base/coll_base_allreduce.c``,
``ompi_coll_base_allreduce_intra_redscat_allgather``) and Rabenseifner's paper
do: the leaves in rank order, ``((L0 op L1) op (L2 op L3)) op ((L4 op L5) op (L6 op L7))``;
at ``p = 4``, ``(x0+x1)+(x2+x3)``. Its reduce-scatter is Open MPI's butterfly
(``coll_base_reduce_scatter.c``), which ends with a swap of positions. Both
pairings have the same rounds and the published cost; the near halves can differ
by an element from the far ones, so its exact counts are replayed from the schedule.
Open MPI's fold differs in its messages (each of a pair reduces half, the even
rank survives) but not in its leaves ``x(2i) op x(2i+1)``, so the bits are the same.

Spec: spec/rabenseifner.md
"""

from __future__ import annotations

import numpy as np

from ..core.chunking import chunk_bounds, chunk_sizes, max_chunk
from ..core.cost import ZERO, Cost
from ._util import copy_into, view, workspace
from .knomial import replay_cost
from .recursive import (
    ABSORBS,
    PAIRINGS,
    SENDS,
    STAYS,
    check_pairing,
    doubling_allgather_steps,
    doubling_rounds,
    fold_in,
    fold_out,
    fold_role,
    halving_reduce_scatter_steps,
    halving_rounds,
    halving_windows,
    largest_receive,
    new_rank,
    own_blocks,
    pof2_below,
    pof2_fold,
    real_rank,
    sum_of_largest,
    survivor_ranges,
    survivor_sizes,
)
from .registry import Algorithm, LinkCost, over_racks, register

__all__ = ["rabenseifner_allreduce", "rabenseifner_reduce_scatter", "rabenseifner_allgather",
           "rabenseifner_allreduce_cost", "rabenseifner_reduce_scatter_cost",
           "rabenseifner_allgather_cost", "rabenseifner_price"]


def rabenseifner_allreduce(t, x: np.ndarray, out: np.ndarray, *, op, pairing: str = "far") -> None:
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
    Option ``pairing="near"``: halve distance 1 first (mask m = 1, ..., p'/2),
      as MPICH (``allreduce_intra_reduce_scatter_allgather.c``), Open MPI
      (``coll_base_allreduce.c``, ``ompi_coll_base_allreduce_intra_redscat_allgather``)
      and Rabenseifner's paper do; survivor i ends with position bitreverse(i) and
      the doubling runs the halving backwards. Its order is the balanced tree over
      the leaves in rank order, ``(L0 op L1) op (L2 op L3)``: recursive doubling's.
      The same rounds; each step's halves may differ by an element (``cost``).
    Spec: spec/rabenseifner.md
    """
    check_pairing(pairing)
    size = t.size
    if size == 1:
        copy_into(out, x)
        return
    ranges = chunk_bounds(x.size, pof2_below(size))
    scratch = workspace(t, largest_receive(x.size, ranges, t.rank, size), x.dtype)
    current = fold_in(t, x, op=op, into=out, scratch=scratch)
    if current is not None:
        me = new_rank(t.rank, size)
        halving_reduce_scatter_steps(t, current, ranges, me, op=op, acc=out, scratch=scratch,
                                     pairing=pairing)
        doubling_allgather_steps(t, out, ranges, me, pairing)
    fold_out(t, out, out)


def rabenseifner_reduce_scatter(t, x: np.ndarray, out: np.ndarray, *, op,
                                pairing: str = "far") -> None:
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
    Option ``pairing="near"``: Open MPI's butterfly
      (``coll_base_reduce_scatter.c``, ``ompi_coll_base_reduce_scatter_intra_butterfly``;
      Träff 2005): halve distance 1 first, so survivor i ends with survivor
      bitreverse(i)'s position, then the two swap them (one more round where
      bitreverse(i) != i). Order: the rank-order balanced tree over the leaves.
    """
    check_pairing(pairing)
    size, rank = t.size, t.rank
    if size == 1:
        copy_into(out, x)
        return
    bounds = chunk_bounds(x.size, size)
    ranges = survivor_ranges(bounds, size)
    role, partner = fold_role(rank, size)
    scratch = workspace(t, largest_receive(x.size, ranges, rank, size), x.dtype, slot=0)
    acc = workspace(t, x.size, x.dtype, slot=1)
    current = fold_in(t, x, op=op, into=acc, scratch=scratch)
    if current is not None:
        me = new_rank(rank, size)
        direct = role == STAYS and pairing == "far"
        halving_reduce_scatter_steps(t, current, ranges, me, op=op, acc=acc, scratch=scratch,
                                     last=out if direct else None, pairing=pairing)
        if pairing == "near":
            _swap_positions(t, acc, ranges, me, out if role == STAYS else None)
        if role == ABSORBS:
            copy_into(out, view(acc, bounds, rank))
    fold_out(t, view(acc, bounds, partner) if role == ABSORBS else out, out)


def _swap_positions(t, acc: np.ndarray, ranges, me: int, out: np.ndarray | None) -> None:
    """Swap the position survivor ``me`` holds after a ``near`` halving for its own.

    Survivor ``me`` holds position ``j = bitreverse(me)``, and survivor ``j`` holds
    position ``me``: each sends the other its position (Open MPI's "mirror
    permutation"). Ours lands in ``out`` when given (a rank that stands for
    itself), else in its place in ``acc``.
    """
    held = halving_windows(me, len(ranges), "near")[-1][1]
    start, stop = ranges[me]
    target = acc[start:stop] if out is None else out
    if held == me:
        copy_into(target, acc[start:stop])
        return
    dest = real_rank(held, t.size)
    t.sendrecv(acc[ranges[held][0]:ranges[held][1]], dest,
               target, dest)  # its position -> survivor bitreverse(me); ours <- it


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


# ------------------------------------------------------------------ cost

def _near_programs(p: int, n: int, collective: str):
    """Return every rank's calls under ``pairing="near"`` (for :func:`replay_cost`) and γ."""
    bounds = chunk_bounds(n, p)
    ranges = (chunk_bounds(n, pof2_below(p)) if collective == "allreduce"
              else survivor_ranges(bounds, p))
    width = [stop - start for start, stop in ranges]
    programs, reduced = [[] for _ in range(p)], [0] * p
    for rank in range(p):
        role, partner = fold_role(rank, p)
        calls = programs[rank]
        if role == SENDS:
            back = n if collective == "allreduce" else bounds[rank][1] - bounds[rank][0]
            programs[rank] = [[("send", partner, n)], [("recv", partner, back)]]
            continue
        if role == ABSORBS:
            calls.append([("recv", partner, n)])
            reduced[rank] += n
        me = new_rank(rank, p)
        steps = halving_windows(me, len(ranges), "near")
        for peer, keep_lo, keep_hi, send_lo, send_hi in steps:
            kept, given = sum(width[keep_lo:keep_hi]), sum(width[send_lo:send_hi])
            calls.append([("send", real_rank(peer, p), given), ("recv", real_rank(peer, p), kept)])
            reduced[rank] += kept
        if collective == "allreduce":
            for peer, keep_lo, keep_hi, send_lo, send_hi in reversed(steps):
                kept, given = sum(width[keep_lo:keep_hi]), sum(width[send_lo:send_hi])
                calls.append([("send", real_rank(peer, p), kept),
                              ("recv", real_rank(peer, p), given)])
            back = n
        else:
            held = steps[-1][1]
            if held != me:
                calls.append([("send", real_rank(held, p), width[held]),
                              ("recv", real_rank(held, p), width[me])])
            back = bounds[partner][1] - bounds[partner][0] if role == ABSORBS else 0
        if role == ABSORBS:
            calls.append([("send", partner, back)])
    return programs, max(reduced)


def _near_cost(p: int, n: int, itemsize: int, collective: str, formula: str) -> Cost:
    """``pairing="near"``: the schedule replayed exactly (halves may differ by an element)."""
    if p == 1:
        return ZERO
    programs, reduced = _near_programs(p, n, collective)
    return replay_cost(programs, itemsize, reduced, formula)


def rabenseifner_allreduce_cost(p: int, n: int, itemsize: int, *, pairing: str = "far") -> Cost:
    """Rabenseifner: fold, halving and doubling over ``chunk_bounds(n, p')``, unfold.

    Published (Thakur, Rabenseifner and Gropp 2005; MPICH): ``2·lg p·α +
    2·((p-1)/p)·n·β + ((p-1)/p)·n·γ`` for ``p`` a power of two; otherwise, with ``p'``
    for ``p``, ``(2·lg p' + 2)·α + (2·(p'-1)/p' + 2)·n·β + (1 + (p'-1)/p')·n·γ``:
    the fold's two rounds of ``n`` and its extra reduction of ``n``.
    ``pairing="near"``: the same published forms; the exact counts replayed.
    """
    check_pairing(pairing)
    if pairing == "near":
        return _near_cost(p, n, itemsize, "allreduce",
                          rabenseifner_allreduce_cost(p, n, itemsize).formula)
    if p == 1:
        return ZERO
    pof2, rem, lg = pof2_fold(p)
    sizes = chunk_sizes(n, pof2)
    # Survivor i sends every position but its own down, its own blocks up; folded
    # survivors also reduce the fold and send the result back.
    owned = own_blocks(sizes)
    sent = [n - sizes[i] + owned[i] + (n if i < rem else 0) for i in range(pof2)]
    reduced = [owned[i] + (n if i < rem else 0) for i in range(pof2)]
    folded = 1 if rem else 0
    fold = {1: n, 2 * lg + 2: n} if rem else {}
    critical = sum_of_largest(fold, halving_rounds(sizes, rem, 0),
                               doubling_rounds(sizes, 0, lg + folded))
    formula = "2·lg p·α + 2·((p-1)/p)·n·β + ((p-1)/p)·n·γ"
    if rem:
        formula = ("(2·lg p'+2)·α + (2·((p'-1)/p') + 2)·n·β + (1 + (p'-1)/p')·n·γ, "
                   "p' = 2^⌊lg p⌋")
    return Cost(rounds=2 * lg + 2 * folded, messages=2 * rem + 2 * lg * pof2,
                bytes=(2 * rem * n + 2 * (pof2 - 1) * n) * itemsize,
                max_rank_messages=2 * lg + folded,
                max_rank_bytes=max(sent + [n if rem else 0]) * itemsize,
                critical_bytes=critical * itemsize, reduced=max(reduced), formula=formula)




def rabenseifner_reduce_scatter_cost(p: int, n: int, itemsize: int, *,
                                     pairing: str = "far") -> Cost:
    """Recursive halving over the survivors' chunks, with the fold (chunk 2i sent back).

    Published (Thakur, Rabenseifner and Gropp 2005): ``lg p·α + ((p-1)/p)·n·β +
    ((p-1)/p)·n·γ`` for ``p`` a power of two. The fold adds ``2α + n·β + (n/p)·β +
    n·γ``: the even ranks' buffers in, chunk ``2i`` back out, one more reduction.
    ``pairing="near"`` (Open MPI's butterfly): one more round, the swap of the
    positions of survivors ``i`` and ``bitreverse(i)``; the exact counts replayed.
    """
    check_pairing(pairing)
    if pairing == "near":
        return _near_cost(p, n, itemsize, "reduce_scatter",
                          rabenseifner_reduce_scatter_cost(p, n, itemsize).formula
                          + " (+ α + (n/p)·β for the swap)")
    if p == 1:
        return ZERO
    pof2, rem, lg = pof2_fold(p)
    chunks = chunk_sizes(n, p)
    sizes = survivor_sizes(chunks, p)
    back = [chunks[2 * i] for i in range(rem)]  # chunk 2i, from rank 2i+1 to rank 2i
    sent = [n - sizes[i] + (back[i] if i < rem else 0) for i in range(pof2)]
    reduced = [owned + (n if i < rem else 0) for i, owned in enumerate(own_blocks(sizes))]
    folded = 1 if rem else 0
    fold = {1: n, lg + 2: max(back)} if rem else {}
    formula = "lg p·α + ((p-1)/p)·n·β + ((p-1)/p)·n·γ"
    if rem:
        formula = ("lg p'·α + ((p'-1)/p')·n·β + ((p'-1)/p')·n·γ "
                   "+ (2α + n·β + (n/p)·β + n·γ for the fold), p' = 2^⌊lg p⌋")
    return Cost(rounds=lg + 2 * folded, messages=2 * rem + lg * pof2,
                bytes=(rem * n + (pof2 - 1) * n + sum(back)) * itemsize,
                max_rank_messages=lg + folded,
                max_rank_bytes=max(sent + [n if rem else 0]) * itemsize,
                critical_bytes=sum_of_largest(fold, halving_rounds(sizes, rem, 0)) * itemsize,
                reduced=max(reduced), formula=formula)


def rabenseifner_allgather_cost(p: int, m: int, itemsize: int) -> Cost:
    """Recursive-doubling allgather of ``m`` elements per rank, with the fold.

    Published (Thakur, Rabenseifner and Gropp 2005): ``lg p·α + (p-1)·m·β`` for
    ``p`` a power of two. The fold adds ``2α + m·β + p·m·β``: block ``2i`` in, the
    whole ``p·m`` back out.
    """
    if p == 1:
        return ZERO
    pof2, rem, lg = pof2_fold(p)
    sizes = survivor_sizes([m] * p, p)
    sent = [owned + (p * m if i < rem else 0) for i, owned in enumerate(own_blocks(sizes))]
    folded = 1 if rem else 0
    fold = {1: m, lg + 2: p * m} if rem else {}
    formula = "lg p·α + (p-1)·m·β"
    if rem:
        formula = ("lg p'·α + ((p'-1)/p')·p·m·β + (2α + m·β + p·m·β for the fold), "
                   "p' = 2^⌊lg p⌋")
    return Cost(rounds=lg + 2 * folded, messages=2 * rem + lg * pof2,
                bytes=(rem * m + (pof2 - 1) * p * m + rem * p * m) * itemsize,
                max_rank_messages=lg + folded,
                max_rank_bytes=max(sent + [m if rem else 0]) * itemsize,
                critical_bytes=sum_of_largest(fold, doubling_rounds(sizes, rem, 0)) * itemsize,
                reduced=0, formula=formula)


def rabenseifner_price(shape, count: int, itemsize: int, *, inter: str = "ring") -> list[LinkCost]:
    """Price it on a cluster: when the levels split, the largest distance goes first.

    The inter-node halving moves ``(m-1)/m`` of the buffer, then the intra-node
    halving and doubling work on the node's part, then the inter-node doubling.
    On racks the halving and doubling among the nodes split again at the racks:
    the exchanges at the largest distances send every rank of a rack across its
    uplink (:func:`~refcoll.algorithms.registry.over_racks`).
    """
    g, m, levels = shape.per_node, shape.nodes, shape.levels()
    if shape.racks > 1 and g == 1:  # one rank a node: the racks are the only split
        return over_racks(rabenseifner_price(shape.among_nodes(), count, itemsize), shape)
    if levels != "split":
        p = shape.ranks
        uplink = shape.all_cross
        return [LinkCost("halving reduce-scatter", levels,
                         rabenseifner_reduce_scatter_cost(p, count, itemsize), uplink=uplink),
                LinkCost("doubling allgather", levels,
                         rabenseifner_allgather_cost(p, max_chunk(count, p), itemsize),
                         uplink=uplink)]
    node_part = max_chunk(count, m)
    intra = [LinkCost("intra halving", "intra",
                      rabenseifner_reduce_scatter_cost(g, node_part, itemsize)),
             LinkCost("intra doubling", "intra",
                      rabenseifner_allgather_cost(g, max_chunk(node_part, g), itemsize))]
    if shape.racks > 1:  # the halving and doubling among the nodes, split again at the racks
        return intra + over_racks(rabenseifner_price(shape.among_nodes(), count, itemsize),
                                  shape, parallel=g)
    return [LinkCost("inter halving", "inter",
                     rabenseifner_reduce_scatter_cost(m, count, itemsize)),
            *intra,
            LinkCost("inter doubling", "inter",
                     rabenseifner_allgather_cost(m, node_part, itemsize))]


def rabenseifner_orders(collective: str, p: int) -> list[dict]:
    """Return ``[{}]``, and ``pairing="near"`` where it reduces in another order (``p' >= 4``).

    The allgather reduces nothing; with ``p' <= 2`` survivors there is one pairing.
    """
    if collective == "allgather" or pof2_below(p) < 4:
        return [{}]
    return [{}, {"pairing": PAIRINGS[1]}]


register(Algorithm(
    "rabenseifner",
    "recursive-halving reduce-scatter + recursive-doubling allgather: 2 lg p rounds, ring's bytes",
    {
        "allreduce": rabenseifner_allreduce,
        "reduce_scatter": rabenseifner_reduce_scatter,
        "allgather": rabenseifner_allgather,
    },
    {
        "allreduce": rabenseifner_allreduce_cost,
        "reduce_scatter": rabenseifner_reduce_scatter_cost,
        "allgather": rabenseifner_allgather_cost,
    },
    "spec/rabenseifner.md",
    order=40,
    replayable=True,
    auto=True,
    price=rabenseifner_price,
    across_nodes=True,
    orders=rabenseifner_orders,
))
