"""α-β-γ cost of every algorithm: one pure function each, held to the ledger by tests.

Model (Hockney; Thakur, Rabenseifner and Gropp 2005): a message of ``b`` bytes
costs ``α + b·β``, combining ``e`` elements costs ``e·γ``. Each function returns
the exact counts the simulator's :class:`~refcoll.transport.base.Ledger` must show
for ``p`` ranks and ``n`` elements of ``itemsize`` bytes:

* ``rounds``: α terms on the critical path (the ledger's largest step);
* ``messages``, ``bytes``: totals over all ranks;
* ``max_rank_messages``, ``max_rank_bytes``: the busiest sender;
* ``critical_bytes``: β bytes on the critical path (largest message per round, summed);
* ``reduced``: elements combined by the busiest rank (γ terms).

``time(α, β, γ) = rounds·α + critical_bytes·β + reduced·γ`` is what
``algorithm="auto"`` and ``refcoll model`` compare. ``formula`` is the textbook
form for display, with ``n`` in bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .chunking import chunk_sizes, max_chunk

__all__ = ["Cost", "ZERO"]


@dataclass(frozen=True)
class Cost:
    """Exact message counts of one collective call, and its α-β-γ time."""

    rounds: int
    messages: int
    bytes: int
    max_rank_messages: int
    max_rank_bytes: int
    critical_bytes: int
    reduced: int
    formula: str = ""

    def time(self, alpha: float, beta: float, gamma: float) -> float:
        """Return the modelled time: ``rounds·α + critical_bytes·β + reduced·γ``."""
        return self.rounds * alpha + self.critical_bytes * beta + self.reduced * gamma

    def counts(self) -> dict:
        """Return the counts (everything but the formula) as a dict."""
        d = asdict(self)
        d.pop("formula")
        return d


ZERO = Cost(0, 0, 0, 0, 0, 0, 0, "0")


# ------------------------------------------------------------------------ naive

def naive_reduce(p: int, n: int, itemsize: int) -> Cost:
    """Linear reduce: the root receives ``p-1`` whole buffers, one after another."""
    if p == 1:
        return ZERO
    b = n * itemsize
    return Cost(p - 1, p - 1, (p - 1) * b, 1, b, (p - 1) * b, (p - 1) * n,
                "(p-1)·α + (p-1)·n·β + (p-1)·n·γ")


def naive_broadcast(p: int, n: int, itemsize: int) -> Cost:
    """Linear broadcast: the root sends the whole buffer to each rank in turn."""
    if p == 1:
        return ZERO
    b = n * itemsize
    return Cost(p - 1, p - 1, (p - 1) * b, p - 1, (p - 1) * b, (p - 1) * b, 0,
                "(p-1)·α + (p-1)·n·β")


def naive_allreduce(p: int, n: int, itemsize: int) -> Cost:
    """Linear reduce to rank 0, then linear broadcast from it."""
    if p == 1:
        return ZERO
    b = n * itemsize
    return Cost(2 * (p - 1), 2 * (p - 1), 2 * (p - 1) * b, p - 1, (p - 1) * b,
                2 * (p - 1) * b, (p - 1) * n, "2(p-1)·α + 2(p-1)·n·β + (p-1)·n·γ")


def naive_reduce_scatter(p: int, n: int, itemsize: int) -> Cost:
    """Linear reduce to rank 0, then rank 0 sends chunk i to rank i."""
    if p == 1:
        return ZERO
    b = n * itemsize
    scattered = (n - chunk_sizes(n, p)[0]) * itemsize
    return Cost(2 * (p - 1), 2 * (p - 1), (p - 1) * b + scattered, p - 1, max(b, scattered),
                (p - 1) * b + scattered, (p - 1) * n,
                "2(p-1)·α + (p-1)·n·β + ((p-1)/p)·n·β + (p-1)·n·γ")


def naive_allgather(p: int, m: int, itemsize: int) -> Cost:
    """Linear gather of ``m`` elements per rank to rank 0, then linear broadcast of all ``p·m``."""
    if p == 1:
        return ZERO
    b = m * itemsize
    return Cost(2 * (p - 1), 2 * (p - 1), (p - 1) * b + (p - 1) * p * b, p - 1, (p - 1) * p * b,
                (p - 1) * b + (p - 1) * p * b, 0, "2(p-1)·α + (p-1)·m·β + (p-1)·p·m·β")


# ------------------------------------------------------------------------- ring

def ring_reduce_scatter(p: int, n: int, itemsize: int) -> Cost:
    """Ring reduce-scatter: ``p-1`` rounds, each rank passes one chunk right per round."""
    if p == 1:
        return ZERO
    sizes = chunk_sizes(n, p)
    # Rank r sends every chunk but its own (chunk r) and reduces every chunk but r-1.
    return Cost(p - 1, p * (p - 1), (p - 1) * n * itemsize, p - 1,
                (n - min(sizes)) * itemsize, (p - 1) * max_chunk(n, p) * itemsize,
                n - min(sizes), "(p-1)·α + ((p-1)/p)·n·β + ((p-1)/p)·n·γ")


def ring_allgather(p: int, m: int, itemsize: int) -> Cost:
    """Ring allgather of ``m`` elements per rank: ``p-1`` rounds of one block each."""
    if p == 1:
        return ZERO
    b = m * itemsize
    return Cost(p - 1, p * (p - 1), p * (p - 1) * b, p - 1, (p - 1) * b, (p - 1) * b, 0,
                "(p-1)·α + (p-1)·m·β")


def ring_allreduce(p: int, n: int, itemsize: int) -> Cost:
    """Ring all-reduce: ring reduce-scatter then ring allgather of the chunks."""
    if p == 1:
        return ZERO
    sizes = chunk_sizes(n, p)
    # Rank r sends all chunks but r in the reduce-scatter, all but r+1 in the allgather.
    busiest = max(2 * n - sizes[r] - sizes[(r + 1) % p] for r in range(p))
    return Cost(2 * (p - 1), 2 * p * (p - 1), 2 * (p - 1) * n * itemsize, 2 * (p - 1),
                busiest * itemsize, 2 * (p - 1) * max_chunk(n, p) * itemsize, n - min(sizes),
                "2(p-1)·α + 2((p-1)/p)·n·β + ((p-1)/p)·n·γ")


# ---- hierarchical

def _hierarchical_parts(p: int, n: int, itemsize: int, ranks_per_node, inter: str):
    """Return ``(sizes, intra costs, inter costs, inter's formula)`` of the phases.

    Equal nodes: intra is one ring all-reduce per node (its reduce-scatter and
    allgather halves), inter one ``inter`` all-reduce per shard ``j``. Unequal:
    intra is a naive reduce and a naive broadcast per node, inter one
    all-reduce of the whole buffer among the leaders.
    """
    from ..algorithms import get  # late: the registry imports this module
    from ..algorithms.hierarchical import node_sizes

    sizes = node_sizes(p, ranks_per_node or p)
    g = len(sizes)
    inter_cost = get(inter).costs["allreduce"]
    if len(set(sizes)) == 1:
        intra = [ring_allreduce(sizes[0], n, itemsize)] * g
        across = [inter_cost(g, shard, itemsize) for shard in chunk_sizes(n, sizes[0])]
    else:
        intra = [naive_reduce(m, n, itemsize) for m in sizes] + \
                [naive_broadcast(m, n, itemsize) for m in sizes]
        across = [inter_cost(g, n, itemsize)]
    return sizes, intra, across, inter_cost(2, 1, itemsize).formula  # general even when g == 1


def hierarchical_allreduce(p: int, n: int, itemsize: int, *, ranks_per_node: int | None = None,
                           inter: str = "ring") -> Cost:
    """Two-level all-reduce: ``g`` nodes of ``k`` ranks (``None``: one node of ``p``).

    Equal nodes: a ring all-reduce's two halves inside each node around an
    ``inter`` all-reduce of each shard ``j`` (``chunk_sizes(n, k)[j]`` elements)
    over ``g`` ranks, the ``k`` shards' all-reduces running side by side.
    Unequal nodes (the last one smaller): a naive reduce to each leader, an
    ``inter`` all-reduce of ``n`` among the ``g`` leaders, a naive broadcast.

    Rank (node i, local j) sends ``2n - n_j - n_(j+1)`` elements and reduces
    ``n - n_(j-1)`` inside an equal node (the ring's counts), a leader ``k-1``
    whole buffers each way inside an unequal one.

    Only ``inter``'s totals are known here, not its per-rank or per-round counts,
    so the composition is exact when ``inter`` (1) runs the same rounds for every
    shard size, with messages that do not shrink as ``n`` grows, (2) ends in the
    same round on every rank, and (3) has cross rank 0 among its busiest ranks.
    ``ring``, ``recursive_doubling``, ``rabenseifner`` and ``tree`` are held to the
    ledger exactly. ``naive`` breaks (2): a node that finishes early overlaps its
    allgather with the others' inter rounds, so ``critical_bytes`` (and, with
    unequal nodes, ``rounds``) are upper bounds. ``dbtree`` breaks (1) and (3): its
    counts here are estimates.
    """
    if p == 1:
        return ZERO
    sizes, intra, across, inter_formula = _hierarchical_parts(p, n, itemsize, ranks_per_node,
                                                              inter)
    k, g = sizes[0], len(sizes)
    if len(set(sizes)) == 1:
        shards = chunk_sizes(n, k)
        # Rank j sends every shard but j (reduce-scatter) and but j+1 (allgather) inside its
        # node and reduces every shard but j-1; the shards' all-reduces run side by side.
        return Cost(
            intra[0].rounds + max(c.rounds for c in across),
            sum(c.messages for c in intra) + sum(c.messages for c in across),
            sum(c.bytes for c in intra) + sum(c.bytes for c in across),
            intra[0].max_rank_messages + max(c.max_rank_messages for c in across),
            max((2 * n - shards[j] - shards[(j + 1) % k]) * itemsize + across[j].max_rank_bytes
                for j in range(k)),
            intra[0].critical_bytes + max(c.critical_bytes for c in across),
            max(n - shards[j - 1] + across[j].reduced for j in range(k)),
            f"k={k} ranks per node, g={g} nodes: 2(k-1)·α + 2((k-1)/k)·n·β + ((k-1)/k)·n·γ "
            f"inside the nodes + {inter} all-reduce of n/k over g [{inter_formula}, p=g, n=n/k]",
        )
    reduce_k, bcast_k = intra[0], intra[g]  # the first node is a full one: the slowest
    return Cost(
        reduce_k.rounds + across[0].rounds + bcast_k.rounds,
        sum(c.messages for c in intra) + across[0].messages,
        sum(c.bytes for c in intra) + across[0].bytes,
        bcast_k.max_rank_messages + across[0].max_rank_messages,
        bcast_k.max_rank_bytes + across[0].max_rank_bytes,
        reduce_k.critical_bytes + across[0].critical_bytes + bcast_k.critical_bytes,
        reduce_k.reduced + across[0].reduced,
        f"nodes {'+'.join(map(str, sizes))} (unequal: leader-based), k={k}, g={g}: "
        f"2(k-1)·α + 2(k-1)·n·β + (k-1)·n·γ inside the nodes + {inter} all-reduce of n over "
        f"the g leaders [{inter_formula}, p=g]",
    )


def hierarchical_traffic(p: int, n: int, itemsize: int, *, ranks_per_node: int | None = None,
                         inter: str = "ring") -> tuple[int, int]:
    """Return the hierarchical all-reduce's ``(intra-node bytes, inter-node bytes)``.

    Every byte of the inter phase crosses nodes and no other byte does, so with
    ``g`` nodes of ``k`` ranks and ``inter="ring"`` the inter-node total is
    ``2(g-1)·n`` bytes·itemsize (each rank sends ``2((g-1)/g)·(n/k)``), and the
    intra-node total ``2g(k-1)·n``. :func:`refcoll.algorithms.hierarchical.node_traffic`
    measures the same split on a ledger.
    """
    if p == 1:
        return 0, 0
    _, intra, across, _ = _hierarchical_parts(p, n, itemsize, ranks_per_node, inter)
    return sum(c.bytes for c in intra), sum(c.bytes for c in across)


# ---- recursive
#
# p' = 2^floor(lg p) survivors, rem = p - p' (the fold of MPICH's recursive
# doubling and Rabenseifner files: ranks 2i -> 2i+1 for i < rem, then back).
# Survivor i of the halving and doubling steps owns "position" i: the elements
# ``sizes[i]``. Ranks that stood in the fold start one round late (Lamport step
# 1 was the fold), so a message's round is its step number plus one when the
# group of survivors it depends on contains a folded one; after ``lg p'`` steps
# every group is everyone, and the rounds line up again.

def _pof2_fold(p: int) -> tuple[int, int, int]:
    """Return ``(p', rem, lg p')`` of the non-power-of-two fold."""
    pof2 = 1 << (p.bit_length() - 1)
    return pof2, p - pof2, pof2.bit_length() - 1


def _own_blocks(sizes: list[int], i: int) -> int:
    """Elements of the aligned blocks of 1, 2, ..., p'/2 positions that hold position ``i``.

    What survivor ``i`` reduces in a recursive halving (it keeps those blocks), and
    what it sends in a recursive-doubling allgather (it passes them on).
    """
    total, mask = 0, 1
    while mask < len(sizes):
        first = i & ~(mask - 1)
        total += sum(sizes[first:first + mask])
        mask *= 2
    return total


def _halving_rounds(sizes: list[int], rem: int, start: int) -> dict[int, int]:
    """Return ``{round: largest message}`` (elements) of recursive halving over ``sizes``.

    Step ``k`` (mask ``m = p'/2^k``) links survivors that agree modulo ``m``; the
    group holds a folded survivor (``< rem``) when its smallest member ``i % m`` does.
    """
    largest: dict[int, int] = {}
    pof2, mask, k = len(sizes), len(sizes) // 2, 1
    while mask:
        for i in range(pof2):
            first = (i ^ mask) & ~(mask - 1)  # the peer's half, which we send
            step = start + k + (1 if i % mask < rem else 0)
            largest[step] = max(largest.get(step, 0), sum(sizes[first:first + mask]))
        mask, k = mask // 2, k + 1
    return largest


def _doubling_rounds(sizes: list[int], rem: int, start: int) -> dict[int, int]:
    """Return ``{round: largest message}`` (elements) of a recursive-doubling allgather.

    Step ``k`` (mask ``m = 2^(k-1)``) links the aligned groups of ``2m`` survivors;
    the group holds a folded survivor when its first member does (``rem = 0``:
    none lags).
    """
    largest: dict[int, int] = {}
    pof2, mask, k = len(sizes), 1, 1
    while mask < pof2:
        for i in range(pof2):
            first = i & ~(mask - 1)  # our block, which we send
            step = start + k + (1 if i & ~(2 * mask - 1) < rem else 0)
            largest[step] = max(largest.get(step, 0), sum(sizes[first:first + mask]))
        mask, k = mask * 2, k + 1
    return largest


def _sum_of_largest(*rounds: dict[int, int]) -> int:
    """Return the sum over rounds of the largest message in any of ``rounds``."""
    largest: dict[int, int] = {}
    for table in rounds:
        for step, size in table.items():
            largest[step] = max(largest.get(step, 0), size)
    return sum(largest.values())


def recursive_doubling_allreduce(p: int, n: int, itemsize: int) -> Cost:
    """Recursive doubling: ``lg p'`` whole-buffer exchanges, plus the fold's two messages.

    Published (MPICH; Thakur, Rabenseifner and Gropp 2005): ``lg p·α + n·lg p·β +
    n·lg p·γ`` for ``p`` a power of two. The fold adds ``2α + 2n·β + n·γ``: a round
    to send the even ranks' buffers in, one to send the result back, and the
    absorbing rank's extra reduction. Every message is the whole buffer and every
    round has one, so ``critical_bytes = rounds·n``.
    """
    if p == 1:
        return ZERO
    pof2, rem, lg = _pof2_fold(p)
    b = n * itemsize
    folded = 1 if rem else 0
    rounds = lg + 2 * folded
    formula = "lg p·α + n·lg p·β + n·lg p·γ"
    if rem:
        formula = ("⌊lg p⌋·α + n·⌊lg p⌋·β + n·⌊lg p⌋·γ "
                   "+ (2α + 2n·β + n·γ for the fold)")
    return Cost(rounds, 2 * rem + pof2 * lg, (2 * rem + pof2 * lg) * b, lg + folded,
                (lg + folded) * b, rounds * b, (lg + folded) * n, formula)


def rabenseifner_allreduce(p: int, n: int, itemsize: int) -> Cost:
    """Rabenseifner: fold, halving and doubling over ``chunk_bounds(n, p')``, unfold.

    Published (Thakur, Rabenseifner and Gropp 2005; MPICH): ``2·lg p·α +
    2·((p-1)/p)·n·β + ((p-1)/p)·n·γ`` for ``p`` a power of two; otherwise, with ``p'``
    for ``p``, ``(2·lg p' + 2)·α + (2·(p'-1)/p' + 2)·n·β + (1 + (p'-1)/p')·n·γ``:
    the fold's two rounds of ``n`` and its extra reduction of ``n``.
    """
    if p == 1:
        return ZERO
    pof2, rem, lg = _pof2_fold(p)
    sizes = chunk_sizes(n, pof2)
    # Survivor i sends every position but its own down, its own blocks up; folded
    # survivors also reduce the fold and send the result back.
    sent = [n - sizes[i] + _own_blocks(sizes, i) + (n if i < rem else 0) for i in range(pof2)]
    reduced = [_own_blocks(sizes, i) + (n if i < rem else 0) for i in range(pof2)]
    folded = 1 if rem else 0
    fold = {1: n, 2 * lg + 2: n} if rem else {}
    critical = _sum_of_largest(fold, _halving_rounds(sizes, rem, 0),
                               _doubling_rounds(sizes, 0, lg + folded))
    formula = "2·lg p·α + 2·((p-1)/p)·n·β + ((p-1)/p)·n·γ"
    if rem:
        formula = ("(2·lg p'+2)·α + (2·((p'-1)/p') + 2)·n·β + (1 + (p'-1)/p')·n·γ, "
                   "p' = 2^⌊lg p⌋")
    return Cost(2 * lg + 2 * folded, 2 * rem + 2 * lg * pof2,
                (2 * rem * n + 2 * (pof2 - 1) * n) * itemsize, 2 * lg + folded,
                max(sent + [n if rem else 0]) * itemsize, critical * itemsize, max(reduced),
                formula)


def _survivor_sizes(per_rank: list[int], p: int) -> list[int]:
    """Return, per survivor, the elements of the ranks it stands for (2i and 2i+1, or i+rem)."""
    pof2, rem, _ = _pof2_fold(p)
    return [per_rank[2 * i] + per_rank[2 * i + 1] if i < rem else per_rank[i + rem]
            for i in range(pof2)]


def rabenseifner_reduce_scatter(p: int, n: int, itemsize: int) -> Cost:
    """Recursive halving over the survivors' chunks, with the fold (chunk 2i sent back).

    Published (Thakur, Rabenseifner and Gropp 2005): ``lg p·α + ((p-1)/p)·n·β +
    ((p-1)/p)·n·γ`` for ``p`` a power of two. The fold adds ``2α + n·β + (n/p)·β +
    n·γ``: the even ranks' buffers in, chunk ``2i`` back out, one more reduction.
    """
    if p == 1:
        return ZERO
    pof2, rem, lg = _pof2_fold(p)
    chunks = chunk_sizes(n, p)
    sizes = _survivor_sizes(chunks, p)
    back = [chunks[2 * i] for i in range(rem)]  # chunk 2i, from rank 2i+1 to rank 2i
    sent = [n - sizes[i] + (back[i] if i < rem else 0) for i in range(pof2)]
    reduced = [_own_blocks(sizes, i) + (n if i < rem else 0) for i in range(pof2)]
    folded = 1 if rem else 0
    fold = {1: n, lg + 2: max(back)} if rem else {}
    formula = "lg p·α + ((p-1)/p)·n·β + ((p-1)/p)·n·γ"
    if rem:
        formula = ("lg p'·α + ((p'-1)/p')·n·β + ((p'-1)/p')·n·γ "
                   "+ (2α + n·β + (n/p)·β + n·γ for the fold), p' = 2^⌊lg p⌋")
    return Cost(lg + 2 * folded, 2 * rem + lg * pof2,
                (rem * n + (pof2 - 1) * n + sum(back)) * itemsize, lg + folded,
                max(sent + [n if rem else 0]) * itemsize,
                _sum_of_largest(fold, _halving_rounds(sizes, rem, 0)) * itemsize, max(reduced),
                formula)


def rabenseifner_allgather(p: int, m: int, itemsize: int) -> Cost:
    """Recursive-doubling allgather of ``m`` elements per rank, with the fold.

    Published (Thakur, Rabenseifner and Gropp 2005): ``lg p·α + (p-1)·m·β`` for
    ``p`` a power of two. The fold adds ``2α + m·β + p·m·β``: block ``2i`` in, the
    whole ``p·m`` back out.
    """
    if p == 1:
        return ZERO
    pof2, rem, lg = _pof2_fold(p)
    sizes = _survivor_sizes([m] * p, p)
    sent = [_own_blocks(sizes, i) + (p * m if i < rem else 0) for i in range(pof2)]
    folded = 1 if rem else 0
    fold = {1: m, lg + 2: p * m} if rem else {}
    formula = "lg p·α + (p-1)·m·β"
    if rem:
        formula = ("lg p'·α + ((p'-1)/p')·p·m·β + (2α + m·β + p·m·β for the fold), "
                   "p' = 2^⌊lg p⌋")
    return Cost(lg + 2 * folded, 2 * rem + lg * pof2,
                (rem * m + (pof2 - 1) * p * m + rem * p * m) * itemsize, lg + folded,
                max(sent + [m if rem else 0]) * itemsize,
                _sum_of_largest(fold, _doubling_rounds(sizes, rem, 0)) * itemsize, 0, formula)


# ---- switch

def _lamport_replay(runs, itemsize: int) -> tuple[int, int]:
    """Return ``(rounds, critical_bytes)`` of messages matched one at a time in order.

    ``runs`` is ``[(transfers, repeat), ...]`` with ``transfers`` a tuple of
    ``(source, dest, elements)``. A message's step is one more than the later of
    its two ranks' clocks, the simulator's rule. Steps at or below every rank's
    clock can get no further message, so their largest message is final. Once a
    tick leaves the state (clocks and open steps, less the least clock) as it
    found it, each further tick of the run repeats it shifted by the same amount
    (max-plus homogeneity), and the rest of the run is added at once.
    """
    clock = {r: 0 for transfers, _ in runs for a, b, _ in transfers for r in (a, b)}
    open_steps: dict[int, int] = {}  # step -> largest message at it, not yet final
    critical = 0
    for transfers, repeat in runs:
        state = None
        for done in range(1, repeat + 1):
            floor_before = min(clock.values())
            for source, dest, elements in transfers:
                step = max(clock[source], clock[dest]) + 1
                clock[source] = clock[dest] = step
                open_steps[step] = max(open_steps.get(step, 0), elements * itemsize)
            floor = min(clock.values())
            final = sum(open_steps.pop(s) for s in [s for s in open_steps if s <= floor])
            critical += final
            previous, state = state, (tuple(c - floor for c in clock.values()),
                                      tuple(sorted((s - floor, b) for s, b in open_steps.items())))
            if state == previous:  # a fixed point: jump over the rest of the run
                shift = (repeat - done) * (floor - floor_before)
                critical += (repeat - done) * final
                clock = {r: c + shift for r, c in clock.items()}
                open_steps = {s + shift: b for s, b in open_steps.items()}
                break
    return max(clock.values(), default=0), critical + sum(open_steps.values())


def switch_allreduce(p: int, n: int, itemsize: int, *, radix: int = 4, packet: int = 256,
                     slots: int = 8, mode: str = "float", **_) -> Cost:
    """In-network all-reduce over ``p`` workers and ``switch_count(p)`` switches.

    ``P = ceil(n/packet)`` packets; each of the ``W+S-1`` tree links carries every
    packet once up and once down, so a worker sends ``n`` and receives ``n``
    bytes whatever ``p`` is (int mode: int32 on the wire, ``4·(n + P)`` bytes
    each way, the exponents included, plus ``4·min(slots, P)`` for the first
    exponents). Rounds and critical bytes replay the schedule's Lamport clock
    (:func:`refcoll.algorithms.switch.switch_schedule`): the ledger serves a
    switch's ports one at a time, where SHARP's latency is ``2·D`` hops.
    """
    # Imported here: the registry imports this module before the algorithms.
    from ..algorithms.switch import packet_count, switch_levels, switch_schedule

    levels = switch_levels(p, radix=radix)
    packets = packet_count(n, packet)
    if p == 1 or packets == 0:
        return ZERO
    links = sum(levels) - 1
    ticks, carried = packets, n  # messages per link each way; elements per link each way
    if mode == "int":
        itemsize = 4
        ticks, carried = packets + 1, n + packets + min(slots, packets)
    fan = [max_chunk(below, here) for below, here in zip(levels, levels[1:])]
    sends = max([f + 1 for f in fan[:-1]] + [fan[-1]])  # a switch: its children and its parent
    rounds, critical = _lamport_replay(
        switch_schedule(p, n, radix=radix, packet=packet, slots=slots, mode=mode), itemsize)
    return Cost(rounds, 2 * links * ticks, 2 * links * carried * itemsize, sends * ticks,
                sends * carried * itemsize, critical, (max(fan) - 1) * carried,
                "2·⌈log_R p⌉·α + 2·n·β + (R-1)·n·γ, in ⌈n/packet⌉ pipelined packets "
                "(the ledger serves a switch's R ports one after another)")


# ---- tree
#
# Binomial trees (MPICH; Thakur, Rabenseifner and Gropp 2005): the root of a
# reduce receives ⌈lg p⌉ partials per segment, and of a broadcast sends ⌈lg p⌉
# copies, one per round. With S = ⌈n/segment⌉ segments (1 unsegmented; 0 when
# n = 0, and nothing moves) the root is busy in each of the ⌈lg p⌉·S rounds, and
# the largest message of each round is the root's current segment, so the β term
# stays ⌈lg p⌉·n however the buffer is cut.

def _segment_count(n: int, segment: int | None) -> int:
    from ..algorithms.tree import segment_bounds  # late: the registry imports this module

    return len(segment_bounds(n, segment))


def tree_reduce(p: int, n: int, itemsize: int, *, segment: int | None = None) -> Cost:
    """Binomial reduce: ``⌈lg p⌉·S`` rounds; the root folds ``⌈lg p⌉`` whole buffers."""
    if p == 1:
        return ZERO
    segments = _segment_count(n, segment)
    lg, b = (p - 1).bit_length(), n * itemsize
    return Cost(lg * segments, (p - 1) * segments, (p - 1) * b, segments, b, lg * b, lg * n,
                "⌈lg p⌉·S·α + ⌈lg p⌉·n·β + ⌈lg p⌉·n·γ (S segments; 1 unsegmented)")


def tree_broadcast(p: int, n: int, itemsize: int, *, segment: int | None = None) -> Cost:
    """Binomial broadcast: ``⌈lg p⌉·S`` rounds; the root sends ``⌈lg p⌉`` whole buffers."""
    if p == 1:
        return ZERO
    segments = _segment_count(n, segment)
    lg, b = (p - 1).bit_length(), n * itemsize
    return Cost(lg * segments, (p - 1) * segments, (p - 1) * b, lg * segments, lg * b, lg * b, 0,
                "⌈lg p⌉·S·α + ⌈lg p⌉·n·β (S segments; 1 unsegmented)")


def tree_allreduce(p: int, n: int, itemsize: int, *, segment: int | None = None) -> Cost:
    """Binomial reduce to rank 0, then binomial broadcast: the two add up round for round.

    The broadcast starts when the root has its result, so its rounds follow the
    reduce's. A rank at position q sends ``S`` messages up and ``S`` to each of
    its ``c(q) < ⌈lg p⌉`` children, so the root, with ``⌈lg p⌉·S``, is the busiest.
    """
    if p == 1:
        return ZERO
    segments = _segment_count(n, segment)
    lg, b = (p - 1).bit_length(), n * itemsize
    return Cost(2 * lg * segments, 2 * (p - 1) * segments, 2 * (p - 1) * b, lg * segments,
                lg * b, 2 * lg * b, lg * n,
                "2⌈lg p⌉·S·α + 2⌈lg p⌉·n·β + ⌈lg p⌉·n·γ (S segments; 1 unsegmented)")


def dbtree_allreduce(p: int, n: int, itemsize: int, *, segment: int | None = 1 << 16) -> Cost:
    """Double binary tree: replay the schedule's messages with the simulator's clock rule.

    The two trees' pipelines meet at the ranks they share, so their rounds have
    no short closed form for every ``p``; they are computed here from
    :func:`refcoll.algorithms.tree.dbtree_messages` (every message in a global
    order each rank follows): a message's round is one more than the later of its
    two ranks' previous rounds. ``segment``'s default is
    :data:`refcoll.algorithms.tree.DBTREE_SEGMENT`. Cost of the replay:
    ``4(p-1)·S`` steps of Python. For ``p`` a power of two >= 4, rounds are
    exactly ``4(2 lg p - 1) + 12(S-1)`` with ``S`` segments per half.
    """
    from ..algorithms.tree import dbtree_messages  # late: the registry imports this module

    if p == 1:
        return ZERO
    clock = [0] * p
    sent, msgs, reduced = [0] * p, [0] * p, [0] * p
    largest: dict[int, int] = {}
    messages = total = 0
    for _tree, phase, source, dest, elements in dbtree_messages(p, n, segment):
        step = max(clock[source], clock[dest]) + 1
        clock[source] = clock[dest] = step
        largest[step] = max(largest.get(step, 0), elements)
        sent[source] += elements
        msgs[source] += 1
        if phase == "reduce":
            reduced[dest] += elements  # every partial received is folded once
        messages += 1
        total += elements
    return Cost(max(clock), messages, total * itemsize, max(msgs), max(sent) * itemsize,
                sum(largest.values()) * itemsize, max(reduced),
                "two trees, each a pipelined reduce + broadcast of n/2 in S segments: "
                "≈ (8·lg p - 4 + 12(S-1))·α + (8·lg p - 4 + 12(S-1))·(n/2S)·β + n·γ")
