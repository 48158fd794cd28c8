"""Recursive-doubling all-reduce: ``lg p`` exchanges of the whole buffer with rank ``^ mask``.

Few rounds, ``n·lg p`` bytes per rank: short messages (MPICH
``src/mpi/coll/allreduce/allreduce_intra_recursive_doubling.c``; Thakur,
Rabenseifner and Gropp 2005). For ``p`` not a power of two MPICH's fold
(:mod:`~refcoll.algorithms.recursive`) first leaves ``p' = 2^⌊lg p⌋`` survivors.
Reduction order: lower-rank partial op higher-rank partial, so every rank holds
the balanced binary tree over the survivors' leaves in rank order,
``((L0 op L1) op (L2 op L3)) op ...``.

**Recursive multiplying** (options ``radix`` ``k`` and ``fold``; MPICH
``allreduce_intra_recursive_multiplying.c``, ``MPIR_CVAR_ALLREDUCE_RECURSIVE_MULTIPLYING_KVAL``):
with ``p_k`` the largest power of ``k`` not above ``p``, rank ``r >= p_k`` first
sends its buffer to rank ``r mod p_k`` (``fold="modulo"``), which makes its leaf
``L(r) = (x(r+p_k) op x(r+2p_k) op ...) op x(r)``; then, at distance ``d = 1, k,
k², ...``, each rank exchanges its whole partial with the other ``k-1`` members of
its group ``{base + r mod d + j·d : j < k}`` (``base = r - r mod (d·k)``) and every
member folds the ``k`` partials left to right in member order; at the end each
rank ``r < p_k`` sends the result to its ranks ``r + p_k, r + 2p_k, ...``. So the
result is the balanced ``k``-ary tree over the leaves in rank order, e.g.
``p = 3, k = 2``: ``(x2+x0)+x1``; ``p = 5, k = 2``: ``((x4+x0)+x1)+(x2+x3)``;
``p = 4, k = 3``: ``((x3+x0)+x1)+x2``. ``radix=2, fold="modulo"`` is MPICH's
recursive multiplying at its default ``k = 2``; ``fold="pairs"`` (the default with
radix 2) is MPICH's recursive doubling's fold above.

Spec: spec/recursive_doubling.md
"""

from __future__ import annotations

import numpy as np

from ..core.cost import ZERO, Cost
from ..core.errors import UsageError
from ._util import copy_into, is_count, receive_into, workspace
from .knomial import replay_cost
from .recursive import (
    doubling_partner,
    fold_in,
    fold_out,
    new_rank,
    pof2_below,
    pof2_fold,
    real_rank,
    reduce_in_rank_order,
)
from .registry import Algorithm, LinkCost, over_racks, register

__all__ = ["recursive_doubling_allreduce", "recursive_doubling_allreduce_cost",
           "recursive_doubling_price", "recursive_doubling_orders", "FOLDS", "power_below",
           "multiplying_group", "multiplying_allreduce"]

#: The non-power-of-two folds: MPICH's recursive doubling's, and its recursive multiplying's.
FOLDS = ("pairs", "modulo")


def _check(radix, fold) -> str:
    """Refuse bad ``radix``/``fold``; return the fold in effect (``None``: the radix's own)."""
    if not is_count(radix) or radix < 2:
        raise UsageError(f"radix must be an integer >= 2 (2: recursive doubling), got {radix!r}")
    if fold is None:
        return FOLDS[0] if radix == 2 else FOLDS[1]
    if fold not in FOLDS:
        raise UsageError(f"fold must be one of {', '.join(FOLDS)} (or None), got {fold!r}")
    if fold == FOLDS[0] and radix != 2:
        raise UsageError(f"fold='pairs' needs radix 2 (got radix {radix}): use fold='modulo'")
    return fold


def power_below(p: int, radix: int) -> int:
    """Return ``p_k``: the largest power of ``radix`` not above ``p``."""
    power = 1
    while power * radix <= p:
        power *= radix
    return power


def multiplying_group(rank: int, distance: int, radix: int) -> list[int]:
    """Return the ``radix`` ranks (``rank`` among them) exchanging at ``distance``, in order."""
    base = rank - rank % (distance * radix) + rank % distance
    return [base + j * distance for j in range(radix)]


def _extras(rank: int, p: int, power: int) -> list[int]:
    """Return the ranks ``rank + p_k, rank + 2·p_k, ...`` below ``p`` that fold into ``rank``."""
    return list(range(rank + power, p, power))


def recursive_doubling_allreduce(t, x: np.ndarray, out: np.ndarray, *, op, radix: int = 2,
                                 fold: str | None = None) -> None:
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
    Options ``radix`` (k >= 2) and ``fold`` (``"pairs"``, ``"modulo"``; ``None``:
      pairs for radix 2, modulo otherwise): MPICH's recursive multiplying
      (:func:`multiplying_allreduce`) unless radix 2 with the pairs fold.
    Spec: spec/recursive_doubling.md
    """
    if _check(radix, fold) != FOLDS[0]:
        multiplying_allreduce(t, x, out, op=op, radix=radix)
        return
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


def multiplying_allreduce(t, x: np.ndarray, out: np.ndarray, *, op, radix: int) -> None:
    """Recursive multiplying (MPICH): fold modulo ``p_k``, exchanges in groups of ``k``, unfold.

    Schedule (p_k = power_below(p, k)):
      0. fold: rank r >= p_k sends x to r mod p_k; rank r < p_k receives from
         r + p_k, r + 2p_k, ... in turn and makes ``(x(r+p_k) op ...) op x(r)``.
      1. round d = 1, k, k², ... < p_k: with the other k-1 ranks of
         :func:`multiplying_group`, in shifts s = 1..k-1 send the whole partial to
         the member s places on and receive from the one s places back; then fold
         the k partials left to right in rank order into ``out``.
      2. unfold: rank r < p_k sends the result to r + p_k, r + 2p_k, ...
    Reduction order: the balanced k-ary tree over the leaves in rank order; every
      member of a group folds the same partials in the same order, so all ranks
      hold the same bits.
    Cost: log_k p·(k-1)·(α + n·β + n·γ) for p a power of k, (k-1) rounds per level
      here (MPICH posts its k-1 exchanges at once); the fold adds a round of n in
      per extra rank, and one out.
    """
    size, rank = t.size, t.rank
    if size == 1:
        copy_into(out, x)
        return
    power = power_below(size, radix)
    if rank >= power:
        t.send(x, rank % power)  # whole buffer -> the rank it folds into
        t.recv(out, rank % power)  # the result <- it
        return
    current = x
    extras = _extras(rank, size, power)
    # A slot per extra rank folded in, and per partial of a group but ours, and one to fold
    # them in: radix slots (a group's k-1 partials arrive where the extras were).
    kept = radix if power > 1 else max(len(extras), 1)
    slots = workspace(t, kept * x.size, x.dtype).reshape(kept, x.size)
    for i, extra in enumerate(extras):
        t.recv(slots[i], extra)  # whole buffer <- a rank that folds into us
    if extras:
        chain = slots[0]
        for i in range(1, len(extras)):
            t.reduce_local(op, chain, slots[i], slots[i])  # the extras, in rank order
            chain = slots[i]
        t.reduce_local(op, chain, x, out)  # then our own input
        current = out
    distance = 1
    while distance < power:
        group = multiplying_group(rank, distance, radix)
        me = group.index(rank)
        values = [None] * radix
        for shift in range(1, radix):
            dest, source = group[(me + shift) % radix], group[(me - shift) % radix]
            values[(me - shift) % radix] = slots[shift - 1]
            t.sendrecv(current, dest, slots[shift - 1],
                       source)  # our partial -> dest; the one s places back's <- source
        values[me] = current  # (ours may be out itself, or x in place: out is written last)
        if radix == 2:
            t.reduce_local(op, values[0], values[1], out)
        else:  # left to right in the one slot no partial is in, out written by the last
            folded = slots[radix - 1]
            t.reduce_local(op, values[0], values[1], folded)
            for value in values[2:-1]:
                t.reduce_local(op, folded, value, folded)
            t.reduce_local(op, folded, values[-1], out)
        current = out
        distance *= radix
    for extra in extras:
        t.send(out, extra)  # the result -> a rank that folded into us


# ------------------------------------------------------------------ cost

def _multiplying_cost(p: int, n: int, itemsize: int, radix: int) -> Cost:
    """Recursive multiplying: its schedule replayed exactly (:func:`replay_cost`)."""
    if p == 1:
        return ZERO
    power = power_below(p, radix)
    programs, reduced = [[] for _ in range(p)], [0] * p
    for rank in range(p):
        if rank >= power:
            programs[rank] = [[("send", rank % power, n)], [("recv", rank % power, n)]]
            continue
        extras = _extras(rank, p, power)
        programs[rank] += [[("recv", extra, n)] for extra in extras]
        reduced[rank] += n * len(extras)
        distance = 1
        while distance < power:
            group = multiplying_group(rank, distance, radix)
            me = group.index(rank)
            programs[rank] += [[("send", group[(me + s) % radix], n),
                                ("recv", group[(me - s) % radix], n)] for s in range(1, radix)]
            reduced[rank] += n * (radix - 1)
            distance *= radix
        programs[rank] += [[("send", extra, n)] for extra in extras]
    return replay_cost(programs, itemsize, max(reduced),
                       "(k-1)·log_k p·(α + n·β + n·γ) for p a power of k "
                       "+ (α + n·β + n·γ per rank folded in, α + n·β out)")


def recursive_doubling_allreduce_cost(p: int, n: int, itemsize: int, *, radix: int = 2,
                                      fold: str | None = None) -> Cost:
    """Recursive doubling: ``lg p'`` whole-buffer exchanges, plus the fold's two messages.

    Published (MPICH; Thakur, Rabenseifner and Gropp 2005): ``lg p·α + n·lg p·β +
    n·lg p·γ`` for ``p`` a power of two. The fold adds ``2α + 2n·β + n·γ``: a round
    to send the even ranks' buffers in, one to send the result back, and the
    absorbing rank's extra reduction. Every message is the whole buffer and every
    round has one, so ``critical_bytes = rounds·n``. Recursive multiplying
    (another ``radix`` or ``fold``): its schedule replayed.
    """
    if _check(radix, fold) != FOLDS[0]:
        return _multiplying_cost(p, n, itemsize, radix)
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
    return Cost(rounds=rounds, messages=2 * rem + pof2 * lg, bytes=(2 * rem + pof2 * lg) * b,
                max_rank_messages=lg + folded, max_rank_bytes=(lg + folded) * b,
                critical_bytes=rounds * b, reduced=(lg + folded) * n, formula=formula)


def recursive_doubling_price(shape, count: int, itemsize: int, *, inter: str = "ring"
                             ) -> list[LinkCost]:
    """Price it on a cluster: exchanges at distance ``< per_node`` stay inside the nodes.

    When nodes and ranks per node are powers of two the first ``lg per_node``
    exchanges are intra-node and the rest inter-node; otherwise every exchange
    waits for the link the levels give. On racks the exchanges among the nodes
    split again: those between racks send every rank of a rack across its uplink
    (:func:`~refcoll.algorithms.registry.over_racks`).
    """
    g, m, levels = shape.per_node, shape.nodes, shape.levels()
    if shape.racks > 1 and g == 1:  # one rank a node: the racks are the only split
        return over_racks(recursive_doubling_price(shape.among_nodes(), count, itemsize), shape)
    if levels != "split":
        return [LinkCost("exchanges", levels,
                         recursive_doubling_allreduce_cost(shape.ranks, count, itemsize),
                         uplink=shape.all_cross)]
    across = (over_racks(recursive_doubling_price(shape.among_nodes(), count, itemsize), shape,
                         parallel=g) if shape.racks > 1 else
              [LinkCost("inter exchanges", "inter",
                        recursive_doubling_allreduce_cost(m, count, itemsize))])
    return [LinkCost("intra exchanges", "intra",
                     recursive_doubling_allreduce_cost(g, count, itemsize)),
            *across]


def _order_text(p: int, radix: int, fold: str) -> str:
    """Return the fold every rank's result is, as text: the key that tells orders apart."""
    if fold == FOLDS[0]:
        pof2, rem = pof2_below(p), p - pof2_below(p)
        level = [_plus(f"x{2 * i}", f"x{2 * i + 1}") if i < rem else f"x{i + rem}"
                 for i in range(pof2)]
        group = 2
    else:
        pof2 = power_below(p, radix)
        level = []
        for rank in range(pof2):
            extras = [f"x{e}" for e in _extras(rank, p, pof2)]
            level.append(_plus(_left_fold(extras), f"x{rank}") if extras else f"x{rank}")
        group = radix
    while len(level) > 1:
        level = [_left_fold(level[i:i + group]) for i in range(0, len(level), group)]
    return level[0]


def _plus(a: str, b: str) -> str:
    """Return ``a op b`` as text, its operands sorted: IEEE sums and products commute bitwise."""
    return "(" + "+".join(sorted((a, b))) + ")"


def _left_fold(terms: list[str]) -> str:
    text = terms[0]
    for term in terms[1:]:
        text = _plus(text, term)
    return text


def recursive_doubling_orders(collective: str, p: int) -> list[dict]:
    """Return ``[{}]`` and the recursive multiplying option sets that reduce in other orders.

    ``fold="modulo"`` (MPICH's recursive multiplying at ``k = 2``), then radix 3 to 8,
    each kept when its order differs from every one before it (at most 8 in all).
    """
    seen, out = {_order_text(p, 2, FOLDS[0])}, [{}]
    for options in [{"fold": FOLDS[1]}] + [{"radix": k} for k in range(3, 9)]:
        text = _order_text(p, options.get("radix", 2), FOLDS[1])
        if text not in seen:
            seen.add(text)
            out.append(options)
    return out[:8]


register(Algorithm(
    "recursive_doubling",
    "lg p exchanges of the whole buffer with rank ^ mask (MPICH fold for other p): short messages",
    {"allreduce": recursive_doubling_allreduce},
    {"allreduce": recursive_doubling_allreduce_cost},
    "spec/recursive_doubling.md",
    order=30,
    replayable=True,
    auto=True,
    battery_options=({}, {"radix": 3}),  # recursive multiplying: its own schedule
    price=recursive_doubling_price,
    across_nodes=True,
    orders=recursive_doubling_orders,
))
