"""Start a ``torch.distributed`` process group where refcoll's users start processes.

Under ``torchrun`` the environment has ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``: the group starts from it (``env://``), with no MPI at all. Under
``mpiexec`` the launcher gives each process its rank (``PMI_RANK``,
``OMPI_COMM_WORLD_RANK`` or ``PMIX_RANK``); rank 0 starts the group's key-value
store, a ``torch.distributed.TCPStore``, on port 0 (``MASTER_PORT`` where it is set),
so the kernel gives it a free port as it binds, and MPI broadcasts the port it got
(the store's ``port``) to the others, which connect to it: the same processes, the
same group, and no port chosen, closed and bound again, which another process could
take in between. One process alone (plain ``python``) gets a group of one over an
in-process ``HashStore``: no port at all.

**Trusted network only.** The store, like ``torchrun``'s, listens on every interface
of rank 0's host and authenticates no one: whoever reaches the port while the job
runs can read and write the group's keys (and so disturb or stop the job). Run
jobs on a trusted network, or one a firewall closes to others; ``MASTER_ADDR``
names the address the other ranks connect to, not the one the store listens on.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import importlib.util
import os
import socket
import sys

from ..calls.progress import stop_threads
from ..core.errors import UsageError
from ..core.ops import get_op
from ..transport.base import default_timeout
from ..transport.deadline import bounded_barrier
from ..transport.torch import forget_groups

__all__ = ["init_process_group", "launcher", "torch_installed", "reduce_op", "INSTALL_HINT",
           "mpi_communicator"]

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


def _master_port() -> int:
    """Return ``MASTER_PORT`` as a port number for the store (0, the default: any free port).

    Raises:
        UsageError: the value is not a whole number from 0 to 65535.
    """
    text = os.environ.get("MASTER_PORT", "").strip()
    if not text:
        return 0
    if not (text.isascii() and text.isdigit()) or int(text) > 65535:
        raise UsageError(f"MASTER_PORT={text[:40]!r} is not a TCP port: give a number from 1 "
                         "to 65535, or leave it unset for any free port")
    return int(text)


def _from_mpi(seconds: float):
    """Return ``(store, rank, size)`` for the processes of an MPI job (collective on its world).

    Rank 0 starts the ``TCPStore`` (its server, which binds port 0 or ``MASTER_PORT``
    itself) and broadcasts where it listens, or why it could not start it, so every
    rank gets the store or the same :class:`UsageError`. The store listens
    unauthenticated on every interface: a trusted network only (see the module).
    """
    import torch.distributed as dist
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    timeout = datetime.timedelta(seconds=seconds)
    bounded_barrier(comm, "refcoll.torch.init_process_group")  # every rank is here
    store, sent = None, None
    if rank == 0:
        try:
            host = os.environ.get("MASTER_ADDR") or socket.gethostbyname(socket.gethostname())
            store = dist.TCPStore(host, _master_port(), size, is_master=True, timeout=timeout,
                                  wait_for_workers=False)
            sent = {"host": host, "port": store.port}
        except UsageError as exc:
            sent = {"error": str(exc)}
        except (OSError, RuntimeError) as exc:  # the port is taken; no address for the host
            sent = {"error": f"the torch.distributed store could not start on rank 0: "
                             f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"}
    sent = comm.bcast(sent, root=0)
    if "error" in sent:
        raise UsageError(f"rank {rank}: {sent['error']}")
    if store is None:
        store = dist.TCPStore(sent["host"], sent["port"], size, is_master=False, timeout=timeout)
    return store, rank, size


def _load_group_defaults() -> None:
    """Import ``torch.distributed.nn.functional`` while no default group exists.

    Its functions take ``group=group.WORLD`` as a default argument, which Python
    evaluates once, at import: imported after a group has started (as
    ``DistributedDataParallel`` imports it, through ``torch._dynamo``), they keep that
    group for the life of the process, and ``destroy_process_group`` then cannot end
    it. A Gloo group so kept keeps its worker threads past the end of ``main``; one
    that drops a finished collective's last tensor while the interpreter tears down
    takes the GIL there and aborts the process (``terminate called without an active
    exception``: pytorch/pytorch#190489). Imported first, the defaults hold ``None``.
    """
    import torch.distributed.nn.functional  # noqa: F401 - imported for its side effect


def _end_groups() -> None:
    """At exit, while the interpreter is whole: let go of every destroyed group.

    refcoll's progress threads end, its cached transports go, and the cycles that
    still hold a group (a model's DDP wrapper, a comm hook's state) are collected, so
    that torch frees a group ``destroy_process_group`` ended here, where its Gloo
    worker threads can finish dropping their last collective's tensors and be
    joined, not in the teardown, where a thread that takes the GIL aborts the process
    (:func:`_load_group_defaults`). Registered by :func:`init_process_group`, after
    refcoll's own exit handlers, so it runs before them.
    """
    stop_threads()
    forget_groups()
    gc.collect()


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
    _load_group_defaults()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl", "refcoll"):
        raise UsageError(f"backend {backend!r} is not one refcoll runs on: use 'gloo' "
                         "(CPU tensors), 'nccl' (CUDA tensors) or 'refcoll'")
    seconds = timeout if timeout is not None else (default_timeout() or 86400.0)
    kind = launcher()
    start: dict = {}
    if kind == "torchrun":
        start["init_method"] = "env://"
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    elif kind == "mpiexec":
        start["store"], rank, size = _from_mpi(seconds)
    else:  # one process: a store in this process, no port for anyone to reach
        start["store"], rank, size = dist.HashStore(), 0, 1
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local)
    dist.init_process_group(backend, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=seconds), **start)
    atexit.unregister(_end_groups)  # once, however many groups the process starts
    atexit.register(_end_groups)
    return dist.group.WORLD


def mpi_communicator(store, rank: int, size: int):
    """Return an MPI communicator of a torch group's processes, or ``None`` where MPI is not theirs.

    Under ``mpiexec``, where this process's MPI runs with threads
    (``MPI_THREAD_MULTIPLE``: refcoll's progress thread then calls it), each rank of
    the group writes its ``MPI_COMM_WORLD`` rank in the group's ``store`` and reads the
    others', so a rank that never comes is the store's timeout, and the group's ranks
    make a communicator of their own in the group's rank order
    (``MPI_Comm_create_group``: collective on them alone, as torch makes a group on
    its own ranks alone). ``None`` under ``torchrun`` or plain ``python``, before MPI
    is initialized, or where the ranks do not map one to one onto MPI's (a group
    started by other means than :func:`init_process_group`).
    """
    mpi = sys.modules.get("mpi4py.MPI")
    if launcher() != "mpiexec" or size < 2 or mpi is None or not mpi.Is_initialized() \
            or mpi.Is_finalized() or mpi.Query_thread() < mpi.THREAD_MULTIPLE:
        return None
    world = mpi.COMM_WORLD
    store.set(f"refcoll/mpi-rank/{rank}", f"{world.Get_rank()} {world.Get_size()}")
    noted = [store.get(f"refcoll/mpi-rank/{r}").split() for r in range(size)]
    ranks = [int(r) for r, _ in noted]
    if len(set(ranks)) != size or {int(n) for _, n in noted} != {world.Get_size()}:
        return None  # not one MPI job's processes (every rank reads the same keys: every None)
    group = world.Get_group()
    try:
        return world.Create_group(group.Incl(ranks))
    finally:
        group.Free()
