"""Starting MPI jobs: find ``mpiexec``, re-run a command under it, read the world it gave.

Commands that need several processes re-run themselves as
``mpiexec -n N python -m refcoll ...`` (:func:`relaunch`) unless they already
run inside an MPI job, in which case they use the existing world. Inside it,
:func:`data_ranks` says how many of its ranks hold data (the rest are helper
processes, such as switches) and notes once when ``-n`` was overruled.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import click

from ..calls.auto import algo_filter, calibration_mode
from ..calls.debug import enabled as debug_enabled
from ..core.errors import UsageError
from ..core.processes import python
from ..transport.base import default_timeout

__all__ = ["in_mpi_job", "in_torchrun", "find_mpiexec", "mpiexec_command", "INSTALL_HINT",
           "relaunch", "check_environment", "workers_env", "data_ranks", "remember_arguments",
           "WORKERS_VARIABLE", "BROKEN_PIPE"]

#: The status of a process that SIGPIPE ended (128 + 13): what ``yes | head`` leaves.
BROKEN_PIPE = 141

#: How many ranks of the world hold data, set by :func:`relaunch` when helper
#: processes (switches) are started beside them.
WORKERS_VARIABLE = "REFCOLL_WORKERS"

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


def _is_open_mpi(mpiexec: str) -> bool:
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


def remember_arguments(args: list[str]) -> None:
    """Keep the arguments ``refcoll`` was called with, for :func:`relaunch` to pass on."""
    global _invoked_args
    _invoked_args = list(args)


def check_environment() -> None:
    """Refuse, before starting any process, a ``REFCOLL_*`` setting every rank would refuse."""
    default_timeout()
    calibration_mode()
    algo_filter()
    debug_enabled()  # REFCOLL_DEBUG: a level it does not know


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
    try:
        code = subprocess.run(cmd, env={**os.environ, **(env or {})}).returncode
    except OSError as exc:
        raise UsageError(f"could not start {cmd[0]}: {exc}") from None
    if code == BROKEN_PIPE:
        sys.exit(code)  # the reader went away: nothing to say
    if code not in (0, 1, 2, 3):  # a rank killed, or the launcher failing
        click.echo(f"refcoll: error: {cmd[0]} exited with status {code}", err=True)
        code = 1
    sys.exit(code)


# ------------------------------------------------------------------------ in the world

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
    if world.rank == 0 and setting is None and nprocs != size:
        click.echo(f"refcoll: note: already inside an MPI job of {size} processes; "
                   f"using it (-n {nprocs} ignored)", err=True)
    return workers
