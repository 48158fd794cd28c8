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

Driven as MPI drives one: a recording whose exchanges are all small starts on
the caller's thread, as ``MPI_Start`` does (:class:`InFlight`): its first
exchange goes out, the MPI library moves it, and :meth:`Plan.wait` runs the
rest. Any other run is queued on the communicator's progress engine, and a
:meth:`Plan.wait` that finds it not yet taken runs it itself, inline (work
stealing); compute between them lets the engine run it.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from .. import algorithms
from ..core.errors import UsageError
from ..core.xp import address, array_namespace, on_callers_device
from ..transport.base import transport_cache
from ..transport.mpi import cached_transport
from ..transport.recorder import compile_steps, done, exchanges, landed, record, run_steps, start
from . import debug
from .args import Call, check_overlap
from .progress import (
    BUSY,
    Handle,
    Steps,
    any_busy,
    busy_engine,
    engine_for,
    in_flight,
    not_done,
    tell_idle,
)

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
            started with :meth:`start` (``None`` before, and once waited for);
            a run started in place makes its handle when first asked.
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
        self._started = None  # the run start() began: its Handle, or an InFlight
        self._lock = threading.Lock()  # held by whoever runs an InFlight's steps
        self._engine = None  # the engine its starts go to (found at the first)
        self._slots = transport_cache(t, "progress")  # where a run started in place is noted
        self.freed = False
        self._broken = None  # why a run failed partway (abandon)
        self._schedule = self._program = None
        self._meter = None  # the recording's traffic: its completed runs (Traffic.meter)
        self._small = False  # a recording of small exchanges only (InFlight)
        self._divides = call.reduction is not None and call.reduction.divides
        # Its own tag slot, where the transport has them (MPI): two plans started in
        # different orders on different ranks then wait for their own messages, up to
        # the deadline, instead of taking each other's data.
        slot_of = getattr(t, "next_plan_slot", None)
        self._slot = slot_of() if slot_of is not None else None
        self.recorded = (call.collective == "allreduce" and t.size > 1 and call.result is not None
                         and hasattr(t, "persistent") and replayable(t, name, options))
        self._own_tags = self._slot is not None and not self.recorded  # the run's, not its record's
        if self.recorded:
            self._record()
        live_plans(t)[id(self)] = self

    def __repr__(self) -> str:
        state = "freed" if self.freed else ("started" if self._started else "ready")
        return (f"<refcoll.Plan {self.collective} {self.algorithm} "
                f"{'recorded' if self.recorded else 'run'} {state}>")

    # ----------------------------------------------------------- the public use

    def __call__(self, x=None, *, out=None, comm=None):
        """Run the plan now and return its result (``MPI_Start`` then ``MPI_Wait``).

        ``x``, ``out`` and ``comm`` may be passed to say which buffers and
        communicator the caller means; each must be the plan's own (the same
        memory, shape and dtype), or the run is refused.
        """
        if self._program is not None and self._plain(x, out, comm):
            return self._run()  # the common case: a recording, nothing else outstanding
        error = self._misuse(x, out, comm)
        engine = busy_engine(self.t) if any_busy() else None
        if engine is not None:  # non-blocking calls are outstanding: run behind them
            job = on_callers_device(lambda: self._run(error), self.x)
            return engine.submit(Handle(self.collective, job, engine)).wait()
        if debug.enabled():
            return debug.traced(self.t, self.collective, self._trace_fields(),
                                lambda: self._run(error))
        return self._run(error)

    def start(self, x=None, *, out=None, comm=None) -> "Plan":
        """Start a non-blocking run (``MPI_Start``); return the plan.

        A recording of small exchanges, started when nothing else is
        outstanding, starts here, on the caller's thread (:class:`InFlight`):
        its first exchange goes out and the start returns. Any other run is
        queued on the communicator's progress engine, in issue order with its
        other calls; on the progress thread, a :meth:`wait` that finds it not
        yet taken runs it itself, inline, and computation between them lets
        the thread run it meanwhile. A start never waits for the peers.

        :meth:`wait` or :meth:`test` completes it. The run's
        :class:`~refcoll.calls.progress.Handle` is :attr:`handle`, for
        :func:`refcoll.wait_all` and its time stamps; a run completed through it
        may be started again at once.
        """
        if self._small and self._plain(x, out, comm):
            self._started = InFlight(self)  # MPI_Start's way: no thread needed
            return self
        error = self._misuse(x, out, comm)
        engine = self._engine
        if engine is None:  # the communicator's engine, made on its first non-blocking call
            engine = self._engine = engine_for(self.t)
        run = on_callers_device(lambda: self._run(error), self.x)  # maybe on another thread
        if engine.kind == "schedule":
            job = Steps(self) if self._program is not None and error is None else run
            self._started = engine.submit(Handle(self.collective, job, engine))
        else:  # queued for the thread; a wait() that finds it not yet taken runs it inline
            self._started = engine.submit(Handle(self.collective, run, engine), defer=True)
        return self

    @property
    def handle(self) -> Handle | None:
        """The :class:`~refcoll.calls.progress.Handle` of the run :meth:`start` began (or None)."""
        run = self._started
        return run.handle if run.__class__ is InFlight else run

    def wait(self, timeout: float | None = None):
        """Complete the started run and return its result (``MPI_Wait``); raise its error."""
        run = self._started
        if run is None:
            raise UsageError(f"rank {self.t.rank}: wait() on a {self.collective} plan that was "
                             "not started: call start() first")
        if run.__class__ is InFlight and timeout is None:  # started in place: finish it here
            if not run.done:
                with self._lock:
                    run.go(wait=True)
            self._started = None
            if run.error is not None:
                raise run.error
            return run.out  # the buffer it ran into (a rebind() since may point elsewhere)
        handle = self.handle
        try:
            result = handle.wait(timeout)
        except BaseException:
            if handle._done.is_set():
                self._started = None  # the run failed: the plan may be started again
            raise
        self._started = None
        return result

    def test(self) -> bool:
        """Return whether the started run has completed (a plan not started: True)."""
        run = self._started
        if run.__class__ is InFlight:
            run.advance()
            run.seen = run.seen or run.done
            return run.done
        return run is None or run.test()

    def free(self) -> None:
        """Release the persistent requests and the buffers; a later run is refused.

        A started run is waited for first (MPI frees an active request once it
        completes); freeing twice is allowed.
        """
        if self.freed:
            return
        if self._started is not None:
            try:
                self.wait()
            except Exception:  # noqa: BLE001 - the run's own failure: freeing releases
                if self._started is not None:  # not the run's: the wait was refused (a done
                    raise  # callback of the same engine), and the run goes on: keep it whole
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
        if self.freed or (self._started is not None and not _completed(self._started)):
            raise UsageError(f"rank {self.t.rank}: rebind() on a {self.collective} plan that is "
                             "freed or running")
        in_place = self.out is self.x
        out = x if out is None and in_place else out
        shapes = (x.shape, x.dtype) if out is None else (x.shape, x.dtype, out.shape, out.dtype)
        if shapes != self._shapes or self.collective != "allreduce":
            raise UsageError(f"rank {self.t.rank}: rebind() takes buffers of the plan's shapes "
                             f"and dtypes ({self._shapes}), for an all-reduce")
        # The checks the call made of the first buffers: the plan runs on their memory.
        for name, buf, written in (("x", x, out is x), ("out", out, True)):
            if buf is not None and not (buf.flags.c_contiguous
                                        and (buf.flags.writeable or not written)):
                raise UsageError(f"rank {self.t.rank}: rebind() needs a C-contiguous {name}"
                                 f"{' it can write' if written else ''}: the plan runs on its "
                                 "memory")
        if out is not None and out is not x:
            check_overlap(x.reshape(-1), out.reshape(-1), (x, out), self.t, "all-reduce")
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
        t = self.t
        if error:
            _refuse(t, error, tell=self.validate)
        t.enter_call(self.collective, t.plan_tags(self._slot) if self._own_tags else None)
        try:
            if self._program is None:
                call = self.call
                call.prologue()
                self.fn(t, *call.arguments(), **call.keywords())
            else:
                run_steps(t, self._program)
        except BaseException as exc:
            self.abandon()
            if getattr(t, "comm", True) is None:  # MPI refused the requests of a freed comm
                raise UsageError(self._broken) from exc
            raise
        finally:
            t.leave_call()
        if self._divides:
            self.call.finish()
        if self._meter is not None:
            self._meter.runs += 1
        self.runs += 1
        return self.out

    def abandon(self) -> None:
        """After a run that failed partway: never run it again (its messages may be in flight).

        A plan with its own tags (recorded, or on MPI) refuses its later runs, and
        revokes its transport: the run's messages still in flight carry the plan's
        tags, so its next run, or a plan that comes to share its slot, could take them
        as its own data. Its peers learn it at their next wait (``PeerFailure``);
        ``comm.Dup()`` gives a fresh communicator.
        """
        if getattr(self.t, "comm", True) is None:  # the communicator itself was freed
            self._broken = _freed(self)
        elif self._program is not None or self._own_tags:
            self._broken = (f"rank {self.t.rank}: run {self.runs + 1} of this {self.collective} "
                            "plan failed partway; its messages may still be in flight: make a "
                            "new plan on a fresh communicator (comm.Dup())")
            revoke = getattr(self.t, "revoke", None)
            if revoke is not None:
                revoke(f"rank {self.t.rank}: run {self.runs + 1} of a {self.collective} plan "
                       "failed partway, leaving messages in flight")

    # ------------------------------------------------------- recording, checks

    def _record(self) -> None:
        """Record the all-reduce on the plan's buffers, in the plan's tag slot of the current
        epoch."""
        self._schedule = record(self.t, self.fn, *self.call.arguments(), slot=self._slot or 0,
                                **self.call.keywords())
        self._program = compile_steps(self._schedule.steps)
        moved = exchanges(self._program)
        self._meter = self.t.traffic.meter(moved)
        self._small = all(max(sent, received) <= IN_FLIGHT_BYTES for sent, received in moved)

    def renew(self) -> None:
        """Record again after every rank left the old persistent exchanges (a failed agreement)."""
        self._forget()
        if self.recorded:
            self._record()

    def _forget(self) -> None:
        if self._schedule is not None:
            self._schedule.free()
        if self._meter is not None:
            self.t.traffic.release(self._meter)
        self._schedule = self._program = self._meter = None
        self._small = False

    def _plain(self, x, out, comm) -> bool:
        """Return whether this run is the common case: the plan's own buffers as they were
        made, no run of its own outstanding, no engine busy, no tracing, its communicator
        not freed (else :meth:`_misuse`)."""
        if (x is not None or out is not None or comm is not None or self._started is not None
                or BUSY[0] or self._broken is not None):
            return False
        tracing = debug.ON[0]
        if tracing is not False and (tracing is not None or debug.enabled()):
            return False
        # _layout_now's test, inline (every run asks); a dtype is most often the same object
        x, out, shapes = self.x, self.out, self._shapes
        return (x.shape == shapes[0] and (x.dtype is shapes[1] or x.dtype == shapes[1])
                and (out is None or out is x
                     or (out.shape == shapes[2] and (out.dtype is shapes[3]
                                                     or out.dtype == shapes[3])))
                and not self.t.released)

    def _misuse(self, x, out, comm) -> str | None:
        """Return what breaks the plan's promise for this run, or None (refused at once if freed).
        """
        if self._started is not None and _seen(self._started):
            self._started = None  # a wait or test saw it complete: it may start again
        if getattr(self.t, "released", False):  # every rank freed it: no peer to tell
            raise UsageError(_freed(self))
        if (x is None and out is None and comm is None and not self.freed
                and self._started is None and self._broken is None
                and self._layout_now() == self._shapes):
            return None  # the common case, in a few attribute reads
        rank = self.t.rank
        if self._broken is not None:
            return self._broken
        if self.freed:  # its peers may be in the run already: tell them (_refuse)
            return (f"rank {rank}: this {self.collective} plan was freed; make a new one with "
                    f"refcoll.{self.collective}_init")
        if self._started is not None:  # this rank's alone: its run goes on, and a start
            raise UsageError(f"rank {rank}: this {self.collective} plan is already started; "
                             "wait() for it before starting it again")  # after wait() is in step
        if comm is not None and not self._belongs(comm):
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

    def _belongs(self, comm) -> bool:
        """Return whether ``comm`` is the plan's communicator: the one it was made with, or its
        transport, or another handle of that MPI communicator (``MPI.COMM_WORLD`` for a plan
        made with ``comm=None``); asks no other rank."""
        if comm is self.comm or comm is self.t:
            return True
        mpi = sys.modules.get("mpi4py.MPI")
        t = getattr(self.t, "inner", self.t)  # a device transport's: the one it wraps
        return mpi is not None and isinstance(comm, mpi.Intracomm) and cached_transport(comm) is t

    def _layout_now(self) -> tuple:
        """Return the shapes and dtypes of the plan's buffers as they are now."""
        x, out = self.x, self.out
        return (x.shape, x.dtype) if out is None else (x.shape, x.dtype, out.shape, out.dtype)

    def _trace_fields(self) -> dict:
        return debug.call_fields(self.x, op=self.reduction, algorithm=self.algorithm,
                                 root=self.root, options=self.options, validate=self.validate)


#: The most bytes an exchange may carry each way for :meth:`Plan.start` to run the
#: recording on the caller's thread (:class:`InFlight`). MPI libraries send messages
#: this small eagerly (MPICH's and Open MPI's shared-memory and network eager limits
#: are 16-64 KiB): the library moves them by itself while the caller computes.
IN_FLIGHT_BYTES = 16 * 1024


class InFlight:
    """A recorded run started on the caller's thread, as ``MPI_Start`` starts one.

    For a recording whose exchanges are all small (:data:`IN_FLIGHT_BYTES`), so
    latency-bound, started when nothing else is outstanding: :meth:`Plan.start`
    runs its steps up to the first exchange, starts that exchange's persistent
    requests in the call's tag space and returns; the MPI library moves the
    message while the caller computes. Each ``test()`` goes on as far as it can
    without waiting (as MPICH's schedules do without a progress thread), raising
    once a peer revoked the call or the exchange it looks at is past the
    transport's deadline (so a ``while not test()`` loop ends), and
    ``wait()`` runs the rest: the same steps, in the same order, as
    ``plan()``. No thread, no queue, and no :class:`~refcoll.calls.progress.Handle`
    unless someone asks for :attr:`handle`: ``start()`` then ``wait()`` back to
    back costs little more than ``plan()``. Any later call in the process, on any
    communicator, first hands the run to its communicator's engine
    (:func:`~refcoll.calls.progress.adopt`): it finishes before a later call on its
    own communicator, and moves while the caller waits on another.

    Whoever runs its steps (the caller, or the engine that adopted it) holds
    the plan's lock.
    """

    __slots__ = ("plan", "index", "posted", "deadline", "done", "error", "_handle", "seen",
                 "told", "out")
    kind = "in-flight"

    def __init__(self, plan: "Plan"):
        self.plan, self.index, self.posted, self.deadline = plan, 0, False, None
        self.out = plan.out  # what the run writes (a rebind() after it completes moves the plan)
        self.done, self.error, self._handle, self.told = False, None, None, False
        self.seen = False  # Plan.test() saw it complete (a wait through its handle: the handle's)
        in_flight(plan._slots, self, started=True)
        t = plan.t
        t.enter_call(plan.collective)  # the call's count and tag space, in issue order
        try:
            with plan._lock:
                self.go(wait=False)
        finally:
            t.leave_call()

    @property
    def collective(self) -> str:
        return self.plan.collective

    @property
    def handle(self) -> Handle:
        """The run's :class:`~refcoll.calls.progress.Handle`, made when first asked."""
        handle = self._handle
        if handle is not None:  # made already (a callback of its own completion may ask)
            return handle
        with _HANDLES:  # (not the plan's lock: an engine running the run holds that)
            handle = self._handle
            if handle is None:
                handle = self._handle = Handle(self.plan.collective, None, self)
                handle.started = handle.issued
            ended = self.done
        if ended:  # the run ended before, or as, its handle was made: tell it here
            self._tell(handle)
        return handle

    def on_thread(self) -> bool:
        return False

    def advance(self, whole: bool = False, through: Handle | None = None) -> None:
        """Go on as far as the run can without waiting (``test()``; the engines' signature)."""
        lock = self.plan._lock
        if not self.done and lock.acquire(blocking=False):
            try:
                self.go(wait=False)
            finally:
                lock.release()

    def finish(self) -> None:
        """Run to the end, waiting for each exchange by the transport's deadline."""
        self.drive(None, None)

    def drive(self, handle: Handle | None, timeout: float | None) -> None:
        """Run to the end, or until ``timeout`` (``wait(timeout)``: the run goes on)."""
        if timeout is None:
            with self.plan._lock:  # an engine that adopted the run may hold it: then it finishes
                self.go(wait=True)
            return
        deadline = time.monotonic() + timeout
        while True:
            self.advance()
            if self.done:  # set before the handle is told (by the run, or by its maker)
                handle._done.wait()
                return
            if time.monotonic() > deadline:
                raise not_done(handle, timeout)
            os.sched_yield()

    def go(self, wait: bool) -> None:
        """Run steps from the current one, holding the plan's lock, to the end or (``wait=False``)
        to an exchange not yet complete, or just started (a look later tests it).

        A failure ends the run with the error, raised from ``wait()``.
        """
        if self.done:
            return
        plan = self.plan
        t, program = plan.t, plan._program
        named, t.current_call = t.current_call, plan.collective  # what a timeout names
        try:
            if wait:  # the rest, as plan() runs it
                run_steps(t, program, self.index, self.posted)
            else:
                while self.index < len(program):
                    step = program[self.index]
                    if step.__class__ is tuple:
                        if not self.posted:  # started: the next look tests it (MPI_Start's way)
                            start(step)
                            self.posted, self.deadline = True, None
                            return
                        if not done(t, step):  # a peer's revocation, or the deadline, raises
                            if self.deadline is None:  # counted from the first look that waits
                                self.deadline = t.deadline()
                            t._look(step[0], step[4], self.deadline)
                            return
                        landed(t, step)
                        self.posted = False
                    else:
                        step()
                    self.index += 1
            if plan._divides:
                plan.call.finish()
            plan._meter.runs += 1
            plan.runs += 1
        except BaseException as exc:  # noqa: BLE001 - raised again from wait()
            plan.abandon()
            self.error = exc
        finally:
            t.current_call = named
        self.done = True  # before the handle is read: one made meanwhile sees it (and tells)
        in_flight(plan._slots, self, started=False)
        tell_idle(t)
        handle = self._handle
        if handle is not None:
            self._tell(handle)

    def _tell(self, handle: Handle) -> None:
        """Complete ``handle`` with the run's result or error (once: the run's end and the
        handle's making may both come here)."""
        with _HANDLES:
            if self.told:
                return
            self.told = True
        handle._result = None if self.error is not None else self.out
        handle._error = self.error
        handle._finish()


#: Held while an in-place run's handle is made or told of the run's end: never while the
#: run waits (the plan's lock is), so ``wait(timeout)`` and ``wait_all`` never wait on it.
_HANDLES = threading.Lock()


def _completed(run) -> bool:
    """Return whether a run :meth:`Plan.start` began (an InFlight, or a Handle) has completed."""
    return run.done if run.__class__ is InFlight else run._done.is_set()


def _seen(run) -> bool:
    """Return whether the program saw a run complete: a ``wait()``, or a ``test()`` that said
    so, on the plan or on its handle (``MPI_Start`` again is allowed only then). A run that
    merely finished in the background is still started: a second ``start()`` is refused."""
    if run.__class__ is InFlight:
        return run.seen or (run._handle is not None and run._handle.seen)
    return run.seen


def _freed(plan: Plan) -> str:
    """Say that ``plan``'s communicator was freed, and what to do."""
    return (f"rank {plan.t.rank}: this {plan.collective} plan's communicator was freed "
            "(comm.Free()), and its persistent requests with it: make the plan on a "
            "communicator that lives as long as the plan")


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
    """Return whether ``a`` is ``b``'s very memory, shape and dtype (host or device arrays)."""
    xp = array_namespace(b)
    return a is b or (isinstance(a, xp.ndarray) and isinstance(b, xp.ndarray)
                      and a.shape == b.shape and a.dtype == b.dtype and address(a) == address(b))


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
