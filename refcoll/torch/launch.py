"""Start a ``torch.distributed`` process group where refcoll's users start processes.

Under ``torchrun`` the environment has ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``: the group starts from it (``env://``), with no MPI at all. Under
``mpiexec`` the launcher gives each process its rank (``PMI_RANK``,
``OMPI_COMM_WORLD_RANK`` or ``PMIX_RANK``) and rank 0 picks a free TCP port on its
host, which MPI broadcasts: the same processes, the same group. One process alone
(plain ``python``) gets a group of one.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import socket
import sys

from ..core.errors import UsageError
from ..core.ops import get_op
from ..transport.base import default_timeout
from ..transport.deadline import bounded_barrier

__all__ = ["init_process_group", "launcher", "torch_installed", "reduce_op", "INSTALL_HINT"]

#: What a user without PyTorch installs for refcoll's torch features.
INSTALL_HINT = "pip install 'refcoll[torch]'"

#: The environment variables by which a launcher names a process's rank and the world's size.
_LAUNCHERS = (("torchrun", "RANK", "WORLD_SIZE"),
              ("mpiexec (MPICH)", "PMI_RANK", "PMI_SIZE"),
              ("mpiexec (Open MPI)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
              ("mpiexec (PMIx)", "PMIX_RANK", None))


def launcher() -> str:
    """Return which launcher started this process: ``torchrun``, ``mpiexec`` or ``none``."""
    for name, rank, _ in _LAUNCHERS:
        if rank in os.environ:
            return name.split()[0]
    return "none"


def torch_installed() -> bool:
    """Return whether PyTorch can be imported, without importing it (which takes seconds)."""
    if "torch" in sys.modules:
        return sys.modules["torch"] is not None
    return importlib.util.find_spec("torch") is not None


def reduce_op(op):
    """Return ``torch.distributed.ReduceOp``'s member for refcoll's op (``sum``... ``avg``)."""
    import torch.distributed as dist

    return {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
            "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}[get_op(op).name]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _from_mpi() -> tuple[str, int, int]:
    """Return ``(init_method, rank, size)`` for the processes of an MPI job."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    bounded_barrier(comm, "refcoll.torch.init_process_group")  # every rank is here
    address = None
    if comm.Get_rank() == 0:
        address = (os.environ.get("MASTER_ADDR") or socket.gethostbyname(socket.gethostname()),
                   int(os.environ.get("MASTER_PORT") or _free_port()))
    host, port = comm.bcast(address, root=0)
    return f"tcp://{host}:{port}", comm.Get_rank(), comm.Get_size()


def init_process_group(backend: str | None = None, *, timeout: float | None = None):
    """Start the default ``torch.distributed`` group, as the launcher asks; return it.

    Args:
        backend: ``"gloo"`` (CPU tensors), ``"nccl"`` (CUDA tensors) or
            ``"refcoll"`` (refcoll's algorithms for every collective:
            :mod:`refcoll.torch.backend`); ``None``: NCCL where CUDA is
            available, else Gloo.
        timeout: seconds torch's own setup and collectives may wait
            (``REFCOLL_TIMEOUT`` or 300 by default); refcoll's waits keep their
            own deadline.

    An initialized group is returned as it is.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.group.WORLD
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl", "refcoll"):
        raise UsageError(f"backend {backend!r} is not one refcoll runs on: use 'gloo' "
                         "(CPU tensors), 'nccl' (CUDA tensors) or 'refcoll'")
    seconds = timeout if timeout is not None else (default_timeout() or 86400.0)
    kind = launcher()
    if kind == "torchrun":
        init, rank, size = "env://", int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    elif kind == "mpiexec":
        init, rank, size = _from_mpi()
    else:
        init, rank, size = f"tcp://127.0.0.1:{_free_port()}", 0, 1
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=seconds))
    return dist.group.WORLD
