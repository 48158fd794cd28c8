"""NCCL, the baseline ``refcoll bench --against nccl`` times beside refcoll.

:func:`nccl_comm`, :func:`nccl_call` (every collective NCCL has),
:func:`nccl_allreduce`; CuPy's ``cupy.cuda.nccl`` bindings underneath.
"""

from __future__ import annotations

import importlib

import numpy as np

from ..core.errors import UsageError
from ..core.ops import dtype_name, get_op
from ..core.xp import array_namespace, require_cupy
from ..transport.deadline import bounded_barrier

__all__ = ["NCCL_CALLS", "require_nccl", "nccl_version", "nccl_comm", "nccl_call",
           "nccl_allreduce", "nccl_types"]


#: ncclDataType_t and ncclRedOp_t from nccl.h, by refcoll's names. bfloat16 and avg
#: need NCCL 2.10; NCCL has no 16-bit integers.
_NCCL_DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
                "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}
_NCCL_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
_NCCL_2_10 = 21000


#: The NCCL function that does each refcoll collective; ``cupy.cuda.nccl``'s
#: ``NcclCommunicator`` calls them allReduce, reduceScatter, allGather, broadcast, reduce.
NCCL_CALLS = {
    "allreduce": "ncclAllReduce",
    "reduce_scatter": "ncclReduceScatter",
    "allgather": "ncclAllGather",
    "broadcast": "ncclBroadcast",
    "reduce": "ncclReduce",
}


def require_nccl(what: str | None = None):
    """Return ``cupy.cuda.nccl``, or raise :class:`UsageError` saying why ``what`` cannot run."""
    require_cupy(what or "NCCL")
    prefix = f"{what}: " if what else ""
    try:
        nccl = importlib.import_module("cupy.cuda.nccl")
    except ImportError as exc:
        raise UsageError(f"{prefix}NCCL is not available to CuPy ({exc})") from None
    if not getattr(nccl, "available", True):
        raise UsageError(f"{prefix}NCCL is not available to CuPy: install the NCCL library "
                         "(pip install nvidia-nccl-cu12, or the one matching CuPy's CUDA)")
    return nccl


def nccl_version() -> str | None:
    """Return the NCCL library's version as ``2.23.4`` (None: no NCCL here).

    NCCL encodes it as ``major·10000 + minor·100 + patch`` since 2.9, as
    ``major·1000 + minor·100 + patch`` before.
    """
    try:
        code = int(require_nccl().get_version())
    except UsageError:
        return None
    if code >= 10000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def nccl_types(dtype, op) -> tuple[int, int]:
    """Return NCCL's ``(datatype, redop)`` codes for a dtype and an op name.

    Raises:
        UsageError: a dtype or op NCCL does not have (16-bit integers, float8;
            bfloat16 and avg before NCCL 2.10).
    """
    name, op_name = dtype_name(dtype), get_op(op).name
    if name not in _NCCL_DTYPES:
        raise UsageError(f"NCCL has no {name} type; NCCL reduces "
                         f"{', '.join(_NCCL_DTYPES)}")
    if name == "bfloat16" or op_name == "avg":
        version = require_nccl().get_version()
        if version < _NCCL_2_10:
            raise UsageError(f"NCCL {version} has no {'bfloat16' if name == 'bfloat16' else 'avg'}"
                             "; it needs NCCL >= 2.10")
    return _NCCL_DTYPES[name], _NCCL_OPS[op_name]


def nccl_comm(mpi_comm):
    """Return an NCCL communicator over the ranks of the mpi4py communicator ``mpi_comm``.

    Rank 0 makes the unique id and MPI broadcasts it; every rank must have
    chosen its GPU first (:func:`check_one_gpu_per_rank`).
    """
    nccl = require_nccl()
    uid = nccl.get_unique_id() if mpi_comm.Get_rank() == 0 else None
    bounded_barrier(mpi_comm, "NCCL communicator setup (MPI_Bcast of the unique id)")
    uid = mpi_comm.bcast(uid, root=0)
    # ncclCommInitRank blocks until every rank joins; all of them passed the barrier.
    return nccl.NcclCommunicator(mpi_comm.Get_size(), uid, mpi_comm.Get_rank())


def nccl_call(comm, collective: str, sendbuf, recvbuf, *, op="sum", root: int = 0):
    """Return a zero-argument call of NCCL's ``collective`` on these device buffers.

    The buffers follow refcoll's layout of the collective: ``sendbuf`` this
    rank's input (what the root sends, in a broadcast), ``recvbuf`` its result
    (``count / n`` elements of a reduce-scatter, ``n`` inputs of an allgather;
    ``None`` on the non-roots of a reduce). Types, counts and the stream are
    resolved here, once, so the call is NCCL's own and nothing else; it is
    queued on the current stream and returns without waiting
    (:func:`synchronize` waits).

    Raises:
        UsageError: host arrays, mismatched dtypes, a dtype or op NCCL lacks, an
            unknown collective.
    """
    xp = array_namespace(sendbuf)
    if xp is np or (recvbuf is not None and array_namespace(recvbuf) is np):
        raise UsageError("NCCL reduces device arrays: pass CuPy arrays")
    if recvbuf is not None and sendbuf.dtype != recvbuf.dtype:
        raise UsageError(f"NCCL needs buffers of one dtype, got {sendbuf.dtype} and "
                         f"{recvbuf.dtype}")
    if collective not in NCCL_CALLS:
        raise UsageError(f"NCCL has no {collective!r}: it runs {', '.join(NCCL_CALLS)}")
    if recvbuf is None and collective != "reduce":
        raise UsageError(f"NCCL {collective} needs a receive buffer on every rank")
    datatype, redop = nccl_types(sendbuf.dtype, op)
    send = sendbuf.data.ptr
    recv = send if recvbuf is None else recvbuf.data.ptr
    stream = xp.cuda.get_current_stream().ptr
    if collective == "allreduce":
        _check_count(sendbuf.size, recvbuf.size, collective)
        count = sendbuf.size
        return lambda: comm.allReduce(send, recv, count, datatype, redop, stream)
    if collective == "reduce_scatter":
        count = recvbuf.size
        _check_count(sendbuf.size, count * comm.size(), collective)
        return lambda: comm.reduceScatter(send, recv, count, datatype, redop, stream)
    if collective == "allgather":
        count = sendbuf.size
        _check_count(count * comm.size(), recvbuf.size, collective)
        return lambda: comm.allGather(send, recv, count, datatype, stream)
    if collective == "broadcast":
        count = recvbuf.size
        _check_count(sendbuf.size, count, collective)
        return lambda: comm.broadcast(send, recv, count, datatype, root, stream)
    count = sendbuf.size
    if recvbuf is not None:
        _check_count(count, recvbuf.size, collective)
    return lambda: comm.reduce(send, recv, count, datatype, redop, root, stream)


def _check_count(have: int, want: int, collective: str) -> None:
    if have != want:
        raise UsageError(f"NCCL {collective}: the buffers hold {have} and {want} elements, "
                         "which its layout does not allow")


def nccl_allreduce(comm, sendbuf, recvbuf, op="sum", *, synchronize: bool = True) -> None:
    """All-reduce the device array ``sendbuf`` into ``recvbuf`` with NCCL (``recvbuf`` may be it).

    Runs on the current stream; with ``synchronize`` (the default) it returns
    once the result is there, as refcoll's calls do, so the two time alike.
    """
    nccl_call(comm, "allreduce", sendbuf, recvbuf, op=op)()
    if synchronize:
        array_namespace(sendbuf).cuda.get_current_stream().synchronize()
