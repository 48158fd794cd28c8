"""Argument agreement: before data moves, every rank checks that all ranks called alike.

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
"""

from __future__ import annotations

import functools
import hashlib
import json

import numpy as np

from ..algorithms.recursive import rabenseifner_allgather
from ..core.errors import MismatchError, UsageError

__all__ = ["agree", "RECORD_BYTES", "FIELDS"]

RECORD_BYTES = 512
FIELDS = ("error", "collective", "algorithm", "op", "dtype", "count", "root", "options",
          "compressor")


def _record(fields: dict) -> np.ndarray:
    """Return this rank's fixed-size record of ``fields`` (read-only, cached by value)."""
    return _encode(tuple(str(fields.get(k, "")) for k in FIELDS))


@functools.lru_cache(maxsize=256)
def _encode(values: tuple) -> np.ndarray:
    """Encode one record; a loop of identical calls encodes it once."""
    fields = dict(zip(FIELDS, values))
    data = json.dumps(list(values)).encode()
    if len(data) > RECORD_BYTES and fields.get("error"):
        fields = dict(fields, error=str(fields["error"])[:300] + "...")
        data = json.dumps([str(fields.get(k, "")) for k in FIELDS]).encode()
    if len(data) > RECORD_BYTES:  # long option values: keep a digest, still comparable
        data = json.dumps([str(fields.get(k, ""))[:48] if k != "options" else
                           hashlib.sha1(str(fields.get(k)).encode()).hexdigest()
                           for k in FIELDS]).encode()[:RECORD_BYTES]
    buf = np.zeros(RECORD_BYTES, dtype=np.uint8)
    buf[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    buf.flags.writeable = False
    return buf


def _decode(buf: np.ndarray) -> list[str]:
    try:
        return json.loads(buf.tobytes().rstrip(b"\0"))
    except ValueError:
        return ["<unreadable>"] * len(FIELDS)


def describe_disagreement(records: list[list[str]]) -> str | None:
    """Return ``"field: rank 0 has A, rank 3 has B"`` for the first differing field."""
    for k, name in enumerate(FIELDS):
        values = [rec[k] if k < len(rec) else "<missing>" for rec in records]
        if len(set(values)) == 1:
            continue
        # Name the majority once and every rank that differs from it.
        majority = max(set(values), key=values.count)
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
    everyone = np.empty(t.size * RECORD_BYTES, dtype=np.uint8)
    everyone[t.rank * RECORD_BYTES:(t.rank + 1) * RECORD_BYTES] = _record(fields)
    rabenseifner_allgather(t, everyone)
    table = everyone.reshape(t.size, RECORD_BYTES)
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
