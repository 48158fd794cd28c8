"""Shared test helpers: the simulated battery, and where MPI is."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from refcoll.verify.conformance import build_cases, run_battery
from refcoll.transport import SimWorld

ROOT = Path(__file__).resolve().parents[1]

# Simulated ranks are threads that hand over on every message: a shorter switch
# interval than CPython's 5 ms default makes the simulated suite several times faster.
sys.setswitchinterval(1e-3)

# auto's calibrations measured by the suite's MPI jobs go to a cache of the suite's own
# (inherited by every job it starts), never into the user's ~/.cache/refcoll.
os.environ.setdefault("REFCOLL_CACHE", tempfile.mkdtemp(prefix="refcoll-test-cache-"))

# tests/mpi/ runs under mpiexec (see test_mpi.py); the serial run does not collect it.
collect_ignore = [] if "--with-mpi" in sys.argv else ["mpi"]


def mpiexec_path() -> str | None:
    """Return the mpiexec beside this Python (the mpich wheel's) or on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    return os.environ.get("REFCOLL_MPIEXEC") or shutil.which("mpiexec")


def sim_battery(p: int, **selection):
    """Run the conformance battery on ``p`` simulated ranks; return failing results."""
    cases = build_cases(p, **selection)
    assert cases, f"no cases selected for p={p}: {selection}"
    results = SimWorld(p).run(lambda t: run_battery(t, cases))[0]
    assert len(results) == len(cases)
    return [r for r in results if not r.passed]


def failure_text(failures) -> str:
    return "\n".join(f"{r.case.id}: {r.reason}" for r in failures[:10])
