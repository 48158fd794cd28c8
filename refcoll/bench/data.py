"""The buffers of one size, and the calls timed on them: out of place and in place.

Each rank allocates, per size, its input, refcoll's result, the baselines' result,
the expected result (when checking) and one in-place buffer (:func:`make_data`).
nccl-tests times each size twice: out of place (separate send and receive
buffers), then in place, with the receive buffer laid over the send buffer as
NCCL allows it (``src/common.cu``, ``startColl``): the buffer itself for
all-reduce, broadcast and reduce; this rank's chunk of the input for
reduce-scatter; this rank's block of the output for allgather. refcoll's calls
take the same layouts (``out=x``; ``out=`` a view of chunk ``r``; ``x`` row ``r``
of ``out``), and the MPI library's take ``MPI_IN_PLACE`` (:func:`mpi_in_place_call`,
whose reduce-scatter leaves its chunk at the start of the buffer, as MPI defines).
An in-place call overwrites its input, so the input is copied back into the
buffer before every call, outside the clock (:attr:`InPlace.refill`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..baselines import gloo, nccl
from ..baselines.mpi import mpi_call
from ..calls import collectives as api
from ..compressors.collective import compressed_allreduce
from ..core import xp as xp_module
from ..core.bits import complement
from ..core.chunking import chunk_slice
from ..core.ops import get_dtype, get_op
from ..verify.inputs import make_input, make_inputs
from ..verify.oracle import fold
from .config import BenchConfig, array_module, baseline_op, element_count, reduces
from .options import algorithm_options, registry_name

__all__ = ["Data", "InPlace", "make_data", "our_call", "our_in_place", "base_call",
           "base_in_place", "mpi_in_place_call"]


@dataclass
class InPlace:
    """One rank's in-place buffer and its views (nccl-tests' in-place layout).

    ``buf`` holds the input before each call (:meth:`refill`) and the result
    after it; ``x`` is the input view refcoll's call gets, ``out`` its result view
    (None on the non-roots of a reduce), ``mpi_out`` where ``MPI_IN_PLACE`` leaves
    the result (the start of the buffer, for ``MPI_Reduce_scatter_block``).
    """

    buf: Any
    x: Any
    out: Any
    mpi_out: Any
    source: Any          # the pristine input, copied into ``x`` before every call
    fill: bool = True    # False: a broadcast's non-root (its buffer is only received into)

    def refill(self) -> None:
        """Copy the input back into the buffer (untimed: an in-place call overwrote it)."""
        if self.fill:
            array_namespace = xp_module.array_namespace(self.buf)
            array_namespace.copyto(self.x.reshape(-1), self.source.reshape(-1))


@dataclass
class Data:
    """One rank's buffers for one size and one number of data ranks ``p``.

    ``x``, ``out``, ``theirs`` and ``poison`` are arrays of the device (NumPy or
    CuPy); ``expected`` is always on the host, where results are checked.
    """

    p: int
    count: int                       # elements of the whole array
    x: Any                           # this rank's input (zeros on a switch process)
    out: Any = None                  # refcoll's result (None on a switch, non-roots of reduce)
    theirs: Any = None               # the baseline's result
    expected: np.ndarray | None = None
    poison: Any = None               # expected's complement: what a buffer holds before a call
    inplace: InPlace | None = None   # the in-place buffer (None on a switch process)


def make_data(config: BenchConfig, nbytes: int, p: int, rank: int, root: int = 0) -> Data:
    """Allocate this rank's input and result buffers, and the expected result when checking."""
    xp = array_module(config.device)
    coll, dt = config.collective, get_dtype(config.dtype)
    op = get_op(config.op).name if reduces(coll) else "sum"
    count = element_count(coll, nbytes, dt.itemsize, p)
    in_count = count // p if coll == "allgather" else count
    if rank >= p:  # a switch process: a template of the buffer, no result
        return Data(p, count, xp.zeros(in_count, dt))
    expected = None
    # A compressed all-reduce is lossy and not judged: values a gradient has (exact inputs
    # reach 2**24 / p, past float16's 65504, and a cast to it made infinities and NaNs).
    kind = "random" if config.compressor is not None else "exact"
    if config.check:
        inputs = make_inputs(kind, dt, in_count, p, op=op)
        x = inputs[rank]
        if coll == "allgather":
            expected = np.stack(inputs).reshape(-1)
        elif coll == "broadcast":
            expected = inputs[root]
        elif coll != "reduce" or rank == root:
            full = fold(op, inputs)
            expected = full[chunk_slice(count, p, rank)] if coll == "reduce_scatter" else full
        del inputs
    else:
        x = make_input(kind, dt, in_count, rank, p, op=op)
    shapes = {"allreduce": (count,), "reduce_scatter": (count // p,), "allgather": (p, in_count),
              "broadcast": (count,), "reduce": (count,)}
    x = xp.asarray(x)
    out = xp.empty(shapes[coll], dt) if coll != "reduce" or rank == root else None
    theirs = None
    if coll == "broadcast":
        theirs = x.copy() if rank == root else xp.empty(count, dt)
    elif coll != "reduce" or rank == root:
        theirs = xp.empty(int(np.prod(shapes[coll])), dt)
    poison = xp.asarray(complement(expected)) if expected is not None else None
    inplace = _in_place(coll, xp, x, count, p, rank, root) if config.in_place else None
    xp_module.synchronize(xp)  # the buffers are written before anything reads them
    return Data(p, count, x, out, theirs, expected, poison, inplace)


def _in_place(coll: str, xp, x, count: int, p: int, rank: int, root: int) -> InPlace:
    """Return the in-place buffer of ``coll`` and its views, as NCCL and MPI lay them out."""
    if coll == "allgather":
        buf = xp.empty((p, x.size), x.dtype)
        return InPlace(buf, buf[rank], buf, buf, x)
    buf = xp.empty(count, x.dtype)
    if coll == "reduce_scatter":
        return InPlace(buf, buf, buf[chunk_slice(count, p, rank)], buf[:count // p], x)
    if coll == "reduce":
        out = buf if rank == root else None
        return InPlace(buf, buf, out, out, x)
    if coll == "broadcast":
        return InPlace(buf, buf, buf, buf, x, fill=rank == root)
    return InPlace(buf, buf, buf, buf, x)


def our_call(config: BenchConfig, t, data: Data, algorithm: str, root: int, state=None):
    """Return the zero-argument call of refcoll's collective on ``data``'s buffers."""
    return _call(config, t, data.x, data.out, algorithm, root, state)


def our_in_place(config: BenchConfig, t, data: Data, algorithm: str, root: int):
    """Return refcoll's in-place call on ``data``'s in-place buffer (a switch: its template)."""
    if data.inplace is None:
        return _call(config, t, data.x, data.out, algorithm, root)
    return _call(config, t, data.inplace.x, data.inplace.out, algorithm, root)


def _call(config: BenchConfig, t, x, out, algorithm: str, root: int, state=None):
    coll, op = config.collective, get_op(config.op).name
    common = {"algorithm": registry_name(algorithm), "validate": False,
              **algorithm_options(algorithm)}
    if coll == "allreduce":
        if config.compressor is not None:
            return lambda: compressed_allreduce(x, t, op=op, compressor=state.compressor,
                                                state=state.state, out=out, **common)[0]
        return lambda: api.allreduce(x, t, op=op, out=out, **common)
    if coll == "reduce_scatter":
        return lambda: api.reduce_scatter(x, t, op=op, out=out, **common)
    if coll == "allgather":
        return lambda: api.allgather(x, t, out=out, **common)
    if coll == "broadcast":
        return lambda: api.broadcast(x, root, t, out=out, **common)
    return lambda: api.reduce(x, root, t, op=op, out=out, **common)


def base_call(config: BenchConfig, library: str, groups, data: Data, root: int):
    """Return ``(call, prepare)``: the library's collective on ``data``'s buffers.

    NCCL's on the run's NCCL communicator (:func:`refcoll.baselines.nccl.nccl_call`);
    Gloo's on its Gloo group (:func:`refcoll.baselines.gloo.gloo_call`, which
    needs ``prepare`` before each call), and the same calls on the ``"refcoll"``
    backend's group (``backend``); else the MPI library's on the data ranks
    (:func:`refcoll.baselines.mpi.mpi_call`; on device buffers, given to mpi4py
    as they are: a CUDA-aware MPI reads them; avg sums, and is not checked).
    """
    args = (config.collective, data.x, data.theirs)
    kwargs = {"op": baseline_op(config), "root": root}
    if library == "gloo":
        return gloo.gloo_call(groups.gloo.group, *args, **kwargs)
    if library == "backend":  # the same torch calls, on the "refcoll" group
        return gloo.gloo_call(groups.backend, *args, check=False, **kwargs)
    if library == "nccl":
        return nccl.nccl_call(groups.nccl, *args, **kwargs), None
    return mpi_call(groups.comm(groups.workers), *args, **kwargs), None


def base_in_place(config: BenchConfig, library: str, groups, data: Data, root: int):
    """Return the library's in-place call on ``data``'s in-place buffer, or None.

    The MPI library's, with ``MPI_IN_PLACE`` (:func:`mpi_in_place_call`). NCCL's and
    Gloo's have no in-place half here: None, and the row shows none.
    """
    if library != "mpi" or data.inplace is None:
        return None
    return mpi_in_place_call(groups.comm(groups.workers), config.collective, data.inplace.buf,
                             op=baseline_op(config), root=root)


def mpi_in_place_call(comm, collective: str, buf, *, op: str = "sum", root: int = 0):
    """Return the zero-argument in-place call of the MPI library's ``collective`` on ``buf``.

    ``MPI_IN_PLACE`` as the MPI standard defines it for each: ``MPI_Allreduce``
    reduces ``buf`` into itself; ``MPI_Reduce_scatter_block`` reduces the whole
    ``buf`` and leaves this rank's chunk at its start; ``MPI_Allgather`` finds
    this rank's block at its place in ``buf``; ``MPI_Reduce`` takes it at the root
    only (the others send ``buf``); ``MPI_Bcast`` is in place by nature. ``avg``
    sums, as :func:`refcoll.baselines.mpi.mpi_call` does.
    """
    from mpi4py import MPI

    mtype = MPI.Datatype.fromcode(buf.dtype.char)
    mop = {"sum": MPI.SUM, "avg": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN,
           "max": MPI.MAX}[get_op(op).name]
    whole = [buf, mtype]
    if collective == "allreduce":
        return lambda: comm.Allreduce(MPI.IN_PLACE, whole, op=mop)
    if collective == "reduce_scatter":
        return lambda: comm.Reduce_scatter_block(MPI.IN_PLACE, whole, op=mop)
    if collective == "allgather":
        return lambda: comm.Allgather(MPI.IN_PLACE, whole)
    if collective == "broadcast":
        return lambda: comm.Bcast(whole, root)
    if comm.Get_rank() == root:
        return lambda: comm.Reduce(MPI.IN_PLACE, whole, op=mop, root=root)
    return lambda: comm.Reduce(whole, None, op=mop, root=root)
