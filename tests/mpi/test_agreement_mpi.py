"""The argument agreement of repeated blocking calls, where ranks disagree (run by test_mpi.py).

A blocking all-reduce keeps nothing between calls (refcoll/calls/collectives.py):
every validated call exchanges its signature with the transport's ``sendrecv``
before any data moves. These tests make the ranks disagree after runs of
identical calls (the last rank's arguments or the others' ran before), with a
peer that stalls, against another collective, and check that every rank names
the difference, that nothing hangs, and that the communicator still gives the
right sums afterwards: after many failures, with a non-blocking call queued
behind the failure, with an op spelled differently per rank and with ``out=``
given on one rank only. A persistent collective (``allreduce_init``) whose
buffer changed on one rank is refused there and its peers learn it in that
very run.
"""

import re

import numpy as np
import pytest

import refcoll
from refcoll.core.errors import (
    CollectiveTimeout,
    MismatchError,
    PeerFailure,
    RefcollError,
    UsageError,
)

pytestmark = pytest.mark.mpi

ALGORITHMS = ("auto", "ring", "recursive_doubling", "rabenseifner", "tree")

#: Identical calls made before the ranks disagree, as a training loop makes them.
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


def _sum_of(t, value):
    return value * t.size * (t.size + 1) / 2


def _check_sums(t, algorithm, counts):
    """Every count sums right on every rank, three times; the transport keeps nothing."""
    for n in counts:
        for value in range(1, CALLS_TO_REPLAY + 1):
            x = np.full(n, value * (t.rank + 1), np.float32)
            got = refcoll.allreduce(x, t, algorithm=algorithm)
            assert np.array_equal(got, np.full(n, _sum_of(t, value), np.float32)), (n, value)
    _assert_keeps_nothing(t)


def _assert_keeps_nothing(t):
    """The transport holds no plan of a blocking call: nothing is kept for the next call."""
    held = t.cache.get("plans", {})
    assert not (set(held) - {"live"}) and not held.get("live"), held


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


@pytest.mark.parametrize("ran", ["both", "others", "last"], ids=lambda v: f"{v} ran")
@pytest.mark.parametrize("field,algorithm", CASES, ids=lambda v: str(v))
def test_a_bad_argument_is_named_on_every_rank(field, algorithm, ran):
    """The last rank passes another count, dtype or op; whose arguments ran before varies.

    ``both``: either arguments ran three times before; ``others``: the last rank's
    arguments never ran; ``last``: the other way round. The op case passes ``out=``.
    """
    t = _transport()
    last, others, message = DIFFERENCES[field]
    out = field == "op"
    defaults = dict(count=16, dtype=np.float32, op="sum")
    mine = dict(defaults, **(last if t.rank == t.size - 1 and t.size > 1 else others))
    warm = {"both": [others, last], "others": [others], "last": [last]}[ran]
    for arguments in warm:
        for value in range(1, CALLS_TO_REPLAY + 1):
            _call(t, algorithm, **dict(defaults, **arguments), out=out, value=value)
    if t.size > 1:
        with pytest.raises(MismatchError, match=message):
            _call(t, algorithm, **mine, out=out)
    _assert_keeps_nothing(t)
    for arguments in (others, last):
        for value in range(1, CALLS_TO_REPLAY + 1):
            got = _call(t, algorithm, **dict(defaults, **arguments), out=out, value=value)
            want = _expected(t, dict(defaults, **arguments)["op"], value)
            assert np.array_equal(got, np.full_like(got, want)), (arguments, value)
    _check_sums(t, algorithm, (16, 17, 5))


def test_a_stalled_peer_is_a_timeout_naming_the_wait_not_a_hang():
    """The last rank is elsewhere (a receive the others answer only once they gave up).

    Every rank but the last sends its signature; the exchange can never complete
    without the last rank's, so each gives up at its deadline, which counts only
    from this call (the calls before it wait as long as they need).
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
        # Each rank gives up at its own deadline; one that reached the call later (a busy
        # machine) may first read the revocation of a rank that gave up before it, which
        # names that rank's timeout: a PeerFailure, in that very call, never a hang.
        with pytest.raises((CollectiveTimeout, PeerFailure)) as caught:
            refcoll.allreduce(np.ones(16, np.float32), t, algorithm="auto")
        said = str(caught.value)
        if caught.type is CollectiveTimeout:
            assert re.search("timed out after 1.5 s.*argument agreement", said), said
        else:
            assert "revoked the communicator" in said and "timed out after 1.5 s" in said, said
    finally:
        if t.rank == 0:
            comm.send(None, dest=t.size - 1, tag=77)


def test_a_late_peer_meets_a_revoked_call_not_the_next_data_of_one_that_gave_up():
    """Rank 1 stalls in the middle of an all-reduce past the others' deadline. The ranks
    that gave up cancel what they had posted and revoke the transport: rank 1, once it
    comes, raises PeerFailure (it used to complete with the data rank 0 wrote next into
    its buffer), and no late message lands in rank 0's arrays after its timeout."""
    import time

    from refcoll.transport.mpi import MPITransport

    comm = _world()
    if comm.size < 2:
        return
    t = MPITransport(comm, timeout=1.0)  # its own communicator: the world stays usable
    x = np.full(1 << 16, float(t.rank + 1), np.float32)
    refcoll.allreduce(x.copy(), t, algorithm="ring")  # every rank past setup
    if t.rank == 1:
        sendrecv, calls = t.sendrecv, [0]

        def stalled(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 2:  # in the middle of the ring, after its first exchange
                comm.recv(source=0, tag=78)  # until rank 0 has given up and written anew
            return sendrecv(*args, **kwargs)

        t.sendrecv = stalled
    if t.rank == 1:
        with pytest.raises(PeerFailure, match="revoked the communicator: rank .*timed out"):
            refcoll.allreduce(x, t, algorithm="ring", out=x)
    else:
        with pytest.raises((CollectiveTimeout, PeerFailure)):
            refcoll.allreduce(x, t, algorithm="ring", out=x)
        x[:] = 7.0  # this rank's next step, in the buffer the failed call received into
        if t.rank == 0:
            comm.send(None, dest=1, tag=78)
        for _ in range(20):  # the library progresses: nothing of the failed call may land
            comm.Iprobe()
            time.sleep(0.05)
        assert np.all(x == 7.0)
    comm.Barrier()


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("in_place", [True, False], ids=["in place", "out of place"])
def test_the_same_buffers_again_give_fresh_sums_into_out(validate, in_place):
    """A loop over one x and one out: every call reads x afresh and keeps nothing."""
    t = _transport()
    x = np.zeros(32, np.float32)
    out = x if in_place else np.empty_like(x)
    for value in range(1, 6):
        x[:] = value * (t.rank + 1)  # new values every call
        got = refcoll.allreduce(x, t, algorithm="ring", out=out, validate=validate)
        assert got is out
        assert np.array_equal(out, np.full(32, _sum_of(t, value), np.float32))
        if not in_place:
            assert np.array_equal(x, np.full(32, value * (t.rank + 1), np.float32))
    _assert_keeps_nothing(t)
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
    _assert_keeps_nothing(t)  # a freed plan leaves nothing


def test_many_mismatches_leave_no_stale_message():
    """Rank 0 calls one count while the others call another, many times over.

    A failed agreement sends only signatures, every one received: the calls after
    each failure still sum right.
    """
    t = _transport()
    if t.size == 1:
        return
    for i in range(19):
        for value in range(1, CALLS_TO_REPLAY + 1):
            x = np.full(16, (t.rank + 1) * (value + 10 * i), np.float32)
            got = refcoll.allreduce(x, t, algorithm="recursive_doubling")
            assert np.array_equal(got, np.full(16, _sum_of(t, value + 10 * i), np.float32)), i
        count = 16 if t.rank == 0 else 17
        with pytest.raises(MismatchError, match="count"):
            refcoll.allreduce(np.full(count, -1.0, np.float32), t, algorithm="recursive_doubling")
    _assert_keeps_nothing(t)


def test_a_scheduled_call_queued_behind_a_disagreement_still_sums_right():
    """The schedule engine: a call queued behind one that fails still sums right.

    Each iallreduce runs whole, as the blocking call, when the engine reaches it.
    """
    from refcoll.calls.progress import engine_for

    t = _transport(timeout=60)
    if t.size == 1:
        return
    engine_for(t, "schedule")
    for value in range(1, CALLS_TO_REPLAY + 1):
        x = np.full(16, value * (t.rank + 1), np.float32)
        assert np.array_equal(refcoll.iallreduce(x, t).wait(), np.full(16, _sum_of(t, value)))
    bad = refcoll.iallreduce(np.ones(20 + t.rank, np.float32), t)  # a count no rank shares
    queued = refcoll.iallreduce(np.full(16, 4 * (t.rank + 1), np.float32), t)
    with pytest.raises(MismatchError, match="count"):
        bad.wait()
    assert np.array_equal(queued.wait(), np.full(16, _sum_of(t, 4), np.float32))
    x = np.full(16, 5 * (t.rank + 1), np.float32)
    assert np.array_equal(refcoll.iallreduce(x, t).wait(), np.full(16, _sum_of(t, 5)))
    _assert_keeps_nothing(t)


def test_one_op_spelled_differently_on_each_rank_takes_one_path():
    """"sum", "SUM" and mpi4py's MPI.SUM are one op: the ranks agree on it."""
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
    _assert_keeps_nothing(t)


def test_an_option_as_a_numpy_integer_on_some_ranks_is_the_same_option():
    """``radix=np.int64(3)`` on some ranks and ``radix=3`` on the others is one call, with the
    bits of the plain one (a tree's and recursive multiplying's radix alike)."""
    t = _transport(timeout=60)
    x = np.arange(1, 41, dtype=np.float32) * (t.rank + 1)
    for algorithm in ("tree", "recursive_doubling"):
        plain = refcoll.allreduce(x, t, algorithm=algorithm, radix=3)
        radix = (3, np.int64(3), np.int32(3))[t.rank % 3]
        assert np.array_equal(refcoll.allreduce(x, t, algorithm=algorithm, radix=radix), plain)
    _assert_keeps_nothing(t)


def test_an_equal_option_of_another_type_after_the_same_call_is_a_mismatch():
    """``segment=2.0`` on one rank, after a call with ``segment=2`` everywhere: equal as keys
    of a dict, so the first call's signature was taken for it (that rank then refused 2.0
    alone and the others waited to the deadline); a MismatchError on every rank now."""
    t = _transport(timeout=60)
    x = np.arange(8, dtype=np.float32)
    refcoll.allreduce(x, t, algorithm="tree", segment=2)
    for odd in (2.0, True):
        with pytest.raises(MismatchError, match=re.escape(f"('segment', {odd!r})")):
            refcoll.allreduce(x, t, algorithm="tree", segment=odd if t.rank == 1 else 2)
    _assert_keeps_nothing(t)


def test_out_on_one_rank_only_keeps_every_rank_on_the_same_path():
    """Rank 0 passes a fresh out= at every call; the others never pass out=: one agreement."""
    t = _transport(timeout=60)
    for count in range(1, 13):
        for value in range(1, CALLS_TO_REPLAY + 1):
            x = np.full(count, (t.rank + 1) * value, np.float32)
            out = np.empty_like(x) if t.rank == 0 else None
            got = refcoll.allreduce(x, t, algorithm="ring", out=out)
            assert out is None or got is out
            assert np.array_equal(got, np.full(count, _sum_of(t, value), np.float32))
    _assert_keeps_nothing(t)
    assert not len(t._persistent)  # no plan, no signature exchange: no persistent request


def test_an_out_whose_dtype_changed_is_checked_again():
    """``out.dtype = ...`` after identical calls: the call is checked in full, on every rank."""
    t = _transport(timeout=60)
    x, out = np.ones(16, np.float32), np.empty(16, np.float32)
    for _ in range(CALLS_TO_REPLAY):
        refcoll.allreduce(x, t, algorithm="auto", out=out)
    out.dtype = np.int32
    with pytest.raises(TypeError, match="out= has dtype int32"):
        refcoll.allreduce(x, t, algorithm="auto", out=out)
    out.dtype = np.float32
    x.shape = (4, 4)  # the same count, another shape: still right
    got = refcoll.allreduce(x, t, algorithm="auto", out=out)
    assert got is out and np.array_equal(out, np.full(16, t.size, np.float32))
    _assert_keeps_nothing(t)


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
    _assert_keeps_nothing(t)


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


@pytest.mark.parametrize("elsewhere", ["broadcast", "allgather", "allreduce17", "repeated17"])
def test_a_repeated_call_against_another_call_is_named_on_every_rank(elsewhere):
    """Rank 0 repeats its call into out=; the others make another validated call."""
    t = _transport(timeout=60)
    x, out = np.ones(16, np.float32), np.empty(16, np.float32)
    y = np.ones(17, np.float32)
    for _ in range(CALLS_TO_REPLAY):
        refcoll.allreduce(x, t, algorithm="auto", out=out)
        if elsewhere == "repeated17":
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
    for value in range(1, CALLS_TO_REPLAY + 2):
        x[:] = value * (t.rank + 1)
        assert np.array_equal(refcoll.allreduce(x, t, algorithm="auto", out=out),
                              np.full(16, _sum_of(t, value), np.float32))
    _assert_keeps_nothing(t)


def test_blocking_calls_queued_behind_the_progress_thread_sum_right():
    """Blocking calls issued while iallreduces run queue behind them, and sum right."""
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
    _assert_keeps_nothing(t)


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
    """The schedule engine runs an iallreduce whole, agreement first: one MismatchError."""
    from refcoll.calls.progress import engine_for

    t = _transport()
    engine_for(t, "schedule")
    for _ in range(CALLS_TO_REPLAY + 1):
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
    _assert_keeps_nothing(t)


def test_none_on_one_rank_is_named_on_every_rank_and_the_next_call_is_right():
    t = _transport()
    last = t.size - 1
    x = None if (t.rank == last and t.size > 1) else np.full(4, 10.0)
    if t.size > 1:
        with pytest.raises(UsageError, match=f"rank {last}: the input is None"):
            refcoll.allreduce(x, t)
    assert refcoll.allreduce(np.full(4, 1.0), t)[0] == t.size  # no call is off by one


def test_a_plan_on_memory_it_would_copy_is_refused_on_every_rank():
    t = _transport()
    last = t.size - 1
    big = np.zeros(8)
    x = big[::2] if (t.rank == last and t.size > 1) else np.zeros(4)
    if t.size > 1:
        with pytest.raises(ValueError, match="not C-contiguous"):
            refcoll.allreduce_init(x, t)
    plan = refcoll.allreduce_init(np.ones(4), t)
    assert plan()[0] == t.size
    a = np.ones((2, 2))
    in_place = refcoll.allreduce_init(a, t, out=a)
    with pytest.raises(UsageError, match="C-contiguous x"):
        in_place.rebind(np.asfortranarray(np.ones((2, 2))))  # a copy would be reduced
    apart = refcoll.allreduce_init(np.ones(8), t, out=np.empty(8))
    buf = np.ones(12)
    with pytest.raises(ValueError, match="overlap"):
        apart.rebind(buf[:8], out=buf[4:12])
    assert apart()[0] == t.size  # the plan kept its buffers


def test_a_message_longer_than_the_buffer_is_named_not_an_mpi_exception():
    from mpi4py import MPI

    from refcoll.transport.mpi import MPITransport

    world = _world()
    pair = world.Split(0 if world.rank < 2 else MPI.UNDEFINED, world.rank)
    if pair == MPI.COMM_NULL or pair.Get_size() < 2:
        return  # one sendrecv between two ranks: each sees the other's size at once
    t = MPITransport(pair, timeout=60)
    count = 999 if t.rank == 1 else 1000
    # validate=False: no agreement, so the sizes meet only in the transfer
    with pytest.raises(RefcollError, match=r"longer than the buffer|expected 8000 B"):
        refcoll.allreduce(np.ones(count), t, algorithm="recursive_doubling", validate=False)


def test_a_compressed_all_reduce_of_other_shapes_is_a_mismatch_on_every_rank():
    from refcoll.compressors import parse

    t = _transport()
    if t.size < 2:
        return
    comp = parse("powersgd:rank=2")  # its factors depend on the matrix's shape
    shape = (6, 4) if t.rank == t.size - 1 else (4, 6)
    with pytest.raises(MismatchError, match="shape"):
        refcoll.compressed_allreduce(np.ones(shape, np.float32), t, compressor=comp,
                                     state=comp.new_state(seed=1, rank=t.rank))
    assert refcoll.allreduce(np.ones(3), t)[0] == t.size


def test_a_freed_communicator_is_a_usage_error_not_mpis_invalid_communicator():
    from mpi4py import MPI

    from refcoll.core.errors import UsageError

    dup = MPI.COMM_WORLD.Dup()
    dup.Free()  # the handle is COMM_NULL now
    with pytest.raises(UsageError, match="the communicator is MPI.COMM_NULL: freed"):
        refcoll.allreduce(np.ones(4, np.float32), dup)
