"""The battery's control channel: small JSON reports and verdicts between the ranks.

Only verdicts travel: every rank regenerates every rank's input and judges its
own output, then sends rank 0 a report of its problems and a digest of its
result, and rank 0 broadcasts the case's verdict. Reports and verdicts are the
fixed-size records of :mod:`refcoll.calls.agree` (one encoding of small
messages between ranks), :data:`REPORT_BYTES` each, so a long message never
throws the exchange off; prose that would not fit is shortened, keeping the
report's shape. The battery's barrier is :func:`refcoll.calls.agree.barrier`.

The battery sends a whole group of cases' reports (and verdicts) as one
message: the records of its cases, end to end, each packed and shortened
exactly as a lone case's is (:func:`gather_report_lists`,
:func:`bcast_report_list`), so a group's verdicts read as its cases' would one
by one, at one exchange per group instead of one per case.

The channel is a transport of its own (:func:`control_channel`) whose waits
are patient (``Transport.patient``): a rank that waits for the others' cases,
or for rank 0's verdicts, sleeps between polls instead of spinning, and leaves
its core to the ranks that have work (the battery runs many ranks on few cores).
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np

from ...calls.agree import broadcast_record, gather_records, pack, unpack

__all__ = ["REPORT_BYTES", "control_channel", "gather_reports", "bcast_report",
           "gather_report_lists", "bcast_report_list"]

#: Size of one control message: a verdict or report, JSON, zero-padded.
REPORT_BYTES = 1024


def control_channel(t, ranks: int | None = None):
    """Return a control transport over ``t``'s first ``ranks`` ranks (None: all); collective.

    A split of ``t``, so control messages never meet the calls' own; ``None``
    on the ranks it leaves out. Its waits sleep between polls (``patient``).
    """
    ctl = t.split(0 if ranks is None or t.rank < ranks else -1, t.rank)
    if ctl is not None:
        ctl.patient = True
    return ctl


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


def _pack_list(objs: Sequence) -> np.ndarray:
    """Encode several reports or verdicts as one message: their records end to end."""
    return np.concatenate([_pack(obj) for obj in objs])


def _unpack_list(buf: np.ndarray) -> list:
    """Decode a message of :func:`_pack_list`."""
    return [_unpack(record) for record in buf.reshape(-1, REPORT_BYTES)]


def gather_report_lists(ctl, reports: Sequence) -> list[list] | None:
    """Gather every rank's reports of the same cases on rank 0, one message per rank.

    Every rank passes one small JSON object per case, the same number of cases
    everywhere. Returns, on rank 0, each case's reports in rank order (rank 0's
    own as given, the others' as they travelled), ``None`` elsewhere.
    """
    records = gather_records(ctl, _pack_list(reports))
    if records is None:
        return None
    others = [_unpack_list(buf) for buf in records[1:]]
    return [[mine] + [theirs[i] for theirs in others] for i, mine in enumerate(reports)]


def bcast_report_list(ctl, reports: Sequence | None, count: int) -> list:
    """Broadcast rank 0's ``count`` small JSON objects to every rank, as they travelled."""
    mine = _pack_list(reports) if ctl.rank == 0 else None
    return _unpack_list(broadcast_record(ctl, mine, count * REPORT_BYTES))


def gather_reports(ctl, report) -> list | None:
    """Gather one small JSON object per rank on rank 0, in rank order (``None`` elsewhere)."""
    every = gather_report_lists(ctl, [report])
    return None if every is None else every[0]


def bcast_report(ctl, report):
    """Broadcast rank 0's small JSON object to every rank."""
    return bcast_report_list(ctl, [report] if ctl.rank == 0 else None, 1)[0]
