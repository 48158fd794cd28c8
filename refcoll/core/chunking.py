"""How a buffer of ``n`` elements is cut into ``p`` chunks: the split rules, each written once.

Chunk ``i`` is a contiguous range and the chunks tile the buffer in order; the
rules differ only in where the ``n % p`` elements that do not divide evenly go.
Which rule a library uses decides which elements a ring reduces in which order,
so predicting its bits needs its rule:

* ``"front"`` (the default: baidu-allreduce's, Open MPI's ``COLL_BASE_COMPUTE_BLOCKCOUNT``
  in ``ompi/mca/coll/base/coll_base_util.h``, MPICH's uneven reduce-scatter): every
  chunk gets ``n // p`` elements and the first ``n % p`` chunks get one more.
  Chunk ``i`` starts at ``i * (n // p) + min(i, n % p)``.
* ``"last"`` (MPICH's ``allreduce_intra_k_reduce_scatter_allgather.c``): every
  chunk gets ``n // p`` and the last chunk also gets the ``n % p`` left over.
* ``"ceil"`` (MPICH's ``allreduce_intra_ring.c``): chunks of ``ceil(n / p)``
  elements while they fit, then the rest, then empty chunks.
* ``"gloo"`` (Gloo's ring all-reduce, ``gloo/allreduce.cc``): the buffer is cut
  into ``N = p·k`` segments of ``ceil(n / N)`` elements (the last short or
  empty), ``k = max(2, ceil(ceil(n·itemsize / 1 MiB) / p))``, and chunk ``i`` is
  segments ``i·k .. i·k+k-1``: chunks of ``k·ceil(n / (k·p))`` elements while
  they fit. It depends on the element size (Gloo caps a segment at 1 MiB).

``"front"``, ``"ceil"`` and ``"gloo"`` give the same chunks whenever ``p``
divides ``n`` (for ``"gloo"``: ``k·p`` divides ``n``), and ``"front"`` and
``"ceil"`` whenever ``n % p`` is ``0`` or ``p - 1``. ``n < p`` leaves empty
chunks at the end under every rule but ``"last"`` (which leaves them at the
front), and ``n == 0`` gives ``p`` empty chunks.
"""

from __future__ import annotations

from .errors import UsageError

__all__ = ["SPLITS", "GLOO_SEGMENT_BYTES", "chunk_bounds", "chunk_sizes", "chunk_slice",
           "max_chunk", "check_split", "gloo_segments"]

#: The split rules, the default first.
SPLITS = ("front", "last", "ceil", "gloo")

#: The largest segment Gloo's ring sends (``AllreduceOptions::kMaxSegmentSize``).
GLOO_SEGMENT_BYTES = 1 << 20


def check_split(rule: str) -> None:
    """Raise :class:`UsageError` unless ``rule`` is one of :data:`SPLITS`."""
    if rule not in SPLITS:
        raise UsageError(f"split must be one of {', '.join(SPLITS)}, got {rule!r}")


def gloo_segments(n: int, p: int, itemsize: int) -> int:
    """Return how many segments Gloo's ring cuts ``n`` elements of ``itemsize`` bytes into.

    At least two per rank, a multiple of ``p``, none over 1 MiB (``gloo/allreduce.cc``).
    """
    largest = itemsize * max(1, GLOO_SEGMENT_BYTES // itemsize)
    wanted = -(-(n * itemsize) // largest)
    per_rank = max(2, -(-wanted // p))
    return per_rank * p


def _width(n: int, p: int, rule: str, itemsize: int) -> int:
    """Return the chunk width of the rules that cut equal chunks while they fit."""
    if rule == "ceil":
        return -(-n // p)
    segments = gloo_segments(n, p, itemsize)
    return (segments // p) * -(-n // segments)


def chunk_bounds(n: int, p: int, rule: str = "front", *,
                 itemsize: int = 1) -> list[tuple[int, int]]:
    """Return ``[(start, stop), ...]`` for the ``p`` chunks of ``n`` elements under ``rule``.

    ``itemsize`` (bytes per element) matters to ``"gloo"`` only.
    """
    if p < 1:
        raise ValueError(f"cannot cut a buffer into {p} chunks: need p >= 1")
    if n < 0:
        raise ValueError(f"cannot cut a buffer of {n} elements: need n >= 0")
    if rule == "front":
        base, extra = divmod(n, p)
        bounds = []
        start = 0
        for i in range(p):
            stop = start + base + (1 if i < extra else 0)
            bounds.append((start, stop))
            start = stop
        return bounds
    check_split(rule)
    if rule == "last":
        base = n // p
        return [(i * base, (i + 1) * base if i < p - 1 else n) for i in range(p)]
    width = _width(n, p, rule, itemsize)
    return [(min(i * width, n), min((i + 1) * width, n)) for i in range(p)]


def chunk_sizes(n: int, p: int, rule: str = "front", *, itemsize: int = 1) -> list[int]:
    """Return the element count of each of the ``p`` chunks of ``n`` elements under ``rule``."""
    if rule == "front":
        base, extra = divmod(n, p)
        return [base + (1 if i < extra else 0) for i in range(p)]
    return [stop - start for start, stop in chunk_bounds(n, p, rule, itemsize=itemsize)]


def chunk_slice(n: int, p: int, i: int) -> slice:
    """Return chunk ``i`` of ``n`` elements cut ``p`` ways (the ``"front"`` rule), as a slice."""
    base, extra = divmod(n, p)
    start = i * base + min(i, extra)
    return slice(start, start + base + (1 if i < extra else 0))


def max_chunk(n: int, p: int, rule: str = "front", *, itemsize: int = 1) -> int:
    """Return the size of the largest chunk (``ceil(n / p)`` under ``"front"`` and ``"ceil"``)."""
    if rule in ("front", "ceil"):
        return -(-n // p)
    return max(chunk_sizes(n, p, rule, itemsize=itemsize))
