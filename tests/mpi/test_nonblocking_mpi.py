"""Non-blocking collectives under real MPI (run by test_mpi.py under mpiexec -n P).

Both progress engines, several calls outstanding on one communicator and on a
split one, progress without test(), and errors raised from wait() on every rank.
"""

import time

import numpy as np
import pytest

import refcoll
from refcoll.calls.progress import engine_for
from refcoll.core.errors import MismatchError

pytestmark = pytest.mark.mpi

ALGORITHMS = ("ring", "rabenseifner", "tree", "recursive_doubling")


def _transport(kind):
    from mpi4py import MPI

    from refcoll.transport.mpi import MPITransport

    t = MPITransport(MPI.COMM_WORLD)
    engine_for(t, kind)
    return t


def _inputs(rank):
    rng = np.random.default_rng(rank)
    return [rng.standard_normal(n).astype(np.float32) for n in (5, 1001, 70_000)]


def test_the_library_gives_thread_multiple_so_the_default_engine_is_the_thread():
    from mpi4py import MPI

    assert MPI.Query_thread() == MPI.THREAD_MULTIPLE
    assert engine_for(refcoll.as_transport(MPI.COMM_WORLD)).kind == "thread"


@pytest.mark.parametrize("kind", ["thread", "schedule"])
def test_outstanding_calls_give_the_blocking_calls_bits(kind):
    t = _transport(kind)
    xs = _inputs(t.rank)
    blocking = [refcoll.allreduce(x, t, algorithm=a) for x in xs for a in ALGORITHMS]
    for _ in range(2):  # the second round runs as recorded schedules on the schedule engine
        handles = [refcoll.iallreduce(x, t, algorithm=a) for x in xs for a in ALGORITHMS]
        gathered = refcoll.iallgather(xs[0], t)
        results = refcoll.wait_all(handles)
        assert [r.tobytes() for r in results] == [b.tobytes() for b in blocking]
        assert gathered.wait()[t.rank].tobytes() == xs[0].tobytes()


def test_calls_outstanding_on_the_world_and_a_split_communicator_at_once():
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    half = world.Split(world.rank % 2, world.rank)
    x = np.arange(1000, dtype=np.float64) + world.rank
    # Even ranks issue the world's call first, odd ranks their half's: MPI orders the calls of
    # each communicator, not across communicators.
    order = [("world", world, "ring"), ("half", half, "tree")]
    if world.rank % 2:
        order.reverse()
    handles = {name: refcoll.iallreduce(x, comm, algorithm=a) for name, comm, a in order}
    on_world, on_half = handles["world"].wait(), handles["half"].wait()
    assert on_world.tobytes() == refcoll.allreduce(x, world, algorithm="ring").tobytes()
    assert on_half.tobytes() == refcoll.allreduce(x, half, algorithm="tree").tobytes()
    half.Free()


def test_the_call_completes_while_the_caller_never_calls_test_or_wait():
    t = _transport("thread")
    x = np.ones(50_000, np.float32)
    h = refcoll.iallreduce(x, t)
    deadline = time.monotonic() + 120  # a bound against a hang, not a timing assertion
    while h.finished is None and time.monotonic() < deadline:
        time.sleep(0.001)  # reading h.finished moves nothing: only the progress thread does
    assert h.finished is not None
    assert h.wait()[0] == t.size


@pytest.mark.parametrize("kind", ["thread", "schedule"])
def test_a_mismatch_is_raised_from_wait_on_every_rank(kind):
    t = _transport(kind)
    for n in (16, 17):  # both counts run once everywhere: later calls of each are scheduled
        assert refcoll.iallreduce(np.ones(n, np.float32), t).wait()[0] == t.size
    count = 16 + (t.rank == t.size - 1 and t.size > 1)
    h = refcoll.iallreduce(np.ones(count, np.float32), t)
    if t.size > 1:
        with pytest.raises(MismatchError, match="count: rank 0 has 16, rank [0-9]+ has 17"):
            h.wait()
        assert isinstance(h.exception(), MismatchError)
    # The communicator is still usable after the failed call.
    assert refcoll.iallreduce(np.ones(3), t).wait()[0] == t.size


@pytest.mark.parametrize("kind", ["thread", "schedule"])
def test_a_loop_of_tests_completes_every_call(kind):
    # MPI's progress rule: MPI_Test called again and again completes the request. The
    # schedule engine runs a call it cannot step whole once a test finds it next.
    t = _transport(kind)
    for i in range(3):  # first calls (run whole) and repeated ones alike
        h = refcoll.iallreduce(np.full(4, float(t.rank + i)), t, algorithm="ring")
        deadline = time.monotonic() + 120  # a bound against a hang, not a timing assertion
        while not h.test() and time.monotonic() < deadline:
            pass
        assert h.test(), f"call {i} never completed under test()"
        assert h.wait()[0] == sum(r + i for r in range(t.size))


def test_waiting_in_a_done_callback_for_a_later_call_is_an_error_not_a_hang():
    """The callback runs on the progress thread, which would wait for itself."""
    from refcoll.core.errors import UsageError

    t = _transport("thread")
    if t.size < 2:
        return
    seen = []
    ready = np.zeros(1)
    if t.rank == 0:  # rank 1 registers its callback before rank 0 lets the call complete
        t.comm.Recv(ready, source=1, tag=77)
    first = refcoll.iallreduce(np.ones(1000), t)
    second = refcoll.iallreduce(np.full(1000, 2.0), t)
    first.add_done_callback(lambda h: seen.append(_raised(second.wait)))
    if t.rank == 1:
        t.comm.Send(ready, dest=0, tag=77)
    assert first.wait()[0] == t.size and second.wait()[0] == 2.0 * t.size
    if t.rank == 1:  # its callback ran on the progress thread: refused, not a hang
        assert len(seen) == 1 and isinstance(seen[0], UsageError), seen
        assert "would wait for itself" in str(seen[0])
    t.free()


def _raised(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - what the callback's wait raised, for the test
        return exc
    return None


@pytest.mark.parametrize("kind", ["iallreduce", "small plan", "large plan"])
def test_freeing_a_communicator_lets_its_pending_calls_complete(kind):
    """MPI_Comm_free lets pending operations complete normally: an iallreduce, or a
    plan's started run, on a communicator freed before its wait still returns the sum;
    the plan's later runs are refused, naming the free."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    x = np.ones(100_000 if kind == "large plan" else 8)
    if kind == "iallreduce":
        handle = refcoll.iallreduce(x, comm)
        comm.Free()
        got = handle.wait()
    else:
        plan = refcoll.allreduce_init(x, comm)
        plan.start()
        comm.Free()
        got = plan.wait()
        with pytest.raises(refcoll.UsageError, match="freed"):
            plan()
    wrong = np.flatnonzero(got != MPI.COMM_WORLD.Get_size())
    assert not wrong.size, (wrong.size, wrong[:5], got[wrong[:5]])


@pytest.mark.parametrize("patience", [1, None])
def test_a_patient_wait_sleeps_after_its_patience_and_never_spins_before(monkeypatch, patience):
    """Rank 1 sends only once rank 0's wait has slept once: the count of polls is fixed
    by that, not by timing. Patience 1 (watch mode's judging): sleeps at its second poll
    and never yields; the default: 10 polls spin, then it yields up to PATIENT_POLLS."""
    from mpi4py import MPI

    import refcoll.transport.mpi as mpi_transport

    world = MPI.COMM_WORLD
    t = mpi_transport.MPITransport(world)
    t.patient, t.patience = True, patience
    counts = {"sleep": 0, "yield": 0}
    sleep, go = mpi_transport.time.sleep, np.zeros(1)

    def first_sleep_lets_rank_1_send(seconds):
        counts["sleep"] += 1
        if counts["sleep"] == 1:
            world.Send(go, dest=1, tag=77)
        sleep(seconds)

    def counted_yield():
        counts["yield"] += 1

    monkeypatch.setattr(mpi_transport.time, "sleep", first_sleep_lets_rank_1_send)
    monkeypatch.setattr(mpi_transport.os, "sched_yield", counted_yield)
    buf = np.zeros(4)
    if t.rank == 0:
        t.recv(buf, 1)
        assert counts["sleep"] >= 1 and buf.tolist() == [1.0] * 4
        spun = mpi_transport.PATIENT_POLLS - mpi_transport.POLLS_BEFORE_YIELD
        expected = 0 if patience == 1 else spun
        assert counts["yield"] == expected, counts
    elif t.rank == 1:
        world.Recv(go, source=0, tag=77)
        t.send(np.ones(4), 0)
    t.free()
