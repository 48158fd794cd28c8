"""A collective agreed once, its algorithm chosen once, its schedule recorded once, run many times.

MPI-4's persistent collectives (``MPI_Allreduce_init``, ``MPI_Start``,
``MPI_Wait``) and NCCL's capture-then-replay under CUDA graphs, in Python::

    plan = refcoll.allreduce_init(grad, comm, algorithm="ring")   # every rank, together
    for step in range(steps):
        ...                                  # write this step's values into grad
        total = plan()                       # or: plan.start(); ...; total = plan.wait()
    plan.free()                              # or: with refcoll.allreduce_init(...) as plan:

Making a plan (collective) checks the arguments, agrees on them (unless
``validate=False``), chooses the algorithm (``auto`` resolves here, once) and,
where the transport has persistent exchanges (MPI) and the algorithm's record
says ``replayable``, records the all-reduce's schedule on the plan's buffers
(:mod:`refcoll.transport.recorder`): each exchange one set of persistent MPI
requests, each reduction a ufunc bound to its buffers. A run then starts those
requests and runs those reductions in order: the same bits as the algorithm,
and none of the call's Python layers. Elsewhere (the simulator,
``torch.distributed``, the other collectives, an algorithm that splits its
communicator) a run calls the algorithm again on the plan's buffers.

A run exchanges nothing but its data. What would break the plan's promise is
checked on each rank at every run, locally: a freed plan, a run already started,
a buffer whose shape or dtype changed in place, another buffer or communicator
passed in. A rank that finds
one refuses the run with a :class:`~refcoll.core.errors.UsageError` and, for a
validated plan, revokes the communicator's transport
(:meth:`~refcoll.transport.mpi.MPITransport.revoke`, the simulator's alike):
its peers, already in the run and waiting for its data, raise
:class:`~refcoll.core.errors.PeerFailure` naming it and the reason, in that
very run rather than at their deadline, and the transport refuses every later
exchange. With ``validate=False`` the rank at fault raises alone; its peers
wait for its next, corrected start, or until their deadline.

The blocking calls (:mod:`refcoll.calls.collectives`) keep nothing for the
next call: each checks, agrees, chooses and runs. Speed for repeated calls comes
only from a plan the caller holds.

Driven as MPI drives one: :meth:`Plan.start` queues the run on the
communicator's progress engine and :meth:`Plan.wait` that finds it not yet
taken runs it itself, inline (work stealing), so ``start()`` then ``wait()``
back to back costs what ``plan()`` costs, while compute between them lets the
engine run it.
"""

from __future__ import annotations

import numpy as np

from .. import algorithms
from ..core.errors import UsageError
from ..transport.base import transport_cache
from ..transport.recorder import compile_steps, record, run_steps
from . import debug
from .args import Call
from .progress import Handle, Steps, any_busy, busy_engine, engine_for

__all__ = ["Plan", "live_plans", "chosen", "replayable"]


class Plan:
    """One collective call, agreed, chosen and (where it can be) recorded: run it many times.

    Made by :func:`refcoll.allreduce_init` and its kin. ``plan()`` runs it now
    and returns the result; ``plan.start()`` runs it as a non-blocking call
    (in issue order with the communicator's others) and ``wait()`` / ``test()``
    complete it; ``free()`` releases its persistent requests.

    Attributes:
        collective: the call's name (``allreduce``...).
        algorithm: the algorithm it runs (``auto`` resolved).
        x: the input it reads at every run (the caller's array).
        out: the result it writes at every run (``out=`` or its own array;
            ``None`` on a ``reduce``'s non-roots and a switch rank).
        recorded: whether a run replays a recorded schedule (else the
            algorithm runs again).
        runs: how many runs have completed; freed: whether :meth:`free` has run.
        handle: the :class:`~refcoll.calls.progress.Handle` of the run last
            started with :meth:`start` (``None`` before, and once waited for).
    """

    def __init__(self, call: Call):
        t = self.t = call.t
        self.comm, self.collective, self.validate = call.comm, call.collective, call.validate
        self.reduction, self.root, self.options = call.reduction, call.root, call.options
        name, self.fn, options = chosen(call)
        self.algorithm = name
        self.fields = call.fields()
        self.call = call
        self.x, self.out = call.x, call.output()
        self._shapes = self._layout_now()
        self.runs = 0
        self.handle = None
        self._engine = None  # the engine its starts go to (found at the first)
        self.freed = False
        self._broken = None  # why a run failed partway (abandon)
        self._schedule = self._program = None
        self.recorded = (call.collective == "allreduce" and t.size > 1 and call.result is not None
                         and hasattr(t, "persistent") and replayable(t, name, options))
        if self.recorded:
            self._record()
        live_plans(t)[id(self)] = self

    def __repr__(self) -> str:
        state = "freed" if self.freed else ("started" if self.handle else "ready")
        return (f"<refcoll.Plan {self.collective} {self.algorithm} "
                f"{'recorded' if self.recorded else 'run'} {state}>")

    # ----------------------------------------------------------- the public use

    def __call__(self, x=None, *, out=None, comm=None):
        """Run the plan now and return its result (``MPI_Start`` then ``MPI_Wait``).

        ``x``, ``out`` and ``comm`` may be passed to say which buffers and
        communicator the caller means; each must be the plan's own (the same
        memory, shape and dtype), or the run is refused.
        """
        error = self._misuse(x, out, comm)
        engine = busy_engine(self.t) if any_busy() else None
        if engine is not None:  # non-blocking calls are outstanding: run behind them
            return engine.submit(Handle(self.collective, lambda: self._run(error), engine)).wait()
        if debug.enabled():
            return debug.traced(self.t, self.collective, self._trace_fields(),
                                lambda: self._run(error))
        return self._run(error)

    def start(self, x=None, *, out=None, comm=None) -> "Plan":
        """Start a non-blocking run (``MPI_Start``); return the plan.

        The run is queued on the communicator's progress engine, in issue order
        with its other calls. On the progress thread, a :meth:`wait` that finds
        it not yet taken runs it itself, inline: ``start()`` then ``wait()``
        back to back costs what ``plan()`` costs, and computation between them
        lets the thread run it meanwhile.

        :meth:`wait` or :meth:`test` completes it. The run's
        :class:`~refcoll.calls.progress.Handle` is :attr:`handle`, for
        :func:`refcoll.wait_all` and its time stamps; a run completed through it
        may be started again at once.
        """
        error = self._misuse(x, out, comm)
        engine = self._engine
        if engine is None:  # the communicator's engine, made on its first non-blocking call
            engine = self._engine = engine_for(self.t)
        if engine.kind == "schedule":
            job = Steps(self) if self._program is not None and error is None else (
                lambda: self._run(error))
            self.handle = engine.submit(Handle(self.collective, job, engine))
        else:  # queued for the thread; a wait() that finds it not yet taken runs it inline
            self.handle = engine.submit(Handle(self.collective, lambda: self._run(error), engine),
                                        defer=True)
        return self

    def wait(self, timeout: float | None = None):
        """Complete the started run and return its result (``MPI_Wait``); raise its error."""
        handle = self.handle
        if handle is None:
            raise UsageError(f"rank {self.t.rank}: wait() on a {self.collective} plan that was "
                             "not started: call start() first")
        try:
            result = handle.wait(timeout)
        except BaseException:
            if handle._done.is_set():
                self.handle = None  # the run failed: the plan may be started again
            raise
        self.handle = None
        return result

    def test(self) -> bool:
        """Return whether the started run has completed (a plan not started: True)."""
        return self.handle is None or self.handle.test()

    def free(self) -> None:
        """Release the persistent requests and the buffers; a later run is refused.

        A started run is waited for first (MPI frees an active request once it
        completes); freeing twice is allowed.
        """
        if self.freed:
            return
        if self.handle is not None:
            try:
                self.wait()
            except Exception:  # noqa: BLE001 - freeing releases; the failure was the run's
                pass
        self.freed = True
        self._forget()
        live_plans(self.t).pop(id(self), None)
        self.x = self.out = self.call = None

    def rebind(self, x, out=None) -> None:
        """Point the plan at other buffers of the same shapes and dtypes (this rank alone).

        For a caller whose buffer moves while its call stays the same, as a DDP
        bucket's does when PyTorch reallocates it: the ranks agreed on the
        call, not on addresses, and a recording's exchanges are this rank's own
        persistent requests, so recording them again on the new buffers is
        local. ``out=None`` keeps the in-place layout when the plan had it.
        """
        if self.freed or (self.handle is not None and not self.handle._done.is_set()):
            raise UsageError(f"rank {self.t.rank}: rebind() on a {self.collective} plan that is "
                             "freed or running")
        in_place = self.out is self.x
        out = x if out is None and in_place else out
        shapes = (x.shape, x.dtype) if out is None else (x.shape, x.dtype, out.shape, out.dtype)
        if shapes != self._shapes or self.collective != "allreduce":
            raise UsageError(f"rank {self.t.rank}: rebind() takes buffers of the plan's shapes "
                             f"and dtypes ({self._shapes}), for an all-reduce")
        call = self.call
        self.call = call.on(x.reshape(-1), out.reshape(-1) if out is not None else call.result)
        self.call.x, self.call.out = x, out
        self.x, self.out = x, self.call.output()
        self.renew()

    def __enter__(self) -> "Plan":
        return self

    def __exit__(self, *exc) -> None:  # the with block frees the plan, however it ends
        self.free()

    # ------------------------------------------------------------- the running

    def _run(self, error: str | None = None):
        """Run once, in the call's own tag space; return the result."""
        t, call = self.t, self.call
        if error:
            _refuse(t, error, tell=self.validate)
        try:
            with t.call(self.collective):
                if self._program is None:
                    call.prologue()
                    self.fn(t, *call.arguments(), **call.keywords())
                else:
                    run_steps(t, self._program)
        except BaseException:
            self.abandon()
            raise
        call.finish()
        self.runs += 1
        return self.out

    def abandon(self) -> None:
        """After a run that failed partway: never start its requests again (they may be running).

        A recorded plan refuses its later runs.
        """
        if self._program is not None:
            self._broken = (f"rank {self.t.rank}: run {self.runs + 1} of this {self.collective} "
                            "plan failed partway; its requests may still be running: make a "
                            "new plan")

    # ------------------------------------------------------- recording, checks

    def _record(self) -> None:
        """Record the all-reduce on the plan's buffers, in the transport's current tag slot."""
        self._schedule = record(self.t, self.fn, *self.call.arguments(), **self.call.keywords())
        self._program = compile_steps(self._schedule.steps)

    def renew(self) -> None:
        """Record again after every rank left the old persistent exchanges (a failed agreement)."""
        self._forget()
        if self.recorded:
            self._record()

    def _forget(self) -> None:
        if self._schedule is not None:
            self._schedule.free()
        self._schedule = self._program = None

    def _misuse(self, x, out, comm) -> str | None:
        """Return what breaks the plan's promise for this run, or None (refused at once if freed).
        """
        if self.handle is not None and self.handle._done.is_set():
            self.handle = None  # completed through its handle: nothing left to wait for
        if (x is None and out is None and comm is None and not self.freed
                and self.handle is None and self._broken is None
                and self._layout_now() == self._shapes):
            return None  # the common case, in a few attribute reads
        rank = self.t.rank
        if self._broken is not None:
            return self._broken
        if self.freed:  # its peers may be in the run already: tell them (_refuse)
            return (f"rank {rank}: this {self.collective} plan was freed; make a new one with "
                    f"refcoll.{self.collective}_init")
        if self.handle is not None:
            raise UsageError(f"rank {rank}: this {self.collective} plan is already started; "
                             "wait() for it before starting it again")
        if comm is not None and comm is not self.comm and comm is not self.t:
            return f"rank {rank}: this {self.collective} plan belongs to another communicator"
        for name, given, held in (("x", x, self.x), ("out", out, self.out)):
            if given is not None and not _same_buffer(given, held):
                return (f"rank {rank}: {name}= is not the buffer this {self.collective} plan "
                        "was made with; a plan runs on its own buffers: make a plan per buffer")
        now = self._layout_now()
        if now != self._shapes:
            name = "x" if now[:2] != self._shapes[:2] else "out"
            at = 0 if name == "x" else 2
            return (f"rank {rank}: {name} of this {self.collective} plan changed from shape "
                    f"{self._shapes[at]} {self._shapes[at + 1]} to shape {now[at]} {now[at + 1]} "
                    "since the plan was made; a plan runs on the buffers it was made with: make "
                    "a new plan")
        return None

    def _layout_now(self) -> tuple:
        """Return the shapes and dtypes of the plan's buffers as they are now."""
        x, out = self.x, self.out
        return (x.shape, x.dtype) if out is None else (x.shape, x.dtype, out.shape, out.dtype)

    def _trace_fields(self) -> dict:
        return debug.call_fields(self.x, op=self.reduction, algorithm=self.algorithm,
                                 root=self.root, options=self.options, validate=self.validate)


def _refuse(t, error: str, *, tell: bool) -> None:
    """Refuse a run on this rank alone; with ``tell``, revoke the transport so its peers know.

    A peer already in the run waits for this rank's data. Told (a validated
    plan, :meth:`~refcoll.transport.mpi.MPITransport.revoke`), it raises
    PeerFailure naming this rank and the reason in that very run, and the
    transport refuses every later exchange. Untold (``validate=False``), it
    waits: for this rank's next, corrected start, or until its deadline.
    """
    if tell and getattr(t, "revoke", None) is not None:
        t.revoke(error)
    raise UsageError(error)


def _same_buffer(a, b) -> bool:
    """Return whether ``a`` is ``b``'s very memory, shape and dtype."""
    return a is b or (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
                      and a.shape == b.shape and a.dtype == b.dtype
                      and a.__array_interface__["data"][0] == b.__array_interface__["data"][0])


# ------------------------------------------------------------ plans of a transport

def live_plans(t) -> dict:
    """Return ``t``'s plans not yet freed, in the order they were made (every rank's same order)."""
    return transport_cache(t, "plans").setdefault("live", {})


def chosen(call: Call) -> tuple:
    """Return the algorithm ``call`` runs, its implementation and options (:meth:`Call.chosen`)."""
    return call.chosen()


def replayable(t, name: str, options) -> bool:
    """Return whether ``name``'s all-reduce with ``options`` on ``t`` replays from a recording
    (its record's ``replayable``: a flag, or a function of the transport and options)."""
    flag = algorithms.get(name).replayable
    return flag(t, **(options or {})) if callable(flag) else bool(flag)
