"""The real transport: mpi4py's upper-case buffer calls over a duplicated communicator.

Bytes travel as ``MPI.BYTE``: no pickling on the data path, and every NumPy dtype
(bfloat16 and float8 from ml_dtypes included) moves unchanged. mpi4py 4 switches
to MPI-4's large-count calls by itself, so messages over 2**31 bytes need nothing
special here.

Two ideas live beside this data path, each in its own module, and come in as
:class:`MPITransport`'s mixins: persistent exchanges and their tag epochs
(:mod:`refcoll.transport.persistent`, the plans of :mod:`refcoll.calls.plans` run
on them), and revocation (:mod:`refcoll.transport.revocation`: a rank that gives
up on a communicator's calls tells the others, whose waits here raise).
"""

from __future__ import annotations

import os
import time

from ..core.errors import RefcollError, UsageError
from .base import (
    TAGS_PER_CALL,
    TransportBase,
    as_bytes,
    default_timeout,
    tag_text,
    transport_cache,
)
from .deadline import (
    POLLS_BEFORE_YIELD,
    abort_on_timeout,
    bounded_barrier,
    duplicate,
    mpi,
    timed_out,
)
from .hosts import exchange_hosts, hosts_of_split, peer_name
from .persistent import PersistentSlots, plan_slots
from .revocation import NOTICE_POLLS, Revocable

__all__ = ["MPITransport", "transport_for"]


_mpi = mpi

#: A progress thread (:mod:`refcoll.calls.progress`) waits patiently: past this many
#: polls of one wait it sleeps :data:`PATIENT_SLEEP` seconds between polls, handing the
#: core (and the GIL) to the computation beside it; 0 makes it spin like the caller
#: (benchmarks/nonblocking.py measures both).
PATIENT_POLLS = 200
PATIENT_SLEEP = 50e-6


def _message(buf) -> list:
    """Return the MPI message of a contiguous array: its bytes, as ``MPI.BYTE`` (no copy)."""
    if buf.dtype.kind == "V" or not buf.flags.c_contiguous:
        buf = as_bytes(buf)  # ml_dtypes' types export no buffer; as_bytes refuses gaps
    return [buf, _mpi().BYTE]


class MPITransport(Revocable, PersistentSlots, TransportBase):
    """A :class:`~refcoll.transport.base.Transport` over an mpi4py communicator.

    Args:
        comm: any intracommunicator; ``None`` means ``MPI.COMM_WORLD``.
        dup: duplicate ``comm`` (the default) so refcoll's messages can never
            match the application's.
        timeout: seconds any one blocking wait may take before
            :class:`~refcoll.core.errors.CollectiveTimeout`; default ``REFCOLL_TIMEOUT``
            or 300 (``REFCOLL_TIMEOUT=0``: wait forever).
    """

    #: How a buffer becomes an MPI message (persistent exchanges build theirs with it).
    _message = staticmethod(_message)
    #: Polls of a patient wait before it sleeps (``None``: :data:`PATIENT_POLLS`). A
    #: transport whose peers come late by design (watch mode's judging) sleeps sooner.
    patience: int | None = None

    def __init__(self, comm=None, *, dup: bool = True, timeout: float | None = None,
                 collective: str | None = None):
        super().__init__()
        MPI = _mpi()
        self.timeout = timeout if timeout is not None else default_timeout()
        comm = MPI.COMM_WORLD if comm is None else comm
        self.comm = duplicate(comm, self.timeout, collective) if dup else comm
        self._owned = dup
        self._release_when_idle = False  # the user's communicator was freed under calls
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        # Every rank's host, named by a wait that times out (a split's: its parent's).
        self.hosts = exchange_hosts(self.comm, self.timeout, collective) if dup else []
        self.thread_multiple = self.concurrent_phases = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        tag_ub = self.comm.Get_attr(MPI.TAG_UB) or 32767
        # The tag space, in slots of TAGS_PER_CALL (MPI guarantees TAG_UB >= 32767:
        # 32 slots). Ordinary calls cycle through the first slots; persistent
        # exchanges keep the later ones, a slot per plan (plan_slots). The last slot
        # is the revocation notices' (revoke).
        slots = (int(tag_ub) + 1) // TAGS_PER_CALL - 1
        kept = plan_slots(slots)
        self._tag_slots = max(1, slots - kept)
        self._init_persistent(kept)
        self._init_revocation(notice_tag=(self._tag_slots + kept) * TAGS_PER_CALL)
        # Reused by every wait: the first request's status (a receive's) is read after.
        self._statuses = [MPI.Status(), MPI.Status()]

    def __repr__(self) -> str:
        return f"MPITransport(rank={self.rank}, size={self.size})"

    def peer(self, rank: int) -> str:  # a wait's message: "rank 2 (host node2)"
        return peer_name(self.hosts, rank)

    # Every blocking call is a nonblocking one waited by the deadline (_finish): no hang.

    def send(self, buf, dest: int, tag: int = 0) -> None:
        req = self.comm.Isend(_message(buf), dest, self._wire_tag(tag))
        self._finish([req], lambda: f"to send {buf.nbytes} B to {self.peer(dest)} "
                                   f"({tag_text(tag)})")
        self.traffic.add(buf.nbytes, -1)

    def recv(self, buf, source: int, tag: int = 0) -> None:
        req = self.comm.Irecv(_message(buf), source, self._wire_tag(tag))
        self._finish([req], lambda: f"to receive {buf.nbytes} B from {self.peer(source)} "
                                   f"({tag_text(tag)})")
        self._check_count(buf.nbytes, source)
        self.traffic.add(-1, buf.nbytes)

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0) -> None:
        wire = self._wire_tag(tag)
        reqs = [self.comm.Irecv(_message(recvbuf), source, wire),
                self.comm.Isend(_message(sendbuf), dest, wire)]
        self._finish(reqs, lambda: f"to receive {recvbuf.nbytes} B from {self.peer(source)} and "
                                   f"to send {sendbuf.nbytes} B to {self.peer(dest)} "
                                   f"({tag_text(tag)})")
        self._check_count(recvbuf.nbytes, source)
        self.traffic.add(sendbuf.nbytes, recvbuf.nbytes)

    def _finish(self, reqs: list, waiting_for, polls: int = 0) -> None:
        """Complete ``reqs`` by the deadline; the first one's status lands in ``_statuses[0]``.

        ``polls``: how many times the caller already polled them (counted towards the yield).
        """
        MPI = _mpi()
        try:
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
            limit = PATIENT_POLLS if self.patience is None else self.patience  # (read here:
            patient = self.patient and limit > 0  # a benchmark may set PATIENT_POLLS)
            while not MPI.Request.Testall(reqs, statuses):
                polls += 1
                if polls % NOTICE_POLLS == 0 and self._stopped():  # a peer gave up on this call
                    self._withdraw(reqs)
                    self._check_revoked()
                if patient and polls > limit:
                    time.sleep(PATIENT_SLEEP)  # a progress thread: leave the core to the work
                elif polls > POLLS_BEFORE_YIELD:
                    os.sched_yield()  # let an oversubscribed peer run
                if time.monotonic() > deadline:
                    self._time_out(reqs, f"{self.current_call or 'point-to-point'} timed out "
                                         f"after {self.timeout:g} s at its exchange {self._ops} "
                                         f"of this call, still waiting {waiting_for()}")
        except MPI.Exception as exc:
            self._mpi_error(exc, waiting_for)

    def _time_out(self, reqs: list, what: str) -> None:
        """Raise the timeout of the call waiting for ``reqs`` (``what`` timed out), leaving
        nothing of it to complete behind this rank's back (:meth:`_give_up`), unless the
        job is to abort (``REFCOLL_ABORT_ON_TIMEOUT``)."""
        message = (f"rank {self.rank}: {what}; that rank may be dead, slow, or in a "
                   "different call (set REFCOLL_TIMEOUT to wait longer)")
        if not abort_on_timeout():  # the job goes on: nothing left behind it
            self._give_up(reqs, message)
        timed_out(message)

    def _look(self, reqs: list, waiting_for, deadline: float | None) -> None:
        """After a test found a started exchange's ``reqs`` incomplete (a non-blocking call's
        look, which never waits): raise where a peer revoked the call, and past ``deadline``
        (counted from the exchange's start) time out as a blocking wait does."""
        if self._stopped():
            self._withdraw(reqs)
            self._check_revoked()
        if deadline is not None and time.monotonic() > deadline:
            self._time_out(reqs, f"{self.current_call or 'a non-blocking call'} timed out "
                                 f"after {self.timeout:g} s, still waiting {waiting_for()}")

    def deadline(self) -> float | None:
        """Return when an exchange started now times out (``None``: never)."""
        return None if self.timeout is None else time.monotonic() + self.timeout

    def _mpi_error(self, exc, waiting_for) -> None:
        """Raise what MPI's error ``exc`` in a wait or test means: a receive shorter than the
        message that came is the ranks' disagreement on a size (a RefcollError); anything
        else as MPI raised it."""
        MPI = _mpi()
        codes = [exc.Get_error_class()]
        if codes[0] == MPI.ERR_IN_STATUS:  # Testall's: each request's own, in its status
            codes = [MPI.Get_error_class(s.Get_error()) for s in self._statuses]
        if MPI.ERR_TRUNCATE not in codes:
            raise exc
        raise RefcollError(
            f"rank {self.rank}: a message came longer than the buffer, waiting "
            f"{waiting_for()}; the ranks disagree on the message size (different counts "
            "or dtypes?)") from None

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

    def release(self) -> None:
        """The user's communicator was freed (``comm.Free()``): free this transport once the
        calls outstanding on it are done, as ``MPI_Comm_free`` lets pending operations
        complete normally; at once when none is. No new call may start on it from now."""
        self.released = True
        if self._outstanding():
            self._release_when_idle = True
        else:
            self.free()

    def idle(self) -> None:
        if self._release_when_idle and not self._outstanding():
            self._release_when_idle = False
            self.free()

    def _outstanding(self) -> bool:
        """Return whether a non-blocking call or a started plan's run is outstanding here."""
        slots = transport_cache(self, "progress")
        engine = slots.get("engine")
        return slots.get("in_flight") is not None or bool(getattr(engine, "outstanding", 0))

    def free(self) -> None:
        """Free the persistent exchanges, then the duplicated communicator.

        A revoked transport's communicator is left unfreed: messages of abandoned calls
        may be on their way, and MPI gives a freed communicator's context to the next one
        made (a small, bounded leak).
        """
        for exchange in list(self._persistent):
            exchange.free()
        self._release_notices()
        if self.comm is not None:
            self._noticed()  # a notice no wait read yet must not outlive its communicator
        if self.revoked is not None:
            self.comm = None
            return
        if self._owned and self.comm is not None:
            self.comm.Free()
            self.comm = None


_KEYVAL = None


def cached_transport(comm) -> MPITransport | None:
    """Return the :class:`MPITransport` made for ``comm`` (any handle of it), or ``None``: local,
    no rank is asked (:func:`transport_for` makes one, collectively)."""
    return None if _KEYVAL is None else comm.Get_attr(_KEYVAL)


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
    if comm == MPI.COMM_NULL:  # (MPI's own error would be "Invalid communicator")
        raise UsageError("the communicator is MPI.COMM_NULL: freed (comm.Free() makes the "
                         "handle COMM_NULL), or a split this rank is not in; call on a "
                         "communicator this rank belongs to")
    if _KEYVAL is None:
        _KEYVAL = MPI.Comm.Create_keyval(delete_fn=lambda c, k, t: t.release())
    t = comm.Get_attr(_KEYVAL)
    if t is None:
        t = MPITransport(comm, collective=collective)
        comm.Set_attr(_KEYVAL, t)
    return t
