"""Argument agreement, and the fixed-size records every rank exchanges to compare notes.

The classic failures of collective libraries when ranks disagree (one rank passes
999 elements, another 1000; one float32, another int32) are hangs and silent
corruption. refcoll exchanges one fixed-size record per rank first (an
allgather of ``RECORD_BYTES`` each, ``⌈lg p⌉`` rounds): the collective, the
algorithm, the op, the dtype, the count, the root and the options. A fixed size
means the exchange itself cannot be thrown off by the disagreement. Every rank
then holds every rank's record and raises the same :class:`MismatchError`,
naming the field and the ranks: ``count: rank 0 has 1000, rank 3 has 999``.

``validate=False`` skips the exchange (one round trip per call saved, which
matters for small messages). Without it, ranks that disagree on sizes still
never corrupt memory (every receive checks its byte count) but may wait until
the timeout instead of failing at once, and ranks that disagree on the dtype of
the same size get wrong numbers without an error.

The record is the one encoding of small messages between ranks over a
Transport: :func:`pack` writes JSON into a zero-padded buffer of a fixed size,
:func:`unpack` reads it back, and :func:`gather_records`,
:func:`broadcast_record` and :func:`allgather_records` move records. The
conformance battery's reports and verdicts travel the same way, and
:func:`barrier` is the one barrier over a Transport (an mpi4py communicator has
:func:`refcoll.transport.mpi.bounded_barrier`).
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any, Iterable

import numpy as np

from ..algorithms.naive import naive_broadcast
from ..algorithms.rabenseifner import rabenseifner_allgather
from ..core.errors import MismatchError, UsageError

__all__ = ["agree", "record_of", "check_table", "describe_disagreement", "RECORD_BYTES",
           "FIELDS", "pack", "unpack",
           "gather_records", "broadcast_record", "allgather_records", "barrier"]

RECORD_BYTES = 512
FIELDS = ("error", "collective", "algorithm", "op", "dtype", "count", "root", "options",
          "compressor")


# ------------------------------------------------------------------- records

def pack(versions: Iterable[Any], size: int) -> np.ndarray:
    """Return the first of ``versions`` whose JSON fits in ``size`` bytes, as a record.

    ``versions`` are the same object, shorter and shorter (read lazily: the
    first that fits ends the reading). When none fits, the last one's text is
    cut at ``size`` bytes (:func:`unpack` then raises on it). The record is a
    ``uint8`` array of exactly ``size`` bytes, zero-padded, so the ranks that
    exchange it need not agree on anything but ``size`` beforehand.
    """
    data = b""
    for version in versions:
        data = json.dumps(version).encode()
        if len(data) <= size:
            break
    data = data[:size]
    buf = np.zeros(size, dtype=np.uint8)
    buf[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    return buf


def unpack(buf: np.ndarray) -> Any:
    """Return the object a record holds; ``ValueError`` for one that holds no whole JSON."""
    return json.loads(buf.tobytes().rstrip(b"\0"))


def gather_records(t, record: np.ndarray, root: int = 0) -> list[np.ndarray] | None:
    """Return every rank's record on ``root``, in rank order (``None`` elsewhere).

    The root receives the others one at a time, in rank order, so a slow rank
    holds up only the records after it.
    """
    if t.rank != root:
        t.send(record, root)
        return None
    out = []
    for src in range(t.size):
        if src == root:
            out.append(record)
        else:
            incoming = np.empty_like(record)
            t.recv(incoming, src)
            out.append(incoming)
    return out


def broadcast_record(t, record: np.ndarray | None, size: int, root: int = 0) -> np.ndarray:
    """Return ``root``'s record of ``size`` bytes on every rank (``record`` is read on the root)."""
    buf = record if t.rank == root else np.empty(size, dtype=np.uint8)
    naive_broadcast(t, buf, root=root)
    return buf


def allgather_records(t, record: np.ndarray) -> np.ndarray:
    """Return every rank's record, as rows in rank order, on every rank (``⌈lg p⌉`` rounds)."""
    size = record.size
    everyone = np.empty(t.size * size, dtype=np.uint8)
    everyone[t.rank * size:(t.rank + 1) * size] = record
    rabenseifner_allgather(t, everyone)
    return everyone.reshape(t.size, size)


def barrier(t) -> None:
    """Return once every rank of ``t`` has called: a dissemination barrier of one byte.

    Round ``k`` sends to ``rank + 2^k`` and receives from ``rank - 2^k``
    (``⌈lg p⌉`` rounds), so no rank is a bottleneck and a rank leaves only after
    every rank has arrived.
    """
    token, back = np.zeros(1, np.uint8), np.zeros(1, np.uint8)
    distance = 1
    while distance < t.size:
        t.sendrecv(token, (t.rank + distance) % t.size, back, (t.rank - distance) % t.size)
        distance *= 2


# ---------------------------------------------------------- argument agreement

def _record(fields: dict) -> np.ndarray:
    """Return this rank's fixed-size record of ``fields`` (read-only, cached by value)."""
    return _encode(tuple(str(fields.get(k, "")) for k in FIELDS))


@functools.lru_cache(maxsize=256)
def _encode(values: tuple) -> np.ndarray:
    """Encode one record; a loop of identical calls encodes it once."""
    buf = pack(_shortened(values), RECORD_BYTES)
    buf.flags.writeable = False
    return buf


def _shortened(values: tuple):
    """Yield the record's fields as sent: whole, then the error cut, then long values digested.

    The digest keeps a long options value comparable across ranks though it
    cannot be read back.
    """
    fields = dict(zip(FIELDS, values))
    yield list(values)
    if fields.get("error"):
        fields = dict(fields, error=str(fields["error"])[:300] + "...")
        yield [str(fields.get(k, "")) for k in FIELDS]
    yield [str(fields.get(k, ""))[:48] if k != "options" else
           hashlib.sha1(str(fields.get(k)).encode()).hexdigest() for k in FIELDS]


def _decode(buf: np.ndarray) -> list[str]:
    try:
        return unpack(buf)
    except ValueError:
        return ["<unreadable>"] * len(FIELDS)


def describe_disagreement(records: list[list[str]]) -> str | None:
    """Return ``"field: rank 0 has A, rank 3 has B"`` for the first differing field."""
    for k, name in enumerate(FIELDS):
        values = [rec[k] if k < len(rec) else "<missing>" for rec in records]
        if len(set(values)) == 1:
            continue
        # Name the majority once and every rank that differs from it.
        majority = max(dict.fromkeys(values), key=values.count)  # ties: the lowest rank's
        first = values.index(majority)
        odd = [r for r, v in enumerate(values) if v != majority]
        parts = [f"rank {first} has {majority}"] + [f"rank {r} has {values[r]}" for r in odd[:8]]
        more = f" (and {len(odd) - 8} more ranks)" if len(odd) > 8 else ""
        return f"{name}: " + ", ".join(parts) + more
    return None


def agree(t, **fields) -> None:
    """Exchange the call's arguments; raise the same MismatchError on every rank if they differ."""
    if t.size == 1:
        return
    check_table(t, fields, allgather_records(t, record_of(fields)))


def record_of(fields: dict) -> np.ndarray:
    """Return this rank's fixed-size record of an agreement's ``fields`` (read-only)."""
    return _record(fields)


def check_table(t, fields: dict, table: np.ndarray) -> None:
    """Judge every rank's record of an agreement (``table``, one row per rank), as :func:`agree`.

    Split from the exchange so that a schedule can run the exchange step by
    step (:mod:`refcoll.calls.nonblocking`) and judge it the same way.
    """
    if not fields.get("error") and (table == table[t.rank]).all():
        return  # the common case: every record is byte-for-byte this rank's
    records = [_decode(table[r]) for r in range(t.size)]
    failed = [(r, rec[0]) for r, rec in enumerate(records) if rec and rec[0]]
    if failed:
        if fields.get("error"):
            return  # this rank raises its own exception
        r, message = failed[0]
        raise UsageError(f"rank {r} could not run {fields.get('collective', 'the collective')}: "
                         f"{message}")
    problem = describe_disagreement(records)
    if problem is not None:
        raise MismatchError(f"ranks called {fields.get('collective', 'a collective')} with "
                            f"different arguments: {problem}")
