"""Rabenseifner's near pairing (MPICH, Open MPI) and recursive multiplying (MPICH): orders,
costs."""

from __future__ import annotations

import json
import re
import textwrap

import numpy as np
import pytest
from conftest import run_script

import refcoll
from refcoll import algorithms
from refcoll.core.chunking import chunk_bounds
from refcoll.core.errors import UsageError
from refcoll.verify.inputs import make_input

RABENSEIFNER = algorithms.get("rabenseifner")
DOUBLING = algorithms.get("recursive_doubling")


def _inputs(p: int, n: int = 263) -> list[np.ndarray]:
    return [make_input("adversarial", "float32", n, r, p) for r in range(p)]


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint32)


def _pairs_leaves(xs):
    """MPICH's fold: ranks 2i and 2i+1 (i < rem) become one leaf, the rest stay."""
    p = len(xs)
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    return [xs[2 * i] + xs[2 * i + 1] if i < rem else xs[i + rem] for i in range(pof2)]


def _rank_order_tree(leaves):
    """((L0+L1)+(L2+L3))+...: pairs of neighbours first."""
    while len(leaves) > 1:
        leaves = [leaves[i] + leaves[i + 1] for i in range(0, len(leaves), 2)]
    return leaves[0]


def _bit_reversed_tree(leaves):
    """((L0+L4)+(L2+L6))+((L1+L5)+(L3+L7)): the top bit first."""
    while len(leaves) > 1:
        half = len(leaves) // 2
        leaves = [leaves[i] + leaves[i + half] for i in range(half)]
    return leaves[0]


# ----------------------------------------------------------------- Rabenseifner's pairing

@pytest.mark.parametrize("p", [3, 4, 5, 8])
@pytest.mark.parametrize("pairing", ["far", "near"])
def test_allreduce_is_the_documented_tree(p, pairing):
    xs = _inputs(p)
    tree = _rank_order_tree if pairing == "near" else _bit_reversed_tree
    want = tree(_pairs_leaves(xs))
    options = {} if pairing == "far" else {"pairing": pairing}
    for out in refcoll.simulate("allreduce", xs, algorithm="rabenseifner", **options).outputs:
        assert np.array_equal(_bits(out), _bits(want))


@pytest.mark.parametrize("p", [3, 4, 5, 8])
@pytest.mark.parametrize("pairing", ["far", "near"])
def test_reduce_scatter_chunks_are_the_documented_tree(p, pairing):
    xs = _inputs(p)
    tree = _rank_order_tree if pairing == "near" else _bit_reversed_tree
    want = tree(_pairs_leaves(xs))
    outs = refcoll.simulate("reduce_scatter", xs, algorithm="rabenseifner",
                            pairing=pairing).outputs
    for r, (start, stop) in enumerate(chunk_bounds(xs[0].size, p)):
        assert np.array_equal(_bits(outs[r]), _bits(want[start:stop])), r


def test_near_and_far_differ_from_four_ranks_on():
    xs = _inputs(4)
    near = refcoll.simulate("allreduce", xs, algorithm="rabenseifner", pairing="near").outputs[0]
    far = refcoll.simulate("allreduce", xs, algorithm="rabenseifner").outputs[0]
    assert not np.array_equal(_bits(near), _bits(far))
    x0, x1, x2, x3 = xs
    assert np.array_equal(_bits(near), _bits((x0 + x1) + (x2 + x3)))
    assert np.array_equal(_bits(far), _bits((x0 + x2) + (x1 + x3)))
    assert RABENSEIFNER.reduction_orders("allreduce", 4) == [{}, {"pairing": "near"}]
    assert RABENSEIFNER.reduction_orders("allreduce", 3) == [{}]
    assert RABENSEIFNER.reduction_orders("allgather", 8) == [{}]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 6, 8, 12])
def test_near_ledger_equals_cost(p):
    for n in sorted({0, 1, p - 1, p + 1, 101}):
        xs = [np.ones(n, np.float32)] * p
        for collective in ("allreduce", "reduce_scatter"):
            ledger = refcoll.simulate(collective, xs, algorithm="rabenseifner",
                                      pairing="near").ledger
            cost = RABENSEIFNER.costs[collective](p, n, 4, pairing="near")
            assert ledger.counts() == cost.counts(), (collective, n)
    if p > 1:  # far and near move the same data on a power of two dividing n
        assert (RABENSEIFNER.costs["allreduce"](8, 800, 4, pairing="near").counts()
                == RABENSEIFNER.costs["allreduce"](8, 800, 4).counts())


def test_bad_pairing_is_refused_naming_the_pairings():
    with pytest.raises(UsageError, match="far, near"):
        refcoll.simulate("allreduce", _inputs(4, 8), algorithm="rabenseifner", pairing="x")
    with pytest.raises(UsageError, match="far, near"):
        RABENSEIFNER.costs["reduce_scatter"](4, 8, 4, pairing="x")


# ------------------------------------------------------------- recursive multiplying

def _multiplying(xs, k):
    """MPICH's recursive multiplying, folded by hand: modulo fold, then k-ary groups."""
    p = len(xs)
    power = 1
    while power * k <= p:
        power *= k
    leaves = []
    for r in range(power):
        extras = list(range(r + power, p, power))
        if extras:
            chain = xs[extras[0]]
            for e in extras[1:]:
                chain = chain + xs[e]
            leaves.append(chain + xs[r])
        else:
            leaves.append(xs[r])
    while len(leaves) > 1:
        folded = []
        for i in range(0, len(leaves), k):
            acc = leaves[i]
            for leaf in leaves[i + 1:i + k]:
                acc = acc + leaf
            folded.append(acc)
        leaves = folded
    return leaves[0]


@pytest.mark.parametrize("p", [3, 4, 5, 8])
@pytest.mark.parametrize("options", [{"fold": "modulo"}, {"radix": 3}, {"radix": 4},
                                     {"radix": 3, "fold": "modulo"}], ids=str)
def test_recursive_multiplying_is_the_documented_fold(p, options):
    xs = _inputs(p)
    want = _multiplying(xs, options.get("radix", 2))
    for out in refcoll.simulate("allreduce", xs, algorithm="recursive_doubling",
                                **options).outputs:
        assert np.array_equal(_bits(out), _bits(want))


def test_recursive_multiplying_folds_the_docstring_writes():
    x0, x1, x2 = _inputs(3)
    out = refcoll.simulate("allreduce", [x0, x1, x2], algorithm="recursive_doubling",
                           fold="modulo").outputs[0]
    assert np.array_equal(_bits(out), _bits((x2 + x0) + x1))
    default = refcoll.simulate("allreduce", [x0, x1, x2], algorithm="recursive_doubling").outputs[0]
    assert np.array_equal(_bits(default), _bits((x0 + x1) + x2))
    assert not np.array_equal(_bits(out), _bits(default))
    x0, x1, x2, x3 = _inputs(4)
    out = refcoll.simulate("allreduce", [x0, x1, x2, x3], algorithm="recursive_doubling",
                           radix=3).outputs[0]
    assert np.array_equal(_bits(out), _bits(((x3 + x0) + x1) + x2))
    xs = _inputs(5)
    out = refcoll.simulate("allreduce", xs, algorithm="recursive_doubling",
                           fold="modulo").outputs[0]
    assert np.array_equal(_bits(out), _bits(((xs[4] + xs[0]) + xs[1]) + (xs[2] + xs[3])))


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 7, 9, 16])
def test_recursive_multiplying_ledger_equals_cost(p):
    for options in ({"fold": "modulo"}, {"radix": 3}, {"radix": 5}):
        for n in sorted({0, 1, p + 1, 64}):
            ledger = refcoll.simulate("allreduce", [np.ones(n, np.float32)] * p,
                                      algorithm="recursive_doubling", **options).ledger
            cost = DOUBLING.costs["allreduce"](p, n, 4, **options)
            assert ledger.counts() == cost.counts(), (options, n)


def test_recursive_multiplying_in_place_leaves_every_rank_the_same_bits():
    from refcoll.transport import SimWorld

    xs = _inputs(8, 31)

    def run(t):
        buf = xs[t.rank].copy()
        return refcoll.allreduce(buf, t, algorithm="recursive_doubling", radix=3, out=buf)

    outs = SimWorld(8).run(run)
    want = _multiplying(xs, 3)
    assert all(np.array_equal(_bits(o), _bits(want)) for o in outs)


def test_doubling_orders_are_distinct():
    for p in (3, 4, 5, 8, 64):
        orders = DOUBLING.reduction_orders("allreduce", p)
        assert orders[0] == {} and len(orders) <= 8
        xs = _inputs(p, 64)
        outs = {_bits(refcoll.simulate("allreduce", xs, algorithm="recursive_doubling",
                                       **o).outputs[0]).tobytes() for o in orders}
        assert len(outs) == len(orders), p
    assert {"fold": "modulo"} in DOUBLING.reduction_orders("allreduce", 3)


@pytest.mark.parametrize("bad,word", [({"radix": 1}, "radix"), ({"radix": "3"}, "radix"),
                                      ({"fold": "x"}, "pairs, modulo"),
                                      ({"radix": 3, "fold": "pairs"}, "radix 2")])
def test_bad_multiplying_values_are_refused(bad, word):
    with pytest.raises(UsageError, match=word):
        refcoll.simulate("allreduce", _inputs(3, 4), algorithm="recursive_doubling", **bad)
    with pytest.raises(UsageError, match=word):
        DOUBLING.costs["allreduce"](3, 4, 4, **bad)


# ------------------------------------------------------------------------ under MPI

_JOB = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    from mpi4py import MPI
    import refcoll
    from refcoll.verify.inputs import make_input
    comm = MPI.COMM_WORLD
    r, p = comm.rank, comm.size
    n = 1001
    xs = [make_input("adversarial", "float32", n, q, p) for q in range(p)]
    for collective, name, options in json.loads(sys.argv[1]):
        out = getattr(refcoll, collective)(xs[r], comm=comm, algorithm=name, **options)
        want = refcoll.simulate(collective, xs, algorithm=name, **options).outputs[r]
        if not np.array_equal(np.asarray(out).view(np.uint32), want.view(np.uint32)):
            print(f"rank {r}: {collective} {name} {options} differs from the simulator", flush=True)
            sys.exit(1)
    if os.environ.get("LIBRARY_ORDER"):
        name, options = json.loads(os.environ["LIBRARY_ORDER"])
        out = np.empty(n, np.float32)
        comm.Allreduce(xs[r], out, op=MPI.SUM)
        want = refcoll.simulate("allreduce", xs, algorithm=name, **options).outputs[r]
        if not np.array_equal(out.view(np.uint32), want.view(np.uint32)):
            print(f"rank {r}: MPICH's all-reduce differs from {name} {options}", flush=True)
            sys.exit(1)
    sys.stdout.write(f"ok{r}" + chr(10))
    sys.stdout.flush()
""")


def _job(tmp_path, p, cases, env=None):
    return run_script(tmp_path, p, _JOB, [json.dumps(cases)], env)


def _mpich_env(env: dict, order) -> dict:
    """Force an MPICH all-reduce and name the refcoll order the job holds it to."""
    from refcoll.baselines import mpi_algorithms as ma

    if ma.installed_library() != "mpich":
        return {}
    return {**env, "LIBRARY_ORDER": json.dumps(order)}


def test_mpi_transport_gives_the_simulators_bits_and_mpichs_recursive_multiplying(tmp_path):
    """refcoll over MPI equals the simulator; under MPICH, its recursive multiplying at k = 2
    (forced in the same job) is ``fold="modulo"``."""
    cases = [("allreduce", "rabenseifner", {"pairing": "near"}),
             ("reduce_scatter", "rabenseifner", {"pairing": "near"}),
             ("allreduce", "recursive_doubling", {"radix": 3}),
             ("allreduce", "recursive_doubling", {"fold": "modulo"})]
    env = _mpich_env({"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "recursive_multiplying"},
                     ("recursive_doubling", {"fold": "modulo"}))
    done = _job(tmp_path, 3, cases, env)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert sorted(re.findall(r"ok\d", done.stdout)) == ["ok0", "ok1", "ok2"], done.stdout


@pytest.mark.parametrize("p,env,order", [
    (4, {"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "reduce_scatter_allgather"},
     ("rabenseifner", {"pairing": "near"})),
    pytest.param(4, {"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "recursive_multiplying",
                     "MPIR_CVAR_ALLREDUCE_RECURSIVE_MULTIPLYING_KVAL": "3"},
                 ("recursive_doubling", {"radix": 3}), marks=pytest.mark.slow),
])
def test_mpichs_all_reduce_is_the_option_sets_order(tmp_path, p, env, order):
    env = _mpich_env(env, order)
    if not env:
        pytest.skip("needs mpi4py on MPICH")
    done = _job(tmp_path, p, [], env)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
