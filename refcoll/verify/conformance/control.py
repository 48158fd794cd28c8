"""The battery's control channel: small JSON reports and verdicts between the ranks.

Only verdicts travel: every rank regenerates every rank's input and judges its
own output, then sends rank 0 a report of its problems and a digest of its
result, and rank 0 broadcasts the case's verdict. Reports and verdicts are the
fixed-size records of :mod:`refcoll.calls.agree` (one encoding of small
messages between ranks), :data:`REPORT_BYTES` each, so a long message never
throws the exchange off; prose that would not fit is shortened, keeping the
report's shape. The battery's barrier is :func:`refcoll.calls.agree.barrier`.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from ...calls.agree import broadcast_record, gather_records, pack, unpack

__all__ = ["REPORT_BYTES", "gather_reports", "bcast_report"]

#: Size of one control message: a verdict or report, JSON, zero-padded.
REPORT_BYTES = 1024


def _shorten(value, limit: int):
    """Return ``value`` with strings over ``limit`` cut and lists cut to three items."""
    if isinstance(value, str):
        return value if len(value) <= limit else value[: limit - 3] + "..."
    if isinstance(value, list):
        return [_shorten(v, limit) for v in value[:3]]
    if isinstance(value, dict):
        return {k: _shorten(v, limit) for k, v in value.items()}
    return value


def _versions(obj) -> Iterator[Any]:
    """Yield ``obj``, then shorter and shorter versions of it (halving the prose limit)."""
    yield obj
    limit = REPORT_BYTES // 2
    while True:
        yield _shorten(obj, limit)
        limit //= 2


def _pack(obj) -> np.ndarray:
    """Encode a report or verdict as one fixed-size message, shortening long prose."""
    return pack(_versions(obj), REPORT_BYTES)


def _unpack(buf: np.ndarray):
    """Decode a message of :func:`_pack`."""
    return unpack(buf)


def gather_reports(ctl, report) -> list | None:
    """Gather one small JSON object per rank on rank 0, in rank order (``None`` elsewhere)."""
    records = gather_records(ctl, _pack(report))
    if records is None:
        return None
    return [report] + [_unpack(buf) for buf in records[1:]]


def bcast_report(ctl, report):
    """Broadcast rank 0's small JSON object to every rank."""
    mine = _pack(report) if ctl.rank == 0 else None
    return _unpack(broadcast_record(ctl, mine, REPORT_BYTES))
