"""An in-process simulated world: ranks as threads, every message in a ledger.

A send completes only when a matching receive takes it (rendezvous, like
``MPI_Ssend``), so a schedule that could deadlock on a real MPI with large
messages deadlocks here too, and the world reports the wait-for cycle instead of
hanging. Bytes are copied from the sender's buffer straight into the receiver's,
so the simulator computes exactly what an MPI run computes.

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
from .base import Ledger, Message, Reduction, TransportBase, default_timeout

__all__ = ["SimWorld", "SimTransport", "as_bytes"]


def as_bytes(buf) -> np.ndarray:
    """Return a contiguous array's memory as a flat ``uint8`` view (no copy)."""
    if not buf.flags.c_contiguous:
        raise ValueError("transport buffers must be C-contiguous (pass a contiguous view)")
    return buf.reshape(-1).view(np.uint8)


class _Request:
    """One posted send or receive, in world ranks."""

    __slots__ = ("kind", "rank", "peer", "tag", "comm", "buf", "clock", "done", "step")

    def __init__(self, kind, rank, peer, tag, comm, buf, clock):
        self.kind, self.rank, self.peer, self.tag = kind, rank, peer, tag
        self.comm, self.buf, self.clock = comm, buf, clock
        self.done = False
        self.step = 0

    def describe(self) -> str:
        if self.kind == "send":
            return f"send of {self.buf.nbytes} B to rank {self.peer} (tag {self.tag})"
        return f"receive of {self.buf.nbytes} B from rank {self.peer} (tag {self.tag})"


class _SplitRequest:
    """One rank's part in a collective ``split``: done once every member arrived."""

    def __init__(self, rendezvous: dict, rank: int):
        self.rendezvous = rendezvous
        self.rank = rank

    @property
    def done(self) -> bool:
        return self.rendezvous["result"] is not None

    @property
    def peer(self) -> int:
        missing = [w for w in self.rendezvous["members"] if w not in self.rendezvous["arrived"]]
        return missing[0] if missing else self.rank

    def describe(self) -> str:
        missing = [w for w in self.rendezvous["members"] if w not in self.rendezvous["arrived"]]
        return f"split waiting for ranks {missing}"


class SimWorld:
    """``size`` simulated ranks that exchange real bytes through a matching engine.

    Args:
        size: number of ranks.
        ranks_per_node: how many consecutive ranks share a simulated node (what
            :meth:`SimTransport.split_node` groups); ``None``: one node.
        record_payloads: keep a copy of every message's bytes in the ledger
            (``Message.payload``), for tracing which data moves where.
        timeout: seconds any one blocking wait may take before
            :class:`~refcoll.core.errors.CollectiveTimeout`; ``None`` reads
            ``REFCOLL_TIMEOUT`` and otherwise waits (the deadlock detector still
            ends every wait that can never complete).
        calibration: the :class:`~refcoll.calls.auto.Calibration` ``auto`` resolves
            with on this world's ranks (default: :data:`refcoll.calls.auto.DEFAULT`),
            to predict what an MPI job that agreed on it returns.
    """

    def __init__(self, size: int, *, timeout: float | None = None,
                 ranks_per_node: int | None = None, record_payloads: bool = False,
                 calibration=None):
        if size < 1:
            raise ValueError(f"a world needs at least one rank, got {size}")
        self.size = size
        self.ranks_per_node = ranks_per_node or size
        self.record_payloads = record_payloads
        self.calibration = calibration
        env = os.environ.get("REFCOLL_TIMEOUT")
        self.timeout = timeout if timeout is not None else (default_timeout() if env else None)
        self.ledger = Ledger()
        self._lock = threading.Lock()
        self._wake = [threading.Condition(self._lock) for _ in range(size)]
        self._sends: dict[tuple, deque] = defaultdict(deque)
        self._recvs: dict[tuple, deque] = defaultdict(deque)
        self._clock = [0] * size
        # What each rank's threads wait on (a rank's progress thread, refcoll.calls.progress,
        # waits beside its main thread), and how many of its threads are doing something else:
        # its main thread, and its progress thread while it has calls to run.
        self._waiting: dict[int, dict[int, list]] = defaultdict(dict)
        self._active = [1] * size
        self._finished: set[int] = set()
        self._error: BaseException | None = None
        self._splits: dict[tuple, dict] = {}
        self._next_comm = 1
        self._ran = False

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
        results: list[Any] = [None] * self.size
        errors: list[BaseException | None] = [None] * self.size

        def main(t: SimTransport) -> None:
            try:
                results[t.rank] = fn(t, *(args[t.rank] if args is not None else ()))
            except BaseException as exc:  # noqa: BLE001 - every failure must reach run()
                errors[t.rank] = exc
                with self._lock:
                    if self._error is None:
                        self._error = PeerFailure(f"rank {t.rank} failed: {exc!r}")
                    self._wake_all()
            finally:
                with self._lock:
                    self._finished.add(t.rank)
                    self._detect_deadlock()

        threads = [
            threading.Thread(target=main, args=(t,), name=f"refcoll-sim-rank{t.rank}", daemon=True)
            for t in self.transports()
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        own = [e for e in errors if e is not None and not isinstance(e, PeerFailure)]
        if own:
            first = next(e for e in own if not isinstance(e, DeadlockError)) if any(
                not isinstance(e, DeadlockError) for e in own) else own[0]
            raise first
        if any(e is not None for e in errors):
            raise next(e for e in errors if e is not None)
        return results

    # ----------------------------------------------------------- matching engine

    def _wake_all(self) -> None:
        for cv in self._wake:
            cv.notify_all()

    def _post(self, req: _Request) -> None:
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

    def _match(self, send: _Request, recv: _Request) -> None:
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
        send.done = recv.done = True
        self.ledger.messages.append(
            Message(step, send.rank, recv.rank, send.buf.nbytes, send.tag, send.comm,
                    send.buf.tobytes() if self.record_payloads else None)
        )
        self._wake[send.rank].notify_all()
        self._wake[recv.rank].notify_all()

    def _stuck(self, rank: int) -> bool:
        """Return whether every thread of ``rank`` waits, on this world or on another thread.

        A thread whose requests are all matched but which has not woken yet is
        not stuck: it is about to go on.
        """
        waits = self._waiting[rank].values()
        return (self._active[rank] <= 0 and bool(waits)
                and all(any(not r.done for r in reqs) for reqs in waits))

    def _pending(self, rank: int):
        return next(r for reqs in self._waiting[rank].values() for r in reqs if not r.done)

    def activity(self, rank: int, delta: int) -> None:
        """Count a thread of ``rank`` starting (+1) or stopping (-1) work outside this world.

        A rank's main thread blocked on a non-blocking call's handle stops; its
        progress thread starts while it has calls to run. A rank is stuck, for
        the deadlock detector, only when none of its threads is doing anything else.
        """
        with self._lock:
            self._active[rank] += delta
            if delta < 0:
                self._detect_deadlock()

    def _detect_deadlock(self) -> None:
        live = [r for r in range(self.size) if r not in self._finished]
        if self._error is not None or not live or not all(self._stuck(r) for r in live):
            return
        waits = {}
        for r in live:
            waits[r] = self._pending(r)
        cycle = _find_cycle({r: q.peer for r, q in waits.items()})
        lines = [f"  rank {r} waits on a {q.describe()}" +
                 (" (that rank has finished)" if q.peer in self._finished else "")
                 for r, q in sorted(waits.items())]
        head = ("deadlock: wait-for cycle " + " -> ".join(map(str, cycle))
                if cycle else "deadlock: every live rank waits on a rank that has finished")
        self._error = DeadlockError(head + "\n" + "\n".join(lines))
        self._wake_all()

    def _complete(self, rank: int, reqs: list, what: str) -> None:
        """Post ``reqs`` for ``rank`` and block until all are matched."""
        with self._lock:
            if self._error is not None:
                raise self._error
            for req in reqs:
                if isinstance(req, _Request):
                    self._post(req)
            if not all(r.done for r in reqs):
                me = threading.get_ident()
                self._waiting[rank][me] = reqs
                self._active[rank] -= 1
                self._detect_deadlock()
                deadline = None if self.timeout is None else time.monotonic() + self.timeout
                try:
                    while not all(r.done for r in reqs):
                        if self._error is not None:
                            raise self._error
                        left = None if deadline is None else deadline - time.monotonic()
                        if left is not None and left <= 0:
                            pending = next(r for r in reqs if not r.done)
                            raise CollectiveTimeout(
                                f"rank {rank}: {what} timed out after {self.timeout:g} s waiting "
                                f"on a {pending.describe()}"
                            )
                        self._wake[rank].wait(left)
                finally:
                    self._waiting[rank].pop(me, None)
                    self._active[rank] += 1
            if self._error is not None:
                raise self._error
            steps = [r.step for r in reqs if isinstance(r, _Request)]
            if steps:
                self._clock[rank] = max(self._clock[rank], *steps)

    def _request(self, kind, rank, peer, tag, comm, buf) -> _Request:
        return _Request(kind, rank, peer, tag, comm, buf, self._clock[rank])

    def _split(self, t: "SimTransport", color, key) -> "SimTransport | None":
        ident = (t.comm, t._split_seq)
        t._split_seq += 1
        with self._lock:
            rv = self._splits.setdefault(
                ident, {"members": list(t.members), "arrived": {}, "result": None}
            )
            rv["arrived"][t.world_rank] = (color, key, t.rank)
            if len(rv["arrived"]) == len(rv["members"]):
                rv["result"] = self._make_groups(rv["arrived"])
                for w in rv["members"]:
                    self._wake[w].notify_all()
        self._complete(t.world_rank, [_SplitRequest(rv, t.world_rank)], "split")
        with self._lock:
            rv["taken"] = rv.get("taken", 0) + 1
            if rv["taken"] == len(rv["members"]):
                del self._splits[ident]
        comm, members = rv["result"].get(t.world_rank, (None, None))
        if comm is None:
            return None
        return SimTransport(self, comm, members, members.index(t.world_rank))

    def _make_groups(self, arrived: dict) -> dict:
        groups: dict[int, list] = defaultdict(list)
        for w, (color, key, rank) in arrived.items():
            if color is not None and color >= 0:
                groups[color].append((key, rank, w))
        result: dict[int, tuple] = {}
        for color in sorted(groups):
            members = [w for _, _, w in sorted(groups[color])]
            comm = self._next_comm
            self._next_comm += 1
            for w in members:
                result[w] = (comm, members)
        return result

    def _record_reduction(self, rank: int, elements: int) -> None:
        with self._lock:
            self.ledger.reductions.append(Reduction(rank, elements, self._clock[rank]))

    def _pending_for(self, comm: int, rank: int) -> list:
        with self._lock:
            return [q for (c, _, dst, _), dq in self._sends.items() if c == comm and dst == rank
                    for q in dq]


def _find_cycle(edges: dict[int, int]) -> list[int]:
    """Return a cycle in a functional graph ``rank -> rank it waits on``, or []."""
    for start in edges:
        seen: list[int] = []
        node = start
        while node in edges and node not in seen:
            seen.append(node)
            node = edges[node]
        if node in seen:
            return seen[seen.index(node):] + [node]
    return []


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
        self.world._complete(self.world_rank, [req], self._what())
        self.traffic.add(view.nbytes, -1)

    def recv(self, buf, source: int, tag: int = 0) -> None:
        view = as_bytes(buf)
        req = self.world._request("recv", self.world_rank, self._peer(source),
                                  self._wire_tag(tag), self.comm, view)
        self.world._complete(self.world_rank, [req], self._what())
        self.traffic.add(-1, view.nbytes)

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0) -> None:
        w = self.world
        wire = self._wire_tag(tag)
        sending, view = as_bytes(sendbuf), as_bytes(recvbuf)
        reqs = [
            w._request("send", self.world_rank, self._peer(dest), wire, self.comm, sending),
            w._request("recv", self.world_rank, self._peer(source), wire, self.comm, view),
        ]
        w._complete(self.world_rank, reqs, self._what())
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

    def activity(self, delta: int) -> None:
        self.world.activity(self.world_rank, delta)

    def unreceived(self) -> list[str]:
        """Return a description of every message sent to this rank and not yet received."""
        return [q.describe().replace("send of", f"message from rank {q.rank} of")
                for q in self.world._pending_for(self.comm, self.world_rank)]
