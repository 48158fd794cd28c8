"""The public collectives, blocking and persistent: check, agree, choose, run.

Each blocking call reads top to bottom: it finds the transport, checks its
arguments on this rank (:func:`~refcoll.calls.args.checked`: the input as a flat
view, a copy only when it is not contiguous; ``out=`` or a new result), and
hands them to :func:`run`, which agrees on them with the other ranks (unless
``validate=False``), chooses the algorithm (``auto``) and runs it in the
transport's tag space for one call, then finishes ``avg``. It keeps nothing for
the next call. The input is never modified unless it is also ``out``.

Each ``*_init`` twin makes the same checks and returns a
:class:`~refcoll.calls.plans.Plan` instead: MPI-4's persistent collective,
agreed, chosen and recorded once, run many times.

:func:`simulate` runs one collective on many simulated ranks in this process,
with its ledger: the same algorithm code as under MPI, so its outputs are, bit
for bit, what a real run must return.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .. import algorithms
from ..algorithms._util import is_count
from ..core.errors import MismatchError, UsageError
from ..core.xp import array_namespace, is_device_array, on_callers_device
from ..transport.base import Ledger, TransportBase
from ..transport.device import device_transport
from ..transport.ledger_only import LedgerWorld
from ..transport.mpi import transport_for
from ..transport.sim import SimWorld
from ..transport.torch import is_process_group, torch_transport_for
from . import debug, progress
from .agree import agree
from .args import Call, checked, shared_errors
from .plans import Plan
from .progress import Handle, busy_engine

__all__ = [
    "allreduce",
    "reduce_scatter",
    "allgather",
    "broadcast",
    "reduce",
    "allreduce_init",
    "reduce_scatter_init",
    "allgather_init",
    "broadcast_init",
    "reduce_init",
    "Plan",
    "as_transport",
    "device_for",
    "run",
    "COLLECTIVE_FUNCTIONS",
    "INIT_FUNCTIONS",
    "simulate",
    "SimResult",
]

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
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and comm.__class__ is mpi.Intracomm:  # the usual case, first
        return transport_for(comm, collective)
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


#: What a rank's first call on device memory agrees on before the path: a rank whose call
#: is on host memory meets it in its own argument agreement, and every rank raises.
FIRST_DEVICE_CALL = "a collective on device memory"


def _every_rank_aware(t, aware: bool) -> bool:
    with t.call(FIRST_DEVICE_CALL):
        agree(t, collective=FIRST_DEVICE_CALL)
    return bool(allreduce(np.array([int(aware)], np.int8), t, op="min", algorithm="ring",
                          validate=False)[0])


def _is_intracomm(comm) -> bool:
    """Return whether ``comm`` is an mpi4py intracommunicator (imports mpi4py only if loaded)."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and isinstance(comm, mpi.Intracomm)


def in_issue_order(comm_at: int):
    """Make a collective queue behind the non-blocking calls outstanding on its comm.

    MPI orders a communicator's blocking and non-blocking collectives alike, in
    issue order: a blocking call made while ``iallreduce``s are running on the
    same communicator runs after them, on their engine, and is waited for. When no
    engine anywhere has work (the usual case) this costs one integer test; when
    tracing is off (its setting read), one more. ``comm_at``: the position of the
    ``comm`` argument.
    """
    busy, tracing_on = progress.BUSY, debug.ON  # the flags, read in place: no call

    def wrap(fn):
        traced = debug.tracing(fn, comm_at, as_transport)  # REFCOLL_DEBUG=INFO: a line per call
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if busy[0]:
                positional = "comm" not in kwargs and len(args) > comm_at
                comm = args[comm_at] if positional else kwargs.get("comm")
                t = as_transport(comm, fn.__name__)
                engine = busy_engine(t)
                if engine is not None:
                    if positional:
                        args = (*args[:comm_at], t, *args[comm_at + 1:])
                    else:
                        kwargs["comm"] = t
                    job = on_callers_device(functools.partial(traced, *args, **kwargs),
                                            args[0] if args else kwargs.get("x"))
                    return engine.submit(Handle(fn.__name__, job, engine)).wait()
            on = tracing_on[0]
            if on or (on is None and debug.enabled()):
                return traced(*args, **kwargs)
            return fn(*args, **kwargs)
        return call
    return wrap


def _call(collective: str, x, comm, *, op=None, root=None, algorithm, out, validate, options):
    """Find the transport that carries ``x`` over ``comm`` and check the call's arguments there."""
    t = as_transport(comm, collective)
    if x.__class__ is not np.ndarray and is_device_array(x):  # it may travel another way
        t = device_for(t, x)  # (anything else, None too, is judged by checked, every rank)
    return checked(t, comm, collective, x, op=op, root=root, algorithm=algorithm, out=out,
                   validate=validate, options=options)


def run(call: Call, implementation=None):
    """Run one blocking call: agree on it (unless ``validate=False``), choose, run; return output.

    ``implementation``: run it instead of the algorithm's (calibration times the
    call layer around an algorithm that does nothing). Nothing is kept for the
    next call.
    """
    t = call.t
    with t.call(call.collective):
        if call.validate:
            call.agree()
        _, fn, _ = call.chosen()
        call.prologue()
        (implementation or fn)(t, *call.arguments(), **call.keywords())
    call.finish()
    return call.output()


def _init(call) -> Plan:
    """Make a plan of ``call``: agree on it once (unless ``validate=False``), choose, record.

    A plan runs on the input's own memory (``MPI_Allreduce_init``'s buffers), so an
    input the call would copy (not C-contiguous) is refused, on every rank.
    """
    with shared_errors(call.t, call.validate, call.collective):
        if not call.x.flags.c_contiguous:
            raise ValueError(f"rank {call.t.rank}: a plan runs on the input's own memory, and "
                             "this one is not C-contiguous (a strided view or Fortran order), "
                             "so each run would see a stale copy; pass "
                             "np.ascontiguousarray(x) and write into that")
    with call.t.call(call.collective):
        if call.validate:  # as "allreduce_init": a plan made here never matches another call there
            agree(call.t, **dict(call.fields(), collective=f"{call.collective}_init"))
        return Plan(call)


@in_issue_order(1)
def allreduce(x, comm=None, *, op="sum", algorithm="ring", out=None, validate: bool = True,
              **options) -> np.ndarray:
    """Reduce ``x`` elementwise over all ranks; every rank gets the bitwise-same result.

    Args:
        x: this rank's array (any shape; reduced elementwise, shape kept).
        comm: an mpi4py communicator or a Transport; ``None``: ``MPI.COMM_WORLD``.
        op: ``sum``, ``prod``, ``min``, ``max`` or ``avg`` (see :mod:`refcoll.core.ops`),
            or mpi4py's ``MPI.SUM``, ``MPI.PROD``, ``MPI.MIN``, ``MPI.MAX``.
        algorithm: a name from ``refcoll list``.
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

    A loop that all-reduces the same arrays again and again is faster as a plan
    (:func:`allreduce_init`). Compression is its own entry, as PyTorch keeps it in
    comm hooks: :func:`refcoll.compressed_allreduce`.

    Example:
        >>> y = refcoll.allreduce(np.arange(4.0), comm, algorithm="ring")  # doctest: +SKIP
    """
    if "compressor" in options or "state" in options:
        raise UsageError("allreduce takes no compressor: call refcoll.compressed_allreduce(x, "
                         "comm, compressor=..., state=...), which returns the result and "
                         "this rank's traffic")
    return run(_call("allreduce", x, comm, op=op, algorithm=algorithm, out=out,
                           validate=validate, options=options))


@in_issue_order(1)
def reduce_scatter(x, comm=None, *, op="sum", algorithm="ring", out=None, validate: bool = True,
                   **options) -> np.ndarray:
    """Reduce ``x`` over all ranks and give rank ``r`` chunk ``r`` of the result.

    ``x`` is flattened; its ``n`` elements are cut into ``p`` chunks by
    :func:`refcoll.core.chunking.chunk_bounds` (the first ``n % p`` chunks one element
    longer), so ``n`` need not divide by ``p``. Returns a 1-D array. In place:
    pass ``out=`` a view of ``x`` at chunk ``r`` (as NCCL's in-place reduce-scatter).
    """
    return run(_call("reduce_scatter", x, comm, op=op, algorithm=algorithm, out=out,
                           validate=validate, options=options))


@in_issue_order(1)
def allgather(x, comm=None, *, algorithm="ring", out=None, validate: bool = True,
              **options) -> np.ndarray:
    """Gather every rank's ``x`` (same shape on every rank) on every rank.

    Returns an array of shape ``(p, *x.shape)``: row ``r`` is rank ``r``'s input
    (``.reshape(-1)`` gives the flat concatenation NCCL and MPI return). In place:
    pass ``x`` as row ``r`` of ``out``.
    """
    return run(_call("allgather", x, comm, algorithm=algorithm, out=out, validate=validate,
                           options=options))


@in_issue_order(2)
def broadcast(x, root: int = 0, comm=None, *, algorithm="naive", out=None, validate: bool = True,
              **options) -> np.ndarray:
    """Return the root's ``x`` on every rank (``x`` must have the same shape everywhere).

    Non-root ranks' ``x`` gives only the shape and dtype; ``out=x`` overwrites it
    in place, as ``MPI_Bcast`` does.
    """
    return run(_call("broadcast", x, comm, root=root, algorithm=algorithm, out=out,
                           validate=validate, options=options))


@in_issue_order(2)
def reduce(x, root: int = 0, comm=None, *, op="sum", algorithm="naive", out=None,
           validate: bool = True, **options) -> np.ndarray | None:
    """Reduce ``x`` over all ranks onto ``root``; return the result there, ``None`` elsewhere."""
    return run(_call("reduce", x, comm, op=op, root=root, algorithm=algorithm, out=out,
                           validate=validate, options=options))


# ------------------------------------------------------------ persistent collectives

@in_issue_order(1)
def allreduce_init(x, comm=None, *, op="sum", algorithm="ring", out=None, validate: bool = True,
                   **options) -> Plan:
    """Make a persistent all-reduce of ``x`` into ``out`` (``MPI_Allreduce_init``): collective.

    Every rank calls it together. The ranks agree on the arguments here, once
    (unless ``validate=False``), ``auto`` chooses here, and on MPI the
    algorithm's schedule is recorded on ``x`` and ``out`` (a new array when not
    given: ``plan.out``). Then each ``plan()`` (or ``plan.start()`` and
    ``plan.wait()``) all-reduces what ``x`` holds at that moment, with the bits
    :func:`allreduce` would give; ``plan.free()`` (or a ``with`` block)
    releases it. The arguments are :func:`allreduce`'s (no ``compressor``).
    See :class:`~refcoll.calls.plans.Plan` for what a run refuses.
    """
    return _init(_call("allreduce", x, comm, op=op, algorithm=algorithm, out=out,
                       validate=validate, options=options))


@in_issue_order(1)
def reduce_scatter_init(x, comm=None, *, op="sum", algorithm="ring", out=None,
                        validate: bool = True, **options) -> Plan:
    """Make a persistent :func:`reduce_scatter` (``MPI_Reduce_scatter_block_init``): collective."""
    return _init(_call("reduce_scatter", x, comm, op=op, algorithm=algorithm, out=out,
                       validate=validate, options=options))


@in_issue_order(1)
def allgather_init(x, comm=None, *, algorithm="ring", out=None, validate: bool = True,
                   **options) -> Plan:
    """Make a persistent :func:`allgather` (``MPI_Allgather_init``): collective."""
    return _init(_call("allgather", x, comm, algorithm=algorithm, out=out, validate=validate,
                       options=options))


@in_issue_order(2)
def broadcast_init(x, root: int = 0, comm=None, *, algorithm="naive", out=None,
                   validate: bool = True, **options) -> Plan:
    """Make a persistent :func:`broadcast` (``MPI_Bcast_init``): collective."""
    return _init(_call("broadcast", x, comm, root=root, algorithm=algorithm, out=out,
                       validate=validate, options=options))


@in_issue_order(2)
def reduce_init(x, root: int = 0, comm=None, *, op="sum", algorithm="naive", out=None,
                validate: bool = True, **options) -> Plan:
    """Make a persistent :func:`reduce` (``MPI_Reduce_init``): collective."""
    return _init(_call("reduce", x, comm, op=op, root=root, algorithm=algorithm, out=out,
                       validate=validate, options=options))


#: The collectives by name, for :func:`simulate` and the battery.
COLLECTIVE_FUNCTIONS = {
    "allreduce": allreduce,
    "reduce_scatter": reduce_scatter,
    "allgather": allgather,
    "broadcast": broadcast,
    "reduce": reduce,
}

#: Their persistent twins by the same names.
INIT_FUNCTIONS = {
    "allreduce": allreduce_init,
    "reduce_scatter": reduce_scatter_init,
    "allgather": allgather_init,
    "broadcast": broadcast_init,
    "reduce": reduce_init,
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


def _check_world(node_size, timeout) -> None:
    """Refuse a node size or a timeout no simulated world can have."""
    if node_size is not None and (not is_count(node_size) or node_size < 1):
        raise UsageError(f"node_size must be a whole number of ranks >= 1 (or None: one "
                         f"node), got {node_size!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(
            timeout, (int, float, np.integer, np.floating)) or not timeout > 0):
        raise UsageError(f"timeout must be seconds > 0 (or None: REFCOLL_TIMEOUT's, if set, "
                         f"else none), got {timeout!r}")


def _same_dtypes(inputs: Sequence) -> None:
    """Raise the MismatchError a validated call raises where the ranks' dtypes differ (of
    the arrays the calls make of lists and scalars, too)."""
    dtypes = [x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype for x in inputs]
    if any(d != dtypes[0] for d in dtypes):
        raise MismatchError("dtype: " + ", ".join(f"rank {r} has {d}"
                                                  for r, d in enumerate(dtypes)))


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
    if "out" in options:  # one buffer would be every simulated rank's
        raise UsageError("simulate returns each rank's output (SimResult.outputs); it takes "
                         "no out=")
    _check_world(node_size, timeout)
    fn = COLLECTIVE_FUNCTIONS[collective]
    # The ledger should show the algorithm's messages only, so argument agreement
    # (one small allgather) is off unless asked for.
    kwargs = dict(options, algorithm=algorithm)
    kwargs.setdefault("validate", False)
    if kwargs["validate"] and not moves_data:
        raise UsageError("simulate(validate=True, moves_data=False): the argument agreement "
                         "reads what the ranks send, and a ledger-only world sends no data; "
                         "drop one of them")
    if not kwargs["validate"]:  # every input is here: the dtypes a real call agrees on
        _same_dtypes(inputs)
    if collective not in ("allgather", "broadcast"):
        kwargs["op"] = op
    algo = algorithms.get(algorithm)
    workers = len(inputs)
    args = [(x,) for x in inputs]
    if algo.extra_ranks is not None:  # ranks that hold no data get a template of the buffer
        template = array_namespace(inputs[0]).zeros_like(inputs[0])
        own = algorithms.options(algorithm, collective)  # (not validate=, root=...)
        args += [(template,)] * algo.extra_ranks(
            workers, **{k: v for k, v in options.items() if k in own})
    world = (SimWorld if moves_data else LedgerWorld)(
        len(args), timeout=timeout, record_payloads=record_payloads, ranks_per_node=node_size,
        calibration=calibration)
    outputs = world.run(lambda t, x: fn(x, comm=t, **kwargs), args)
    return SimResult(outputs[:workers], world.ledger, world)
