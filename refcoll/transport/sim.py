"""An in-process simulated world: ranks as threads that take turns, every message in a ledger.

A send completes only when a matching receive takes it (rendezvous, like
``MPI_Ssend``), so a schedule that could deadlock on a real MPI with large
messages deadlocks here too, and the world reports the wait-for cycle instead of
hanging. Bytes are copied from the sender's buffer straight into the receiver's,
so the simulator computes exactly what an MPI run computes. The threads run one
at a time, each until it blocks (:mod:`~refcoll.transport.scheduler`), so what a
message costs does not grow with the number of ranks. For the ledger alone at
thousands of ranks, :mod:`~refcoll.transport.ledger_only` needs no threads.

    world = SimWorld(4)
    outputs = world.run(lambda t: ring_allreduce(t, inputs[t.rank], ...))
    world.ledger.total_bytes
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict, deque
from typing import Any, Callable, Sequence

import numpy as np

from ..core.errors import CollectiveTimeout, DeadlockError, PeerFailure, RefcollError
from .base import Ledger, Message, Reduction, TransportBase, as_bytes, default_timeout
from .requests import Request, SplitRequest, collector_paused, find_cycle, split_groups
from .scheduler import (
    MAX_SIMULATED_RANKS,
    RUNNING,
    RUNNING_LOCK,
    RunQueue,
    SimProgress,
    Waiter,
    Watchdog,
    WorldLock,
    small_stacks,
)

__all__ = ["MAX_SIMULATED_RANKS", "SimWorld", "SimTransport", "SimProgress"]

class SimWorld:
    """``size`` simulated ranks that exchange real bytes through a matching engine.

    Each rank runs on a thread of its own, but the threads take turns
    (:class:`~refcoll.transport.scheduler.RunQueue`): a thread runs until it
    blocks on the world, then hands its turn to the next thread whose wait is
    over. No thread is woken for nothing and the interpreter lock is not fought
    over, and the deadlock detector's bookkeeping is a few counters per wait
    rather than a look at every rank, so what a message costs does not grow with
    the world. Which thread runs when changes neither the messages, their rounds,
    nor the bytes: the ledger and the outputs are the same for any order.

    Args:
        size: number of ranks.
        ranks_per_node: how many consecutive ranks share a simulated node (what
            :meth:`SimTransport.split_node` groups); ``None``: one node.
        record_payloads: keep a copy of every message's bytes in the ledger
            (``Message.payload``), for tracing which data moves where.
        timeout: seconds any one blocking wait may take before
            :class:`~refcoll.core.errors.CollectiveTimeout`; ``None`` reads
            ``REFCOLL_TIMEOUT`` and otherwise waits (the deadlock detector still
            ends every wait that can never complete); seconds at or beyond
            ``threading.TIMEOUT_MAX`` (``inf``), more than a wait can hold, wait for ever.
        calibration: the :class:`~refcoll.calls.auto.Calibration` ``auto`` resolves
            with on this world's ranks (default: :data:`refcoll.calls.auto.DEFAULT`),
            to predict what an MPI job that agreed on it returns.
        slots: how many rank threads may run at once (default 1: one at a time;
            ``size`` lets every thread run as soon as its wait is over, as the
            operating system schedules them).
        progress: called with a :class:`SimProgress` every ``progress_every``
            seconds while :meth:`run` runs (a long run's progress note).
    """

    def __init__(self, size: int, *, timeout: float | None = None,
                 ranks_per_node: int | None = None, record_payloads: bool = False,
                 calibration=None, slots: int = 1,
                 progress: Callable[["SimProgress"], None] | None = None,
                 progress_every: float = 10.0):
        if size < 1:
            raise ValueError(f"a world needs at least one rank, got {size}")
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self.size = size
        self.ranks_per_node = ranks_per_node or size
        self.record_payloads = record_payloads
        self.calibration = calibration
        env = os.environ.get("REFCOLL_TIMEOUT")
        self.timeout = timeout if timeout is not None else (default_timeout() if env else None)
        if self.timeout is not None and self.timeout >= threading.TIMEOUT_MAX:
            self.timeout = None
        self.ledger = Ledger()
        self.progress, self.progress_every = progress, progress_every
        self._lock = WorldLock()
        self._queue = RunQueue(self._lock, slots)
        self._local = threading.local()  # this thread's Waiter
        self._sends: dict[tuple, deque] = defaultdict(deque)
        self._recvs: dict[tuple, deque] = defaultdict(deque)
        self._clock = [0] * size
        # What each rank's threads wait on (a rank's progress thread, refcoll.calls.progress,
        # waits beside its main thread), how many of its threads are doing something else
        # (its main thread, its progress thread while it has calls to run) and how many of
        # its waits are over; _stuck_ranks counts the live ranks with none of either.
        self._waiting: dict[int, dict[int, Waiter]] = defaultdict(dict)
        self._active = [1] * size
        self._ready = [0] * size
        self._stuck_ranks = 0
        self._finished: set[int] = set()
        self._error: BaseException | None = None
        self._splits: dict[tuple, dict] = {}
        self._revoked: dict[int, tuple] = {}  # communicator -> (why, the call revoked)
        self._next_comm = 1
        self._ran = False
        self._started = 0.0

    # ------------------------------------------------------------------ running

    def transports(self) -> list["SimTransport"]:
        """Return one transport per rank over the world communicator."""
        members = list(range(self.size))
        return [SimTransport(self, 0, members, r) for r in range(self.size)]

    def run(self, fn: Callable[..., Any], args: Sequence[tuple] | None = None) -> list[Any]:
        """Run ``fn(transport, *args[rank])`` on every rank at once; return the results.

        Raises the first rank's own exception (a :class:`DeadlockError` when the
        world deadlocked) after every thread has stopped.
        """
        if self._ran:
            raise RuntimeError("a SimWorld runs once: create a new SimWorld for another run")
        self._ran = True
        self._started = time.monotonic()
        results: list[Any] = [None] * self.size
        errors: list[BaseException | None] = [None] * self.size

        def main(t: SimTransport, w: Waiter) -> None:
            self._local.waiter = w
            try:
                with self._lock:
                    while not w.turn:  # the first turn: rank order, one at a time
                        w.sleep(None, self._lock)
                    w.turn = False
                results[t.rank] = fn(t, *(args[t.rank] if args is not None else ()))
            except BaseException as exc:  # noqa: BLE001 - every failure must reach run()
                errors[t.rank] = exc
                with self._lock:
                    if self._error is None:
                        self._error = PeerFailure(f"rank {t.rank} failed: {exc!r}")
                    self._wake_all()
            finally:
                with self._lock:
                    if self._is_stuck(t.world_rank):
                        self._stuck_ranks -= 1
                    self._finished.add(t.world_rank)
                    self._queue.stopped()
                    self._detect_deadlock()

        starts = [Waiter(r) for r in range(self.size)]
        threads = [threading.Thread(target=main, args=(t, starts[t.rank]), daemon=True,
                                    name=f"refcoll-sim-rank{t.rank}") for t in self.transports()]
        with self._lock:
            for w in starts:
                self._queue.can_go(w)
        report = (lambda: self.progress(self.snapshot())) if self.progress is not None else None
        with RUNNING_LOCK:
            RUNNING.add(self)
        try:
            with Watchdog(self._lock, self._queue, self._recount, report, self.progress_every), \
                    collector_paused():
                with small_stacks(self.size):
                    for th in threads:
                        th.start()
                for th in threads:
                    th.join()
        finally:
            with RUNNING_LOCK:
                RUNNING.discard(self)
        own = [e for e in errors if e is not None and not isinstance(e, PeerFailure)]
        if own:  # a rank's own failure first, a deadlock only when no rank failed by itself
            raise next((e for e in own if not isinstance(e, DeadlockError)), own[0])
        failed = [e for e in errors if e is not None]
        if failed:
            raise failed[0]
        return results

    def snapshot(self) -> "SimProgress":
        """Return how far the run has come (safe to call from any thread)."""
        with self._lock:
            return SimProgress(self.size, len(self._finished), len(self.ledger.messages),
                               time.monotonic() - (self._started or time.monotonic()))

    # ----------------------------------------------------------- matching engine

    def _wake_all(self) -> None:
        """Wake every waiting thread (the world failed: each raises the error)."""
        self._queue.flush()
        for waits in self._waiting.values():
            for w in waits.values():
                w.wake(self._lock)

    def _post(self, req: Request) -> None:
        if req.kind == "send":
            key = (req.comm, req.rank, req.peer, req.tag)
            waiting = self._recvs.get(key)
            if waiting:
                self._match(req, waiting.popleft())
                if not waiting:
                    del self._recvs[key]
            else:
                self._sends[key].append(req)
        else:
            key = (req.comm, req.peer, req.rank, req.tag)
            waiting = self._sends.get(key)
            if waiting:
                self._match(waiting.popleft(), req)
                if not waiting:
                    del self._sends[key]
            else:
                self._recvs[key].append(req)

    def _match(self, send: Request, recv: Request) -> None:
        if send.buf.nbytes != recv.buf.nbytes:
            self._error = RefcollError(
                f"size mismatch: rank {send.rank} sent {send.buf.nbytes} B to rank {recv.rank} "
                f"(tag {send.tag}), which posted a receive of {recv.buf.nbytes} B; the ranks "
                "disagree on the message size (different counts or dtypes?)"
            )
            self._wake_all()
            return
        recv.buf[...] = send.buf
        step = max(send.clock, recv.clock) + 1
        send.step = recv.step = step
        self.ledger.messages.append(
            Message(step, send.rank, recv.rank, send.buf.nbytes, send.tag, send.comm,
                    send.buf.tobytes() if self.record_payloads else None)
        )
        self._done(send)
        self._done(recv)

    def _done(self, req) -> None:
        """Mark ``req`` matched; a thread whose last pending request it was may go on."""
        req.done = True
        w = req.waiter
        if w is not None:
            w.pending -= 1
            if w.pending == 0:
                self._count(w.rank, ready=1)
                self._queue.can_go(w)

    def _is_stuck(self, rank: int) -> bool:
        """Return whether every thread of ``rank`` waits, on this world or on another thread.

        A thread whose requests are all matched but which has not run yet is
        not stuck: it is about to go on.
        """
        return self._active[rank] <= 0 and bool(self._waiting[rank]) and self._ready[rank] == 0

    def _count(self, rank: int, *, active: int = 0, ready: int = 0, enter=None,
               leave=None) -> None:
        """Change ``rank``'s counts and waits (``enter=(ident, waiter)``, ``leave=ident``).

        Keeps :attr:`_stuck_ranks` right, so that the detector tests one number.
        """
        before = self._is_stuck(rank)
        if enter is not None:
            self._waiting[rank][enter[0]] = enter[1]
        if leave is not None:
            self._waiting[rank].pop(leave, None)
        self._active[rank] += active
        self._ready[rank] += ready
        if rank not in self._finished:
            self._stuck_ranks += self._is_stuck(rank) - before

    def _recount(self) -> None:
        """Count the stuck ranks from scratch and look for a deadlock (the watchdog's check)."""
        self._stuck_ranks = sum(self._is_stuck(r) for r in range(self.size)
                                if r not in self._finished)
        self._detect_deadlock()

    def _pending(self, rank: int):
        return next(r for w in self._waiting[rank].values() for r in w.reqs if not r.done)

    def activity(self, rank: int, delta: int) -> None:
        """Count a thread of ``rank`` starting (+1) or stopping (-1) work outside this world.

        A rank's main thread blocked on a non-blocking call's handle stops; its
        progress thread starts while it has calls to run. A rank is stuck, for
        the deadlock detector, only when none of its threads is doing anything
        else; a thread that stops hands its turn on.
        """
        with self._lock:
            self._count(rank, active=delta)
            if delta < 0:
                self._queue.stopped(-delta)
                self._detect_deadlock()
            else:
                self._queue.started(delta)

    def _detect_deadlock(self) -> None:
        live = self.size - len(self._finished)
        if self._error is not None or not live or self._stuck_ranks < live:
            return
        live_ranks = [r for r in range(self.size) if r not in self._finished]
        if not all(self._is_stuck(r) for r in live_ranks):  # the counts are a shortcut only
            return
        waits = {r: self._pending(r) for r in live_ranks}
        if any(q.comm in self._revoked for q in waits.values()):
            return  # those waits end in PeerFailure as soon as their ranks run again
        cycle = find_cycle({r: q.peer for r, q in waits.items()})
        lines = [f"  rank {r} waits on a {q.describe()}" +
                 (" (that rank has finished)" if q.peer in self._finished else "")
                 for r, q in sorted(waits.items())]
        head = ("deadlock: wait-for cycle " + " -> ".join(map(str, cycle))
                if cycle else "deadlock: every live rank waits on a rank that has finished")
        self._error = DeadlockError(head + "\n" + "\n".join(lines))
        self._wake_all()

    def _waiter(self, rank: int) -> Waiter:
        """Return this thread's :class:`Waiter` (a progress thread gets one on its first wait)."""
        w = getattr(self._local, "waiter", None)
        if w is None:
            w = self._local.waiter = Waiter(rank)
        w.rank = rank
        return w

    def _complete(self, rank: int, reqs: list, what: str, calls: int = 0) -> None:
        """Post ``reqs`` for ``rank`` (its transport in its call ``calls``); block until matched."""
        with self._lock:
            self._check_revoked(rank, reqs, what, calls)
            if self._error is not None:
                raise self._error
            for req in reqs:
                if req.kind != "split":
                    self._post(req)
            pending = sum(1 for r in reqs if not r.done)
            if pending:
                self._block(rank, reqs, pending, what, calls)
            if self._error is not None:
                raise self._error
            steps = [r.step for r in reqs if r.kind != "split"]
            if steps:
                self._clock[rank] = max(self._clock[rank], *steps)

    def _block(self, rank: int, reqs: list, pending: int, what: str, calls: int) -> None:
        """Wait, the world's lock held, until ``reqs`` are matched; hand the turn on meanwhile."""
        w = self._waiter(rank)
        w.reqs, w.pending, w.turn = reqs, pending, False
        for r in reqs:
            if not r.done:
                r.waiter = w
        me = threading.get_ident()
        self._count(rank, active=-1, enter=(me, w))
        self._queue.stopped()
        self._detect_deadlock()
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        try:
            while True:
                self._check_revoked(rank, reqs, what, calls)  # first: a revoked wait is no deadlock
                if self._error is not None:
                    raise self._error
                left = None if deadline is None else deadline - time.monotonic()
                if w.pending == 0 and (w.turn or (left is not None and left <= 0)):
                    return
                if left is not None and left <= 0:
                    pending_req = next(r for r in reqs if not r.done)
                    raise CollectiveTimeout(
                        f"rank {rank}: {what} timed out after {self.timeout:g} s waiting "
                        f"on a {pending_req.describe()}"
                    )
                w.sleep(left, self._lock)
        finally:
            for r in reqs:
                r.waiter = None
            self._queue.leave(w)
            if not w.turn:
                self._queue.started()  # it goes on out of turn: a timeout, an error
            w.turn = False
            self._count(rank, active=1, ready=-1 if w.pending == 0 else 0, leave=me)
            w.reqs = []

    def _check_revoked(self, rank: int, reqs: list, what: str, calls: int) -> None:
        """Raise :class:`PeerFailure` for a wait in a call a rank revoked (lock held)."""
        found = self._revoked.get(reqs[0].comm) if self._revoked and reqs else None
        if found is not None and calls > found[1]:
            raise PeerFailure(f"rank {rank}: {what} cannot complete: {found[0]}")

    def revoke(self, t: "SimTransport", reason: str) -> None:
        """Revoke ``t``'s communicator from ``t``'s next call: its waits there and later raise."""
        with self._lock:
            self._revoked.setdefault(
                t.comm, (f"rank {t.rank} revoked the communicator: {reason}", t._calls))
            self._wake_all()

    def _request(self, kind, rank, peer, tag, comm, buf) -> Request:
        return Request(kind, rank, peer, tag, comm, buf, self._clock[rank])

    def _split(self, t: "SimTransport", color, key) -> "SimTransport | None":
        ident = (t.comm, t._split_seq)
        t._split_seq += 1
        req = SplitRequest(t.world_rank, t.comm)
        with self._lock:
            rv = self._splits.setdefault(
                ident, {"members": list(t.members), "arrived": {}, "result": None,
                        "requests": []}
            )
            req.rendezvous = rv
            rv["arrived"][t.world_rank] = (color, key, t.rank)
            rv["requests"].append(req)
            if len(rv["arrived"]) == len(rv["members"]):
                rv["result"], self._next_comm = split_groups(rv["arrived"], self._next_comm)
                for q in rv["requests"]:
                    self._done(q)
        self._complete(t.world_rank, [req], "split")
        with self._lock:
            rv["taken"] = rv.get("taken", 0) + 1
            if rv["taken"] == len(rv["members"]):
                del self._splits[ident]
        comm, members = rv["result"].get(t.world_rank, (None, None))
        if comm is None:
            return None
        return SimTransport(self, comm, members, members.index(t.world_rank))

    def _record_reduction(self, rank: int, elements: int) -> None:
        with self._lock.plain:  # wakes no thread
            self.ledger.reductions.append(Reduction(rank, elements, self._clock[rank]))

    def _pending_for(self, comm: int, rank: int) -> list:
        with self._lock:
            return [q for (c, _, dst, _), dq in self._sends.items() if c == comm and dst == rank
                    for q in dq]


class SimTransport(TransportBase):
    """One rank's view of a :class:`SimWorld` communicator."""

    def __init__(self, world: SimWorld, comm: int, members: list[int], rank: int):
        super().__init__()
        self.world = world
        self.comm = comm
        self.members = members
        self.rank = rank
        self.size = len(members)
        self.world_rank = members[rank]
        self._split_seq = 0

    def __repr__(self) -> str:
        return f"SimTransport(rank={self.rank}, size={self.size}, comm={self.comm})"

    def _peer(self, peer: int) -> int:
        if not 0 <= peer < self.size:
            raise ValueError(f"rank {self.rank}: peer {peer} is outside 0..{self.size - 1}")
        return self.members[peer]

    def _what(self) -> str:
        return self.current_call or "point-to-point"

    def send(self, buf, dest: int, tag: int = 0) -> None:
        view = as_bytes(buf)
        req = self.world._request("send", self.world_rank, self._peer(dest),
                                  self._wire_tag(tag), self.comm, view)
        self.world._complete(self.world_rank, [req], self._what(), self._calls)
        self.traffic.add(view.nbytes, -1)

    def recv(self, buf, source: int, tag: int = 0) -> None:
        view = as_bytes(buf)
        req = self.world._request("recv", self.world_rank, self._peer(source),
                                  self._wire_tag(tag), self.comm, view)
        self.world._complete(self.world_rank, [req], self._what(), self._calls)
        self.traffic.add(-1, view.nbytes)

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0) -> None:
        w = self.world
        wire = self._wire_tag(tag)
        sending, view = as_bytes(sendbuf), as_bytes(recvbuf)
        reqs = [
            w._request("send", self.world_rank, self._peer(dest), wire, self.comm, sending),
            w._request("recv", self.world_rank, self._peer(source), wire, self.comm, view),
        ]
        w._complete(self.world_rank, reqs, self._what(), self._calls)
        self.traffic.add(sending.nbytes, view.nbytes)

    def split(self, color: int, key: int) -> "SimTransport | None":
        child = self.world._split(self, color, key)
        if child is not None:
            child.traffic = self.traffic
        return child

    def split_node(self) -> "SimTransport":
        """Return the transport of the ranks on this rank's simulated node."""
        return self.split(self.world_rank // self.world.ranks_per_node, self.rank)

    def reduce_local(self, op, a, b, out) -> None:
        op.apply(a, b, out)
        self.world._record_reduction(self.world_rank, int(np.size(out)))

    def revoke(self, reason: str) -> None:
        """Revoke the communicator, as :meth:`refcoll.transport.mpi.MPITransport.revoke` does."""
        self.world.revoke(self, reason)

    def activity(self, delta: int) -> None:
        self.world.activity(self.world_rank, delta)

    def unreceived(self) -> list[str]:
        """Return a description of every message sent to this rank and not yet received."""
        return [q.describe().replace("send of", f"message from rank {q.rank} of")
                for q in self.world._pending_for(self.comm, self.world_rank)]
