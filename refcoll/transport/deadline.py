"""Waiting by the deadline: every wait on another rank ends, or says whom it waited for.

A blocking MPI call waits forever for a rank that never comes. refcoll's waits
are nonblocking calls polled until ``REFCOLL_TIMEOUT`` (:func:`wait_by_deadline`);
a call MPI has only in blocking form is preceded by a bounded barrier
(:func:`bounded_barrier`), and a duplicated communicator comes from ``MPI_Comm_idup``
(:func:`duplicate`). Past the deadline :func:`timed_out` raises
:class:`~refcoll.core.errors.CollectiveTimeout`, or ends the job when asked to.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time

from ..core.errors import CollectiveTimeout
from .base import default_timeout

__all__ = ["abort_on_timeout", "TIMEOUT_STATUS", "timed_out", "abort_job", "wait_by_deadline",
           "duplicate", "bounded_barrier", "POLLS_BEFORE_YIELD", "mpi"]


@functools.cache
def mpi():
    """Return mpi4py's MPI module (imported lazily: the simulator needs no MPI library)."""
    from mpi4py import MPI

    return MPI


#: Polls of a wait before each further poll yields the CPU. With a core per rank
#: a peer's message comes within a few polls and the yield is never reached; with
#: more ranks than cores the peer may be waiting for this very core, and on 4
#: ranks over 2 cores yielding after 10 polls instead of 100 made small and
#: medium all-reduces 1.5 to 3 times faster.
POLLS_BEFORE_YIELD = 10


def abort_on_timeout() -> bool:
    """Return whether ``REFCOLL_ABORT_ON_TIMEOUT`` asks a timeout to end the whole MPI job."""
    return os.environ.get("REFCOLL_ABORT_ON_TIMEOUT", "").strip().lower() in ("1", "true", "yes")


#: Exit status of a job that a timeout aborted (the CLI's for a timeout too).
TIMEOUT_STATUS = 3


def timed_out(message: str):
    """Raise :class:`CollectiveTimeout`, or abort the MPI job when asked to.

    With ``REFCOLL_ABORT_ON_TIMEOUT=1`` the message goes to stderr and
    ``MPI_Abort`` ends every process of the job, as PyTorch's NCCL watchdog
    tears a job down (``TORCH_NCCL_ASYNC_ERROR_HANDLING``): for programs that
    would rather die at once than have every rank handle the exception.
    """
    if abort_on_timeout():
        sys.stderr.write(f"refcoll: error: {message}; aborting the MPI job "
                         "(REFCOLL_ABORT_ON_TIMEOUT=1)\n")
        abort_job(TIMEOUT_STATUS)
    raise CollectiveTimeout(message)


#: Seconds between writing the last message and ``MPI_Abort``. The launcher
#: forwards each process's stderr from a pipe, and tears the job down when asked
#: to abort: without the pause the reason can be lost with the job.
ABORT_GRACE = 1.0

#: Seconds a rank waits in MPI_Abort before the kernel ends it (a launcher it cannot reach).
ABORT_WAIT = 5


def abort_job(code: int) -> None:
    """End every process of the MPI job with ``code`` (nothing when there is no job)."""
    sys.stdout.flush()
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() \
            and mpi.COMM_WORLD.Get_size() > 1:
        time.sleep(ABORT_GRACE)
        # MPI_Abort asks the launcher to end the job; a rank cut off from it (a failed link,
        # its node's proxy unreachable) would wait in MPI_Abort for ever. The kernel ends it
        # instead, ABORT_WAIT seconds on, whatever holds the interpreter (SIGALRM's default).
        if hasattr(signal, "alarm"):
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(ABORT_WAIT)
        mpi.COMM_WORLD.Abort(code)


def wait_by_deadline(request, timeout: float | None, describe) -> None:
    """Complete one request (a nonblocking collective's) by the deadline, or time out."""
    if timeout is None:
        request.Wait()
        return
    deadline = time.monotonic() + timeout
    polls = 0
    while not request.Test():
        polls += 1
        if polls > POLLS_BEFORE_YIELD:
            os.sched_yield()
        if time.monotonic() > deadline:
            timed_out(describe())


def _not_arrived(comm, collective: str | None, what: str, timeout: float,
                 stage: str = "at communicator setup") -> str:
    size = comm.Get_size()
    return (f"rank {comm.Get_rank()}: {collective or 'refcoll'} timed out after {timeout:g} s "
            f"{stage} ({what} over {size} ranks): not every rank has reached it, "
            "and MPI cannot tell which have not (a nonblocking collective completes on all of "
            "them or none); a rank may be dead, slow, or on another code path "
            "(set REFCOLL_TIMEOUT to wait longer)")


def duplicate(comm, timeout: float | None, collective: str | None = None):
    """Return ``MPI_Comm_idup(comm)``, waited for by the deadline.

    ``MPI_Comm_dup`` is a blocking collective: a rank that never makes its
    first refcoll call would hang every other rank there, before any deadline
    applies. The nonblocking form is waited for like every other exchange.
    """
    if comm.Get_size() == 1:
        return comm.Dup()  # nothing to wait for
    new, request = comm.Idup()
    wait_by_deadline(request, timeout,
                     lambda: _not_arrived(comm, collective, "MPI_Comm_idup", timeout))
    return new


def bounded_barrier(comm, what: str, timeout: float | None = None, *,
                    stage: str = "waiting for every rank") -> None:
    """``MPI_Ibarrier`` on ``comm``, waited for by the deadline (``timeout`` None: the default).

    Put before an MPI call that has no nonblocking form (``MPI_Comm_split``, a
    library's own collective in a benchmark): once every rank has passed the
    barrier, the call cannot wait for a rank that never comes.
    """
    if comm.Get_size() == 1:
        return
    if timeout is None:
        timeout = default_timeout()
    wait_by_deadline(comm.Ibarrier(), timeout,
                     lambda: _not_arrived(comm, what, "MPI_Ibarrier", timeout, stage))


