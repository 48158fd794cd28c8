"""The timing loop of ``refcoll bench``: timed items, communicators, the sweep.

:func:`run_bench` runs a sweep on every rank: per size it allocates each rank's
buffers and the expected result (:func:`~.data.make_data`), builds the timed items
(our algorithms out of place and in place, the library baselines' two halves, the
transport bounds: :class:`_Item`), runs ``warmup + iters`` iterations over them in
an order rotated by one per iteration, each item after a barrier of its
participants, then gathers every rank's timings and counts into one row per
algorithm (:mod:`.rows`). ``-d all -o all`` runs the sweep once per type and op.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .. import algorithms
from ..algorithms.spelling import spell
from ..baselines import gloo, nccl
from ..calls import as_transport, device_for
from ..calls.auto import resolve_with_options
from ..compressors import parse as parse_compressor
from ..core import xp as xp_module
from ..core.bits import count_wrong
from ..core.errors import UsageError
from ..core.ops import get_op
from ..transport.base import default_timeout
from ..transport.deadline import bounded_barrier, mpi, wait_by_deadline, watchdog
from ..transport.recorder import Schedule
from ..verify.conformance import case_ranks
from .config import (
    BenchConfig,
    array_module,
    baseline_checked,
    baseline_name,
    baseline_unavailable,
    check_config,
    check_forced_mpi,
    libraries,
    root_runs,
    use_device,
    variants,
)
from .data import Data, base_call, base_in_place, make_data, our_call, our_in_place
from .options import algorithm_options, extra_ranks, registry_name
from .replay import Replay, node_options, schedule
from .rows import make_row, reduce_items, wire_bytes
from .tuning import NcclLog

__all__ = ["check_room", "run_bench"]

#: The names the tests reach for, kept from before the buffers had a module of their own.
_Data, _make_data = Data, make_data
_reduce_items = reduce_items


# --------------------------------------------------------------- the timed items

@dataclass
class _Item:
    """One thing timed each iteration: an algorithm, the baseline or a bound."""

    kind: str                       # "ours", "ours_ip", "base", "base_ip" or "bound"
    name: str                       # the algorithm, or the baseline's name
    comm: Any                       # the participants' communicator; None: this rank sits out
    call: Callable[[], Any]
    result: np.ndarray | None = None  # the buffer to check after the call
    data: _Data | None = None
    times: list = field(default_factory=list)
    wrong: int = 0
    checked: int = 0
    xp: Any = np                    # the array module of the buffers: NumPy, or CuPy on a GPU
    what: str = "refcoll bench"     # names the call in a timeout's message
    timeout: float | None = None    # the barrier's deadline (None: REFCOLL_TIMEOUT's)
    prepare: Callable[[], Any] | None = None  # untimed, before the call: an in-place input
    agree: bool = False  # no expected bits (a compressed all-reduce: lossy by design), but
    #                      every rank must hold the first rank's bits (checked against them)

    def run(self, timed: bool, check: bool, calls: int = 1) -> None:
        """Run ``calls`` times back to back after one barrier of the participants.

        Each call is timed and checked on its own; between two calls of the run
        there is no barrier, only the untimed poisoning and ``prepare`` (so a call
        meets the network as the call before it left it: nccl-tests' aggregated
        iterations, ``-m``). On a device the clock stops once the current stream
        has drained, and the poisoning copy has finished before the barrier.
        ``prepare`` runs after the poisoning, outside the clock: a collective that
        works in place (Gloo's all_reduce) gets its input copied into the result
        buffer there.
        """
        checking = check and self.result is not None and self.data.expected is not None
        # A compressed result is set beside the first rank's after the run (a broadcast
        # between its calls would pace them): the result itself after one call, its digest
        # after each of several (memory: one result, whatever -m).
        kept = [] if check and self.agree else None
        xp = self.xp
        for k in range(calls):
            if checking:
                xp.copyto(self.result.reshape(-1), self.data.poison)
            if self.prepare is not None:
                self.prepare()
            xp_module.synchronize(xp)
            if k == 0:
                # MPI_Ibarrier waited by the deadline, before the clock starts (not timed).
                # Once it completes every participant is at this call, so the call itself
                # cannot wait for a rank that never comes: this bounds the MPI library's
                # (or NCCL's) own blocking collective and the bound's replay, which have
                # no deadline of their own. refcoll's calls wait by the transport's
                # deadline anyway.
                bounded_barrier(self.comm, self.what, self.timeout)
            result = self._timed(timed)
            if checking:
                self.wrong += count_wrong(xp_module.to_host(self.result), self.data.expected)
                self.checked += self.data.expected.size
            if kept is not None:
                mine = np.ascontiguousarray(xp_module.to_host(result)).reshape(-1)
                kept.append(mine if calls == 1 else (_digest(mine), mine.size))
        if kept and calls == 1:
            mine = kept[0]
            self.wrong += count_wrong(mine, self._first_ranks(mine))
            self.checked += mine.size
        elif kept:  # a call whose bits differ anywhere counts every element wrong
            digests = np.frombuffer(b"".join(d for d, _ in kept), np.uint8)
            first = self._first_ranks(digests).reshape(len(kept), -1)
            for (_, size), mine, theirs in zip(kept, digests.reshape(len(kept), -1), first):
                self.wrong += size if not np.array_equal(mine, theirs) else 0
                self.checked += size

    def _first_ranks(self, mine: np.ndarray) -> np.ndarray:
        """Return the first participant's copy of ``mine`` (a broadcast, outside the clock,
        waited by the deadline)."""
        first = mine.copy()
        wait_by_deadline(self.comm.Ibcast([first.view(np.uint8), mpi().BYTE], root=0),
                         default_timeout() if self.timeout is None else self.timeout,
                         lambda: f"{self.what}: the first rank's result, to compare with")
        return first

    def _timed(self, timed: bool):
        """Make the call once on the clock (kept when ``timed``); return what it returned."""
        # A peer lost during a library's call (its link cut) would still hold it for
        # ever, and nothing interrupts a blocking call: past the deadline the watchdog
        # ends the job. Armed and disarmed outside the clock.
        watched = contextlib.nullcontext()
        if self.kind != "ours" and self.kind != "ours_ip":
            half = {"base_ip": ", in place", "bound": "'s bound"}.get(self.kind, "")
            watched = watchdog(f"refcoll bench ({self.name}{half})", self.timeout)
        with watched:
            start = time.perf_counter()
            result = self.call()
            xp_module.synchronize(self.xp)
            elapsed = time.perf_counter() - start
        if timed:
            self.times.append(elapsed)
        return result


def _digest(result: np.ndarray) -> bytes:
    """Return a digest of ``result``'s bits (BLAKE2b, 16 bytes)."""
    return hashlib.blake2b(result.view(np.uint8), digest_size=16).digest()


@dataclass
class _Compressed:
    """A compressor and one rank's state for one (algorithm, size) stream."""

    compressor: Any
    state: Any


# -------------------------------------------------------------------- the run

def check_room(config: BenchConfig, size: int) -> dict:
    """Return each algorithm's ``(data ranks, ranks)`` in a job of ``size`` ranks; refuse,
    alike on every rank, an algorithm whose switch processes the job has no ranks for."""
    workers = config.workers or size
    if not 1 <= workers <= size:
        raise UsageError(f"{workers} data ranks do not fit a world of {size}")
    layout = {name: case_ranks(registry_name(name), workers, size, {})
              for name in config.algorithms}
    for name, (data, _) in layout.items():
        if data != workers:  # every row is on the same data ranks as its baseline
            extra = extra_ranks([name], workers)
            raise UsageError(
                f"--algorithm {name} needs {extra} more ranks (switch processes) beside "
                f"the {workers} data ranks, and this job has {size}: start "
                f"{workers + extra} with REFCOLL_WORKERS={workers}, or let "
                f"refcoll start them (refcoll bench -n {workers}, outside mpiexec)")
    return layout


class _Groups:
    """The communicators of a run: the data ranks, and data ranks plus switches per algorithm."""

    def __init__(self, world, config: BenchConfig, timeout: float | None = None) -> None:
        from mpi4py import MPI

        self.world = world
        self.workers = config.workers or world.size
        self.layout = check_room(config, world.size)
        self._comms: dict[int, Any] = {}
        for total in sorted({self.workers} | {total for _, total in self.layout.values()}):
            color = 0 if world.rank < total else MPI.UNDEFINED
            # MPI has no nonblocking split: a bounded MPI_Ibarrier first, after which
            # every rank is at this MPI_Comm_split.
            bounded_barrier(world, f"refcoll bench (MPI_Comm_split of the first {total} ranks)",
                            timeout)
            comm = world.Split(color, world.rank)
            self._comms[total] = None if comm == MPI.COMM_NULL else comm
        self.nccl = None  # NCCL's communicator of the data ranks, made once for the sweep
        self.nccl_log = None  # NCCL's TUNING lines, read after each size (rank 0)
        self.gloo = None  # the Gloo group of the data ranks, started once for the sweep
        self.backend = None  # a backend="refcoll" group of the data ranks (--against backend)
        chosen = libraries(config)
        if "gloo" in chosen or "backend" in chosen:  # collective over the whole world, as
            self.gloo = gloo.gloo_group(world, self.workers, timeout)  # torch's groups are
        if "backend" in chosen and baseline_unavailable(config, "backend") is None:
            self.backend = gloo.backend_group(self.workers, registry_name(config.algorithms[0]),
                                              timeout)
        if "nccl" in libraries(config) and self._comms[self.workers] is not None:
            # NCCL's unique id goes out in a blocking MPI bcast: a bounded MPI_Ibarrier first.
            # Its debug settings first: NCCL reads them once, when it initialises.
            self.nccl_log = NcclLog.start(config)
            bounded_barrier(self._comms[self.workers], "refcoll bench (making NCCL's communicator)",
                            timeout)
            self.nccl = nccl.nccl_comm(self._comms[self.workers])

    def comm(self, total: int):
        """Return the communicator of the first ``total`` ranks (None on the others)."""
        return self._comms[total]

    def free(self) -> None:
        """Free every communicator this run made (MPI_Comm_free does not wait for the others)."""
        if self.nccl is not None and hasattr(self.nccl, "destroy"):
            self.nccl.destroy()
        if self.nccl_log is not None:
            self.nccl_log.close()
        if self.gloo is not None:
            self.gloo.free()
        for comm in self._comms.values():
            if comm is not None:
                comm.Free()


def run_bench(comm, config: BenchConfig, *, on_row: Callable[[dict], None] | None = None,
              progress: Callable[[int, int, int], None] | None = None) -> list[dict]:
    """Run the benchmark on every rank of ``comm`` (collective); return the rows.

    Args:
        comm: an mpi4py communicator; its first ``config.workers`` ranks hold
            data, the rest serve switch algorithms (or sit out).
        config: what to run (checked with :func:`check_config` first); several
            dtypes or ops (``all``), or every root (``root=-1``), run one sweep
            each, in nccl-tests' order.
        on_row: called with each row as soon as its size is done.
        progress: called as ``progress(done, total, nbytes)`` after every
            iteration, ``done`` and ``total`` counting iterations of the sweep.

    Returns:
        One dict per (dtype, op, size, algorithm) with the fields of
        :data:`~.config.ROW_FIELDS` (and every rank's times), the same on every rank.

    Raises:
        UsageError: on every rank alike: a root outside the data ranks, a forced
            MPI algorithm whose variables the job lacks, and all that
            :func:`check_config` refuses.
    """
    check_config(config, config.workers or comm.size)
    timeout = default_timeout()  # a bad REFCOLL_TIMEOUT is a UsageError on every rank, up front
    check_forced_mpi(config, comm.rank)
    # nccl-tests' order: types, then ops, then roots (-r -1: every root of the data ranks).
    runs = [run for v in variants(config) for run in root_runs(v, config.workers or comm.size)]
    use_device(comm, config)
    groups = _Groups(comm, runs[0], timeout)
    rows: list[dict] = []
    schedules: dict[tuple, list] = {}  # a schedule serves every size and algorithm it fits
    per_size = config.warmup + config.iters
    total = len(runs) * len(config.sizes) * per_size
    try:
        for v, run in enumerate(runs):
            for i, nbytes in enumerate(run.sizes):
                done = (v * len(run.sizes) + i) * per_size
                step = None if progress is None else (
                    lambda k, done=done, n=nbytes: progress(done + k, total, n))
                size_rows = _run_size(groups, run, nbytes, schedules, step, timeout)
                rows += size_rows
                if on_row is not None:
                    for row in size_rows:
                        on_row(row)
    finally:
        groups.free()
    return rows


def _run_size(groups: _Groups, config: BenchConfig, nbytes: int, schedules: dict,
              step, timeout: float | None = None) -> list[dict]:
    """Time every item at one size; return its rows."""
    states: dict[str, _Compressed] = {}
    items, resolved = _items(groups, config, nbytes, schedules, states, timeout)
    try:
        for it in range(config.warmup + config.iters):
            k = it % len(items)
            timed = it >= config.warmup
            for item in items[k:] + items[:k]:  # a rotated order: no item always goes first
                if item.comm is not None:
                    item.run(timed, bool(config.check), config.agg if timed else 1)
            if step is not None:
                step(it + 1)
    finally:
        for item in items:
            if isinstance(item.call, Schedule):
                item.call.free()
    by_key = reduce_items(groups.world, items, timeout, config.average)
    wires = wire_bytes(groups.world, config, states, timeout)
    choice = _nccl_choice(groups, config, nbytes, timeout)
    return [make_row(config, groups, nbytes, name, resolved[name], by_key, wires.get(name),
                     choice) for name in config.algorithms]


def _nccl_choice(groups: _Groups, config: BenchConfig, nbytes: int, timeout: float | None):
    """Return what NCCL chose at this size, from rank 0's TUNING lines (None: no NCCL run)."""
    if "nccl" not in libraries(config) or baseline_unavailable(config, "nccl") is not None:
        return None
    choice = None
    if groups.world.rank == 0 and groups.nccl_log is not None:
        choice = groups.nccl_log.choice(config.collective, nbytes)
    # The gathers of the timings completed: every rank is here, at this blocking bcast.
    bounded_barrier(groups.world, f"refcoll bench (sharing NCCL's choice at {nbytes} B)", timeout)
    return groups.world.bcast(choice, root=0)


def _items(groups: _Groups, config: BenchConfig, nbytes: int, schedules: dict,
           states: dict, timeout: float | None = None) -> tuple[list[_Item], dict]:
    """Return this rank's timed items at one size, and what ``auto`` resolved to (rank 0's)."""
    rank, root = groups.world.rank, config.root
    datas: dict[int, Data] = {}

    def data_for(p: int) -> Data:
        if p not in datas:
            datas[p] = make_data(config, nbytes, p, rank, root)
        return datas[p]

    bound = config.bound and config.compressor is None
    in_place = config.in_place and config.compressor is None
    xp = array_module(config.device)
    items: list[_Item] = []
    resolved: dict[str, str | None] = dict.fromkeys(config.algorithms)
    base_comm = groups.comm(groups.workers)
    for library in libraries(config):
        if baseline_unavailable(config, library) is not None:
            continue
        name = baseline_name(config, library)
        data = data_for(groups.workers) if base_comm is not None else None
        # Not checked: avg on MPI (it sums) and NCCL (it may scale before summing), and
        # the root's broadcast buffer (it is the source). The baselines share one result
        # buffer, poisoned before each call.
        checked = data is not None and baseline_checked(config, library) and not (
            config.collective == "broadcast" and rank == root)
        call, prepare = base_call(config, library, groups, data, root) if data else (None, None)
        what = f"refcoll bench (before {name} at {nbytes} B)"
        items.append(_Item("base", name, base_comm, call, data.theirs if checked else None,
                           data, xp=xp, what=what, timeout=timeout, prepare=prepare))
        # Every rank decides alike whether the library has an in-place half (MPI's).
        if in_place and library == "mpi":
            call = base_in_place(config, library, groups, data, root) if data else None
            items.append(_Item("base_ip", name, base_comm, call,
                               data.inplace.mpi_out if checked else None, data, xp=xp,
                               what=f"{what[:-1]}, in place)", timeout=timeout,
                               prepare=data.inplace.refill if data else None))
    for name in config.algorithms:
        p, total = groups.layout[name]
        sub = groups.comm(total)
        if sub is None:  # a spare rank: it sits out this algorithm
            items += [_Item(kind, name, None, None) for kind, wanted in
                      (("ours", True), ("ours_ip", in_place), ("bound", bound)) if wanted]
            continue
        t = as_transport(sub)
        data = data_for(p)
        if algorithms.get(registry_name(name)).chooses:
            in_count = data.count // p if config.collective == "allgather" else data.count
            # Resolved where the call resolves it: on the transport that carries the buffers;
            # named with its options, as hierarchical(inter=ring,pipeline=8).
            resolved[name] = spell(*resolve_with_options(device_for(t, data.x),
                                                         config.collective, in_count,
                                                         data.x.itemsize))
        state = None
        if config.compressor is not None:
            comp = parse_compressor(config.compressor)
            state = states[name] = _Compressed(comp, comp.new_state(seed=0, rank=sub.rank))
        what = f"refcoll bench (before {name} at {nbytes} B)"
        items.append(_Item("ours", name, sub, our_call(config, t, data, name, root, state),
                           data.out if config.compressor is None else None, data, xp=xp,
                           what=what, timeout=timeout, agree=config.compressor is not None))
        if in_place:
            ip = data.inplace
            items.append(_Item("ours_ip", name, sub, our_in_place(config, t, data, name, root),
                               ip.out if ip is not None else None, data, xp=xp,
                               what=f"{what[:-1]}, in place)", timeout=timeout,
                               prepare=ip.refill if ip is not None else None))
        if bound:
            items.append(_bound_item(config, sub, t, name, resolved[name] or name, p, total,
                                     data.count, nbytes, schedules, timeout))
    # A bounded MPI_Ibarrier, then the blocking (pickled) bcast of auto's choices.
    bounded_barrier(groups.world, f"refcoll bench (setting up {nbytes} B)", timeout)
    return items, groups.world.bcast(resolved, root=0)


def _bound_item(config: BenchConfig, sub, t, name: str, algorithm: str, p: int, total: int,
                count: int, nbytes: int, schedules: dict, timeout: float | None) -> _Item:
    """Return the timed replay of ``algorithm``'s schedule (rank 0 simulates it, once)."""
    key = (algorithm, p, total, count, config.dtype, config.op, config.root)
    if key not in schedules:
        # collective: every rank splits the nodes (or the racks its level names)
        options = node_options(t, registry_name(algorithm), algorithm_options(algorithm))
        plans = None
        if sub.rank == 0:
            plans = schedule(config.collective, registry_name(algorithm), p, count, config.dtype,
                             op=get_op(config.op).name, root=config.root, **options)
        # After rank 0's simulation: a bounded MPI_Ibarrier, then the blocking scatter.
        bounded_barrier(sub, f"refcoll bench (sending {name}'s schedule at {nbytes} B)",
                        timeout)
        schedules[key] = sub.scatter(plans, root=0)
    return _Item("bound", name, sub,
                 Replay(sub, schedules[key], config.dtype, config.op, timeout=timeout),
                 what=f"refcoll bench (before {name}'s bound at {nbytes} B)", timeout=timeout)
