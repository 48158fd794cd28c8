import time

import numpy as np
import pytest

from refcoll.core.errors import CollectiveTimeout, DeadlockError, RefcollError
from refcoll.core.ops import get_op
from refcoll.transport import SimWorld


def test_bytes_move_and_the_ledger_records_them():
    def body(t):
        buf = np.full(3, t.rank, dtype=np.float64)
        got = np.empty(3)
        left, right = (t.rank - 1) % t.size, (t.rank + 1) % t.size
        t.sendrecv(buf, right, got, left)
        return got

    world = SimWorld(4)
    out = world.run(body)
    assert [o[0] for o in out] == [3, 0, 1, 2]
    assert world.ledger.total_messages == 4
    assert world.ledger.total_bytes == 4 * 24
    assert {m.step for m in world.ledger.messages} == {1}, "one ring step is one round"


def test_steps_follow_the_critical_path():
    def chain(t):
        token = np.zeros(1, dtype=np.int64)
        if t.rank > 0:
            t.recv(token, t.rank - 1)
        if t.rank < t.size - 1:
            t.send(token + 1, t.rank + 1)
        return int(token[0])

    world = SimWorld(4)
    assert world.run(chain) == [0, 1, 2, 3]
    assert sorted(m.step for m in world.ledger.messages) == [1, 2, 3]
    assert world.ledger.rounds == 3
    assert world.ledger.critical_bytes == 3 * 8


def test_two_blocking_sends_deadlock_and_the_cycle_is_named():
    def head_on(t):
        peer = 1 - t.rank
        t.send(np.zeros(4), peer)  # rendezvous: neither send can complete
        t.recv(np.zeros(4), peer)

    with pytest.raises(DeadlockError, match=r"cycle (0 -> 1 -> 0|1 -> 0 -> 1)"):
        SimWorld(2).run(head_on)


def test_waiting_on_a_finished_rank_is_reported():
    def lonely(t):
        if t.rank == 0:
            t.recv(np.zeros(1), 1)

    with pytest.raises(DeadlockError, match="has finished"):
        SimWorld(2).run(lonely)


@pytest.mark.parametrize("p", [2, 3])
def test_a_split_waiting_on_a_finished_rank_is_reported(p):
    # The deadlock detector read every waiting request's communicator, and a split's had
    # none: an AttributeError, where the ranks waiting in the split should be named.
    def alone(t):
        if t.rank:
            t.split(0, 0)

    with pytest.raises(DeadlockError, match=r"rank 1 waits on a split waiting for ranks \[0\] "
                                            r"\(that rank has finished\)"):
        SimWorld(p).run(alone)


def test_size_mismatch_is_an_error_not_a_silent_truncation():
    def mismatch(t):
        if t.rank == 0:
            t.send(np.zeros(5), 1)
        else:
            t.recv(np.zeros(4), 0)

    with pytest.raises(RefcollError, match="size mismatch: rank 0 sent 40 B to rank 1"):
        SimWorld(2).run(mismatch)


def test_a_rank_error_reaches_the_caller_and_releases_the_others():
    def body(t):
        if t.rank == 2:
            raise ValueError("boom on rank 2")
        t.recv(np.zeros(1), 2)

    with pytest.raises(ValueError, match="boom on rank 2"):
        SimWorld(3).run(body)


def test_timeout_names_the_wait():
    def slow(t):
        if t.rank == 0:
            t.send(np.zeros(2), 1)
        else:
            time.sleep(0.5)
            t.recv(np.zeros(2), 0)

    with pytest.raises(CollectiveTimeout, match="send of 16 B to rank 1"):
        SimWorld(2, timeout=0.1).run(slow)


def test_split_groups_by_color_and_orders_by_key():
    def body(t):
        sub = t.split(t.rank % 2, -t.rank)
        none = t.split(-1 if t.rank == 0 else 0, t.rank)
        return sub.size, sub.rank, sub.members, none is None

    out = SimWorld(5).run(body)
    assert out[0] == (3, 2, [4, 2, 0], True)
    assert out[1] == (2, 1, [3, 1], False)
    assert out[4] == (3, 0, [4, 2, 0], False)


def test_split_node_uses_the_worlds_node_shape():
    out = SimWorld(5, ranks_per_node=2).run(lambda t: t.split_node().members)
    assert out == [[0, 1], [0, 1], [2, 3], [2, 3], [4]]


def test_reductions_are_charged_to_the_ledger():
    def body(t):
        a = np.ones(7)
        t.reduce_local(get_op("sum"), a, a, a)
        return a

    world = SimWorld(2)
    assert world.run(body)[0].tolist() == [2.0] * 7
    assert world.ledger.reduced_elements() == {0: 7, 1: 7}


def test_consecutive_calls_use_separate_tag_spaces():
    def body(t):
        seen = []
        for call in range(3):
            with t.call("x"):
                buf = np.array([call]) if t.rank == 0 else np.empty(1, dtype=int)
                if t.rank == 0:
                    t.send(buf, 1)
                else:
                    t.recv(buf, 0)
                    seen.append(int(buf[0]))
        return seen

    world = SimWorld(2)
    assert world.run(body)[1] == [0, 1, 2]
    assert len({m.tag for m in world.ledger.messages}) == 3


def test_buffers_must_be_contiguous():
    def body(t):
        t.send(np.zeros((4, 4))[:, 0], 1 - t.rank)

    with pytest.raises(ValueError, match="C-contiguous"):
        SimWorld(2).run(body)
