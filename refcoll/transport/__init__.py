"""How bytes move: the Transport protocol, its implementations, and what they keep.

:mod:`~refcoll.transport.base` (the protocol, the ledger, the declared
per-transport cache), :mod:`~refcoll.transport.mpi` (real processes; mpi4py is
imported only when a communicator is wrapped, so the simulator works without an
MPI library), :mod:`~refcoll.transport.sim` (threads in one process),
:mod:`~refcoll.transport.device` and :mod:`~refcoll.transport.cuda_aware` (device
buffers), :mod:`~refcoll.transport.recorder` (recorded schedules replayed).
"""

from .base import TAGS_PER_CALL, Ledger, Message, Reduction, Transport, TransportBase
from .mpi import MPITransport, transport_for
from .sim import SimTransport, SimWorld

__all__ = [
    "Transport",
    "TransportBase",
    "Ledger",
    "Message",
    "Reduction",
    "SimWorld",
    "SimTransport",
    "TAGS_PER_CALL",
    "MPITransport",
    "transport_for",
]
