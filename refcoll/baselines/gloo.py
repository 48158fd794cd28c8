"""Gloo through ``torch.distributed``: the baseline ``refcoll bench --against gloo`` times.

:func:`require_torch` (``--against gloo`` without PyTorch is a usage error),
:func:`gloo_unavailable` (the types and ops torch's Gloo backend lacks),
:func:`gloo_group` (a Gloo group over the processes of the MPI job, started with
:func:`refcoll.torch.launch.init_process_group`) and :func:`gloo_call` (the
zero-argument call of torch's collective on refcoll's own NumPy buffers, seen as
tensors with ``torch.from_numpy``: no copy).

Torch's Gloo backend (``ProcessGroupGloo.cpp``, its ``GENERATE_ALL_TYPES``) moves
and reduces float32, float64, float16, bfloat16, int8, uint8, int32, int64 and
bool; any other type, for every collective, fails with "Invalid scalar type".
Its ``ReduceOp.AVG`` sums, then divides in the tensor's own type, so integers
have no average there ("result type Float can't be cast").
"""

from __future__ import annotations

import contextlib
import os
from importlib.metadata import PackageNotFoundError, version
from typing import Callable

import numpy as np

from ..algorithms import registry
from ..algorithms.spelling import unspell
from ..core.errors import UsageError
from ..core.ops import dtype_name, get_dtype, get_op, is_integer
from ..transport.deadline import bounded_barrier

__all__ = ["GLOO_CALLS", "GLOO_DTYPES", "require_torch", "torch_version", "gloo_unavailable",
           "GlooGroup", "gloo_group", "gloo_call", "backend_group", "backend_unavailable"]

#: The ``torch.distributed`` function that does each refcoll collective on a Gloo group.
GLOO_CALLS = {
    "allreduce": "Gloo all_reduce",
    "reduce_scatter": "Gloo reduce_scatter_tensor",
    "allgather": "Gloo all_gather_into_tensor",
    "broadcast": "Gloo broadcast",
    "reduce": "Gloo reduce",
}

#: The refcoll dtypes torch's Gloo backend carries (``GENERATE_ALL_TYPES`` in
#: ``ProcessGroupGloo.cpp``); it has no 16-bit integers, no unsigned types wider
#: than a byte, and no float8.
GLOO_DTYPES = ("int8", "uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64")

def require_torch(what: str = "Gloo", *, load: bool = True):
    """Return ``torch.distributed``, or raise :class:`UsageError` saying why ``what`` cannot run.

    With ``load=False`` only look for the package, without importing it (which
    takes seconds), and return None: a launcher's check before it starts the
    processes that import it.
    """
    launch = _bridge().launch
    missing = UsageError(f"{what} needs PyTorch, which is not installed: {launch.INSTALL_HINT}")
    if not load:
        if not launch.torch_installed():
            raise missing
        return None
    try:
        import torch.distributed as dist
    except ImportError:
        raise missing from None
    if not dist.is_available() or not dist.is_gloo_available():
        raise UsageError(f"{what}: this PyTorch build has no Gloo backend "
                         "(torch.distributed.is_gloo_available() is False)")
    return dist


def _bridge():
    """Return :mod:`refcoll.torch`, imported only when a torch baseline runs (it imports torch)."""
    import refcoll.torch as bridge

    return bridge


def torch_version() -> str | None:
    """Return PyTorch's installed version, from its package metadata (None: not installed).

    Read without importing torch, which takes seconds.
    """
    try:
        return version("torch")
    except PackageNotFoundError:
        return None


def gloo_unavailable(collective: str, dtype, op: str = "sum", device: str = "cpu") -> str | None:
    """Return why Gloo's ``collective`` cannot run on these buffers (None: it can).

    A dtype outside :data:`GLOO_DTYPES`; ``avg`` of integers (Gloo's average
    divides in the integer type, which torch refuses); device buffers (the bench
    gives Gloo host memory only).
    """
    if device != "cpu":
        return f"{GLOO_CALLS[collective]} is timed on host buffers only"
    dt = get_dtype(dtype)
    if dtype_name(dt) not in GLOO_DTYPES:
        return (f"Gloo has no {dtype_name(dt)} type; torch's Gloo backend carries "
                f"{', '.join(GLOO_DTYPES)}")
    if collective not in ("allgather", "broadcast") and get_op(op).divides and is_integer(dt):
        return f"Gloo has no average of integers ({dtype_name(dt)})"
    return None


class GlooGroup:
    """The Gloo group of the first ``workers`` processes of an MPI job, and how to end it.

    Attributes:
        group: the ``torch.distributed`` group the calls run on (``None`` on a
            process outside it, which sits the baseline out).
    """

    def __init__(self, group, made: list, default: bool) -> None:
        self.group = group
        self._made = made          # subgroups started here, destroyed by free()
        self._default = default    # the default group was started here too

    def free(self) -> None:
        """Destroy the groups started here (a group the caller had started stays)."""
        import torch.distributed as dist

        for group in self._made:
            dist.destroy_process_group(group)
        if self._default:
            dist.destroy_process_group()


def gloo_group(comm, workers: int, timeout: float | None = None) -> GlooGroup:
    """Start a Gloo group over the first ``workers`` ranks of ``comm`` (collective over it).

    The default group is the MPI job's, started by
    :func:`refcoll.torch.launch.init_process_group` (rank 0 picks a port, MPI
    broadcasts it), so ``comm`` must hold every process of the job in
    ``MPI_COMM_WORLD``'s order. An existing default group is used as it is;
    where it is not Gloo, or ``workers`` is fewer than the job's processes,
    ``torch.distributed.new_group`` makes the Gloo subgroup.

    Raises:
        UsageError: PyTorch or its Gloo backend is missing; ``comm`` is not the
            job's world (the same answer on every rank).
    """
    from mpi4py import MPI

    dist = require_torch("--against gloo")
    if comm.Get_size() != MPI.COMM_WORLD.Get_size():
        raise UsageError(f"rank {comm.Get_rank()}: the Gloo baseline runs over every process "
                         f"of the MPI job ({MPI.COMM_WORLD.Get_size()}), not a communicator of "
                         f"{comm.Get_size()}")
    started = not dist.is_initialized()
    _bridge().init_process_group("gloo", timeout=timeout)
    same = dist.get_rank() == comm.Get_rank() and dist.get_world_size() == comm.Get_size()
    bounded_barrier(comm, "refcoll bench (checking the Gloo group's ranks)", timeout)
    if not comm.allreduce(same, op=MPI.LAND):
        raise UsageError(f"rank {comm.Get_rank()}: torch.distributed's ranks are not this MPI "
                         "job's; start the Gloo baseline in a job of its own")
    made = []
    group = dist.group.WORLD
    if workers < comm.Get_size() or dist.get_backend() != "gloo":
        # new_group is collective over the default group: every process comes here.
        group = dist.new_group(list(range(workers)), backend="gloo")
        made.append(group)
        if comm.Get_rank() >= workers:
            group = None
    return GlooGroup(group, made, started)


def backend_unavailable(algorithm: str, collective: str, device: str) -> str | None:
    """Return why torch's calls on a ``"refcoll"`` group cannot time ``algorithm`` (None: can)."""
    if device != "cpu":
        return "the refcoll backend's baseline runs on host buffers (--device cpu)"
    name, options = unspell(algorithm)
    if name not in registry.names(collective):
        return f"{algorithm} is not an algorithm the refcoll backend runs for {collective}"
    if registry.get(name).workers is not None:
        return (f"{algorithm} is not an algorithm the refcoll backend runs for {collective} "
                "(switch processes are ranks of their own)")
    if options:
        return (f"the refcoll backend runs {name} by its name (REFCOLL_ALGO), without the "
                f"options of {algorithm}")
    return None


def backend_group(workers: int, algorithm: str, timeout: float | None = None):
    """Return a ``backend="refcoll"`` group of the first ``workers`` ranks running ``algorithm``.

    Collective over the default group, which :func:`gloo_group` started: every
    process comes here. ``None`` on a process outside it.
    """
    import torch.distributed as dist

    from ..torch import backend

    backend.register()
    chooses = algorithm in registry.REGISTRY and registry.get(algorithm).chooses
    chosen = "" if chooses else ",".join(
        f"{c}={algorithm}" for c in backend.COLLECTIVES if algorithm in registry.names(c))
    # the group runs refcoll's algorithms, unwatched
    with _environment(REFCOLL_ALGO=chosen, REFCOLL_WATCH=None):
        group = dist.new_group(list(range(workers)), backend="refcoll")
    return None if dist.get_rank() >= workers else group


@contextlib.contextmanager
def _environment(**values):
    """Set environment variables (``None``: unset) for the block; restore them as they were."""
    before = {name: os.environ.get(name) for name in values}
    try:
        _set(values)
        yield
    finally:
        _set(before)


def _set(values: dict) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _tensor(array):
    """Return a CPU tensor over ``array``'s memory, flat (bfloat16 through its bits, no copy)."""
    return _bridge().tensors.cpu_tensor(array.reshape(-1))


def gloo_call(group, collective: str, sendbuf: np.ndarray, recvbuf: np.ndarray | None, *,
              op: str = "sum", root: int = 0,
              check: bool = True) -> tuple[Callable[[], None], Callable | None]:
    """Return ``(call, prepare)``: torch's Gloo ``collective`` on these NumPy buffers.

    The buffers follow refcoll's layout of the collective, as
    :func:`refcoll.baselines.mpi.mpi_call` takes them: ``sendbuf`` this rank's
    input, ``recvbuf`` its result (``None`` on the non-roots of a reduce). The
    tensors are made here, once, over the same memory. ``reduce_scatter_tensor``
    and ``all_gather_into_tensor`` run out of place; ``all_reduce`` and
    ``reduce`` work in place, so ``prepare`` (to be run before each call, not
    timed) copies the input into the buffer they reduce: the result buffer, or
    a scratch buffer on a non-root of a reduce, where Gloo leaves partial sums.
    A broadcast's root holds the source in ``recvbuf`` already; ``prepare`` is
    None where nothing needs copying.

    ``check=False`` for a group that is not Gloo's (the refcoll backend's), which
    carries dtypes and ops Gloo lacks.

    Raises:
        UsageError: an unknown collective, or a dtype or op Gloo lacks.
    """
    import torch.distributed as dist

    if collective not in GLOO_CALLS:
        raise UsageError(f"Gloo has no {collective!r}: it runs {', '.join(GLOO_CALLS)}")
    why = gloo_unavailable(collective, sendbuf.dtype, op) if check else None
    if why is not None:
        raise UsageError(why)
    x = _tensor(sendbuf)
    if collective == "allgather":
        out = _tensor(recvbuf)
        # torch 2.13 renamed it all_gather_single (the old name warns); the same call.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return (lambda: gather(out, x, group=group)), None
    if collective == "broadcast":
        out = _tensor(recvbuf)
        return (lambda: dist.broadcast(out, src=root, group=group)), None
    red = _bridge().launch.reduce_op(op)
    if collective == "reduce_scatter":
        out = _tensor(recvbuf)
        # torch 2.13 renamed it reduce_scatter_single (the old name warns); the same call.
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return (lambda: scatter(out, x, op=red, group=group)), None
    buf = recvbuf if recvbuf is not None else np.empty_like(sendbuf)
    inplace = _tensor(buf)
    prepare = lambda: np.copyto(buf.reshape(-1), sendbuf.reshape(-1))  # noqa: E731
    if collective == "allreduce":
        return (lambda: dist.all_reduce(inplace, op=red, group=group)), prepare
    return (lambda: dist.reduce(inplace, dst=root, op=red, group=group)), prepare
