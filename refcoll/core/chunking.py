"""How a buffer of ``n`` elements is cut into ``p`` chunks: one rule, used everywhere.

The rule (baidu-allreduce's, and MPICH's for uneven reduce-scatter): every chunk
gets ``n // p`` elements and the first ``n % p`` chunks get one more, in order.
So ``n < p`` gives ``p - n`` empty chunks at the end and ``n == 0`` gives ``p``
empty chunks. Chunk ``i`` starts at ``i * (n // p) + min(i, n % p)``.
"""

from __future__ import annotations

__all__ = ["chunk_bounds", "chunk_sizes", "chunk_slice", "max_chunk"]


def chunk_bounds(n: int, p: int) -> list[tuple[int, int]]:
    """Return ``[(start, stop), ...]`` for the ``p`` chunks of ``n`` elements."""
    if p < 1:
        raise ValueError(f"cannot cut a buffer into {p} chunks: need p >= 1")
    if n < 0:
        raise ValueError(f"cannot cut a buffer of {n} elements: need n >= 0")
    base, extra = divmod(n, p)
    bounds = []
    start = 0
    for i in range(p):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def chunk_sizes(n: int, p: int) -> list[int]:
    """Return the element count of each of the ``p`` chunks of ``n`` elements."""
    base, extra = divmod(n, p)
    return [base + (1 if i < extra else 0) for i in range(p)]


def chunk_slice(n: int, p: int, i: int) -> slice:
    """Return chunk ``i`` of ``n`` elements cut ``p`` ways, as a slice."""
    base, extra = divmod(n, p)
    start = i * base + min(i, extra)
    return slice(start, start + base + (1 if i < extra else 0))


def max_chunk(n: int, p: int) -> int:
    """Return the size of the largest chunk: ``ceil(n / p)``."""
    return -(-n // p)
