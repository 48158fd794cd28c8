"""The argument agreement carried beside the data of prepared all-reduces (run by test_mpi.py).

A validated all-reduce that ran before replays its plan with the signature
exchange started beside its first data exchange (refcoll/calls/prepared.py).
These tests make the ranks disagree in every way the two paths can meet: both
ranks prepared (different plans), one prepared and one not (its count never ran),
a peer that stalls, a bound call against another collective, and they check that
every rank names the difference, that nothing hangs, and that the communicator
still gives the right sums afterwards: after more failures than there are
reserved tag slots, with a non-blocking call queued behind the failure, with an
op spelled differently per rank, and with buffers bound on one rank only.
"""

import numpy as np
import pytest

import refcoll
from refcoll.calls.agree import signatures
from refcoll.core.errors import CollectiveTimeout, MismatchError

pytestmark = pytest.mark.mpi

ALGORITHMS = ("auto", "ring", "recursive_doubling", "rabenseifner", "tree")


def _transport(timeout=None):
    from mpi4py import MPI

    from refcoll.transport.mpi import MPITransport

    return MPITransport(MPI.COMM_WORLD, timeout=timeout)


def _check_sums(t, algorithm, counts):
    """Every count sums right on every rank, twice (the second from its plan)."""
    for n in counts:
        for _ in range(2):
            x = np.full(n, t.rank + 1, np.float32)
            got = refcoll.allreduce(x, t, algorithm=algorithm)
            assert np.array_equal(got, np.full(n, t.size * (t.size + 1) / 2, np.float32))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_prepared_call_runs_its_agreement_beside_its_data(algorithm):
    t = _transport()
    _check_sums(t, algorithm, (16,))
    if t.size > 1:
        key = next(k for k in t.cache["prepared"] if k[0] == algorithm and k[3] == 16)
        assert t.cache["prepared"][key].signed()  # the second call ran signed
        sent = t.traffic.messages_sent
        refcoll.allreduce(np.ones(16, np.float32), t, algorithm=algorithm)
        plan_messages = sum(1 for s in t.cache["prepared"][key].plan.schedule.steps
                            if getattr(s, "_sent", -1) >= 0)
        signature_messages = sum(1 for s in signatures(t).steps if s._sent >= 0)
        # No record exchange beyond the signatures: the plan's messages and theirs.
        assert t.traffic.messages_sent - sent == plan_messages + signature_messages


@pytest.mark.parametrize("prepared_elsewhere", [True, False])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_bad_count_is_named_on_every_rank(algorithm, prepared_elsewhere):
    """The last rank passes 17 where the others pass 16: both plans exist, or only 16's."""
    t = _transport()
    _check_sums(t, algorithm, (16, 17) if prepared_elsewhere else (16,))
    count = 16 + (t.rank == t.size - 1 and t.size > 1)
    if t.size > 1:
        with pytest.raises(MismatchError, match=r"count: rank 0 has 16, rank \d+ has 17"):
            refcoll.allreduce(np.ones(count, np.float32), t, algorithm=algorithm)
    # Every rank left its plans; the next calls record new ones and sum right.
    assert not t.cache.get("prepared")
    _check_sums(t, algorithm, (16, 17, 5))


def test_a_bad_dtype_of_the_same_size_is_named_on_every_rank():
    t = _transport()
    _check_sums(t, "auto", (8,))
    x = np.ones(8, np.int32 if t.rank == t.size - 1 else np.float32)
    if t.size > 1:
        with pytest.raises(MismatchError, match=r"dtype: rank 0 has float32, rank \d+ has int32"):
            refcoll.allreduce(x, t, algorithm="auto")
    _check_sums(t, "auto", (8,))


def test_a_stalled_peer_is_a_timeout_naming_the_wait_not_a_hang():
    """The last rank is elsewhere (a barrier the others never join) while they all-reduce."""
    from mpi4py import MPI

    t = _transport(timeout=1.5)
    _check_sums(t, "auto", (16,))
    if t.size == 1:
        return
    comm = MPI.COMM_WORLD
    if t.rank == t.size - 1:
        comm.recv(source=0, tag=77)  # stalled until rank 0 has given up; it never calls
    else:
        with pytest.raises(CollectiveTimeout, match="timed out after 1.5 s.*argument agreement"):
            refcoll.allreduce(np.ones(16, np.float32), t, algorithm="auto")
        if t.rank == 0:
            comm.send(None, dest=t.size - 1, tag=77)
    comm.Barrier()


def _bound(t):
    return [k for k, v in t.cache.get("prepared", {}).items() if k[0] == "bound" and v.schedule]


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("in_place", [True, False])
def test_the_same_buffers_again_replay_on_those_buffers(validate, in_place):
    """A loop over one x and one out: from the third call the schedule runs on them, no copies."""
    t = _transport()
    x = np.zeros(32, np.float32)
    out = x if in_place else np.empty_like(x)
    for value in range(1, 6):
        x[:] = value * (t.rank + 1)  # new values every call: the replay reads them afresh
        got = refcoll.allreduce(x, t, algorithm="auto", out=out, validate=validate)
        assert got is out
        assert np.array_equal(out, np.full(32, value * t.size * (t.size + 1) / 2, np.float32))
    assert len(_bound(t)) == (t.size > 1)
    x2 = np.ones(32, np.float64)  # other buffers, other dtype: the ordinary way, still right
    assert np.array_equal(refcoll.allreduce(x2, t, algorithm="auto", out=np.empty_like(x2),
                                            validate=validate), np.full(32, t.size, np.float64))


def test_a_mismatch_met_on_bound_buffers_is_named_on_every_rank():
    t = _transport()
    x, out = np.ones(16, np.float32), np.empty(16, np.float32)
    for _ in range(3):
        refcoll.allreduce(x, t, algorithm="auto", out=out, op="avg")
    if t.size > 1:
        assert _bound(t)
        op = "max" if t.rank == t.size - 1 else "avg"
        with pytest.raises(MismatchError, match="op: rank 0 has avg"):
            refcoll.allreduce(x, t, algorithm="auto", out=out, op=op)
        assert not _bound(t)
    for _ in range(3):
        assert np.array_equal(refcoll.allreduce(x, t, algorithm="auto", out=out, op="avg"), x)


def _sum_of(t, value):
    return value * t.size * (t.size + 1) / 2


def test_mismatches_past_every_tag_epoch_leave_no_stale_message():
    """Rank 0 replays (its first data sent) while the others call another count, many times over.

    Each failure leaves rank 0's first message unreceived in the slot it left. After
    every reserved slot has been used once, the next ones must still never take it.
    """
    from refcoll.transport.mpi import PERSISTENT_EPOCHS

    t = _transport(timeout=20)
    if t.size == 1:
        return
    for i in range(PERSISTENT_EPOCHS + 3):
        for value in (1, 2):  # the first records the plan, the second replays it, signed
            x = np.full(16, (t.rank + 1) * (value + 10 * i), np.float32)
            got = refcoll.allreduce(x, t, algorithm="recursive_doubling")
            assert np.array_equal(got, np.full(16, _sum_of(t, value + 10 * i), np.float32)), i
        count = 16 if t.rank == 0 else 17
        with pytest.raises(MismatchError, match="count"):
            refcoll.allreduce(np.full(count, -1.0, np.float32), t, algorithm="recursive_doubling")


def test_a_scheduled_call_queued_behind_a_disagreement_still_sums_right():
    """The schedule engine: a call queued behind one that fails keeps a plan that still works."""
    from refcoll.calls.progress import engine_for

    t = _transport(timeout=20)
    if t.size == 1:
        return
    engine_for(t, "schedule")
    for value in (1, 2):  # the first runs whole, the second from the engine's plan
        x = np.full(16, value * (t.rank + 1), np.float32)
        assert np.array_equal(refcoll.iallreduce(x, t).wait(), np.full(16, _sum_of(t, value)))
    bad = refcoll.iallreduce(np.ones(20 + t.rank, np.float32), t)  # a count no rank shares
    queued = refcoll.iallreduce(np.full(16, 3 * (t.rank + 1), np.float32), t)
    with pytest.raises(MismatchError, match="count"):
        bad.wait()
    assert np.array_equal(queued.wait(), np.full(16, _sum_of(t, 3), np.float32))
    x = np.full(16, 4 * (t.rank + 1), np.float32)
    assert np.array_equal(refcoll.iallreduce(x, t).wait(), np.full(16, _sum_of(t, 4)))


def test_one_op_spelled_differently_on_each_rank_takes_one_path():
    """"sum", "SUM" and mpi4py's MPI.SUM are one op: every rank prepares the call alike."""
    from mpi4py import MPI

    t = _transport(timeout=20)
    op = ("sum", "SUM", MPI.SUM)[t.rank % 3]
    out = np.empty(16, np.float32)
    for value in range(1, 5):
        x = np.full(16, value * (t.rank + 1), np.float32)
        assert np.array_equal(refcoll.allreduce(x, t, op=op, algorithm="ring"),
                              np.full(16, _sum_of(t, value), np.float32))
        refcoll.allreduce(x, t, op=op, algorithm="ring", out=out)
        assert np.array_equal(out, np.full(16, _sum_of(t, value), np.float32))


def test_binding_on_one_rank_only_keeps_every_rank_on_the_same_path():
    """Rank 0 gives fresh buffers with out= (each is bound); the others never pass out=.

    Bound buffers must not push the prepared call out of rank 0's cache while the
    others keep theirs: the ranks would replay on one side and not on the other.
    """
    from refcoll.calls.prepared import PREPARED_KEPT

    t = _transport(timeout=20)
    for i in range(PREPARED_KEPT + 8):
        x = np.full(8, (t.rank + 1) * i, np.float32)
        expected = np.full(8, _sum_of(t, i), np.float32)
        if t.rank == 0:
            out = np.empty_like(x)
            for _ in range(2):  # the second call binds x and out
                assert np.array_equal(refcoll.allreduce(x, t, algorithm="ring", out=out), expected)
        else:
            for _ in range(2):
                assert np.array_equal(refcoll.allreduce(x, t, algorithm="ring"), expected)


def test_a_bound_out_whose_dtype_changed_is_refused_on_every_rank():
    """``out.dtype = ...`` after binding: the call is checked again, not replayed into it."""
    t = _transport(timeout=20)
    x, out = np.ones(16, np.float32), np.empty(16, np.float32)
    for _ in range(3):
        refcoll.allreduce(x, t, algorithm="auto", out=out)
    out.dtype = np.int32
    with pytest.raises(TypeError, match="out= has dtype int32"):
        refcoll.allreduce(x, t, algorithm="auto", out=out)
    out.dtype = np.float32
    x.shape = (4, 4)  # the same memory and count: still the bound call, still right
    got = refcoll.allreduce(x, t, algorithm="auto", out=out)
    assert got is out and np.array_equal(out, np.full(16, t.size, np.float32))


@pytest.mark.parametrize("elsewhere", ["broadcast", "allgather", "allreduce17", "prepared17"])
def test_a_bound_call_against_another_call_is_named_on_every_rank(elsewhere):
    """Rank 0 replays on bound buffers; the others make another validated call."""
    t = _transport(timeout=20)
    x, out = np.ones(16, np.float32), np.empty(16, np.float32)
    y = np.ones(17, np.float32)
    for _ in range(3):
        refcoll.allreduce(x, t, algorithm="auto", out=out)
        if elsewhere == "prepared17":
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
    for value in (1, 2, 3):  # ordinary, prepared, bound again: all right
        x[:] = value * (t.rank + 1)
        assert np.array_equal(refcoll.allreduce(x, t, algorithm="auto", out=out),
                              np.full(16, _sum_of(t, value), np.float32))


def test_bound_calls_queued_behind_the_progress_thread_sum_right():
    """Blocking calls on bound buffers issued while iallreduces run queue behind them."""
    from refcoll.calls.progress import engine_for

    t = _transport(timeout=20)
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
    for _ in range(3):  # the first runs whole, the later ones from the engine's recording
        assert refcoll.iallreduce(np.ones(16, np.float32), t).wait()[0] == t.size
    if t.size > 1:
        with pytest.raises(MismatchError, match=r"count: rank 0 has 16, rank \d+ has 17"):
            if t.rank == t.size - 1:
                refcoll.allreduce(np.ones(17, np.float32), t)
            else:
                refcoll.iallreduce(np.ones(16, np.float32), t).wait()
    for _ in range(2):
        assert refcoll.iallreduce(np.ones(16, np.float32), t).wait()[0] == t.size
        assert refcoll.allreduce(np.ones(17, np.float32), t)[0] == t.size
