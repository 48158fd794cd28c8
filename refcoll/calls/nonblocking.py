"""The non-blocking collectives: ``iallreduce`` and its kin, each returning a :class:`Handle`.

    h = refcoll.iallreduce(grad, comm, algorithm="ring")
    ...                      # compute: the call progresses meanwhile
    grad_sum = h.wait()      # bit-identical to refcoll.allreduce(grad, comm, algorithm="ring")

Each takes exactly the blocking call's arguments (the compressed all-reduce
included) and returns at once, after finding the communicator's transport (its
first call ``MPI_Comm_idup``s, in the caller's thread and order). The call itself
runs on the communicator's progress engine (:mod:`refcoll.calls.progress`), in
issue order. MPI's buffer rule holds: the input must not change, and the output
must not be read, until the handle completes.
"""

from __future__ import annotations

import numpy as np

from ..core.ops import get_op
from .args import Call
from .collectives import allgather, allreduce, as_transport, broadcast, reduce, reduce_scatter
from .plans import kept
from .progress import Handle, Steps, engine_for, wait_all

__all__ = ["iallreduce", "ireduce_scatter", "iallgather", "ibroadcast", "ireduce", "wait_all",
           "issue", "Handle", "NONBLOCKING_FUNCTIONS"]


def _issue(name: str, fn, x, comm, args: tuple, kwargs: dict) -> Handle:
    """Queue ``fn(x, *args, comm=t, **kwargs)`` on the engine of ``comm``'s transport."""
    t = as_transport(comm, name)
    engine = engine_for(t)

    def job():
        return fn(x, *args, comm=t, **kwargs)

    if engine.kind == "schedule" and name == "allreduce":
        job = scheduled(t, x, kwargs, job) or job
    return engine.submit(Handle(name, job, engine))


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


class _Planned:
    """An ``iallreduce`` for the schedule engine: its kept plan's steps, one exchange at a time.

    The plan is fetched when the call starts (an earlier call in the queue may
    have made or dropped it); without one the call runs whole, as the blocking
    call it is.
    """

    def __init__(self, t, key, caller: Call, whole):
        self.t, self.key, self.caller, self.whole = t, key, caller, whole
        self.steps = None
        self.result = None

    def step(self) -> bool:
        """Advance as far as possible without waiting; return whether the call is complete."""
        if self.steps is None:
            plan = kept(self.t, self.key)
            if plan is None:
                self.result = self.whole()
                return True
            self.steps = Steps(plan, self.caller)
        if not self.steps.step():
            return False
        self.result = self.steps.result
        return True


def scheduled(t, x, kwargs: dict, whole):
    """Return the job of an ``iallreduce`` for the schedule engine: a state machine where it can be.

    Only the plain case steps: a contiguous NumPy array, no compressor or
    options, ``out=`` absent or of ``x``'s shape and dtype, and arguments whose
    blocking call keeps a plan (:func:`refcoll.calls.plans.run`: the same
    arguments came twice, checked in full then). Anything else returns None and
    runs whole, as the blocking call, when the engine reaches it.
    """
    algorithm = kwargs.get("algorithm", "ring")
    out = kwargs.get("out")
    if (not isinstance(x, np.ndarray) or not x.flags.c_contiguous or not hasattr(t, "persistent")
            or t.size < 2 or set(kwargs) - {"algorithm", "op", "out", "validate"}
            or (out is not None and (type(out) is not np.ndarray or out.shape != x.shape
                                     or out.dtype != x.dtype or not out.flags.c_contiguous))):
        return None
    try:
        reduction = get_op(kwargs.get("op", "sum"))
        key = (algorithm, reduction.name, x.dtype, x.size)
        if kept(t, key) is None:
            return None
    except Exception:  # noqa: BLE001 - the whole call names what is wrong with its arguments
        return None
    flat = x.reshape(-1)
    result = np.empty_like(flat) if out is None else out.reshape(-1)
    caller = Call(t, t, "allreduce", algorithm, {}, kwargs.get("validate", True), reduction, 0, x,
                  flat, result, out, x.shape, t.size, key)
    return _Planned(t, key, caller, whole)
