"""The pipelined hierarchical all-reduce: segments, their bits, their counts, two threads.

``pipeline=S`` cuts the buffer into ``S`` segments and runs the two-level schedule
on each; under a library with ``MPI_THREAD_MULTIPLE`` the cross-node phase of one
segment overlaps the node phases of the others (the MPI battery runs that path;
the simulator runs the segments one after another).
"""

import threading

import numpy as np
import pytest

import refcoll
from refcoll.algorithms._pipeline import concurrent_phases, run_pipelined
from refcoll.algorithms.hierarchical import hierarchical_allreduce_cost as hierarchical_cost
from refcoll.algorithms.hierarchical import hierarchical_price, hierarchical_traffic, node_traffic
from refcoll.algorithms.registry import NodeShape
from refcoll.core.calibration import Calibration
from refcoll.core.chunking import chunk_bounds
from refcoll.core.errors import UsageError
from refcoll.verify.inputs import make_inputs
from refcoll.verify.oracle import fold

#: (p, ranks_per_node): equal nodes, a smaller last node, one rank a node, one node.
SHAPES = [(8, 4), (7, 3), (6, 2), (5, 1), (4, 4)]


def shape_id(shape):
    return f"p{shape[0]}-k{shape[1]}"


@pytest.mark.parametrize("segments", [2, 3, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_each_segment_is_the_unpipelined_all_reduce_of_that_segment(shape, segments):
    # The spec's order, computed independently: segment s of the pipelined result is,
    # bit for bit, the plain hierarchical all-reduce of segment s of every input.
    p, k = shape
    for n in (0, 5, 1003):
        xs = make_inputs("random", np.dtype(np.float32), n, p, seed=n)
        piped = refcoll.simulate("allreduce", xs, algorithm="hierarchical", ranks_per_node=k,
                                 pipeline=segments)
        for start, stop in chunk_bounds(n, segments):
            alone = refcoll.simulate("allreduce", [x[start:stop] for x in xs],
                                     algorithm="hierarchical", ranks_per_node=k)
            for rank in range(p):
                assert piped.outputs[rank][start:stop].tobytes() == alone.outputs[rank].tobytes(), \
                    (n, start, rank)


def test_segments_change_the_order_and_so_the_bits():
    # Not a relabelling of pipeline=1: the shards (and so each element's order) move.
    xs = make_inputs("random", np.dtype(np.float32), 1 << 12, 8, seed=3)
    one = refcoll.simulate("allreduce", xs, algorithm="hierarchical", ranks_per_node=4)
    four = refcoll.simulate("allreduce", xs, algorithm="hierarchical", ranks_per_node=4,
                            pipeline=4)
    assert one.outputs[0].tobytes() != four.outputs[0].tobytes()
    assert np.allclose(one.outputs[0], four.outputs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_exact_sums_and_the_ledger_equal_the_cost(shape):
    p, k = shape
    for segments in (2, 5):
        for n in (0, 3, p + 1, 1003):
            xs = make_inputs("exact", np.dtype(np.int64), n, p)
            result = refcoll.simulate("allreduce", xs, algorithm="hierarchical",
                                      ranks_per_node=k, pipeline=segments)
            assert all(np.array_equal(o, fold("sum", xs)) for o in result.outputs)
            want = hierarchical_cost(p, n, 8, ranks_per_node=k, pipeline=segments)
            assert result.ledger.counts() == want.counts(), (segments, n)
            intra, inter = node_traffic(result.ledger, k)
            assert (intra, inter) == hierarchical_traffic(p, n, 8, ranks_per_node=k,
                                                          pipeline=segments)


def test_one_segment_costs_what_the_plain_schedule_costs():
    for p, k, n in [(8, 4, 1003), (7, 3, 10), (6, 2, 0)]:
        assert hierarchical_cost(p, n, 4, ranks_per_node=k, pipeline=1) == \
            hierarchical_cost(p, n, 4, ranks_per_node=k)
    assert "3 segments" in hierarchical_cost(8, 100, 4, ranks_per_node=4, pipeline=3).formula


@pytest.mark.parametrize("bad", [0, -2, True, 2.5, "4", (1 << 16) + 1, 10**9])
def test_a_bad_pipeline_is_a_usage_error_naming_it(bad):
    """(10**9 segments: a tuning file's rule was priced segment by segment, for hours.)"""
    xs = make_inputs("exact", np.dtype(np.float32), 16, 4)
    with pytest.raises(UsageError, match="pipeline must be a whole number of segments"):
        refcoll.simulate("allreduce", xs, algorithm="hierarchical", ranks_per_node=2,
                         pipeline=bad)


# ------------------------------------------------------------------- the price

def test_the_price_overlaps_the_segments():
    shape = NodeShape(2, 2)
    cal = Calibration(alpha=1e-6, beta=1e-10, gamma=0.0, inter_alpha=2e-5, inter_beta=8e-9,
                      nodes=2, per_node=2)
    count = 1 << 24
    plain = cal.price(hierarchical_price(shape, count, 4), 2, 4)
    parts = hierarchical_price(shape, count, 4, pipeline=4)
    assert {part.segments for part in parts} == {4}
    each = [cal.price([part._replace(segments=1)], 2, 4) for part in parts]
    piped = cal.price(parts, 2, 4)
    assert piped == pytest.approx(sum(each) + 3 * max(each))
    # the network phase is the slowest: the pipeline hides most of the node phases
    assert max(each) == each[1] and piped < plain


# ------------------------------------------------------- two threads, for real

class Concurrent:
    concurrent_phases = True


def test_the_middle_phases_run_on_another_thread_in_segment_order():
    seen = []
    middle_threads = set()

    def first(s):
        seen.append(("first", s))

    def middle(s):
        middle_threads.add(threading.get_ident())
        seen.append(("middle", s))

    def last(s):
        assert ("middle", s) in seen  # a segment's last phase waits for its middle one
        seen.append(("last", s))

    run_pipelined(Concurrent(), 4, first, middle, last)
    assert concurrent_phases(Concurrent()) and not concurrent_phases(object())
    assert middle_threads and threading.get_ident() not in middle_threads
    for phase in ("first", "middle", "last"):
        assert [s for name, s in seen if name == phase] == [0, 1, 2, 3]


def test_an_error_on_the_network_thread_is_raised_to_the_caller():
    def middle(s):
        if s == 1:
            raise RuntimeError("segment 1 lost its peer")

    done = []
    with pytest.raises(RuntimeError, match="segment 1 lost its peer"):
        run_pipelined(Concurrent(), 3, lambda s: None, middle, done.append)
    assert done == [0]  # segment 0 completed; nothing after the failure


def test_an_error_on_the_callers_thread_releases_the_network_thread():
    middles = []

    def first(s):
        if s == 2:
            raise ValueError("bad segment")

    with pytest.raises(ValueError, match="bad segment"):
        run_pipelined(Concurrent(), 4, first, middles.append, lambda s: None)
    for thread in threading.enumerate():
        if thread.name == "refcoll-pipeline":
            thread.join(timeout=60)
            assert not thread.is_alive()
    assert middles == [0, 1]  # the segments whose first phase ran, and no other


def test_without_concurrency_the_segments_run_one_after_another():
    seen = []
    run_pipelined(object(), 2, lambda s: seen.append(("f", s)), lambda s: seen.append(("m", s)),
                  lambda s: seen.append(("l", s)))
    assert seen == [("f", 0), ("m", 0), ("l", 0), ("f", 1), ("m", 1), ("l", 1)]
