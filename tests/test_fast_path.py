"""Kept plans: a repeated blocking all-reduce gives the bits of its first, ordinary run.

The first all-reduce of an (algorithm, op, dtype, count) runs the algorithm, and
so does the second, which then keeps a plan of it (small ones, on MPI: a
recording over persistent requests, refcoll/calls/plans.py); the third and later
replay that plan. Under ``mpiexec`` every replay is compared bit for bit with the
ordinary run and with the simulator, moves the bytes the ordinary run moves (its
agreement beside them), leaves the input as it was and returns ``out=``; kept
plans are evicted past ``PLANS_KEPT`` and freed; a stalled peer still ends a
replayed call with :class:`~refcoll.core.errors.CollectiveTimeout`; and the
messages a failed agreement leaves unreceived never reach a later call.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import mpiexec_path

import refcoll
from refcoll.calls import plans
from refcoll.core.ops import get_op
from refcoll.transport import SimWorld
from refcoll.transport.recorder import Recorder

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
                plans.kept(t, ("auto", "sum", x.dtype, 10)) is None)

    assert SimWorld(3).run(body) == [(True, True, True)] * 3


KEPT = textwrap.dedent("""
    import numpy as np, ml_dtypes
    from mpi4py import MPI
    import refcoll
    from refcoll.calls import plans
    from refcoll.calls.agree import signatures
    from refcoll.calls.args import PLAN_BYTES
    from refcoll.calls.auto import calibration_for, resolve
    from refcoll.calls.collectives import as_transport

    comm = MPI.COMM_WORLD
    t = as_transport(comm)
    plans.PLANS_KEPT = 40  # small enough that the loop below evicts kept plans too
    refcoll.allreduce(np.zeros(1), comm, algorithm="auto")  # calibrate auto before counting
    bad = []
    made = []
    for algorithm in ("auto", "ring", "recursive_doubling", "rabenseifner", "tree", "dbtree"):
        for dtype in (np.float32, ml_dtypes.bfloat16, np.int32):
            for op in ("sum", "max", "avg"):
                for count in (1, 7, 1000, 20000):
                    rng = np.random.default_rng([comm.rank, count])
                    x = (rng.standard_normal(count) * 100).astype(dtype).reshape(-1, 1)
                    keep = x.copy()
                    case = f"{algorithm} {np.dtype(dtype)} {op} {count}"
                    key = (algorithm, op, np.dtype(dtype), count)
                    sent = t.traffic.snapshot()
                    first = refcoll.allreduce(x, comm, algorithm=algorithm, op=op,
                                              validate=False)  # run, and seen
                    moved = np.subtract(t.traffic.snapshot(), sent)
                    # auto's oracle resolves with the calibration these ranks agreed on.
                    expected = refcoll.simulate("allreduce", comm.allgather(x),
                                                algorithm=algorithm, op=op,
                                                calibration=calibration_for(t)).outputs[comm.rank]
                    results = [refcoll.allreduce(x, comm, algorithm=algorithm, op=op,
                                                 validate=False)]  # run, and kept
                    plan = plans.kept(t, key)
                    name = resolve(t, "allreduce", count, x.itemsize) if algorithm == "auto" \\
                        else algorithm
                    if (plan is not None) != (comm.size > 1 and x.nbytes <= PLAN_BYTES
                                              and plans.replayable(t, name, {})):
                        bad.append(f"{case}: kept {plan is not None}")
                    out = np.empty_like(x)
                    sent = t.traffic.snapshot()
                    results.append(refcoll.allreduce(x, comm, algorithm=algorithm, op=op,
                                                     out=out, validate=True))  # replayed, signed
                    moved_signed = np.subtract(t.traffic.snapshot(), sent)
                    inplace = x.copy()
                    sent = t.traffic.snapshot()
                    results.append(refcoll.allreduce(inplace, comm, algorithm=algorithm, op=op,
                                                     out=inplace, validate=False))  # replayed
                    moved_again = np.subtract(t.traffic.snapshot(), sent)
                    if plan is not None:
                        made.append(plan)
                        if plan.runs != 2 or not plan.recorded:
                            bad.append(f"{case}: {plan.runs} replays of {plan!r}, not 2")
                    if any(r.tobytes() != first.tobytes() for r in results):
                        bad.append(f"{case}: a kept plan's result differs from the first")
                    if first.tobytes() != expected.tobytes():
                        bad.append(f"{case}: differs from the simulator")
                    if results[1] is not out or results[2] is not inplace:
                        bad.append(f"{case}: out= not returned")
                    if x.tobytes() != keep.tobytes():
                        bad.append(f"{case}: the input changed")
                    if moved_again.tolist() != moved.tolist():
                        bad.append(f"{case}: traffic {moved_again}, first {moved}")
                    agreement = [sum(s._sent for s in signatures(t).steps if s._sent >= 0),
                                 sum(s._received for s in signatures(t).steps
                                     if s._received >= 0)] if comm.size > 1 else [0, 0]
                    if moved_signed.tolist() != (moved + agreement).tolist():
                        bad.append(f"{case}: validated traffic {moved_signed}, first {moved} "
                                   f"and the signatures {agreement}")
    table = t.cache.get("plans", {}).get("kept", {})
    if len(table) > plans.PLANS_KEPT:
        bad.append(f"{len(table)} plans kept, more than {plans.PLANS_KEPT}")
    if [p for p in made if not p.freed] != list(table.values()):
        bad.append("an evicted plan was not freed, or a kept one was")
    held = sum(1 for p in table.values() for s in p._schedule.steps if hasattr(s, "_sent"))
    held += sum(1 for s in signatures(t).steps if hasattr(s, "_sent")) if comm.size > 1 else 0
    if len(t._persistent) != held:
        bad.append(f"{len(t._persistent)} persistent exchanges, the kept plans hold {held}")
    mine = [(k[0], k[1], str(k[2]), k[3], p.algorithm) for k, p in table.items()]
    if any(theirs != mine for theirs in comm.allgather(mine)):
        bad.append("the ranks keep different plans")
    lines = comm.gather(f"rank {comm.rank}: kept {len(made)}; " + ("; ".join(bad[:5]) or "OK"))
    if comm.rank == 0:
        print("\\n".join(lines))
""")

STALLED = textwrap.dedent("""
    import numpy as np
    from mpi4py import MPI
    import refcoll
    from refcoll.calls import plans
    from refcoll.calls.collectives import as_transport
    from refcoll.core.errors import CollectiveTimeout

    comm = MPI.COMM_WORLD
    t = as_transport(comm)
    x = np.ones(16, np.float32)
    for _ in range(3):  # run and seen, run and kept, replayed
        refcoll.allreduce(x, comm, algorithm="recursive_doubling", validate=False)
    plan = plans.kept(t, ("recursive_doubling", "sum", x.dtype, 16))
    assert plan is not None and plan.recorded and plan.runs == 1, plan
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

# Rank 0 replays its kept plan (its first message sent beside its signature) while rank 1
# makes another call: the agreement fails and rank 0's message stays unreceived at rank 1.
STALE = textwrap.dedent("""
    import sys
    import numpy as np
    from mpi4py import MPI
    import refcoll
    from refcoll.core.errors import MismatchError
    from refcoll.transport.mpi import MPITransport
    from refcoll.transport.persistent import PERSISTENT_EPOCHS

    comm = MPI.COMM_WORLD
    failures, fresh = {"epochs": (3 * PERSISTENT_EPOCHS + 3, False),
                       "freed": (4, True)}[sys.argv[1]]
    t = MPITransport(comm)
    bad = []
    for i in range(failures):
        if fresh:  # a transport of its own each time, freed after its failure
            t = MPITransport(comm)
        for value in (1, 2, 3):  # the third replays the kept plan
            x = np.full(16, (comm.rank + 1) * (value + 10 * i), np.float32)
            got = refcoll.allreduce(x, t, algorithm="recursive_doubling")
            want = (value + 10 * i) * comm.size * (comm.size + 1) / 2
            if not np.array_equal(got, np.full(16, want, np.float32)):
                bad.append(f"after {i} failures, call {value}: {got[0]:g}, not {want:g}")
        count = 16 if comm.rank == 0 else 17  # rank 0 replays; the others run the ordinary way
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
def test_kept_plans_under_mpi_give_the_bits_of_the_first_call(tmp_path, p):
    res = run_mpi(tmp_path, KEPT, p)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    lines = sorted(line for line in res.stdout.splitlines() if line.startswith("rank "))
    assert len(lines) == p, res.stdout
    for line in lines:
        assert line.endswith("OK"), line
        assert int(line.split("kept ")[1].split(";")[0]) > 0, line
    assert "persistent request" not in res.stderr  # every plan's requests were freed


@needs_mpi
def test_a_replayed_call_still_times_out_on_a_stalled_peer(tmp_path):
    res = run_mpi(tmp_path, STALLED, 2)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "timed out: rank 0: allreduce timed out after 1 s at its exchange 1 of this call, " \
           "still waiting to receive 64 B from rank 1" in res.stdout, res.stdout


@needs_mpi
@pytest.mark.parametrize("how", ["epochs", "freed"])
def test_a_message_a_failed_agreement_left_never_reaches_a_later_call(tmp_path, how):
    """After 3 x PERSISTENT_EPOCHS failures on one transport, or a transport freed after one.

    Either way a communicator that held the unreceived message is freed (the
    transport's second duplicate for its epochs, or the transport's own), and MPI
    may give its context to the next one made.
    """
    res = run_mpi(tmp_path, STALE, 2, args=(how,))
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    lines = sorted(line for line in res.stdout.splitlines() if line.startswith("rank "))
    assert lines == ["rank 0: OK", "rank 1: OK"], res.stdout + res.stderr[-3000:]
