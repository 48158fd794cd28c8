"""The argument agreement carried beside the data of prepared all-reduces (run by test_mpi.py).

A validated all-reduce that ran before replays its plan with the signature
exchange started beside its first data exchange (refcoll/calls/prepared.py).
These tests make the ranks disagree in every way the two paths can meet: both
ranks prepared (different plans), one prepared and one not (its count never ran),
a peer that stalls, and they check that every rank names the difference, that
nothing hangs, and that the communicator still gives the right sums afterwards.
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
        with pytest.raises(CollectiveTimeout, match="timed out after 1.5 s"):
            refcoll.allreduce(np.ones(16, np.float32), t, algorithm="auto")
        if t.rank == 0:
            comm.send(None, dest=t.size - 1, tag=77)
    comm.Barrier()


def _bound(t):
    return [k for k in t.cache.get("prepared", {}) if k[0] == "bound"]


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
