"""The MPI library's own collectives: the baseline ``refcoll bench`` times beside refcoll's.

:data:`BASELINES` names the MPI function that does each refcoll collective;
:func:`mpi_unavailable` says why one cannot run (a type MPI lacks, device buffers
without a CUDA-aware MPI); :func:`mpi_call` returns the zero-argument call of it on
given buffers, resolved once so that timing it times the library alone. NCCL's
half of the baseline is :mod:`refcoll.baselines.nccl`.
"""

from __future__ import annotations

from typing import Callable

from ..core.ops import dtype_name, get_dtype, get_op
from ..transport import cuda_aware

__all__ = ["BASELINES", "mpi_unavailable", "mpi_call"]

#: The MPI library's own collective that each refcoll collective is timed against.
BASELINES = {
    "allreduce": "MPI_Allreduce",
    "reduce_scatter": "MPI_Reduce_scatter_block",
    "allgather": "MPI_Allgather",
    "broadcast": "MPI_Bcast",
    "reduce": "MPI_Reduce",
}


def mpi_unavailable(collective: str, dtype, device: str = "cpu") -> str | None:
    """Return why the MPI library's ``collective`` cannot run here (None: it can).

    MPI has no type for bfloat16 and float8. On device buffers (``device="gpu"``)
    it needs a CUDA-aware MPI (:func:`refcoll.transport.cuda_aware.cuda_aware`,
    the same answer on every rank of a job, as its sources are).
    """
    dt = get_dtype(dtype)
    try:
        from mpi4py import MPI

        MPI.Datatype.fromcode(dt.char)
    except (ImportError, ValueError, KeyError):
        return f"MPI has no {dtype_name(dt)} type"
    if device == "gpu":
        aware, why = cuda_aware.cuda_aware()
        if not aware:
            return f"{BASELINES[collective]} on device buffers needs a CUDA-aware MPI ({why})"
    return None


def mpi_call(comm, collective: str, sendbuf, recvbuf, *, op: str = "sum",
             root: int = 0) -> Callable[[], None]:
    """Return the zero-argument call of the MPI library's ``collective`` on these buffers.

    The buffers follow refcoll's layout of the collective: ``sendbuf`` this rank's
    input, ``recvbuf`` its result (``count / n`` elements of a reduce-scatter,
    ``n`` inputs of an allgather; the broadcast's one buffer, which the root fills
    first; ``None`` on the non-roots of a reduce). Device buffers are given to
    mpi4py as they are: a CUDA-aware MPI reads them. ``avg`` has no MPI op: the
    call sums.
    """
    from mpi4py import MPI

    mtype = MPI.Datatype.fromcode(sendbuf.dtype.char)  # predefined: the ops apply
    mop = {"sum": MPI.SUM, "avg": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN,
           "max": MPI.MAX}[get_op(op).name]
    x, theirs = [sendbuf, mtype], [recvbuf, mtype] if recvbuf is not None else None
    if collective == "allreduce":
        return lambda: comm.Allreduce(x, theirs, op=mop)
    if collective == "reduce_scatter":
        return lambda: comm.Reduce_scatter_block(x, theirs, op=mop)
    if collective == "allgather":
        return lambda: comm.Allgather(x, theirs)
    if collective == "broadcast":
        return lambda: comm.Bcast(theirs, root)
    return lambda: comm.Reduce(x, theirs, op=mop, root=root)
