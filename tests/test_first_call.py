"""A rank that never comes to a call ends the job with a named timeout, never a hang.

The first call on a communicator creates refcoll's duplicate of it
(``MPI_Comm_idup``), a hierarchical call splits it (``MPI_Comm_split_type``,
``MPI_Comm_split``) and the first ``auto`` call agrees on its calibration: each
of these waits by the deadline of ``REFCOLL_TIMEOUT`` like every exchange.

The jobs below leave one rank asleep for ten minutes. A job that ends at all
within the subprocess limit (two minutes) was ended by the timeout, whatever
the machine's load: these tests bound no duration but that one.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest
from conftest import mpiexec_path

from refcoll.core.errors import UsageError
from refcoll.transport.base import default_timeout

MPIEXEC = mpiexec_path()
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: pip install 'refcoll[mpi]'")

#: Seconds of REFCOLL_TIMEOUT in these jobs; the sleeping rank sleeps far longer.
TIMEOUT = 2

ABSENT = textwrap.dedent("""
    import sys, time
    import numpy as np
    from mpi4py import MPI
    import refcoll

    comm = MPI.COMM_WORLD
    comm.Barrier()  # every rank has started: no deadline below can catch a slow start-up
    where = sys.argv[1]
    x = np.arange(64, dtype=np.float64)
    if where != "first":
        refcoll.allreduce(x, comm)  # the transport exists: only the later call is missed
    if comm.rank == 2:
        time.sleep(600)  # alive, but never comes to the call
        sys.exit(0)
    if where in ("first", "after"):
        refcoll.allreduce(x, comm)
    elif where == "hierarchical":
        # validate=False leaves the argument agreement out: the node split itself must time out.
        refcoll.allreduce(x, comm, algorithm="hierarchical", validate=False)
    elif where == "auto":
        refcoll.allreduce(x, comm, algorithm="auto", validate=False)
""")


def run_job(tmp_path, where: str, *, launcher=("-m", "mpi4py"), env_extra=None):
    path = tmp_path / "absent.py"
    path.write_text(ABSENT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    env.update(REFCOLL_TIMEOUT=str(TIMEOUT), **(env_extra or {}))
    env.pop("REFCOLL_CALIBRATION", None)  # the first auto call really agrees and calibrates
    return subprocess.run([MPIEXEC, "-n", "4", sys.executable, *launcher, str(path), where],
                          capture_output=True, text=True, timeout=120, env=env)


@needs_mpi
@pytest.mark.parametrize("where,stage", [
    ("first", "at communicator setup (MPI_Comm_idup over 4 ranks)"),
    ("hierarchical", "at communicator setup (MPI_Ibarrier over 4 ranks)"),
    ("auto", "at its exchange"),
    ("after", "at its exchange"),
])
def test_a_rank_that_never_calls_ends_the_job_with_a_named_timeout(tmp_path, where, stage):
    res = run_job(tmp_path, where)
    assert res.returncode != 0, res.stderr
    assert f"allreduce timed out after {TIMEOUT} s {stage}" in res.stderr or (
        f"allreduce (MPI_Comm_split_type) timed out after {TIMEOUT} s {stage}" in res.stderr
    ), res.stderr[-3000:]
    if "communicator setup" in stage:  # a nonblocking collective cannot name the absent
        assert "MPI cannot tell which have not" in res.stderr
    else:  # a point-to-point wait names the peer
        assert re.search(r"still waiting to (receive|send) \d+ B (from|to) rank \d", res.stderr)


@needs_mpi
def test_abort_on_timeout_ends_a_plain_python_job(tmp_path):
    # Without python -m mpi4py an unhandled exception leaves the sleeping rank running;
    # REFCOLL_ABORT_ON_TIMEOUT=1 makes the timeout end every process of the job.
    res = run_job(tmp_path, "first", launcher=(), env_extra={"REFCOLL_ABORT_ON_TIMEOUT": "1"})
    assert res.returncode != 0
    assert "aborting the MPI job (REFCOLL_ABORT_ON_TIMEOUT=1)" in res.stderr, res.stderr[-3000:]


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "-inf", "1e400x"])
def test_a_bad_timeout_is_a_usage_error(monkeypatch, value):
    monkeypatch.setenv("REFCOLL_TIMEOUT", value)
    with pytest.raises(UsageError, match="REFCOLL_TIMEOUT=.* is not a number of seconds"):
        default_timeout()


@pytest.mark.parametrize("value,expected", [("0", None), ("none", None), ("inf", None),
                                            ("2.5", 2.5), ("", 300.0)])
def test_timeout_values(monkeypatch, value, expected):
    monkeypatch.setenv("REFCOLL_TIMEOUT", value)
    assert default_timeout() == expected


@needs_mpi
@pytest.mark.parametrize("value", ["abc", "-1"])
def test_a_bad_timeout_fails_every_rank_of_a_program_with_one_message(tmp_path, value):
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent("""
        import numpy as np
        from mpi4py import MPI
        import refcoll
        try:
            refcoll.allreduce(np.ones(4), MPI.COMM_WORLD)
        except refcoll.UsageError as exc:
            print(f"rank {MPI.COMM_WORLD.rank}: {exc}", flush=True)
    """))
    env = dict(os.environ, REFCOLL_TIMEOUT=value)
    res = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(path)], capture_output=True,
                         text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    # Ranks print at once, so their lines may run together: count the messages instead.
    ranks = re.findall(r"rank (\d): REFCOLL_TIMEOUT='[^']*' is not a number of seconds", res.stdout)
    assert sorted(ranks) == ["0", "1"], res.stdout


def test_a_bad_timeout_stops_the_cli_before_it_starts_mpiexec():
    res = subprocess.run([sys.executable, "-m", "refcoll", "verify", "-n", "2"],
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, REFCOLL_TIMEOUT="abc"))
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [
        "refcoll: error: REFCOLL_TIMEOUT='abc' is not a number of seconds: give a positive "
        "number (for example 300), or 0 to wait forever"]
