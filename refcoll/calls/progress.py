"""What moves a non-blocking collective while its caller computes: handles and progress engines.

MPI's semantics (MPI-4.1 §6.12): every rank issues a communicator's collectives,
blocking and non-blocking, in the same order; several may be outstanding; each
completes as if it ran alone. refcoll gets there by running a communicator's calls
one after another, in issue order, on an engine of that communicator's own:

* :class:`ThreadEngine`, a progress thread per communicator. It runs the very
  blocking call the caller would have made (same code, same checks, same
  messages), so the result is bit-identical to the blocking call and an error is
  the blocking call's error, raised from :meth:`Handle.wait` on every rank. It
  progresses while the caller computes, whether or not anyone calls
  :meth:`Handle.test`: NumPy's large kernels, ``time.sleep`` and mpi4py's waits
  release the GIL. It needs ``MPI_THREAD_MULTIPLE``, since the progress thread
  and the caller may both be inside MPI (on different communicators).
* :class:`ScheduleEngine`, a state machine as libNBC's and MPICH's schedules are:
  the call's recorded exchanges (:mod:`refcoll.transport.recorder`) are started
  one step at a time, and the next step starts only when :meth:`Handle.test`,
  :meth:`Handle.wait` or another call on the communicator finds the current one
  done. No thread, so any thread level does; but between two such calls nothing
  moves except what the MPI library moves by itself.

The thread engine is the default wherever the library gives ``MPI_THREAD_MULTIPLE``
(mpi4py asks for it, and MPICH and Open MPI give it); with less, the schedule
engine. ``REFCOLL_PROGRESS=thread`` or ``schedule`` chooses (thread with less than
``MPI_THREAD_MULTIPLE`` is a UsageError). Why the thread is the default, with
measurements: ``spec/nonblocking.md``.

A blocking collective issued while non-blocking ones are outstanding on the same
communicator queues behind them (:func:`busy_engine`), as MPI orders them.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import threading
import time
import weakref

import numpy as np

from ..core.errors import CollectiveTimeout, UsageError
from ..transport.base import TransportBase, transport_cache
from ..transport.recorder import Stepper

_log = logging.getLogger("refcoll")

__all__ = ["BUSY", "Handle", "Steps", "ThreadEngine", "ScheduleEngine", "ENGINES", "engine_for",
           "engine_kind", "busy_engine", "any_busy", "tell_idle", "wait_all", "LINGER", "POLL",
           "POLL_WINDOW", "not_done", "in_flight", "adopt", "stop_threads"]

#: The engines ``REFCOLL_PROGRESS`` may name.
ENGINES = ("thread", "schedule")

#: Seconds an idle progress thread waits for the next call before it ends (the
#: next call starts a new one): simulated worlds come and go by the thousand.
LINGER = 1.0

#: Seconds between a progress thread's looks at its queue while plans are being
#: started (:meth:`ThreadEngine.submit` with ``defer``): a plan's run waits at most
#: this long for the thread, and a ``wait()`` that comes first runs it itself.
POLL = 200e-6

#: Seconds a progress thread goes on polling after the last deferred start. Short:
#: a polling thread takes the GIL and a core from everything else at every look, so
#: a start after a longer pause wakes the thread instead (a few µs, once).
POLL_WINDOW = 0.002

#: Engines with calls outstanding, in this process: while none has any, a
#: blocking call pays one integer test for the ordering check.
_busy = [0]
_busy_lock = threading.Lock()

#: The same count, public: a blocking call reads ``BUSY[0]`` in place, calling nothing.
BUSY = _busy


class _Done:
    """Whether a call has completed: ``threading.Event``'s three methods, cheap to make.

    A handle is made per call, and most are waited for by the thread that
    runs them (inline), so a waiter's lock is made only when one waits:
    :meth:`set` is called under ``_busy_lock`` (:meth:`Handle._finish`), and
    :meth:`wait` registers under it.
    """

    __slots__ = ("flag", "waiters")

    def __init__(self):
        self.flag = False
        self.waiters = None

    def is_set(self) -> bool:
        return self.flag

    def set(self) -> None:
        """Mark done and release every waiter (the caller holds ``_busy_lock``)."""
        self.flag = True
        waiters, self.waiters = self.waiters, None
        for lock in waiters or ():
            lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until :meth:`set` or ``timeout`` seconds; return whether it is set."""
        with _busy_lock:
            if self.flag:
                return True
            lock = threading.Lock()
            lock.acquire()
            self.waiters = (self.waiters or []) + [lock]
        lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0))
        return self.flag


class Handle:
    """One non-blocking collective call: MPI's request, ``torch.distributed``'s Work.

    Attributes:
        collective: the call's name (``allreduce``...).
        issued, started, finished: ``time.perf_counter()`` when the call was
            issued, began to run, and completed (``None`` until then).
        cpu: the CPU seconds the thread that ran the call spent in it
            (``time.thread_time``; ``None`` until it ran whole on one thread).
    """

    __slots__ = ("collective", "issued", "started", "finished", "cpu", "_engine", "_job",
                 "_result", "_error", "_done", "_callbacks", "seen")

    def __init__(self, collective: str, job, engine):
        self.collective = collective
        self._job = job  # a callable, or a scheduled step machine with .step()
        self._engine = engine
        self._result = None
        self._error: BaseException | None = None
        self._done = _Done()
        self.issued = time.perf_counter()
        self.started = self.finished = None
        self.cpu = None  # CPU seconds the thread that ran the call spent in it
        self._callbacks = None
        self.seen = False  # a wait() or test() saw it complete (MPI's rule: then inactive)

    def __repr__(self) -> str:
        state = "done" if self._done.is_set() else "pending"
        return f"<refcoll.Handle {self.collective} {state}>"

    def test(self) -> bool:
        """Return whether the call has completed (advancing a schedule engine); never raises.

        On a schedule engine, a call that cannot step runs whole here once it is next
        (:meth:`ScheduleEngine.advance`'s ``through``): repeated tests complete every
        call, as MPI's progress rule asks of ``MPI_Test``, and a ``while not test()``
        loop ends.
        """
        if not self._done.is_set():
            self._engine.advance(through=self)
        if self._done.is_set():
            self.seen = True
            return True
        return False

    def is_completed(self) -> bool:
        """Return whether the call has completed, successfully or not (``torch``'s name)."""
        return self.test()

    def exception(self) -> BaseException | None:
        """Return the exception the call failed with; ``None`` if it succeeded or still runs."""
        return self._error if self._done.is_set() else None

    def wait(self, timeout: float | None = None):
        """Wait for the call and return its result, or raise its error.

        The error is the blocking call's own (a :class:`~refcoll.core.errors.MismatchError`,
        a :class:`~refcoll.core.errors.CollectiveTimeout` naming the peer...), raised
        on every rank the call failed on. ``timeout``: seconds to wait here before a
        :class:`CollectiveTimeout` (the call keeps running, and a later ``wait`` may
        still return it); ``None`` waits as long as the call may take (the
        transport's own deadline bounds every exchange). On the schedule engine a
        call that cannot run step by step (:class:`ScheduleEngine`) runs whole when a
        wait reaches it, as MPI's progress rule asks, and ``timeout`` is then looked
        at only once it returns: its exchanges are bounded by the deadline alone.
        """
        if not self._done.is_set():
            self._engine.drive(self, timeout)
        self.seen = True
        if self._error is not None:
            raise self._error
        return self._result

    def result(self):
        """Return the result of a completed call (``wait()``)."""
        return self.wait()

    def _run(self) -> None:
        """Run a callable job to its end, keeping its result or its error."""
        self.started = time.perf_counter()
        cpu = time.thread_time()
        try:
            with np.errstate(all="ignore"):  # IEEE's results, never a one-rank raise or
                self._result = self._job()  # warning (python -W error): see core.ops
        except BaseException as exc:  # noqa: BLE001 - raised again from wait()
            self._error = exc
        self.cpu = time.thread_time() - cpu
        self._finish()

    def add_done_callback(self, fn) -> None:
        """Call ``fn(handle)`` when the call completes (now if it has), on the completing thread.

        That thread may be the engine's: ``fn`` must not make collective calls on the
        same communicator (where they fall in its order would depend on when ``fn``
        ran), and a wait there for a later call of the engine is refused.
        """
        with _busy_lock:
            if not self._done.is_set():
                self._callbacks = (self._callbacks or []) + [fn]
                return
        fn(self)

    def _finish(self) -> None:
        self.finished = time.perf_counter()
        self._job = None
        with _busy_lock:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks or ():
            try:
                fn(self)
            except Exception:  # as concurrent.futures does: logged, and the engine goes on
                _log.exception("refcoll: a done callback of a %s call raised", self.collective)


def not_done(handle: Handle, timeout: float) -> CollectiveTimeout:
    return CollectiveTimeout(
        f"{handle.collective} (non-blocking) not complete after wait(timeout={timeout:g}); it "
        "is still running and a later wait() may return it (a peer may be slow, dead, or not "
        "yet at this call)")


def _count_busy(delta: int) -> None:
    with _busy_lock:
        _busy[0] += delta


class ThreadEngine:
    """A communicator's progress thread: runs its calls one at a time, in issue order."""

    kind = "thread"

    def __init__(self, t):
        self.t = t
        self._queue: collections.deque[Handle] = collections.deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._running = False  # a call is running, on the thread or on a waiting caller
        self._runner, self.outstanding, self._stopping = None, 0, False  # who runs the call
        self._polling_until = 0.0  # the thread looks at its queue every POLL until then
        # Only the simulator counts a rank's threads (its deadlock detector); others need no call.
        self._counted = getattr(type(t), "activity", None) is not TransportBase.activity
        _THREADED.add(self)

    def submit(self, handle: Handle, *, defer: bool = False) -> Handle:
        """Queue ``handle``'s call; start the thread if none is running.

        ``defer`` (a plan's :meth:`~refcoll.calls.plans.Plan.start`): leave the
        thread asleep when it is polling already; it takes the call at its next
        look, within :data:`POLL`, unless a ``wait()`` has taken it first and run
        it inline (work stealing: a start then a wait back to back costs what
        the plan's blocking run costs, no hand-off between threads). Polling
        goes on for :data:`POLL_WINDOW` after the last deferred call.
        """
        adopt()
        with self._cv:
            if self.outstanding == 0:
                _count_busy(1)
                self.t.activity(1)
            self.outstanding += 1
            self._queue.append(handle)
            if self._thread is None:
                self._start_thread()
            elif not defer or self._polling_until == 0.0:
                self._cv.notify()  # a sleeping thread must be woken: it then polls
            if defer:
                self._polling_until = time.monotonic() + POLL_WINDOW
        return handle

    def _start_thread(self) -> None:
        """Start the engine's thread (holding ``_cv``)."""
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"refcoll-progress-rank{self.t.rank}")
        self._thread.start()

    def on_thread(self) -> bool:
        """Return whether the caller is running one of this engine's calls.

        The engine's own thread, or a caller that took the head of the queue in
        :meth:`drive`; either way a call it makes on the transport runs inline.
        """
        return self._running and threading.get_ident() == self._runner

    def advance(self, whole: bool = False, through: Handle | None = None) -> None:
        """Nothing to do: the thread advances by itself."""

    def drive(self, handle: Handle, timeout: float | None) -> None:
        """Block until ``handle`` is done, or ``timeout`` passes.

        Without a timeout, a handle that is next in line and not yet taken by
        the thread (the thread is between calls) runs here, on the caller's thread: waiting for
        a call at once then costs what the blocking call costs, not a handoff to
        the progress thread and back. The order is kept: only the head of the
        queue is taken, and only when no call is running.
        """
        if self.on_thread():  # a done callback, or a call's job, waiting for a later call
            raise UsageError(f"rank {self.t.rank}: wait() for the {handle.collective} call from "
                             "inside another call of the same communicator's progress engine (a "
                             "done callback?) would wait for itself: wait for it after the "
                             "callback returns")
        with self._cv:  # (a wait with a timeout must be able to give up: never run it here)
            mine = (timeout is None and not self._running and bool(self._queue)
                    and self._queue[0] is handle)
            if mine:
                self._queue.popleft()
                self._running, self._runner = True, threading.get_ident()
        if mine:
            if not self._counted:
                self._run_one(handle, patient=False)
                return
            self.t.activity(-1)  # this thread now does the engine's work, counted as the engine's
            try:
                self._run_one(handle, patient=False)
            finally:
                self.t.activity(1)
            return
        self.t.activity(-1)
        try:
            if not handle._done.wait(timeout):
                raise not_done(handle, timeout)
        finally:
            self.t.activity(1)

    def _run_one(self, handle: Handle, *, patient: bool) -> None:
        """Run one call taken off the queue, then count it done."""
        self.t.patient = patient  # only one thread runs calls on t while it has work
        try:
            handle._run()
        finally:
            self.t.patient = False
            with self._cv:
                self._running = False
                self.outstanding -= 1
                idle = self.outstanding == 0
                if idle:
                    _count_busy(-1)
                    self.t.activity(-1)
                elif self._queue:
                    self._cv.notify()
            if idle:
                tell_idle(self.t)

    def stop(self) -> None:
        """Let the thread finish its queue and end; wait for it a few seconds at most (at exit)."""
        with self._cv:
            self._stopping, thread = True, self._thread
            self._cv.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue or self._running:
                    polling = self._polling_until > 0.0
                    woken = self._cv.wait(POLL if polling else LINGER)
                    if polling and not woken and not self._stopping:
                        if time.monotonic() < self._polling_until:
                            continue  # a look at the queue: a deferred call may be there
                        self._polling_until = 0.0
                        continue
                    if (not woken or self._stopping) and not self._queue:
                        self._thread = None  # a later submit starts a new thread
                        return
                handle = self._queue.popleft()
                self._running, self._runner = True, threading.get_ident()
            try:
                self._run_one(handle, patient=True)
            except BaseException:  # a done callback's SystemExit: this thread ends with it
                with self._cv:  # and another takes the calls queued behind
                    self._thread = None
                    if self._queue and not self._stopping:
                        self._start_thread()
                raise


#: The thread engines of this process, stopped at exit (:func:`stop_threads`).
_THREADED: "weakref.WeakSet[ThreadEngine]" = weakref.WeakSet()


@atexit.register
def stop_threads() -> None:
    """End every progress thread before the interpreter's teardown, which a waiting daemon
    thread can outlive the library objects of (a Gloo context then aborts the process)."""
    for engine in list(_THREADED):
        engine.stop()


class ScheduleEngine:
    """A communicator's calls as a state machine, advanced by ``test``, ``wait`` and new calls.

    A call that can run as a schedule (``handle._job`` with a ``step()`` method:
    a recorded plan's run, :class:`Steps`) starts its exchanges one
    step at a time, whenever the engine is advanced; issuing never waits, nor
    does ``test()`` for such a call. Any other call (the first of its kind on the
    communicator, a compressed one, another collective) runs whole, blocking, from
    ``wait()`` or from a ``test()`` that finds it next (MPI's progress rule: tests
    repeated complete the call): the calls queued behind it wait with it.
    """

    kind = "schedule"

    def __init__(self, t):
        self.t = t
        self._queue: collections.deque[Handle] = collections.deque()
        self.outstanding = 0
        self._advancing = False

    def submit(self, handle: Handle) -> Handle:
        """Queue ``handle``'s call and advance the engine (a schedule's first step starts now)."""
        adopt()
        if self.outstanding == 0:
            _count_busy(1)
        self.outstanding += 1
        self._queue.append(handle)
        self.advance()
        return handle

    def on_thread(self) -> bool:
        """Return whether the caller is inside this engine's advance (running one of its calls)."""
        return self._advancing

    def advance(self, whole: bool = False, through: Handle | None = None) -> None:
        """Move the queue as far as it goes without waiting (``whole``: run whole calls too;
        ``through``: run whole the calls that cannot step, up to and including that one)."""
        if self._advancing:
            return  # a call this engine runs is making a call of its own
        self._advancing = True
        try:
            reached = through is None
            while self._queue:
                head = self._queue[0]
                if not _step(head, whole or not reached):
                    return
                self._queue.popleft()
                self.outstanding -= 1
                if self.outstanding == 0:
                    _count_busy(-1)
                    tell_idle(self.t)
                reached = reached or head is through
        finally:
            self._advancing = False

    def drive(self, handle: Handle, timeout: float | None) -> None:
        """Advance until ``handle`` is done (polling, yielding the CPU), or ``timeout`` passes.

        Calls queued behind ``handle`` only step: a peer may join them only once this
        wait has returned.
        """
        if self._advancing:
            raise UsageError(f"rank {self.t.rank}: wait() for the {handle.collective} call from "
                             "inside another call of the same communicator's progress engine (a "
                             "done callback?) would wait for itself: wait for it after the "
                             "callback returns")
        deadline = None if timeout is None else time.monotonic() + timeout
        while not handle._done.is_set():
            self.advance(through=handle)
            if handle._done.is_set():
                return
            if deadline is not None and time.monotonic() > deadline:
                raise not_done(handle, timeout)
            os.sched_yield()


class Steps:
    """A recorded plan's run as the schedule engine's job: each exchange started, then tested.

    For a :class:`~refcoll.calls.plans.Plan` with a recording: the same
    exchanges and reductions, in the same order, as the plan's blocking run:
    the same bits, and the same error.
    """

    def __init__(self, plan):
        self.plan = plan
        self.steps = None
        self.result = None

    def step(self) -> bool:
        """Advance as far as possible without waiting; return whether the run is complete."""
        try:
            return self._step()
        except BaseException:
            self.plan.abandon()  # its requests may still be running: never start them again
            raise

    def _step(self) -> bool:
        plan, t = self.plan, self.plan.t
        if self.steps is None:
            with t.call(plan.collective):
                pass  # the call's count, taken as it starts: a peer's revocation of it applies
            self.steps = Stepper(plan._schedule.steps)
        named, t.current_call = t.current_call, plan.collective  # what a failure names
        try:
            if not self.steps.advance():
                return False
        finally:
            t.current_call = named
        plan.call.finish()
        plan.runs += 1
        self.result = plan.call.output()
        return True


def _step(handle: Handle, whole: bool) -> bool:
    """Advance one queued call (``whole``: run a call that cannot step); return whether it is done.
    """
    if handle._done.is_set():
        return True
    job = handle._job
    if not hasattr(job, "step"):
        if not whole:
            return False
        handle._run()
        return True
    if handle.started is None:
        handle.started = time.perf_counter()
    try:
        if not job.step():
            return False
        handle._result = job.result
    except BaseException as exc:  # noqa: BLE001 - raised again from wait()
        handle._error = exc
    handle._finish()
    return True


def engine_kind(t) -> str:
    """Return which engine runs ``t``'s non-blocking calls.

    ``REFCOLL_PROGRESS`` names it; unset, the thread level decides.
    """
    wanted = os.environ.get("REFCOLL_PROGRESS", "").strip().lower()
    if wanted and wanted not in ENGINES:
        raise UsageError(f"REFCOLL_PROGRESS={wanted!r} is not a progress engine: use "
                         f"{' or '.join(ENGINES)}")
    if wanted == "thread" and not t.thread_multiple:
        raise UsageError("REFCOLL_PROGRESS=thread needs MPI_THREAD_MULTIPLE, and this MPI library "
                         "gave less (MPI.Query_thread()); use REFCOLL_PROGRESS=schedule")
    if wanted:
        return wanted
    return "thread" if getattr(t, "thread_multiple", False) else "schedule"


def engine_for(t, kind: str | None = None):
    """Return the engine of transport ``t``, made on its first non-blocking call.

    ``kind`` (``thread`` or ``schedule``) chooses it for a transport that has
    none yet, as a benchmark comparing the two does; default :func:`engine_kind`.
    """
    cache = transport_cache(t, "progress")
    engine = cache.get("engine")
    if engine is None:
        kind = kind or engine_kind(t)
        if kind not in ENGINES:
            raise UsageError(f"unknown progress engine {kind!r}: use {' or '.join(ENGINES)}")
        engine = (ThreadEngine if kind == "thread" else ScheduleEngine)(t)
        cache["engine"] = engine
    elif kind is not None and kind != engine.kind:
        raise UsageError(f"this communicator's non-blocking calls already run on the {engine.kind} "
                         f"engine; ask for {kind} before its first non-blocking call")
    return engine


def tell_idle(t) -> None:
    """Tell ``t`` its calls are done, where its communicator was freed meanwhile
    (:meth:`~refcoll.transport.base.TransportBase.idle`): one attribute read otherwise,
    as every run started in place ends here."""
    if getattr(t, "released", False):
        t.idle()


def any_busy() -> bool:
    """Return whether any engine in this process has calls outstanding (one integer test)."""
    return _busy[0] > 0


#: The runs started in place and not yet handed to an engine, each with its transport's
#: slots: what :func:`adopt` hands over.
_IN_PLACE: dict = {}


def in_flight(slots: dict, run, started: bool) -> None:
    """Note that ``run`` started in place on a transport, or (``started=False``) completed.

    ``slots``: the transport's ``transport_cache(t, "progress")``. A plan's run
    started on the caller's thread (:class:`~refcoll.calls.plans.InFlight`)
    holds no engine's queue, so it counts as outstanding here, and the next
    call in the process hands it to its engine first (:func:`adopt`).
    """
    with _busy_lock:  # _count_busy, inline: every start in place comes here twice
        if started:
            _busy[0] += 1
            slots["in_flight"] = run
            _IN_PLACE[run] = slots
        else:
            _busy[0] -= 1
            if slots.get("in_flight") is run:
                slots["in_flight"] = None
            _IN_PLACE.pop(run, None)


def adopt() -> None:
    """Put every run started in place, first in its own engine's queue.

    Every later call (blocking, non-blocking, a plan's) comes here first, on any
    communicator. On the run's own, that call then runs after it, as MPI orders
    a communicator's calls, and never beside it on the same tags. On another,
    the run still moves while this thread waits there (MPI's progress rule: a
    process blocked in one call still progresses its others, so ranks that
    start a plan on one communicator and block on another in opposite orders
    do not wait for each other for ever). A start never waits, as ``MPI_Start``
    does not.
    """
    if not _IN_PLACE:
        return
    with _busy_lock:
        taken = [run for run, slots in _IN_PLACE.items() if slots.get("in_flight") is run]
        for run in taken:
            _IN_PLACE[run]["in_flight"] = None
        _IN_PLACE.clear()
    for run in taken:
        engine = engine_for(run.plan.t)
        engine.submit(Handle(run.collective, run.finish, engine))


def busy_engine(t):
    """Return ``t``'s engine if it has calls outstanding and the caller is not one of them.

    A run started in place, on ``t`` or another transport, goes to its engine first
    (:func:`adopt`).
    """
    adopt()
    engine = transport_cache(t, "progress").get("engine")
    if engine is None or not engine.outstanding or engine.on_thread():
        return None
    return engine


def wait_all(handles, timeout: float | None = None) -> list:
    """Wait for every handle, in order; return their results (``MPI_Waitall``).

    Every handle is waited for even when one fails, so no call is left running
    unseen; then the first failure is raised. ``timeout`` bounds the whole wait. An
    interrupt (Ctrl-C: KeyboardInterrupt) is raised at once, as a single wait raises it.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    results, first = [], None
    for h in handles:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            results.append(h.wait(left))
        except CollectiveTimeout as exc:
            if h._done.is_set():  # the call itself timed out: every rank sees it
                results.append(None)
                first = first or exc
            else:
                raise
        except Exception as exc:  # noqa: BLE001 - the first is raised below
            results.append(None)
            first = first or exc
    if first is not None:
        raise first
    return results
