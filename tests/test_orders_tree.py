"""k-nomial trees (MPICH's knomial_1 and knomial_2, any radix) and k-ary trees (MPICH's kary,
Open MPI's binary reduce): orders, costs, refusals, MPI."""

from __future__ import annotations

import json
import re
import textwrap

import numpy as np
import pytest
from conftest import run_script

import refcoll
from refcoll import algorithms
from refcoll.core.errors import UsageError
from refcoll.verify.inputs import make_input

TREE = algorithms.get("tree")


def _inputs(p: int, n: int = 257) -> list[np.ndarray]:
    return [make_input("adversarial", "float32", n, r, p) for r in range(p)]


def _bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).view(np.uint32)


# ------------------------------------------------ explicit folds, written out by hand

def _growing(x, q, width, k, farthest):
    """Fold of the positions ``q .. q+width-1`` of a tree whose subtrees grow with distance."""
    children, w = [], 1
    while w < width:
        children += [(q + v * w, w) for v in range(1, k) if q + v * w < len(x)]
        w *= k
    if farthest:
        children.reverse()
    acc = x[q]
    for child, cw in children:
        acc = acc + _growing(x, child, cw, k, farthest)
    return acc


def _shrinking(x, q, width, k):
    """Fold of ``q .. q+width-1`` (``width`` a power of k) when the nearest child is the largest."""
    acc, start, w = x[q], q + 1, width // k
    while w >= 1:
        for _ in range(k - 1):
            if start < len(x):
                acc = acc + _shrinking(x, start, w, k)
            start += w
        w //= k
    return acc


def _expected(xs, radix, subtrees, first):
    x = [np.float32(0) + xi for xi in xs]  # float32 arrays, folded by numpy
    width = 1
    while width < len(x):
        width *= radix
    if subtrees == "shrinking":
        return _shrinking(x, 0, width, radix)
    return _growing(x, 0, width, radix, first == "farthest")


def _kary(x, q, k):
    """Fold of the heap-ordered k-ary subtree at ``q``: children ``k*q+1 .. k*q+k`` in order."""
    acc = x[q]
    for child in range(k * q + 1, k * q + k + 1):
        if child < len(x):
            acc = acc + _kary(x, child, k)
    return acc


def _strided(x, q, k):
    """Fold of Open MPI's level-order tree at ``q``: on the level whose first position is
    ``(k**L - 1) // (k - 1)``, children ``q + k**L, q + 2*k**L, ...`` in order."""
    level = 0
    while (k ** (level + 1) - 1) // (k - 1) <= q:
        level += 1
    acc = x[q]
    for v in range(1, k + 1):
        if q + v * k ** level < len(x):
            acc = acc + _strided(x, q + v * k ** level, k)
    return acc


VARIANTS = [{}, {"first": "farthest"}, {"subtrees": "shrinking"},
            {"radix": 3, "subtrees": "shrinking"}, {"radix": 3, "first": "farthest"},
            {"radix": 3}, {"radix": 4, "subtrees": "shrinking"}, {"radix": 4, "first": "farthest"}]


@pytest.mark.parametrize("p", [3, 4, 5, 8])
@pytest.mark.parametrize("options", VARIANTS,
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_allreduce_and_reduce_are_the_documented_fold(p, options):
    xs = _inputs(p)
    want = _expected(xs, options.get("radix", 2), options.get("subtrees", "growing"),
                     options.get("first", "nearest"))
    result = refcoll.simulate("allreduce", xs, algorithm="tree", **options)
    for out in result.outputs:
        assert np.array_equal(_bits(out), _bits(want))
    root = p - 1  # positions are ranks shifted by the root
    shifted = [xs[(q + root) % p] for q in range(p)]
    want_root = _expected(shifted, options.get("radix", 2), options.get("subtrees", "growing"),
                          options.get("first", "nearest"))
    out = refcoll.simulate("reduce", xs, algorithm="tree", root=root, **options).outputs[root]
    assert np.array_equal(_bits(out), _bits(want_root))


def test_p4_folds_are_the_ones_the_docstring_draws():
    x0, x1, x2, x3 = _inputs(4)
    drawn = {
        (): (x0 + x1) + (x2 + x3),
        (("first", "farthest"),): (x0 + (x2 + x3)) + x1,
        (("subtrees", "shrinking"),): (x0 + (x1 + x2)) + x3,
        (("radix", 3), ("subtrees", "shrinking")): x0 + ((x1 + x2) + x3),
        (("radix", 3), ("first", "farthest")): ((x0 + x3) + x2) + x1,
    }
    for options, want in drawn.items():
        out = refcoll.simulate("allreduce", [x0, x1, x2, x3], algorithm="tree",
                               **dict(options)).outputs[0]
        assert np.array_equal(_bits(out), _bits(want)), options
    # The orders really differ on these inputs (the test could fail).
    assert len({_bits(w).tobytes() for w in drawn.values()}) == len(drawn)


KARY = [({"shape": "kary"}, _kary), ({"shape": "kary", "radix": 3}, _kary),
        ({"shape": "strided"}, _strided), ({"shape": "strided", "radix": 3}, _strided)]


@pytest.mark.parametrize("p", [4, 5, 7])
@pytest.mark.parametrize("options,fold", KARY, ids=lambda o: str(o) if isinstance(o, dict) else "")
def test_kary_trees_are_the_heap_and_level_folds(p, options, fold):
    xs = _inputs(p)
    x = [np.float32(0) + xi for xi in xs]
    want = fold(x, 0, options.get("radix", 2))
    for out in refcoll.simulate("allreduce", xs, algorithm="tree", **options).outputs:
        assert np.array_equal(_bits(out), _bits(want))
    root = 2
    shifted = [x[(q + root) % p] for q in range(p)]
    out = refcoll.simulate("reduce", xs, algorithm="tree", root=root, **options).outputs[root]
    assert np.array_equal(_bits(out), _bits(fold(shifted, 0, options.get("radix", 2))))


def test_kary_trees_at_p4_p5_and_p7_are_drawn_right():
    x0, x1, x2, x3, x4 = _inputs(5)
    four = refcoll.simulate("allreduce", [x0, x1, x2, x3], algorithm="tree", shape="kary")
    assert np.array_equal(_bits(four.outputs[0]), _bits((x0 + (x1 + x3)) + x2))
    heap = refcoll.simulate("allreduce", [x0, x1, x2, x3, x4], algorithm="tree", shape="kary")
    level = refcoll.simulate("allreduce", [x0, x1, x2, x3, x4], algorithm="tree",
                             shape="strided")
    assert np.array_equal(_bits(heap.outputs[0]), _bits((x0 + ((x1 + x3) + x4)) + x2))
    assert np.array_equal(_bits(level.outputs[0]), _bits((x0 + (x1 + x3)) + (x2 + x4)))
    assert not np.array_equal(_bits(heap.outputs[0]), _bits(level.outputs[0]))
    from refcoll.algorithms.knomial import node_children

    assert [node_children(q, 7, 2, shape="strided") for q in range(3)] == [[1, 2], [3, 5], [4, 6]]
    assert [node_children(q, 7, 2, shape="kary") for q in range(3)] == [[1, 2], [3, 4], [5, 6]]


def _assert_ledger_equals_cost(p, n, options, segment):
    """Every tree collective on ``p`` ranks moves what its cost function says."""
    xs = [np.ones(n, np.float32)] * p
    for collective in ("allreduce", "reduce", "broadcast"):
        opts = dict(options, segment=segment)
        if collective == "broadcast":
            opts.pop("first", None)
        roots = {} if collective == "allreduce" else {"root": (n + 1) % p}
        ledger = refcoll.simulate(collective, xs, algorithm="tree", **roots, **opts).ledger
        cost = TREE.costs[collective](p, n, 4, **opts)
        assert ledger.counts() == cost.counts(), (p, collective, opts, n)


def test_kary_ledger_equals_cost():
    for p in (1, 2, 5, 7):
        for options in ({"shape": "kary"}, {"shape": "strided", "radix": 3},
                        {"shape": "kary", "first": "farthest"}):
            for segment, n in ((None, 0), (None, 50), (3, 10)):
                _assert_ledger_equals_cost(p, n, options, segment)


def test_kary_broadcast_reaches_every_rank():
    for p in (3, 5, 8):
        xs = _inputs(p, 33)
        for options in ({"shape": "kary"}, {"shape": "strided", "radix": 3}):
            outs = refcoll.simulate("broadcast", xs, algorithm="tree", root=2 % p,
                                    **options).outputs
            assert all(np.array_equal(_bits(o), _bits(xs[2 % p])) for o in outs)


def test_broadcast_reaches_every_rank_in_every_tree():
    for p in (3, 5, 8):
        xs = _inputs(p, 33)
        for options in ({"radix": 3}, {"subtrees": "shrinking"},
                        {"radix": 4, "subtrees": "shrinking"}):
            outs = refcoll.simulate("broadcast", xs, algorithm="tree", root=1, **options).outputs
            assert all(np.array_equal(_bits(o), _bits(xs[1])) for o in outs)


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
def test_ledger_equals_cost_for_every_tree(p):
    for options in VARIANTS[1:]:
        for segment in (None, 3):
            for n in sorted({0, 1, p + 1, 50}):
                _assert_ledger_equals_cost(p, n, options, segment)


def test_default_options_keep_the_binomial_costs_closed_form():
    from refcoll.algorithms.tree import tree_allreduce_cost

    assert tree_allreduce_cost(8, 100, 4) == tree_allreduce_cost(8, 100, 4, radix=2,
                                                                 subtrees="growing")
    assert tree_allreduce_cost(8, 100, 4).rounds == 6


def test_orders_are_distinct_and_start_with_the_default():
    for p in (3, 4, 5, 8, 64):
        orders = TREE.reduction_orders("allreduce", p)
        assert orders[0] == {} and 1 < len(orders) <= 9
        assert {"subtrees": "shrinking"} in orders and {"first": "farthest"} in orders
        assert ({"shape": "kary"} in orders) == (p >= 4)  # p = 3: the binomial tree's fold
        assert ({"shape": "strided"} in orders) == (p >= 5)  # p <= 4: the kary tree
        xs = _inputs(p, 64)
        outs = {_bits(refcoll.simulate("allreduce", xs, algorithm="tree", **o).outputs[0]).tobytes()
                for o in orders}
        assert len(outs) == len(orders), p
    assert TREE.reduction_orders("broadcast", 8) == [{}]


@pytest.mark.parametrize("bad,word", [({"radix": 1}, "radix"), ({"radix": 2.0}, "radix"),
                                      ({"radix": True}, "radix"), ({"subtrees": "x"}, "growing"),
                                      ({"first": "x"}, "farthest"),
                                      ({"shape": "heap"}, "kary, strided"),
                                      ({"shape": "kary", "subtrees": "shrinking"}, "knomial")])
def test_bad_values_are_refused_naming_the_allowed_ones(bad, word):
    with pytest.raises(UsageError, match=word):
        refcoll.simulate("allreduce", _inputs(3, 4), algorithm="tree", **bad)
    with pytest.raises(UsageError, match=word):
        TREE.costs["allreduce"](3, 4, 4, **bad)


def test_broadcast_takes_no_fold_order():
    with pytest.raises(UsageError, match="first"):
        refcoll.simulate("broadcast", _inputs(3, 4), algorithm="tree", root=0, first="farthest")


# ------------------------------------------------------------------------ under MPI

_JOB = textwrap.dedent("""
    import os, sys, json
    import numpy as np
    from mpi4py import MPI
    import refcoll
    from refcoll.verify.inputs import make_input
    comm = MPI.COMM_WORLD
    r, p = comm.rank, comm.size
    n = 1001
    xs = [make_input("adversarial", "float32", n, q, p) for q in range(p)]
    for collective, options in json.loads(sys.argv[1]):
        roots = {} if collective == "allreduce" else {"root": 1}
        fn = getattr(refcoll, collective)
        out = fn(xs[r], comm=comm, algorithm="tree", **roots, **options)
        want = refcoll.simulate(collective, xs, algorithm="tree", **roots, **options).outputs[r]
        if want is not None and not np.array_equal(np.asarray(out).view(np.uint32),
                                                   want.view(np.uint32)):
            print(f"rank {r}: {collective} {options} differs from the simulator", flush=True)
            sys.exit(1)
    if os.environ.get("LIBRARY_OPTIONS"):
        out = np.empty(n, np.float32)
        comm.Allreduce(xs[r], out, op=MPI.SUM)
        want = refcoll.simulate("allreduce", xs, algorithm="tree",
                                **json.loads(os.environ["LIBRARY_OPTIONS"])).outputs[r]
        if not np.array_equal(out.view(np.uint32), want.view(np.uint32)):
            print(f"rank {r}: MPICH's tree differs", flush=True)
            sys.exit(1)
    sys.stdout.write(f"ok{r}" + chr(10))
    sys.stdout.flush()
""")


def _job(tmp_path, p, cases, env=None):
    return run_script(tmp_path, p, _JOB, [json.dumps(cases)], env)


def _mpich_env(tree_type: str, kval: int, options: dict) -> dict:
    """Force MPICH's tree all-reduce and name the option set the job holds it to."""
    from refcoll.baselines import mpi_algorithms as ma

    if ma.installed_library() != "mpich":
        return {}
    return {"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "tree",
            "MPIR_CVAR_ALLREDUCE_TREE_TYPE": tree_type,
            "MPIR_CVAR_ALLREDUCE_TREE_KVAL": str(kval), "LIBRARY_OPTIONS": json.dumps(options)}


def test_mpi_transport_gives_the_simulators_bits_and_mpichs_knomial_1(tmp_path):
    """refcoll over MPI equals the simulator; MPICH's default tree is subtrees="shrinking".

    (Under MPICH the same job runs its own ``MPI_Allreduce`` with the tree forced.)
    """
    cases = [("allreduce", {"subtrees": "shrinking"}),
             ("allreduce", {"radix": 3, "first": "farthest"}),
             ("reduce", {"radix": 3, "subtrees": "shrinking"}), ("broadcast", {"radix": 3}),
             ("allreduce", {"shape": "kary"}), ("reduce", {"shape": "strided", "radix": 3}),
             ("broadcast", {"shape": "kary", "radix": 3})]
    done = _job(tmp_path, 4, cases, _mpich_env("knomial_1", 2, {"subtrees": "shrinking"}))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert sorted(re.findall(r"ok\d", done.stdout)) == [f"ok{r}" for r in range(4)], done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("tree_type,kval,options,p", [
    ("knomial_2", 3, {"radix": 3, "first": "farthest"}, 4),
    ("knomial_1", 3, {"radix": 3, "subtrees": "shrinking"}, 4),
    ("kary", 2, {"shape": "kary"}, 5),
    ("kary", 3, {"shape": "kary", "radix": 3}, 7),
])
def test_mpichs_tree_allreduce_is_the_option_sets_order(tmp_path, tree_type, kval, options, p):
    env = _mpich_env(tree_type, kval, options)
    if not env:
        pytest.skip("needs mpi4py on MPICH")
    done = _job(tmp_path, p, [], env)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
