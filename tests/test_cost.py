"""Every registered algorithm's cost function equals the simulator's ledger, exactly."""

import numpy as np
import pytest

import refcoll
from refcoll import algorithms
from refcoll.verify.inputs import make_inputs

PAIRS = [(name, coll) for name, algo in algorithms.REGISTRY.items() for coll in algo.costs]




@pytest.mark.parametrize("name,collective", PAIRS, ids=[f"{a}-{c}" for a, c in PAIRS])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("n", [0, 1, "p-1", "p+1", 1000])
def test_ledger_equals_cost_function(name, collective, p, n):
    count = {"p-1": p - 1, "p+1": p + 1}.get(n, n)
    dtype = np.dtype(np.float32)
    xs = make_inputs("exact", dtype, count, p)
    options = {"root": p - 1} if collective in ("broadcast", "reduce") else {}
    result = refcoll.simulate(collective, xs, algorithm=name, **options)
    predicted = algorithms.get(name).costs[collective](p, count, dtype.itemsize)
    assert result.ledger.counts() == predicted.counts()


def test_ring_allreduce_matches_the_textbook_formula_when_p_divides_n():
    p, n, s = 8, 8000, 4
    cost = algorithms.get("ring").costs["allreduce"](p, n, s)
    assert cost.rounds == 2 * (p - 1)
    assert cost.critical_bytes == 2 * (p - 1) * n * s // p
    assert cost.reduced == (p - 1) * n // p
    assert cost.bytes == 2 * (p - 1) * n * s
    alpha, beta, gamma = 1e-6, 1e-9, 1e-10
    assert cost.time(alpha, beta, gamma) == pytest.approx(
        2 * (p - 1) * alpha + 2 * (p - 1) / p * n * s * beta + (p - 1) / p * n * gamma)
