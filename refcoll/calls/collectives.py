"""The public collectives: argument handling around the registry's algorithms.

Each call turns its input into a flat contiguous view (a copy only when the input
is not contiguous), allocates the result unless ``out=`` is given, runs the
algorithm in the transport's tag space for one call, and finishes ``avg``.
The input is never modified unless it is also ``out``.

Repeated all-reduces are prepared. The first call of an (algorithm, op, dtype,
count) on a transport runs as above and keeps what it checked and resolved
(``auto``'s choice included); later calls skip those steps. Small ones on MPI
go further, as MPI-4's persistent collectives (``MPI_Allreduce_init``) do: the
algorithm's schedule is recorded once on buffers of the plan's own, and a call
copies the input in, replays the schedule over persistent requests and copies
the result out. Below :data:`PLAN_BYTES` a call costs its messages and Python
steps, not its bytes, and the replay drops most of the steps. The results are
the same bits: the same exchanges and reductions, in the same order, on the
same values.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .. import algorithms
from ..core.chunking import chunk_slice, chunk_sizes
from ..core.errors import MismatchError, UsageError
from ..core.xp import array_namespace, check_device_dtype, is_device_array
from ..transport.device import device_transport
from ..core.ops import check_supported, dtype_name, get_dtype, get_op
from ..transport.base import Ledger, TransportBase, transport_cache
from ..transport.mpi import transport_for
from ..transport.sim import SimWorld
from .auto import resolve
from .agree import agree
from .args import (agree_arguments, check_overlap, check_root, flat_input, flat_out, shaped,
                   shared_errors, workers_of)

__all__ = [
    "PLAN_BYTES",
    "allreduce",
    "reduce_scatter",
    "allgather",
    "broadcast",
    "reduce",
    "simulate",
    "SimResult",
    "as_transport",
    "device_for",
    "use_compressed",
]


#: The compressed all-reduce, which lives a layer above (:mod:`refcoll.compressors`) and
#: hands itself in when it is imported (:func:`use_compressed`).
_COMPRESSED = None


def use_compressed(fn) -> None:
    """Route ``allreduce(..., compressor=...)`` to ``fn`` (the compressors package does this)."""
    global _COMPRESSED
    _COMPRESSED = fn


def as_transport(comm=None, collective: str | None = None):
    """Return the transport for ``comm``: a Transport as is, an mpi4py communicator wrapped.

    ``None`` means ``MPI.COMM_WORLD``. The wrapper (an ``Idup`` of the
    communicator, waited for by the deadline) is cached on the communicator, so
    repeated calls cost nothing. ``collective`` names the call, for the timeout
    when some rank never comes to this first one.

    Raises:
        TypeError: ``comm`` is neither a Transport nor an mpi4py intracommunicator.
    """
    if isinstance(comm, TransportBase) or (
            comm is not None and hasattr(comm, "sendrecv") and hasattr(comm, "reduce_local")):
        return comm
    if comm is not None and not _is_intracomm(comm):
        raise TypeError(f"comm= must be an mpi4py intracommunicator (such as MPI.COMM_WORLD), a "
                        f"refcoll Transport, or None for MPI.COMM_WORLD; got {comm!r} "
                        f"({type(comm).__name__})")
    return transport_for(comm, collective)


def device_for(t, x=None):
    """Return the transport that carries ``x`` over ``t``: ``t`` itself for host arrays.

    For device arrays, the direct or staged device transport over ``t``
    (:func:`~refcoll.transport.device.device_transport`), the ranks agreeing on
    the path with a one-byte ``min`` all-reduce.
    """
    return device_transport(t, x, agree=_every_rank_aware)


def _every_rank_aware(t, aware: bool) -> bool:
    return bool(allreduce(np.array([int(aware)], np.int8), t, op="min", algorithm="ring",
                          validate=False)[0])


def _is_intracomm(comm) -> bool:
    """Return whether ``comm`` is an mpi4py intracommunicator (imports mpi4py only if it is loaded)."""
    import sys

    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and isinstance(comm, mpi.Intracomm)


def allreduce(x, comm=None, *, op="sum", algorithm="ring", compressor=None, state=None,
              out=None, validate: bool = True, **options) -> np.ndarray:
    """Reduce ``x`` elementwise over all ranks; every rank gets the bitwise-same result.

    Args:
        x: this rank's array (any shape; reduced elementwise, shape kept).
        comm: an mpi4py communicator or a Transport; ``None``: ``MPI.COMM_WORLD``.
        op: ``sum``, ``prod``, ``min``, ``max`` or ``avg`` (see :mod:`refcoll.core.ops`),
            or mpi4py's ``MPI.SUM``, ``MPI.PROD``, ``MPI.MIN``, ``MPI.MAX``.
        algorithm: a name from ``refcoll list``.
        compressor: a compressor or its spec string (``"ef(topk:ratio=0.01)"``):
            run the compressed all-reduce of
            :func:`refcoll.compressors.collective.compressed_allreduce`, which
            picks the pattern the compressor declares (op ``sum`` or ``avg``;
            floating tensors only).
        state: with ``compressor``, this tensor's
            :class:`~refcoll.compressors.base.CompressorState`
            (``compressor.new_state(seed=S, rank=r)``, the same ``S`` on every
            rank), kept per tensor and passed again on every call; it carries
            the error-feedback residual and warm starts from call to call, and
            after the call ``state.traffic`` holds the bytes this rank sent and
            received. Error feedback (``ef(...)``) requires it: without one the
            residual would be thrown away, so ``state=None`` there is a
            UsageError on every rank. ``None`` otherwise: a fresh state for
            this call alone.
        out: result buffer (``out=x`` runs in place); a new array otherwise.
        validate: first check that every rank passed the same collective,
            algorithm, op, dtype, count and options (:mod:`refcoll.calls.agree`);
            ``False`` saves that round trip.
        **options: passed to the algorithm (segment sizes and the like); one
            the algorithm does not take is a UsageError on every rank, before
            any data moves.

    Returns:
        The reduced array, ``out`` when given. With ``algorithm="switch"`` the
        last ranks of ``comm`` are switch processes: they call ``allreduce`` too,
        with an array of the same count and dtype (its values are ignored), and
        get ``None`` back.
    """
    if compressor is not None:
        if _COMPRESSED is None:
            raise UsageError("compressor= needs refcoll.compressors: import refcoll, "
                             "which loads it")
        result, _ = _COMPRESSED(x, comm, compressor=compressor, state=state, op=op,
                                         algorithm=algorithm, out=out, validate=validate,
                                         **options)
        return result
    if state is not None:
        raise UsageError("state= goes with compressor=; a plain all-reduce keeps no state")
    xp = array_namespace(x)
    arr = xp.asarray(x)
    t = device_for(as_transport(comm, "allreduce"), arr)
    key = (algorithm, op, arr.dtype, arr.size)
    prepared = None if options else _prepared(t, key)
    if prepared is None:
        with shared_errors(t, validate, "allreduce"):
            reduction = get_op(op)
            fn = algorithms.implementation(algorithm, "allreduce")
            algorithms.check_options(algorithm, "allreduce", options, rank=t.rank)
            workers = workers_of(algorithms.get(algorithm), t, options)
            flat = flat_input(arr, t)
            check_supported(reduction, flat.dtype)
    else:  # the same call ran before: its arguments were checked and resolved then
        reduction, workers = prepared.reduction, t.size
        flat = xp.ascontiguousarray(arr).reshape(-1)
    if t.rank >= workers:  # a rank that holds no data (a switch): serve, return nothing
        with t.call("allreduce"):
            agree_arguments(t, validate, "allreduce", algorithm, reduction, flat, options)
            fn(t, flat, None, op=reduction, **options)
        return None
    with shared_errors(t, validate, "allreduce"):
        result = flat_out(out, arr.shape, flat.dtype, t, "all-reduce", xp)
        if out is not arr:  # the one in-place layout needs no check
            check_overlap(flat, result, (flat, result), t, "all-reduce")
    with t.call("allreduce"):
        agree_arguments(t, validate, "allreduce", algorithm, reduction, flat, options)
        if prepared is None:
            fn(t, flat, result, op=reduction, **options)
        else:
            prepared.run(t, flat, result)
    reduction.finalize(result, workers)
    if prepared is None and not options and workers == t.size > 1:
        _prepare(t, key, reduction)
    return shaped(result, out, arr.shape)


# --------------------------------------------------------- prepared all-reduces

#: Largest all-reduce, in bytes, that runs from a recorded plan. Up to here the
#: two copies a plan adds (input in, result out) cost less than the Python steps
#: it saves; above it an out-of-place call should not copy its input at all.
PLAN_BYTES = 64 << 10

#: Prepared all-reduces kept per transport; past this the oldest is dropped (on
#: every rank alike, as every rank makes the same calls).
PREPARED_KEPT = 128

#: Algorithms whose all-reduce, on two or more ranks, touches data only through
#: the transport (no local copies, no ``split``), so a recording replays it exactly.
PLANNABLE = frozenset({"ring", "recursive_doubling", "rabenseifner", "tree", "dbtree"})


class _Prepared:
    """An all-reduce already run once on a transport with this (algorithm, op, dtype, count).

    It keeps what the first call checked and resolved (the op, the
    implementation, ``auto``'s choice), so later calls skip those steps; below
    :data:`PLAN_BYTES`, on a transport with persistent exchanges, it also holds
    the recorded :class:`_Plan`. Every rank makes the same calls, so every rank
    prepares the same calls and switches to a plan at the same call (a plan's
    messages use tags ordinary calls do not).
    """

    def __init__(self, t, key: tuple, reduction):
        algorithm, _, dtype, count = key
        name = resolve(t, "allreduce", count, dtype.itemsize) if algorithm == "auto" else algorithm
        self.fn = algorithms.implementation(name, "allreduce")
        self.reduction = reduction
        self.plan = None
        if (count * dtype.itemsize <= PLAN_BYTES and name in PLANNABLE
                and hasattr(t, "persistent")):
            self.plan = _Plan(t, self.fn, reduction, dtype, count)

    def run(self, t, x: np.ndarray, out: np.ndarray) -> None:
        """Reduce the flat ``x`` into the flat ``out``, inside the caller's ``t.call``."""
        if self.plan is None:
            self.fn(t, x, out, op=self.reduction)
            return
        try:
            self.plan.run(x, out)
        except BaseException:
            self.plan = None  # its requests may still be running: never restart them
            raise

    def free(self) -> None:
        """Free the plan's persistent requests, if any."""
        if self.plan is not None:
            self.plan.free()


def _prepared(t, key: tuple) -> _Prepared | None:
    """Return the all-reduce prepared on ``t`` for ``key``; None the first time."""
    try:
        return transport_cache(t, "prepared").get(key)
    except TypeError:  # an unhashable op or algorithm: the ordinary checks name it
        return None


def _prepare(t, key: tuple, reduction) -> None:
    """Keep ``key``'s all-reduce prepared on ``t`` after a call that ran the ordinary way."""
    try:
        hash(key)
    except TypeError:  # an op object that cannot key a cache (mpi4py's MPI.SUM): never prepared
        return
    prepared = transport_cache(t, "prepared")
    if len(prepared) >= PREPARED_KEPT:
        prepared.pop(next(iter(prepared))).free()
    prepared[key] = _Prepared(t, key, reduction)


class _Recorder:
    """A stand-in transport that records an algorithm's steps instead of running them.

    The schedules are data-oblivious (which message goes where never depends on
    the values), so one recording over the plan's own buffers is every call's
    schedule. Each send, receive or sendrecv becomes one persistent exchange of
    the real transport; each local reduction, the real transport's call, bound.
    """

    def __init__(self, t):
        self.rank, self.size = t.rank, t.size
        self.steps: list = []
        self._t = t

    def send(self, buf, dest: int, tag: int = 0) -> None:
        self.steps.append(self._t.persistent([(buf, dest, tag)], []))

    def recv(self, buf, source: int, tag: int = 0) -> None:
        self.steps.append(self._t.persistent([], [(buf, source, tag)]))

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0) -> None:
        self.steps.append(self._t.persistent([(sendbuf, dest, tag)], [(recvbuf, source, tag)]))

    def reduce_local(self, op, a, b, out) -> None:
        self.steps.append(functools.partial(self._t.reduce_local, op, a, b, out))


class _Plan:
    """A small all-reduce recorded once: its own buffers and the steps that run on them.

    MPI-4's persistent collectives (``MPI_Allreduce_init``) in Python: a run
    copies the input in, replays the recorded exchanges (persistent requests)
    and reductions in their order, and copies the result out. The same
    exchanges and reductions on the same values give the same bits as the
    algorithm itself.
    """

    def __init__(self, t, fn, reduction, dtype, count: int):
        self.x = np.empty(count, dtype)
        self.out = np.empty(count, dtype)
        recorder = _Recorder(t)
        fn(recorder, self.x, self.out, op=reduction)
        self.steps = recorder.steps

    def run(self, x: np.ndarray, out: np.ndarray) -> None:
        """Reduce the flat ``x`` into the flat ``out`` (which may be ``x``)."""
        np.copyto(self.x, x)
        for step in self.steps:
            step()
        np.copyto(out, self.out)

    def free(self) -> None:
        """Free the persistent requests."""
        for step in self.steps:
            if hasattr(step, "free"):
                step.free()


def reduce_scatter(x, comm=None, *, op="sum", algorithm="ring", out=None, validate: bool = True,
                   **options) -> np.ndarray:
    """Reduce ``x`` over all ranks and give rank ``r`` chunk ``r`` of the result.

    ``x`` is flattened; its ``n`` elements are cut into ``p`` chunks by
    :func:`refcoll.core.chunking.chunk_bounds` (the first ``n % p`` chunks one element
    longer), so ``n`` need not divide by ``p``. Returns a 1-D array. In place:
    pass ``out=`` a view of ``x`` at chunk ``r`` (as NCCL's in-place reduce-scatter).
    """
    xp = array_namespace(x)
    t = device_for(as_transport(comm, "reduce_scatter"), x)
    with shared_errors(t, validate, "reduce_scatter"):
        reduction = get_op(op)
        fn = algorithms.implementation(algorithm, "reduce_scatter")
        algorithms.check_options(algorithm, "reduce_scatter", options, rank=t.rank)
        flat = flat_input(x, t)
        check_supported(reduction, flat.dtype)
        shape = (chunk_sizes(flat.size, t.size)[t.rank],)
        result = flat_out(out, shape, flat.dtype, t, "reduce-scatter", xp)
        check_overlap(flat, result, (flat[chunk_slice(flat.size, t.size, t.rank)], result), t,
                       "reduce-scatter")
    with t.call("reduce_scatter"):
        agree_arguments(t, validate, "reduce_scatter", algorithm, reduction, flat, options)
        fn(t, flat, result, op=reduction, **options)
    reduction.finalize(result, t.size)
    return shaped(result, out, shape)


def allgather(x, comm=None, *, algorithm="ring", out=None, validate: bool = True,
              **options) -> np.ndarray:
    """Gather every rank's ``x`` (same shape on every rank) on every rank.

    Returns an array of shape ``(p, *x.shape)``: row ``r`` is rank ``r``'s input
    (``.reshape(-1)`` gives the flat concatenation NCCL and MPI return). In place:
    pass ``x`` as row ``r`` of ``out``.
    """
    xp = array_namespace(x)
    t = device_for(as_transport(comm, "allgather"), x)
    with shared_errors(t, validate, "allgather"):
        fn = algorithms.implementation(algorithm, "allgather")
        algorithms.check_options(algorithm, "allgather", options, rank=t.rank)
        flat = flat_input(x, t)
        shape = (t.size, *xp.asarray(x).shape)
        result = flat_out(out, shape, flat.dtype, t, "allgather", xp)
        own_block = result[chunk_slice(result.size, t.size, t.rank)]
        check_overlap(flat, result, (flat, own_block), t, "allgather")
        if not (flat.size and xp.shares_memory(own_block, flat)):
            xp.copyto(own_block, flat)
    with t.call("allgather"):
        agree_arguments(t, validate, "allgather", algorithm, None, flat, options)
        fn(t, result, **options)
    return shaped(result, out, shape)


def broadcast(x, root: int = 0, comm=None, *, algorithm="naive", out=None, validate: bool = True,
              **options) -> np.ndarray:
    """Return the root's ``x`` on every rank (``x`` must have the same shape everywhere).

    Non-root ranks' ``x`` gives only the shape and dtype; ``out=x`` overwrites it
    in place, as ``MPI_Bcast`` does.
    """
    xp = array_namespace(x)
    t = device_for(as_transport(comm, "broadcast"), x)
    with shared_errors(t, validate, "broadcast"):
        check_root(root, t)
        fn = algorithms.implementation(algorithm, "broadcast")
        algorithms.check_options(algorithm, "broadcast", options, rank=t.rank)
        flat = flat_input(x, t)
        shape = xp.asarray(x).shape
        result = flat_out(out, shape, flat.dtype, t, "broadcast", xp)
        check_overlap(flat, result, (flat, result), t, "broadcast")
        if t.rank == root and not xp.shares_memory(result, flat):
            xp.copyto(result, flat)
    with t.call("broadcast"):
        agree_arguments(t, validate, "broadcast", algorithm, None, flat, options, root)
        fn(t, result, root=root, **options)
    return shaped(result, out, shape)


def reduce(x, root: int = 0, comm=None, *, op="sum", algorithm="naive", out=None,
           validate: bool = True, **options) -> np.ndarray | None:
    """Reduce ``x`` over all ranks onto ``root``; return the result there, ``None`` elsewhere."""
    xp = array_namespace(x)
    t = device_for(as_transport(comm, "reduce"), x)
    with shared_errors(t, validate, "reduce"):
        check_root(root, t)
        reduction = get_op(op)
        fn = algorithms.implementation(algorithm, "reduce")
        algorithms.check_options(algorithm, "reduce", options, rank=t.rank)
        flat = flat_input(x, t)
        check_supported(reduction, flat.dtype)
        shape = xp.asarray(x).shape
        result = flat_out(out, shape, flat.dtype, t, "reduce", xp) if t.rank == root else None
        if result is not None:
            check_overlap(flat, result, (flat, result), t, "reduce")
    with t.call("reduce"):
        agree_arguments(t, validate, "reduce", algorithm, reduction, flat, options, root)
        fn(t, flat, result, op=reduction, root=root, **options)
    if t.rank != root:
        return None
    reduction.finalize(result, t.size)
    return shaped(result, out, shape)


_COLLECTIVE_FUNCTIONS = {
    "allreduce": allreduce,
    "reduce_scatter": reduce_scatter,
    "allgather": allgather,
    "broadcast": broadcast,
    "reduce": reduce,
}


@dataclass
class SimResult:
    """What :func:`simulate` returns.

    Attributes:
        outputs: each data rank's result, by rank (``None`` on non-roots of
            ``reduce``); ranks that hold no data (switches) are not listed.
        ledger: every message and local reduction of the run.
        world: the simulated world (for further inspection).
    """

    outputs: list[Any]
    ledger: Ledger
    world: SimWorld


def simulate(collective: str, inputs: Sequence, *, algorithm: str, op="sum",
             timeout: float | None = None, record_payloads: bool = False,
             node_size: int | None = None, calibration=None, **options) -> SimResult:
    """Run one collective on ``len(inputs)`` simulated ranks in this process.

    The same algorithm code runs as under MPI, over threads and a rendezvous
    transport, so ``outputs`` is, bit for bit, what a real run must return.

    Args:
        collective: ``allreduce``, ``reduce_scatter``, ``allgather``, ``broadcast``
            or ``reduce``.
        inputs: one array per rank.
        algorithm: an algorithm name; op: a reduction op (ignored for allgather
            and broadcast); options: ``root=`` and algorithm options.

    ``validate=True`` runs the argument agreement of the real calls first (off by
    default, so the ledger holds the algorithm's messages alone);
    ``record_payloads=True`` keeps every message's bytes in the ledger;
    ``node_size`` gives the simulated world its node shape (what
    ``Transport.split_node`` sees), as ``refcoll.algorithms.hierarchical`` uses
    when no ``ranks_per_node`` option is passed to it. ``calibration`` is the
    :class:`~refcoll.calls.auto.Calibration` ``algorithm="auto"`` resolves with
    (default :data:`~refcoll.calls.auto.DEFAULT`): pass the one an MPI job agreed on
    (``refcoll.calls.auto.calibration_for(transport)``) to predict that job's bits.

    Algorithms with ranks that hold no data (``switch``) get them added after
    the ``len(inputs)`` data ranks; the ledger shows their traffic too.
    """
    if collective not in _COLLECTIVE_FUNCTIONS:
        raise UsageError(f"unknown collective {collective!r}: choose one of "
                         f"{', '.join(_COLLECTIVE_FUNCTIONS)}")
    algorithms.implementation(algorithm, collective)
    if len(inputs) < 1:
        raise UsageError("simulate needs at least one rank's input")
    fn = _COLLECTIVE_FUNCTIONS[collective]
    # The ledger should show the algorithm's messages only, so argument agreement
    # (one small allgather) is off unless asked for.
    kwargs = dict(options, algorithm=algorithm)
    kwargs.setdefault("validate", False)
    if collective not in ("allgather", "broadcast"):
        kwargs["op"] = op
    algo = algorithms.get(algorithm)
    workers = len(inputs)
    args = [(x,) for x in inputs]
    if algo.extra_ranks is not None:  # ranks that hold no data get a template of the buffer
        template = array_namespace(inputs[0]).zeros_like(inputs[0])
        args += [(template,)] * algo.extra_ranks(workers, **options)
    world = SimWorld(len(args), timeout=timeout, record_payloads=record_payloads,
                     ranks_per_node=node_size, calibration=calibration)
    outputs = world.run(lambda t, x: fn(x, comm=t, **kwargs), args)
    return SimResult(outputs[:workers], world.ledger, world)
