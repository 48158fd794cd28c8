"""The timing loop of ``refcoll bench``: buffers, timed items, communicators, rows.

:func:`run_bench` runs a sweep on every rank: per size it allocates each rank's
buffers and the expected result (:func:`_make_data`), builds the timed items (our
algorithms, the library baseline, the transport bounds: :class:`_Item`), runs
``warmup + iters`` iterations over them in an order rotated by one per iteration,
each item after a barrier of its participants, then reduces the timings and the
counts over the ranks into one row per algorithm.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ... import algorithms
from ...baselines import gloo, nccl
from ...baselines.mpi import mpi_call
from ...calls import as_transport, device_for
from ...calls import collectives as api
from ...calls.auto import resolve
from ...compressors import parse as parse_compressor
from ...core import xp as xp_module
from ...core.bits import complement, count_wrong
from ...core.chunking import chunk_slice
from ...core.errors import UsageError
from ...core.ops import dtype_name, get_dtype, get_op
from ...transport.mpi import bounded_barrier, default_timeout, wait_by_deadline
from ...transport.recorder import Schedule
from ...verify.conformance import case_ranks
from ...verify.inputs import make_input, make_inputs
from ...verify.oracle import fold
from .config import (ROW_FIELDS, BenchConfig, array_module, baseline_checked, baseline_name,
                     baseline_op, baseline_unavailable, bus_factor, check_config, element_count,
                     libraries, op_label, reduces, use_device)
from .replay import Replay, node_options, schedule

__all__ = ["run_bench"]


# -------------------------------------------------------------------- the data

@dataclass
class _Data:
    """One rank's buffers for one size and one number of data ranks ``p``.

    ``x``, ``out``, ``theirs`` and ``poison`` are arrays of the device (NumPy or
    CuPy); ``expected`` is always on the host, where results are checked.
    """

    p: int
    count: int                       # elements of the whole array
    x: Any                           # this rank's input (zeros on a switch process)
    out: Any = None                  # refcoll's result (None on a switch, non-roots of reduce)
    theirs: Any = None               # the baseline's result
    expected: np.ndarray | None = None
    poison: Any = None               # expected's complement: what a buffer holds before a call


def _make_data(config: BenchConfig, nbytes: int, p: int, rank: int, root: int = 0) -> _Data:
    """Allocate this rank's input and result buffers, and the expected result when checking."""
    xp = array_module(config.device)
    coll, dt = config.collective, get_dtype(config.dtype)
    op = get_op(config.op).name if reduces(coll) else "sum"
    count = element_count(coll, nbytes, dt.itemsize, p)
    in_count = count // p if coll == "allgather" else count
    if rank >= p:  # a switch process: a template of the buffer, no result
        return _Data(p, count, xp.zeros(in_count, dt))
    expected = None
    if config.check:
        inputs = make_inputs("exact", dt, in_count, p, op=op)
        x = inputs[rank]
        if coll == "allgather":
            expected = np.stack(inputs).reshape(-1)
        elif coll == "broadcast":
            expected = inputs[root]
        elif coll != "reduce" or rank == root:
            full = fold(op, inputs)
            expected = full[chunk_slice(count, p, rank)] if coll == "reduce_scatter" else full
        del inputs
    else:
        x = make_input("exact", dt, in_count, rank, p, op=op)
    shapes = {"allreduce": (count,), "reduce_scatter": (count // p,), "allgather": (p, in_count),
              "broadcast": (count,), "reduce": (count,)}
    x = xp.asarray(x)
    out = xp.empty(shapes[coll], dt) if coll != "reduce" or rank == root else None
    theirs = None
    if coll == "broadcast":
        theirs = x.copy() if rank == root else xp.empty(count, dt)
    elif coll != "reduce" or rank == root:
        theirs = xp.empty(int(np.prod(shapes[coll])), dt)
    poison = xp.asarray(complement(expected)) if expected is not None else None
    xp_module.synchronize(xp)  # the buffers are written before anything reads them
    return _Data(p, count, x, out, theirs, expected, poison)


# --------------------------------------------------------------- the timed items

@dataclass
class _Item:
    """One thing timed each iteration: an algorithm, the baseline or a bound."""

    kind: str                       # "ours", "base" or "bound"
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

    def run(self, timed: bool, check: bool) -> None:
        """Run once after a barrier of the participants; time it and check it.

        On a device the clock stops once the current stream has drained, and
        the poisoning copy has finished before the barrier. ``prepare`` runs
        after the poisoning, outside the clock: a collective that works in place
        (Gloo's all_reduce) gets its input copied into the result buffer there.
        """
        checking = check and self.result is not None and self.data.expected is not None
        xp = self.xp
        if checking:
            xp.copyto(self.result.reshape(-1), self.data.poison)
        if self.prepare is not None:
            self.prepare()
        xp_module.synchronize(xp)
        # MPI_Ibarrier waited by the deadline, before the clock starts (not timed). Once it
        # completes every participant is at this call, so the call itself cannot wait for
        # a rank that never comes: this bounds the MPI library's (or NCCL's) own blocking
        # collective and the bound's replay, which have no deadline of their own. refcoll's
        # calls wait by the transport's deadline anyway.
        bounded_barrier(self.comm, self.what, self.timeout)
        start = time.perf_counter()
        self.call()
        xp_module.synchronize(xp)
        elapsed = time.perf_counter() - start
        if timed:
            self.times.append(elapsed)
        if checking:
            self.wrong += count_wrong(xp_module.to_host(self.result), self.data.expected)
            self.checked += self.data.expected.size


def _our_call(config: BenchConfig, t, data: _Data, algorithm: str, root: int, state=None):
    """Return the zero-argument call of refcoll's collective on ``data``'s buffers."""
    coll, op, x, out = config.collective, get_op(config.op).name, data.x, data.out
    common = {"algorithm": algorithm, "validate": False}
    if coll == "allreduce":
        if config.compressor is not None:
            return lambda: api.allreduce(x, t, op=op, compressor=state.compressor,
                                         state=state.state, out=out, **common)
        return lambda: api.allreduce(x, t, op=op, out=out, **common)
    if coll == "reduce_scatter":
        return lambda: api.reduce_scatter(x, t, op=op, out=out, **common)
    if coll == "allgather":
        return lambda: api.allgather(x, t, out=out, **common)
    if coll == "broadcast":
        return lambda: api.broadcast(x, root, t, out=out, **common)
    return lambda: api.reduce(x, root, t, op=op, out=out, **common)


def _base_call(config: BenchConfig, library: str, groups: "_Groups", data: _Data, root: int):
    """Return ``(call, prepare)``: the library's collective on ``data``'s buffers.

    NCCL's on the run's NCCL communicator (:func:`refcoll.baselines.nccl.nccl_call`);
    Gloo's on its Gloo group (:func:`refcoll.baselines.gloo.gloo_call`, which
    needs ``prepare`` before each call); else the MPI library's on the data ranks
    (:func:`refcoll.baselines.mpi.mpi_call`; on device buffers, given to mpi4py
    as they are: a CUDA-aware MPI reads them; avg sums, and is not checked).
    """
    args = (config.collective, data.x, data.theirs)
    kwargs = {"op": baseline_op(config), "root": root}
    if library == "gloo":
        return gloo.gloo_call(groups.gloo.group, *args, **kwargs)
    if library == "nccl":
        return nccl.nccl_call(groups.nccl, *args, **kwargs), None
    return mpi_call(groups.comm(groups.workers), *args, **kwargs), None


@dataclass
class _Compressed:
    """A compressor and one rank's state for one (algorithm, size) stream."""

    compressor: Any
    state: Any


# -------------------------------------------------------------------- the run

class _Groups:
    """The communicators of a run: the data ranks, and data ranks plus switches per algorithm."""

    def __init__(self, world, config: BenchConfig, timeout: float | None = None) -> None:
        from mpi4py import MPI

        self.world = world
        self.workers = config.workers or world.size
        if not 1 <= self.workers <= world.size:
            raise UsageError(f"{self.workers} data ranks do not fit a world of {world.size}")
        self.layout = {name: case_ranks(name, self.workers, world.size, {})
                       for name in config.algorithms}
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
        self.gloo = None  # the Gloo group of the data ranks, started once for the sweep
        if "gloo" in libraries(config):  # collective over the whole world, as torch's groups are
            self.gloo = gloo.gloo_group(world, self.workers, timeout)
        if "nccl" in libraries(config) and self._comms[self.workers] is not None:
            # NCCL's unique id goes out in a blocking MPI bcast: a bounded MPI_Ibarrier first.
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
        config: what to run (checked with :func:`check_config` first).
        on_row: called with each row as soon as its size is done.
        progress: called as ``progress(done, total, nbytes)`` after every
            iteration, ``done`` and ``total`` counting iterations of the sweep.

    Returns:
        One dict per (size, algorithm) with the fields of :data:`ROW_FIELDS`,
        the same on every rank.
    """
    check_config(config)
    timeout = default_timeout()  # a bad REFCOLL_TIMEOUT is a UsageError on every rank, up front
    use_device(comm, config)
    groups = _Groups(comm, config, timeout)
    rows: list[dict] = []
    schedules: dict[tuple, list] = {}  # a schedule serves every size and algorithm it fits
    runs = config.warmup + config.iters
    try:
        for i, nbytes in enumerate(config.sizes):
            step = None if progress is None else (
                lambda k, done=i * runs, n=nbytes: progress(done + k, len(config.sizes) * runs, n))
            size_rows = _run_size(groups, config, nbytes, schedules, step, timeout)
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
            for item in items[k:] + items[:k]:  # a rotated order: no item always goes first
                if item.comm is not None:
                    item.run(it >= config.warmup, config.check)
            if step is not None:
                step(it + 1)
    finally:
        for item in items:
            if isinstance(item.call, Schedule):
                item.call.free()
    by_key = _reduce_items(groups.world, items, timeout)
    wires = _wire_bytes(groups.world, config, states, timeout)
    return [_row(config, groups, nbytes, name, resolved[name], by_key, wires.get(name))
            for name in config.algorithms]


def _items(groups: _Groups, config: BenchConfig, nbytes: int, schedules: dict,
           states: dict, timeout: float | None = None) -> tuple[list[_Item], dict]:
    """Return this rank's timed items at one size, and what ``auto`` resolved to (rank 0's)."""
    rank, root = groups.world.rank, 0
    datas: dict[int, _Data] = {}

    def data_for(p: int) -> _Data:
        if p not in datas:
            datas[p] = _make_data(config, nbytes, p, rank, root)
        return datas[p]

    bound = config.bound and config.compressor is None
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
        call, prepare = _base_call(config, library, groups, data, root) if data else (None, None)
        items.append(_Item("base", name, base_comm, call, data.theirs if checked else None,
                           data, xp=xp, what=f"refcoll bench (before {name} at {nbytes} B)",
                           timeout=timeout, prepare=prepare))
    for name in config.algorithms:
        p, total = groups.layout[name]
        sub = groups.comm(total)
        if sub is None:  # a spare rank: it sits out this algorithm
            items += [_Item("ours", name, None, None)] + ([_Item("bound", name, None, None)]
                                                           if bound else [])
            continue
        t = as_transport(sub)
        data = data_for(p)
        if algorithms.get(name).chooses:
            in_count = data.count // p if config.collective == "allgather" else data.count
            # Resolved where the call resolves it: on the transport that carries the buffers.
            resolved[name] = resolve(device_for(t, data.x), config.collective,
                                     in_count, data.x.itemsize)
        state = None
        if config.compressor is not None:
            comp = parse_compressor(config.compressor)
            state = states[name] = _Compressed(comp, comp.new_state(seed=0, rank=sub.rank))
        items.append(_Item("ours", name, sub, _our_call(config, t, data, name, root, state),
                           data.out if config.compressor is None else None, data, xp=xp,
                           what=f"refcoll bench (before {name} at {nbytes} B)", timeout=timeout))
        if bound:
            items.append(_bound_item(config, sub, t, name, resolved[name] or name, p, total,
                                     data.count, nbytes, schedules, timeout))
    # A bounded MPI_Ibarrier, then the blocking (pickled) bcast of auto's choices.
    bounded_barrier(groups.world, f"refcoll bench (setting up {nbytes} B)", timeout)
    return items, groups.world.bcast(resolved, root=0)


def _bound_item(config: BenchConfig, sub, t, name: str, algorithm: str, p: int, total: int,
                count: int, nbytes: int, schedules: dict, timeout: float | None) -> _Item:
    """Return the timed replay of ``algorithm``'s schedule (rank 0 simulates it, once)."""
    key = (algorithm, p, total, count)
    if key not in schedules:
        node = node_options(t, algorithm)  # collective: every rank splits the nodes
        plans = None
        if sub.rank == 0:
            plans = schedule(config.collective, algorithm, p, count, config.dtype,
                             op=get_op(config.op).name, root=0, **node)
        # After rank 0's simulation: a bounded MPI_Ibarrier, then the blocking scatter.
        bounded_barrier(sub, f"refcoll bench (sending {name}'s schedule at {nbytes} B)",
                        timeout)
        schedules[key] = sub.scatter(plans, root=0)
    return _Item("bound", name, sub,
                 Replay(sub, schedules[key], config.dtype, config.op, timeout=timeout),
                 what=f"refcoll bench (before {name}'s bound at {nbytes} B)", timeout=timeout)


def _iallreduce(comm, buf: np.ndarray, op, what: str, timeout: float | None) -> None:
    """All-reduce ``buf`` in place with ``MPI_Iallreduce``, waited for by the deadline."""
    from mpi4py import MPI

    wait_by_deadline(
        comm.Iallreduce(MPI.IN_PLACE, buf, op=op), timeout,
        lambda: f"rank {comm.rank}: refcoll bench timed out after {timeout:g} s {what} "
                f"(MPI_Iallreduce over {comm.size} ranks): not every rank has reached it, and "
                "MPI cannot tell which; a rank may be dead, slow, or still timing "
                "(set REFCOLL_TIMEOUT to wait longer)")


def _reduce_items(world, items: list[_Item], timeout: float | None = None) -> dict:
    """Return ``(kind, name) -> (time, wrong, checked)``: the slowest median, summed counts."""
    from mpi4py import MPI

    medians = np.array([float(np.median(item.times)) if item.times else 0.0 for item in items])
    counts = np.array([[item.wrong, item.checked] for item in items], dtype=np.int64)
    _iallreduce(world, medians, MPI.MAX, "gathering the timings", timeout)
    _iallreduce(world, counts, MPI.SUM, "gathering the checks", timeout)
    return {(item.kind, item.name): (float(medians[j]), int(counts[j, 0]), int(counts[j, 1]))
            for j, item in enumerate(items)}


def _wire_bytes(world, config: BenchConfig, states: dict, timeout: float | None = None) -> dict:
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
    _iallreduce(world, values, MPI.MAX, "gathering the wire bytes", timeout)
    # The all-reduce completed, so every rank has reached it and comes to this blocking
    # (pickled) bcast next: bounded as if by a barrier.
    patterns = world.bcast(patterns, root=0)  # rank 0 holds data: it ran every pattern
    return {name: {"wire_sent": int(values[j, 0]), "wire_received": int(values[j, 1]),
                   "dense_sent": int(values[j, 2]), "pattern": patterns[j]}
            for j, name in enumerate(config.algorithms)}


def _row(config: BenchConfig, groups: _Groups, nbytes: int, name: str, resolved: str | None,
         by_key: dict, wire: dict | None) -> dict:
    """Assemble one row from the reduced timings and counts.

    ``baselines`` holds every library that ran at this size; the first library of
    ``config.against`` also fills the ``base_*`` fields, as a one-baseline run does.
    """
    dt = get_dtype(config.dtype)
    p = groups.layout[name][0]
    count = element_count(config.collective, nbytes, dt.itemsize, p)
    size = count * dt.itemsize
    in_network = algorithms.get(name).workers is not None
    factor = bus_factor(config.collective, p, in_network=in_network)
    seconds, wrong, checked = by_key[("ours", name)]
    algbw = size / seconds / 1e9 if seconds > 0 else 0.0
    row = dict.fromkeys(ROW_FIELDS)
    row.update(collective=config.collective, algorithm=name, resolved=resolved, ranks=p,
               size=size, count=count, dtype=dtype_name(dt), op=op_label(config),
               time_us=seconds * 1e6, algbw=algbw, busbw=algbw * factor)
    if config.check and config.compressor is None:
        row.update(wrong=wrong, checked=checked)
    row["baselines"] = {}
    base_count = element_count(config.collective, nbytes, dt.itemsize, groups.workers)
    for j, library in enumerate(libraries(config)):
        base_name = baseline_name(config, library)
        if ("base", base_name) not in by_key:
            continue
        base_seconds, base_wrong, base_checked = by_key[("base", base_name)]
        base_algbw = base_count * dt.itemsize / base_seconds / 1e9 if base_seconds > 0 else 0.0
        judged = baseline_checked(config, library)
        entry = {"baseline": base_name, "time_us": base_seconds * 1e6,
                 "busbw": base_algbw * bus_factor(config.collective, groups.workers),
                 "wrong": base_wrong if judged else None,
                 "checked": base_checked if judged else None,
                 "time_over": seconds / base_seconds if base_seconds > 0 else None}
        row["baselines"][library] = entry
        if j == 0:  # the first library also fills the one-baseline fields of ROW_FIELDS
            row.update(baseline=base_name, base_time_us=entry["time_us"],
                       base_busbw=entry["busbw"], base_wrong=entry["wrong"],
                       time_over_base=entry["time_over"])
    if ("bound", name) in by_key:
        bound_seconds = by_key[("bound", name)][0]
        row.update(bound_us=bound_seconds * 1e6,
                   time_over_bound=seconds / bound_seconds if bound_seconds > 0 else None)
    if config.compressor is not None:
        row.update(compressor=config.compressor, **(wire or {}))
    return row
