"""A repeated blocking all-reduce keeps nothing: every call gives the bits of the first.

Every call of an (algorithm, op, dtype, count) checks, agrees (unless
``validate=False``), chooses and runs the algorithm; nothing is kept on the
transport for the next call. Speed for repeated calls comes from a plan the
caller holds (``refcoll.allreduce_init``: a recording over persistent requests
on MPI, refcoll/calls/plans.py). Under ``mpiexec`` every repeated call and every
plan run is compared bit for bit with the first call and with the simulator,
moves the bytes the first call moves (the agreement's signatures besides, when
validated), leaves the input as it was and returns ``out=``; a stalled peer
still ends a repeated call with :class:`~refcoll.core.errors.CollectiveTimeout`;
and a failed agreement leaves nothing that reaches a later call.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import mpiexec_path

import refcoll
from refcoll.core.ops import get_op
from refcoll.transport import SimWorld
from refcoll.transport.recorder import Recorder

MPIEXEC = mpiexec_path()
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: pip install 'refcoll[mpi]'")


class _Recording:
    """What a recorder's transport needs: rank, size, persistent exchanges as plain tuples."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def persistent(self, sends, recvs, what="persistent", slot=0):
        return ("exchange", [(b.nbytes, peer) for b, peer, _ in sends],
                [(b.nbytes, peer) for b, peer, _ in recvs])

    def reduce_local(self, op, a, b, out):
        op.apply(a, b, out)


# The flat algorithms record on one transport; hierarchical's recording (its node's and
# cross-node transports, split from a real one) is held under MPI by tests/mpi/test_plans_mpi.py.
@pytest.mark.parametrize("algorithm", sorted(name for name, algo in refcoll.REGISTRY.items()
                                              if algo.replayable is True))
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


class _Replaying:
    """A simulated rank whose persistent exchanges are its own sendrecv, run at each replay:
    a recording made and replayed on the simulator, as a plan makes and replays one on MPI."""

    def __init__(self, t):
        self._t, self.rank, self.size = t, t.rank, t.size

    def __getattr__(self, name):
        return getattr(self._t, name)

    def persistent(self, sends, recvs, what="persistent", slot=0):
        t = self._t

        def run():
            if sends and recvs:
                (out, dest, tag), (into, source, _) = sends[0], recvs[0]
                t.sendrecv(out, dest, into, source, tag)
            elif sends:
                t.send(sends[0][0], sends[0][1], sends[0][2])
            else:
                t.recv(recvs[0][0], recvs[0][1], recvs[0][2])
        return run


@pytest.mark.parametrize("options", [{}, {"radix": 3}, {"radix": 4, "fold": "modulo"}],
                         ids=["radix2", "radix3", "radix4-modulo"])
@pytest.mark.parametrize("p", [3, 5, 6, 7, 9])
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in-place"])
def test_a_replayed_recording_gives_the_direct_runs_bits_for_what_x_holds_now(options, p,
                                                                              in_place):
    """Recursive multiplying copied a partial with NumPy, outside the transport: a plan's
    recording never replayed it, and ranks 2 and 5 of 6 folded a stale copy. In place, it
    folded into out before reading x through another view of it (rank 2 of 3 wrong)."""
    from refcoll.algorithms.recursive_doubling import recursive_doubling_allreduce
    from refcoll.transport.recorder import record

    rng = np.random.default_rng(p)
    first = [rng.standard_normal(33).astype(np.float32) for _ in range(p)]
    then = [rng.standard_normal(33).astype(np.float32) for _ in range(p)]
    sum_ = get_op("sum")

    def run(t):
        direct = np.empty(33, np.float32)
        recursive_doubling_allreduce(t, then[t.rank], direct, op=sum_, **options)
        x = first[t.rank].copy()
        out = x if in_place else np.empty(33, np.float32)
        schedule = record(_Replaying(t), recursive_doubling_allreduce, x, out.reshape(-1),
                          op=sum_, **options)
        x[:] = then[t.rank]  # the program's next step, in the plan's own buffer
        schedule()
        return direct, out

    def blocking_in_place(t):
        x = then[t.rank].copy()
        return refcoll.allreduce(x, t, algorithm="recursive_doubling", out=x, **options)

    calls = SimWorld(p).run(blocking_in_place)
    for rank, (direct, replayed) in enumerate(SimWorld(p).run(run)):
        assert np.array_equal(direct.view(np.uint32), replayed.view(np.uint32)), rank
        assert np.array_equal(direct.view(np.uint32), calls[rank].view(np.uint32)), rank


@pytest.mark.parametrize("algorithm", ["ring", "rabenseifner", "recursive_doubling"])
@pytest.mark.parametrize("p", [2, 3, 5])
def test_receiving_into_the_result_gives_the_in_place_bits(algorithm, p):
    # Out of place, partials land straight in out; in place they go through scratch.
    rng = np.random.default_rng(p)
    xs = [rng.standard_normal(1001).astype(np.float32) for _ in range(p)]
    for op in ("sum", "min"):
        apart = SimWorld(p).run(lambda t, op=op: refcoll.allreduce(
            xs[t.rank], t, op=op, algorithm=algorithm, out=np.empty(1001, np.float32)))
        inplace = SimWorld(p).run(lambda t, op=op: refcoll.allreduce(
            xs[t.rank].copy(), t, op=op, algorithm=algorithm, out=None))
        for a, b in zip(apart, inplace):
            assert a.tobytes() == b.tobytes() == apart[0].tobytes()


def test_a_repeated_call_on_the_simulator_keeps_no_plan_and_agrees():
    """The simulator has no persistent exchanges: every call runs the algorithm, with its bits."""
    def body(t):
        x = np.arange(10, dtype=np.float64) * (t.rank + 1)
        first = refcoll.allreduce(x, t, algorithm="auto", validate=False)
        again = [refcoll.allreduce(x, t, algorithm="auto", validate=False) for _ in range(3)]
        with refcoll.allreduce_init(x, t, algorithm="auto", validate=False) as plan:
            planned = plan().tobytes() == first.tobytes() and not plan.recorded
        return (all(a.tobytes() == first.tobytes() for a in again), planned,
                set(t.cache.get("plans", {})) <= {"live"})

    assert SimWorld(3).run(body) == [(True, True, True)] * 3


REPEATED = textwrap.dedent("""
    import numpy as np, ml_dtypes
    from mpi4py import MPI
    import refcoll
    from refcoll.calls.auto import calibration_for
    from refcoll.calls.collectives import as_transport

    comm = MPI.COMM_WORLD
    t = as_transport(comm)
    refcoll.allreduce(np.zeros(1), comm, algorithm="auto")  # calibrate auto before counting
    bad = []
    agreements = set()
    for algorithm in ("auto", "ring", "recursive_doubling", "rabenseifner", "tree", "dbtree"):
        for dtype in (np.float32, ml_dtypes.bfloat16, np.int32):
            for op in ("sum", "max", "avg"):
                for count in (1, 7, 1000, 20000):
                    rng = np.random.default_rng([comm.rank, count])
                    x = (rng.standard_normal(count) * 100).astype(dtype).reshape(-1, 1)
                    keep = x.copy()
                    case = f"{algorithm} {np.dtype(dtype)} {op} {count}"
                    sent = t.traffic.snapshot()
                    first = refcoll.allreduce(x, comm, algorithm=algorithm, op=op,
                                              validate=False)
                    moved = np.subtract(t.traffic.snapshot(), sent)
                    # auto's oracle resolves with the calibration these ranks agreed on.
                    expected = refcoll.simulate("allreduce", comm.allgather(x),
                                                algorithm=algorithm, op=op,
                                                calibration=calibration_for(t)).outputs[comm.rank]
                    results = [refcoll.allreduce(x, comm, algorithm=algorithm, op=op,
                                                 validate=False)]
                    out = np.empty_like(x)
                    sent = t.traffic.snapshot()
                    results.append(refcoll.allreduce(x, comm, algorithm=algorithm, op=op,
                                                     out=out, validate=True))
                    moved_signed = np.subtract(t.traffic.snapshot(), sent)
                    inplace = x.copy()
                    sent = t.traffic.snapshot()
                    results.append(refcoll.allreduce(inplace, comm, algorithm=algorithm, op=op,
                                                     out=inplace, validate=False))
                    moved_again = np.subtract(t.traffic.snapshot(), sent)
                    planned = np.empty_like(x)
                    with refcoll.allreduce_init(x, comm, algorithm=algorithm, op=op,
                                                out=planned) as plan:
                        for _ in range(2):  # each run all-reduces what x holds then
                            results.append(plan().copy())
                        plan.start()
                        results.append(plan.wait().copy())
                        if plan.runs != 3:
                            bad.append(f"{case}: {plan.runs} plan runs, not 3")
                    if any(r.tobytes() != first.tobytes() for r in results):
                        bad.append(f"{case}: a repeated call's or a plan's result differs")
                    if first.tobytes() != expected.tobytes():
                        bad.append(f"{case}: differs from the simulator")
                    if results[1] is not out or results[2] is not inplace:
                        bad.append(f"{case}: out= not returned")
                    if x.tobytes() != keep.tobytes():
                        bad.append(f"{case}: the input changed")
                    if moved_again.tolist() != moved.tolist():
                        bad.append(f"{case}: traffic {moved_again}, first {moved}")
                    agreements.add(tuple(moved_signed - moved))
    if len(agreements) != 1:  # the agreement moves the same signatures whatever the call
        bad.append(f"the agreement's own traffic varies: {sorted(agreements)}")
    held = t.cache.get("plans", {})
    if set(held) - {"live"} or held.get("live"):
        bad.append(f"the transport keeps plans: {held}")
    if len(t._persistent):
        bad.append(f"{len(t._persistent)} persistent exchanges held after every plan was freed")
    lines = comm.gather(f"rank {comm.rank}: " + ("; ".join(bad[:5]) or "OK"))
    if comm.rank == 0:
        print("\\n".join(lines))
""")

STALLED = textwrap.dedent("""
    import numpy as np
    from mpi4py import MPI
    import refcoll
    from refcoll.calls.collectives import as_transport
    from refcoll.core.errors import CollectiveTimeout

    comm = MPI.COMM_WORLD
    t = as_transport(comm)
    x = np.ones(16, np.float32)
    for _ in range(3):  # repeated calls, as a loop makes them
        refcoll.allreduce(x, comm, algorithm="recursive_doubling", validate=False)
    comm.Barrier()
    t.timeout = 1  # for the call below alone: the calls above waited as long as they needed
    if comm.rank == 1:
        comm.recv(source=0, tag=77)  # stalled until rank 0 has given up, however long that takes
    else:
        try:
            refcoll.allreduce(x, comm, algorithm="recursive_doubling", validate=False)
        except CollectiveTimeout as exc:
            print(f"timed out: {exc}", flush=True)
        finally:
            comm.send(None, dest=1, tag=77)
""")

# The ranks repeat a call, then disagree on the count: the agreement fails on every rank,
# again and again on one transport and on fresh ones, and every later call still sums right.
STALE = textwrap.dedent("""
    import sys
    import numpy as np
    from mpi4py import MPI
    import refcoll
    from refcoll.core.errors import MismatchError
    from refcoll.transport.mpi import MPITransport

    comm = MPI.COMM_WORLD
    failures, fresh = {"many": (51, False),
                       "freed": (4, True)}[sys.argv[1]]
    t = MPITransport(comm)
    bad = []
    for i in range(failures):
        if fresh:  # a transport of its own each time, freed after its failure
            t = MPITransport(comm)
        for value in (1, 2, 3):
            x = np.full(16, (comm.rank + 1) * (value + 10 * i), np.float32)
            got = refcoll.allreduce(x, t, algorithm="recursive_doubling")
            want = (value + 10 * i) * comm.size * (comm.size + 1) / 2
            if not np.array_equal(got, np.full(16, want, np.float32)):
                bad.append(f"after {i} failures, call {value}: {got[0]:g}, not {want:g}")
        count = 16 if comm.rank == 0 else 17
        try:
            refcoll.allreduce(np.full(count, -1.0, np.float32), t, algorithm="recursive_doubling")
        except MismatchError:
            pass
        if fresh:
            t.free()
    lines = comm.gather(f"rank {comm.rank}: " + ("; ".join(bad[:3]) or "OK"))
    if comm.rank == 0:
        print("\\n".join(lines), flush=True)
""")


def run_mpi(tmp_path, script: str, n: int, args=(), timeout_env: str = "60"):
    path = tmp_path / "job.py"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    env["REFCOLL_TIMEOUT"] = timeout_env
    return subprocess.run([MPIEXEC, "-n", str(n), sys.executable, str(path), *args],
                          capture_output=True, text=True, timeout=300, env=env)


@needs_mpi
@pytest.mark.parametrize("p", [2, 3])
def test_repeated_calls_and_plans_under_mpi_give_the_bits_of_the_first_call(tmp_path, p):
    res = run_mpi(tmp_path, REPEATED, p)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    lines = sorted(line for line in res.stdout.splitlines() if line.startswith("rank "))
    assert len(lines) == p, res.stdout
    for line in lines:
        assert line.endswith("OK"), line
    assert "persistent request" not in res.stderr  # every plan's requests were freed


@needs_mpi
def test_a_repeated_call_still_times_out_on_a_stalled_peer(tmp_path):
    res = run_mpi(tmp_path, STALLED, 2)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "timed out: rank 0: allreduce timed out after 1 s at its exchange 1 of this call, " \
           "still waiting to receive 64 B from rank 1" in res.stdout, res.stdout


@needs_mpi
@pytest.mark.parametrize("how", ["many", "freed"])
def test_a_message_a_failed_agreement_left_never_reaches_a_later_call(tmp_path, how):
    """After 51 failures on one transport, or a transport freed after one.

    A failed agreement sends no data beside the signatures, so nothing is left
    unreceived: a later call on the transport, or on the next one MPI gives a
    freed one's context to, sums right.
    """
    res = run_mpi(tmp_path, STALE, 2, args=(how,))
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    lines = sorted(line for line in res.stdout.splitlines() if line.startswith("rank "))
    assert lines == ["rank 0: OK", "rank 1: OK"], res.stdout + res.stderr[-3000:]
