"""refcoll inside PyTorch: a torch.distributed backend, DDP comm hooks, torch's collectives judged.

Install with the ``torch`` extra (any torch >= 2.6, whose point-to-point calls name
peers by group rank). Under ``torchrun`` (or ``mpiexec``, which starts the same
processes)::

    import refcoll.torch as rt
    dist.init_process_group("refcoll")               # any torch program on refcoll's algorithms
    rt.init_process_group()                          # Gloo on CPU, NCCL on CUDA
    y = rt.allreduce(t, algorithm="rabenseifner")    # refcoll's algorithm over torch.distributed
    state, hook = rt.comm_hook(algorithm="ring", compressor="powersgd:rank=2")
    ddp.register_comm_hook(state, hook)

Importing this package registers the ``"refcoll"`` backend of
``torch.distributed`` (:mod:`refcoll.torch.backend`; its watch mode, which
judges another backend's results in flight: :mod:`refcoll.torch.watch`).
The transport underneath, :class:`~refcoll.transport.torch.TorchTransport`, is the
third Transport: every refcoll algorithm runs over ``torch.distributed``'s tagged
``isend``/``irecv``. A process group is also accepted wherever refcoll takes
``comm=``: ``refcoll.allreduce(array, group)``. :mod:`refcoll.torch.judge` runs
the conformance battery against torch's own collectives (``refcoll verify
--backend torch``).
"""

from ..transport.torch import TorchTransport
from .collectives import (
    allgather,
    allreduce,
    broadcast,
    iallgather,
    iallreduce,
    ibroadcast,
    ireduce,
    ireduce_scatter,
    reduce,
    reduce_scatter,
    transport_for,
)
from .hooks import HookState, comm_hook, refcoll_hook
from .judge import TorchJudge, TorchReport, judge_collectives
from .launch import init_process_group, launcher, torch_installed

# import refcoll.torch; dist.init_process_group("refcoll"). This imports torch (a second):
# the command line and the benchmark's baselines import this package only when they need it.
if torch_installed():
    from .backend import register as _register

    _register()

__all__ = ["init_process_group", "launcher", "transport_for", "TorchTransport", "allreduce",
           "reduce_scatter", "allgather", "broadcast", "reduce", "iallreduce",
           "ireduce_scatter", "iallgather", "ibroadcast", "ireduce", "comm_hook",
           "refcoll_hook", "HookState", "judge_collectives", "TorchJudge", "TorchReport"]
