"""Recursive-doubling all-reduce: ``lg p`` exchanges of the whole buffer with rank ``^ mask``.

Few rounds, ``n·lg p`` bytes per rank: short messages (MPICH
``src/mpi/coll/allreduce/allreduce_intra_recursive_doubling.c``; Thakur,
Rabenseifner and Gropp 2005). For ``p`` not a power of two MPICH's fold
(:mod:`~refcoll.algorithms.recursive`) first leaves ``p' = 2^⌊lg p⌋`` survivors.
Reduction order: lower-rank partial op higher-rank partial, so every rank holds
the balanced binary tree over the survivors' leaves in rank order,
``((L0 op L1) op (L2 op L3)) op ...``.

Spec: spec/recursive_doubling.md
"""

from __future__ import annotations

import numpy as np

from ..core.cost import ZERO, Cost
from ._util import copy_into, receive_into, workspace
from .recursive import (reduce_in_rank_order, doubling_partner, fold_in, fold_out, new_rank,
                        pof2_below, pof2_fold, real_rank)
from .registry import Algorithm, LinkCost, register

__all__ = ["recursive_doubling_allreduce", "recursive_doubling_allreduce_cost",
           "recursive_doubling_price"]


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
            reduce_in_rank_order(t, op, current, incoming, out, theirs_lower=peer < me)
            current = out
            mask *= 2
    fold_out(t, out, out)


# ------------------------------------------------------------------ cost

def recursive_doubling_allreduce_cost(p: int, n: int, itemsize: int) -> Cost:
    """Recursive doubling: ``lg p'`` whole-buffer exchanges, plus the fold's two messages.

    Published (MPICH; Thakur, Rabenseifner and Gropp 2005): ``lg p·α + n·lg p·β +
    n·lg p·γ`` for ``p`` a power of two. The fold adds ``2α + 2n·β + n·γ``: a round
    to send the even ranks' buffers in, one to send the result back, and the
    absorbing rank's extra reduction. Every message is the whole buffer and every
    round has one, so ``critical_bytes = rounds·n``.
    """
    if p == 1:
        return ZERO
    pof2, rem, lg = pof2_fold(p)
    b = n * itemsize
    folded = 1 if rem else 0
    rounds = lg + 2 * folded
    formula = "lg p·α + n·lg p·β + n·lg p·γ"
    if rem:
        formula = ("⌊lg p⌋·α + n·⌊lg p⌋·β + n·⌊lg p⌋·γ "
                   "+ (2α + 2n·β + n·γ for the fold)")
    return Cost(rounds, 2 * rem + pof2 * lg, (2 * rem + pof2 * lg) * b, lg + folded,
                (lg + folded) * b, rounds * b, (lg + folded) * n, formula)


def recursive_doubling_price(shape, count: int, itemsize: int, *, inter: str = "ring"
                             ) -> list[LinkCost]:
    """Price it on a cluster: exchanges at distance ``< per_node`` stay inside the nodes.

    When nodes and ranks per node are powers of two the first ``lg per_node``
    exchanges are intra-node and the rest inter-node; otherwise every exchange
    waits for the link the levels give.
    """
    g, m, levels = shape.per_node, shape.nodes, shape.levels()
    if levels != "split":
        return [LinkCost("exchanges", levels,
                         recursive_doubling_allreduce_cost(shape.ranks, count, itemsize))]
    return [LinkCost("intra exchanges", "intra", recursive_doubling_allreduce_cost(g, count, itemsize)),
            LinkCost("inter exchanges", "inter", recursive_doubling_allreduce_cost(m, count, itemsize))]


register(Algorithm(
    "recursive_doubling",
    "lg p exchanges of the whole buffer with rank ^ mask (MPICH fold for other p): short messages",
    {"allreduce": recursive_doubling_allreduce},
    {"allreduce": recursive_doubling_allreduce_cost},
    "spec/recursive_doubling.md",
    order=30,
    replayable=True,
    auto=True,
    price=recursive_doubling_price,
    across_nodes=True,
))
