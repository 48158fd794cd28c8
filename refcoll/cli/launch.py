"""Starting MPI jobs: find ``mpiexec``, re-run a command under it, read the world it gave.

Commands that need several processes re-run themselves as
``mpiexec -n N python -m refcoll ...`` (:func:`relaunch`) unless they already
run inside an MPI job, in which case they use the existing world. Inside it,
:func:`data_ranks` says how many of its ranks hold data (the rest are helper
processes, such as switches) and notes once when ``-n`` was overruled.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import click

from ..calls.auto import algo_filter, calibration_mode
from ..calls.debug import check_level as debug_check_level
from ..core import reading, writing
from ..core.errors import UsageError
from ..core.processes import python
from ..transport.base import default_timeout

__all__ = ["in_mpi_job", "in_torchrun", "find_mpiexec", "mpiexec_command", "INSTALL_HINT",
           "relaunch", "check_environment", "workers_env", "data_ranks", "remember_arguments",
           "invoked_arguments", "arguments_problem", "start_mpi", "given", "WORKERS_VARIABLE",
           "BROKEN_PIPE", "note_exit", "EXIT_NOTES"]

#: The status of a process that SIGPIPE ended (128 + 13): what ``yes | head`` leaves.
BROKEN_PIPE = 141

#: How many ranks of the world hold data, set by :func:`relaunch` when helper
#: processes (switches) are started beside them.
WORKERS_VARIABLE = "REFCOLL_WORKERS"

#: The folder where the ranks of a job :func:`relaunch` started note their exit status.
EXIT_NOTES = "REFCOLL_EXIT_NOTES"

INSTALL_HINT = ("install an MPI runtime with: pip install 'refcoll[mpi]' (the mpich wheel), "
                "or point REFCOLL_MPIEXEC at your system's mpiexec")

# Set by mpiexec of MPICH (hydra), Open MPI, PMIx launchers, Intel MPI and Slurm's srun.
_JOB_VARIABLES = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS",
                  "SLURM_PMIX_MAPPING_SERV")


def in_mpi_job() -> bool:
    """Return whether this process was started by an MPI launcher."""
    return any(v in os.environ for v in _JOB_VARIABLES)


def in_torchrun() -> bool:
    """Return whether this process was started by ``torchrun`` (or any launcher of its env://).

    torchrun gives every process ``RANK`` and ``WORLD_SIZE``; only commands that
    run on ``torch.distributed`` (``verify --backend torch``) count that as a job.
    """
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def find_mpiexec() -> str:
    """Return the path of ``mpiexec``; raise :class:`UsageError` with install advice if none.

    Order: ``REFCOLL_MPIEXEC``, the one beside this Python (the mpich wheel's in a
    virtual environment), then ``PATH``.
    """
    if importlib.util.find_spec("mpi4py") is None:
        raise UsageError("mpi4py is not installed; " + INSTALL_HINT)
    override = os.environ.get("REFCOLL_MPIEXEC")
    if override:
        return override
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if found is None:
        raise UsageError("no mpiexec found; " + INSTALL_HINT)
    return found


@functools.lru_cache(maxsize=None)
def _is_open_mpi(mpiexec: str) -> bool:
    """Whether ``mpiexec`` is Open MPI's (asked once per launcher: it runs ``--version``)."""
    try:
        version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in version.stdout + version.stderr or "OpenRTE" in version.stdout


def mpiexec_command(n: int, args: list[str], *, mpiexec: str | None = None) -> list[str]:
    """Return the command that runs ``python -m refcoll ARGS`` on ``n`` processes.

    Oversubscription is allowed (Open MPI needs ``--oversubscribe``; MPICH's
    hydra allows it by default), so ``-n 8`` works on a 2-core laptop. Python starts
    without the working folder on its import path (:func:`~refcoll.core.processes.python`),
    so a ``./refcoll/`` where the command runs is never imported in place of the package.
    """
    if n < 1:
        raise UsageError(f"-n must be at least 1, got {n}")
    launcher = mpiexec or find_mpiexec()
    extra = ["--oversubscribe"] if _is_open_mpi(launcher) else []
    return [launcher, *extra, "-n", str(n), *python("-m", "refcoll", *args)]


# ------------------------------------------------------------------------- re-running

_invoked_args: list[str] = []
_exit_notes: list[str] = []  # the folder this rank notes its status in (relaunch's), if any


def remember_arguments(args: list[str]) -> None:
    """Keep the arguments ``refcoll`` was called with, for :func:`relaunch` to pass on; take
    the folder of exit notes out of the environment (a process this rank starts is not one
    of the job's ranks)."""
    global _invoked_args
    _invoked_args = list(args)
    folder = os.environ.pop(EXIT_NOTES, None)
    _exit_notes[:] = [folder] if folder else []
    _note("running")  # this rank reached the folder (a node without it notes nothing)


def note_exit(code) -> None:
    """Note the status this rank exits with for the :func:`relaunch` that started it."""
    _note(str(code if isinstance(code, int) else (0 if code is None else 1)))


def _note(text: str) -> None:
    if not _exit_notes:
        return
    try:
        writing.write_text(os.path.join(_exit_notes[0], str(os.getpid())), text)
    except (OSError, UsageError):  # another node, whose file system lacks the folder
        pass


#: Variables through which MPICH's launcher takes hosts from outside its command line (its
#: host file, a scheduler's allocation): ranks may then run on other nodes.
_HOSTS_FROM = ("HYDRA_HOST_FILE", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "COBALT_JOBID",
               "FLUX_JOB_ID", "PE_HOSTFILE")


def _ranks_here(launcher: str) -> bool:
    """Whether the relaunched job's ranks all run on this machine: MPICH's launcher, the
    one refcoll found itself (not ``REFCOLL_MPIEXEC``'s), given no hosts, outside any
    allocation it reads (Open MPI's also reads install-wide host files: never sure).
    Every such rank notes that it started, so a job none of whose ranks did is the
    launcher's failure, whatever its status."""
    return ("REFCOLL_MPIEXEC" not in os.environ and not _is_open_mpi(launcher)
            and not any(v in os.environ for v in _HOSTS_FROM))


def _noted(folder: str) -> tuple[bool, set[int]]:
    """Return whether any rank of the job reached ``folder``, and the statuses they noted."""
    reached, found = False, set()
    for name in os.listdir(folder):
        reached = True
        try:
            found.add(int(reading.read_text(os.path.join(folder, name), max_bytes=64,
                                            what="exit note").strip()))
        except (UsageError, ValueError):  # still "running": it ended without a word
            continue
    return reached, found


def invoked_arguments() -> list[str]:
    """Return the arguments ``refcoll`` was called with (after the program's name)."""
    return list(_invoked_args)


def arguments_problem(arguments: list) -> str | None:
    """Return what differs between the ranks' arguments (``arguments[r]``: rank r's, a list
    of words), or None when every rank was given rank 0's.

    A job whose ranks were given different arguments (an MPMD command line, a script
    that builds them per host) would run other cases, sizes or inputs on each rank:
    every such job is refused, on every rank, before anything runs.
    """
    first = list(arguments[0])
    for rank, words in enumerate(arguments[1:], 1):
        words = list(words)
        if words == first:
            continue
        parts = []
        matcher = difflib.SequenceMatcher(a=first, b=words, autojunk=False)
        for tag, a0, a1, b0, b1 in matcher.get_opcodes():
            if tag == "equal":
                continue
            if a0 and b0 and first[a0 - 1].startswith("-"):  # the option whose value differs
                a0, b0 = a0 - 1, b0 - 1
            parts.append(f"rank {rank} has {' '.join(words[b0:b1]) or 'nothing'!r} where "
                         f"rank 0 has {' '.join(first[a0:a1]) or 'nothing'!r}")
        return ("the ranks were given different arguments: " + "; ".join(parts[:3])
                + ": give every rank the same command")
    return None


def check_environment() -> None:
    """Refuse, before starting any process, a ``REFCOLL_*`` setting every rank would refuse."""
    default_timeout()
    calibration_mode()
    algo_filter()
    debug_check_level()  # REFCOLL_DEBUG: a level it does not know


def workers_env(workers: int) -> dict[str, str]:
    """Return the environment that tells a relaunched job its first ``workers`` ranks hold data."""
    return {WORKERS_VARIABLE: str(workers)}


def relaunch(nprocs: int, env: dict | None = None) -> None:
    """Re-run this very command under ``mpiexec -n nprocs`` and exit with its status.

    ``env`` is added to this process's environment for the job (give it
    :func:`workers_env` when some of the ``nprocs`` ranks are helpers).
    """
    check_environment()
    cmd = mpiexec_command(nprocs, _invoked_args)
    with tempfile.TemporaryDirectory(prefix="refcoll-exit-") as notes:
        try:
            code = subprocess.run(cmd, env={**os.environ, **(env or {}),
                                            EXIT_NOTES: notes}).returncode
        except OSError as exc:
            raise UsageError(f"could not start {cmd[0]}: {exc}") from None
        # MPICH's mpiexec passes on a rank's signal as its status: SIGINT is 2, a usage
        # error's, and SIGHUP 1, a failed check's. Those are the ranks' own only where one
        # of them noted it, or where none could (ranks on other nodes only, whose file
        # systems lack the folder). (3, SIGQUIT's, is a fault either way, as a timeout is.)
        reached, noted = _noted(notes)
        unseen = not reached and not _ranks_here(cmd[0])  # elsewhere: they note nothing here
        own = (code in (0, 3, BROKEN_PIPE) and (reached or unseen)) or \
            (code in (1, 2) and (code in noted or unseen))
    if code == BROKEN_PIPE:
        sys.exit(code)  # the reader went away: nothing to say
    if not own:  # a rank killed, or the launcher failing
        why = ("no rank of the job started" if not reached else
               "a rank died or the launcher failed")
        click.echo(f"refcoll: error: {cmd[0]} exited with status {code}: {why}; nothing was "
                   "judged", err=True)
        code = 3  # a fault, as a timeout is; never a failed check (1)
    sys.exit(code)


# ------------------------------------------------------------------------ in the world

#: The longest wait ``select`` takes (a deadline beyond it is as good as none: a year).
_LONGEST_SELECT = 365 * 24 * 3600.0


def start_mpi(what: str):
    """Return mpi4py's MPI module, initialising MPI by the deadline; else end this rank.

    ``MPI_Init`` waits for every rank of the job, and a rank that never calls it (it
    stopped on an error in its arguments or files, one another node did not see)
    leaves the others there for ever, holding the GIL, so no thread of this process
    can time out. A small watcher process, forked before, waits for word that MPI
    started; past ``REFCOLL_TIMEOUT`` it says why on stderr and ends this rank,
    which ends the job.
    """
    seconds = default_timeout()
    if "mpi4py.MPI" in sys.modules or seconds is None:  # started already, or no deadline
        from mpi4py import MPI

        return MPI
    parent = os.getpid()
    read_end, write_end = os.pipe()
    watcher = os.fork()
    if watcher == 0:  # the watcher: a word (or the end of its parent) within the deadline
        try:
            os.close(write_end)
            ready, _, _ = select.select([read_end], [], [], min(seconds, _LONGEST_SELECT))
            if not ready and os.getppid() == parent:  # never another process, once orphaned
                os.write(2, (f"refcoll: error: {what}: MPI did not start within {seconds:g} s "
                             "(REFCOLL_TIMEOUT): a rank of this job never started it; it may "
                             "have stopped on an error (see its message)\n").encode())
                os.kill(parent, signal.SIGKILL)
        finally:
            os._exit(0)
    os.close(read_end)
    try:
        from mpi4py import MPI
    finally:
        os.write(write_end, b"k")
        os.close(write_end)
        os.waitpid(watcher, 0)
    return MPI


def given(name: str = "nprocs") -> bool:
    """Return whether the running command was given option ``name`` (click's parameter name;
    ``nprocs`` is ``-n``), not left at its default."""
    ctx = click.get_current_context(silent=True)
    source = ctx.get_parameter_source(name) if ctx is not None else None
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def data_ranks(world, nprocs: int) -> int:
    """Return how many ranks of ``world`` hold data; say once when ``-n`` was overruled.

    ``world`` is an mpi4py communicator or a transport (anything with ``rank``
    and ``size``). The count is :data:`WORKERS_VARIABLE` where :func:`relaunch`
    set it, else the whole world. Started by a user's ``mpiexec`` of another
    size than ``-n nprocs``, rank 0 notes on stderr that the job's size wins.

    Raises:
        UsageError: :data:`WORKERS_VARIABLE` is not a count that fits the world.
    """
    size = world.size
    setting = os.environ.get(WORKERS_VARIABLE)
    try:
        workers = size if setting is None else int(setting)
    except ValueError:
        raise UsageError(f"{WORKERS_VARIABLE}={setting} is not a number of ranks") from None
    if not 1 <= workers <= size:
        raise UsageError(f"{WORKERS_VARIABLE}={workers} does not fit a world of {size} ranks")
    if world.rank == 0 and setting is None and nprocs != size and given("nprocs"):
        click.echo(f"refcoll: note: already inside an MPI job of {size} processes; "
                   f"using it (-n {nprocs} ignored)", err=True)
    return workers
