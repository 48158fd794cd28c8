"""Every rank's host name, so that a wait that times out names the machine it waited for."""

from __future__ import annotations

import numpy as np

from .deadline import _not_arrived, mpi, wait_by_deadline

__all__ = ["exchange_hosts", "hosts_of_split", "peer_name", "HOST_BYTES"]

#: Bytes of one rank's host name in the exchange.
HOST_BYTES = 64


def exchange_hosts(comm, timeout: float | None, collective: str | None) -> list[str]:
    """Return every rank's host name (an ``MPI_Iallgather`` of fixed records, by the deadline).

    Paid once per communicator refcoll wraps, beside its ``MPI_Comm_idup``; a
    rank that never comes is the same :class:`CollectiveTimeout` as there.
    """
    MPI = mpi()
    name = MPI.Get_processor_name().encode()[:HOST_BYTES]
    if comm.Get_size() == 1:
        return [name.decode(errors="replace")]
    mine = np.zeros(HOST_BYTES, np.uint8)
    mine[:len(name)] = np.frombuffer(name, np.uint8)
    everyone = np.zeros((comm.Get_size(), HOST_BYTES), np.uint8)
    request = comm.Iallgather([mine, MPI.BYTE], [everyone, MPI.BYTE])
    wait_by_deadline(request, timeout, lambda: _not_arrived(
        comm, collective, "MPI_Iallgather of the host names", timeout))
    return [row.tobytes().rstrip(bytes(1)).decode(errors="replace") for row in everyone]


def hosts_of_split(hosts: list[str], comm, sub) -> list[str]:
    """Return the hosts of ``sub``'s ranks, ``sub`` split from ``comm`` (ranks on ``hosts``)."""
    theirs = mpi().Group.Translate_ranks(sub.Get_group(), list(range(sub.Get_size())),
                                         comm.Get_group())
    return [hosts[r] if 0 <= r < len(hosts) else "" for r in theirs]


def peer_name(hosts: list[str], rank: int) -> str:
    """Return ``rank`` as a message names it: ``rank 2 (host node2)``, or ``rank 2``."""
    host = hosts[rank] if 0 <= rank < len(hosts) else ""
    return f"rank {rank} (host {host})" if host else f"rank {rank}"
