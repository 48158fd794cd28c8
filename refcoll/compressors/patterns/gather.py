"""The ``gather`` pattern: payloads gathered whole and summed after decompression.

For compressors whose payloads do not add up compressed (top-k, threshold,
QSGD, TernGrad, int8; sign and 1-bit by choice). Every rank's payload goes
round a ring allgather with variable sizes: the element counts of each wire
array are exchanged first (``8 · arrays`` bytes per rank), then the payloads,
serialised, roles in sorted order. Every rank decompresses all ``p`` payloads
and sums them in rank order (``avg``: divided by ``p`` once), so every rank
holds the same bits. The bytes a rank sends grow with ``p``: ``(p - 1)``
payloads.

The serialisation and the variable-size allgather here serve the two-phase
pattern too.

Spec: spec/compressors.md
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from ...algorithms.ring import ring_allgather_steps
from ...core.ops import get_op
from ...core.xp import address, array_namespace
from ..base import Compressor, CompressorState, Payload, compute_dtype

__all__ = ["gather_pattern", "gather_payloads", "allgather_counts", "wire_counts", "serialise",
           "deserialise", "sum_in_rank_order", "Tagged", "TAG_ALLTOALL"]

# Each phase of a compressed call sends under its own tag, so that two never cross.
_TAG_COUNTS, _TAG_DATA = 0, 1
#: The tag of the two-phase pattern's all-to-all.
TAG_ALLTOALL = 2


class Tagged:
    """A transport view that sends every message of one phase under one tag."""

    def __init__(self, t, tag: int):
        self._t, self._tag = t, tag
        self.rank, self.size = t.rank, t.size

    def sendrecv(self, sendbuf, dest, recvbuf, source, tag: int = 0) -> None:
        """Exchange with ``dest`` and ``source`` under this view's tag (``tag`` is ignored)."""
        self._t.sendrecv(sendbuf, dest, recvbuf, source, self._tag)


def sum_in_rank_order(parts: Sequence[np.ndarray], op: str) -> np.ndarray:
    """Return ``parts[0] + parts[1] + ...`` left to right (``avg``: over len), in their dtype.

    float16 and bfloat16 parts add in float32 (:func:`~refcoll.compressors.base.compute_dtype`)
    and are rounded once, after ``avg``'s division: an average of large half-precision
    gradients is finite where their half-precision sum is not (as PyTorch's hooks divide
    first for the same reason). float32 and float64 add in their own dtype.
    """
    add = get_op("sum")
    dtype = parts[0].dtype
    wide = compute_dtype(dtype)
    acc = parts[0].astype(wide)  # a copy
    for part in parts[1:]:
        add.apply(acc, part.astype(wide, copy=False), acc)
    get_op(op).finalize(acc.reshape(-1), len(parts))
    return acc.astype(dtype, copy=False)


def wire_counts(payload: Payload) -> np.ndarray:
    """Return the element count of each wire array, roles in sorted order."""
    return np.array([payload.arrays[role].size for role in sorted(payload.arrays)], np.int64)


def serialise(payload: Payload) -> np.ndarray:
    """Return the payload's wire arrays as one byte string, roles in sorted order."""
    xp = array_namespace(next(iter(payload.arrays.values()), np.empty(0)))
    parts = [xp.ascontiguousarray(payload.arrays[role]).reshape(-1).view(np.uint8)
             for role in sorted(payload.arrays)]
    return xp.concatenate(parts) if parts else xp.empty(0, np.uint8)


def deserialise(record: np.ndarray, sizes: np.ndarray, like: Payload) -> Payload:
    """Return the payload in ``record``, read with ``like``'s roles, dtypes and trailing shapes.

    Every rank's payload of the same tensor has the same roles and dtypes; only
    the element counts (``sizes``) may differ (threshold), and they travel
    ahead of the data.
    """
    arrays, offset = {}, 0
    for role, count in zip(sorted(like.arrays), sizes):
        ref = like.arrays[role]
        nbytes = int(count) * ref.dtype.itemsize
        data = record[offset:offset + nbytes]
        if address(data) % ref.dtype.itemsize:  # packed behind a role of another width:
            data = data.copy()  # an aligned copy (a device kernel faults on a misaligned load)
        data = data.view(ref.dtype)
        offset += nbytes
        trailing = ref.shape[1:]
        arrays[role] = data.reshape((-1, *trailing) if trailing else (-1,))
    return dataclasses.replace(like, arrays=arrays)


def allgather_counts(t, mine: np.ndarray) -> np.ndarray:
    """Return every rank's ``mine`` (same length everywhere) as a ``(p, len)`` table."""
    k = mine.size
    table = np.zeros(t.size * k, np.int64)
    table[t.rank * k:(t.rank + 1) * k] = mine
    ring_allgather_steps(Tagged(t, _TAG_COUNTS), table, [(i * k, (i + 1) * k)
                                                         for i in range(t.size)])
    return table.reshape(t.size, k)


def _allgatherv(t, record: np.ndarray, lengths: Sequence[int]) -> list[np.ndarray]:
    """Ring allgather of byte strings of the given lengths; return them in rank order."""
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    buf = array_namespace(record).empty(int(offsets[-1]), np.uint8)
    bounds = [(int(offsets[i]), int(offsets[i + 1])) for i in range(t.size)]
    start, stop = bounds[t.rank]
    buf[start:stop] = record
    ring_allgather_steps(Tagged(t, _TAG_DATA), buf, bounds)
    return [buf[a:b] for a, b in bounds]


def gather_payloads(t, payloads: list[Payload], like: list[Payload]) -> list[list[Payload]]:
    """Allgather this rank's ``payloads``; return every rank's, read with ``like`` as templates.

    Each rank passes the same number of payloads; entry ``[rank][i]`` is rank
    ``rank``'s payload ``i``.
    """
    per_rank = [wire_counts(pl) for pl in payloads]
    widths = [c.size for c in per_rank]
    table = allgather_counts(t, np.concatenate(per_rank) if per_rank else np.empty(0, np.int64))
    itemsizes = np.concatenate([[a.dtype.itemsize for _, a in sorted(pl.arrays.items())]
                                for pl in like]).astype(np.int64)
    lengths = [int((row * itemsizes).sum()) for row in table]
    records = [serialise(pl) for pl in payloads]
    record = array_namespace(records[0]).concatenate(records)
    records = _allgatherv(t, record, lengths)
    result = []
    for rec, row in zip(records, table):
        mine, offset, at = [], 0, 0
        for template, width in zip(like, widths):
            sizes = row[at:at + width]
            nbytes = int((sizes * itemsizes[at:at + width]).sum())
            mine.append(deserialise(rec[offset:offset + nbytes], sizes, template))
            offset += nbytes
            at += width
        result.append(mine)
    return result


def gather_pattern(t, comp: Compressor, state: CompressorState, x, *, op: str,
                   algorithm: str, options: dict):
    """Gather every rank's payload and sum them decompressed; return it and the payload bytes.

    ``algorithm`` and ``options`` play no part: the payloads go round a ring
    allgather. Error feedback, if ``comp`` is one, works in its ``compress``.
    """
    with t.call("compressed_allreduce"):
        payload = comp.compress(x, state)
        everyone = gather_payloads(t, [payload], [payload])
    parts = [comp.decompress(pls[0]) for pls in everyone]
    return sum_in_rank_order(parts, op), payload.nbytes
