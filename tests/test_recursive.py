"""Recursive doubling and Rabenseifner: battery, exact costs, closed forms, reduction order."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import failure_text, sim_battery

import refcoll
from refcoll import algorithms
from refcoll.algorithms.recursive import (
    ABSORBS,
    SENDS,
    STAYS,
    fold_role,
    new_rank,
    pof2_below,
    real_rank,
    survivor_ranges,
)
from refcoll.core.chunking import chunk_bounds, chunk_slice
from refcoll.transport import SimWorld
from refcoll.verify.inputs import make_inputs

NAMES = ["recursive_doubling", "rabenseifner"]


# ------------------------------------------------------------------ peer arithmetic

@pytest.mark.parametrize("p", range(1, 18))
def test_fold_renumbers_survivors_in_rank_order(p):
    pof2 = pof2_below(p)
    assert pof2 <= p < 2 * pof2 and pof2 & (pof2 - 1) == 0
    survivors = [r for r in range(p) if new_rank(r, p) is not None]
    assert [new_rank(r, p) for r in survivors] == list(range(pof2))
    assert [real_rank(i, p) for i in range(pof2)] == survivors
    for r in range(p):
        role, partner = fold_role(r, p)
        if role == SENDS:
            assert new_rank(r, p) is None and fold_role(partner, p) == (ABSORBS, r)
        else:
            assert new_rank(r, p) is not None and (role == STAYS) == (partner is None)


@pytest.mark.parametrize("p", [3, 5, 6, 7, 12, 17])
@pytest.mark.parametrize("n", [0, 2, 17, 1001])
def test_survivor_ranges_are_the_chunks_each_survivor_stands_for(p, n):
    bounds = chunk_bounds(n, p)
    ranges = survivor_ranges(bounds, p)
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, in order
    for r in range(p):
        i = new_rank(r, p) if new_rank(r, p) is not None else new_rank(r + 1, p)
        assert ranges[i][0] <= bounds[r][0] and bounds[r][1] <= ranges[i][1]


# -------------------------------------------------------------- conformance battery

ROTATED_OPS = ("sum", "min", "avg")
ROTATED_DTYPES = ("float32", "int32", "float16")


@pytest.mark.parametrize("p", [pytest.param(p, marks=pytest.mark.slow) if p in (5, 15) else p
                               for p in range(1, 18)])  # 5: the fold as at 3, 6 and 7; 15: 6's pair
def test_battery_on_the_simulator(p):
    """p <= 5: every op on three dtypes; p > 5: one (op, dtype) per p, all nine pairs over
    6..17 (15 repeats 6's: slow).

    Every default size (0, 1, p-1, p, p+1, 5003), both in-place modes, every collective.
    The full battery (every op and dtype at every p) is ``-m slow``.
    """
    if p <= 5:
        selection = dict(dtypes=["int32", "bfloat16", "float32"])
    else:
        selection = dict(ops=[ROTATED_OPS[p % 3]], dtypes=[ROTATED_DTYPES[(p // 3) % 3]])
    failures = sim_battery(p, algorithms_=NAMES, **selection)
    assert not failures, failure_text(failures)


@pytest.mark.slow
@pytest.mark.parametrize("p", range(1, 18))
def test_full_battery_on_the_simulator(p):
    failures = sim_battery(p, algorithms_=NAMES)
    assert not failures, failure_text(failures)


# ---------------------------------------------------------------- ledger == cost

PAIRS = [(name, coll) for name in NAMES for coll in algorithms.get(name).costs]




@pytest.mark.parametrize("name,collective", PAIRS, ids=[f"{a}-{c}" for a, c in PAIRS])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 17])
def test_ledger_equals_cost_exactly(name, collective, p):
    cost = algorithms.get(name).costs[collective]
    for n in sorted({0, 1, p - 1, p, p + 1, 1000, 1001}):
        for dtype in (np.dtype(np.float32), np.dtype(np.float16)) if n == 1001 else (
                np.dtype(np.float32),):
            xs = make_inputs("exact", dtype, n, p)
            ledger = refcoll.simulate(collective, xs, algorithm=name).ledger
            assert ledger.counts() == cost(p, n, dtype.itemsize).counts(), (p, n, dtype)


# ------------------------------------------------------- the published closed forms

COSTS = {(name, coll): algorithms.get(name).costs[coll] for name, coll in PAIRS}


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_power_of_two_costs_are_the_published_formulas(p):
    lg, n, s = p.bit_length() - 1, 1024 * p, 4
    alpha, beta, gamma = 1e-6, 1e-9, 1e-10

    rd = COSTS["recursive_doubling", "allreduce"](p, n, s)
    assert (rd.rounds, rd.critical_bytes, rd.reduced) == (lg, lg * n * s, lg * n)
    assert rd.time(alpha, beta, gamma) == pytest.approx(
        lg * alpha + n * s * lg * beta + n * lg * gamma)
    assert rd.formula == "lg p·α + n·lg p·β + n·lg p·γ"

    rab = COSTS["rabenseifner", "allreduce"](p, n, s)
    assert rab.rounds == 2 * lg
    assert rab.critical_bytes == 2 * (p - 1) * n * s // p
    assert rab.reduced == (p - 1) * n // p
    assert rab.bytes == 2 * (p - 1) * n * s  # the same total as the ring
    assert rab.time(alpha, beta, gamma) == pytest.approx(
        2 * lg * alpha + 2 * (p - 1) / p * n * s * beta + (p - 1) / p * n * gamma)
    assert rab.formula == "2·lg p·α + 2·((p-1)/p)·n·β + ((p-1)/p)·n·γ"

    rs = COSTS["rabenseifner", "reduce_scatter"](p, n, s)
    assert (rs.rounds, rs.critical_bytes, rs.reduced) == (
        lg, (p - 1) * n * s // p, (p - 1) * n // p)

    m = n // p
    ag = COSTS["rabenseifner", "allgather"](p, m, s)
    assert (ag.rounds, ag.critical_bytes, ag.reduced) == (lg, (p - 1) * m * s, 0)


@pytest.mark.parametrize("p", [3, 5, 6, 7, 12, 17])
def test_the_fold_adds_the_documented_terms(p):
    """MPICH's non-power-of-two terms, with p' = 2^floor(lg p) for p (p' divides n)."""
    pof2 = pof2_below(p)
    lg, n, s = pof2.bit_length() - 1, 1024 * pof2, 4

    rd = COSTS["recursive_doubling", "allreduce"](p, n, s)
    assert (rd.rounds, rd.critical_bytes, rd.reduced) == (lg + 2, (lg + 2) * n * s, (lg + 1) * n)

    rab = COSTS["rabenseifner", "allreduce"](p, n, s)
    assert rab.rounds == 2 * lg + 2
    assert rab.critical_bytes == (2 * (pof2 - 1) * n // pof2 + 2 * n) * s
    assert rab.reduced == n + (pof2 - 1) * n // pof2

    assert COSTS["rabenseifner", "reduce_scatter"](p, n, s).rounds == lg + 2
    assert COSTS["rabenseifner", "allgather"](p, n, s).rounds == lg + 2


# ------------------------------------------------------------ the reduction order

def documented_leaves(xs, combine):
    """L(i) = x(2i) op x(2i+1) for i < rem, x(i + rem) otherwise (the module docstring)."""
    p = len(xs)
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    return [combine(xs[2 * i], xs[2 * i + 1]) if i < rem else xs[i + rem] for i in range(pof2)]


def rank_order_tree(leaves, combine):
    """Recursive doubling: ((L0 op L1) op (L2 op L3)) op ..., the lower half on the left."""
    if len(leaves) == 1:
        return leaves[0]
    half = len(leaves) // 2
    return combine(rank_order_tree(leaves[:half], combine), rank_order_tree(leaves[half:], combine))


def top_bit_first_tree(leaves, combine):
    """Rabenseifner: T(c, m) = T(c, 2m) op T(c+m, 2m), T(c, p') = L(c); result T(0, 1)."""
    pof2 = len(leaves)

    def tree(c, m):
        return leaves[c] if m == pof2 else combine(tree(c, 2 * m), tree(c + m, 2 * m))

    return tree(0, 1)


def float32_add(a, b):
    return np.add(a, b, dtype=np.float32)


def spread_inputs(p, n=4000, seed=7):
    """Random float32 of wildly different magnitudes: every summation order shows."""
    rng = np.random.default_rng([seed, p])
    return [(rng.standard_normal(n) * 10.0 ** rng.integers(-6, 7, n)).astype(np.float32)
            for _ in range(p)]


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
def test_reduction_order_is_the_documented_tree(p):
    xs = spread_inputs(p)
    leaves = documented_leaves(xs, float32_add)
    want = {"recursive_doubling": rank_order_tree(leaves, float32_add),
            "rabenseifner": top_bit_first_tree(leaves, float32_add)}
    for name in NAMES:
        for got in refcoll.simulate("allreduce", xs, algorithm=name).outputs:
            assert np.array_equal(got, want[name]), (name, p)
    scattered = refcoll.simulate("reduce_scatter", xs, algorithm="rabenseifner").outputs
    for r, got in enumerate(scattered):
        assert np.array_equal(got, want["rabenseifner"][chunk_slice(xs[0].size, p, r)]), r


def test_the_two_documented_orders_really_differ():
    """So the test above can tell them apart (at p = 4 the trees are not the same)."""
    leaves = documented_leaves(spread_inputs(4), float32_add)
    assert not np.array_equal(rank_order_tree(leaves, float32_add),
                              top_bit_first_tree(leaves, float32_add))


@pytest.mark.parametrize("name", NAMES)
def test_signed_zeros_under_min_follow_the_order_on_every_rank(name):
    """min(+0, -0) depends on the operand order: only a rank-independent order agrees everywhere."""
    p = 6
    xs = [np.array([0.0, -0.0] * 8, dtype=np.float32) * (1 if r % 2 else -1) for r in range(p)]
    tree = rank_order_tree if name == "recursive_doubling" else top_bit_first_tree
    want = tree(documented_leaves(xs, np.minimum), np.minimum)
    for got in refcoll.simulate("allreduce", xs, algorithm=name, op="min").outputs:
        assert np.array_equal(np.signbit(got), np.signbit(want))


# --------------------------------------------------------------------- speed habits

@pytest.mark.parametrize("p", [4, 6])
def test_rabenseifner_reuses_its_workspace_across_calls(p):
    """Receive buffers come from the transport's workspace: the second call allocates none."""
    xs = make_inputs("random", np.float32, 1001, p)

    def twice(t, x):
        refcoll.allreduce(x, t, algorithm="rabenseifner")
        first = {k: id(v) for k, v in t.cache["workspace"].items()}
        refcoll.allreduce(x, t, algorithm="rabenseifner")
        return first == {k: id(v) for k, v in t.cache["workspace"].items()}

    assert all(SimWorld(p).run(twice, [(x,) for x in xs]))


def test_a_radix_past_the_ranks_allocates_no_radix_buffers():
    """Every rank took radix·n elements of scratch before it looked at p: radix 100,000 on
    3 ranks of 100,000 float64 asked for 74.5 GiB. A radix past p folds into rank 0."""
    xs = [np.full(100_000, float(r + 1)) for r in range(3)]
    got = refcoll.simulate("allreduce", xs, algorithm="recursive_doubling", radix=100_000)
    assert all((out == 6.0).all() for out in got.outputs)


@pytest.mark.parametrize("pof2", [1, 2, 4, 8, 64])
def test_the_block_sums_of_the_costs_are_the_blocks_own_sums(pof2):
    """own_blocks, halving_rounds and doubling_rounds sum blocks by prefix sums (a cost at
    thousands of ranks once summed p'^2 elements): each is its definition, summed whole."""
    from refcoll.algorithms.recursive import doubling_rounds, halving_rounds, own_blocks

    sizes = [int(v) for v in np.random.default_rng(pof2).integers(0, 50, pof2)]
    masks = [1 << k for k in range(pof2.bit_length() - 1)]
    assert own_blocks(sizes) == [sum(sum(sizes[i & ~(m - 1):(i & ~(m - 1)) + m]) for m in masks)
                                 for i in range(pof2)]
    for rem in range(pof2 + 1):
        halving, doubling = {}, {}
        for k, m in enumerate(reversed(masks), 1):
            for i in range(pof2):
                first = (i ^ m) & ~(m - 1)
                step = k + (1 if i % m < rem else 0)
                halving[step] = max(halving.get(step, 0), sum(sizes[first:first + m]))
        for k, m in enumerate(masks, 1):
            for i in range(pof2):
                step = 3 + k + (1 if i & ~(2 * m - 1) < rem else 0)
                doubling[step] = max(doubling.get(step, 0), sum(sizes[i & ~(m - 1):][:m]))
        assert halving_rounds(sizes, rem, 0) == halving
        assert doubling_rounds(sizes, rem, 3) == doubling
