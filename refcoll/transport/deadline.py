"""Waiting by the deadline: every wait on another rank ends, or says whom it waited for.

A blocking MPI call waits forever for a rank that never comes. refcoll's waits
are nonblocking calls polled until ``REFCOLL_TIMEOUT`` (:func:`wait_by_deadline`);
a call MPI has only in blocking form is preceded by a bounded barrier
(:func:`bounded_barrier`), and a duplicated communicator comes from ``MPI_Comm_idup``
(:func:`duplicate`). Past the deadline :func:`timed_out` raises
:class:`~refcoll.core.errors.CollectiveTimeout`, or ends the job when asked to.

A barrier bounds a blocking call against a rank that never comes, not against
one lost during the call (its node's link cut): a blocking MPI collective then
waits for ever, and no exception can reach the thread inside it. Such a call
runs under :func:`watchdog`, which ends the job past the deadline, as NCCL's
watchdog does. A timeout that a program lets go uncaught ends the job too
(:func:`timed_out`): otherwise the process would wait in ``MPI_Finalize`` for
the rank it lost, and on a GPU node hold its GPU while it waits.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
import time

from ..core.errors import CollectiveTimeout
from .base import default_timeout

__all__ = ["abort_on_timeout", "TIMEOUT_STATUS", "timed_out", "abort_job", "wait_by_deadline",
           "duplicate", "bounded_barrier", "watchdog", "POLLS_BEFORE_YIELD", "mpi",
           "mpi_library_version"]


@functools.cache
def mpi():
    """Return mpi4py's MPI module (imported lazily: the simulator needs no MPI library)."""
    from mpi4py import MPI

    return MPI


def mpi_library_version() -> str:
    """Return the first line of ``MPI_Get_library_version``'s text, its spaces collapsed and
    without the NUL bytes some libraries end it with (Open MPI's)."""
    lines = mpi().Get_library_version().replace("\x00", "").strip().splitlines()
    return " ".join(lines[0].split()) if lines else ""


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

    Without it the exception is the program's to handle; if it goes uncaught
    (it, or an exception raised while handling it), the job is ended once the
    traceback is printed (:func:`_end_job_when_uncaught`), rather than left
    waiting in ``MPI_Finalize`` for the rank this one lost.
    """
    if abort_on_timeout():
        sys.stderr.write(f"refcoll: error: {message}; aborting the MPI job "
                         "(REFCOLL_ABORT_ON_TIMEOUT=1)\n")
        abort_job(TIMEOUT_STATUS)
    _end_job_when_uncaught()
    raise CollectiveTimeout(message)


def _caused_by_timeout(exc: BaseException | None) -> bool:
    """Return whether ``exc`` is a :class:`CollectiveTimeout`, or was raised while handling one."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, CollectiveTimeout):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _end_job_when_uncaught() -> None:
    """Make an uncaught timeout end the MPI job after its traceback (once per process).

    A process that ends on an exception still runs ``MPI_Finalize`` (mpi4py's
    exit handler), which waits for the ranks it exchanged with: after a timeout
    one of them may never answer (a dead node, a cut link), and the process, its
    node's launcher proxy and a GPU it holds would wait for ever. So the hook,
    after Python's own (the traceback), calls :func:`abort_job`. A program that
    catches the timeout decides for itself: it should end the job the same way
    (``abort_job``), since ``MPI_Finalize`` can wait for the lost rank as well.
    """
    previous = sys.excepthook
    if getattr(previous, "_ends_mpi_job", False):
        return

    def hook(kind, value, tb):
        previous(kind, value, tb)
        if _caused_by_timeout(value):
            sys.stderr.write("refcoll: a collective timed out and the program did not catch it: "
                             f"ending the MPI job (exit status {TIMEOUT_STATUS}) rather than "
                             "waiting in MPI_Finalize for a rank that may never answer\n")
            abort_job(TIMEOUT_STATUS)

    hook._ends_mpi_job = True
    sys.excepthook = hook


#: Seconds between writing the last message and ``MPI_Abort``. The launcher
#: forwards each process's stderr from a pipe, and tears the job down when asked
#: to abort: without the pause the reason can be lost with the job.
ABORT_GRACE = 1.0

#: Seconds a rank waits in MPI_Abort before the kernel ends it (a launcher it cannot reach).
ABORT_WAIT = 5


def abort_job(code: int) -> None:
    """End every process of the MPI job with ``code`` (nothing when there is no job).

    Callable from any thread (:func:`watchdog`'s). A rank that cannot reach its
    launcher does not end in ``MPI_Abort`` (MPICH's returns, or waits): the
    kernel ends it :data:`ABORT_WAIT` seconds on.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() \
            and mpi.COMM_WORLD.Get_size() > 1:
        time.sleep(ABORT_GRACE)
        # MPI_Abort asks the launcher to end the job; a rank cut off from it (a failed link,
        # its node's proxy unreachable) has MPI_Abort return, or wait for ever, and would then
        # wait in MPI_Finalize. The kernel ends it instead, ABORT_WAIT seconds on, whatever
        # holds the interpreter (SIGALRM's default action; the alarm is the process's, set
        # from any thread, the action only from the main one).
        if hasattr(signal, "alarm"):
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(ABORT_WAIT)
        mpi.COMM_WORLD.Abort(code)
        os._exit(code)  # MPI_Abort returned: its launcher is out of reach


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




# --------------------------------------------------------------------- the watchdog

#: Seconds between two looks of the watchdog thread at the calls it watches.
WATCHDOG_PERIOD = 0.5

_watched: dict = {}  # thread id -> (deadline, what, timeout) of the blocking call it is in
_watchdog_lock = threading.Lock()
_watchdog_thread: list = []


@contextlib.contextmanager
def watchdog(what: str, timeout: float | None = None):
    """Run the block (one blocking call of the MPI library) under a deadline that ends the job.

    ``MPI_Allreduce`` and every other blocking call have no deadline, and a
    thread inside one cannot be interrupted: a peer lost during the call (its
    node's link cut) holds it for ever, and every rank waiting on this one.
    A barrier before the call (:func:`bounded_barrier`) only proves that every
    rank came to it. Past ``timeout`` seconds (``None``: ``REFCOLL_TIMEOUT``'s;
    waiting forever: not watched) a thread of this process writes which call
    it was and ends the job with :data:`TIMEOUT_STATUS` (:func:`abort_job`), as
    NCCL's watchdog does with ``TORCH_NCCL_ASYNC_ERROR_HANDLING``.

    Entering and leaving cost a dictionary write each (no thread is started
    per call): put the block around a timed call, outside its clock.
    """
    if timeout is None:
        timeout = default_timeout()
    if timeout is None:
        yield
        return
    me = threading.get_ident()
    outer = _watched.get(me)  # a watched block inside another: the outer one's comes back after
    _watched[me] = (time.monotonic() + timeout, what, timeout)
    if not _watchdog_thread:
        _start_watchdog()
    try:
        yield
    finally:
        if outer is None:
            _watched.pop(me, None)
        else:
            _watched[me] = outer


def _start_watchdog() -> None:
    with _watchdog_lock:
        if not _watchdog_thread:
            thread = threading.Thread(target=_watch, name="refcoll-watchdog", daemon=True)
            thread.start()
            _watchdog_thread.append(thread)


def _watch() -> None:
    """The watchdog thread: end the job when a watched call has passed its deadline."""
    while True:
        time.sleep(WATCHDOG_PERIOD)
        now = time.monotonic()
        late = [entry for entry in list(_watched.values()) if now > entry[0]]
        if late:
            _, what, timeout = late[0]
            mpi = sys.modules.get("mpi4py.MPI")
            rank = (f"rank {mpi.COMM_WORLD.Get_rank()}: "
                    if mpi is not None and mpi.Is_initialized() else "")
            sys.stderr.write(
                f"refcoll: error: {rank}{what} has not returned after {timeout:g} s: a blocking "
                "call of the MPI library, which no deadline can interrupt, waits for a rank that "
                "may be dead, slow, or cut off; ending the MPI job (set REFCOLL_TIMEOUT to wait "
                "longer)\n")
            abort_job(TIMEOUT_STATUS)
            os._exit(TIMEOUT_STATUS)  # no MPI job to abort: end this process at least
