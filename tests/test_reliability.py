"""Bad input fails loudly and precisely on every rank: mismatches, dead peers, odd arrays."""

import os
import re
import socket
import subprocess
import sys
import textwrap
import time

import ml_dtypes
import numpy as np
import pytest
from conftest import mpiexec_path

import refcoll
from refcoll.core.errors import MismatchError, RefcollError
from refcoll.transport import SimWorld
from refcoll.verify.oracle import fold

MPIEXEC = mpiexec_path()
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: pip install 'refcoll[mpi]'")


def errors_on_every_rank(p, call):
    def body(t):
        try:
            call(t)
        except MismatchError as exc:
            return str(exc)
        return None

    return SimWorld(p).run(body)


@pytest.mark.parametrize("field,call,expected", [
    ("count", lambda t: refcoll.allreduce(np.zeros(999 if t.rank == 3 else 1000), t),
     "count: rank 0 has 1000, rank 3 has 999"),
    ("dtype", lambda t: refcoll.allreduce(np.zeros(8, np.int32 if t.rank == 1 else np.float32), t),
     "dtype: rank 0 has float32, rank 1 has int32"),
    ("op", lambda t: refcoll.allreduce(np.zeros(8), t, op="max" if t.rank == 2 else "sum"),
     "op: rank 0 has sum, rank 2 has max"),
    ("algorithm",
     lambda t: refcoll.allreduce(np.zeros(8), t, algorithm="tree" if t.rank == 0 else "ring"),
     "algorithm: rank 1 has ring, rank 0 has tree"),
    ("root", lambda t: refcoll.broadcast(np.zeros(8), 1 if t.rank == 3 else 0, t),
     "root: rank 0 has 0, rank 3 has 1"),
])
def test_a_mismatch_raises_the_same_named_error_on_every_rank(field, call, expected):
    messages = errors_on_every_rank(4, call)
    assert len(set(messages)) == 1, "every rank must raise the same error"
    assert messages[0] is not None and expected in messages[0]


def test_without_validation_a_count_mismatch_is_still_an_error_not_a_wrong_answer():
    def body(t):
        refcoll.allreduce(np.zeros(999 if t.rank == 1 else 1000), t, validate=False)

    with pytest.raises(RefcollError, match="size mismatch"):
        SimWorld(2).run(body)


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_nan_and_inf_propagate_as_the_naive_reference():
    xs = [np.array([np.nan, 1.0, np.inf, -np.inf, 2.0]) * (r + 1) for r in range(3)]
    xs[1][4] = np.inf
    xs[2][4] = -np.inf
    for algorithm in ("ring", "tree", "rabenseifner", "recursive_doubling"):
        for op in ("sum", "max", "min"):
            got = refcoll.simulate("allreduce", xs, algorithm=algorithm, op=op).outputs[0]
            np.testing.assert_array_equal(got, fold(op, xs))


def test_zero_d_and_multidimensional_and_fortran_arrays():
    xs0 = [np.float64(r + 1.5) for r in range(3)]
    out = SimWorld(3).run(lambda t: refcoll.allreduce(np.asarray(xs0[t.rank]), t))
    assert out[0].shape == () and float(out[0]) == sum(xs0)
    xs = [np.asfortranarray(np.arange(12, dtype=np.int64).reshape(3, 4) * (r + 1))
          for r in range(2)]
    out = SimWorld(2).run(lambda t: refcoll.allreduce(xs[t.rank], t, algorithm="rabenseifner"))
    np.testing.assert_array_equal(out[1], xs[0] * 3)


def test_integer_overflow_wraps_like_numpy():
    xs = [np.array([100, -100], dtype=np.int8)] * 3
    got = refcoll.simulate("allreduce", xs, algorithm="ring").outputs[0]
    assert got.tolist() == [np.int8(44), np.int8(-44)]  # 300 and -300 wrapped to int8


def test_read_only_input_and_bfloat16():
    x = np.ones(10, dtype=ml_dtypes.bfloat16)
    x.flags.writeable = False
    out = SimWorld(2).run(lambda t: refcoll.allreduce(x, t, op="avg"))
    assert out[0].dtype == ml_dtypes.bfloat16 and float(out[0][0]) == 1.0


MISMATCH = textwrap.dedent("""
    import sys
    import numpy as np
    from mpi4py import MPI
    import refcoll
    comm = MPI.COMM_WORLD
    n = 999 if comm.rank == 3 else 1000
    try:
        refcoll.allreduce(np.zeros(n, np.float32), comm)
    except refcoll.MismatchError as exc:
        print(f"rank {comm.rank}: {exc}", flush=True)
        comm.Barrier()  # every rank raised: all reach here, so every line is printed
        sys.exit(1)
""")

STALL = textwrap.dedent("""
    import os, signal, sys, time
    import numpy as np
    from mpi4py import MPI
    import refcoll
    from refcoll.cli import reports_errors
    comm = MPI.COMM_WORLD
    comm.Barrier()  # every rank has started: no deadline below can catch a slow start-up
    x = np.ones(4096, np.float32)
    refcoll.allreduce(x, comm)

    @reports_errors
    def run():
        if comm.rank == 2:
            if sys.argv[1] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(600)  # alive but gone from the collective
        for _ in range(10):
            refcoll.allreduce(x, comm)

    run()
""")


def run_mpi(tmp_path, script, n, *args, timeout_env="5"):
    path = tmp_path / "job.py"
    path.write_text(script)
    env = dict(os.environ, REFCOLL_TIMEOUT=timeout_env)
    start = time.monotonic()
    res = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, str(path), *args],
                         capture_output=True, text=True, timeout=120, env=env)
    return res, time.monotonic() - start, path


def leftovers(path) -> list[str]:
    out = subprocess.run(["pgrep", "-f", str(path)], capture_output=True, text=True)
    return out.stdout.split()


@needs_mpi
def test_mpi_mismatch_ends_every_rank_with_the_named_error_quickly(tmp_path):
    # With a ten-minute deadline, only an immediate error ends the job inside run_mpi's
    # two-minute limit: this bounds no duration that the machine's load could stretch.
    res, _, _ = run_mpi(tmp_path, MISMATCH, 4, timeout_env="600")
    assert res.returncode == 1, res.stdout + res.stderr
    # Ranks print concurrently, so lines may interleave: count the messages instead.
    reports = re.findall(r"rank (\d): ranks called allreduce with different arguments: "
                         r"count: rank 0 has 1000, rank 3 has 999", res.stdout)
    assert sorted(reports) == ["0", "1", "2", "3"], res.stdout


@needs_mpi
@pytest.mark.parametrize("how", ["stall", "kill"])
def test_a_dead_or_stalled_peer_ends_the_job_within_the_timeout(tmp_path, how):
    # The stalled rank sleeps ten minutes: a job that ends inside run_mpi's two-minute
    # limit was ended by the 5 s deadline (or by mpiexec, for the killed rank).
    res, _, path = run_mpi(tmp_path, STALL, 4, how)
    assert res.returncode != 0
    if how == "stall":
        assert res.returncode == 3, res.stderr
        # Ranks wait on each other in a chain that ends at rank 2, and whichever rank's
        # deadline passes first ends the job: it names the peer it waits on, not
        # necessarily rank 2.
        assert re.search(r"rank \d: allreduce timed out after 5 s at its exchange \d+ of this "
                         r"call, still waiting to (receive|send) \d+ B (from|to) rank \d \(host "
                         + re.escape(socket.gethostname()) + r"\)", res.stderr), res.stderr
    for _ in range(300):  # mpiexec has returned; its processes may take a moment to go
        if not leftovers(path):
            break
        time.sleep(0.1)
    assert leftovers(path) == [], "no process of the job may be left"


@pytest.mark.parametrize("bad", ["byteorder", "dtype", "out"])
def test_a_bad_argument_on_one_rank_is_an_error_on_every_rank(bad):
    def body(t):
        x = np.zeros(4, np.float32)
        out = None
        if t.rank == 2 and bad == "byteorder":
            x = x.astype(x.dtype.newbyteorder())
        if t.rank == 2 and bad == "dtype":
            x = np.zeros(4, np.complex64)
        if t.rank == 2 and bad == "out":
            out = np.zeros(3, np.float32)
        try:
            refcoll.allreduce(x, t, out=out)
        except (TypeError, ValueError) as exc:
            return str(exc)
        return None

    messages = SimWorld(4).run(body)
    assert all(m is not None for m in messages), messages
    assert all("rank 2" in m for m in messages)
