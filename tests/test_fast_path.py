"""Prepared all-reduces: a repeated call gives the bits of its first, ordinary run.

The first all-reduce of an (algorithm, op, dtype, count) runs the algorithm; later
ones run what it prepared (small ones: a recorded plan over persistent MPI
requests). Under ``mpiexec`` every prepared result is compared bit for bit with
the ordinary run and with the simulator, and a stalled peer still ends a planned
call with :class:`~refcoll.core.errors.CollectiveTimeout`.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import refcoll
from conftest import mpiexec_path
from refcoll.core.ops import get_op
from refcoll.transport.recorder import Recorder
from refcoll.transport import SimWorld

MPIEXEC = mpiexec_path()
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: pip install 'refcoll[mpi]'")


class _Recording:
    """What a recorder's transport needs: rank, size, persistent exchanges as plain tuples."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def persistent(self, sends, recvs):
        return ("exchange", [(b.nbytes, peer) for b, peer, _ in sends],
                [(b.nbytes, peer) for b, peer, _ in recvs])

    def reduce_local(self, op, a, b, out):
        op.apply(a, b, out)


@pytest.mark.parametrize("algorithm", sorted(name for name, algo in refcoll.REGISTRY.items()
                                              if algo.replayable))
@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_a_recording_holds_every_message_and_reduction_of_the_ledger(algorithm, p):
    count = 37
    ledger = refcoll.simulate("allreduce", [np.zeros(count, np.float32)] * p,
                              algorithm=algorithm).ledger
    fn = refcoll.algorithms.implementation(algorithm, "allreduce")
    for rank in range(p):
        recorder = Recorder(_Recording(rank, p))
        fn(recorder, np.zeros(count, np.float32), np.empty(count, np.float32), op=get_op("sum"))
        exchanges = [s for s in recorder.steps if isinstance(s, tuple)]
        sent = sorted((n, peer) for _, sends, _ in exchanges for n, peer in sends)
        received = sorted((n, peer) for _, _, recvs in exchanges for n, peer in recvs)
        assert sent == sorted((m.nbytes, m.dest) for m in ledger.messages if m.source == rank)
        assert received == sorted((m.nbytes, m.source) for m in ledger.messages
                                  if m.dest == rank)
        reductions = len(recorder.steps) - len(exchanges)
        assert reductions == sum(1 for r in ledger.reductions if r.rank == rank)


@pytest.mark.parametrize("algorithm", ["ring", "rabenseifner", "recursive_doubling"])
@pytest.mark.parametrize("p", [2, 3, 5])
def test_receiving_into_the_result_gives_the_in_place_bits(algorithm, p):
    # Out of place, partials land straight in out; in place they go through scratch.
    rng = np.random.default_rng(p)
    xs = [rng.standard_normal(1001).astype(np.float32) for _ in range(p)]
    for op in ("sum", "min"):
        apart = SimWorld(p).run(lambda t: refcoll.allreduce(
            xs[t.rank], t, op=op, algorithm=algorithm, out=np.empty(1001, np.float32)))
        inplace = SimWorld(p).run(lambda t: refcoll.allreduce(
            xs[t.rank].copy(), t, op=op, algorithm=algorithm, out=None))
        for a, b in zip(apart, inplace):
            assert a.tobytes() == b.tobytes() == apart[0].tobytes()


def test_a_repeated_call_on_the_simulator_is_prepared_and_agrees():
    def body(t):
        x = np.arange(10, dtype=np.float64) * (t.rank + 1)
        first = refcoll.allreduce(x, t, algorithm="auto", validate=False)
        again = refcoll.allreduce(x, t, algorithm="auto", validate=False)
        return first.tobytes() == again.tobytes(), ("auto", "sum", x.dtype, 10) in t.cache["prepared"]

    assert SimWorld(3).run(body) == [(True, True)] * 3


PREPARED = textwrap.dedent("""
    import numpy as np, ml_dtypes
    from mpi4py import MPI
    import refcoll
    from refcoll.calls import prepared
    from refcoll.calls.collectives import as_transport
    from refcoll.calls.auto import calibration_for

    comm = MPI.COMM_WORLD
    t = as_transport(comm)
    prepared.PREPARED_KEPT = 40  # small enough that the loop below evicts plans too
    refcoll.allreduce(np.zeros(1), comm, algorithm="auto")  # calibrate auto before counting
    bad = []
    planned = 0
    for algorithm in ("auto", "ring", "recursive_doubling", "rabenseifner", "tree", "dbtree"):
        for dtype in (np.float32, ml_dtypes.bfloat16, np.int32):
            for op in ("sum", "max", "avg"):
                for count in (1, 7, 1000, 20000):
                    rng = np.random.default_rng([comm.rank, count])
                    x = (rng.standard_normal(count) * 100).astype(dtype).reshape(-1, 1)
                    keep = x.copy()
                    sent = t.traffic.snapshot()
                    first = refcoll.allreduce(x, comm, algorithm=algorithm, op=op,
                                              validate=False)
                    moved = np.subtract(t.traffic.snapshot(), sent)
                    # auto's oracle resolves with the calibration these ranks agreed on.
                    expected = refcoll.simulate("allreduce", comm.allgather(x),
                                                algorithm=algorithm, op=op,
                                                calibration=calibration_for(t)).outputs[comm.rank]
                    out = np.empty_like(x)
                    sent = t.traffic.snapshot()
                    results = [refcoll.allreduce(x, comm, algorithm=algorithm, op=op,
                                                 validate=False)]
                    moved_again = np.subtract(t.traffic.snapshot(), sent)
                    results.append(refcoll.allreduce(x, comm, algorithm=algorithm, op=op,
                                                     out=out, validate=True))
                    inplace = x.copy()
                    results.append(refcoll.allreduce(inplace, comm, algorithm=algorithm, op=op,
                                                     out=inplace, validate=False))
                    key = (algorithm, op, np.dtype(dtype), count)
                    planned += t.cache["prepared"][key].plan is not None
                    case = f"{algorithm} {np.dtype(dtype)} {op} {count}"
                    if any(r.tobytes() != first.tobytes() for r in results):
                        bad.append(f"{case}: a prepared call differs from the first")
                    if first.tobytes() != expected.tobytes():
                        bad.append(f"{case}: differs from the simulator")
                    if results[1] is not out or results[2] is not inplace:
                        bad.append(f"{case}: out= not returned")
                    if x.tobytes() != keep.tobytes():
                        bad.append(f"{case}: the input changed")
                    if moved_again.tolist() != moved.tolist():
                        bad.append(f"{case}: traffic {moved_again}, first {moved}")
    assert len(t.cache["prepared"]) <= prepared.PREPARED_KEPT
    lines = comm.gather(f"rank {comm.rank}: planned {planned}; " + ("; ".join(bad[:5]) or "OK"))
    if comm.rank == 0:
        print("\\n".join(lines))
""")

STALLED = textwrap.dedent("""
    import time
    import numpy as np
    from mpi4py import MPI
    import refcoll
    from refcoll.calls.collectives import as_transport
    from refcoll.core.errors import CollectiveTimeout

    comm = MPI.COMM_WORLD
    comm.Barrier()  # every rank has started: no deadline below can catch a slow start-up
    x = np.ones(16, np.float32)
    for _ in range(3):
        refcoll.allreduce(x, comm, algorithm="auto", validate=False)
    assert as_transport(comm).cache["prepared"][("auto", "sum", x.dtype, 16)].plan is not None
    if comm.rank == 1:
        time.sleep(5)  # five deadlines late: rank 0's planned call gives up first, under any load
        refcoll.allreduce(x, comm, algorithm="auto", validate=False)
    else:
        try:
            refcoll.allreduce(x, comm, algorithm="auto", validate=False)
        except CollectiveTimeout as exc:
            print(f"timed out: {exc}", flush=True)
""")


def run_mpi(tmp_path, script: str, n: int, timeout_env: str = "60"):
    path = tmp_path / "job.py"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    env["REFCOLL_TIMEOUT"] = timeout_env
    return subprocess.run([MPIEXEC, "-n", str(n), sys.executable, str(path)],
                          capture_output=True, text=True, timeout=120, env=env)


@needs_mpi
@pytest.mark.parametrize("p", [2, 3])
def test_prepared_calls_under_mpi_give_the_bits_of_the_first_call(tmp_path, p):
    res = run_mpi(tmp_path, PREPARED, p)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    lines = sorted(line for line in res.stdout.splitlines() if line.startswith("rank "))
    assert len(lines) == p, res.stdout
    for line in lines:
        assert line.endswith("OK"), line
        assert int(line.split("planned ")[1].split(";")[0]) > 0, line
    assert "persistent request" not in res.stderr  # every plan's requests were freed


@needs_mpi
def test_a_planned_call_still_times_out_on_a_stalled_peer(tmp_path):
    res = run_mpi(tmp_path, STALLED, 2, timeout_env="1")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "timed out: rank 0: allreduce timed out after 1 s at its exchange 1 of this call, " \
           "still waiting to receive 64 B from rank 1" in res.stdout, res.stdout
