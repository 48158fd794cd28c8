"""refcoll: readable reference collectives for distributed training, and their oracle.

    import refcoll
    y = refcoll.allreduce(x, algorithm="ring")            # under mpiexec
    with refcoll.allreduce_init(x, algorithm="ring") as plan:   # persistent: made once,
        y = plan()                                              # run many times
    res = refcoll.simulate("allreduce", xs, algorithm="ring")  # in one process
"""

from .algorithms import COLLECTIVES, REGISTRY
from .calls import (
    Handle,
    Plan,
    SimResult,
    allgather,
    allgather_init,
    allreduce,
    allreduce_init,
    as_transport,
    broadcast,
    broadcast_init,
    iallgather,
    iallreduce,
    ibroadcast,
    ireduce,
    ireduce_scatter,
    reduce,
    reduce_init,
    reduce_scatter,
    reduce_scatter_init,
    simulate,
    wait_all,
)
from .compressors.collective import compressed_allreduce
from .core.errors import (
    CollectiveTimeout,
    DeadlockError,
    MismatchError,
    PeerFailure,
    RefcollError,
    UsageError,
    WrongResult,
)
from .core.ops import DTYPES, OPS
from .training.reducer import GradBucket, Reducer
from .transport import SimTransport, SimWorld, Transport

__version__ = "0.1.0"

__all__ = [
    "allreduce",
    "compressed_allreduce",
    "reduce_scatter",
    "allgather",
    "broadcast",
    "reduce",
    "iallreduce",
    "ireduce_scatter",
    "iallgather",
    "ibroadcast",
    "ireduce",
    "wait_all",
    "Handle",
    "allreduce_init",
    "reduce_scatter_init",
    "allgather_init",
    "broadcast_init",
    "reduce_init",
    "Plan",
    "Reducer",
    "GradBucket",
    "simulate",
    "SimResult",
    "as_transport",
    "Transport",
    "SimWorld",
    "SimTransport",
    "REGISTRY",
    "COLLECTIVES",
    "OPS",
    "DTYPES",
    "RefcollError",
    "UsageError",
    "MismatchError",
    "CollectiveTimeout",
    "DeadlockError",
    "PeerFailure",
    "WrongResult",
]
