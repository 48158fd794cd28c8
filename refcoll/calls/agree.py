"""Argument agreement, and the fixed-size records every rank exchanges to compare notes.

The classic failures of collective libraries when ranks disagree (one rank passes
999 elements, another 1000; one float32, another int32) are hangs and silent
corruption. refcoll makes every rank compare notes first: a fixed-size record per
rank of the collective, the algorithm, the op, the dtype, the count, the root and
the options. A fixed size means the exchange itself cannot be thrown off by the
disagreement. Every rank ends with every rank's notes and raises the same
:class:`MismatchError`, naming the field and the ranks: ``count: rank 0 has
1000, rank 3 has 999``.

What travels first is a :data:`SIGNATURE_BYTES`-byte digest of the record
(:func:`exchange_signatures`: an allgather over the transport's plain
``sendrecv``, ``⌈lg p⌉`` rounds, in the call's own tag space, at
:data:`SIGNATURE_TAG`); the records themselves (``RECORD_BYTES`` each) move
only when the digests differ, to name the field (:func:`disagreement`). Every
rank ends with every rank's digest, so every rank takes the same branch.

``validate=False`` skips the exchange. Without it, ranks that disagree on sizes
still never corrupt memory (every receive checks its byte count) but may wait
until the timeout instead of failing at once, and ranks that disagree on the
dtype of the same size get wrong numbers without an error.

The record is the one encoding of small messages between ranks over a
Transport: :func:`pack` writes JSON into a zero-padded buffer of a fixed size,
:func:`unpack` reads it back, and :func:`gather_records`,
:func:`broadcast_record` and :func:`allgather_records` move records. The
conformance battery's reports and verdicts travel the same way, and
:func:`barrier` is the one barrier over a Transport (an mpi4py communicator has
:func:`refcoll.transport.deadline.bounded_barrier`).
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
from ..transport.base import TAG_NAMES, TAGS_PER_CALL

__all__ = ["agree", "agree_key", "record_of", "signature_of", "exchange_signatures", "disagreement",
           "SIGNATURE_BYTES", "SIGNATURE_TAG", "check_table",
           "describe_disagreement", "RECORD_BYTES",
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
    """Exchange the call's arguments; raise the same MismatchError on every rank if they differ.

    The ranks first exchange :data:`SIGNATURE_BYTES`-byte digests of their
    records (:func:`exchange_signatures`); only when those differ do they
    exchange the records themselves, to name the field. Every rank ends with
    every rank's digest, so every rank takes the same branch.
    """
    if t.size == 1:
        return
    signature = signature_of(record_of(fields))
    if exchange_signatures(t, signature) != signature * t.size:
        disagreement(t, fields)
    # else the same record everywhere (an error every rank has: each raises it)


#: Signatures by a call's key (:func:`agree_key`): a value cache, as ``_encode``'s.
_SIGNATURES: dict = {}


def agree_key(t, key: tuple, fields) -> None:
    """:func:`agree` on ``fields()``, whose signature is computed once per ``key`` (a value).

    ``key`` is a hashable tuple that determines ``fields()`` (a call's own
    arguments: :meth:`refcoll.calls.args.Call.agree`), so a loop of identical
    calls builds and encodes its record once; one whose key cannot be hashed
    is encoded every time.
    """
    if t.size == 1:
        return
    try:
        signature = _SIGNATURES.get(key)
    except TypeError:  # an option's value that cannot be hashed
        agree(t, **fields())
        return
    if signature is None:
        signature = signature_of(record_of(fields()))
        if len(_SIGNATURES) >= 256:
            _SIGNATURES.clear()
        _SIGNATURES[key] = signature
    if exchange_signatures(t, signature) != signature * t.size:
        disagreement(t, fields())


def disagreement(t, fields: dict) -> None:
    """After signatures that differed on some rank: name the difference on every rank.

    The ranks exchange their whole records and raise the same error
    (:func:`check_table`; a rank with an error of its own returns to raise it).
    """
    check_table(t, fields, allgather_records(t, record_of(fields)))
    if not fields.get("error"):  # the same records, other signatures: a digest's collision
        raise MismatchError(f"ranks called {fields.get('collective', 'a collective')} with "
                            "arguments whose signatures differ though their records match")


# ------------------------------------------------------------- signatures

#: Bytes of a call's signature: a BLAKE2b digest of its record.
SIGNATURE_BYTES = 32

#: The tag of the signature exchange: above the tags algorithms use, in the
#: call's own tag space.
SIGNATURE_TAG = TAGS_PER_CALL - 1
TAG_NAMES[SIGNATURE_TAG] = "the argument agreement's signatures"


def signature_of(record: np.ndarray) -> bytes:
    """Return the signature of a record (cached with it: a loop of identical calls hashes once)."""
    return _signature(record.tobytes())


@functools.lru_cache(maxsize=256)
def _signature(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=SIGNATURE_BYTES).digest()


def exchange_signatures(t, signature: bytes) -> bytes:
    """Return every rank's ``signature``, concatenated in rank order, on every rank (collective).

    Bruck's allgather over ``t.sendrecv``: in round ``k`` a rank sends the
    ``2^k`` signatures it holds (its own first, then those of the ranks after
    it) to ``rank - 2^k`` and receives as many from ``rank + 2^k``; ``⌈lg p⌉``
    rounds, then the rows are rotated back into rank order.
    """
    p, rank, n = t.size, t.rank, SIGNATURE_BYTES
    held = np.empty(p * n, np.uint8)
    held[:n] = np.frombuffer(signature, np.uint8)
    have = 1
    while have < p:
        count = min(have, p - have)
        t.sendrecv(held[:count * n], (rank - have) % p, held[have * n:(have + count) * n],
                   (rank + have) % p, SIGNATURE_TAG)
        have += count
    data = held.tobytes()  # row i: rank (rank + i) % p's signature
    cut = (p - rank) % p * n
    return data[cut:] + data[:cut]


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
