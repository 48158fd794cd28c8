"""Whose turn it is: the run queue that lets a simulated world's threads run one at a time.

A :class:`~refcoll.transport.sim.SimWorld` runs each rank on a thread of its own,
because the algorithms are ordinary blocking functions. Left to the operating
system, every matched message wakes its waiting thread at once, and many runnable
threads then contend for the interpreter lock: a woken thread may block again on
the world's lock, then on the interpreter's, before it runs. Here a thread that can
go on joins a first-in, first-out queue instead, and is woken only when a running
thread blocks: one thread runs at a time (``slots``), each block hands the turn
straight to one thread, and it wakes after the world's lock is free
(:class:`WorldLock`). This is the baton passing of discrete-event simulators of MPI:
SimGrid, which SMPI runs MPI programs on, runs its actors one at a time and, when
they are system threads, hands control over with one semaphore per actor; here it
is one plain lock per thread.

The queue only decides *when* a thread may go on, never *whether*: the world's
matching still runs under the world's lock, so a thread that runs out of turn (one
that wakes for a timeout or an error, a progress thread, whose work is counted
through :meth:`RunQueue.started` and :meth:`RunQueue.stopped`) is still correct.
A thread that blocks somewhere the world cannot see (``time.sleep``, another
thread's event) keeps its turn; the :class:`Watchdog` then lets the next thread in
line go on after :data:`PATIENCE` seconds, so such a run is slower but never stuck.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Callable

__all__ = ["MAX_SIMULATED_RANKS", "WorldLock", "Waiter", "RunQueue", "Watchdog", "SimProgress",
           "small_stacks", "PATIENCE", "RUNNING", "RUNNING_LOCK", "progress_note"]

#: The most ranks a simulation runs. Simulated ranks are threads of one process that
#: take turns (this module): on two shared cores a tree or Rabenseifner all-reduce of
#: one element takes seconds at 1,024 ranks and under a minute at 4,096; a ring's
#: 2p(p-1) messages take about 20 s at 256 ranks and grow as p² (``--ledger-only``
#: replays them without data, about 3x cheaper).
MAX_SIMULATED_RANKS = 4096

#: The simulated worlds running in this process (each ``SimWorld.run`` adds its world),
#: for :func:`progress_note`, and the lock that guards the set.
RUNNING: "weakref.WeakSet" = weakref.WeakSet()
RUNNING_LOCK = threading.Lock()


def progress_note() -> str | None:
    """Return a note on the simulated worlds running in this process, or None if none is.

    For a command's heartbeat: a long ``refcoll simulate`` can say how far it is.
    """
    with RUNNING_LOCK:
        worlds = list(RUNNING)
    notes = [w.snapshot().describe() for w in worlds]
    return "; ".join(notes) if notes else None

#: Seconds the head of the queue waits for a turn while every turn is held, before
#: the watchdog lets it run beside the holders (whichever is blocked elsewhere).
PATIENCE = 0.02

#: Stack of each rank thread in worlds of more than :data:`BIG_WORLD` ranks: a rank
#: runs Python frames and NumPy calls only, and 4,096 default stacks (8 MiB each)
#: would reserve 32 GiB of address space.
STACK_BYTES = 1 << 20
BIG_WORLD = 256


class WorldLock:
    """The world's lock; the threads given a turn while it was held wake once it is released.

    Waking a thread while holding the lock would wake it only to block again on the
    lock (and then on the interpreter lock): three switches instead of one. So
    :meth:`Waiter.wake` only notes the thread in ``wakes``, and :meth:`release`
    lets the noted threads go after the lock itself.
    """

    __slots__ = ("_lock", "wakes", "plain")

    def __init__(self) -> None:
        self._lock = self.plain = threading.Lock()  # plain: for holders that wake no thread
        self.wakes: list[Waiter] = []

    def acquire(self) -> None:
        """Take the lock."""
        self._lock.acquire()

    def release(self) -> None:
        """Release the lock, then wake the threads noted while it was held."""
        wakes = self.wakes
        if wakes:
            self.wakes = []
            self._lock.release()
            for w in wakes:
                w.lock.release()
        else:
            self._lock.release()

    def __enter__(self) -> "WorldLock":
        self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Waiter:
    """One thread's place in a world: what it waits on and the lock it sleeps on.

    ``lock`` is held while the thread may not run; :meth:`wake` has the world's
    lock release it once (``woken`` guards against a second release), and the
    thread takes it back on waking. ``pending`` counts its requests not yet
    matched; ``turn`` says that the queue gave it a turn, ``queued`` that it
    waits in the queue for one.
    """

    __slots__ = ("rank", "reqs", "pending", "lock", "woken", "turn", "queued")

    def __init__(self, rank: int):
        self.rank = rank
        self.reqs: list = []
        self.pending = 0
        self.lock = threading.Lock()
        self.lock.acquire()
        self.woken = False
        self.turn = False
        self.queued = False

    def wake(self, world_lock: WorldLock) -> None:
        """Let the thread go on once ``world_lock`` (held) is released; once until it slept."""
        if not self.woken:
            self.woken = True
            world_lock.wakes.append(self)

    def sleep(self, timeout: float | None, world_lock: WorldLock) -> None:
        """Release ``world_lock``, sleep until woken or ``timeout`` passes, take it back."""
        world_lock.release()
        got = False
        try:
            got = self.lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0))
        finally:
            world_lock.acquire()
            if self.woken:
                if not got:  # woken just after the timeout: the release is done or under way
                    self.lock.acquire()
                self.woken = False


class RunQueue:
    """At most ``slots`` running threads; the others that could go on wait in line.

    Every method is called with the world's lock held. ``running`` counts the
    threads that hold a turn, including those the world lets run on their own
    (a progress thread between :meth:`started` and :meth:`stopped`).
    """

    def __init__(self, lock: WorldLock, slots: int = 1):
        self.lock = lock
        self.slots = slots
        self.running = 0
        self.ready: deque[Waiter] = deque()
        self.turns = 0  # turns given so far: the watchdog's sign of progress

    def can_go(self, w: Waiter) -> None:
        """``w``'s wait is over: give it a turn now if one is free, else queue it."""
        if self.running < self.slots:
            self._give(w)
        elif not w.queued:
            w.queued = True
            self.ready.append(w)

    def _give(self, w: Waiter) -> None:
        self.running += 1
        self.turns += 1
        w.turn = True
        w.wake(self.lock)

    def stopped(self, threads: int = 1) -> None:
        """``threads`` running threads blocked or ended: hand their turns on."""
        self.running -= threads
        self.dispatch()

    def started(self, threads: int = 1) -> None:
        """``threads`` threads run without waiting for a turn (woken by something else)."""
        self.running += threads

    def dispatch(self) -> None:
        """Give free turns to the threads first in line."""
        while self.running < self.slots and self.ready:
            w = self.ready.popleft()
            w.queued = False
            self._give(w)

    def force(self) -> None:
        """Give the head of the line a turn even though none is free (see :class:`Watchdog`)."""
        if self.ready:
            w = self.ready.popleft()
            w.queued = False
            self._give(w)

    def leave(self, w: Waiter) -> None:
        """Take ``w`` out of the line (it goes on by itself: a timeout, an error)."""
        if w.queued:
            w.queued = False
            self.ready.remove(w)

    def flush(self) -> None:
        """Give every thread in line a turn (the world failed: each must see it)."""
        while self.ready:
            w = self.ready.popleft()
            w.queued = False
            self._give(w)


class Watchdog:
    """A thread that keeps a world moving and reports on it while it runs.

    Every :data:`PATIENCE` seconds: if threads wait in line and no turn was given
    since the last look, the head of the line gets one (whoever holds the turns is
    blocked where the world cannot see); if none waits in line and nothing moved,
    ``stalled()`` runs (the world checks from scratch whether it deadlocked). Every
    ``every`` seconds it calls
    ``report()``, if given (a progress note for a long run).
    """

    def __init__(self, lock: WorldLock, queue: RunQueue, stalled: Callable[[], None],
                 report: Callable[[], None] | None = None, every: float = 10.0):
        self.lock, self.queue, self.stalled = lock, queue, stalled
        self.report, self.every = report, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="refcoll-sim-watchdog",
                                        daemon=True)

    def __enter__(self) -> "Watchdog":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        seen, next_report = -1, time.monotonic() + self.every
        while not self._stop.wait(PATIENCE):
            with self.lock:
                if self.queue.turns == seen:
                    if self.queue.ready:
                        self.queue.force()
                    else:
                        self.stalled()
                seen = self.queue.turns
            if self.report is not None and time.monotonic() >= next_report:
                next_report += self.every
                self.report()


@dataclass(frozen=True)
class SimProgress:
    """How far a running world has come: its ranks, those finished, messages matched."""

    size: int
    finished: int
    messages: int
    elapsed: float
    recorded: int | None = None  # a ledger-only world still recording its ranks: how many

    def describe(self) -> str:
        """Return it as a progress note: ``812 of 1024 ranks finished, 1,598,114 messages``."""
        if self.recorded is not None:
            return f"{self.recorded} of {self.size} ranks' messages recorded, none matched yet"
        return (f"{self.finished} of {self.size} ranks finished, {self.messages:,} messages "
                f"matched")


@contextlib.contextmanager
def small_stacks(size: int):
    """Give the threads started inside small stacks when ``size`` ranks are many."""
    if size <= BIG_WORLD:
        yield
        return
    before = threading.stack_size(STACK_BYTES)
    try:
        yield
    finally:
        threading.stack_size(before)
