"""The real transport: mpi4py's upper-case buffer calls over a duplicated communicator.

Bytes travel as ``MPI.BYTE``: no pickling on the data path, and every NumPy dtype
(bfloat16 and float8 from ml_dtypes included) moves unchanged. mpi4py 4 switches
to MPI-4's large-count calls by itself, so messages over 2**31 bytes need nothing
special here.
"""

from __future__ import annotations

import numpy as np

from ..errors import RefcollError
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
    """

    def __init__(self, comm=None, *, dup: bool = True):
        super().__init__()
        MPI = _mpi()
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

    def send(self, buf, dest: int, tag: int = 0) -> None:
        self.comm.Send([as_bytes(buf), _mpi().BYTE], dest, self._wire_tag(tag))

    def recv(self, buf, source: int, tag: int = 0) -> None:
        MPI = _mpi()
        view = as_bytes(buf)
        self.comm.Recv([view, MPI.BYTE], source, self._wire_tag(tag), self._status)
        self._check_count(view, source)

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0) -> None:
        MPI = _mpi()
        wire = self._wire_tag(tag)
        view = as_bytes(recvbuf)
        self.comm.Sendrecv([as_bytes(sendbuf), MPI.BYTE], dest, wire,
                           [view, MPI.BYTE], source, wire, self._status)
        self._check_count(view, source)

    def _check_count(self, view: np.ndarray, source: int) -> None:
        got = self._status.Get_count(_mpi().BYTE)
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
        t = MPITransport(sub, dup=False)
        t._owned = True  # created here, so freed here
        return t

    def split_node(self) -> "MPITransport":
        """Return the transport of the ranks on this rank's node (``MPI.COMM_TYPE_SHARED``)."""
        MPI = _mpi()
        return MPITransport(self.comm.Split_type(MPI.COMM_TYPE_SHARED, self.rank), dup=False)

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
