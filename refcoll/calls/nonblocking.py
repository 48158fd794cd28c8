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

from .. import algorithms
from ..core.ops import get_op
from .agree import disagreement, record_of, signature_of, signatures
from . import debug
from .args import argument_fields
from .auto import resolve
from .collectives import allgather, allreduce, as_transport, broadcast, reduce, reduce_scatter
from .prepared import Plan
from .progress import Handle, engine_for, wait_all

__all__ = ["iallreduce", "ireduce_scatter", "iallgather", "ibroadcast", "ireduce", "wait_all",
           "issue", "Handle", "NONBLOCKING_FUNCTIONS"]


def _issue(name: str, fn, x, comm, args: tuple, kwargs: dict) -> Handle:
    """Queue ``fn(x, *args, comm=t, **kwargs)`` on the engine of ``comm``'s transport."""
    t = as_transport(comm, name)
    engine = engine_for(t)
    job = None
    if engine.kind == "schedule" and name == "allreduce":
        job = scheduled(engine, t, x, kwargs)
    if job is None:
        def job():
            return fn(x, *args, comm=t, **kwargs)
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
    """Non-blocking :func:`refcoll.allreduce` (``MPI_Iallreduce``): same arguments, a handle back."""
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


class _Steps:
    """A recorded schedule run one step at a time: exchanges started, then tested, across calls."""

    def __init__(self, schedule):
        self.steps = schedule.steps
        self.index = 0
        self.started = False

    def advance(self) -> bool:
        """Run as far as possible without waiting; return whether every step is done."""
        steps = self.steps
        while self.index < len(steps):
            step = steps[self.index]
            if hasattr(step, "test"):  # an exchange: start it, then look again later
                if not self.started:
                    step.start()
                    self.started = True
                if not step.test():
                    return False
                self.started = False
            else:
                step()
            self.index += 1
        return True


class _Scheduled:
    """An all-reduce as a state machine: its recorded steps, started one at a time.

    The algorithm is recorded once per (algorithm, op, dtype, count) on buffers
    of its own (:class:`refcoll.calls.prepared.Plan`), as a prepared call's plan
    is. A validated run first steps through the blocking calls' signature
    exchange (:class:`refcoll.calls.agree.Signatures`, the transport's current
    one, taken when the run starts), so a rank that calls ``iallreduce`` meets a
    rank that calls ``allreduce`` in the same exchange; where the signatures
    differ it names the difference as the blocking call does
    (:func:`refcoll.calls.agree.disagreement`). Then it copies the input in,
    steps through the algorithm, and copies the result out. Each :meth:`step`
    goes as far as it can without waiting. The same exchanges and reductions in
    the same order on the same values as the blocking call: the same bits, and
    the same error when the ranks disagree.
    """

    def __init__(self, t, plan: Plan, x, out, reduction, algorithm, validate: bool):
        self.t, self.plan, self.x, self.out = t, plan, x, out
        self.reduction = reduction
        self.fields = argument_fields("allreduce", algorithm, reduction, x.reshape(-1), {})
        self.validate = validate
        self.exchange = None  # the signature exchange this run steps through
        self.stage = None
        self.result = None
        self.trace = None  # REFCOLL_DEBUG: begun at the first step, written at the last
        self.algorithm = algorithm

    def step(self) -> bool:
        """Advance as far as possible; return whether the all-reduce is complete."""
        t = self.t
        if self.stage is None:
            if debug.enabled():
                self.trace = debug.begin(t, "allreduce", debug.call_fields(
                    self.x, op=self.reduction, algorithm=self.algorithm,
                    validate=self.validate))
            if self.validate:
                self.exchange = signatures(t)
                self.signature = signature_of(record_of(self.fields))
                self.exchange.write(self.signature)
                self.stage = ("agree", _Steps(self.exchange.schedule))
            else:
                self.stage = ("data", self._start_data())
        kind, steps = self.stage
        if not steps.advance():
            return False
        if kind == "agree":
            if not self.exchange.uniform(self.signature):
                with t.call("allreduce"):  # the records travel as the blocking call's do
                    disagreement(t, self.fields)
            self.stage = ("data", self._start_data())
            if not self.stage[1].advance():
                return False
        out = self.out if self.out is not None else np.empty_like(self.x)
        np.copyto(out.reshape(-1), self.plan.out)
        self.reduction.finalize(out.reshape(-1), t.size)
        self.result = out
        if self.trace is not None:
            self.trace.end()
        return True

    def _start_data(self) -> _Steps:
        np.copyto(self.plan.x, self.x.reshape(-1))
        return _Steps(self.plan.schedule)


def scheduled(engine, t, x, kwargs: dict):
    """Return the job of an all-reduce for the schedule engine: a state machine where it can be.

    Only the plain case steps: a NumPy array, no compressor or options, an
    algorithm whose record says ``replayable``, a transport with persistent
    exchanges, and a call whose first run on this transport (whole, with every
    check) succeeded. Anything else returns None and runs whole when the engine
    reaches it.
    """
    algorithm = kwargs.get("algorithm", "ring")
    op = kwargs.get("op", "sum")
    out = kwargs.get("out")
    if (not isinstance(x, np.ndarray) or not hasattr(t, "persistent") or t.size < 2
            or set(kwargs) - {"algorithm", "op", "out", "validate"}
            or (out is not None and (out.shape != x.shape or out.dtype != x.dtype))):
        return None
    key = (algorithm, op, x.dtype, x.size)
    try:
        plan = engine.plans.get(key)
    except TypeError:  # an unhashable op: the whole call says what it needs
        return None
    if plan is None:
        if key not in engine.checked:
            def first():
                result = allreduce(x, comm=t, **kwargs)
                engine.checked.add(key)
                return result
            return first
        name = (resolve(t, "allreduce", x.size, x.dtype.itemsize)
                if algorithms.get(algorithm).chooses else algorithm)
        if not algorithms.get(name).replayable:
            return None
        reduction = get_op(op)
        plan = engine.plans[key] = (Plan(t, algorithms.implementation(name, "allreduce"),
                                         reduction, x.dtype, x.size), reduction)
    return _Scheduled(t, plan[0], x, out, plan[1], algorithm, kwargs.get("validate", True))
