"""Bruck's allgather (distances largest first) and its reduce-scatter dual."""

import numpy as np
import pytest
from conftest import ALGORITHM_TWINS, failure_text

import refcoll
from refcoll import algorithms
from refcoll.algorithms.bruck import bruck_steps, moving_offsets
from refcoll.core.chunking import chunk_bounds
from refcoll.transport import SimWorld
from refcoll.verify.conformance import build_cases, run_battery

PROCESS_COUNTS = list(range(1, 18))


def _sizes(p: int) -> list[int]:
    return sorted({0, 1, max(p - 1, 0), p, p + 1, 1001})


def _exact_inputs(p: int, n: int) -> list[np.ndarray]:
    """Integer-valued floats, different per rank and per element: every order gives these bits."""
    return [((np.arange(n) * 7 + r * 13) % 101).astype(np.float32) for r in range(p)]


@pytest.mark.parametrize("p", PROCESS_COUNTS)
def test_reduce_scatter_gives_each_rank_its_reduced_block(p):
    for n in _sizes(p):
        xs = _exact_inputs(p, n)
        total = np.sum(np.stack(xs).astype(np.float64), axis=0) if n else np.zeros(0)
        result = refcoll.simulate("reduce_scatter", xs, algorithm="bruck")
        for rank, (start, stop) in enumerate(chunk_bounds(n, p)):
            assert result.outputs[rank].tobytes() == total[start:stop].astype(np.float32).tobytes()


@pytest.mark.parametrize("p", PROCESS_COUNTS)
def test_allgather_gives_every_rank_every_block(p):
    for m in (0, 1, 3, 50):
        xs = [np.arange(m, dtype=np.int64) + 1000 * r for r in range(p)]
        result = refcoll.simulate("allgather", xs, algorithm="bruck")
        for out in result.outputs:
            assert np.array_equal(out, np.stack(xs))


@pytest.mark.parametrize("p", PROCESS_COUNTS)
def test_ledger_is_the_cost_function_exactly(p):
    record = algorithms.get("bruck")
    rng = np.random.default_rng(p)
    for n in _sizes(p):
        xs = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]
        ledger = refcoll.simulate("reduce_scatter", xs, algorithm="bruck").ledger
        assert ledger.counts() == record.costs["reduce_scatter"](p, n, 4).counts(), n
    for m in (0, 1, 5):
        xs = [np.zeros(m, np.float64) for _ in range(p)]
        ledger = refcoll.simulate("allgather", xs, algorithm="bruck").ledger
        assert ledger.counts() == record.costs["allgather"](p, m, 8).counts(), m


@pytest.mark.parametrize("p", [2, 3, 5, 8, 13, 16, 17])
def test_rounds_are_ceil_lg_p_and_every_block_moves_once(p):
    assert bruck_steps(p) == (p - 1).bit_length()
    cost = algorithms.get("bruck").costs["allgather"](p, 1, 1)
    assert cost.rounds == (p - 1).bit_length()
    assert cost.bytes == p * (p - 1), "each rank receives each other rank's block exactly once"
    # The offsets a rank holds (relative to its own, so alike on every rank) grow from {0}
    # to 0..p-1, each added once.
    held = [0]
    for k in reversed(range(bruck_steps(p))):
        added = [(1 << k) + a for a in moving_offsets(p, k)]
        assert set(added).isdisjoint(held) and set(moving_offsets(p, k)) <= set(held)
        held += added
    assert sorted(held) == list(range(p))


def test_the_module_docstrings_p5_table():
    assert [moving_offsets(5, k) for k in (2, 1, 0)] == [[0], [0], [0, 2]]
    # rank 0 receives offsets d + a: {4}, then {2}, then {1, 3}
    assert [[(1 << k) + a for a in moving_offsets(5, k)] for k in (2, 1, 0)] == [[4], [2], [1, 3]]


def test_reduction_order_is_doubling_halves_in_cyclic_order():
    """p = 4: block q is (x(q+1) op x(q+2)) op (x(q+3) op x(q)), bit for bit."""
    p, n = 4, 4003
    rng = np.random.default_rng(0)
    xs = [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32)
          for _ in range(p)]
    result = refcoll.simulate("reduce_scatter", xs, algorithm="bruck")
    for q, (start, stop) in enumerate(chunk_bounds(n, p)):
        x = [a[start:stop] for a in xs]
        want = (x[(q + 1) % p] + x[(q + 2) % p]) + (x[(q + 3) % p] + x[q])
        assert result.outputs[q].tobytes() == want.tobytes(), q


def test_in_place_reduce_scatter_and_allgather():
    p, n = 5, 23
    xs = _exact_inputs(p, n)
    bounds = chunk_bounds(n, p)

    def body(t):
        x = xs[t.rank].copy()
        start, stop = bounds[t.rank]
        got = refcoll.reduce_scatter(x, t, algorithm="bruck", out=x[start:stop])
        block = np.full(3, t.rank, np.int32)
        gathered = np.zeros((p, 3), np.int32)
        gathered[t.rank] = block
        return got.copy(), refcoll.allgather(gathered[t.rank], t, algorithm="bruck", out=gathered)

    outs = SimWorld(p).run(body)
    total = np.sum(np.stack(xs), axis=0)
    for rank, (reduced, gathered) in enumerate(outs):
        start, stop = bounds[rank]
        assert np.array_equal(reduced, total[start:stop])
        assert np.array_equal(gathered, np.repeat(np.arange(p, dtype=np.int32)[:, None], 3, 1))


def test_auto_does_not_consider_it_and_nothing_replays_it():
    record = algorithms.get("bruck")
    assert not record.auto and not record.replayable and record.price is None
    assert record.collectives == ("reduce_scatter", "allgather")


# 7 and 8 ranks repeat what 3, 4 and 5 show (odd, a power of two, neither) at three times the
# cost: slow only; the ledger and result tests above cover p = 1..17.
@pytest.mark.parametrize("p", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow),
                               pytest.param(5, marks=pytest.mark.slow),
                               pytest.param(7, marks=pytest.mark.slow),
                               pytest.param(8, marks=pytest.mark.slow)])
def test_conformance_battery_passes(p):
    cases = build_cases(p, algorithms_=["bruck"])
    assert cases, "the battery has bruck cases"
    results = SimWorld(p).run(lambda t: run_battery(t, cases, nonblocking=ALGORITHM_TWINS))[0]
    failures = [r for r in results if not r.passed]
    assert not failures, failure_text(failures)
