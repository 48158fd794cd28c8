"""Binomial tree and double binary tree: shapes, battery, exact costs, roots, reduction order."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

import numpy as np
import pytest
from conftest import ALGORITHM_TWINS, ROOT, failure_text, mpiexec_path

import refcoll
from refcoll import algorithms
from refcoll.algorithms.dbtree import (
    DBTREE_SEGMENT,
    btree_links,
    dbtree_allreduce_cost,
    dbtree_links,
    dbtree_messages,
    dbtree_position,
    dbtree_rank,
)
from refcoll.algorithms.tree import (
    binomial_children,
    binomial_parent,
    segment_bounds,
    tree_allreduce_cost,
    tree_broadcast_cost,
    tree_position,
    tree_reduce_cost,
)
from refcoll.core.chunking import chunk_bounds
from refcoll.core.errors import UsageError
from refcoll.core.ops import get_op
from refcoll.transport import SimWorld
from refcoll.verify.conformance import LARGE_SIZE, build_cases, run_battery

NAMES = ["tree", "dbtree"]


def _random(p: int, n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng([seed, p, n])
    return [rng.standard_normal(n).astype(np.float32) for _ in range(p)]


# ------------------------------------------------------------------------ segments

@pytest.mark.parametrize("n", [0, 1, 2, 7, 100, 1001])
@pytest.mark.parametrize("segment", [None, 1, 3, 64, 5000])
def test_segments_cover_the_buffer_in_order_each_at_most_segment(n, segment):
    pieces = segment_bounds(n, segment)
    if n == 0:
        assert pieces == []
        return
    assert pieces[0][0] == 0 and pieces[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    sizes = [stop - start for start, stop in pieces]
    assert len(pieces) == (1 if segment is None else -(-n // segment))
    assert max(sizes) - min(sizes) <= 1 and (segment is None or max(sizes) <= segment)


@pytest.mark.parametrize("segment", [0, -4, "abc", 2.5, True])
def test_a_segment_that_is_no_positive_count_is_a_usage_error(segment):
    with pytest.raises(UsageError, match="segment must be a positive element count"):
        segment_bounds(10, segment)


@pytest.mark.parametrize("algorithm", ["tree", "dbtree"])
@pytest.mark.parametrize("p", [1, 2])
def test_a_bad_segment_is_refused_on_one_rank_as_on_many(algorithm, p):
    """dbtree's one-rank copy came before its segment was read: segment=0 ran on one rank
    and was refused on two, so a job tested alone failed when it grew."""
    x = [np.arange(5, dtype=np.float32)] * p
    with pytest.raises(UsageError, match="segment must be a positive element count"):
        refcoll.simulate("allreduce", x, algorithm=algorithm, segment=0)


def test_root_true_is_no_rank():
    with pytest.raises(UsageError, match="root True is not a rank"):
        refcoll.simulate("broadcast", [np.ones(2)] * 3, algorithm="tree", root=True)


# ------------------------------------------------------------------- binomial shape

@pytest.mark.parametrize("p", range(1, 18))
def test_binomial_tree_spans_every_rank_from_every_root(p):
    lg = (p - 1).bit_length()
    for root in range(p):
        assert binomial_parent(root, p, root) is None
        assert len(binomial_children(root, p, root)) == lg
        for rank in range(p):
            for child in binomial_children(rank, p, root):
                assert binomial_parent(child, p, root) == rank
            depth, node = 0, rank
            while node != root:  # every rank reaches the root in at most ⌈lg p⌉ hops
                node = binomial_parent(node, p, root)
                depth += 1
            assert depth <= lg
        # MPICH's rule: position q's parent clears q's lowest set bit.
        for rank in range(p):
            q = tree_position(rank, p, root)
            if q:
                assert tree_position(binomial_parent(rank, p, root), p, root) == q & (q - 1)


# ---------------------------------------------------------------- NCCL's two trees

def _parents(p: int, tree: int) -> dict[int, int]:
    links = {r: dbtree_links(r, p, tree)[0] for r in range(p)}
    return {r: parent for r, parent in links.items() if parent is not None}


def _children(rank: int, p: int, tree: int) -> list[int]:
    _, left, right = dbtree_links(rank, p, tree)
    return left + right


def test_trees_match_the_drawings_in_ncclGetDtree():
    """The three pictures in NVIDIA/nccl src/graph/trees.cc, child -> parent."""
    fourteen = {8: 0, 4: 8, 12: 8, 2: 4, 6: 4, 10: 12, 13: 12,
                1: 2, 3: 2, 5: 6, 7: 6, 9: 10, 11: 10}
    assert _parents(14, 0) == fourteen
    twelve_mirror = {3: 11, 1: 3, 7: 3, 0: 1, 2: 1, 5: 7, 9: 7, 4: 5, 6: 5, 8: 9, 10: 9}
    assert _parents(12, 0) == {8: 0, 4: 8, 10: 8, 2: 4, 6: 4, 1: 2, 3: 2, 5: 6, 7: 6, 9: 10, 11: 10}
    assert _parents(12, 1) == twelve_mirror
    thirteen_shift = {9: 1, 5: 9, 0: 9, 3: 5, 7: 5, 11: 0, 2: 3, 4: 3, 6: 7, 8: 7, 10: 11, 12: 11}
    assert _parents(13, 0) == {k: v for k, v in fourteen.items() if k != 13}
    assert _parents(13, 1) == thirteen_shift


@pytest.mark.parametrize("p", range(1, 41))
def test_the_two_trees_are_complementary(p):
    roots = []
    for tree in (0, 1):
        parents = _parents(p, tree)
        (root,) = [r for r in range(p) if r not in parents]
        roots.append(root)
        for rank in range(p):
            kids = _children(rank, p, tree)
            assert len(kids) <= 2 and all(parents[c] == rank for c in kids)
            node, hops = rank, 0
            while node != root:  # a spanning tree: every rank reaches the root
                node, hops = parents[node], hops + 1
                assert hops < p
            position = dbtree_position(rank, p, tree)
            assert dbtree_rank(position, p, tree) == rank
            _, left, right = dbtree_links(rank, p, tree)  # in order: left < node < right
            assert all(dbtree_position(c, p, tree) < position for c in left)
            assert all(dbtree_position(c, p, tree) > position for c in right)
    # NCCL's ncclGetDtreeRoots: 0, and p-1 (even p) or 1 (odd p).
    assert roots == [0, (1 if p % 2 and p > 1 else p - 1)]
    interior = [[bool(_children(r, p, tree)) for r in range(p)] for tree in (0, 1)]
    assert [r for r in range(p) if not interior[0][r]] == [r for r in range(p) if r % 2 or p == 1]
    both = [r for r in range(p) if interior[0][r] and interior[1][r]]
    if p % 2 == 0 or p == 1:
        assert both == []  # every rank is interior in at most one tree
    else:
        # Odd p: the shift leaves rank 0 interior in both, with one child in each.
        assert both == [0]
        assert len(_children(0, p, 0)) == len(_children(0, p, 1)) == 1
    for rank in range(p):  # so no rank has more than two children over both trees
        assert len(_children(rank, p, 0)) + len(_children(rank, p, 1)) <= 2


@pytest.mark.parametrize("p", [2, 3, 5, 6, 9])
@pytest.mark.parametrize("n,segment", [(0, 3), (1, 3), (11, 3), (40, None), (40, 7)])
def test_dbtree_messages_is_every_ranks_program_order(p, n, segment):
    """Projected on any rank, the ledger (match order) equals the documented global order."""
    result = refcoll.simulate("allreduce", _random(p, n), algorithm="dbtree", segment=segment)
    planned = [(src, dst, k * 4) for _, _, src, dst, k in dbtree_messages(p, n, segment)]
    happened = [(m.source, m.dest, m.nbytes) for m in result.ledger.messages]
    for rank in range(p):
        assert ([m for m in happened if rank in m[:2]] == [m for m in planned if rank in m[:2]])


# --------------------------------------------------------------- conformance battery

BATTERY_OPS = ("sum", "max", "avg")
BATTERY_DTYPES = ("int32", "float32", "bfloat16")


def covering_cases(p: int):
    """One case per (algorithm, collective, options, size, mode), cycling through the
    (op, dtype, kind) combinations so every one appears at each p.

    The registry's battery segment (1024) splits only the large size; segments of 3
    are added here on the small sizes, so their many-segment paths run at every p
    (segments of 3 on the large size would be 1668 segments, a thread switch each).
    """
    groups: dict[tuple, list] = {}
    for case in build_cases(p, algorithms_=NAMES, ops=BATTERY_OPS, dtypes=BATTERY_DTYPES):
        variants = [case]
        if not case.options and case.count != LARGE_SIZE:
            variants.append(dataclasses.replace(case, options=(("segment", 3),)))
        for variant in variants:
            key = (variant.algorithm, variant.collective, variant.options, variant.count,
                   variant.inplace)
            groups.setdefault(key, []).append(variant)
    return [cases[i % len(cases)] for i, cases in enumerate(groups.values())]


#: Every p up to 9, then 12 (neither a power of two nor next to one) and 17 (one past a
#: power of two, where the binomial tree gains a level); the other p up to 17 (16 too, a
#: power of two as 8 is) repeat those shapes and run with ``-m slow``.
COVERED_P = [*range(1, 10), 12, 17]


@pytest.mark.parametrize("p", [p if p in COVERED_P else pytest.param(p, marks=pytest.mark.slow)
                               for p in range(1, 18)])
def test_battery_on_the_simulator(p):
    cases = covering_cases(p)
    assert {c.options for c in cases} == {(), (("segment", 3),), (("segment", 1024),)}
    assert len({(c.op, c.dtype, c.kind) for c in cases}) == 20  # 3 ops + broadcast, x 5
    results = SimWorld(p).run(lambda t: run_battery(t, cases, nonblocking=ALGORITHM_TWINS))[0]
    failures = [r for r in results if not r.passed]
    assert not failures, failure_text(failures)


@pytest.mark.slow
@pytest.mark.parametrize("p", range(1, 18))
def test_full_battery_on_the_simulator(p):
    cases = build_cases(p, algorithms_=NAMES)
    results = SimWorld(p).run(lambda t: run_battery(t, cases, nonblocking=ALGORITHM_TWINS))[0]
    failures = [r for r in results if not r.passed]
    assert not failures, failure_text(failures)


# ------------------------------------------------------------------- ledger == cost



PAIRS = [(name, coll) for name in NAMES for coll in algorithms.get(name).costs]


@pytest.mark.parametrize("name,collective", PAIRS, ids=[f"{a}-{c}" for a, c in PAIRS])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 7, 8, 16, 17])
@pytest.mark.parametrize("segment", [None, 3], ids=["default", "segment3"])
def test_ledger_equals_cost_function(name, collective, p, segment):
    options = {} if segment is None else {"segment": segment}
    predict = algorithms.get(name).costs[collective]
    for n in sorted({0, 1, max(p - 1, 0), p + 1, 1000}):
        roots = {"root": (n + 1) % p} if collective in ("reduce", "broadcast") else {}
        result = refcoll.simulate(collective, _random(p, n), algorithm=name, **roots, **options)
        assert result.ledger.counts() == predict(p, n, 4, **options).counts(), (n, options)


def test_cost_defaults_are_the_algorithms_defaults():
    from refcoll.algorithms import dbtree

    for name, collective in PAIRS:
        algo_default = inspect.signature(algorithms.get(name).implementations[collective]) \
            .parameters["segment"].default
        cost_default = inspect.signature(algorithms.get(name).costs[collective]) \
            .parameters["segment"].default
        assert algo_default == cost_default, (name, collective)
    assert dbtree.dbtree_allreduce.__kwdefaults__["segment"] == DBTREE_SEGMENT


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8, 13, 16, 64])
def test_binomial_costs_are_mpichs_formulas_unsegmented(p):
    """⌈lg p⌉·α + ⌈lg p⌉·n·β (+ ⌈lg p⌉·n·γ) per reduce or broadcast; twice in the all-reduce."""
    n, s = 1000, 4
    lg = int(np.ceil(np.log2(p)))
    for fn, twice in [(tree_reduce_cost, 1), (tree_broadcast_cost, 1), (tree_allreduce_cost, 2)]:
        c = fn(p, n, s)
        assert (c.rounds, c.critical_bytes) == (twice * lg, twice * lg * n * s)
    assert tree_reduce_cost(p, n, s).reduced == tree_allreduce_cost(p, n, s).reduced == lg * n
    assert tree_broadcast_cost(p, n, s).reduced == 0
    # Segmenting a binomial tree only adds α: the root still moves ⌈lg p⌉·n.
    seg = tree_allreduce_cost(p, n, s, segment=100)
    assert (seg.rounds, seg.critical_bytes) == (2 * lg * 10, 2 * lg * n * s)


@pytest.mark.parametrize("p", [4, 8, 16, 32])
@pytest.mark.parametrize("segments", [1, 2, 3, 5])
def test_dbtree_rounds_closed_form_for_powers_of_two(p, segments):
    """The formula the cost function's docstring states: 4(2 lg p - 1) + 12(S-1)."""
    lg = p.bit_length() - 1
    n = 2 * 5 * segments  # two halves of S segments of 5
    rounds = dbtree_allreduce_cost(p, n, 4, segment=5).rounds
    assert rounds == 4 * (2 * lg - 1) + 12 * (segments - 1)


def test_dbtree_rank_sends_at_most_twice_its_buffer():
    for p in [2, 3, 6, 7, 16, 17]:
        c = dbtree_allreduce_cost(p, 1000, 4)
        assert c.max_rank_bytes <= 2 * 1000 * 4 and c.reduced <= 1000


# -------------------------------------------------- every root, and reduction order

def binomial_fold(op, xs, root):
    """The documented order, written from the spec: position q folds its subtrees
    q+1, q+2, q+4, ... (below its lowest set bit and below p) on the right."""
    p = len(xs)

    def partial(q):
        acc = xs[(q + root) % p].copy()
        mask = 1
        while (q == 0 or mask < (q & -q)) and q + mask < p:
            op.apply(acc, partial(q + mask), acc)
            mask <<= 1
        return acc

    return partial(0)


def inorder_fold(op, xs, tree):
    """The documented order of half ``tree``: left subtree op node op right subtree."""
    p = len(xs)
    start, stop = chunk_bounds(xs[0].size, 2)[tree]

    def partial(q):
        acc = xs[dbtree_rank(q, p, tree)][start:stop].copy()
        for child in btree_links(q, p)[1]:
            if child < q:
                op.apply(partial(child), acc, acc)
            else:
                op.apply(acc, partial(child), acc)
        return acc

    return partial(0)


@pytest.mark.parametrize("p", range(1, 10))
@pytest.mark.parametrize("segment", [None, 4])
def test_reduce_and_broadcast_from_every_root(p, segment):
    xs = _random(p, 23, seed=p)
    add = get_op("sum")
    for root in range(p):
        reduced = refcoll.simulate("reduce", xs, algorithm="tree", root=root, segment=segment)
        assert all(out is None for r, out in enumerate(reduced.outputs) if r != root)
        assert reduced.outputs[root].tobytes() == binomial_fold(add, xs, root).tobytes()
        sent = refcoll.simulate("broadcast", xs, algorithm="tree", root=root, segment=segment)
        assert all(out.tobytes() == xs[root].tobytes() for out in sent.outputs)


@pytest.mark.parametrize("p", [1, 2, 3, 5, 6, 8, 11, 17])
@pytest.mark.parametrize("segment", [None, 3])
def test_allreduce_reduction_orders_are_the_documented_ones(p, segment):
    xs = _random(p, 31, seed=7)
    add = get_op("sum")
    want = binomial_fold(add, xs, 0).tobytes()
    for out in refcoll.simulate("allreduce", xs, algorithm="tree", segment=segment).outputs:
        assert out.tobytes() == want
    want = np.concatenate([inorder_fold(add, xs, 0), inorder_fold(add, xs, 1)]).tobytes()
    for out in refcoll.simulate("allreduce", xs, algorithm="dbtree", segment=segment).outputs:
        assert out.tobytes() == want


def test_the_p4_brackets_written_out():
    """The spec pages' p = 4 examples, written out by hand."""
    x0, x1, x2, x3 = xs = _random(4, 10, seed=3)
    half0, half1 = slice(0, 5), slice(5, 10)
    out = refcoll.simulate("reduce", xs, algorithm="tree", root=0).outputs[0]
    assert out.tobytes() == ((x0 + x1) + (x2 + x3)).tobytes()
    out = refcoll.simulate("reduce", xs, algorithm="tree", root=2).outputs[2]
    assert out.tobytes() == ((x2 + x3) + (x0 + x1)).tobytes()
    out = refcoll.simulate("allreduce", xs, algorithm="dbtree").outputs[0]
    assert out[half0].tobytes() == (x0 + ((x1 + x2) + x3))[half0].tobytes()
    assert out[half1].tobytes() == (x3 + ((x2 + x1) + x0))[half1].tobytes()


# ---------------------------------------------------------------------- real MPI

@pytest.mark.skipif(mpiexec_path() is None,
                    reason="no mpiexec: install with pip install 'refcoll[mpi]'")
def test_verify_under_mpi():
    res = subprocess.run(
        [sys.executable, "-m", "refcoll", "verify", "-n", "3", "--algorithm", "tree,dbtree",
         "--dtype", "int32,float32", "--op", "sum,max", "--sizes", "0,1,2,3,4,257"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    last = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else res.stderr
    assert res.returncode == 0 and last.endswith(" 0 failed"), \
        res.stdout[-3000:] + res.stderr[-2000:]


@pytest.mark.parametrize("p", [1, 2, 3, 7])
def test_a_radix_past_the_ranks_builds_the_same_tree_without_walking_it(p):
    """The children were listed by walking every digit value up to the radix: a tuning
    file's tree(radix=10**12) was priced for hours on every rank."""
    from refcoll.algorithms.knomial import kary_children, knomial_children

    huge = 10**12
    for q in range(p):
        for subtrees in ("growing", "shrinking"):
            assert knomial_children(q, p, huge, subtrees) == knomial_children(q, p, p, subtrees)
        assert kary_children(q, p, huge) == kary_children(q, p, p)
    x = [np.arange(4.0)] * p
    assert (refcoll.simulate("allreduce", x, algorithm="tree", radix=huge).outputs[0]
            == p * np.arange(4.0)).all()
