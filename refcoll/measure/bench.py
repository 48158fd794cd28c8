"""The benchmark harness behind ``refcoll bench``: nccl-tests' numbers for refcoll's collectives.

For each message size of a sweep (``-b MIN -e MAX -f FACTOR``, as nccl-tests takes
them) every selected algorithm runs ``warmup + iters`` times on preallocated
buffers, interleaved with the MPI library's own collective on the same inputs:
each iteration visits every timed item (our algorithms, the baseline, the
transport bounds) in an order rotated by one per iteration, each after a barrier
of its participants, so all of them see the same machine noise.

What is reported, per size and algorithm (nccl-tests' ``doc/PERFORMANCE.md``):

* ``time``: the maximum over ranks of each rank's median over the timed iterations;
* ``algbw = S / time``, ``S`` the bytes of the whole array: the buffer of an
  all-reduce, broadcast and reduce, the full input of a reduce-scatter, the full
  output of an allgather (so reduce-scatter and allgather round the element count
  down to a multiple of ``n``, as nccl-tests does);
* ``busbw = algbw · factor`` with :func:`bus_factor`: all-reduce ``2(n-1)/n``,
  in-network all-reduce (``switch``) ``(n-1)/(n+1)`` with ``n`` the workers,
  reduce-scatter and allgather ``(n-1)/n``, broadcast and reduce ``1``;
* ``#wrong``: with checking on, the elements that differ bit for bit from the
  expected result, summed over every iteration (warm-up included) and rank. The
  inputs are ``exact`` (:mod:`refcoll.verify.inputs`: integer-valued floats whose every
  partial result is exact), so the expected result is the naive fold of all
  ranks' inputs, computed once per size, and any correct algorithm matches it
  bit for bit. Before each call the result buffer is filled with the bitwise
  complement of the expected result, so an element left unwritten counts as wrong.
* the baseline (``MPI_Allreduce``, ``MPI_Reduce_scatter_block``, ``MPI_Allgather``,
  ``MPI_Bcast``, ``MPI_Reduce``) time, busbw and ``time/base`` (below 1: refcoll
  is faster). ``avg`` has no MPI op: the baseline runs ``MPI_SUM`` and is not
  checked. Types MPI lacks (bfloat16, float8) have no baseline.
* on GPUs (``device="gpu"``): the buffers are CuPy arrays on this rank's GPU,
  refcoll's collectives move them as :func:`refcoll.transport.device.device_transport`
  decides (directly through a CUDA-aware MPI, else staged through pinned host
  memory), and every timed call ends by synchronising the current stream, so
  the time is the device's, not the launch's. The baseline is NCCL
  (``against="nccl"``: ``ncclAllReduce``... through ``cupy.cuda.nccl``, one
  process per GPU, the communicator's unique id broadcast over MPI) or the MPI
  library's collective on the device buffers, which needs a CUDA-aware MPI.
  The expected results stay on the host; results are copied there to be
  checked, outside the timed region.
* with ``bound``: the transport bound of each algorithm, the time of the bare
  point-to-point exchanges its schedule needs plus its local reductions (the
  schedule from the simulator's ledger, replayed with nonblocking MPI calls step
  by step on preallocated buffers, see :class:`Replay`), and ``time/bound``: what
  the implementation costs beyond its messages and arithmetic.
* with a compressor (all-reduce only): the time, the effective algbw and busbw of
  the dense size, and the bytes this rank put on the wire (largest over ranks).

Timed calls pass ``validate=False``: the argument agreement round trip is a
separate cost, not part of the algorithm's. Roots are rank 0.

JSON (``--json``): ``{"schema": "refcoll-bench/1", "header": {...}, "rows": [...],
"summary": {...}}``. ``header`` describes the run (machine, MPI library and
versions (CuPy's and NCCL's on GPUs), ranks, collective, op, dtype, sizes,
iterations, the baseline, notes; on GPUs ``gpu``: the device and how its
buffers travel, from :func:`refcoll.transport.cuda_aware.device_path`); each row has
the fields of :data:`ROW_FIELDS` (``None`` where not applicable); ``summary`` has
``avg_busbw`` per algorithm and for the baseline, ``wrong``, ``checked``
(elements compared) and ``passed``. ``--csv`` writes the rows with the same fields.
"""

from __future__ import annotations

import csv
import os
import platform
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .. import algorithms
from ..transport import cuda_aware as cuda
from ..transport import device as devices
from ..baselines import nccl
from ..core import xp as xp_module
from ..core.chunking import chunk_slice
from ..core.errors import UsageError
from ..verify.inputs import make_input, make_inputs
from ..core.ops import check_supported, dtype_name, get_dtype, get_op, is_float
from ..verify.oracle import fold
from ..transport.mpi import bounded_barrier, default_timeout, duplicate, wait_by_deadline

__all__ = [
    "BenchConfig",
    "ROW_FIELDS",
    "BASELINES",
    "parse_size",
    "size_sweep",
    "bus_factor",
    "element_count",
    "count_wrong",
    "NCCL_BASELINES",
    "array_module",
    "use_device",
    "check_config",
    "baseline_name",
    "baseline_unavailable",
    "extra_ranks",
    "schedule",
    "Replay",
    "run_bench",
    "bench_header",
    "summarize",
    "format_header",
    "format_row",
    "format_footer",
    "format_table",
    "write_csv",
    "plotting",
    "plot",
    "bar_target",
    "TableWriter",
]

#: The MPI library's own collective that each refcoll collective is timed against.
BASELINES = {
    "allreduce": "MPI_Allreduce",
    "reduce_scatter": "MPI_Reduce_scatter_block",
    "allgather": "MPI_Allgather",
    "broadcast": "MPI_Bcast",
    "reduce": "MPI_Reduce",
}

#: NCCL's collective that each refcoll collective is timed against with ``--against nccl``.
NCCL_BASELINES = nccl.NCCL_CALLS

#: The fields of every row, in the order ``--csv`` writes them.
ROW_FIELDS = (
    "collective", "algorithm", "resolved", "ranks", "size", "count", "dtype", "op",
    "time_us", "algbw", "busbw", "wrong", "checked",
    "baseline", "base_time_us", "base_busbw", "base_wrong", "time_over_base",
    "bound_us", "time_over_bound",
    "compressor", "pattern", "wire_sent", "wire_received", "dense_sent",
)

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Return the bytes of a size as nccl-tests takes it: ``8``, ``64K``, ``16M``, ``1G``.

    The suffixes are binary (K = 1024) and case-insensitive.

    Raises:
        UsageError: anything else (a fraction, a negative number, another unit).
    """
    m = _SIZE.match(str(text))
    if not m:
        raise UsageError(f"bad size {text!r}: give a whole number of bytes, optionally with "
                         "K, M or G (binary: 64K = 65536)")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def size_sweep(minbytes: int, maxbytes: int, factor: int) -> list[int]:
    """Return ``minbytes, minbytes·factor, ...`` up to ``maxbytes`` (nccl-tests' ``-b -e -f``)."""
    if minbytes < 1:
        raise UsageError(f"the smallest size must be at least 1 byte, got {minbytes}")
    if maxbytes < minbytes:
        raise UsageError(f"the largest size ({maxbytes} B) is below the smallest ({minbytes} B)")
    if factor < 2:
        raise UsageError(f"the step factor must be at least 2, got {factor}")
    sizes = [minbytes]
    while sizes[-1] * factor <= maxbytes:
        sizes.append(sizes[-1] * factor)
    return sizes


def bus_factor(collective: str, n: int, *, in_network: bool = False) -> float:
    """Return nccl-tests' ``busbw / algbw`` for ``collective`` on ``n`` ranks.

    All-reduce ``2(n-1)/n`` (in-network reduction: ``(n-1)/(n+1)``, ``n`` the
    workers); reduce-scatter and allgather ``(n-1)/n``; broadcast and reduce 1.
    """
    if n < 1:
        raise ValueError(f"a collective needs at least one rank, got {n}")
    if collective == "allreduce":
        return (n - 1) / (n + 1) if in_network else 2 * (n - 1) / n
    if collective in ("reduce_scatter", "allgather"):
        return (n - 1) / n
    if collective in ("broadcast", "reduce"):
        return 1.0
    raise UsageError(f"unknown collective {collective!r}: choose one of "
                     f"{', '.join(algorithms.COLLECTIVES)}")


def element_count(collective: str, nbytes: int, itemsize: int, n: int) -> int:
    """Return the elements of the whole array for a size of ``nbytes``.

    Reduce-scatter and allgather round down to a multiple of ``n``, so every rank's
    chunk is the same (the MPI baseline, ``MPI_Reduce_scatter_block``, needs it).
    """
    count = nbytes // itemsize
    if collective in ("reduce_scatter", "allgather"):
        count -= count % n
    return count


def count_wrong(got: np.ndarray, expected: np.ndarray) -> int:
    """Return how many elements of ``got`` differ bit for bit from ``expected``.

    A result of the wrong size or element width is wrong in every element.
    """
    want = np.ascontiguousarray(expected).reshape(-1)
    have = np.ascontiguousarray(got).reshape(-1)
    if have.size != want.size or have.dtype.itemsize != want.dtype.itemsize:
        return int(want.size)
    if want.size == 0:
        return 0
    bits = np.dtype(f"u{want.dtype.itemsize}")
    return int(np.count_nonzero(have.view(bits) != want.view(bits)))


def _complement(expected: np.ndarray) -> np.ndarray:
    """Return an array whose every element differs from ``expected`` in every bit."""
    bits = np.dtype(f"u{expected.dtype.itemsize}")
    return np.invert(expected.reshape(-1).view(bits)).view(expected.dtype)


# ------------------------------------------------------------------- the device

def array_module(device: str):
    """Return the array module buffers of ``device`` are allocated with: NumPy or CuPy.

    Raises:
        UsageError: an unknown device, or ``gpu`` where CuPy or a GPU is missing
            (the reason in one line).
    """
    if device == "cpu":
        return np
    if device == "gpu":
        return xp_module.require_cupy("--device gpu")
    raise UsageError(f"unknown device {device!r}: choose cpu or gpu")


def use_device(comm, config: "BenchConfig") -> int | None:
    """Make this rank's GPU current, collectively over ``comm``; return its number (None: CPU).

    With NCCL each rank needs a GPU of its own (an error says so when ranks
    would share one); refcoll alone shares GPUs round robin among a node's
    ranks. The dtype is checked on the device here, in the ranks, rather than
    in :func:`check_config`: a check there would open a CUDA context in the
    launching process, which a GPU in exclusive-process mode refuses to its ranks.

    Raises:
        UsageError: ranks that would share a GPU under NCCL; a dtype the device
            cannot compute in.
    """
    if config.device != "gpu":
        return None
    # The GPU choice starts with MPI_Comm_split_type, which has no nonblocking form:
    # a bounded MPI_Ibarrier first, so a rank that never comes times out here.
    bounded_barrier(comm, "refcoll bench (choosing GPUs: MPI_Comm_split_type)")
    device = (devices.check_one_gpu_per_rank(comm) if config.against == "nccl"
              else devices.use_node_gpu(comm))
    xp_module.check_device_dtype(get_dtype(config.dtype), array_module("gpu"))
    return device


# ------------------------------------------------------------------- the config

@dataclass
class BenchConfig:
    """What to benchmark.

    Attributes:
        sizes: message sizes in bytes (:func:`size_sweep`).
        algorithms: algorithm names (``auto`` included).
        collective, op, dtype: what each call computes (``op`` ignored by
            allgather and broadcast).
        against: ``mpi`` (time the MPI library's collective too), ``nccl`` or ``none``.
        device: ``cpu`` or ``gpu``.
        warmup, iters: untimed and timed iterations per size.
        check: compare every iteration's result with the expected one.
        bound: also time each algorithm's transport bound.
        compressor: a compressor spec (all-reduce only), or None.
        workers: ranks that hold data (``None``: the whole communicator); the
            ranks after them serve as switch processes.
    """

    sizes: Sequence[int] = (8,)
    algorithms: Sequence[str] = ("auto",)
    collective: str = "allreduce"
    op: str = "sum"
    dtype: str = "float32"
    against: str = "mpi"
    device: str = "cpu"
    warmup: int = 5
    iters: int = 20
    check: bool = True
    bound: bool = False
    compressor: str | None = None
    workers: int | None = None


def check_config(config: BenchConfig) -> None:
    """Raise :class:`UsageError` for a configuration no rank could run (before any MPI).

    Unknown or unsupported names, an algorithm without the collective, an op the
    dtype lacks, a compressor outside a floating sum/avg all-reduce, a GPU or NCCL
    where there is none, NCCL without ``--device gpu`` or with a dtype or op it
    lacks, ``--bound`` on a GPU, iteration counts below their minimum. Nothing
    here opens a CUDA context (:func:`use_device` checks the dtype on the device).
    """
    if not config.sizes:
        raise UsageError("no message sizes to run")
    if config.collective not in algorithms.COLLECTIVES:
        raise UsageError(f"unknown collective {config.collective!r}: choose one of "
                         f"{', '.join(algorithms.COLLECTIVES)}")
    if not config.algorithms:
        raise UsageError(f"no algorithm selected; algorithms with {config.collective}: "
                         f"{', '.join(algorithms.names(config.collective))}")
    for name in config.algorithms:
        algorithms.implementation(name, config.collective)
    dt = get_dtype(config.dtype)
    check_supported(get_op(config.op), dt)
    if config.warmup < 0 or config.iters < 1:
        raise UsageError(f"need warm-up >= 0 and iterations >= 1, got -w {config.warmup} "
                         f"-i {config.iters}")
    if config.against not in ("mpi", "nccl", "none"):
        raise UsageError(f"unknown baseline {config.against!r}: choose mpi, nccl or none")
    if config.against == "nccl" and config.device != "gpu":
        raise UsageError("--against nccl needs --device gpu (NCCL runs on GPUs)")
    if array_module(config.device) is not np and config.bound:
        raise UsageError("--bound replays schedules on host buffers: it runs with "
                         "--device cpu only")
    if config.against == "nccl":
        nccl.require_nccl("--against nccl")
        nccl.nccl_types(dt, "sum" if config.collective in ("allgather", "broadcast") else config.op)
    if config.compressor is not None:
        from ..compressors import parse

        parse(config.compressor)
        if config.collective != "allreduce" or config.op not in ("sum", "avg") or not is_float(dt):
            raise UsageError("--compressor runs a compressed all-reduce: it needs --collective "
                             "allreduce, --op sum or avg and a floating dtype")
        switches = [n for n in config.algorithms if algorithms.get(n).workers is not None]
        if switches:
            raise UsageError(f"--compressor cannot run with {', '.join(switches)}: switch "
                             "processes cannot combine compressed payloads")


def extra_ranks(names: Sequence[str], workers: int) -> int:
    """Return the ranks beyond ``workers`` the algorithms ``names`` need (switch processes)."""
    return max((algorithms.get(n).extra_ranks(workers) for n in names
                if algorithms.get(n).extra_ranks is not None), default=0)


# ---------------------------------------------------------------- the schedules

def schedule(collective: str, algorithm: str, p: int, count: int, dtype, *, op: str = "sum",
             root: int = 0, node_size: int | None = None, **options) -> list[list[tuple]]:
    """Return every rank's replay plan of one call of ``algorithm``, from the simulator.

    The plan of a rank is a list of ``(step, sends, receives, reductions)`` in
    step order: ``sends`` as ``(dest, nbytes)``, ``receives`` as ``(source,
    nbytes)``, ``reductions`` as element counts combined after the step's
    messages. Steps are the ledger's rounds, so within a step no message waits
    for another. Ranks are those of the simulated world: the ``p`` data ranks,
    then any switch processes. ``count`` is the elements of the whole array
    (:func:`element_count`); the schedule depends on sizes only, so the
    simulated inputs are zeros.
    """
    from ..calls.collectives import simulate

    in_count = count // p if collective == "allgather" else count
    x = np.zeros(in_count, dtype=get_dtype(dtype))
    x.flags.writeable = False
    kwargs = dict(options)
    if collective in ("broadcast", "reduce"):
        kwargs["root"] = root
    result = simulate(collective, [x] * p, algorithm=algorithm, op=op, node_size=node_size,
                      **kwargs)
    plans: list[dict] = [defaultdict(lambda: ([], [], [])) for _ in range(result.world.size)]
    for m in result.ledger.messages:
        plans[m.source][m.step][0].append((m.dest, m.nbytes))
        plans[m.dest][m.step][1].append((m.source, m.nbytes))
    for red in result.ledger.reductions:
        plans[red.rank][red.step][2].append(red.elements)
    return [[(step, *plan[step]) for step in sorted(plan)] for plan in plans]


class Replay:
    """One rank's schedule, replayed on bare MPI: the transport bound of an algorithm.

    Every step posts its receives and sends at once (``Irecv``/``Isend`` on
    preallocated byte buffers), waits for them all, then runs its reductions
    (the op's ufunc on preallocated arrays of the dtype, ``out=`` the first
    operand). Nothing else runs: no argument handling, no views, no tag spaces,
    no Python step loop of the algorithm. Call the object to run it once.

    Args:
        comm: an mpi4py communicator of the schedule's ranks (duplicated here).
        plan: this rank's plan from :func:`schedule`.
        dtype: the elements' dtype; op: the reduction op.
        timeout: seconds the duplication may wait for the other ranks (None:
            ``REFCOLL_TIMEOUT``'s, see :func:`refcoll.transport.mpi.default_timeout`).
    """

    def __init__(self, comm, plan: list[tuple], dtype, op, *, timeout: float | None = None) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        # MPI_Comm_idup waited by the deadline, not the blocking MPI_Comm_dup.
        self.comm = duplicate(comm, default_timeout() if timeout is None else timeout,
                              "refcoll bench (the transport bound's communicator)")
        self._ufunc = get_op(op).ufunc
        dt = get_dtype(dtype)
        largest_send = max((n for _, sends, _, _ in plan for _, n in sends), default=0)
        largest_step = max((sum(n for _, n in recvs) for _, _, recvs, _ in plan), default=0)
        largest_reduction = max((e for *_, reds in plan for e in reds), default=0)
        # Written once, so every page is real: reading never-written (zero-page)
        # memory costs almost nothing and would make the bound too optimistic.
        send = np.ones(largest_send, np.uint8)  # concurrent sends may share a buffer
        recv = np.ones(largest_step, np.uint8)  # concurrent receives may not
        acc = np.ones(largest_reduction, dt)
        other = np.ones(largest_reduction, dt)
        self._steps = []
        for _, sends, recvs, reds in plan:
            receives, offset = [], 0
            for source, n in recvs:
                receives.append(([recv[offset:offset + n], MPI.BYTE], source))
                offset += n
            self._steps.append((receives, [([send[:n], MPI.BYTE], dest) for dest, n in sends],
                                [(acc[:e], other[:e]) for e in reds]))

    def __call__(self) -> None:
        # Timed, so a bare Waitall with no deadline: bounded by the MPI_Ibarrier before
        # every run (:meth:`_Item.run`), after which every peer is in this very replay.
        comm, ufunc, waitall = self.comm, self._ufunc, self._mpi.Request.Waitall
        for receives, sends, reductions in self._steps:
            if receives or sends:
                waitall([comm.Irecv(buf, source) for buf, source in receives]
                        + [comm.Isend(buf, dest) for buf, dest in sends])
            for a, b in reductions:
                ufunc(a, b, out=a)

    def free(self) -> None:
        """Free the duplicated communicator."""
        self.comm.Free()


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
    op = get_op(config.op).name if coll not in ("allgather", "broadcast") else "sum"
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
    poison = xp.asarray(_complement(expected)) if expected is not None else None
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

    def run(self, timed: bool, check: bool) -> None:
        """Run once after a barrier of the participants; time it and check it.

        On a device the clock stops once the current stream has drained, and
        the poisoning copy has finished before the barrier.
        """
        checking = check and self.result is not None and self.data.expected is not None
        xp = self.xp
        if checking:
            xp.copyto(self.result.reshape(-1), self.data.poison)
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
    from ..calls import collectives as api

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


def baseline_name(config: BenchConfig) -> str | None:
    """Return the library collective timed beside refcoll's: ``MPI_Allreduce``, ``ncclAllReduce``..."""
    if config.against == "nccl":
        return NCCL_BASELINES[config.collective]
    if config.against == "mpi":
        return BASELINES[config.collective]
    return None


def baseline_unavailable(config: BenchConfig) -> str | None:
    """Return why the baseline cannot run for ``config`` (None: it can).

    NCCL's availability is :func:`check_config`'s to refuse. The MPI library's
    collective on device buffers needs a CUDA-aware MPI (:func:`refcoll.transport.cuda_aware.cuda_aware`,
    the same answer on every rank of a job, as its sources are).
    """
    if config.against == "none":
        return "no baseline requested"
    if config.against == "nccl":
        return None
    name = BASELINES[config.collective]
    try:
        from mpi4py import MPI

        MPI.Datatype.fromcode(get_dtype(config.dtype).char)
    except (ImportError, ValueError, KeyError):
        return f"MPI has no {dtype_name(get_dtype(config.dtype))} type"
    if config.device == "gpu":
        aware, why = cuda.cuda_aware()
        if not aware:
            return f"{name} on device buffers needs a CUDA-aware MPI ({why})"
    return None


def _base_call(config: BenchConfig, comm, data: _Data, root: int, nccl=None):
    """Return the zero-argument call of the library's collective on ``data``'s buffers.

    ``nccl``: the NCCL communicator, for NCCL's collective; else the MPI library's
    on ``comm`` (on device buffers, given to mpi4py as they are: a CUDA-aware MPI
    reads them).
    """
    if nccl is not None:
        op = "sum" if config.collective in ("allgather", "broadcast") else config.op
        return nccl.nccl_call(nccl, config.collective, data.x, data.theirs, op=op, root=root)
    from mpi4py import MPI

    mtype = MPI.Datatype.fromcode(get_dtype(config.dtype).char)  # predefined: ops apply
    # avg has no MPI op: the baseline sums (and is not checked).
    mop = {"sum": MPI.SUM, "avg": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN,
           "max": MPI.MAX}[get_op(config.op).name]
    x, theirs = [data.x, mtype], [data.theirs, mtype] if data.theirs is not None else None
    coll = config.collective
    if coll == "allreduce":
        return lambda: comm.Allreduce(x, theirs, op=mop)
    if coll == "reduce_scatter":
        return lambda: comm.Reduce_scatter_block(x, theirs, op=mop)
    if coll == "allgather":
        return lambda: comm.Allgather(x, theirs)
    if coll == "broadcast":
        return lambda: comm.Bcast(theirs, root)
    return lambda: comm.Reduce(x, theirs, op=mop, root=root)


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

        from ..verify.conformance import case_ranks

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
        if config.against == "nccl" and self._comms[self.workers] is not None:
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
            if isinstance(item.call, Replay):
                item.call.free()
    by_key = _reduce_items(groups.world, items, timeout)
    wires = _wire_bytes(groups.world, config, states, timeout)
    return [_row(config, groups, nbytes, name, resolved[name], by_key, wires.get(name))
            for name in config.algorithms]


def _items(groups: _Groups, config: BenchConfig, nbytes: int, schedules: dict,
           states: dict, timeout: float | None = None) -> tuple[list[_Item], dict]:
    """Return this rank's timed items at one size, and what ``auto`` resolved to (rank 0's)."""
    from ..calls.collectives import as_transport, device_for

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
    if baseline_unavailable(config) is None:
        data = data_for(groups.workers) if base_comm is not None else None
        # Not checked: avg (MPI sums; NCCL may scale before summing), and the root's
        # broadcast buffer (it is the source).
        checked = data is not None and get_op(config.op).name != "avg" and not (
            config.collective == "broadcast" and rank == root)
        call = _base_call(config, base_comm, data, root, groups.nccl) if data else None
        items.append(_Item("base", baseline_name(config), base_comm, call,
                           data.theirs if checked else None, data, xp=xp,
                           what=f"refcoll bench (before {baseline_name(config)} at {nbytes} B)",
                           timeout=timeout))
    for name in config.algorithms:
        p, total = groups.layout[name]
        sub = groups.comm(total)
        if sub is None:  # a spare rank: it sits out this algorithm
            items += [_Item("ours", name, None, None)] + ([_Item("bound", name, None, None)]
                                                           if bound else [])
            continue
        t = as_transport(sub)
        data = data_for(p)
        if name == "auto":
            from ..calls.auto import resolve

            in_count = data.count // p if config.collective == "allgather" else data.count
            # Resolved where the call resolves it: on the transport that carries the buffers.
            resolved[name] = resolve(device_for(t, data.x), config.collective,
                                     in_count, data.x.itemsize)
        state = None
        if config.compressor is not None:
            from ..compressors import parse

            comp = parse(config.compressor)
            state = states[name] = _Compressed(comp, comp.new_state(seed=0, rank=sub.rank))
        items.append(_Item("ours", name, sub, _our_call(config, t, data, name, root, state),
                           data.out if config.compressor is None else None, data, xp=xp,
                           what=f"refcoll bench (before {name} at {nbytes} B)", timeout=timeout))
        if bound:
            algorithm = resolved[name] or name
            key = (algorithm, p, total, data.count)
            if key not in schedules:
                plans = None
                if sub.rank == 0:
                    plans = schedule(config.collective, algorithm, p, data.count, config.dtype,
                                     op=get_op(config.op).name, root=root,
                                     node_size=_node_size(t, algorithm))
                elif algorithm == "hierarchical":
                    _node_size(t, algorithm)  # collective: every rank splits the nodes
                # After rank 0's simulation: a bounded MPI_Ibarrier, then the blocking scatter.
                bounded_barrier(sub, f"refcoll bench (sending {name}'s schedule at {nbytes} B)",
                                timeout)
                schedules[key] = sub.scatter(plans, root=0)
            items.append(_Item("bound", name, sub,
                               Replay(sub, schedules[key], config.dtype, config.op,
                                      timeout=timeout),
                               what=f"refcoll bench (before {name}'s bound at {nbytes} B)",
                               timeout=timeout))
    # A bounded MPI_Ibarrier, then the blocking (pickled) bcast of auto's choices.
    bounded_barrier(groups.world, f"refcoll bench (setting up {nbytes} B)", timeout)
    return items, groups.world.bcast(resolved, root=0)


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
    """Return ``(kind, name) -> (time, wrong, checked)``: the slowest rank's median, summed counts."""
    from mpi4py import MPI

    medians = np.array([float(np.median(item.times)) if item.times else 0.0 for item in items])
    counts = np.array([[item.wrong, item.checked] for item in items], dtype=np.int64)
    _iallreduce(world, medians, MPI.MAX, "gathering the timings", timeout)
    _iallreduce(world, counts, MPI.SUM, "gathering the checks", timeout)
    return {(item.kind, item.name): (float(medians[j]), int(counts[j, 0]), int(counts[j, 1]))
            for j, item in enumerate(items)}


def _node_size(t, algorithm: str) -> int | None:
    """Return the node size the simulator needs to predict ``algorithm`` on ``t`` (hierarchical)."""
    if algorithm != "hierarchical":
        return None
    from ..algorithms.hierarchical import node_layout

    return node_layout(t).sizes[0]


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
    """Assemble one row from the reduced timings and counts."""
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
               size=size, count=count, dtype=dtype_name(dt), op=_op_label(config),
               time_us=seconds * 1e6, algbw=algbw, busbw=algbw * factor)
    if config.check and config.compressor is None:
        row.update(wrong=wrong, checked=checked)
    base_name = baseline_name(config)
    if ("base", base_name) in by_key:
        base_seconds, base_wrong, base_checked = by_key[("base", base_name)]
        base_count = element_count(config.collective, nbytes, dt.itemsize, groups.workers)
        base_algbw = base_count * dt.itemsize / base_seconds / 1e9 if base_seconds > 0 else 0.0
        checked_base = config.check and get_op(config.op).name != "avg"
        row.update(baseline=base_name, base_time_us=base_seconds * 1e6,
                   base_busbw=base_algbw * bus_factor(config.collective, groups.workers),
                   base_wrong=base_wrong if checked_base else None,
                   time_over_base=seconds / base_seconds if base_seconds > 0 else None)
    if ("bound", name) in by_key:
        bound_seconds = by_key[("bound", name)][0]
        row.update(bound_us=bound_seconds * 1e6,
                   time_over_bound=seconds / bound_seconds if bound_seconds > 0 else None)
    if config.compressor is not None:
        row.update(compressor=config.compressor, **(wire or {}))
    return row


def _op_label(config: BenchConfig) -> str:
    return "none" if config.collective in ("allgather", "broadcast") else get_op(config.op).name


# ------------------------------------------------------------------ the report

def bench_header(comm, config: BenchConfig) -> dict:
    """Return the run's description: machine, MPI library, versions, ranks, settings, notes.

    Collective over ``comm`` when ``auto`` is selected (its calibration may be
    measured here, once) and on GPUs (each rank's GPU is chosen here, as
    :func:`run_bench` does). ``gpu`` describes the device path
    (:func:`refcoll.transport.cuda_aware.device_path`: the GPU, direct or staged transfers and
    why) on GPUs, and is None on CPUs.
    """
    from importlib.metadata import PackageNotFoundError, version

    from mpi4py import MPI

    def package(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    workers = config.workers or comm.size
    timeout = default_timeout()
    use_device(comm, config)
    unavailable = baseline_unavailable(config)
    notes = [
        "timed calls pass validate=False: the argument agreement round trip is not timed",
        "time: the largest over ranks of each rank's median over the timed iterations",
        f"busbw = algbw x nccl-tests' factor for {config.collective}",
    ]
    if unavailable is None and get_op(config.op).name == "avg":
        notes.append("avg: NCCL's ncclAvg may scale before summing; the baseline is not checked"
                     if config.against == "nccl" else
                     "avg: MPI has no average; the baseline runs MPI_SUM and is not checked")
    if config.device == "gpu":
        notes.append("device time: every timed call ends when the current stream has drained")
    if any(algorithms.get(n).workers is not None for n in config.algorithms):
        notes.append("switch: busbw factor (n-1)/(n+1) of in-network reduction, n the workers")
    header = {
        "command": "refcoll bench",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"node": platform.node(), "arch": platform.machine(),
                    "system": platform.platform(), "cpus": os.cpu_count(),
                    "processor": MPI.Get_processor_name()},
        "mpi": {"library": " ".join(MPI.Get_library_version().splitlines()[0].split()),
                "standard": "%d.%d" % MPI.Get_version()},
        "versions": {"python": platform.python_version(), "numpy": np.__version__,
                     "mpi4py": package("mpi4py"), "refcoll": package("refcoll"),
                     "ml_dtypes": package("ml_dtypes")},
        "gpu": cuda.device_path() if config.device == "gpu" else None,
        "world": comm.size,
        "workers": workers,
        "collective": config.collective,
        "op": _op_label(config),
        "dtype": dtype_name(get_dtype(config.dtype)),
        "root": 0 if config.collective in ("broadcast", "reduce") else None,
        "algorithms": list(config.algorithms),
        "sizes": list(config.sizes),
        "baseline": baseline_name(config) if unavailable is None else None,
        "baseline_note": unavailable,
        "device": config.device,
        "against": config.against,
        "warmup": config.warmup,
        "iters": config.iters,
        "check": config.check,
        "bound": config.bound and config.compressor is None,
        "compressor": config.compressor,
        "validate": False,
        "notes": notes,
        "calibration": None,
    }
    if config.device == "gpu":
        cupy = array_module("gpu")
        header["versions"]["cupy"] = getattr(cupy, "__version__", None)
        header["versions"]["nccl"] = nccl.nccl_version()
    if "auto" in config.algorithms:
        from ..calls.collectives import as_transport, device_for
        from ..calls.auto import calibration_for

        # MPI has no nonblocking split: a bounded MPI_Ibarrier first.
        bounded_barrier(comm, "refcoll bench (MPI_Comm_split for auto's calibration)", timeout)
        sub = comm.Split(0 if comm.rank < workers else MPI.UNDEFINED, comm.rank)
        if sub != MPI.COMM_NULL:
            # The calibration of the transport the calls run on (device buffers: its wrapper);
            # its messages wait by the transport's deadline.
            template = array_module(config.device).zeros(1, np.uint8)
            cal = calibration_for(device_for(as_transport(sub), template))
            header["calibration"] = {"alpha": cal.alpha, "beta": cal.beta, "gamma": cal.gamma,
                                     "source": cal.source}
            sub.Free()
        # A bounded MPI_Ibarrier (the spare ranks wait here through the calibration),
        # then the blocking (pickled) bcast.
        bounded_barrier(comm, "refcoll bench (sharing auto's calibration)", timeout)
        header["calibration"] = comm.bcast(header["calibration"], root=0)
    return header


def summarize(rows: Sequence[dict]) -> dict:
    """Return the footer's numbers: average busbw per algorithm and baseline, the check tally."""
    per: dict[str, list[float]] = defaultdict(list)
    base: list[float] = []
    seen_base = set()
    for row in rows:
        per[row["algorithm"]].append(row["busbw"])
        if row["base_busbw"] is not None and row["size"] not in seen_base:
            seen_base.add(row["size"])
            base.append(row["base_busbw"])
    checked_rows = [r for r in rows if r["wrong"] is not None]
    wrong = sum(r["wrong"] for r in checked_rows) if checked_rows else None
    base_rows = {r["size"]: r["base_wrong"] for r in rows if r["base_wrong"] is not None}
    return {
        "avg_busbw": {name: sum(v) / len(v) for name, v in per.items()},
        "base_avg_busbw": sum(base) / len(base) if base else None,
        "baseline": next((r["baseline"] for r in rows if r["baseline"]), None),
        "wrong": wrong,
        "checked": sum(r["checked"] for r in checked_rows) if checked_rows else None,
        "base_wrong": sum(base_rows.values()) if base_rows else None,
        "passed": not wrong,
    }


def _columns(header: dict) -> list[tuple[str, str, int, Callable]]:
    """Return the table's columns: (title, unit, width, formatter of a row)."""
    cols = [("size", "(B)", 12, lambda r: f"{r['size']}"),
            ("count", "(elements)", 12, lambda r: f"{r['count']}"),
            ("type", "", 13, lambda r: r["dtype"]),
            ("redop", "", 5, lambda r: r["op"]),
            ("algorithm", "", 26, _algorithm_label),
            ("time", "(us)", 10, lambda r: _us(r["time_us"])),
            ("algbw", "(GB/s)", 7, lambda r: f"{r['algbw']:.2f}"),
            ("busbw", "(GB/s)", 7, lambda r: f"{r['busbw']:.2f}")]
    if header["check"] and not header["compressor"]:
        cols.append(("#wrong", "", 7, lambda r: _opt(r["wrong"], "{}")))
    if header["baseline"]:
        short = ("NCCL" if header["baseline"].startswith("nccl") else
                 header["baseline"].replace("MPI_", "").replace("Reduce_scatter_block", "RSblock"))
        cols += [(short, "(us)", 10, lambda r: _us(r["base_time_us"])),
                 ("busbw", "(GB/s)", 7, lambda r: _opt(r["base_busbw"], "{:.2f}")),
                 ("time/base", "", 9, lambda r: _opt(r["time_over_base"], "{:.2f}"))]
    if header["bound"]:
        cols += [("bound", "(us)", 10, lambda r: _us(r["bound_us"])),
                 ("time/bound", "", 10, lambda r: _opt(r["time_over_bound"], "{:.2f}"))]
    if header["compressor"]:
        cols += [("wire", "(B sent)", 12, lambda r: _opt(r["wire_sent"], "{}")),
                 ("dense", "(B sent)", 12, lambda r: _opt(r["dense_sent"], "{}"))]
    return cols


def _algorithm_label(row: dict) -> str:
    return f"{row['algorithm']}({row['resolved']})" if row["resolved"] else row["algorithm"]


def _us(value) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}" if value < 1e5 else f"{value:.0f}"


def _opt(value, fmt: str) -> str:
    return "n/a" if value is None else fmt.format(value)


def format_header(header: dict) -> str:
    """Return the ``#`` lines that open the table, and the column titles."""
    lines = [
        f"# refcoll bench: {header['collective']}, {header['dtype']} {header['op']}, "
        f"{header['workers']} ranks" + (f" ({header['world']} with switch processes)"
                                       if header["world"] > header["workers"] else ""),
        f"# machine: {header['machine']['node']} ({header['machine']['arch']}, "
        f"{header['machine']['cpus']} CPUs), {header['machine']['system']}",
        f"# MPI: {header['mpi']['library']} (MPI {header['mpi']['standard']}); "
        + ", ".join(f"{k} {v}" for k, v in header["versions"].items() if v),
        f"# iterations: {header['warmup']} warm-up + {header['iters']} timed per size; check: "
        + _check_label(header),
        "# baseline: " + (f"{header['baseline']} on the same "
                          f"{'device ' if header.get('gpu') else ''}buffers, interleaved"
                          if header["baseline"] else f"none ({header['baseline_note']})"),
    ]
    if header.get("gpu"):
        g = header["gpu"]
        lines.insert(2, f"# device: {g['gpu'] or 'none (' + str(g['gpu_reason']) + ')'}; "
                        f"transfers: {g['path']} ({g['why']})")
    if header["compressor"]:
        lines.append(f"# compressor: {header['compressor']} (algbw and busbw of the dense size)")
    if header["calibration"]:
        c = header["calibration"]
        lines.append(f"# auto: alpha={c['alpha']:.3g} s, beta={c['beta']:.3g} s/B, "
                     f"gamma={c['gamma']:.3g} s/element ({c['source']})")
    lines += [f"# note: {note}" for note in header["notes"]]
    cols = _columns(header)
    lines.append("#" + " ".join(f"{title:>{w}}" for title, _, w, _ in cols))
    lines.append("#" + " ".join(f"{unit:>{w}}" for _, unit, w, _ in cols))
    return "\n".join(lines)


def _check_label(header: dict) -> str:
    if not header["check"]:
        return "off"
    if header["compressor"]:
        return "the baseline only (a compressed result is approximate)"
    return "every iteration, bit for bit"


def format_row(row: dict, header: dict) -> str:
    """Return one row of the table."""
    return " " + " ".join(f"{fmt(row):>{w}}" for _, _, w, fmt in _columns(header))


def format_footer(summary: dict) -> str:
    """Return the closing lines: average bus bandwidths and the correctness tally."""
    averages = [f"{name} {value:.3f}" for name, value in summary["avg_busbw"].items()]
    if summary["base_avg_busbw"] is not None:
        averages.append(f"{summary['baseline']} {summary['base_avg_busbw']:.3f}")
    lines = ["# Avg bus bandwidth (GB/s): " + ", ".join(averages)]
    if summary["wrong"] is None:
        lines.append("# #wrong: not checked")
    else:
        verdict = "OK" if summary["passed"] else "FAILED"
        lines.append(f"# #wrong: {summary['wrong']} of {summary['checked']} elements checked: "
                     f"{verdict}")
    if summary["base_wrong"] is not None:
        lines.append(f"# {summary['baseline']} #wrong: {summary['base_wrong']}")
    return "\n".join(lines)


def format_table(header: dict, rows: Sequence[dict]) -> str:
    """Return the whole report: header lines, one line per row, footer."""
    body = [format_row(row, header) for row in rows]
    return "\n".join([format_header(header), *body, format_footer(summarize(rows))])


def write_csv(rows: Sequence[dict], path: str) -> None:
    """Write the rows to ``path`` as CSV, one column per field of :data:`ROW_FIELDS`."""
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(ROW_FIELDS))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row.get(k) is None else row[k] for k in ROW_FIELDS})


def plotting():
    """Return ``matplotlib.figure``; raise :class:`UsageError` when matplotlib is not installed."""
    import importlib

    try:
        return importlib.import_module("matplotlib.figure")
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'refcoll[plot]'") from None


def plot(rows: Sequence[dict], path: str, *, title: str = "") -> None:
    """Draw busbw against size, log-log, one line per algorithm and the baseline, to ``path``.

    Raises:
        UsageError: matplotlib is not installed (it is in the ``plot`` extra).
    """
    Figure = plotting().Figure
    lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
    base_name = None
    for row in rows:
        lines[row["algorithm"]].append((row["size"], row["busbw"]))
        if row["base_busbw"] is not None:
            base_name = row["baseline"]
            if all(size != row["size"] for size, _ in lines[base_name]):
                lines[base_name].append((row["size"], row["base_busbw"]))
    fig = Figure(figsize=(8, 5))  # no pyplot: no global state, the Agg canvas by default
    ax = fig.subplots()
    for name, points in lines.items():
        shown = sorted((s, b) for s, b in points if s > 0 and b > 0)  # a log axis has no zero
        if shown:
            ax.plot(*zip(*shown), marker="o", label=name,
                    linestyle="--" if name == base_name else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title or "refcoll bench")
    ax.grid(True, which="both", alpha=0.3)
    if any(ax.get_lines()):
        ax.legend()
    fig.savefig(path, format="png", dpi=100)



# ---------------------------------------------------------------- the terminal

def bar_target(out_fd: int = 1, err_fd: int = 2) -> tuple[str, int] | None:
    """Return where a progress bar may be drawn, ``("stdout" | "stderr", columns)``, or None.

    A bar is drawn only when stderr is a terminal. When stdout is that same
    terminal (``os.path.samestat`` of the two descriptors) the bar goes to
    ``"stdout"``, the stream that carries the table: see :class:`TableWriter`
    for why. ``columns`` is that terminal's width (80 when it reports none).
    Call it where the terminal is, in the process that starts ``mpiexec``:
    the ranks' streams are pipes to the launcher.
    """
    if not os.isatty(err_fd):
        return None
    shared = os.isatty(out_fd) and os.path.samestat(os.fstat(out_fd), os.fstat(err_fd))
    fd = out_fd if shared else err_fd
    try:
        columns = os.get_terminal_size(fd).columns
    except OSError:
        columns = 0
    return ("stdout" if shared else "stderr"), columns or 80


class TableWriter:
    """Rank 0's report: the table's lines on ``out``, and a progress bar between them.

    One process writes both, in one thread, and erases the bar before every
    line of the table, so no row is written while a bar stands on the line.
    That is not enough by itself: under ``mpiexec`` a rank's stdout and stderr
    are two pipes, which the launcher reads as data comes and copies to its own
    stdout and stderr, so bytes flushed to stderr before a row was flushed to
    stdout can still reach the terminal after it (a row glued to a bar, then
    erased). Order holds only within one stream. So when stdout and stderr are
    the same terminal (``shared``, from :func:`bar_target`) the bar is drawn on
    ``out`` itself: bar, erasure and row travel down one pipe and arrive in the
    order written. Otherwise the bar is on stderr and the rows go to a file, a
    pipe or another terminal: they never share a line with it. Either way the
    bar's stream is flushed after each erasure, before the row is written, and
    ``out`` after each row. The bar is erased by overwriting it with spaces
    (it never wraps: it is cut to the terminal's width), which every terminal
    understands.

    Args:
        out: the table's stream (stdout).
        err: the bar's stream when it is not ``out`` (stderr).
        tty: whether the bar's stream is a terminal; without one no bar is drawn.
        shared: ``out`` and ``err`` are the same terminal: draw the bar on ``out``.
        width: the terminal's columns.
        min_interval: seconds between two redraws of the bar (a sweep of small
            sizes would otherwise redraw it thousands of times a second).
        clock: the time source of ``min_interval`` (seconds).
    """

    BAR = 30

    def __init__(self, out, err, *, tty: bool, shared: bool = False, width: int = 80,
                 min_interval: float = 0.1, clock: Callable[[], float] = time.monotonic) -> None:
        self._out = out
        self._bar = (out if shared else err) if tty else None
        self._width = max(width - 1, 1)  # the last column would wrap on some terminals
        self._min_interval = min_interval
        self._clock = clock
        self._drawn = 0  # characters of the bar now on the line (0: none)
        self._last = None

    def line(self, text: str) -> None:
        """Erase the bar, then write ``text`` and a newline to ``out``; flush both."""
        self.clear()
        self._out.write(text + "\n")
        self._out.flush()

    def progress(self, done: int, total: int, nbytes: int) -> None:
        """Redraw the bar (at most once per ``min_interval``): ``run_bench``'s ``progress``."""
        if self._bar is None:
            return
        now = self._clock()
        if self._last is not None and now - self._last < self._min_interval:
            return
        self._last = now
        filled = self.BAR * done // max(total, 1)
        text = (f"[{'#' * filled}{'.' * (self.BAR - filled)}] {done}/{total} iterations, "
                f"at {nbytes} B")[:self._width]
        self._bar.write("\r" + text.ljust(self._drawn))  # covers a longer bar before it
        self._bar.flush()
        self._drawn = max(self._drawn, len(text))

    __call__ = progress

    def clear(self) -> None:
        """Erase the bar, if one is drawn, and flush its stream."""
        if self._drawn:
            self._bar.write("\r" + " " * self._drawn + "\r")
            self._bar.flush()
            self._drawn = 0
