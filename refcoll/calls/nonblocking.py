"""The non-blocking collectives: ``iallreduce`` and its kin, each returning a :class:`Handle`.

    h = refcoll.iallreduce(grad, comm, algorithm="ring")
    ...                      # compute: the call progresses meanwhile
    grad_sum = h.wait()      # bit-identical to refcoll.allreduce(grad, comm, algorithm="ring")

Each takes exactly the blocking call's arguments (a compressed all-reduce is
:func:`refcoll.compressed_allreduce`'s, blocking, or a DDP hook's) and returns at
once, after finding the communicator's transport (its first call
``MPI_Comm_idup``s, in the caller's thread and order). The call itself
runs on the communicator's progress engine (:mod:`refcoll.calls.progress`), in
issue order: on the schedule engine each runs whole, as the blocking call it is,
when the engine reaches it (a plan's :meth:`~refcoll.calls.plans.Plan.start`
steps through its recorded exchanges instead). MPI's buffer rule holds: the
input must not change, and the output must not be read, until the handle
completes.
"""

from __future__ import annotations

from ..core.xp import on_callers_device
from .collectives import allgather, allreduce, as_transport, broadcast, reduce, reduce_scatter
from .progress import Handle, engine_for, wait_all

__all__ = ["iallreduce", "ireduce_scatter", "iallgather", "ibroadcast", "ireduce", "wait_all",
           "issue", "Handle", "NONBLOCKING_FUNCTIONS"]


def _issue(name: str, fn, x, comm, args: tuple, kwargs: dict) -> Handle:
    """Queue ``fn(x, *args, comm=t, **kwargs)`` on the engine of ``comm``'s transport."""
    t = as_transport(comm, name)
    engine = engine_for(t)

    def job():
        return fn(x, *args, comm=t, **kwargs)

    return engine.submit(Handle(name, on_callers_device(job, x), engine))


def issue(name: str, comm, job) -> Handle:
    """Run ``job(t)`` as one non-blocking call on ``comm``'s engine, in issue order; its handle.

    For a caller whose call is more than one collective, as the Reducer's bucket
    is (divide in place, then all-reduce): ``job`` gets the communicator's
    transport and must make the same collective calls on every rank. What it
    returns is the handle's result.
    """
    t = as_transport(comm, name)
    engine = engine_for(t)
    return engine.submit(Handle(name, lambda: job(t), engine))


def iallreduce(x, comm=None, **kwargs) -> Handle:
    """Non-blocking :func:`refcoll.allreduce` (``MPI_Iallreduce``): its arguments, a handle back."""
    return _issue("allreduce", allreduce, x, comm, (), kwargs)


def ireduce_scatter(x, comm=None, **kwargs) -> Handle:
    """Non-blocking :func:`refcoll.reduce_scatter` (``MPI_Ireduce_scatter_block``)."""
    return _issue("reduce_scatter", reduce_scatter, x, comm, (), kwargs)


def iallgather(x, comm=None, **kwargs) -> Handle:
    """Non-blocking :func:`refcoll.allgather` (``MPI_Iallgather``)."""
    return _issue("allgather", allgather, x, comm, (), kwargs)


def ibroadcast(x, root: int = 0, comm=None, **kwargs) -> Handle:
    """Non-blocking :func:`refcoll.broadcast` (``MPI_Ibcast``)."""
    return _issue("broadcast", broadcast, x, comm, (root,), kwargs)


def ireduce(x, root: int = 0, comm=None, **kwargs) -> Handle:
    """Non-blocking :func:`refcoll.reduce` (``MPI_Ireduce``)."""
    return _issue("reduce", reduce, x, comm, (root,), kwargs)


#: The non-blocking collectives by the name of the blocking one, for the battery.
NONBLOCKING_FUNCTIONS = {
    "allreduce": iallreduce,
    "reduce_scatter": ireduce_scatter,
    "allgather": iallgather,
    "broadcast": ibroadcast,
    "reduce": ireduce,
}
