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

Reduction orders. Libraries run this same schedule with another walk or
another cut, and each gives other bits; three options name them (defaults: the
order above, bit for bit):

* ``direction``: ``"forward"`` sends to rank ``r+1``; ``"reverse"`` sends to ``r-1``.
* ``start``: ``"next"``: chunk ``c`` starts at the rank after ``c`` in the ring's
  direction and is finished at rank ``c``; ``"own"``: chunk ``c`` starts at rank
  ``c`` (every rank first sends its own chunk), so it is finished one rank before
  ``c``, and the allgather starts from there.
* ``split``: where the elements that do not divide evenly go
  (:mod:`refcoll.core.chunking`): ``"front"``, ``"last"``, ``"ceil"``, ``"gloo"``.

Chunk ``c`` is a left fold over the ranks in the order it visits them (indices
mod p); the received partial is the left operand, the rank's own chunk the right:

    direction  start  chunk c                               used by (split)
    forward    next   ((x(c+1) op x(c+2)) op ...) op x(c)   MPICH allreduce_intra_ring.c ("ceil");
                                                            Open MPI's ring reduce-scatter,
                                                            coll_base_reduce_scatter.c ("front")
    forward    own    ((x(c) op x(c+1)) op ...) op x(c-1)   Open MPI coll_base_allreduce.c:
                                                            _intra_ring, _intra_ring_segmented
                                                            ("front")
    reverse    next   ((x(c-1) op x(c-2)) op ...) op x(c)   Gloo gloo/allreduce.cc ring() ("gloo"):
                                                            torch's Gloo all_reduce, and its
                                                            reduce_scatter_tensor (the
                                                            all-reduce's block)
    reverse    own    ((x(c) op x(c-1)) op ...) op x(c+1)   MPICH's pairwise reduce-scatter,
                                                            reduce_scatter_intra_pairwise.c
                                                            ("front"; its sums, not its schedule)

With those options each library's sums come out bit for bit (checked on
adversarial and random float32 inputs, Gloo's float64 too, p = 3 and 4, at
counts that tell the cuts apart). Gloo passes its own chunk as the left
operand, refcoll the partial: for IEEE sum and product that is the same result.
The reduce-scatter keeps rank r's block under any option (under another
``split`` or ``start="own"`` it runs as the all-reduce, as torch's Gloo does:
:func:`ring_reduce_scatter`).
Outside the orders stay two edges of Open MPI's: its ring runs recursive doubling
when ``n < p``, and its segmented ring the plain ring below ``p`` segments. The
all-reduce's options change no count: the same messages, of the chosen cut's chunks.

Spec: spec/ring.md
"""

from __future__ import annotations

import numpy as np

from ..core.chunking import check_split, chunk_bounds, chunk_sizes, max_chunk
from ..core.cost import ZERO, Cost
from ..core.errors import UsageError
from ._util import copy_into, receive_into, view, workspace
from .registry import Algorithm, LinkCost, register

__all__ = [
    "DIRECTIONS",
    "STARTS",
    "ring_peers",
    "ring_walk",
    "ring_order",
    "ring_reduce_scatter_steps",
    "ring_allgather_steps",
    "ring_allreduce",
    "ring_reduce_scatter",
    "ring_allgather",
    "ring_reduce_scatter_cost",
    "ring_allgather_cost",
    "ring_allreduce_cost",
    "ring_price",
    "ring_orders",
]

#: ``direction``: the rank step a message takes, by name (the default first).
DIRECTIONS = {"forward": 1, "reverse": -1}
#: ``start``: how many hops past rank ``c`` (in the ring's direction) chunk ``c`` starts.
STARTS = {"next": 1, "own": 0}


def _choice(name: str, value, allowed: dict) -> int:
    try:
        return allowed[value]
    except (KeyError, TypeError):
        raise UsageError(f"ring {name} must be one of {', '.join(allowed)}, "
                         f"got {value!r}") from None


def ring_walk(direction: str = "forward", start: str = "next") -> tuple[int, int]:
    """Return ``(hop, lead)``: sends go to ``r + hop``; chunk ``c`` starts at ``c + hop·lead``.

    Raises:
        UsageError: a ``direction`` or ``start`` the ring does not know.
    """
    return _choice("direction", direction, DIRECTIONS), _choice("start", start, STARTS)


def ring_order(c: int, p: int, direction: str = "forward", start: str = "next") -> list[int]:
    """Return the ranks whose chunks ``c`` is folded over, left to right (see the module)."""
    hop, lead = ring_walk(direction, start)
    return [(c + hop * (lead + i)) % p for i in range(p)]


def ring_peers(rank: int, size: int, hop: int = 1) -> tuple[int, int]:
    """Return ``(left, right)``: the ranks this rank receives from and sends to.

    ``hop = -1`` turns the ring round: "left" is then rank ``rank + 1``.
    """
    return (rank - hop) % size, (rank + hop) % size


def ring_reduce_scatter_steps(t, x: np.ndarray, bounds, *, op, target, scratch,
                              hop: int = 1, lead: int = 1) -> int:
    """Run the ring reduce-scatter's ``p-1`` steps over chunks ``bounds`` of ``x``.

    Step ``s`` (``hop = lead = 1``, the default): send the partial of chunk
    ``r-s-1`` right, receive the partial of chunk ``r-s-2`` from the left and
    combine it with our own chunk: ``target(idx) = incoming op x[idx]``. In
    general the chunks are ``r - hop·(s+lead)`` and ``r - hop·(s+lead+1)``. The
    chunk written in the last step, ``r + hop·(1-lead)`` (returned), is this
    rank's finished chunk; the others are partials in flight. The partial lands
    straight in ``target(idx)`` when that overlaps neither the chunk being sent
    nor ``x`` (an out-of-place all-reduce), else in ``scratch``.

    Reduction order: chunk ``c`` is combined over ranks ``c + hop·lead``,
    ``c + hop·(lead+1)``, ... (``p`` of them), each step appending one rank on
    the right of the running partial.
    """
    size, rank = t.size, t.rank
    left, right = ring_peers(rank, size, hop)
    first = rank - hop * lead  # the chunk sent at step 0: our own input
    finished = None  # the partial this rank combined in the previous step
    for k in range(first, first - hop * (size - 1), -hop):  # k = first - hop·step
        send_idx = k % size  # our own input at step 0, then last step's partial
        recv_idx = (k - hop) % size
        sending = view(x, bounds, send_idx) if finished is None else finished
        start, stop = bounds[recv_idx]
        dst, own = target(recv_idx), x[start:stop]
        incoming = receive_into(dst, scratch[: stop - start], sending, own)
        # the partial of send_idx -> right; of recv_idx <- left
        t.sendrecv(sending, right, incoming, left)
        t.reduce_local(op, incoming, own, dst)  # chunk recv_idx: the left's partial, then ours
        finished = dst
    return (rank + hop * (1 - lead)) % size


def ring_allgather_steps(t, buf: np.ndarray, bounds, *, hop: int = 1,
                         held: int | None = None) -> None:
    """Run the ring allgather's ``p-1`` steps in place: each rank's chunk ``held`` goes round.

    Step ``s``: send chunk ``held - hop·s`` on, receive chunk ``held - hop·(s+1)``
    straight into its place in ``buf``. ``held`` defaults to the rank
    (``hop = 1``: send chunk ``r-s`` right, receive ``r-s-1`` from the left).
    """
    size, rank = t.size, t.rank
    left, right = ring_peers(rank, size, hop)
    held = rank if held is None else held
    for k in range(held, held - hop * (size - 1), -hop):  # k = held - hop·step
        send_idx = k % size
        recv_idx = (k - hop) % size
        t.sendrecv(view(buf, bounds, send_idx), right,
                   view(buf, bounds, recv_idx), left)  # chunk send_idx -> right; recv_idx <- left


def ring_allreduce(t, x: np.ndarray, out: np.ndarray, *, op, direction: str = "forward",
                   start: str = "next", split: str = "front") -> None:
    """Ring all-reduce: a ring reduce-scatter, then a ring allgather.

    Schedule (p = t.size, r = t.rank, chunks = chunk_bounds(len(x), p, split);
    the defaults, ``direction="forward"``, ``start="next"``):
      1. reduce-scatter, step s = 0..p-2: send chunk (r-s-1) right, receive chunk
         (r-s-2) from the left, reduce it with ours straight into ``out``.
      2. allgather,     step s = 0..p-2: send chunk (r-s) right, receive chunk (r-s-1).
    ``direction="reverse"`` sends left instead; ``start="own"`` sends chunk (r-s)
    in step 1, finishing chunk r+1, which the allgather then sends first.
    Reduction order: chunk c is reduced c+1, c+2, ..., c (around the ring); the
    other options' orders are in the module's table.
    Cost: 2(p-1)·α + 2·((p-1)/p)·n·β + ((p-1)/p)·n·γ, under every option.
    Restrictions: none on p or n (n < p gives empty chunks, sent as empty messages).
    The first step sends straight from ``x``, so an out-of-place call never copies
    its input, and each partial is received straight into its chunk of ``out``
    (in place: into one chunk of scratch).   Spec: spec/ring.md
    """
    hop, lead = ring_walk(direction, start)
    size = t.size
    if split == "front":
        bounds = chunk_bounds(x.size, size)
        largest = max_chunk(x.size, size)
    else:
        check_split(split)
        bounds = chunk_bounds(x.size, size, split, itemsize=x.dtype.itemsize)
        largest = max(stop - begin for begin, stop in bounds)
    if size == 1:
        copy_into(out, x)
        return
    scratch = workspace(t, largest, x.dtype)
    held = ring_reduce_scatter_steps(t, x, bounds, op=op, scratch=scratch, hop=hop, lead=lead,
                                     target=lambda idx: view(out, bounds, idx))
    ring_allgather_steps(t, out, bounds, hop=hop, held=held)


def ring_reduce_scatter(t, x: np.ndarray, out: np.ndarray, *, op, direction: str = "forward",
                        start: str = "next", split: str = "front") -> None:
    """Ring reduce-scatter: rank r gets chunk r of the reduction, ``chunk_bounds`` rule.

    ``direction="reverse"`` sends left: chunk c is then reduced c-1, c-2, ..., c.
    Partials in flight live in one chunk-sized accumulator; only the last step
    writes ``out``. Cost: (p-1)·α + ((p-1)/p)·n·β + ((p-1)/p)·n·γ.

    Rank r's block is the collective's cut (``"front"``), so a ring whose chunks
    are other (``split`` other than ``"front"``), or end one rank early
    (``start="own"``), cannot leave it there: under those options the
    reduce-scatter is the ring all-reduce with the same options, of which rank r
    keeps block r, as torch's Gloo ``reduce_scatter_tensor`` does with Gloo's
    ring (``ring(direction=reverse, split=gloo)``). Its result is always block r
    of the all-reduce under the same options; its cost, in that case, the
    all-reduce's.
    """
    hop, lead = ring_walk(direction, start)
    size, rank = t.size, t.rank
    if split != "front" or lead != 1:
        full = workspace(t, x.size, x.dtype, slot=1)
        ring_allreduce(t, x, full, op=op, direction=direction, start=start, split=split)
        copy_into(out, view(full, chunk_bounds(x.size, size), rank))
        return
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

    ring_reduce_scatter_steps(t, x, bounds, op=op, scratch=scratch, target=target, hop=hop)


def ring_allgather(t, out: np.ndarray) -> None:
    """Ring allgather, in place: ``out`` holds ``p`` equal blocks, block ``rank`` filled.

    Cost: (p-1)·α + (p-1)·m·β.
    """
    if t.size > 1:
        ring_allgather_steps(t, out, chunk_bounds(out.size, t.size))


def ring_orders(collective: str, p: int) -> list[dict]:
    """Return the option sets under which the ring reduces in distinct orders on ``p`` ranks.

    With ``p <= 2`` every element is ``x0 op x1`` under every option. A fold is
    fixed by its sequence of ranks up to swapping the first two, so on 3 ranks
    the reverse walk from the next rank equals the forward one, and only splits
    and the ``own`` starts differ. ``split="last"`` is listed though no known
    ring cuts that way, as a cut a hand-written ring may well use.
    """
    if p <= 2 or collective == "allgather":
        return [{}]
    if collective == "reduce_scatter":
        # reverse/own: MPICH's pairwise reduce-scatter (reduce_scatter_intra_pairwise.c)
        # folds chunk r over ranks r, r-1, ..., r+1, the ring's order under those options.
        gloo = {"direction": "reverse", "split": "gloo"}
        pairwise = {"direction": "reverse", "start": "own"}
        return [{}, {"direction": "reverse"}, gloo, pairwise] if p > 3 else [{}, gloo, pairwise]
    orders = [{}, {"split": "ceil"}, {"split": "last"}, {"start": "own"},
              {"direction": "reverse", "start": "own"},
              {"direction": "reverse", "split": "gloo"}]
    if p > 3:
        orders.insert(4, {"direction": "reverse"})
    return orders


# ------------------------------------------------------------------ cost

def ring_reduce_scatter_cost(p: int, n: int, itemsize: int, *, direction: str = "forward",
                             start: str = "next", split: str = "front") -> Cost:
    """Ring reduce-scatter: ``p-1`` rounds, each rank passes one chunk on per round.

    Under another ``split`` or ``start="own"`` it is the all-reduce's cost
    (:func:`ring_reduce_scatter` runs the all-reduce then).
    """
    _, lead = ring_walk(direction, start)
    if split != "front" or lead != 1:
        return ring_allreduce_cost(p, n, itemsize, direction=direction, start=start, split=split)
    if p == 1:
        return ZERO
    sizes = chunk_sizes(n, p)
    # Rank r sends every chunk but its own (chunk r) and reduces every chunk but r-1.
    return Cost(rounds=p - 1, messages=p * (p - 1), bytes=(p - 1) * n * itemsize,
                max_rank_messages=p - 1, max_rank_bytes=(n - min(sizes)) * itemsize,
                critical_bytes=(p - 1) * max_chunk(n, p) * itemsize, reduced=n - min(sizes),
                formula="(p-1)·α + ((p-1)/p)·n·β + ((p-1)/p)·n·γ")


def ring_allgather_cost(p: int, m: int, itemsize: int) -> Cost:
    """Ring allgather of ``m`` elements per rank: ``p-1`` rounds of one block each."""
    if p == 1:
        return ZERO
    b = m * itemsize
    return Cost(rounds=p - 1, messages=p * (p - 1), bytes=p * (p - 1) * b,
                max_rank_messages=p - 1, max_rank_bytes=(p - 1) * b, critical_bytes=(p - 1) * b,
                reduced=0, formula="(p-1)·α + (p-1)·m·β")


def ring_allreduce_cost(p: int, n: int, itemsize: int, *, direction: str = "forward",
                        start: str = "next", split: str = "front") -> Cost:
    """Ring all-reduce: ring reduce-scatter then ring allgather of the chunks.

    The same under every ``direction`` and ``start``: every round moves every
    chunk once, and a rank sends all chunks but two neighbouring ones.
    """
    ring_walk(direction, start)
    check_split(split)
    if p == 1:
        return ZERO
    sizes = chunk_sizes(n, p, split, itemsize=itemsize)
    # Rank r sends all chunks but r in the reduce-scatter, all but r+1 in the allgather
    # (under start="own": all but r+1, then all but r+2; reversed: r-1 for r+1).
    busiest = max(2 * n - sizes[r] - sizes[(r + 1) % p] for r in range(p))
    return Cost(rounds=2 * (p - 1), messages=2 * p * (p - 1), bytes=2 * (p - 1) * n * itemsize,
                max_rank_messages=2 * (p - 1), max_rank_bytes=busiest * itemsize,
                critical_bytes=2 * (p - 1) * max(sizes) * itemsize, reduced=n - min(sizes),
                formula="2(p-1)·α + 2((p-1)/p)·n·β + ((p-1)/p)·n·γ")


def ring_price(shape, count: int, itemsize: int, *, inter: str = "ring") -> list[LinkCost]:
    """Price the flat ring on a cluster: each step waits for the slowest link it uses.

    On racks of consecutive nodes each step sends one flow out of every rack.
    """
    p, link = shape.ranks, shape.flat_ring_link()
    uplink = 1 if shape.racks > 1 else 0
    return [LinkCost("reduce-scatter", link, ring_reduce_scatter_cost(p, count, itemsize),
                     uplink=uplink),
            LinkCost("allgather", link, ring_allgather_cost(p, max_chunk(count, p), itemsize),
                     uplink=uplink)]


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
    orders=ring_orders,
))
