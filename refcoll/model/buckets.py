"""Gradient buckets: how many a gradient may be cut into, and the cut, last layers first.

The functions take any workload with ``elements``, ``nbytes``, ``shapes`` and
``layered`` (:class:`~refcoll.model.cluster.Workload`).
"""

from __future__ import annotations

import math

from ..core.errors import UsageError
from ..core.units import human_bytes

__all__ = ["MAX_BUCKETS", "bucket_limit", "check_buckets", "buckets_for_size", "buckets_of"]

#: The most gradient buckets the overlap model cuts a gradient into: each is priced
#: on its own, so the work grows with their number.
MAX_BUCKETS = 100_000


def bucket_limit(workload) -> int:
    """Return the most buckets ``workload`` may be cut into: one a parameter, MAX_BUCKETS."""
    return min(workload.elements, MAX_BUCKETS)


def check_buckets(count: int, workload, *, name: str = "buckets") -> int:
    """Return ``count`` if it is from 1 to :func:`bucket_limit`; else raise UsageError.

    ``name`` is what the message calls the number (an option, ``--buckets``).
    """
    limit = bucket_limit(workload)
    if count < 1:
        raise UsageError(f"{name} {count}: give at least 1 (1 means one bucket: no overlap)")
    if count > limit:
        raise UsageError(f"{name} {count:,}: give at most {limit:,} (at most one bucket per "
                         f"parameter and at most {MAX_BUCKETS:,})")
    return count


def buckets_for_size(workload, nbytes: int, *, name: str = "bucket size") -> int:
    """Return how many buckets of at most ``nbytes`` the gradient fills (checked as above)."""
    if nbytes < 1:
        raise UsageError(f"{name} {nbytes}: give a positive size, e.g. 25MB")
    count = -(-workload.nbytes // nbytes)
    limit = bucket_limit(workload)
    if count > limit:
        smallest = -(-workload.nbytes // limit)
        raise UsageError(f"{name} {nbytes:,} B cuts the {human_bytes(workload.nbytes)} gradient "
                         f"into {count:,} buckets, more than the {limit:,} the model takes: "
                         f"give at least {smallest:,} B")
    return count


def buckets_of(workload, count: int) -> list[tuple[tuple[tuple[int, ...], ...], float]]:
    """Cut the gradient into at most ``count`` buckets, last layers first.

    Returns ``[(shapes, ready), ...]`` in the order the backward pass fills them:
    ``ready`` is the fraction of the backward pass after which the bucket's
    last gradient exists (gradients appear at a uniform rate per parameter). A
    flat parameter count is cut into ``count`` equal pieces; layers are never
    split (as in PyTorch DDP), so big layers can leave fewer buckets than asked.
    ``count`` runs from 1 to :func:`bucket_limit` (:func:`check_buckets`).
    """
    check_buckets(count, workload)
    total = workload.elements
    if not workload.layered:
        sizes = [total // count + (1 if i < total % count else 0) for i in range(count)]
        out, done = [], 0
        for size in sizes:
            done += size
            out.append((((size,),), done / total))
        return out
    out, current, done = [], [], 0
    boundary = 1
    for shape in reversed(workload.shapes):
        if not math.prod(shape) and out and not current:  # empty: it joins the bucket before,
            out[-1] = (out[-1][0] + (shape,), out[-1][1])  # never one of its own
            continue
        current.append(shape)
        done += math.prod(shape)
        if done * count >= boundary * total:
            out.append((tuple(current), done / total if total else 1.0))
            current = []
            while boundary * total <= done * count and boundary < count:
                boundary += 1
    if current:
        out.append((tuple(current), 1.0))
    return out
