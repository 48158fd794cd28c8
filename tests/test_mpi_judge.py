"""`refcoll verify --backend mpi`: the MPI library's own collectives judged by the oracle.

On MPICH the battery passes and each float order is named; a library that saturates
its 8-bit sums (as Open MPI does) is reported, naming the dtypes, not hidden; under
Open MPI itself (``REFCOLL_OPENMPI_PYTHON``, as CI builds it) the run exits 1 naming
int8 and int16; what does not apply to the MPI library's calls is refused at once; no
order is named for a class with a failed case; ranks given different arguments, and a rank
that never starts MPI, end the job with a reason, never a wait for ever.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from refcoll.cli import main

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    env.update(REFCOLL_TIMEOUT="60", REFCOLL_CALIBRATION="default")
    return env


def refcoll(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "refcoll", *args], capture_output=True,
                          text=True, timeout=timeout, env=_env())


def test_mpich_passes_the_battery_and_its_float_orders_are_named(tmp_path):
    out = tmp_path / "mpi.json"
    res = refcoll("verify", "--backend", "mpi", "-n", "2", "--dtype", "int8,float32",
                  "--sizes", "0,1,5003", "--json", str(out))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    text = res.stdout
    for call in ("MPI_Allreduce", "MPI_Reduce_scatter_block", "MPI_Allgather", "MPI_Bcast",
                 "MPI_Reduce"):
        assert call in text, text
    assert "MPI has no average op" in text  # avg is not supported, not failed
    assert " 0 failed" in text.splitlines()[-1]
    data = json.loads(out.read_text())
    assert data["backend"] == "mpi" and data["failed"] == 0 and data["passed"] > 100
    assert "MPICH" in data["version"]
    # Order-dependent classes name the refcoll orders with the same bits (at 2 ranks a
    # sum of two has one order: every candidate).
    assert data["same_bits"]["allreduce sum float32"]
    assert {c["collective"] for c in data["cases"]} == {"allreduce", "reduce_scatter",
                                                       "allgather", "broadcast", "reduce"}


SATURATING = textwrap.dedent("""
    import json
    import numpy as np
    from refcoll.baselines.mpi_judge import MPIJudge

    class Saturating(MPIJudge):
        '''An MPI whose 8-bit sums saturate, as Open MPI's do.'''
        def _call(self, case, mine):
            out, x = super()._call(case, mine)
            if case.op == "sum" and case.dtype == "int8" and case.collective == "allreduce":
                wide = np.empty(x.size, np.int64)
                self.comm.Allreduce(mine.astype(np.int64), wide)
                out[:] = np.clip(wide, -128, 127).astype(np.int8)
            return out, x

    judge = Saturating()
    report = judge.run(judge.cases(collectives=["allreduce"], ops=["sum"],
                                   dtypes=["int8", "int32"], sizes=[5003]))
    if judge.rank == 0:
        print(json.dumps({"failed": report.failed, "passed": report.passed,
                          "failing": sorted({r.case.dtype for r in report.results
                                             if not r.passed}),
                          "reasons": [r.reason for r in report.results if not r.passed]}))
""")


def test_a_saturating_library_is_reported_naming_its_dtype(tmp_path):
    script = tmp_path / "saturating.py"
    script.write_text(SATURATING)
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    res = subprocess.run([mpiexec, "-n", "2", sys.executable, str(script)], capture_output=True,
                         text=True, timeout=120, env=_env())
    assert res.returncode == 0, res.stderr[-3000:]
    found = json.loads(res.stdout.strip().splitlines()[-1])
    assert found["failing"] == ["int8"] and found["failed"] == 2 and found["passed"] == 2
    assert all("127" in reason for reason in found["reasons"])  # the saturated value named


def _openmpi():
    python = os.environ.get("REFCOLL_OPENMPI_PYTHON")
    if not python:
        return None, "no Open MPI here: set REFCOLL_OPENMPI_PYTHON (as .ci/run does)"
    mpirun = Path(python).parent / "mpirun"
    if not mpirun.exists():
        return None, f"no mpirun beside REFCOLL_OPENMPI_PYTHON={python}"
    return (python, mpirun), None


OPENMPI, NO_OPENMPI = _openmpi()


@pytest.mark.skipif(OPENMPI is None, reason=str(NO_OPENMPI))
def test_open_mpis_saturating_sums_fail_naming_int8_and_int16():
    python, mpirun = OPENMPI
    res = subprocess.run([str(mpirun), "--allow-run-as-root", "--oversubscribe", "-n", "2",
                          python, "-m", "refcoll", "verify", "--backend", "mpi", "--op", "sum",
                          "--dtype", "int8,int16,int32,float32", "--sizes", "1,5003"],
                         capture_output=True, timeout=300, env=_env())
    text = res.stdout.decode(errors="replace")
    assert res.returncode != 0, text[-3000:]
    assert "Open MPI" in text
    failed = [line for line in text.splitlines() if "failed on" in line]
    assert failed and all("failed on int8, int16;" in line for line in failed), text[-3000:]
    assert " failed" in text and " 0 failed" not in text


@pytest.mark.parametrize("args, needle", [
    (["--algorithm", "ring"], "--algorithm"),
    (["--compressor", "fp16"], "--compressor"),
    (["--device", "gpu"], "--device gpu"),
    (["--collective", "broadcast", "--inplace", "no"], "in place only"),
    (["--collective", "alltoall"], "alltoall"),
    (["--collective", "allreduce", "--op", "avg"], "average op"),  # known without MPI
    (["--collective", "allreduce", "--dtype", "bfloat16"], "no bfloat16 type"),
    (["--collective", "allreduce", "--op", ""], "no op is selected"),
])
def test_what_does_not_apply_to_mpis_calls_is_refused_at_once(args, needle, monkeypatch):
    for name in list(os.environ):  # not inside a job: the refusal comes before any mpiexec
        if name.startswith(("PMI_", "OMPI_", "PMIX_")):
            monkeypatch.delenv(name)
    monkeypatch.setattr("refcoll.cli.commands.relaunch", lambda *a, **k: pytest.fail("ran"))
    res = CliRunner().invoke(main, ["verify", "--backend", "mpi", "-n", "2", *args])
    assert res.exit_code == 2, res.output
    assert needle in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


FAILING_FLOAT = textwrap.dedent("""
    import json
    from refcoll.baselines.mpi_judge import MPIJudge

    class Off(MPIJudge):
        # An MPI whose float sums of 5003 random elements are wrong in one element.
        def _call(self, case, mine):
            out, x = super()._call(case, mine)
            if case.count == 5003 and case.kind == "random" and out is not None:
                out[0] *= 4
            return out, x

    judge = Off()
    report = judge.run(judge.cases(collectives=["allreduce"], ops=["sum"], dtypes=["float32"],
                                   sizes=[1, 5003]))
    if judge.rank == 0:
        print(json.dumps({"failed": report.failed, "same_bits": report.same_bits}))
""")


def _mpiexec(*args, timeout=120, env=None):
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    return subprocess.run([mpiexec, *args], capture_output=True, text=True, timeout=timeout,
                          env=env or _env())


def test_an_order_is_named_only_where_every_case_of_its_class_passed(tmp_path):
    script = tmp_path / "off.py"
    script.write_text(FAILING_FLOAT)
    res = _mpiexec("-n", "3", sys.executable, str(script))
    assert res.returncode == 0, res.stderr[-3000:]
    found = json.loads(res.stdout.strip().splitlines()[-1])
    # The cases of one element passed and every order gives their bits; the 5003 ones
    # failed: no order is the library's.
    assert found["failed"] >= 1 and found["same_bits"]["allreduce sum float32"] == []


def test_ranks_given_different_arguments_are_refused_on_every_rank():
    base = [sys.executable, "-m", "refcoll", "verify", "--backend", "mpi", "--collective",
            "allreduce", "--op", "sum", "--dtype", "float32", "--sizes", "5003"]
    res = _mpiexec("-n", "1", *base, "--seed", "0", ":", "-n", "1", *base, "--seed", "1")
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "rank 1 has '--seed 1' where rank 0 has '--seed 0'" in res.stderr, res.stderr
    assert "failed" not in res.stdout  # nothing was judged, MPI was not blamed


def test_a_rank_that_never_starts_mpi_ends_the_job_by_the_deadline():
    base = [sys.executable, "-m", "refcoll", "verify", "--backend", "mpi", "--collective",
            "allreduce", "--sizes", "3"]
    env = dict(_env(), REFCOLL_TIMEOUT="5")
    res = _mpiexec("-n", "1", *base, "--dtype", "int8", ":", "-n", "1", *base, "--dtype", "foo",
                   env=env)
    assert res.returncode != 0
    assert "unknown dtype 'foo'" in res.stderr  # the rank that stopped says why
    assert "MPI did not start within 5 s (REFCOLL_TIMEOUT)" in res.stderr, res.stderr


def test_the_library_version_keeps_no_nul(monkeypatch):
    from refcoll.transport.deadline import mpi, mpi_library_version

    monkeypatch.setattr(mpi(), "Get_library_version",
                        lambda: "Open MPI v5.0.11, package: Open MPI  2026\x00\n more")
    assert mpi_library_version() == "Open MPI v5.0.11, package: Open MPI 2026"


STALLED = textwrap.dedent("""
    import sys, time
    from refcoll.baselines import mpi_judge
    from refcoll.transport.deadline import bounded_barrier
    mine = mpi_judge.MPIJudge._call
    def _call(self, case, x):  # rank 1 passes the barrier, then never calls the library
        if self.rank == 1:
            bounded_barrier(self.ctl.comm, "stalled")
            time.sleep(60)
        return mine(self, case, x)
    mpi_judge.MPIJudge._call = _call
    from refcoll.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_a_rank_stalled_in_the_librarys_call_ends_the_job_by_the_deadline(tmp_path):
    # MPI_Allreduce has no deadline: the other ranks waited inside it for ever.
    script = tmp_path / "stalled.py"
    script.write_text(STALLED)
    res = _mpiexec("-n", "2", sys.executable, str(script), "verify", "--backend", "mpi",
                   "--collective", "allreduce", "--op", "sum", "--dtype", "int32",
                   "--sizes", "5003", env={**_env(), "REFCOLL_TIMEOUT": "3"})
    assert res.returncode == 3, res.stderr[-3000:]
    assert "the MPI library's MPI_Allreduce (allreduce, int32," in res.stderr
    assert "has not returned after 3 s" in res.stderr


NON_ROOT_WRITES = textwrap.dedent("""
    import json
    from refcoll.baselines.mpi_judge import MPIJudge
    class Writes(MPIJudge):  # a library that writes into a non-root's send buffer
        def _call(self, case, mine):
            out, x = super()._call(case, mine)
            if case.collective == "reduce" and self.rank != case.root and x.size > 3:
                x[3] += 1
            return out, x
    judge = Writes()
    report = judge.run(judge.cases(collectives=["reduce"], dtypes=["int32"], ops=["sum"],
                                   sizes=[5003]))
    if judge.rank == 0:
        print(json.dumps(sorted({r.case.inplace for r in report.results if not r.passed})))
""")


def test_a_reduce_that_writes_a_non_roots_send_buffer_fails_in_place_too(tmp_path):
    # In place, only the root passes MPI_IN_PLACE: the others send their input as it is,
    # and a library that wrote it passed there.
    script = tmp_path / "writes.py"
    script.write_text(NON_ROOT_WRITES)
    res = _mpiexec("-n", "2", sys.executable, str(script))
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == [False, True]
