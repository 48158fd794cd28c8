"""Persistent collectives under real MPI (run by test_mpi.py and test_plans.py under mpiexec -n P).

Every start of a plan gives the blocking call's bits and the simulator's for what ``x``
holds then, in issue order with the non-blocking calls on both progress engines; a
refused start is raised on every rank in that start (no timeout), or on the rank at
fault alone without validation; freed plans leave no persistent MPI request behind.
"""

import ml_dtypes
import numpy as np
import pytest

import refcoll
from refcoll.calls.progress import engine_for
from refcoll.core.bits import same_bits
from refcoll.core.errors import MismatchError, PeerFailure, UsageError

pytestmark = pytest.mark.mpi

ROOTED = ("broadcast", "reduce")
#: Seconds a refusal test's own transport waits: a refusal the peers learnt by a timeout
#: would end in CollectiveTimeout (not the UsageError asserted) instead of hanging the job.
DEADLINE = 30.0

# (collective, algorithm, keywords); root -1 is the last rank.
CASES = [("allreduce", "ring", {"op": "sum"}), ("allreduce", "rabenseifner", {"op": "avg"}),
         ("allreduce", "recursive_doubling", {"op": "max"}), ("allreduce", "tree", {"op": "prod"}),
         ("allreduce", "dbtree", {"op": "sum"}), ("allreduce", "auto", {"op": "sum"}),
         ("allreduce", "hierarchical", {"op": "sum", "ranks_per_node": 2}),
         ("reduce_scatter", "ring", {"op": "sum"}), ("reduce_scatter", "bruck", {"op": "min"}),
         ("allgather", "ring", {}), ("allgather", "rabenseifner", {}),
         ("broadcast", "tree", {"root": -1}), ("broadcast", "naive", {"root": 0}),
         ("reduce", "tree", {"op": "sum", "root": -1}),
         ("reduce", "naive", {"op": "avg", "root": 0})]


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _own_transport(kind=None, timeout=DEADLINE):
    """Return a transport of its own over COMM_WORLD (freed by the caller), on engine ``kind``."""
    from refcoll.transport.mpi import MPITransport

    t = MPITransport(_world(), timeout=timeout)
    if kind is not None:
        engine_for(t, kind)
    return t


def _values(shape, dtype, rank: int, start: int) -> np.ndarray:
    rng = np.random.default_rng([rank, start, 5])
    if np.dtype(dtype).kind == "i":
        return rng.integers(-9, 10, size=shape).astype(dtype)
    return (rng.standard_normal(shape) * 4).astype(dtype)


def _make(collective, x, comm, **kw):
    fn = getattr(refcoll, f"{collective}_init")
    return fn(x, kw.pop("root", 0), comm, **kw) if collective in ROOTED else fn(x, comm, **kw)


def _blocking(collective, x, comm, **kw):
    fn = getattr(refcoll, collective)
    return fn(x, kw.pop("root", 0), comm, **kw) if collective in ROOTED else fn(x, comm, **kw)


def _same(a, b) -> bool:
    return a is None and b is None or (a is not None and b is not None and same_bits(a, b))


def _plan_run_once(t, count: int):
    """Return ``(x, plan, last rank)``: an all-reduce plan of ``count`` values on ``t``, run
    once (a refusal test's; it skips on one rank, whose refusal is its own)."""
    if t.size == 1:
        pytest.skip("one rank: the refusal is its own")
    x = _values(count, np.float32, t.rank, 0)
    plan = refcoll.allreduce_init(x, t)
    plan()
    return x, plan, t.size - 1


def _outcome(fn):
    """Return ``fn()``'s error, or None."""
    try:
        fn()
    except (UsageError, MismatchError, PeerFailure, TypeError, ValueError) as exc:
        return exc
    return None


@pytest.mark.parametrize("shape", [(5, 41), (70_001,)], ids=["recorded", "large"])
@pytest.mark.parametrize("case", CASES,
                         ids=lambda c: " ".join([c[0], c[1], *map(str, c[2].values())]))
def test_every_start_gives_the_blocking_calls_and_the_simulators_bits(case, shape):
    comm = _world()
    collective, algorithm, kw = case
    kw = {k: v % comm.size if k == "root" else v for k, v in kw.items()}
    x = np.zeros(shape, np.float32)
    plan = _make(collective, x, comm, algorithm=algorithm, **kw)
    for start in range(3):
        x[...] = _values(shape, np.float32, comm.rank, start)  # new contents, same buffer
        got = plan() if start != 1 else plan.start().wait()
        got = None if got is None else got.copy()
        want = _blocking(collective, x, comm, algorithm=algorithm, **kw)
        oracle = refcoll.simulate(collective, comm.allgather(x), algorithm=plan.algorithm,
                                  **kw).outputs[comm.rank]  # auto: as this job resolved it
        assert _same(got, want), f"start {start}: not the blocking call's bits"
        assert _same(got, oracle), f"start {start}: not the simulator's bits"
    plan.free()


def test_hierarchical_is_recorded_on_equal_nodes_and_runs_again_on_unequal_ones():
    # Equal nodes: its phases on the node's and the cross-node communicators become one
    # recorded schedule; unequal ones take the leader-based schedule, which copies locally.
    comm = _world()
    x = np.zeros(1000, np.float32)
    for k, inter in ((2, "ring"), (2, "recursive_doubling"), (1, "ring"), (2, "naive")):
        with refcoll.allreduce_init(x, comm, algorithm="hierarchical", ranks_per_node=k,
                                    inter=inter) as plan:
            equal = comm.size % k == 0
            assert plan.recorded == (equal and inter != "naive" and comm.size > 1), (k, inter)
            for start in range(2):
                x[...] = _values(1000, np.float32, comm.rank, start)
                want = refcoll.simulate("allreduce", comm.allgather(x), algorithm="hierarchical",
                                        ranks_per_node=k, inter=inter).outputs[comm.rank]
                assert same_bits(plan(), want), (k, inter, start)


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "rabenseifner"])
def test_every_op_and_dtype_gives_the_blocking_calls_bits(algorithm):
    comm = _world()
    for dtype in (np.float32, np.float64, np.int32, ml_dtypes.bfloat16):
        for op in ("sum", "prod", "min", "max", "avg"):
            x = _values(37, dtype, comm.rank, 0)
            with refcoll.allreduce_init(x, comm, algorithm=algorithm, op=op) as plan:
                for start in range(2):
                    x[...] = _values(37, dtype, comm.rank, start)
                    got = plan().copy()
                    want = refcoll.allreduce(x, comm, algorithm=algorithm, op=op)
                    assert same_bits(got, want), f"{np.dtype(dtype)} {op} start {start}"


def test_no_comm_means_comm_world_and_auto_resolves_alike_on_every_rank():
    comm = _world()
    x = _values(100, np.float32, comm.rank, 0)
    with refcoll.allreduce_init(x, algorithm="auto") as plan:
        assert not refcoll.REGISTRY[plan.algorithm].chooses
        assert len(set(comm.allgather(plan.algorithm))) == 1
        assert same_bits(plan(), refcoll.allreduce(x, comm, algorithm=plan.algorithm))


@pytest.mark.parametrize("kind", ["thread", "schedule"])
def test_a_start_runs_in_issue_order_among_nonblocking_and_blocking_calls(kind):
    # Rank 0 issues everything at once; the others wait for each call before the next.
    t = _own_transport(kind)
    x = np.arange(1000, dtype=np.float64) * (t.rank + 1)
    y = np.arange(3, dtype=np.float64) + 10 * t.rank
    plan = refcoll.allreduce_init(x, t)
    for _ in range(2):  # the second round of the schedule engine runs recorded schedules
        if t.rank == 0:
            first = refcoll.iallreduce(y, t, op="max")
            plan.start()
            between = refcoll.allreduce(y, t, op="min")
            last = refcoll.iallgather(y, t)
            results = [first.wait(), plan.wait().copy(), between, last.wait()]
        else:
            results = [refcoll.iallreduce(y, t, op="max").wait(), plan().copy(),
                       refcoll.allreduce(y, t, op="min"), refcoll.iallgather(y, t).wait()]
        assert all(same_bits(a, b) for a, b in zip(results, _world().bcast(results)))
        assert results[1].tolist() == (np.arange(1000) * sum(range(1, t.size + 1))).tolist()
    plan.free()
    t.free()


def test_a_started_plan_is_incomplete_until_its_peers_start_it():
    comm = _world()
    if comm.size == 1:
        pytest.skip("one rank has no peer to wait for")
    x = np.full(10, comm.rank + 1.0)
    plan = refcoll.allreduce_init(x, comm)
    if comm.rank == 0:
        plan.start()
        incomplete = not plan.test()  # the peers are in the barrier below: none has started
        comm.Barrier()
        result = plan.wait()
        assert incomplete and plan.test()
    else:
        comm.Barrier()
        result = plan()
    assert result.tolist() == [comm.size * (comm.size + 1) / 2] * 10
    plan.free()


@pytest.mark.parametrize("kind", ["thread", "schedule"])
def test_a_small_plan_starts_in_place_and_the_calls_after_it_run_after_it(kind):
    # A small recorded plan's start runs on the caller's thread (MPI_Start's way); the
    # non-blocking, blocking and plan calls issued after it, on every rank, see it first.
    t = _own_transport(kind)
    x = np.arange(300, dtype=np.float32) * (t.rank + 1)
    y = np.arange(3, dtype=np.float64) + 10 * t.rank
    plan, other = refcoll.allreduce_init(x, t), refcoll.allreduce_init(y, t, op="max")
    assert plan.start().handle._engine.kind == "in-flight"
    later = refcoll.iallreduce(y, t, op="min")
    blocking = refcoll.allreduce(y, t, op="max")
    other.start()
    results = [plan.wait().copy(), later.wait(), blocking, other.wait()]
    assert all(same_bits(a, b) for a, b in zip(results, _world().bcast(results)))
    assert same_bits(results[0], refcoll.allreduce(x, t))
    assert results[1].tolist() == [0.0, 1.0, 2.0]  # rank 0's y is the least
    assert results[2].tolist() == results[3].tolist()
    plan.free()
    other.free()
    t.free()


def test_a_run_started_in_place_gives_its_handle_before_during_and_after_it():
    # The in-place run makes its Handle only when asked: asked at the start (as the Reducer
    # asks), it completes with the run; asked after test() completed the run, it is done
    # already, with the result; either way the plan may be started again at once.
    comm = _world()
    x = np.arange(6, dtype=np.float32) * (comm.rank + 1)
    expected = (np.arange(6) * sum(range(1, comm.size + 1))).tolist()
    plan = refcoll.allreduce_init(x, comm)
    early = plan.start().handle
    assert early._engine.kind == "in-flight" and plan.handle is early
    assert [r.tolist() for r in refcoll.wait_all([early])] == [expected]
    assert plan.wait().tolist() == expected and plan.handle is None
    plan.start()
    while not plan.test():
        pass
    late = plan.handle
    assert late.test() and late.finished is not None and late.wait().tolist() == expected
    assert plan.wait().tolist() == expected
    for _ in range(3):  # back to back, no handle asked: MPI_Start then MPI_Wait
        assert plan.start().wait().tolist() == expected
    assert plan.runs == 5
    plan.free()


def test_a_timed_wait_returns_the_result_of_a_run_its_engine_finished(monkeypatch):
    # A run started in place goes to an engine when a later call comes (adopt()), and the
    # engine sets the run done before it tells the handle. A wait(timeout) that saw done
    # returned the handle's result before it was told: None, or a failure lost. The
    # engine's telling is slowed here so that the wait finds that window every time.
    import threading
    import time

    import refcoll.calls.plans as plans

    t, other = _own_transport(), _own_transport()
    if t.size == 1:
        pytest.skip("one rank has no peer to wait for")
    told = plans.tell_idle

    def slow_to_tell(transport):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.3)
        told(transport)

    monkeypatch.setattr(plans, "tell_idle", slow_to_tell)
    refcoll.allreduce(np.ones(1), other)
    plan = refcoll.allreduce_init(np.full(8, t.rank + 1.0), t)
    world = _world()
    if t.rank == 0:
        plan.start()
        later = refcoll.iallreduce(np.ones(4), other)  # the engine adopts the run
        world.bcast(None, root=0)  # the peers start only now: the engine finishes the run
        result = plan.wait(timeout=DEADLINE)
    else:
        world.bcast(None, root=0)
        plan.start()
        later = refcoll.iallreduce(np.ones(4), other)
        result = plan.wait(timeout=DEADLINE)
    later.wait()
    assert result is not None and result.tolist() == [t.size * (t.size + 1) / 2] * 8
    plan.free()
    t.free()
    other.free()


def test_a_start_never_waits_for_peers_that_have_not_started_the_run_before_it():
    # Rank 0 starts two small plans and waits for neither before its peers start any: each
    # start returns (the first run goes to the engine), and both complete once they do.
    t = _own_transport()
    if t.size == 1:
        pytest.skip("one rank has no peer to wait for")
    x = np.full(8, t.rank + 1.0, np.float32)
    first, second = refcoll.allreduce_init(x, t), refcoll.allreduce_init(x, t, op="max")
    if t.rank == 0:
        first.start()
        second.start()
        with pytest.raises(refcoll.CollectiveTimeout):
            second.wait(timeout=0.05)  # the peers are in the barrier below
    _world().Barrier()
    results = ([first.wait().copy(), second.wait().copy()] if t.rank == 0
               else [first().copy(), second().copy()])
    assert results[0].tolist() == [t.size * (t.size + 1) / 2] * 8
    assert results[1].tolist() == [float(t.size)] * 8
    first.free()
    second.free()
    t.free()


def test_different_counts_at_init_are_a_mismatch_on_every_rank():
    comm = _world()
    if comm.size == 1:
        pytest.skip("one rank agrees with itself")
    last = comm.size - 1
    error = _outcome(lambda: refcoll.allreduce_init(np.ones(16 + (comm.rank == last)), comm))
    assert isinstance(error, MismatchError)
    assert f"count: rank 0 has 16, rank {last} has 17" in str(error)
    assert refcoll.allreduce(np.ones(3), comm)[0] == comm.size  # the communicator still works


def test_a_bad_out_at_init_on_one_rank_is_an_error_on_every_rank():
    comm = _world()
    last = comm.size - 1
    out = np.empty(10, np.float32 if comm.rank == last else np.float64)
    error = _outcome(lambda: refcoll.allreduce_init(np.ones(10), comm, out=out))
    assert isinstance(error, TypeError if comm.rank == last else UsageError), error
    assert f"rank {last}" in str(error)


def _faulty(fault, plan, x):
    if fault == "freed":
        plan.free()
        return plan()
    if fault == "x reshaped in place":
        x.shape = (2, x.size // 2)
        try:
            return plan()
        finally:
            x.shape = (x.size,)
    return plan(x=x.copy())


@pytest.mark.parametrize("fault", ["another x", "x reshaped in place", "freed"])
def test_a_refused_start_on_the_last_rank_is_raised_on_every_rank_in_that_start(fault):
    t = _own_transport()
    x, plan, last = _plan_run_once(t, 64)
    error = _outcome(lambda: _faulty(fault, plan, x) if t.rank == last else plan())
    # The rank at fault is refused and revokes the transport: its peers, in the run, raise
    # PeerFailure naming it in that run (a CollectiveTimeout would mean they waited it out).
    assert isinstance(error, UsageError if t.rank == last else PeerFailure), error
    assert f"rank {last}" in str(error)
    if t.rank != last:
        assert f"rank {last} revoked the communicator" in str(error), error
    later = _outcome(lambda: refcoll.allreduce(np.ones(3), t))  # revoked: every call refused
    assert isinstance(later, PeerFailure) and "revoked" in str(later) or t.rank == last, later
    fresh = refcoll.as_transport(t.comm.Dup())  # a new communicator works
    assert refcoll.allreduce(np.ones(3), fresh)[0] == t.size
    fresh.free()
    if not plan.freed:
        plan.free()
    t.free()


def test_without_validation_only_the_rank_at_fault_raises():
    t = _own_transport()
    x = _values(64, np.float32, t.rank, 0)
    plan = refcoll.allreduce_init(x, t, validate=False)
    plan()
    if t.rank == t.size - 1:  # its peers make no call: a refusal that waited would time out
        with pytest.raises(UsageError):
            plan(x=x.copy())
    plan.free()
    t.free()


def test_starting_a_started_plan_is_refused_and_the_first_start_completes():
    comm = _world()
    x = _values(64, np.float32, comm.rank, 0)
    with refcoll.allreduce_init(x, comm) as plan:
        plan.start()
        with pytest.raises(UsageError):
            plan.start()
        assert same_bits(plan.wait(), refcoll.allreduce(x, comm))


def test_freed_plans_leave_no_persistent_request():
    comm = _world()
    t = refcoll.as_transport(comm)
    x = np.arange(12, dtype=np.float32)
    with refcoll.allreduce_init(x, comm) as warm:  # what the transport keeps for good is made here
        warm()
    before = len(t._persistent)
    alive = []
    for _ in range(50):
        for collective in ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce"):
            plan = _make(collective, x, comm)
            plan()
            alive.append(plan)
    if t.size > 1:  # a live plan of a small all-reduce holds its recorded exchanges
        assert len(t._persistent) > before
    for plan in alive:
        plan.free()
    assert len(t._persistent) == before


@pytest.mark.parametrize("algorithm", ["recursive_doubling", "ring"])
def test_a_recorded_plans_runs_count_the_blocking_calls_traffic_and_keep_it_when_freed(
        algorithm):
    comm = _world()
    t = refcoll.as_transport(comm)
    x = np.arange(12, dtype=np.float32)

    def counts():
        traffic = t.traffic
        return np.array([traffic.sent, traffic.received, traffic.messages_sent,
                         traffic.messages_received])

    before = counts()
    refcoll.allreduce(x, comm, algorithm=algorithm, validate=False)
    one = counts() - before
    plan = refcoll.allreduce_init(x, comm, algorithm=algorithm, validate=False)
    assert plan.recorded == (t.size > 1)
    before = counts()
    plan()
    plan.start().wait()  # (started in place: InFlight)
    plan.start()
    assert np.array_equal(plan.wait(), refcoll.allreduce(x, comm, algorithm=algorithm,
                                                         validate=False))
    after_runs = counts() - before - one  # (the blocking call beside the last run)
    assert np.array_equal(after_runs, 3 * one), (after_runs, one)
    plan.free()
    assert np.array_equal(counts() - before, 4 * one)  # freed: its runs stay counted


@pytest.mark.parametrize("count", [4, 100_000])
def test_a_run_that_failed_partway_revokes_rather_than_leave_its_messages_to_a_new_plan(count):
    """(100,000 elements: the timed-out sends are past MPICH's eager size, where cancelling
    a persistent send ended the process with SIGSEGV: they are kept, not cancelled.)"""
    from refcoll.core.errors import CollectiveTimeout
    from refcoll.transport.mpi import MPITransport

    t = MPITransport(_world(), timeout=2)  # its own communicator: the world's stays usable
    if t.size < 2:
        return
    x = np.full(count, 100.0 * (t.rank + 1))
    first = refcoll.allreduce_init(x, t)
    if t.rank != t.size - 1:  # the last rank never runs it: the others' sends stay in flight
        with pytest.raises((CollectiveTimeout, PeerFailure)):
            first()
    # A new plan on the same transport could come to share the tags of those messages
    # (plans past the tag slots share them): the ranks that failed revoked it and refuse
    # at once; the last rank, which never ran
    # the failed plan, learns it from their notice or by its deadline, never by reducing
    # those messages as its data.
    with pytest.raises((PeerFailure, CollectiveTimeout)) as caught:
        refcoll.allreduce_init(np.full(4, 1.0), t)()
    if t.rank != t.size - 1:  # revoked by the run's timeout, the first reason given
        said = str(caught.value)
        assert caught.type is PeerFailure and "cannot complete" in said
        assert "timed out" in said or "failed partway" in said, said
    assert refcoll.allreduce(np.ones(3), _world())[0] == t.size  # the world is untouched


# A recorded plan started and waited; a plan that runs its algorithm again, called.
@pytest.mark.parametrize("collective, drive", [("allreduce", "start"), ("allgather", "call")])
def test_plans_started_in_different_orders_time_out_rather_than_swap_their_data(
        collective, drive):
    """Each plan has its own tags: two plans of the same sizes, run in opposite orders on
    rank 0 and on the others, each wait for their own messages (up to the deadline) where
    they once took each other's data and returned a wrong result without a word."""
    from refcoll.core.errors import CollectiveTimeout
    from refcoll.transport.mpi import MPITransport

    t = MPITransport(_world(), timeout=1)  # its own communicator: revoked by the timeouts
    if t.size < 2:
        return
    make = getattr(refcoll, f"{collective}_init")
    first = make(np.full(4, 1.0 + t.rank), t)
    second = make(np.full(4, 100.0 + t.rank), t)
    order = [first, second] if t.rank == 0 else [second, first]
    with pytest.raises((CollectiveTimeout, PeerFailure)) as caught:
        if drive == "start":
            for plan in order:
                plan.start()
            for plan in order:
                plan.wait()
        else:
            for plan in order:
                plan()
    assert "timed out" in str(caught.value)
    assert "plan #" in str(caught.value) or collective != "allreduce"  # which plan waited
    for plan in order:
        plan.free()
    assert refcoll.allreduce(np.ones(3), _world())[0] == t.size  # the world is untouched


def test_a_started_run_that_times_out_names_its_collective():
    """start() then wait(): the wait ran the plan's exchanges outside any call, so its
    timeout said "point-to-point timed out"; it names the plan's collective."""
    from refcoll.core.errors import CollectiveTimeout
    from refcoll.transport.mpi import MPITransport

    t = MPITransport(_world(), timeout=1)  # its own communicator: revoked by the timeout
    if t.size < 2:
        return
    plan = refcoll.allreduce_init(np.ones(4), t)
    if t.rank == 0:  # the others never start it
        with pytest.raises(CollectiveTimeout, match="rank 0: allreduce timed out after 1 s"):
            plan.start().wait()
    _world().Barrier()


def test_a_run_that_finished_unseen_is_still_started_until_a_wait_or_test_sees_it():
    """MPI's rule: a persistent request is active until MPI_Wait or a successful MPI_Test;
    a run that merely finished in the background is no excuse for a second start."""
    t = _own_transport("thread")
    x = _values(100_000, np.float32, t.rank, 0)  # not a small run: it goes to the thread
    plan = refcoll.allreduce_init(x, t)
    plan.start()
    plan.handle._done.wait()  # finished, by the progress thread; nobody saw it
    with pytest.raises(UsageError, match="already started"):
        plan.start()  # on every rank, whatever the timing
    assert same_bits(plan.wait(), refcoll.allreduce(x, t))
    plan.start()  # seen by wait(): it may start again
    while not plan.test():  # and a test that says so is seen too
        pass
    plan.start()
    plan.wait()
    plan.free()
    t.free()


@pytest.mark.parametrize("kind", ["thread", "schedule"])
def test_a_refused_start_reaches_its_peers_in_the_run_on_either_engine(kind):
    """The schedule engine counted a run's call only at its end, so a peer's revocation
    of it was noticed at the deadline (CollectiveTimeout), not in the run (PeerFailure)."""
    t = _own_transport(kind)
    x, plan, last = _plan_run_once(t, 100_000)
    if t.rank == last:
        error = _outcome(lambda: plan.start(x=x.copy()).wait())
    else:
        error = _outcome(lambda: plan.start().wait())
    assert isinstance(error, UsageError if t.rank == last else PeerFailure), error
    assert f"rank {last}" in str(error)
    plan.free()
    t.free()


@pytest.mark.parametrize("kind", ["thread", "schedule"])
def test_a_late_peer_of_a_timed_out_run_is_refused_and_writes_nothing_here(kind):
    """The schedule engine's timeout left the run's receive posted and its call unrevoked:
    a peer that came after rank 0 gave up completed with what rank 0 wrote next, and wrote
    into rank 0's result. Rank 1 starts only once rank 0 has timed out and moved on."""
    from refcoll.core.errors import CollectiveTimeout

    world = _world()
    t = _own_transport(kind, timeout=1)
    if t.size < 2:
        t.free()
        return
    x = np.full(100_000, t.rank + 1.0, np.float32)
    out = np.empty_like(x)
    plan = refcoll.allreduce_init(x, t, out=out)
    plan()
    if t.rank == 0:
        with pytest.raises(CollectiveTimeout, match="rank 0: allreduce timed out after 1 s"):
            plan.start().wait()
        x[:], out[:] = 1000.0, -7.0  # the program's next step
        world.ssend(None, dest=1, tag=71)  # (on the world: rank 1 may go now)
        world.recv(source=1, tag=72)  # rank 1 has tried
        assert (out == -7.0).all()  # nothing of the late run landed here
    elif t.rank == 1:
        world.recv(source=0, tag=71)
        with pytest.raises(PeerFailure, match="rank 0 revoked the communicator: rank 0: "
                                              "allreduce timed out"):
            plan.start().wait()
        world.ssend(None, dest=0, tag=72)
    world.Barrier()


def _tested_until_it_ends(plan, error, match: str) -> None:
    """Start ``plan``, call ``test()`` until it says done, then expect ``wait()`` to raise."""
    plan.start()
    while not plan.test():
        pass
    with pytest.raises(error, match=match):
        plan.wait()


def test_a_test_loop_on_a_run_started_in_place_ends_by_the_deadline_or_a_revocation():
    """A small plan started in place was looked at by test() without a deadline and without
    reading a peer's revocation: ``while not plan.test()`` spun for ever."""
    from refcoll.core.errors import CollectiveTimeout

    world = _world()
    t = _own_transport(timeout=1)
    if t.size < 2:
        t.free()
        return
    x = np.ones(8, np.float32)
    plan = refcoll.allreduce_init(x, t)
    if t.rank == 0:  # rank 1 never starts it: the deadline
        _tested_until_it_ends(plan, CollectiveTimeout, "rank 0: allreduce timed out after 1 s")
    world.Barrier()
    t2 = _own_transport(timeout=DEADLINE)
    plan = refcoll.allreduce_init(x, t2)
    if t2.rank == 1:  # a refused run: rank 1 revokes, and rank 0's loop reads it at once
        with pytest.raises(UsageError, match="is not the buffer"):
            plan(x=x.copy())
    elif t2.rank == 0:
        _tested_until_it_ends(plan, PeerFailure, "rank 1 revoked the communicator")
    world.Barrier()


def test_the_plans_own_communicator_under_another_handle_is_its_own():
    """A plan made with comm=None refused comm=MPI.COMM_WORLD as "another communicator", and
    that refusal revoked the world's transport for every later call."""
    from mpi4py import MPI

    world = _world()
    x = np.full(8, world.rank + 1.0)
    plan = refcoll.allreduce_init(x)
    want = float(sum(range(1, world.size + 1)))
    assert (plan(comm=MPI.COMM_WORLD) == want).all()
    dup = world.Dup()
    other = refcoll.allreduce_init(x, dup)
    assert (other(comm=MPI.Intracomm(dup)) == want).all()  # another handle, the same comm
    assert (refcoll.allreduce(x, world) == want).all()  # nothing revoked
    plan.free()
    other.free()
    if world.size > 1:
        with pytest.raises(UsageError, match="belongs to another communicator"):
            refcoll.allreduce_init(x, dup, validate=False)(comm=world)
    dup.Free()


def test_a_plan_and_another_call_on_the_other_ranks_are_a_mismatch_at_once():
    """allreduce_init agreed on the blocking call's record: against an allreduce on another
    rank it passed, and that rank waited out its deadline for the plan's first run."""
    t = _own_transport()
    if t.size < 2:
        t.free()
        return
    x = np.ones(8, np.float32)
    with pytest.raises(MismatchError, match="different arguments: collective: ") as caught:
        if t.rank == 0:
            refcoll.allreduce_init(x, t)
        else:
            refcoll.allreduce(x, t)
    assert "rank 0 has allreduce_init" in str(caught.value)
    assert "rank 1 has allreduce," in str(caught.value) + ","
    t.free()


def test_a_plan_whose_communicator_was_freed_says_so_on_every_rank():
    world = _world()
    dup = world.Dup()
    plan = refcoll.allreduce_init(np.ones(8), dup)
    plan()
    dup.Free()
    for _ in range(2):  # and again: not "failed partway"
        with pytest.raises(UsageError, match="communicator was freed"):
            plan()


@pytest.mark.parametrize("count", [16, 100_000])  # started in place, and on the thread
def test_plans_started_on_one_communicator_move_while_a_rank_blocks_on_another(count):
    """Rank 0 starts a plan on c1 and runs one on c2; the others start on c2 and run on c1:
    each communicator sees one order on every rank, so MPI completes it (its progress
    rule). A small plan's start in place once moved only on its own communicator's calls,
    and both ranks waited for each other until their deadline."""
    first, second = _own_transport(), _own_transport()
    try:
        r = first.rank
        x, y = np.full(count, r + 1.0), np.full(count, 10.0 * (r + 1))
        with refcoll.allreduce_init(x, first) as p1, refcoll.allreduce_init(y, second) as p2:
            if r == 0:
                p1.start()
                b = p2()
                a = p1.wait()
            else:
                p2.start()
                a = p1()
                b = p2.wait()
            total = first.size * (first.size + 1) / 2
            assert a[0] == a[-1] == total and b[0] == b[-1] == 10 * total
    finally:
        first.free()
        second.free()


@pytest.mark.parametrize("count", [4, 100_000])  # started in place, and on the thread
def test_a_wait_after_a_rebind_returns_the_buffer_its_run_wrote(count):
    """test() saw the run complete, rebind() pointed the plan elsewhere: wait() returns
    the output the run wrote, not the new buffer (which no run has written yet)."""
    t = _world()
    x1, o1, x2, o2 = np.ones(count), np.zeros(count), np.ones(count), np.zeros(count)
    with refcoll.allreduce_init(x1, t, out=o1) as plan:
        plan.start()
        while not plan.test():
            pass
        plan.rebind(x2, out=o2)
        got = plan.wait()
        assert got is o1 and o1[0] == o1[-1] == t.Get_size() and not o2.any()
        assert plan() is o2 and o2[0] == t.Get_size()


@pytest.mark.parametrize("strict", ["seterr", "warnings"])
@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "tree"])
def test_an_overflow_under_strict_numpy_gives_inf_on_every_rank(algorithm, strict):
    """A program that debugs with ``np.seterr(all="raise")``, or runs under ``python -W
    error``: the partial that overflows is one rank's, and a FloatingPointError (or the
    warning, raised) there left the others waiting to the deadline. IEEE's inf on every
    rank: blocking, from a plan (whose reductions are compiled), and compressed."""
    import warnings

    t = refcoll.as_transport(_world())
    x = np.ones(6, np.float32)
    if t.rank >= 1:
        x[5] = 3e38
    before = np.geterr()
    with warnings.catch_warnings():
        if strict == "seterr":
            np.seterr(all="raise")
        else:
            warnings.simplefilter("error")
        try:
            y = refcoll.allreduce(x, t, algorithm=algorithm)
            z = np.empty_like(x)
            plan = refcoll.allreduce_init(x, t, algorithm=algorithm, out=z)
            plan()
            plan.free()
            half, _ = refcoll.compressed_allreduce(x, t, compressor="fp16", algorithm=algorithm)
        finally:
            np.seterr(**before)
    p = t.size
    want = np.array([float(p)] * 5 + [np.inf if p > 2 else 3e38 + 1], np.float32)
    assert y.tolist() == z.tolist() == want.tolist()
    assert half.tolist() == [float(p)] * 5 + [np.inf]  # (3e38 is past float16's range)
