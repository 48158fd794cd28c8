"""The argument agreement carried beside the data of kept plans (run by test_mpi.py).

A validated all-reduce whose arguments came twice is kept as a plan
(refcoll/calls/plans.py, ``plans.run``); from the third call it replays that
plan with the signature exchange started beside its first data exchange
(``Plan._signed``). These tests make the ranks disagree in every way the two
paths can meet: both ranks kept (different plans), one kept and one not (its
count never ran), a plan kept on some ranks only (the same arguments on
different paths), a peer that stalls, a kept plan against another collective,
and they check that every rank names the difference, that nothing hangs, and
that the communicator still gives the right sums afterwards: after more
failures than there are reserved tag slots, with a non-blocking call queued
behind the failure, with an op spelled differently per rank, with ``out=``
given on one rank only, and past the eviction of kept plans. A persistent
collective (``allreduce_init``) whose buffer changed on one rank is refused
there and its peers learn it in that very run.
"""

import re

import numpy as np
import pytest

import refcoll
from refcoll.calls import plans
from refcoll.calls.agree import signatures
from refcoll.calls.auto import resolve
from refcoll.core.errors import CollectiveTimeout, MismatchError, PeerFailure, UsageError

pytestmark = pytest.mark.mpi

ALGORITHMS = ("auto", "ring", "recursive_doubling", "rabenseifner", "tree")

#: Calls of one set of arguments before a blocking all-reduce replays a kept plan:
#: the first is seen, the second runs and is kept, the third replays.
CALLS_TO_REPLAY = 3


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _transport(timeout=None):
    """Return a transport of its own over COMM_WORLD, never freed.

    Freeing it would let MPICH give its communicator's context to a later one, where
    the messages a failed call left unreceived here would be taken as data.
    """
    from refcoll.transport.mpi import MPITransport

    return MPITransport(_world(), timeout=timeout)


def _key(algorithm, count, dtype=np.float32, op="sum"):
    return (algorithm, op, np.dtype(dtype), count)


def _replays(t, algorithm, count, itemsize=4) -> bool:
    """Return whether a small all-reduce of these arguments is kept and replayed on ``t``."""
    name = resolve(t, "allreduce", count, itemsize) if algorithm == "auto" else algorithm
    return t.size > 1 and plans.replayable(t, name, {})


def _sum_of(t, value):
    return value * t.size * (t.size + 1) / 2


def _check_sums(t, algorithm, counts):
    """Every count sums right on every rank, three times: the third from its kept plan."""
    for n in counts:
        for value in range(1, CALLS_TO_REPLAY + 1):
            x = np.full(n, value * (t.rank + 1), np.float32)
            got = refcoll.allreduce(x, t, algorithm=algorithm)
            assert np.array_equal(got, np.full(n, _sum_of(t, value), np.float32)), (n, value)
        plan = plans.kept(t, _key(algorithm, n))
        assert (plan is not None) == _replays(t, algorithm, n), (algorithm, n)
        assert plan is None or (plan.recorded and plan.runs >= 1 and not plan.freed)


def _kept_plans(t) -> list:
    """Return what ``t`` keeps, in its order: key, algorithm run, whether recorded and freed."""
    table = t.cache.get("plans", {}).get("kept", {})
    return [(k[0], k[1], str(k[2]), k[3], p.algorithm, p.recorded, p.freed)
            for k, p in table.items()]


def _assert_same_kept_plans(t):
    """Every rank keeps the same plans in the same order: the ranks stay on one path."""
    mine = _kept_plans(t)
    assert all(theirs == mine for theirs in _world().allgather(mine)), mine


@pytest.mark.parametrize("count", [0, 16])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_kept_plan_runs_its_agreement_beside_its_data(algorithm, count):
    """From the third call, a validated call's signatures travel beside the plan's data, alone.

    With 0 elements a plan may have no exchange at all (tree): its signatures still travel.
    """
    t = _transport()
    _check_sums(t, algorithm, (count,))
    plan = plans.kept(t, _key(algorithm, count))
    if plan is None:
        assert not _replays(t, algorithm, count)
        return
    assert plan._signature is not None  # a validated replay carries the call's signature
    exchanges = [s for s in plan._schedule.steps if getattr(s, "_sent", -1) >= 0]
    agreement = [s for s in signatures(t).steps if s._sent >= 0]
    for validate, carried in ((True, agreement), (False, [])):
        runs, messages, sent = plan.runs, t.traffic.messages_sent, t.traffic.sent
        x = np.full(count, t.rank + 1, np.float32)
        assert np.array_equal(refcoll.allreduce(x, t, algorithm=algorithm, validate=validate),
                              np.full(count, _sum_of(t, 1), np.float32))
        assert plan.runs == runs + 1  # replayed
        # No record exchange and no round trip of its own: the plan's messages and the
        # signatures' (validated), the plan's alone (not).
        assert t.traffic.messages_sent - messages == len(exchanges) + len(carried), validate
        assert t.traffic.sent - sent == sum(s._sent for s in exchanges + carried), validate
    _assert_same_kept_plans(t)


# How the last rank differs from the others: (field, its argument, the others', message).
DIFFERENCES = {
    "count": (dict(count=17), dict(count=16), r"count: rank 0 has 16, rank \d+ has 17"),
    "dtype": (dict(dtype=np.int32), dict(dtype=np.float32),
              r"dtype: rank 0 has float32, rank \d+ has int32"),
    "op": (dict(op="max"), dict(op="avg"), r"op: rank 0 has avg, rank \d+ has max"),
}
CASES = ([("count", algorithm) for algorithm in ALGORITHMS]
         + [("dtype", "auto"), ("op", "auto"), ("op", "ring")])


def _expected(t, op, value):
    """Return what every element of ``value * (rank + 1)`` all-reduces to under ``op``."""
    return {"sum": _sum_of(t, value), "avg": _sum_of(t, value) / t.size,
            "max": value * t.size}[op]


def _call(t, algorithm, *, count, dtype, op, out=False, value=1):
    """All-reduce ``value * (rank + 1)``, into a fresh ``out=`` when asked; return the result."""
    x = np.full(count, value * (t.rank + 1), dtype)
    result = np.empty_like(x) if out else None
    got = refcoll.allreduce(x, t, algorithm=algorithm, op=op, out=result)
    assert result is None or got is result
    return got


@pytest.mark.parametrize("kept", ["both", "others", "last"], ids=lambda v: f"{v} kept")
@pytest.mark.parametrize("field,algorithm", CASES, ids=lambda v: str(v))
def test_a_bad_argument_is_named_on_every_rank(field, algorithm, kept):
    """The last rank passes another count, dtype or op; whose arguments ran before varies.

    ``both``: every rank has kept a plan of either arguments, so the last rank
    replays its own while the others replay theirs; ``others``: the last rank's
    arguments never ran, so it takes the ordinary path while the others replay;
    ``last``: the other way round. The op case passes ``out=``.
    """
    t = _transport()
    last, others, message = DIFFERENCES[field]
    out = field == "op"
    defaults = dict(count=16, dtype=np.float32, op="sum")
    mine = dict(defaults, **(last if t.rank == t.size - 1 and t.size > 1 else others))
    warm = {"both": [others, last], "others": [others], "last": [last]}[kept]
    for arguments in warm:
        for value in range(1, CALLS_TO_REPLAY + 1):
            _call(t, algorithm, **dict(defaults, **arguments), out=out, value=value)
    before = _kept_plans(t)
    if t.size > 1:
        with pytest.raises(MismatchError, match=message):
            _call(t, algorithm, **mine, out=out)
    # Every rank moved its exchanges to a new tag slot and dropped its kept plans (one kept
    # on some ranks only may be what failed): every rank back on the ordinary path, where
    # the calls keep their plans again and still give the right results.
    assert _kept_plans(t) == ([] if t.size > 1 else before)
    _assert_same_kept_plans(t)
    for arguments in (others, last):
        for value in range(1, CALLS_TO_REPLAY + 1):
            got = _call(t, algorithm, **dict(defaults, **arguments), out=out, value=value)
            want = _expected(t, dict(defaults, **arguments)["op"], value)
            assert np.array_equal(got, np.full_like(got, want)), (arguments, value)
    _check_sums(t, algorithm, (16, 17, 5))
    _assert_same_kept_plans(t)


def test_a_plan_kept_on_some_ranks_only_is_named_on_every_rank(monkeypatch):
    """Rank 0 keeps one plan where its peers keep two: the same arguments meet on two paths.

    Its lower ``PLANS_KEPT`` evicts the first plan when the second is kept; the next
    call of the first arguments runs the ordinary way on rank 0 and replays on its
    peers. The records are the same, the signatures are not: every rank says so.
    """
    t = _transport()
    if t.size == 1:
        pytest.skip("one rank takes one path")
    if t.rank == 0:
        monkeypatch.setattr(plans, "PLANS_KEPT", 1)
    _check_sums(t, "ring", (16, 17))
    assert (plans.kept(t, _key("ring", 16)) is None) == (t.rank == 0)
    with pytest.raises(MismatchError, match="same arguments but on different paths"):
        refcoll.allreduce(np.ones(16, np.float32), t, algorithm="ring")


def test_a_stalled_peer_is_a_timeout_naming_the_wait_not_a_hang():
    """The last rank is elsewhere (a receive the others answer only once they gave up).

    Every rank but the last replays its kept plan, signed; its signature exchange
    can never complete without the last rank's, so each gives up at its deadline,
    which counts only from this call (the calls before it wait as long as they need).
    """
    t = _transport()
    _check_sums(t, "auto", (16,))
    if t.size == 1:
        return
    comm = _world()
    comm.Barrier()
    t.timeout = 1.5
    if t.rank == t.size - 1:
        comm.recv(source=0, tag=77)  # until rank 0 has given up; it never calls
        return
    try:
        with pytest.raises(CollectiveTimeout, match="timed out after 1.5 s.*argument agreement"):
            refcoll.allreduce(np.ones(16, np.float32), t, algorithm="auto")
    finally:
        if t.rank == 0:
            comm.send(None, dest=t.size - 1, tag=77)


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("in_place", [True, False], ids=["in place", "out of place"])
def test_the_same_buffers_again_replay_the_kept_plan_into_out(validate, in_place):
    """A loop over one x and one out: from the third call the kept plan runs, reading x afresh."""
    t = _transport()
    x = np.zeros(32, np.float32)
    out = x if in_place else np.empty_like(x)
    for value in range(1, 6):
        x[:] = value * (t.rank + 1)  # new values every call: the replay reads them afresh
        got = refcoll.allreduce(x, t, algorithm="ring", out=out, validate=validate)
        assert got is out
        assert np.array_equal(out, np.full(32, _sum_of(t, value), np.float32))
        if not in_place:
            assert np.array_equal(x, np.full(32, value * (t.rank + 1), np.float32))
    plan = plans.kept(t, _key("ring", 32))
    assert (plan is not None) == (t.size > 1)
    assert plan is None or plan.runs == 3  # calls 3, 4 and 5
    assert len(_kept_plans(t)) == (t.size > 1)
    x2 = np.ones(32, np.float64)  # other buffers, other dtype: the ordinary way, still right
    assert np.array_equal(refcoll.allreduce(x2, t, algorithm="ring", out=np.empty_like(x2),
                                            validate=validate), np.full(32, t.size, np.float64))


@pytest.mark.parametrize("in_place", [True, False], ids=["in place", "out of place"])
def test_a_plan_of_the_same_buffers_runs_on_them(in_place):
    """The named way to all-reduce one x into one out again and again: ``allreduce_init``."""
    t = _transport()
    x = np.zeros(32, np.float32)
    out = x if in_place else np.empty_like(x)
    with refcoll.allreduce_init(x, t, algorithm="ring", out=out) as plan:
        assert plan.x is x and plan.out is out and plan.recorded == (t.size > 1)
        for value in range(1, 4):
            x[:] = value * (t.rank + 1)
            assert plan() is out
            assert np.array_equal(out, np.full(32, _sum_of(t, value), np.float32))
    assert not _kept_plans(t)  # a user's plan is not a kept one


def test_mismatches_past_every_tag_epoch_leave_no_stale_message():
    """Rank 0 replays (its first data sent) while the others call another count, many times over.

    Each failure leaves rank 0's first message unreceived in the slot it left. After
    every reserved slot has been used once, the next ones must still never take it.
    """
    from refcoll.transport.persistent import PERSISTENT_EPOCHS

    t = _transport()
    if t.size == 1:
        return
    for i in range(PERSISTENT_EPOCHS + 3):
        for value in range(1, CALLS_TO_REPLAY + 1):  # each loop keeps the plan again, then replays
            x = np.full(16, (t.rank + 1) * (value + 10 * i), np.float32)
            got = refcoll.allreduce(x, t, algorithm="recursive_doubling")
            assert np.array_equal(got, np.full(16, _sum_of(t, value + 10 * i), np.float32)), i
        plan = plans.kept(t, _key("recursive_doubling", 16))
        assert plan is not None and not plan.freed and plan.runs == CALLS_TO_REPLAY - 2
        count = 16 if t.rank == 0 else 17
        with pytest.raises(MismatchError, match="count"):
            refcoll.allreduce(np.full(count, -1.0, np.float32), t, algorithm="recursive_doubling")
        assert plan.freed and plans.kept(t, _key("recursive_doubling", 16)) is None  # dropped


def test_a_scheduled_call_queued_behind_a_disagreement_still_sums_right():
    """The schedule engine: a call queued behind one that fails still sums right.

    The failure drops every kept plan on every rank, so the queued call finds none
    and runs whole, and the calls after it keep the plan again.
    """
    from refcoll.calls.progress import engine_for

    t = _transport(timeout=60)
    if t.size == 1:
        return
    engine_for(t, "schedule")
    for value in range(1, CALLS_TO_REPLAY + 1):  # whole, whole and kept, then the kept plan's steps
        x = np.full(16, value * (t.rank + 1), np.float32)
        assert np.array_equal(refcoll.iallreduce(x, t).wait(), np.full(16, _sum_of(t, value)))
    plan = plans.kept(t, _key("ring", 16))
    assert plan is not None and plan.runs == 1
    bad = refcoll.iallreduce(np.ones(20 + t.rank, np.float32), t)  # a count no rank shares
    queued = refcoll.iallreduce(np.full(16, 4 * (t.rank + 1), np.float32), t)
    with pytest.raises(MismatchError, match="count"):
        bad.wait()
    assert np.array_equal(queued.wait(), np.full(16, _sum_of(t, 4), np.float32))
    x = np.full(16, 5 * (t.rank + 1), np.float32)
    assert np.array_equal(refcoll.iallreduce(x, t).wait(), np.full(16, _sum_of(t, 5)))
    again = plans.kept(t, _key("ring", 16))  # the queued call and this one: kept anew
    assert plan.freed and again is not None and again is not plan and again.runs == 0
    x = np.full(16, 6 * (t.rank + 1), np.float32)  # replayed: the kept plan's steps
    assert np.array_equal(refcoll.iallreduce(x, t).wait(), np.full(16, _sum_of(t, 6)))
    assert plans.kept(t, _key("ring", 16)) is again and again.runs == 1


def test_one_op_spelled_differently_on_each_rank_takes_one_path():
    """"sum", "SUM" and mpi4py's MPI.SUM are one op: every rank keeps and replays the call alike."""
    from mpi4py import MPI

    t = _transport(timeout=60)
    op = ("sum", "SUM", MPI.SUM)[t.rank % 3]
    out = np.empty(16, np.float32)
    for value in range(1, 5):
        x = np.full(16, value * (t.rank + 1), np.float32)
        assert np.array_equal(refcoll.allreduce(x, t, op=op, algorithm="ring"),
                              np.full(16, _sum_of(t, value), np.float32))
        assert refcoll.allreduce(x, t, op=op, algorithm="ring", out=out) is out
        assert np.array_equal(out, np.full(16, _sum_of(t, value), np.float32))
    plan = plans.kept(t, _key("ring", 16))
    assert (plan is not None) == (t.size > 1)
    assert plan is None or plan.runs == 8 - 2
    _assert_same_kept_plans(t)


def test_out_on_one_rank_only_keeps_every_rank_on_the_same_path(monkeypatch):
    """Rank 0 passes a fresh out= at every call; the others never pass out=.

    A kept plan is keyed by the agreed fields, never by a buffer, so every rank keeps,
    replays and (``PLANS_KEPT`` lowered) evicts the same plans at the same calls, and
    an evicted plan leaves no persistent request behind.
    """
    monkeypatch.setattr(plans, "PLANS_KEPT", 4)
    t = _transport(timeout=60)
    made = []
    for count in range(1, 3 * plans.PLANS_KEPT + 1):
        for value in range(1, CALLS_TO_REPLAY + 1):
            x = np.full(count, (t.rank + 1) * value, np.float32)
            out = np.empty_like(x) if t.rank == 0 else None
            got = refcoll.allreduce(x, t, algorithm="ring", out=out)
            assert out is None or got is out
            assert np.array_equal(got, np.full(count, _sum_of(t, value), np.float32))
        plan = plans.kept(t, _key("ring", count))
        assert (plan is not None) == (t.size > 1)
        made += [plan] if plan is not None else []
        _assert_same_kept_plans(t)
    table = t.cache.get("plans", {}).get("kept", {})
    assert len(table) == (plans.PLANS_KEPT if t.size > 1 else 0)
    assert [p for p in made if not p.freed] == list(table.values())  # the newest; the rest freed
    assert list(plans.live_plans(t).values()) == list(table.values())
    if t.size > 1:  # what holds persistent requests: the kept plans and the signature exchange
        held = sum(1 for p in table.values() for s in p._schedule.steps if hasattr(s, "_sent"))
        assert len(t._persistent) == held + sum(1 for s in signatures(t).steps
                                                if hasattr(s, "_sent"))


def test_user_plans_never_push_a_kept_plan_out(monkeypatch):
    """Plans made with ``allreduce_init`` are the user's: they count against no kept plan's room."""
    monkeypatch.setattr(plans, "PLANS_KEPT", 2)
    t = _transport(timeout=60)
    _check_sums(t, "ring", (16,))
    before = _kept_plans(t)
    mine = [refcoll.allreduce_init(np.ones(n, np.float32), t, algorithm="ring")
            for n in range(1, 3 * plans.PLANS_KEPT + 1)]
    for plan in mine:
        assert np.array_equal(plan(), np.full(plan.x.size, t.size, np.float32))
    assert _kept_plans(t) == before
    for plan in mine:
        plan.free()
    assert _kept_plans(t) == before
    _check_sums(t, "ring", (16,))
    plan = plans.kept(t, _key("ring", 16))
    assert plan is None or plan.runs == 2 * CALLS_TO_REPLAY - 2


def test_an_out_whose_dtype_changed_is_checked_again_not_replayed_into():
    """``out.dtype = ...`` after the plan was kept: the call is checked in full, on every rank."""
    t = _transport(timeout=60)
    x, out = np.ones(16, np.float32), np.empty(16, np.float32)
    for _ in range(CALLS_TO_REPLAY):
        refcoll.allreduce(x, t, algorithm="auto", out=out)
    out.dtype = np.int32
    with pytest.raises(TypeError, match="out= has dtype int32"):
        refcoll.allreduce(x, t, algorithm="auto", out=out)
    out.dtype = np.float32
    x.shape = (4, 4)  # the same count: still the kept plan, still right
    got = refcoll.allreduce(x, t, algorithm="auto", out=out)
    assert got is out and np.array_equal(out, np.full(16, t.size, np.float32))
    _assert_same_kept_plans(t)


def test_an_out_whose_dtype_changed_on_one_rank_is_named_on_every_rank():
    """The last rank's out= changed dtype: TypeError there, its reason on every other rank."""
    t = _transport(timeout=60)
    last = t.size - 1
    x, out = np.ones(16, np.float32), np.empty(16, np.float32)
    for _ in range(CALLS_TO_REPLAY):
        refcoll.allreduce(x, t, algorithm="auto", out=out)
    if t.rank == last:
        out.dtype = np.int32
        with pytest.raises(TypeError, match="out= has dtype int32"):
            refcoll.allreduce(x, t, algorithm="auto", out=out)
        out.dtype = np.float32
    else:
        with pytest.raises(UsageError, match=f"rank {last} could not run allreduce: TypeError: "
                                             "rank .*out= has dtype int32"):
            refcoll.allreduce(x, t, algorithm="auto", out=out)
    for _ in range(CALLS_TO_REPLAY):
        got = refcoll.allreduce(x, t, algorithm="auto", out=out)
        assert got is out and np.array_equal(out, np.full(16, t.size, np.float32))
    _assert_same_kept_plans(t)


def test_a_plan_whose_out_changed_dtype_is_refused_on_every_rank():
    """``out.dtype = ...`` on the last rank after ``allreduce_init``: refused in that very run.

    UsageError on the rank at fault, which revokes the transport; its peers, waiting
    for its data, raise PeerFailure naming it and the reason (no deadline reached).
    """
    t = _transport(timeout=60)
    last = t.size - 1
    x, out = np.ones(16, np.float32), np.empty(16, np.float32)
    plan = refcoll.allreduce_init(x, t, algorithm="ring", out=out)
    assert plan() is out and np.array_equal(out, np.full(16, t.size, np.float32))
    reason = (f"rank {last}: out of this allreduce plan changed from shape (16,) float32 to "
              "shape (16,) int32")
    if t.rank == last:
        out.dtype = np.int32
        with pytest.raises(UsageError, match=re.escape(reason)):
            plan()
        out.dtype = np.float32
    else:
        with pytest.raises(PeerFailure) as failure:
            plan()
        assert f"rank {last} revoked the communicator" in str(failure.value)
        assert reason in str(failure.value)
    assert t.revoked is not None or t.size == 1


@pytest.mark.parametrize("elsewhere", ["broadcast", "allgather", "allreduce17", "kept17"])
def test_a_kept_plan_against_another_call_is_named_on_every_rank(elsewhere):
    """Rank 0 replays its kept plan into out=; the others make another validated call."""
    t = _transport(timeout=60)
    x, out = np.ones(16, np.float32), np.empty(16, np.float32)
    y = np.ones(17, np.float32)
    for _ in range(CALLS_TO_REPLAY):
        refcoll.allreduce(x, t, algorithm="auto", out=out)
        if elsewhere == "kept17":
            refcoll.allreduce(y, t, algorithm="auto")
    if t.size == 1:
        return
    with pytest.raises(MismatchError, match="rank 0 has|rank 1 has"):
        if t.rank == 0:
            refcoll.allreduce(x, t, algorithm="auto", out=out)
        elif elsewhere == "broadcast":
            refcoll.broadcast(x, 0, t)
        elif elsewhere == "allgather":
            refcoll.allgather(x, t)
        else:
            refcoll.allreduce(y, t, algorithm="auto")
    for value in range(1, CALLS_TO_REPLAY + 2):  # the kept plan again (or the ordinary way)
        x[:] = value * (t.rank + 1)
        assert np.array_equal(refcoll.allreduce(x, t, algorithm="auto", out=out),
                              np.full(16, _sum_of(t, value), np.float32))
    _assert_same_kept_plans(t)


def test_kept_plans_queued_behind_the_progress_thread_sum_right():
    """Blocking calls that replay kept plans, issued while iallreduces run, queue behind them."""
    from refcoll.calls.progress import engine_for

    t = _transport(timeout=60)
    if not t.thread_multiple:
        pytest.skip("the progress thread needs MPI_THREAD_MULTIPLE")
    engine_for(t, "thread")
    x, out = np.zeros(16, np.float32), np.empty(16, np.float32)
    for value in range(1, 6):
        y = np.full(1000, value * (t.rank + 1), np.float64)
        h = refcoll.iallreduce(y, t)
        x[:] = value * (t.rank + 1)
        assert refcoll.allreduce(x, t, algorithm="auto", out=out, op="avg") is out
        assert np.array_equal(out, np.full(16, _sum_of(t, value) / t.size, np.float32))
        assert np.array_equal(h.wait(), np.full(1000, _sum_of(t, value)))
    plan = plans.kept(t, _key("auto", 16, op="avg"))
    assert (plan is not None) == _replays(t, "auto", 16)
    assert plan is None or plan.runs == 3


def test_a_freed_persistent_exchange_refuses_to_run():
    """Run after free, an exchange with no requests would "complete" having moved nothing."""
    from refcoll.core.errors import RefcollError

    t = _transport()
    if t.size == 1:
        return
    buf = np.zeros(4, np.uint8)
    exchange = t.persistent([(buf, (t.rank + 1) % t.size, 0)], [(buf, (t.rank - 1) % t.size, 0)])
    exchange.free()
    for run in (exchange, exchange.start):
        with pytest.raises(RefcollError, match="freed persistent exchange"):
            run()


def test_a_scheduled_iallreduce_meets_a_blocking_call_in_the_same_signature_exchange():
    """The schedule engine steps through the blocking calls' signatures: one MismatchError."""
    from refcoll.calls.progress import engine_for

    t = _transport()
    engine_for(t, "schedule")
    for _ in range(CALLS_TO_REPLAY + 1):  # whole, whole and kept, then the kept plan's steps
        assert refcoll.iallreduce(np.ones(16, np.float32), t).wait()[0] == t.size
    plan = plans.kept(t, _key("ring", 16))
    assert (plan is not None) == (t.size > 1)
    assert plan is None or plan.runs == 2
    if t.size > 1:
        with pytest.raises(MismatchError, match=r"count: rank 0 has 16, rank \d+ has 17"):
            if t.rank == t.size - 1:
                refcoll.allreduce(np.ones(17, np.float32), t)
            else:
                refcoll.iallreduce(np.ones(16, np.float32), t).wait()
    for _ in range(2):
        assert refcoll.iallreduce(np.ones(16, np.float32), t).wait()[0] == t.size
        assert refcoll.allreduce(np.ones(17, np.float32), t)[0] == t.size
    _assert_same_kept_plans(t)
