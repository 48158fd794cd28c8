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
