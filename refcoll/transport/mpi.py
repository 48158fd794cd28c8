"""The real transport: mpi4py's upper-case buffer calls over a duplicated communicator.

Bytes travel as ``MPI.BYTE``: no pickling on the data path, and every NumPy dtype
(bfloat16 and float8 from ml_dtypes included) moves unchanged. mpi4py 4 switches
to MPI-4's large-count calls by itself, so messages over 2**31 bytes need nothing
special here.

A repeated exchange can be made persistent (:meth:`MPITransport.persistent`,
``MPI_Send_init``/``MPI_Recv_init``): the plans of :mod:`refcoll.calls.plans` run on them.

A rank that cannot go on with a communicator's calls (a plan misused on it
alone) revokes the transport (:meth:`MPITransport.revoke`, as ULFM's
``MPI_Comm_revoke``): a notice goes to every other rank, whose next wait that
cannot complete reads it and raises :class:`~refcoll.core.errors.PeerFailure`
naming the rank and the reason, instead of waiting for its deadline.
"""

from __future__ import annotations

import atexit
import os
import time

import numpy as np

from ..core.errors import PeerFailure, RefcollError
from .base import TAGS_PER_CALL, TransportBase, as_bytes, default_timeout
from .deadline import POLLS_BEFORE_YIELD, bounded_barrier, duplicate, mpi, timed_out
from .hosts import exchange_hosts, hosts_of_split, peer_name

__all__ = ["MPITransport", "PersistentExchange", "transport_for"]


_mpi = mpi

#: A progress thread (:mod:`refcoll.calls.progress`) waits patiently: past this many
#: polls of one wait it sleeps :data:`PATIENT_SLEEP` seconds between polls, handing the
#: core (and the GIL) to the computation beside it; 0 makes it spin like the caller
#: (benchmarks/nonblocking.py measures both).
PATIENT_POLLS = 200
PATIENT_SLEEP = 50e-6

#: Tag slots kept for persistent exchanges, used one epoch at a time
#: (:meth:`MPITransport.new_persistent_epoch`).
PERSISTENT_EPOCHS = 16

#: Bytes of a revocation notice (:meth:`MPITransport.revoke`): UTF-8 text, zero-padded.
NOTICE_BYTES = 512

#: Polls of a wait between two looks for a revocation notice (an MPI_Iprobe: made at
#: every poll, it slowed the battery by a third with more ranks than cores).
NOTICE_POLLS = 64


def _message(buf) -> list:
    """Return the MPI message of a contiguous array: its bytes, as ``MPI.BYTE`` (no copy)."""
    if buf.dtype.kind == "V" or not buf.flags.c_contiguous:
        buf = as_bytes(buf)  # ml_dtypes' types export no buffer; as_bytes refuses gaps
    return [buf, _mpi().BYTE]


class MPITransport(TransportBase):
    """A :class:`~refcoll.transport.base.Transport` over an mpi4py communicator.

    Args:
        comm: any intracommunicator; ``None`` means ``MPI.COMM_WORLD``.
        dup: duplicate ``comm`` (the default) so refcoll's messages can never
            match the application's.
        timeout: seconds any one blocking wait may take before
            :class:`~refcoll.core.errors.CollectiveTimeout`; default ``REFCOLL_TIMEOUT``
            or 300 (``REFCOLL_TIMEOUT=0``: wait forever).
    """

    def __init__(self, comm=None, *, dup: bool = True, timeout: float | None = None,
                 collective: str | None = None):
        super().__init__()
        MPI = _mpi()
        self.timeout = timeout if timeout is not None else default_timeout()
        comm = MPI.COMM_WORLD if comm is None else comm
        self.comm = duplicate(comm, self.timeout, collective) if dup else comm
        self._owned = dup
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        # Every rank's host, named by a wait that times out (a split's: its parent's).
        self.hosts = exchange_hosts(self.comm, self.timeout, collective) if dup else []
        self.thread_multiple = self.concurrent_phases = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        tag_ub = self.comm.Get_attr(MPI.TAG_UB) or 32767
        # Ordinary calls cycle through the tag slots but the last few, which
        # persistent exchanges keep for themselves, one epoch at a time
        # (new_persistent_epoch; MPI guarantees TAG_UB >= 32767: 32 slots).
        # The last slot is the revocation notices' (revoke).
        slots = (int(tag_ub) + 1) // TAGS_PER_CALL - 1
        self._epochs = max(1, min(PERSISTENT_EPOCHS, slots // 2))
        self._tag_slots = max(1, slots - self._epochs)
        self._notice_tag = (self._tag_slots + self._epochs) * TAGS_PER_CALL
        self.revoked: str | None = None  # why, once this rank or a peer revoked the transport
        self._revoked_at = 0  # the call revoked: calls before it still complete
        self._notice, self._notice_status = np.zeros(NOTICE_BYTES, np.uint8), MPI.Status()
        self._notices_sent: list = []
        self._epoch = 0
        self._persistent_tags = self._tag_slots * TAGS_PER_CALL
        # The communicator persistent exchanges are made on: this one, until every
        # reserved slot has had its epoch (then a duplicate, new_persistent_epoch).
        self._persistent_comm = self.comm
        self._persistent: list[PersistentExchange] = []
        self._abandoned, self._kept_comms = False, []  # see new_persistent_epoch
        # Reused by every wait: the first request's status (a receive's) is read after.
        self._statuses = [MPI.Status(), MPI.Status()]

    def __repr__(self) -> str:
        return f"MPITransport(rank={self.rank}, size={self.size})"

    def peer(self, rank: int) -> str:  # a wait's message: "rank 2 (host node2)"
        return peer_name(self.hosts, rank)

    # Every blocking call is a nonblocking one waited by the deadline (_finish): no hang.

    def send(self, buf, dest: int, tag: int = 0) -> None:
        req = self.comm.Isend(_message(buf), dest, self._wire_tag(tag))
        self._finish([req], lambda: f"to send {buf.nbytes} B to {self.peer(dest)} (tag {tag})")
        self.traffic.add(buf.nbytes, -1)

    def recv(self, buf, source: int, tag: int = 0) -> None:
        req = self.comm.Irecv(_message(buf), source, self._wire_tag(tag))
        self._finish([req], lambda: f"to receive {buf.nbytes} B from {self.peer(source)} "
                                   f"(tag {tag})")
        self._check_count(buf.nbytes, source)
        self.traffic.add(-1, buf.nbytes)

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0) -> None:
        wire = self._wire_tag(tag)
        reqs = [self.comm.Irecv(_message(recvbuf), source, wire),
                self.comm.Isend(_message(sendbuf), dest, wire)]
        self._finish(reqs, lambda: f"to receive {recvbuf.nbytes} B from {self.peer(source)} and "
                                   f"send {sendbuf.nbytes} B to {self.peer(dest)} (tag {tag})")
        self._check_count(recvbuf.nbytes, source)
        self.traffic.add(sendbuf.nbytes, recvbuf.nbytes)

    def persistent(self, sends, recvs, what: str = "persistent") -> "PersistentExchange":
        """Return one exchange over fixed buffers, as MPI persistent requests.

        ``sends`` and ``recvs`` are lists of ``(buf, peer, tag)`` (at most one
        of each); calling the result runs the exchange, as :meth:`sendrecv`
        would, with the same deadline and byte-count check. The buffers must
        stay alive and in place while it exists. Its tags live in a slot no
        ordinary call uses; ranks must run their persistent exchanges in the
        same order, as they run their calls. ``what`` names the exchange in a
        timeout's message.
        """
        exchange = PersistentExchange(self, sends, recvs, what)
        self._persistent.append(exchange)
        return exchange

    def new_persistent_epoch(self) -> None:
        """Move the persistent exchanges made from now on to the next reserved tag slot.

        Every rank calls it at the same point (after an argument agreement that
        every rank saw fail), so the messages a failed call left unmatched in
        the old slot can never be taken by a later exchange. Once every reserved
        slot has had its epoch, the slots would come round again to messages still
        unreceived there: instead the persistent exchanges move to a duplicate of
        the communicator (``MPI_Comm_idup``, by the deadline; every rank is here),
        where no old message can match at all. The previous duplicate is kept, not
        freed, and so is every communicator of a transport that has been here
        (:meth:`free`): MPI gives a freed communicator's context to the next one
        made, where a message a failed call left would match a receive not its own.
        """
        self._abandoned = True
        self._epoch = (self._epoch + 1) % self._epochs
        self._persistent_tags = (self._tag_slots + self._epoch) * TAGS_PER_CALL
        if self._epoch == 0:
            old, self._persistent_comm = self._persistent_comm, duplicate(
                self.comm, self.timeout, self.current_call)
            if old is not self.comm:
                self._kept_comms.append(old)  # never freed: see above

    def revoke(self, reason: str) -> None:
        """Tell every other rank that this rank cannot go on with this transport's calls.

        ULFM's ``MPI_Comm_revoke``: a notice of ``reason`` goes to every other
        rank; a peer waiting in this rank's next call (the one it refuses) or a
        later one, for a message this rank will never send, reads it and raises
        :class:`~refcoll.core.errors.PeerFailure` at once. From that call on
        every exchange on the transport, here and there, raises: what was in
        flight cannot be told apart from what is new. A peer still finishing an
        earlier call (this rank finished it) is left to finish it.
        """
        if self.revoked is not None:
            return
        self.revoked, self._revoked_at = reason, self._calls
        if self.size == 1:
            return
        MPI = _mpi()
        text = np.zeros(NOTICE_BYTES, np.uint8)
        data = f"{self._calls} {reason}".encode()[:NOTICE_BYTES]
        text[:len(data)] = np.frombuffer(data, np.uint8)
        self._notices_sent.extend(self.comm.Isend([text, MPI.BYTE], peer, self._notice_tag)
                                  for peer in range(self.size) if peer != self.rank)
        self._notices_sent.append(text)  # MPI reads it until the sends complete

    def _noticed(self) -> bool:
        """Return whether a peer's revocation notice has come (its reason now in ``revoked``).

        Probed for, not received into a standing request: only a wait that is
        not complete at once looks, and a transport dropped without
        :meth:`free` leaves nothing posted behind.
        """
        if self.size == 1 or self.revoked is not None:
            return False
        MPI, status = _mpi(), self._notice_status
        if not self.comm.Iprobe(MPI.ANY_SOURCE, self._notice_tag, status):
            return False
        self.comm.Recv([self._notice, MPI.BYTE], status.Get_source(), self._notice_tag, status)
        at, _, text = self._notice.tobytes().rstrip(bytes(1)).decode(errors="replace").partition(" ")
        self.revoked = f"rank {self._notice_status.Get_source()} revoked the communicator: {text}"
        self._revoked_at = int(at)
        return True

    def _stopped(self) -> bool:
        """Return whether the current call is revoked (a peer's notice read, if one came)."""
        if self.revoked is None:
            self._noticed()
        return self.revoked is not None and self._calls > self._revoked_at

    def _check_revoked(self) -> None:
        """Raise if this transport is revoked for the current call (a notice read first)."""
        if self._stopped():
            raise PeerFailure(f"rank {self.rank}: {self.current_call or 'a call'} cannot "
                              f"complete: {self.revoked}")

    def _finish(self, reqs: list, waiting_for) -> None:
        """Complete ``reqs`` by the deadline; the first one's status lands in ``_statuses[0]``."""
        MPI = _mpi()
        self._ops += 1
        statuses = self._statuses
        if self.revoked is not None and self._calls > self._revoked_at:
            self._withdraw(reqs)
            self._check_revoked()
        if self.timeout is None:
            MPI.Request.Waitall(reqs, statuses)
            return
        if MPI.Request.Testall(reqs, statuses):
            return
        deadline = time.monotonic() + self.timeout
        polls = 0
        patient = self.patient and PATIENT_POLLS > 0  # read here: a benchmark may set it
        while not MPI.Request.Testall(reqs, statuses):
            polls += 1
            if polls % NOTICE_POLLS == 0 and self._stopped():  # a peer gave up on this call
                self._withdraw(reqs)
                self._check_revoked()
            if patient and polls > PATIENT_POLLS:
                time.sleep(PATIENT_SLEEP)  # a progress thread: leave the core to the computation
            elif polls > POLLS_BEFORE_YIELD:
                os.sched_yield()  # let an oversubscribed peer run
            if time.monotonic() > deadline:
                timed_out(
                    f"rank {self.rank}: {self.current_call or 'point-to-point'} timed out after "
                    f"{self.timeout:g} s at its exchange {self._ops} of this call, still waiting "
                    f"{waiting_for()}; that rank may be dead, slow, or in a different call "
                    "(set REFCOLL_TIMEOUT to wait longer)"
                )

    def _release_notices(self) -> None:
        """Release the revocation notices sent (an active send completes on its own)."""
        for sent in self._notices_sent:
            if hasattr(sent, "Free"):
                sent.Free()
        self._notices_sent = []

    @staticmethod
    def _withdraw(reqs: list) -> None:
        """Cancel the receives among ``reqs`` that are still waiting: their call is abandoned."""
        for req in reqs:
            try:
                if not req.Test():
                    req.Cancel()
                    req.Wait()
            except _mpi().Exception:
                pass  # completed in error, or a send: it completes on its own

    def _check_count(self, nbytes: int, source: int) -> None:
        """Check the byte count of the receive the last wait completed (its first request)."""
        got = self._statuses[0].Get_count(_mpi().BYTE)
        if got != nbytes:
            raise RefcollError(
                f"rank {self.rank}: expected {nbytes} B from rank {source}, got {got} B; "
                "the ranks disagree on the message size (different counts or dtypes?)"
            )

    def split(self, color: int, key: int) -> "MPITransport | None":
        """Return the transport of the ranks that passed ``color`` (``MPI_Comm_split``).

        MPI has no nonblocking split, so a deadline-bounded ``MPI_Ibarrier`` runs first:
        a rank that never comes is a :class:`CollectiveTimeout`, not a hang in the split.
        """
        MPI = _mpi()
        self._setup_barrier("MPI_Comm_split")
        sub = self.comm.Split(MPI.UNDEFINED if color is None or color < 0 else color, key)
        if sub == MPI.COMM_NULL:
            return None
        return self._child(sub)

    def split_node(self) -> "MPITransport":
        """Return the transport of the ranks on this rank's node (``MPI.COMM_TYPE_SHARED``)."""
        MPI = _mpi()
        self._setup_barrier("MPI_Comm_split_type")
        return self._child(self.comm.Split_type(MPI.COMM_TYPE_SHARED, self.rank))

    def _child(self, sub) -> "MPITransport":
        """Wrap a communicator split from this one: freed here, counted in this traffic."""
        t = MPITransport(sub, dup=False, timeout=self.timeout)
        t._owned = True  # created here, so freed here
        t.hosts = hosts_of_split(self.hosts, self.comm, sub)
        t.traffic = self.traffic
        return t

    def _setup_barrier(self, what: str) -> None:
        """Wait, by the deadline, until every rank has reached the blocking call ``what``."""
        if self.size > 1:
            bounded_barrier(self.comm, f"{self.current_call or 'refcoll'} ({what})",
                            self.timeout, stage="at communicator setup")

    def unreceived(self) -> list[str]:
        """Return a description of a message sent to this rank and not received, if any."""
        MPI = _mpi()
        status = MPI.Status()
        if self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
            return [f"message from rank {status.Get_source()} of "
                    f"{status.Get_count(MPI.BYTE)} B (tag {status.Get_tag()})"]
        return []

    def free(self) -> None:
        """Free the persistent exchanges, then the duplicated communicator.

        A revoked transport's communicators, or one's whose calls failed an agreement,
        are left unfreed: messages of abandoned calls may be on their way, and MPI gives
        a freed communicator's context to the next one made (a small, bounded leak).
        """
        for exchange in list(self._persistent):
            exchange.free()
        self._release_notices()
        if self.comm is not None:
            self._noticed()  # a notice no wait read yet must not outlive its communicator
        if self.revoked is not None or self._abandoned:
            self._persistent_comm = self.comm = None
            return
        if self._persistent_comm is not None and self._persistent_comm is not self.comm:
            self._persistent_comm.Free()
        self._persistent_comm = None
        if self._owned and self.comm is not None:
            self.comm.Free()
            self.comm = None


class PersistentExchange:
    """One send and/or receive over fixed buffers, built once, run many times.

    MPI's persistent requests (``MPI_Send_init``, ``MPI_Recv_init``): a run is
    ``MPI_Startall`` and the transport's deadline wait, nothing built per run.
    Made by :meth:`MPITransport.persistent`.
    """

    def __init__(self, t: MPITransport, sends, recvs, what: str = "persistent"):
        if len(sends) > 1 or len(recvs) > 1:
            raise ValueError("a persistent exchange holds at most one send and one receive")
        base = t._persistent_tags
        for _, _, tag in (*sends, *recvs):
            if not 0 <= tag < TAGS_PER_CALL:
                raise ValueError(f"tag {tag} out of range: algorithms use 0 <= tag < "
                                 f"{TAGS_PER_CALL}")
        self._t = t
        # The receive comes first: its status is the one the byte count is read from.
        comm = t._persistent_comm
        self._requests = ([comm.Recv_init(_message(buf), peer, base + tag)
                           for buf, peer, tag in recvs]
                          + [comm.Send_init(_message(buf), peer, base + tag)
                             for buf, peer, tag in sends])
        self._buffers = [buf for buf, _, _ in (*sends, *recvs)]  # MPI writes and reads them
        self._received = recvs[0][0].nbytes if recvs else -1
        self._source = recvs[0][1] if recvs else None
        self._sent = sends[0][0].nbytes if sends else -1
        waits = ([f"to receive {buf.nbytes} B from {t.peer(peer)}" for buf, peer, _ in recvs]
                 + [f"to send {buf.nbytes} B to {t.peer(peer)}" for buf, peer, _ in sends])
        self._waiting_for = " and ".join(waits) + f" ({what})"
        _UNFREED.add(self)

    def __call__(self) -> None:
        """Run the exchange once; return when its buffers may be read and reused."""
        if not self._requests:
            self._freed()
        _mpi().Prequest.Startall(self._requests)
        self.finish()

    def _freed(self):
        """Refuse to run a freed exchange: with no requests it would "complete" moving nothing."""
        raise RefcollError(f"rank {self._t.rank}: a freed persistent exchange was run "
                           f"({self._waiting_for}); its plan was dropped (its communicator freed, "
                           "or a failed agreement moved the exchanges to a new tag slot)")

    def finish(self) -> None:
        """Complete an exchange begun with :meth:`start`, as :meth:`__call__` does after starting."""
        t = self._t
        t._finish(self._requests, self._describe)
        if self._source is not None:
            t._check_count(self._received, self._source)
        t.traffic.add(self._sent, self._received)

    def cancel(self) -> None:
        """Withdraw an exchange begun with :meth:`start` and free it: its call is abandoned.

        A receive not yet matched is cancelled (``MPI_Cancel``) and completed; a
        send is freed and completes on its own (MPI's rule for active requests).
        """
        if self._source is not None:  # the receive is the first request
            receive = self._requests[0]
            try:
                if not receive.Test():
                    receive.Cancel()
                    receive.Wait()
            except _mpi().Exception:
                pass  # it completed in error (a message too long): it is no longer active
        self.free()

    def start(self) -> None:
        """Start the exchange and return at once (:meth:`test` completes it): a schedule's step."""
        if not self._requests:
            self._freed()
        _mpi().Prequest.Startall(self._requests)
        self._deadline = (None if self._t.timeout is None
                          else time.monotonic() + self._t.timeout)

    def test(self) -> bool:
        """Return whether the started exchange has completed, checking it as ``__call__`` does.

        Past the transport's deadline (counted from :meth:`start`) it times out
        as a blocking wait would.
        """
        t = self._t
        if not _mpi().Request.Testall(self._requests, t._statuses):
            if t._stopped():
                t._withdraw(self._requests)
                t._check_revoked()
            if self._deadline is not None and time.monotonic() > self._deadline:
                timed_out(f"rank {t.rank}: a non-blocking call timed out after {t.timeout:g} s "
                          f"still waiting {self._waiting_for}; that rank may be dead, slow, or in "
                          "a different call (set REFCOLL_TIMEOUT to wait longer)")
            return False
        if self._source is not None:
            t._check_count(self._received, self._source)
        t.traffic.add(self._sent, self._received)
        return True

    def _describe(self) -> str:
        return self._waiting_for

    def free(self) -> None:
        """Free the requests; a running one is freed once it completes (MPI's rule)."""
        for req in self._requests:
            req.Free()
        self._requests = []
        _UNFREED.discard(self)
        if self in self._t._persistent:
            self._t._persistent.remove(self)


#: Persistent exchanges not yet freed. MPICH warns about persistent requests left
#: at MPI_Finalize, which mpi4py runs after Python's exit handlers: free them there.
_UNFREED: set[PersistentExchange] = set()


@atexit.register
def _free_persistent() -> None:
    if _UNFREED and not _mpi().Is_finalized():
        for exchange in list(_UNFREED):
            exchange.free()


_KEYVAL = None


def transport_for(comm=None, collective: str | None = None) -> MPITransport:
    """Return the cached :class:`MPITransport` of an mpi4py communicator.

    The transport is kept as an MPI attribute of ``comm`` (MPI's own caching
    mechanism), so the ``Idup`` happens once per communicator, not once per call,
    and is freed when ``comm`` is. ``collective`` names the call that needed it,
    for the timeout's message when a rank never comes to that first call.
    """
    global _KEYVAL
    MPI = _mpi()
    comm = MPI.COMM_WORLD if comm is None else comm
    if _KEYVAL is None:
        _KEYVAL = MPI.Comm.Create_keyval(delete_fn=lambda c, k, t: t.free())
    t = comm.Get_attr(_KEYVAL)
    if t is None:
        t = MPITransport(comm, collective=collective)
        comm.Set_attr(_KEYVAL, t)
    return t
