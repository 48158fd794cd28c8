"""The conformance battery over the simulator: naive and ring, p = 1..17.

Small worlds run the full product (every collective, op, dtype, size and mode);
larger worlds a covering subset, since each simulated rank is a thread on a
2-core machine. Each algorithm family's own test file runs the battery on its
algorithms the same way.
"""

import pytest

from conftest import failure_text, sim_battery
from refcoll.verify.conformance import LARGE_SIZE

FOUNDATION = ["naive", "ring"]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_full_battery(p):
    failures = sim_battery(p, algorithms_=FOUNDATION)
    assert not failures, failure_text(failures)


@pytest.mark.parametrize("p", range(6, 18))
def test_covering_battery(p):
    failures = sim_battery(p, algorithms_=FOUNDATION, ops=["sum", "avg"],
                           dtypes=["int32", "float32"], sizes=[0, 1, p - 1, p + 1, 1001])
    assert not failures, failure_text(failures)


def test_large_odd_size_is_in_the_default_battery():
    from refcoll.verify.conformance import default_sizes

    assert LARGE_SIZE % 2 == 1
    assert default_sizes(4) == [0, 1, 3, 4, 5, LARGE_SIZE]


def test_battery_catches_a_broken_algorithm(monkeypatch):
    """A ring that skips one reduction must fail the battery, on the right chunk."""
    from refcoll.algorithms import ring

    real = ring.ring_reduce_scatter_steps

    def lossy(t, x, bounds, *, op, target, scratch):
        def skip_rank_one(idx):
            view = target(idx)
            return view

        real(t, x, bounds, op=op, target=skip_rank_one, scratch=scratch)
        if t.rank == 1 and x.size:
            start, stop = bounds[1]
            target(1)[...] = x[start:stop]  # drop everyone else's contribution to chunk 1

    monkeypatch.setattr(ring, "ring_reduce_scatter_steps", lossy)
    failures = sim_battery(3, algorithms_=["ring"], collectives=["allreduce"], ops=["sum"],
                           dtypes=["int32"], sizes=[7])
    assert failures, "the battery must catch a dropped contribution"
    assert "element 3" in failures[0].reason


@pytest.mark.parametrize("p,k", [(4, 2), (6, 3), (7, 3)])
def test_battery_on_multi_node_worlds_predicts_with_the_real_nodes(p, k):
    """hierarchical without ranks_per_node finds the nodes itself; the oracle must too."""
    from refcoll.verify.conformance import build_cases, run_battery
    from refcoll.transport import SimWorld

    cases = [c for c in build_cases(p, algorithms_=["hierarchical"], ops=["sum", "avg"],
                                    dtypes=["float32", "int32"], sizes=[0, p + 1, 257])
             if not c.options]
    results = SimWorld(p, ranks_per_node=k).run(lambda t: run_battery(t, cases))[0]
    failures = [r for r in results if not r.passed]
    assert not failures, failure_text(failures)
