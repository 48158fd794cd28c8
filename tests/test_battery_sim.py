"""The conformance battery over the simulator: naive and ring, p = 1..17.

Worlds of 1 to 3 ranks run the full product (every collective, op, dtype, size
and mode), the non-blocking twins on a covering subset of it; larger worlds a
covering subset, twins included, since each simulated rank is a thread on a
2-core machine (the full product at 4 and 5 ranks is ``-m slow``). Each
algorithm family's own test file runs the battery on its algorithms.
"""

import pytest
from conftest import classes, covering, failure_text, sim_battery

from refcoll.transport import SimWorld
from refcoll.verify.conformance import LARGE_SIZE, build_cases, run_battery

FOUNDATION = ["naive", "ring"]


def run_cases(p: int, twinned, blocking=()):
    """Run ``twinned`` with their non-blocking twins, then ``blocking`` without; return failures."""
    results = SimWorld(p).run(lambda t: run_battery(t, twinned)
                              + run_battery(t, blocking, nonblocking=False))[0]
    assert len(results) == len(twinned) + len(blocking)
    return [r for r in results if not r.passed]


def every_call(cases):
    """One case per (algorithm, collective, op, size, mode), cycling through (dtype, kind)."""
    return covering(cases, lambda c: (c.algorithm, c.collective, c.op, c.count, c.inplace))


# The full product from 2 ranks on repeats, dtype by dtype, what 1 rank shows (an op acts
# element by element, whatever the world): slow only; test_every_call_at_3_4_and_5_ranks
# runs every call, op, size and mode at 3 and 4 by default (5 with -m slow), and 2 ranks run
# every case of the MPI battery's selection under mpiexec (tests/mpi/test_mpi_battery.py).
@pytest.mark.parametrize("p", [1, pytest.param(2, marks=pytest.mark.slow),
                               pytest.param(3, marks=pytest.mark.slow),
                               pytest.param(4, marks=pytest.mark.slow),
                               pytest.param(5, marks=pytest.mark.slow)])
def test_full_battery(p):
    """Every case; the twins on :func:`every_call`'s subset.

    A twin runs the very blocking call on the communicator's progress thread
    (``refcoll.calls.progress``): what it adds depends on the call and its
    buffers, not on the dtype, which the subset still cycles through.
    """
    cases = build_cases(p, algorithms_=FOUNDATION)
    twinned = every_call(cases)
    assert classes(twinned) == classes(cases)
    chosen = set(twinned)
    failures = run_cases(p, twinned, [c for c in cases if c not in chosen])
    assert not failures, failure_text(failures)


@pytest.mark.parametrize("p", [3, 4, pytest.param(5, marks=pytest.mark.slow)])
def test_every_call_at_3_4_and_5_ranks(p):
    """Odd and power-of-two worlds: every (algorithm, collective, op, size, mode), twins too.

    The full battery's subset at ``p`` (:func:`every_call`): every dtype and input
    kind of each algorithm still appears; each dtype at each size is held by the
    full battery at 1 and 2 ranks.
    """
    cases = build_cases(p, algorithms_=FOUNDATION)
    chosen = every_call(cases)
    assert classes(chosen) == classes(cases)
    failures = run_cases(p, chosen)
    assert not failures, failure_text(failures)


@pytest.mark.parametrize("p", [p if p in (6, 7, 8, 9, 10, 12, 17)
                               else pytest.param(p, marks=pytest.mark.slow)
                               for p in range(6, 18)])  # the others: more of the same p mod 4
def test_covering_battery(p):
    """One case per (algorithm, collective, size, mode), cycling through (op, dtype, kind).

    The full battery holds every op and dtype at every size to the same code at
    1 to 3 ranks; what a larger world changes is the chunking and the schedule,
    which the sizes 0, 1, p-1, p+1 and 1001 in both modes reach for every collective.
    """
    cases = build_cases(p, algorithms_=FOUNDATION, ops=["sum", "avg"],
                        dtypes=["int32", "float32"], sizes=[0, 1, p - 1, p + 1, 1001])
    chosen = covering(cases, lambda c: (c.algorithm, c.collective, c.count, c.inplace))
    assert classes(chosen) == classes(cases)
    failures = run_cases(p, chosen)
    assert not failures, failure_text(failures)


def test_large_odd_size_is_in_the_default_battery():
    from refcoll.verify.conformance import default_sizes

    assert LARGE_SIZE % 2 == 1
    assert default_sizes(4) == [0, 1, 3, 4, 5, LARGE_SIZE]


def test_battery_catches_a_broken_algorithm(monkeypatch):
    """A ring that skips one reduction must fail the battery, on the right chunk."""
    from refcoll.algorithms import ring

    real = ring.ring_reduce_scatter_steps

    def lossy(t, x, bounds, *, op, target, scratch, **walk):
        def skip_rank_one(idx):
            view = target(idx)
            return view

        held = real(t, x, bounds, op=op, target=skip_rank_one, scratch=scratch, **walk)
        if t.rank == 1 and x.size:
            start, stop = bounds[1]
            target(1)[...] = x[start:stop]  # drop everyone else's contribution to chunk 1
        return held

    monkeypatch.setattr(ring, "ring_reduce_scatter_steps", lossy)
    failures = sim_battery(3, algorithms_=["ring"], collectives=["allreduce"], ops=["sum"],
                           dtypes=["int32"], sizes=[7])
    assert failures, "the battery must catch a dropped contribution"
    assert "element 3" in failures[0].reason


@pytest.mark.parametrize("p,k", [(4, 2), (6, 3), (7, 3)])
def test_battery_on_multi_node_worlds_predicts_with_the_real_nodes(p, k):
    """hierarchical without ranks_per_node finds the nodes itself; the oracle must too."""
    cases = [c for c in build_cases(p, algorithms_=["hierarchical"], ops=["sum", "avg"],
                                    dtypes=["float32", "int32"], sizes=[0, p + 1, 257])
             if not c.options]
    results = SimWorld(p, ranks_per_node=k).run(lambda t: run_battery(t, cases))[0]
    failures = [r for r in results if not r.passed]
    assert not failures, failure_text(failures)
