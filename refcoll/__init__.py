"""refcoll: readable reference collectives for distributed training, and their oracle.

    import refcoll
    y = refcoll.allreduce(x, algorithm="ring")            # under mpiexec
    res = refcoll.simulate("allreduce", xs, algorithm="ring")  # in one process
"""

from .calls import (Handle, SimResult, allgather, allreduce, as_transport, broadcast, iallgather,
                    iallreduce, ibroadcast, ireduce, ireduce_scatter, reduce, reduce_scatter,
                    simulate, wait_all)
from .algorithms import COLLECTIVES, REGISTRY
from . import compressors  # also routes allreduce(compressor=...) to it
from .core.errors import (CollectiveTimeout, DeadlockError, MismatchError, PeerFailure,
                          RefcollError, UsageError)
from .core.ops import DTYPES, OPS
from .reducer import GradBucket, Reducer
from .transport import SimTransport, SimWorld, Transport

__version__ = "0.1.0"

__all__ = [
    "allreduce",
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
]
