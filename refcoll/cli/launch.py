"""Starting MPI jobs: find ``mpiexec``, tell whether we already run under one.

Commands that need several processes re-run themselves as
``mpiexec -n N python -m refcoll ...`` unless they already run inside an MPI
job, in which case they use the existing world.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from ..core.errors import UsageError

__all__ = ["in_mpi_job", "find_mpiexec", "mpiexec_command", "INSTALL_HINT"]

INSTALL_HINT = ("install an MPI runtime with: pip install 'refcoll[mpi]' (the mpich wheel), "
                "or point REFCOLL_MPIEXEC at your system's mpiexec")

# Set by mpiexec of MPICH (hydra), Open MPI, PMIx launchers, Intel MPI and Slurm's srun.
_JOB_VARIABLES = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS",
                  "SLURM_PMIX_MAPPING_SERV")


def in_mpi_job() -> bool:
    """Return whether this process was started by an MPI launcher."""
    return any(v in os.environ for v in _JOB_VARIABLES)


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
    hydra allows it by default), so ``-n 8`` works on a 2-core laptop.
    """
    if n < 1:
        raise UsageError(f"-n must be at least 1, got {n}")
    launcher = mpiexec or find_mpiexec()
    extra = ["--oversubscribe"] if _is_open_mpi(launcher) else []
    return [launcher, *extra, "-n", str(n), sys.executable, "-m", "refcoll", *args]
