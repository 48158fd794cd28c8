"""The public collectives: argument handling around the registry's algorithms.

Each call turns its input into a flat contiguous view (a copy only when the input
is not contiguous), allocates the result unless ``out=`` is given, runs the
algorithm in the transport's tag space for one call, and finishes ``avg``.
The input is never modified unless it is also ``out``. What every call does
before its algorithm runs is :class:`_Call`'s; what each adds (the shape of its
result, the in-place layout it allows) is in its own function.

Repeated all-reduces are prepared (:mod:`refcoll.calls.prepared`). :func:`simulate` runs one
collective on many simulated ranks in this process, with its ledger: the same
algorithm code as under MPI, so its outputs are, bit for bit, what a real run
must return.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .. import algorithms
from ..core.chunking import chunk_slice, chunk_sizes
from ..core.errors import UsageError
from ..core.ops import check_supported, get_op
from ..core.xp import array_namespace
from ..transport.base import Ledger, TransportBase
from ..transport.device import device_transport
from ..transport.mpi import transport_for
from ..transport.torch import is_process_group, torch_transport_for
from ..transport.ledger_only import LedgerWorld
from ..transport.sim import SimWorld
from .agree import disagreement
from . import debug
from .args import (agree_arguments, argument_fields, check_overlap, check_root, flat_input, flat_out, shaped,
                   shared_errors, workers_of)
from .prepared import bind, bound_call, op_key, prepare, prepared_call
from .progress import Handle, any_busy, busy_engine

__all__ = [
    "allreduce",
    "reduce_scatter",
    "allgather",
    "broadcast",
    "reduce",
    "as_transport",
    "device_for",
    "use_compressed",
    "COLLECTIVE_FUNCTIONS",
    "simulate",
    "SimResult",
]

#: The compressed all-reduce, which lives a layer above (:mod:`refcoll.compressors`) and
#: hands itself in when it is imported (:func:`use_compressed`).
_COMPRESSED = None


def use_compressed(fn) -> None:
    """Route ``allreduce(..., compressor=...)`` to ``fn`` (the compressors package does this)."""
    global _COMPRESSED
    _COMPRESSED = fn


def as_transport(comm=None, collective: str | None = None):
    """Return the transport for ``comm``: a Transport as is, a communicator or group wrapped.

    An mpi4py communicator becomes an :class:`~refcoll.transport.mpi.MPITransport`,
    a ``torch.distributed`` process group a
    :class:`~refcoll.transport.torch.TorchTransport`.

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
    if is_process_group(comm):
        return torch_transport_for(comm)
    if comm is not None and not _is_intracomm(comm):
        raise TypeError(f"comm= must be an mpi4py intracommunicator (such as MPI.COMM_WORLD), a "
                        f"torch.distributed process group, a refcoll Transport, or None for "
                        f"MPI.COMM_WORLD; got {comm!r} "
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
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and isinstance(comm, mpi.Intracomm)


class _Call:
    """What every collective does around its algorithm: the transport, the checks, the run.

    Built outside the shared-error context (finding the transport is not an
    argument check); :meth:`check` runs inside it, :meth:`run` after it.
    """

    def __init__(self, x, comm, collective: str, algorithm: str, options: dict, validate: bool):
        self.xp = array_namespace(x)
        self.t = device_for(as_transport(comm, collective), x)
        self.collective, self.algorithm, self.options = collective, algorithm, options
        self.validate = validate
        self.reduction = None
        self.root = 0

    def errors(self):
        """Return the context in which the call checks its arguments (:func:`shared_errors`)."""
        return shared_errors(self.t, self.validate, self.collective)

    def check(self, x, *, op=None, root: int | None = None):
        """Check the root, op, algorithm and options; return ``x`` as a flat view."""
        t = self.t
        if root is not None:
            check_root(root, t)
            self.root = root
        if op is not None:
            self.reduction = get_op(op)
        self.fn = algorithms.implementation(self.algorithm, self.collective)
        algorithms.check_options(self.algorithm, self.collective, self.options, rank=t.rank)
        self.flat = flat_input(x, t)
        if self.reduction is not None:
            check_supported(self.reduction, self.flat.dtype)
        return self.flat

    def run(self, *args, **kwargs) -> None:
        """Agree on the arguments and run the algorithm, in the call's own tag space."""
        with self.t.call(self.collective):
            agree_arguments(self.t, self.validate, self.collective, self.algorithm,
                            self.reduction, self.flat, self.options, self.root)
            self.fn(self.t, *args, **kwargs, **self.options)


def _in_issue_order(comm_at: int):
    """Make a blocking collective queue behind the non-blocking calls outstanding on its comm.

    MPI orders a communicator's blocking and non-blocking collectives alike, in
    issue order: a blocking call made while ``iallreduce``s are running on the
    same communicator runs after them, on their engine, and is waited for. When no
    engine anywhere has work (the usual case) this costs one integer test.
    ``comm_at``: the position of the ``comm`` argument.
    """
    def wrap(fn):
        traced = debug.tracing(fn, comm_at, as_transport)  # REFCOLL_DEBUG=INFO: a line per call
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if any_busy():
                positional = "comm" not in kwargs and len(args) > comm_at
                comm = args[comm_at] if positional else kwargs.get("comm")
                t = as_transport(comm, fn.__name__)
                engine = busy_engine(t)
                if engine is not None:
                    if positional:
                        args = (*args[:comm_at], t, *args[comm_at + 1:])
                    else:
                        kwargs["comm"] = t
                    job = functools.partial(traced, *args, **kwargs)
                    return engine.submit(Handle(fn.__name__, job, engine)).wait()
            if debug.enabled():
                return traced(*args, **kwargs)
            return fn(*args, **kwargs)
        return call
    return wrap


@_in_issue_order(1)
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
                                algorithm=algorithm, out=out, validate=validate, **options)
        return result
    if state is not None:
        raise UsageError("state= goes with compressor=; a plain all-reduce keeps no state")
    if out is not None and not options:
        bound = bound_call(comm, x, out, algorithm, op, validate)
        if bound is not None:  # these very arguments ran before: replay on their buffers
            return bound()
    arr = array_namespace(x).asarray(x)
    c = _Call(arr, comm, "allreduce", algorithm, options, validate)
    t, xp = c.t, c.xp
    key = (algorithm, op_key(op), arr.dtype, arr.size)  # every spelling of an op: one key
    prepared = None if options else prepared_call(t, key)
    if prepared is None:
        with c.errors():
            flat = c.check(arr, op=op)
            workers = workers_of(algorithms.get(algorithm), t, options)
    else:  # the same call ran before: its arguments were checked and resolved then
        c.reduction, workers = prepared.reduction, t.size
        c.flat = flat = xp.ascontiguousarray(arr).reshape(-1)
    reduction = c.reduction
    if t.rank >= workers:  # a rank that holds no data (a switch): serve, return nothing
        c.run(flat, None, op=reduction)
        return None
    with c.errors():
        result = flat_out(out, arr.shape, flat.dtype, t, "all-reduce", xp)
        if out is not arr:  # the one in-place layout needs no check
            check_overlap(flat, result, (flat, result), t, "all-reduce")
    if prepared is None:
        c.run(flat, result, op=reduction)
    else:
        with t.call("allreduce"):
            if validate and prepared.signed():  # the agreement rides beside the data
                fields = argument_fields("allreduce", algorithm, reduction, flat, options)
                if not prepared.run_signed(t, flat, result, fields):
                    disagreement(t, fields)
            else:
                agree_arguments(t, validate, "allreduce", algorithm, reduction, flat, options)
                prepared.run(t, flat, result)
    reduction.finalize(result, workers)
    if prepared is None and not options and workers == t.size > 1:
        prepare(t, key, reduction)
    elif (prepared is not None and prepared.plan is not None and out is not None and arr is x
          and not options):
        bind(t, comm, x, out, algorithm, op, validate,
             argument_fields("allreduce", algorithm, reduction, flat, options))
    return shaped(result, out, arr.shape)


@_in_issue_order(1)
def reduce_scatter(x, comm=None, *, op="sum", algorithm="ring", out=None, validate: bool = True,
                   **options) -> np.ndarray:
    """Reduce ``x`` over all ranks and give rank ``r`` chunk ``r`` of the result.

    ``x`` is flattened; its ``n`` elements are cut into ``p`` chunks by
    :func:`refcoll.core.chunking.chunk_bounds` (the first ``n % p`` chunks one element
    longer), so ``n`` need not divide by ``p``. Returns a 1-D array. In place:
    pass ``out=`` a view of ``x`` at chunk ``r`` (as NCCL's in-place reduce-scatter).
    """
    c = _Call(x, comm, "reduce_scatter", algorithm, options, validate)
    t = c.t
    with c.errors():
        flat = c.check(x, op=op)
        shape = (chunk_sizes(flat.size, t.size)[t.rank],)
        result = flat_out(out, shape, flat.dtype, t, "reduce-scatter", c.xp)
        check_overlap(flat, result, (flat[chunk_slice(flat.size, t.size, t.rank)], result), t,
                      "reduce-scatter")
    c.run(flat, result, op=c.reduction)
    c.reduction.finalize(result, t.size)
    return shaped(result, out, shape)


@_in_issue_order(1)
def allgather(x, comm=None, *, algorithm="ring", out=None, validate: bool = True,
              **options) -> np.ndarray:
    """Gather every rank's ``x`` (same shape on every rank) on every rank.

    Returns an array of shape ``(p, *x.shape)``: row ``r`` is rank ``r``'s input
    (``.reshape(-1)`` gives the flat concatenation NCCL and MPI return). In place:
    pass ``x`` as row ``r`` of ``out``.
    """
    c = _Call(x, comm, "allgather", algorithm, options, validate)
    t, xp = c.t, c.xp
    with c.errors():
        flat = c.check(x)
        shape = (t.size, *xp.asarray(x).shape)
        result = flat_out(out, shape, flat.dtype, t, "allgather", xp)
        own_block = result[chunk_slice(result.size, t.size, t.rank)]
        check_overlap(flat, result, (flat, own_block), t, "allgather")
        if not (flat.size and xp.shares_memory(own_block, flat)):
            xp.copyto(own_block, flat)
    c.run(result)
    return shaped(result, out, shape)


@_in_issue_order(2)
def broadcast(x, root: int = 0, comm=None, *, algorithm="naive", out=None, validate: bool = True,
              **options) -> np.ndarray:
    """Return the root's ``x`` on every rank (``x`` must have the same shape everywhere).

    Non-root ranks' ``x`` gives only the shape and dtype; ``out=x`` overwrites it
    in place, as ``MPI_Bcast`` does.
    """
    c = _Call(x, comm, "broadcast", algorithm, options, validate)
    t, xp = c.t, c.xp
    with c.errors():
        flat = c.check(x, root=root)
        shape = xp.asarray(x).shape
        result = flat_out(out, shape, flat.dtype, t, "broadcast", xp)
        check_overlap(flat, result, (flat, result), t, "broadcast")
        if t.rank == root and not xp.shares_memory(result, flat):
            xp.copyto(result, flat)
    c.run(result, root=root)
    return shaped(result, out, shape)


@_in_issue_order(2)
def reduce(x, root: int = 0, comm=None, *, op="sum", algorithm="naive", out=None,
           validate: bool = True, **options) -> np.ndarray | None:
    """Reduce ``x`` over all ranks onto ``root``; return the result there, ``None`` elsewhere."""
    c = _Call(x, comm, "reduce", algorithm, options, validate)
    t, xp = c.t, c.xp
    with c.errors():
        flat = c.check(x, op=op, root=root)
        shape = xp.asarray(x).shape
        result = flat_out(out, shape, flat.dtype, t, "reduce", xp) if t.rank == root else None
        if result is not None:
            check_overlap(flat, result, (flat, result), t, "reduce")
    c.run(flat, result, op=c.reduction, root=root)
    if t.rank != root:
        return None
    c.reduction.finalize(result, t.size)
    return shaped(result, out, shape)


#: The collectives by name, for :func:`simulate` and the battery.
COLLECTIVE_FUNCTIONS = {
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
             node_size: int | None = None, calibration=None, moves_data: bool = True,
             **options) -> SimResult:
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
    when no ``ranks_per_node`` option is passed to it. ``moves_data=False`` runs it
    on a :class:`~refcoll.transport.ledger_only.LedgerWorld`: the same ledger with no
    data and no thread per rank (outputs are None; algorithms that split are
    refused), for thousands of ranks. ``calibration`` is the
    :class:`~refcoll.calls.auto.Calibration` ``algorithm="auto"`` resolves with
    (default :data:`~refcoll.calls.auto.DEFAULT`): pass the one an MPI job agreed on
    (``refcoll.calls.auto.calibration_for(transport)``) to predict that job's bits.

    Algorithms with ranks that hold no data (``switch``) get them added after
    the ``len(inputs)`` data ranks; the ledger shows their traffic too.
    """
    if collective not in COLLECTIVE_FUNCTIONS:
        raise UsageError(f"unknown collective {collective!r}: choose one of "
                         f"{', '.join(COLLECTIVE_FUNCTIONS)}")
    algorithms.implementation(algorithm, collective)
    if len(inputs) < 1:
        raise UsageError("simulate needs at least one rank's input")
    fn = COLLECTIVE_FUNCTIONS[collective]
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
    world = (SimWorld if moves_data else LedgerWorld)(
        len(args), timeout=timeout, record_payloads=record_payloads, ranks_per_node=node_size,
        calibration=calibration)
    outputs = world.run(lambda t, x: fn(x, comm=t, **kwargs), args)
    return SimResult(outputs[:workers], world.ledger, world)
