"""A simulated world that moves no data: each rank runs alone, then the rendezvous is replayed.

:class:`~refcoll.transport.sim.SimWorld` interleaves its ranks because a rank
needs the bytes it receives. A schedule that depends only on the process count,
the rank and the message sizes (every registered algorithm's, for a given count,
dtype and options) needs no bytes to be known: :class:`LedgerWorld` runs each
rank by itself, start to end, on a :class:`LedgerTransport` that only writes down
what it is asked to send, receive and reduce (receive buffers are left as they
are, reductions are not computed), and then replays the rendezvous of those
records as the simulator's matching engine does. The ledger is the simulator's,
message for message and round for round (the Lamport clock of a message depends
only on each rank's program order), and a schedule that would deadlock is
reported with the same wait-for cycle. With no thread per rank and no data, a
ring over 1,024 ranks is two million records and their replay.

It cannot run what needs data or company: ``split`` (hierarchical) is
refused, and the outputs are not computed (:meth:`LedgerWorld.run` returns None
for every rank). SimGrid's SMPI offers the same trade for large runs:
``SMPI_SHARED_MALLOC`` folds every rank's buffers onto one block, so the data is
lost and the communication pattern kept.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Sequence

from ..core.errors import DeadlockError, RefcollError, UsageError
from .base import Ledger, Message, Reduction, TransportBase
from .requests import Request, collector_paused, find_cycle
from .scheduler import RUNNING, RUNNING_LOCK, SimProgress

__all__ = ["LedgerWorld", "LedgerTransport"]


def _nbytes(buf) -> int:
    """Return a transport buffer's size, refusing what every transport refuses (non-contiguous)."""
    if not buf.flags.c_contiguous:
        raise ValueError("transport buffers must be C-contiguous (pass a contiguous view)")
    return buf.nbytes


class _Size:
    """What a recorded request keeps of its buffer for a report: its size."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int):
        self.nbytes = nbytes


class LedgerTransport(TransportBase):
    """One rank of a :class:`LedgerWorld`: records every exchange, moves nothing."""

    def __init__(self, world: "LedgerWorld", rank: int):
        super().__init__()
        self.world = world
        self.rank = self.world_rank = rank
        self.size = world.size
        self.comm = 0
        self.ops: list = []  # batches ((is_send, peer, tag, nbytes), ...) and reductions (int)

    def __repr__(self) -> str:
        return f"LedgerTransport(rank={self.rank}, size={self.size})"

    def _peer(self, peer: int) -> int:
        if not 0 <= peer < self.size:
            raise ValueError(f"rank {self.rank}: peer {peer} is outside 0..{self.size - 1}")
        return peer

    # A batch is a tuple of (is_send, peer, wire tag, bytes): one call's messages.

    def send(self, buf, dest: int, tag: int = 0) -> None:
        nbytes = _nbytes(buf)
        self.ops.append(((True, self._peer(dest), self._wire_tag(tag), nbytes),))
        self.traffic.add(nbytes, -1)

    def recv(self, buf, source: int, tag: int = 0) -> None:
        nbytes = _nbytes(buf)
        self.ops.append(((False, self._peer(source), self._wire_tag(tag), nbytes),))
        self.traffic.add(-1, nbytes)

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0) -> None:
        wire = self._wire_tag(tag)
        out, into = _nbytes(sendbuf), _nbytes(recvbuf)
        self.ops.append(((True, self._peer(dest), wire, out),
                         (False, self._peer(source), wire, into)))
        self.traffic.add(out, into)

    def split(self, color: int, key: int):
        raise UsageError("a ledger-only simulation cannot split a communicator (its ranks run "
                         "one after another); simulate this algorithm with its data")

    def split_node(self):
        return self.split(0, self.rank)

    def reduce_local(self, op, a, b, out) -> None:
        self.ops.append(int(out.size))  # charged, not computed: the data is not there


class LedgerWorld:
    """``size`` simulated ranks whose messages are recorded and matched, without data.

    The arguments :class:`~refcoll.transport.sim.SimWorld` takes, so either can be
    built the same way; ``timeout`` is accepted and unused (nothing waits), and
    ``record_payloads`` is refused (there are no payloads).
    """

    def __init__(self, size: int, *, timeout: float | None = None,
                 ranks_per_node: int | None = None, record_payloads: bool = False,
                 calibration=None):
        if size < 1:
            raise ValueError(f"a world needs at least one rank, got {size}")
        if record_payloads:
            raise ValueError("a ledger-only world moves no bytes, so it has no payloads to record")
        self.size = size
        self.ranks_per_node = ranks_per_node or size
        self.calibration = calibration
        self.timeout = timeout
        self.ledger = Ledger()
        self._ran = False
        self._recorded, self._replay = 0, None  # how far run() has come, for snapshot()
        self._started = 0.0

    def transports(self) -> list[LedgerTransport]:
        """Return one recording transport per rank."""
        return [LedgerTransport(self, r) for r in range(self.size)]

    def run(self, fn: Callable[..., Any], args: Sequence[tuple] | None = None) -> list[None]:
        """Run ``fn(transport, *args[rank])`` on each rank in turn, then replay the messages.

        Returns None for every rank (no output is computed). Raises the first
        rank's own exception, a :class:`DeadlockError` naming the wait-for cycle
        when the rendezvous cannot complete, or the size mismatch of a message.
        """
        if self._ran:
            raise RuntimeError("a LedgerWorld runs once: create a new one for another run")
        self._ran, self._started = True, time.monotonic()
        ops = []
        with RUNNING_LOCK:
            RUNNING.add(self)
        try:
            with collector_paused():
                for rank in range(self.size):  # one rank's transport (and workspaces) at a time
                    t = LedgerTransport(self, rank)
                    fn(t, *(args[rank] if args is not None else ()))
                    ops.append(t.ops)
                    self._recorded += 1
                    del t  # its records are kept; the buffers it cached are not
                self._replay = _Replay(self.ledger, ops)
                self._replay.run()
        finally:
            with RUNNING_LOCK:
                RUNNING.discard(self)
        return [None] * self.size

    def snapshot(self) -> SimProgress:
        """Return how far the run has come: the ranks recorded, then those whose replay has
        finished and the messages matched (read from another thread: a heartbeat's)."""
        elapsed = time.monotonic() - self._started
        replay = self._replay
        if replay is None:
            return SimProgress(self.size, 0, 0, elapsed, recorded=self._recorded)
        return SimProgress(self.size, replay.finished(), len(self.ledger.messages), elapsed)


class _Replay:
    """The rendezvous of recorded batches: SimWorld's matching engine without threads.

    A posted request is a list ``[is_send, rank, peer, tag, nbytes, clock, step]``
    (``step`` 0 until it matches): two million of them for a ring over 1,024
    ranks, so nothing heavier.
    """

    def __init__(self, ledger: Ledger, ops: list[list]):
        self.ledger, self.ops = ledger, ops
        p = len(ops)
        self.pos, self.clock = [0] * p, [0] * p
        self.current: list[list | None] = [None] * p  # the batch a rank waits on
        self.pending = [0] * p
        self.sends: dict[tuple, deque] = {}  # (source, dest, tag) -> unmatched sends
        self.recvs: dict[tuple, deque] = {}  # (source, dest, tag) -> unmatched receives
        self.ready: deque[int] = deque(range(p))

    def finished(self) -> int:
        """Return how many ranks have run all their records."""
        return sum(pos >= len(ops) for pos, ops in zip(self.pos, self.ops))

    def run(self) -> None:
        while self.ready:
            self._advance(self.ready.popleft())
        stuck = [r for r in range(len(self.ops)) if self.pos[r] < len(self.ops[r])]
        if stuck:
            raise self._deadlock(stuck)

    def _advance(self, rank: int) -> None:
        """Run ``rank``'s records from where it stands until it must wait or it ends."""
        ops, reductions = self.ops[rank], self.ledger.reductions
        pos, end = self.pos[rank], len(ops)
        while pos < end:
            entry = ops[pos]
            if entry.__class__ is int:
                reductions.append(Reduction(rank, entry, self.clock[rank]))
                pos += 1
                continue
            clock = self.clock[rank]
            reqs = [[is_send, rank, peer, tag, nbytes, clock, 0]
                    for is_send, peer, tag, nbytes in entry]
            self.current[rank] = reqs
            self.pending[rank] = len(reqs)
            self.pos[rank] = pos
            for req in reqs:
                self._post(req)
            if self.pending[rank]:
                return
            self.clock[rank] = max(clock, *(r[6] for r in reqs))
            self.current[rank] = None
            pos += 1
        self.pos[rank] = pos

    def _post(self, req: list) -> None:
        is_send, rank, peer, tag = req[0], req[1], req[2], req[3]
        if is_send:
            key, mine, theirs = (rank, peer, tag), self.sends, self.recvs
        else:
            key, mine, theirs = (peer, rank, tag), self.recvs, self.sends
        waiting = theirs.get(key)
        if not waiting:
            queue = mine.get(key)
            if queue is None:
                mine[key] = deque((req,))
            else:
                queue.append(req)
            return
        other = waiting.popleft()
        if not waiting:
            del theirs[key]
        send, recv = (req, other) if is_send else (other, req)
        if send[4] != recv[4]:
            raise RefcollError(
                f"size mismatch: rank {send[1]} sent {send[4]} B to rank {recv[1]} "
                f"(tag {send[3]}), which posted a receive of {recv[4]} B; the ranks "
                "disagree on the message size (different counts or dtypes?)")
        step = max(send[5], recv[5]) + 1
        send[6] = recv[6] = step
        self.ledger.messages.append(Message(step, send[1], recv[1], send[4], send[3], 0))
        pending = self.pending
        pending[rank] -= 1
        mate = other[1]
        pending[mate] -= 1
        if mate != rank and pending[mate] == 0:
            batch = self.current[mate]
            self.clock[mate] = max(self.clock[mate], *(r[6] for r in batch))
            self.current[mate] = None
            self.pos[mate] += 1
            self.ready.append(mate)

    def _deadlock(self, stuck: list[int]) -> DeadlockError:
        """Return the error SimWorld raises for the same wait: cycle and each rank's wait."""
        finished = {r for r in range(len(self.ops)) if r not in stuck}
        waits = {r: next(Request("send" if q[0] else "recv", r, q[2], q[3], 0, _Size(q[4]), q[5])
                         for q in self.current[r] if not q[6]) for r in stuck}
        cycle = find_cycle({r: q.peer for r, q in waits.items()})
        lines = [f"  rank {r} waits on a {q.describe()}" +
                 (" (that rank has finished)" if q.peer in finished else "")
                 for r, q in sorted(waits.items())]
        head = ("deadlock: wait-for cycle " + " -> ".join(map(str, cycle))
                if cycle else "deadlock: every live rank waits on a rank that has finished")
        return DeadlockError(head + "\n" + "\n".join(lines))
