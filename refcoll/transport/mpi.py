"""The real transport: mpi4py's upper-case buffer calls over a duplicated communicator.

Bytes travel as ``MPI.BYTE``: no pickling on the data path, and every NumPy dtype
(bfloat16 and float8 from ml_dtypes included) moves unchanged. mpi4py 4 switches
to MPI-4's large-count calls by itself, so messages over 2**31 bytes need nothing
special here.
"""

from __future__ import annotations

import os
import time

import numpy as np

from ..errors import CollectiveTimeout, RefcollError
from .base import TAGS_PER_CALL, TransportBase
from .sim import as_bytes

__all__ = ["MPITransport", "transport_for"]


def _mpi():
    from mpi4py import MPI  # imported lazily: the simulator needs no MPI library

    return MPI


class MPITransport(TransportBase):
    """A :class:`~refcoll.transport.base.Transport` over an mpi4py communicator.

    Args:
        comm: any intracommunicator; ``None`` means ``MPI.COMM_WORLD``.
        dup: duplicate ``comm`` (the default) so refcoll's messages can never
            match the application's.
        timeout: seconds any one blocking wait may take before
            :class:`~refcoll.errors.CollectiveTimeout`; default ``REFCOLL_TIMEOUT``
            or 300 (``REFCOLL_TIMEOUT=0``: wait forever).
    """

    def __init__(self, comm=None, *, dup: bool = True, timeout: float | None = None):
        super().__init__()
        MPI = _mpi()
        self.timeout = timeout if timeout is not None else default_timeout()
        comm = MPI.COMM_WORLD if comm is None else comm
        self.comm = comm.Dup() if dup else comm
        self._owned = dup
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        tag_ub = self.comm.Get_attr(MPI.TAG_UB) or 32767
        self._tag_slots = max(1, (int(tag_ub) + 1) // TAGS_PER_CALL)
        self._status = MPI.Status()

    def __repr__(self) -> str:
        return f"MPITransport(rank={self.rank}, size={self.size})"

    # Every blocking call is a nonblocking one completed by _finish, which waits
    # with a deadline: a dead or disagreeing peer ends in CollectiveTimeout, not a hang.

    def send(self, buf, dest: int, tag: int = 0) -> None:
        view = as_bytes(buf)
        req = self.comm.Isend([view, _mpi().BYTE], dest, self._wire_tag(tag))
        self._finish([req], lambda: f"to send {view.nbytes} B to rank {dest} (tag {tag})")
        self.traffic.add(view.nbytes, -1)

    def recv(self, buf, source: int, tag: int = 0) -> None:
        view = as_bytes(buf)
        req = self.comm.Irecv([view, _mpi().BYTE], source, self._wire_tag(tag))
        self._finish([req], lambda: f"to receive {view.nbytes} B from rank {source} (tag {tag})")
        self._check_count(view, source, self._status)
        self.traffic.add(-1, view.nbytes)

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0) -> None:
        MPI = _mpi()
        wire = self._wire_tag(tag)
        view = as_bytes(recvbuf)
        sending = as_bytes(sendbuf)
        reqs = [self.comm.Irecv([view, MPI.BYTE], source, wire),
                self.comm.Isend([sending, MPI.BYTE], dest, wire)]
        self._finish(reqs, lambda: f"to receive {view.nbytes} B from rank {source} and send "
                                   f"{sending.nbytes} B to rank {dest} (tag {tag})")
        self._check_count(view, source, self._status)
        self.traffic.add(sending.nbytes, view.nbytes)

    def _finish(self, reqs: list, waiting_for) -> None:
        """Complete ``reqs`` (the first one's status lands in ``self._status``) by the deadline."""
        MPI = _mpi()
        self._ops += 1
        statuses = [self._status] + [MPI.Status() for _ in reqs[1:]]
        if self.timeout is None:
            MPI.Request.Waitall(reqs, statuses)
            return
        if MPI.Request.Testall(reqs, statuses):
            return
        deadline = time.monotonic() + self.timeout
        polls = 0
        while not MPI.Request.Testall(reqs, statuses):
            polls += 1
            if polls > 100:
                os.sched_yield()  # let an oversubscribed peer run
            if time.monotonic() > deadline:
                raise CollectiveTimeout(
                    f"rank {self.rank}: {self.current_call or 'point-to-point'} timed out after "
                    f"{self.timeout:g} s at its exchange {self._ops} of this call, still waiting "
                    f"{waiting_for()}; that rank may be dead, slow, or in a different call "
                    "(set REFCOLL_TIMEOUT to wait longer)"
                )

    def _check_count(self, view: np.ndarray, source: int, status) -> None:
        got = status.Get_count(_mpi().BYTE)
        if got != view.nbytes:
            raise RefcollError(
                f"rank {self.rank}: expected {view.nbytes} B from rank {source}, got {got} B; "
                "the ranks disagree on the message size (different counts or dtypes?)"
            )

    def split(self, color: int, key: int) -> "MPITransport | None":
        MPI = _mpi()
        sub = self.comm.Split(MPI.UNDEFINED if color is None or color < 0 else color, key)
        if sub == MPI.COMM_NULL:
            return None
        t = MPITransport(sub, dup=False, timeout=self.timeout)
        t._owned = True  # created here, so freed here
        t.traffic = self.traffic
        return t

    def split_node(self) -> "MPITransport":
        """Return the transport of the ranks on this rank's node (``MPI.COMM_TYPE_SHARED``)."""
        MPI = _mpi()
        t = MPITransport(self.comm.Split_type(MPI.COMM_TYPE_SHARED, self.rank), dup=False,
                         timeout=self.timeout)
        t._owned = True
        t.traffic = self.traffic
        return t

    def unreceived(self) -> list[str]:
        """Return a description of a message sent to this rank and not received, if any."""
        MPI = _mpi()
        status = MPI.Status()
        if self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
            return [f"message from rank {status.Get_source()} of "
                    f"{status.Get_count(MPI.BYTE)} B (tag {status.Get_tag()})"]
        return []

    def free(self) -> None:
        """Free the duplicated communicator."""
        if self._owned and self.comm is not None:
            self.comm.Free()
            self.comm = None


#: Seconds a blocking wait may take when neither ``timeout=`` nor ``REFCOLL_TIMEOUT`` says.
DEFAULT_TIMEOUT = 300.0


def default_timeout() -> float | None:
    """Return ``REFCOLL_TIMEOUT`` in seconds (``0`` or ``none``: wait forever), else 300."""
    value = os.environ.get("REFCOLL_TIMEOUT")
    if value is None:
        return DEFAULT_TIMEOUT
    if value.strip().lower() in ("0", "none", "inf", ""):
        return None
    return float(value)


_KEYVAL = None


def transport_for(comm=None) -> MPITransport:
    """Return the cached :class:`MPITransport` of an mpi4py communicator.

    The transport is kept as an MPI attribute of ``comm`` (MPI's own caching
    mechanism), so the ``Dup`` happens once per communicator, not once per call,
    and is freed when ``comm`` is.
    """
    global _KEYVAL
    MPI = _mpi()
    comm = MPI.COMM_WORLD if comm is None else comm
    if _KEYVAL is None:
        _KEYVAL = MPI.Comm.Create_keyval(delete_fn=lambda c, k, t: t.free())
    t = comm.Get_attr(_KEYVAL)
    if t is None:
        t = MPITransport(comm)
        comm.Set_attr(_KEYVAL, t)
    return t
