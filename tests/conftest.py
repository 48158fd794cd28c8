"""Shared test helpers: the simulated battery, and where MPI is."""

from __future__ import annotations

import compileall
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from refcoll.transport import SimWorld
from refcoll.verify.conformance import build_cases, run_battery

ROOT = Path(__file__).resolve().parents[1]

# The suite starts a few hundred processes (mpiexec, torchrun, the CLI), which import refcoll
# from this checkout. Where the environment forbids writing bytecode (PYTHONDONTWRITEBYTECODE),
# each would compile every module again, a second of CPU apiece: compile them once here.
compileall.compile_dir(ROOT / "refcoll", quiet=1)

# Simulated ranks are threads that hand over on every message: a shorter switch
# interval than CPython's 5 ms default makes the simulated suite several times faster.
sys.setswitchinterval(1e-3)

# auto's calibrations measured by the suite's MPI jobs go to a cache of the suite's own
# (inherited by every job it starts), never into the user's ~/.cache/refcoll.
os.environ.setdefault("REFCOLL_CACHE", tempfile.mkdtemp(prefix="refcoll-test-cache-"))

# tests/mpi/ runs under mpiexec (see test_mpi.py); the serial run does not collect it.
collect_ignore = [] if "--with-mpi" in sys.argv else ["mpi"]
# tests/torch/ runs under torchrun and mpiexec (see test_torch.py), which set REFCOLL_TORCH_JOB.
if not os.environ.get("REFCOLL_TORCH_JOB"):
    collect_ignore.append("torch")
# tests/backend/ runs on the "refcoll" torch backend in a job (see test_torch_backend.py).
if not os.environ.get("REFCOLL_BACKEND_JOB"):
    collect_ignore.append("backend")


def mpiexec_path() -> str | None:
    """Return the mpiexec beside this Python (the mpich wheel's) or on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    return os.environ.get("REFCOLL_MPIEXEC") or shutil.which("mpiexec")


def run_script(tmp_path, p: int, source: str, args=(), env=None):
    """Run ``source`` as a script on ``p`` processes under mpiexec; skip without one.

    The environment is this one less any MPI library's variables (a forced
    algorithm of the caller's must not leak in), plus ``env``.
    """
    mpiexec = mpiexec_path()
    if mpiexec is None:
        pytest.skip("no mpiexec: install with pip install 'refcoll[mpi]'")
    script = tmp_path / "job.py"
    script.write_text(source)
    full = {k: v for k, v in os.environ.items()
            if not k.startswith(("MPIR_CVAR_", "PMI_", "OMPI_", "PMIX_"))}
    return subprocess.run([mpiexec, "-n", str(p), sys.executable, str(script), *args],
                          env={**full, **(env or {})}, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


#: The algorithm files' simulated batteries run without the non-blocking twins: the MPI
#: battery (tests/mpi/) runs every algorithm's twins on its covering cases at 1 to 8
#: processes, and test_nonblocking.py and test_battery_sim.py hold them in the simulator.
ALGORITHM_TWINS = False


def sim_battery(p: int, *, nonblocking: bool = ALGORITHM_TWINS, **selection):
    """Run the conformance battery on ``p`` simulated ranks; return failing results."""
    cases = build_cases(p, **selection)
    assert cases, f"no cases selected for p={p}: {selection}"
    results = SimWorld(p).run(lambda t: run_battery(t, cases, nonblocking=nonblocking))[0]
    assert len(results) == len(cases)
    return [r for r in results if not r.passed]


def raised_on_each_rank(fn, args_per_rank, timeout=None) -> list:
    """Run ``fn(t, *args_per_rank[r])`` on simulated rank ``r``; return what each raised (or
    None), so a test reads every rank's error."""

    def rank(t, *args):
        try:
            fn(t, *args)
        except Exception as exc:  # noqa: BLE001 - the test reads every rank's error
            return exc
        return None

    return SimWorld(len(args_per_rank), timeout=timeout).run(rank, args=args_per_rank)


def failure_text(failures) -> str:
    return "\n".join(f"{r.case.id}: {r.reason}" for r in failures[:10])


def covering(cases, key):
    """Return one case per ``key(case)``: the i-th group, in the battery's order, its (i mod n)-th.

    A group's cases differ only in the fields ``key`` leaves out (dtype, then mode,
    then input kind, in the battery's order), so consecutive groups of one call
    take different ones: each call keeps both modes, and each algorithm every
    dtype and input kind (:func:`classes`, asserted before the run).
    """
    groups: dict = {}
    for case in cases:
        groups.setdefault(key(case), []).append(case)
    return [group[i % len(group)] for i, group in enumerate(groups.values())]


def fewest_covering(cases) -> list:
    """Return a few cases that keep every class of ``cases`` (:func:`classes`), greedily.

    Each case is taken, in the battery's order, when it brings a class no case
    taken before has: for a battery run where every launch costs, as the torch
    transport's launches under two launchers do.
    """
    seen, chosen = set(), []
    for case in cases:
        new = classes([case]) - seen
        if new:
            chosen.append(case)
            seen |= new
    return chosen


def classes(cases) -> set:
    """Each call's ops, sizes and modes, and each algorithm's dtypes and input kinds."""
    out = set()
    for c in cases:
        call = (c.algorithm, c.collective, c.options)
        out |= {(call, c.op), (call, "size", c.count), (call, "inplace", c.inplace),
                (c.algorithm, c.dtype, c.kind)}
    return out


@pytest.fixture
def launched(monkeypatch):
    """Make a command's ``mpiexec`` a recorder: returns the dict it fills with ``cmd`` and ``env``.

    Outside an MPI job, with MPICH's launcher, so that the command starts the job
    itself, as it would from a shell.
    """
    import refcoll.cli as cli

    seen = {}

    def fake_run(cmd, env=None):
        seen.update(cmd=cmd, env=env)
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(cli.subprocess, "run", fake_run)
    monkeypatch.setattr("refcoll.cli.launch.in_mpi_job", lambda: False)
    monkeypatch.setattr("refcoll.cli.launch._is_open_mpi", lambda launcher: False)
    monkeypatch.setenv("REFCOLL_MPIEXEC", "mpiexec")
    return seen
