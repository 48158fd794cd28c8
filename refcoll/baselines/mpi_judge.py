"""The MPI library's own collectives judged by the oracle: ``refcoll verify --backend mpi``.

The battery's cases run through the library's ``MPI_Allreduce``,
``MPI_Reduce_scatter_block``, ``MPI_Allgather``, ``MPI_Bcast`` and ``MPI_Reduce``
(:data:`~refcoll.baselines.mpi.BASELINES`), in place (``MPI_IN_PLACE``) and out of
place, on every dtype MPI has a type for and every op it has, and are judged as
every library's own collectives are (:mod:`refcoll.verify.conformance.library`):
bit for bit where the inputs allow it, within the error bound elsewhere, every
rank the same bits, and each float order named by the refcoll orders that give
its bits.

MPI's forms: a reduce-scatter of a count ``p`` divides is
``MPI_Reduce_scatter_block``; of any other count, ``MPI_Reduce_scatter`` with
refcoll's chunks (the first ``n % p`` one element longer) as its receive counts.
In place, ``MPI_Reduce_scatter_block`` and ``MPI_Reduce_scatter`` read the whole
input from the receive buffer and write rank r's chunk at its start;
``MPI_Allgather`` reads rank r's input from its block of the output;
``MPI_Reduce`` in place on the root only; ``MPI_Bcast`` is in place by nature.
MPI has no average op and no bfloat16 or float8 type: those are not supported,
never failed. The verdicts travel on a duplicate of the communicator, so the one
under test carries only the calls under test.
"""

from __future__ import annotations

import numpy as np

from ..core.chunking import chunk_bounds
from ..core.ops import DTYPES
from ..transport.deadline import bounded_barrier, mpi_library_version, watchdog
from ..transport.mpi import MPITransport
from ..verify.conformance.cases import Case
from ..verify.conformance.library import LibraryJudge, LibraryReport
from .mpi import BASELINES, mpi_unavailable

__all__ = ["MPI_CALLS", "IN_PLACE_ONLY", "MPIJudge", "library_name", "judge_mpi",
           "known_refusal"]

#: refcoll's name of each collective -> the MPI function judged.
MPI_CALLS = dict(BASELINES)

#: Collectives MPI offers in place only: ``MPI_Bcast``'s one buffer.
IN_PLACE_ONLY = ("broadcast",)

_EXCHANGE = "refcoll verify --backend mpi"


def library_name() -> str:
    """Return the MPI library's name: ``MPICH``, ``Open MPI``, or its first word."""
    text = mpi_library_version()
    for name in ("Open MPI", "MPICH", "Intel(R) MPI", "MVAPICH", "Cray MPICH"):
        if name in text:
            return name
    return text.split()[0] if text.split() else "MPI"


class MPIJudge(LibraryJudge):
    """The MPI library's collectives on ``comm`` (default ``MPI.COMM_WORLD``), judged on rank 0."""

    calls = MPI_CALLS
    in_place_only = IN_PLACE_ONLY
    sends_off_root = True
    exchange = _EXCHANGE

    def __init__(self, comm=None):
        from mpi4py import MPI

        comm = MPI.COMM_WORLD if comm is None else comm
        self.comm = comm
        version = mpi_library_version()
        # The control transport duplicates comm by the deadline (MPI_Comm_idup): a rank
        # that never comes is a timeout, not a wait for ever.
        super().__init__(rank=comm.Get_rank(), size=comm.Get_size(),
                         ctl=MPITransport(comm, collective=_EXCHANGE), library="mpi",
                         version=version, backend=library_name(), launcher="mpiexec")

    def refusal_errors(self) -> tuple:
        from mpi4py import MPI

        return (MPI.Exception,)  # the library's own refusal; anything else is a defect

    def refusal(self, collective: str, op: str | None, dtype: str) -> str | None:
        return known_refusal(op, dtype) or mpi_unavailable(collective, dtype)

    def _call(self, case: Case, mine: np.ndarray):
        """Run the MPI library's collective of ``case`` on this rank's input."""
        from mpi4py import MPI

        # Every rank is here before the library's blocking call, or the barrier times out:
        # a rank that died or left is named, not waited for ever.
        bounded_barrier(self.ctl.comm, f"{_EXCHANGE} (before {self.calls[case.collective]})")
        x = np.array(mine, dtype=DTYPES[case.dtype], copy=True)
        mtype = MPI.Datatype.fromcode(x.dtype.char)  # predefined: MPI's ops apply
        op = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}.get(case.op)
        comm, rank, p, n = self.comm, self.rank, self.size, x.size
        mine_buf = [x, mtype]
        # The library's call has no deadline, and nothing interrupts it: past
        # REFCOLL_TIMEOUT the watchdog names it and ends the job (exit 3), as bench's does.
        with watchdog(f"the MPI library's {self.calls[case.collective]} ({case.collective}, "
                      f"{case.dtype}, {n} elements)"):
            if case.collective == "allreduce":
                out = x if case.inplace else _pattern(n, x.dtype)
                comm.Allreduce(MPI.IN_PLACE if case.inplace else mine_buf, [out, mtype], op=op)
            elif case.collective == "reduce_scatter":
                counts = [hi - lo for lo, hi in chunk_bounds(n, p)]
                mine_count = counts[rank]
                if case.inplace:  # the whole input in the receive buffer, the chunk at its start
                    out, send = x, MPI.IN_PLACE
                else:
                    out, send = _pattern(mine_count, x.dtype), mine_buf
                if n % p == 0:
                    comm.Reduce_scatter_block(send, [out, mine_count, mtype], op=op)
                else:
                    comm.Reduce_scatter(send, [out, mtype], recvcounts=counts, op=op)
                out = out[:mine_count]
            elif case.collective == "allgather":
                out = _pattern(n * p, x.dtype)
                if case.inplace:
                    out[rank * n:(rank + 1) * n] = x
                    x = out[rank * n:(rank + 1) * n]
                    comm.Allgather(MPI.IN_PLACE, [out, mtype])
                else:
                    comm.Allgather(mine_buf, [out, mtype])
            elif case.collective == "broadcast":
                comm.Bcast(mine_buf, root=case.root)
                out = x
            else:
                if rank == case.root:
                    out = x if case.inplace else _pattern(n, x.dtype)
                    comm.Reduce(MPI.IN_PLACE if case.inplace else mine_buf, [out, mtype], op=op,
                                root=case.root)
                else:
                    comm.Reduce(mine_buf, None, op=op, root=case.root)
                    out = None
        return out, x


def known_refusal(op: str | None, dtype: str) -> str | None:
    """Return why no MPI library runs ``op`` on ``dtype``, known without starting MPI: MPI
    has no average op, and no type for the dtypes NumPy gets from ml_dtypes (bfloat16,
    float8), whose MPI type codes no library defines."""
    if op == "avg":
        return "MPI has no average op (MPI_SUM, then divide)"
    if DTYPES[dtype].isbuiltin != 1:
        return f"MPI has no {dtype} type"
    return None


def _pattern(count: int, dtype) -> np.ndarray:
    """Return an output buffer filled with a pattern no result has (0xa5 bytes)."""
    out = np.empty(count, dtype)
    out.view(np.uint8).fill(0xA5)
    return out


def judge_mpi(comm=None, *, seed: int = 0, **filters) -> LibraryReport:
    """Run the battery on the MPI library's own collectives; return what it found (every rank).

    ``filters`` are :func:`~refcoll.verify.conformance.library.build_library_cases`'s:
    ``judge_mpi(dtypes=["float32"]).failed == 0``.
    """
    judge = MPIJudge(comm)
    return judge.run(judge.cases(**filters), seed=seed)
