"""From every rank's timings to the rows of ``refcoll bench``: one per size and algorithm.

:func:`reduce_items` gathers each timed item's median from every rank (each rank's
median over its timed iterations) and makes the row's time from them as nccl-tests'
``-a`` says (:func:`~.options.over_ranks`: rank 0's, the mean, the smallest or the
largest), keeping every rank's; the counts of wrong elements are summed, and the
ranks that saw any are counted (nccl-tests' ``Out of bounds values``).
:func:`make_row` assembles a row: the out-of-place half, the in-place half
(``inplace_*``), each library's halves, the bound, the compressor's bytes, and
what NCCL chose (:mod:`.tuning`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..core.ops import dtype_name, get_dtype
from ..transport.deadline import wait_by_deadline
from .config import (
    ROW_FIELDS,
    BenchConfig,
    baseline_checked,
    baseline_name,
    bus_factor,
    element_count,
    libraries,
    op_label,
    rooted,
)
from .options import over_ranks

__all__ = ["Reduced", "reduce_items", "iallreduce", "wire_bytes", "make_row"]


@dataclass
class Reduced:
    """One timed item over the ranks: the row's time, every rank's, and the check tally."""

    seconds: float
    wrong: int = 0
    checked: int = 0
    rank_seconds: list = field(default_factory=list)  # by rank; None where a rank sat out
    wrong_ranks: int = 0                               # ranks whose result had a wrong element


def _wait(comm, request, what: str, call: str, timeout: float | None) -> None:
    wait_by_deadline(
        request, timeout,
        lambda: f"rank {comm.rank}: refcoll bench timed out after {timeout:g} s {what} "
                f"({call} over {comm.size} ranks): not every rank has reached it, and "
                "MPI cannot tell which; a rank may be dead, slow, or still timing "
                "(set REFCOLL_TIMEOUT to wait longer)")


def iallreduce(comm, buf: np.ndarray, op, what: str, timeout: float | None) -> None:
    """All-reduce ``buf`` in place with ``MPI_Iallreduce``, waited for by the deadline."""
    from mpi4py import MPI

    _wait(comm, comm.Iallreduce(MPI.IN_PLACE, buf, op=op), what, "MPI_Iallreduce", timeout)


def _iallgather(comm, buf: np.ndarray, what: str, timeout: float | None) -> np.ndarray:
    """Return every rank's ``buf``, stacked by rank, with ``MPI_Iallgather`` by the deadline."""
    out = np.empty((comm.size, *buf.shape), buf.dtype)
    _wait(comm, comm.Iallgather(buf, out), what, "MPI_Iallgather", timeout)
    return out


def reduce_items(world, items, timeout: float | None = None, average: int = 3) -> dict:
    """Return ``(kind, name) -> Reduced`` for this rank's timed items (collective over ``world``).

    Every rank lists the same items in the same order (a rank that sits one out
    has it with no times: NaN in the gather, None in ``rank_seconds``).
    """
    medians = np.array([float(np.median(item.times)) if item.times else math.nan
                        for item in items])
    counts = np.array([[item.wrong, item.checked] for item in items], dtype=np.int64)
    times = _iallgather(world, medians, "gathering the timings", timeout)
    tally = _iallgather(world, counts, "gathering the checks", timeout)
    out = {}
    for j, item in enumerate(items):
        per_rank = [None if math.isnan(v) else float(v) for v in times[:, j]]
        out[(item.kind, item.name)] = Reduced(
            over_ranks(per_rank, average), int(tally[:, j, 0].sum()), int(tally[:, j, 1].sum()),
            per_rank, int((tally[:, j, 0] > 0).sum()))
    return out


def wire_bytes(world, config: BenchConfig, states: dict, timeout: float | None = None) -> dict:
    """Return each compressed algorithm's wire bytes in its last call: the largest over ranks."""
    if config.compressor is None:
        return {}
    from mpi4py import MPI

    values = np.zeros((len(config.algorithms), 3), dtype=np.int64)
    patterns = []
    for j, name in enumerate(config.algorithms):
        traffic = getattr(states[name].state, "traffic", None) if name in states else None
        if traffic is not None:
            values[j] = traffic.sent, traffic.received, traffic.dense
        patterns.append(getattr(traffic, "pattern", None))
    iallreduce(world, values, MPI.MAX, "gathering the wire bytes", timeout)
    # The all-reduce completed, so every rank has reached it and comes to this blocking
    # (pickled) bcast next: bounded as if by a barrier.
    patterns = world.bcast(patterns, root=0)  # rank 0 holds data: it ran every pattern
    return {name: {"wire_sent": int(values[j, 0]), "wire_received": int(values[j, 1]),
                   "dense_sent": int(values[j, 2]), "pattern": patterns[j]}
            for j, name in enumerate(config.algorithms)}


def _us(seconds):
    return None if seconds is None else seconds * 1e6


def _workers(reduced: Reduced | None, p: int, average: int) -> Reduced | None:
    """Return an item's figures over the ``p`` ranks that hold data, the first of its
    communicator: a ``switch`` run's switch processes, after them, serve and are not timed
    as a rank is (``-a`` picks among the workers)."""
    if reduced is None or len(reduced.rank_seconds) <= p:
        return reduced
    times = reduced.rank_seconds[:p]
    return Reduced(over_ranks(times, average), reduced.wrong, reduced.checked, times,
                   reduced.wrong_ranks)


def _half(reduced: Reduced | None, size: int, factor: float, judged: bool = True) -> dict:
    """Return one half's numbers: time (µs), algbw, busbw (GB/s), the check, every rank's time."""
    if reduced is None:
        return {"time_us": None, "algbw": None, "busbw": None, "wrong": None, "checked": None,
                "rank_times_us": None, "wrong_ranks": None}
    seconds = reduced.seconds
    algbw = size / seconds / 1e9 if seconds > 0 else 0.0
    return {"time_us": seconds * 1e6, "algbw": algbw, "busbw": algbw * factor,
            "wrong": reduced.wrong if judged else None,
            "checked": reduced.checked if judged else None,
            "rank_times_us": [_us(s) for s in reduced.rank_seconds],
            "wrong_ranks": reduced.wrong_ranks if judged else None}


def make_row(config: BenchConfig, groups, nbytes: int, name: str, resolved: str | None,
             by_key: dict, wire: dict | None, choice=None) -> dict:
    """Assemble one row from the reduced timings and counts.

    ``baselines`` holds every library that ran at this size, each with both
    halves; the first library of ``config.against`` also fills the ``base_*``
    fields, as a one-baseline run does. ``choice`` is what NCCL chose at this
    size (a :class:`refcoll.baselines.nccl_log.Tuning`, or None).
    """
    dt = get_dtype(config.dtype)
    p = groups.layout[name][0]
    count = element_count(config.collective, nbytes, dt.itemsize, p)
    size = count * dt.itemsize
    factor = bus_factor(config.collective, p)
    judged = bool(config.check)  # (a compressed result: against the first rank's bits)
    ours = _half(_workers(by_key[("ours", name)], p, config.average), size, factor, judged)
    mine = _half(_workers(by_key.get(("ours_ip", name)), p, config.average), size, factor,
                 judged)
    row = dict.fromkeys(ROW_FIELDS)
    row.update(collective=config.collective, algorithm=name, resolved=resolved, ranks=p,
               size=size, count=count, requested=nbytes, dtype=dtype_name(dt), op=op_label(config),
               root=config.root if rooted(config.collective) else None,
               time_us=ours["time_us"], algbw=ours["algbw"], busbw=ours["busbw"],
               wrong=ours["wrong"], checked=ours["checked"], rank_times_us=ours["rank_times_us"],
               wrong_ranks=ours["wrong_ranks"], inplace_rank_times_us=mine["rank_times_us"],
               inplace_wrong_ranks=mine["wrong_ranks"],
               **{f"inplace_{k}": mine[k] for k in ("time_us", "algbw", "busbw", "wrong",
                                                    "checked")})
    row["baselines"] = {}
    base_count = element_count(config.collective, nbytes, dt.itemsize, groups.workers)
    base_factor = bus_factor(config.collective, groups.workers)
    for j, library in enumerate(libraries(config)):
        base_name = baseline_name(config, library)
        if ("base", base_name) not in by_key:
            continue
        check = baseline_checked(config, library)
        out = _half(by_key[("base", base_name)], base_count * dt.itemsize, base_factor, check)
        inside = _half(by_key.get(("base_ip", base_name)), base_count * dt.itemsize, base_factor,
                       check)
        base_seconds = by_key[("base", base_name)].seconds
        entry = {"baseline": base_name, "time_us": out["time_us"], "busbw": out["busbw"],
                 "wrong": out["wrong"], "checked": out["checked"],
                 "time_over": ours["time_us"] / 1e6 / base_seconds if base_seconds > 0 else None,
                 "rank_times_us": out["rank_times_us"],
                 **{f"inplace_{k}": inside[k] for k in ("time_us", "busbw", "wrong", "checked",
                                                        "rank_times_us")}}
        row["baselines"][library] = entry
        if j == 0:  # the first library also fills the one-baseline fields of ROW_FIELDS
            row.update(baseline=base_name, base_time_us=entry["time_us"],
                       base_busbw=entry["busbw"], base_wrong=entry["wrong"],
                       time_over_base=entry["time_over"],
                       base_inplace_time_us=entry["inplace_time_us"],
                       base_inplace_busbw=entry["inplace_busbw"],
                       base_inplace_wrong=entry["inplace_wrong"])
    if ("bound", name) in by_key:
        bound_seconds = by_key[("bound", name)].seconds
        row.update(bound_us=bound_seconds * 1e6,
                   time_over_bound=(ours["time_us"] / 1e6 / bound_seconds
                                    if bound_seconds > 0 else None))
    if config.compressor is not None:
        row.update(compressor=config.compressor, **(wire or {}))
    if choice is not None:
        lo_hi = choice.channels
        row.update(nccl_algo=choice.algo, nccl_proto=choice.proto,
                   nccl_channels=lo_hi[1] - lo_hi[0] + 1 if lo_hi else None)
    return row
