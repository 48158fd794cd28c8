"""How bytes move: the Transport protocol and its two implementations."""

from .base import TAGS_PER_CALL, Ledger, Message, Reduction, Transport, TransportBase
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


def __getattr__(name):
    # The MPI transport imports mpi4py only when asked for, so the simulator
    # works on machines without an MPI library.
    if name in ("MPITransport", "transport_for"):
        from . import mpi

        return getattr(mpi, name)
    raise AttributeError(name)
