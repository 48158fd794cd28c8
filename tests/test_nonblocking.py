"""Non-blocking collectives on the simulator: the blocking call's bits, MPI's order, errors on
wait."""

import threading
import time

import numpy as np
import pytest

import refcoll
from refcoll import SimWorld
from refcoll.calls import progress
from refcoll.calls.collectives import COLLECTIVE_FUNCTIONS
from refcoll.calls.nonblocking import NONBLOCKING_FUNCTIONS, issue
from refcoll.core.errors import CollectiveTimeout, DeadlockError, MismatchError, UsageError


def _inputs(p, n=37, dtype=np.float32):
    return [np.random.default_rng(r).standard_normal(n).astype(dtype) for r in range(p)]


def _call(table, collective, x, t, **kw):
    root = kw.pop("root", None)
    fn = table[collective]
    return fn(x, root, t, **kw) if root is not None else fn(x, t, **kw)


CALLS = [("allreduce", "ring", {"op": "sum"}), ("allreduce", "rabenseifner", {"op": "avg"}),
         ("allreduce", "tree", {"op": "max"}), ("reduce_scatter", "ring", {"op": "sum"}),
         ("reduce_scatter", "bruck", {"op": "prod"}), ("allgather", "bruck", {}),
         ("broadcast", "tree", {"root": 1}), ("allreduce", "dbtree", {"op": "sum"}),
         ("reduce", "tree", {"op": "sum", "root": 0})]


@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_every_call_gives_the_blocking_calls_bits_with_all_outstanding_at_once(p):
    xs = _inputs(p, 41)

    def kwargs(algorithm, kw):
        kw = dict(kw, algorithm=algorithm)
        if "root" in kw:
            kw["root"] = min(kw["root"], p - 1)
        return kw

    def rank(t):
        x = xs[t.rank]
        handles = [_call(NONBLOCKING_FUNCTIONS, c, x, t, **kwargs(a, kw)) for c, a, kw in CALLS]
        results = refcoll.wait_all(handles)
        blocking = [_call(COLLECTIVE_FUNCTIONS, c, x, t, **kwargs(a, kw)) for c, a, kw in CALLS]
        return results, blocking

    for results, blocking in SimWorld(p).run(rank):
        for got, want, (c, a, _) in zip(results, blocking, CALLS):
            if want is None:
                assert got is None, (c, a)
                continue
            assert got.shape == want.shape and got.dtype == want.dtype, (c, a)
            assert got.tobytes() == want.tobytes(), (c, a)


def test_the_simulator_predicts_a_nonblocking_run_with_the_same_ledger():
    xs = _inputs(4, 1000)
    blocking = refcoll.simulate("allreduce", xs, algorithm="rabenseifner")
    world = SimWorld(4)
    outs = world.run(lambda t: refcoll.iallreduce(xs[t.rank], t, algorithm="rabenseifner",
                                                  validate=False).wait())
    assert all(o.tobytes() == b.tobytes() for o, b in zip(outs, blocking.outputs))
    # simulate() runs without the argument agreement; so does this call: the messages are
    # the algorithm's alone, the same in both.
    assert world.ledger.counts() == blocking.ledger.counts()
    assert world.ledger.rounds == blocking.ledger.rounds


def test_a_blocking_call_issued_among_outstanding_ones_runs_in_issue_order():
    # Rank 1 issues the same calls as blocking ones: if rank 0's blocking call jumped the queue,
    # the two ranks would pair different calls (a size mismatch or a wrong result).
    xs = [np.arange(8, dtype=np.float64) * (r + 1) for r in range(2)]
    ys = [np.arange(3, dtype=np.float64) + 10 * r for r in range(2)]

    def rank(t):
        if t.rank == 0:
            h1 = refcoll.iallreduce(xs[0], t)
            middle = refcoll.allreduce(ys[0], t, op="max")
            h3 = refcoll.iallgather(ys[0], t)
            return h1.wait(), middle, h3.wait()
        return (refcoll.allreduce(xs[1], t), refcoll.allreduce(ys[1], t, op="max"),
                refcoll.allgather(ys[1], t))

    a, b = SimWorld(2).run(rank)
    for u, v in zip(a, b):
        assert u.tobytes() == v.tobytes()
    np.testing.assert_array_equal(a[0], xs[0] + xs[1])
    np.testing.assert_array_equal(a[1], np.maximum(ys[0], ys[1]))


def test_the_call_progresses_while_the_caller_never_calls_test_or_wait():
    # Rank 1's blocking all-reduce can finish only if rank 0's non-blocking one moves while
    # rank 0 sits on an event that only rank 1 sets afterwards.
    peer_done = threading.Event()

    def rank(t):
        x = np.full(1000, t.rank + 1.0)
        if t.rank == 0:
            h = refcoll.iallreduce(x, t)
            assert peer_done.wait(60), "the non-blocking call did not progress by itself"
            return h.wait()
        y = refcoll.allreduce(x, t)
        peer_done.set()
        return y

    a, b = SimWorld(2).run(rank)
    assert a.tobytes() == b.tobytes() and a[0] == 3.0


def test_handle_states_and_a_wait_timeout_that_leaves_the_call_running():
    release = threading.Event()
    seen = {}

    def rank(t):
        x = np.ones(5)
        if t.rank == 1:
            release.wait(60)  # issues only after rank 0's wait(timeout) has given up
            return refcoll.iallreduce(x, t).wait()
        h = refcoll.iallreduce(x, t)
        seen["test"] = h.test()
        seen["exception"] = h.exception()
        with pytest.raises(CollectiveTimeout, match="not complete after wait"):
            h.wait(timeout=0.05)
        release.set()
        out = h.wait()
        seen["after"] = (h.test(), h.is_completed(), h.exception())
        seen["stamps"] = h.issued <= h.started <= h.finished
        return out

    a, b = SimWorld(2).run(rank)
    assert seen["test"] is False and seen["exception"] is None
    assert seen["after"] == (True, True, None) and seen["stamps"]
    np.testing.assert_array_equal(a, b)


def _errors(world_size, fn):
    errors = [None] * world_size

    def rank(t):
        try:
            fn(t)
        except Exception as exc:  # noqa: BLE001
            errors[t.rank] = exc

    SimWorld(world_size).run(rank)
    return errors


def test_a_mismatch_is_raised_from_wait_on_every_rank_with_the_blocking_calls_message():
    def counts(t):
        return np.ones(10 + (t.rank == 2), np.float32)

    blocking = _errors(3, lambda t: refcoll.allreduce(counts(t), t))
    handles = {}

    def nonblocking(t):
        handles[t.rank] = refcoll.iallreduce(counts(t), t)
        handles[t.rank].wait()

    errors = _errors(3, nonblocking)
    assert all(isinstance(e, MismatchError) for e in errors)
    assert [str(e) for e in errors] == [str(e) for e in blocking]
    assert "count: rank 0 has 10, rank 2 has 11" in str(errors[0])
    assert all(handles[r].exception() is errors[r] for r in range(3))


def test_wait_all_waits_for_every_handle_then_raises_the_first_error():
    results = {}

    def rank(t):
        good = refcoll.iallreduce(np.ones(4), t)
        bad = refcoll.iallreduce(np.ones(4 + t.rank), t)
        after = refcoll.iallgather(np.full(2, t.rank), t)
        try:
            refcoll.wait_all([good, bad, after])
        finally:
            results[t.rank] = (good.test(), bad.test(), after.wait())

    errors = _errors(2, rank)
    assert all(isinstance(e, MismatchError) for e in errors)
    for r in range(2):
        assert results[r][:2] == (True, True)
        np.testing.assert_array_equal(results[r][2], [[0, 0], [1, 1]])


def test_wait_all_passes_an_interrupt_on_at_once():
    """Ctrl-C in the first wait is not held back until every other call completes or
    times out (minutes, at the default deadline), as one handle's wait does not."""
    waited = []

    class Interrupted:
        def wait(self, timeout=None):
            waited.append("interrupted")
            raise KeyboardInterrupt

    class Late:
        def wait(self, timeout=None):
            waited.append("late")
            return 1

    with pytest.raises(KeyboardInterrupt):
        refcoll.wait_all([Interrupted(), Late()])
    assert waited == ["interrupted"]


def test_a_rank_that_never_issues_is_a_deadlock_error_from_wait():
    def rank(t):
        if t.rank == 0:
            refcoll.iallreduce(np.ones(3), t).wait()

    errors = _errors(2, rank)
    assert isinstance(errors[0], DeadlockError)
    assert "rank 1 has finished" in str(errors[0]) or "has finished" in str(errors[0])


def test_compressed_iallreduce_keeps_the_blocking_calls_bits_and_state():
    xs = _inputs(3, 200)

    def rank(t, nonblocking):
        comp = refcoll.compressors.parse("ef(topk:ratio=0.1)")
        state = comp.new_state(seed=7, rank=t.rank)
        outs = []
        for step in range(3):
            x = xs[t.rank] * (step + 1)
            if nonblocking:
                outs.append(issue("allreduce", t, lambda t, x=x: refcoll.compressed_allreduce(
                    x, t, op="avg", compressor=comp, state=state)[0]).wait())
            else:
                outs.append(refcoll.compressed_allreduce(x, t, op="avg", compressor=comp,
                                                         state=state)[0])
        return outs

    a = SimWorld(3).run(lambda t: rank(t, True))
    b = SimWorld(3).run(lambda t: rank(t, False))
    for u, v in zip(a, b):
        assert [o.tobytes() for o in u] == [o.tobytes() for o in v]


def test_the_schedule_engine_gives_the_same_bits(monkeypatch):
    monkeypatch.setenv("REFCOLL_PROGRESS", "schedule")
    xs = _inputs(3, 300)

    def rank(t):
        hs = [refcoll.iallreduce(xs[t.rank], t, algorithm=a) for a in ("ring", "tree", "ring")]
        assert progress.engine_for(t).kind == "schedule"
        return refcoll.wait_all(hs)

    ring = refcoll.simulate("allreduce", xs, algorithm="ring").outputs
    tree = refcoll.simulate("allreduce", xs, algorithm="tree").outputs
    for r, outs in enumerate(SimWorld(3).run(rank)):
        assert [o.tobytes() for o in outs] == [ring[r].tobytes(), tree[r].tobytes(),
                                               ring[r].tobytes()]


def test_an_unknown_progress_engine_is_a_usage_error(monkeypatch):
    monkeypatch.setenv("REFCOLL_PROGRESS", "fibers")
    errors = _errors(2, lambda t: refcoll.iallreduce(np.ones(2), t))
    assert all(isinstance(e, UsageError) and "REFCOLL_PROGRESS='fibers'" in str(e)
               for e in errors)


def test_asking_a_communicator_for_another_engine_after_its_first_call_is_refused():
    def rank(t):
        refcoll.iallreduce(np.ones(2), t).wait()
        progress.engine_for(t, "schedule")

    errors = _errors(2, rank)
    assert all(isinstance(e, UsageError) and "already run on the thread engine" in str(e)
               for e in errors)


def test_the_thread_engine_needs_thread_multiple(monkeypatch):
    class Serialized:  # a transport over a library that gave less than MPI_THREAD_MULTIPLE
        thread_multiple = False

    assert progress.engine_kind(Serialized()) == "schedule"
    monkeypatch.setenv("REFCOLL_PROGRESS", "thread")
    with pytest.raises(UsageError, match="MPI_THREAD_MULTIPLE"):
        progress.engine_kind(Serialized())


@pytest.mark.parametrize("kind", ["thread", "schedule"])
def test_a_wait_returns_before_the_calls_issued_after_it_complete(monkeypatch, kind):
    # A legal program: rank 1 issues its second call only once rank 0's first wait has
    # returned. The schedule engine's wait ran every queued call whole, the second too, so
    # rank 0's first wait could not return: a deadlock.
    monkeypatch.setenv("REFCOLL_PROGRESS", kind)
    first_waited = threading.Event()

    def rank(t):
        if t.rank == 0:
            h1 = refcoll.iallreduce(np.ones(4), t)
            h2 = refcoll.iallreduce(np.full(4, 2.0), t)
            a = h1.wait()
            first_waited.set()  # as a message on another communicator would tell rank 1
            return a[0], h2.wait()[0]
        a = refcoll.iallreduce(np.ones(4), t).wait()
        first_waited.wait()
        return a[0], refcoll.iallreduce(np.full(4, 2.0), t).wait()[0]

    assert SimWorld(2, timeout=60).run(rank) == [(2.0, 4.0), (2.0, 4.0)]


@pytest.mark.parametrize("kind", ["thread", "schedule"])
def test_a_wait_from_a_done_callback_of_the_same_engine_is_refused(monkeypatch, kind):
    # The schedule engine spun for ever: its advance returns at once inside its own call.
    monkeypatch.setenv("REFCOLL_PROGRESS", kind)

    def rank(t):
        h1 = refcoll.iallreduce(np.ones(4), t)
        h2 = refcoll.iallreduce(np.full(4, 2.0), t)
        got = []
        h1.add_done_callback(lambda h: got.append(_raised(h2.wait)))
        h1.wait()
        return got, h2.wait()[0]

    for got, value in SimWorld(2, timeout=60).run(rank):
        assert value == 4.0
        if got:  # a callback run on the caller's thread (h1 done at its registration) may wait
            assert isinstance(got[0], UsageError) and "would wait for itself" in str(got[0])


def _raised(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - returned for the test to look at
        return exc


@pytest.mark.parametrize("kind", ["thread", "schedule"])
def test_a_compressed_allreduce_runs_in_issue_order_behind_outstanding_calls(monkeypatch, kind):
    # Rank 1 makes the same two calls blocking: the compressed one ran ahead of rank 0's
    # iallreduce, on the caller's thread, and the ranks paired different calls.
    monkeypatch.setenv("REFCOLL_PROGRESS", kind)
    topk = refcoll.compressors.parse("topk:ratio=0.5")

    def rank(t):
        x = np.arange(1000, dtype=np.float32) * (t.rank + 1)
        y = np.arange(64, dtype=np.float32) * (t.rank + 1)
        if t.rank == 0:
            h = refcoll.iallreduce(x, t)
            c, _ = refcoll.compressed_allreduce(y, t, compressor=topk)
            return h.wait(), c
        a = refcoll.allreduce(x, t)
        c, _ = refcoll.compressed_allreduce(y, t, compressor=topk)
        return a, c

    (a0, c0), (a1, c1) = SimWorld(2, timeout=60).run(rank)
    assert a0.tobytes() == a1.tobytes() and c0.tobytes() == c1.tobytes()
    np.testing.assert_array_equal(a0, np.arange(1000, dtype=np.float32) * 3)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_progress_thread_ended_by_a_callback_leaves_a_thread_for_the_calls_behind():
    # A done callback's SystemExit ends the progress thread; the engine still named it, so
    # later calls were never run unless a wait() took them over: test() never completed.
    registered = threading.Event()

    def rank(t):
        if t.rank == 0:
            h1 = refcoll.iallreduce(np.ones(4), t)
            h1.add_done_callback(lambda h: (_ for _ in ()).throw(SystemExit(0)))
            registered.set()  # rank 1 joins h1 only now: h1 completes on the thread
        else:
            registered.wait()
            h1 = refcoll.iallreduce(np.ones(4), t)
        give_up = time.monotonic() + 60  # a bound, not a timing: it ends a failed test
        while not h1.test():  # not wait(): it would take the call, and run the callback, here
            pass
        h2 = refcoll.iallreduce(np.full(4, 2.0), t)
        while not h2.test() and time.monotonic() < give_up:  # test() alone, as MPI_Test
            pass  # repeated completes a call
        return h1.wait()[0], h2.test() and h2.wait()[0]

    assert SimWorld(2, timeout=60).run(rank) == [(2.0, 4.0), (2.0, 4.0)]
