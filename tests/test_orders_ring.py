"""The ring's and naive's reduction-order options, each held to a fold written here.

Every expectation is an explicit NumPy fold over the ranks, chunk by chunk, in
the order the module's docstring states, on chunks cut by the rule written out
again below; the MPI transport must give the simulator's bits.
"""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
from conftest import mpiexec_path, run_script

import refcoll
from refcoll import algorithms
from refcoll.algorithms.ring import ring_orders
from refcoll.core.chunking import chunk_bounds
from refcoll.core.errors import UsageError
from refcoll.transport import SimWorld
from refcoll.verify.inputs import make_inputs

PROCESS_COUNTS = (3, 4, 5)
COUNTS = (11, 121)  # none divisible by 3, 4 or 5; at 121 the four cuts differ for each p


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}").tobytes()


def _cut(n: int, p: int, split: str, itemsize: int) -> list[tuple[int, int]]:
    """The chunk rules, written from their definitions (not from refcoll.core.chunking)."""
    if split == "front":
        sizes = [n // p + (1 if i < n % p else 0) for i in range(p)]
    elif split == "last":
        sizes = [n // p] * (p - 1) + [n - (p - 1) * (n // p)]
    else:
        if split == "ceil":
            width = -(-n // p)
        else:  # gloo: 2 or more 1 MiB-capped segments per rank, k of them per chunk
            segments = -(-(n * itemsize) // 2**20)
            k = max(2, -(-segments // p))
            width = k * -(-n // (k * p))
        sizes, left = [], n
        for _ in range(p):
            sizes.append(min(width, left))
            left -= sizes[-1]
    starts = np.cumsum([0] + sizes)
    return [(int(starts[i]), int(starts[i + 1])) for i in range(p)]


def _walk(c: int, p: int, direction: str, start: str) -> list[int]:
    """The ranks chunk c is folded over, as the ring module's table states them."""
    if (direction, start) == ("forward", "next"):
        return [(c + 1 + i) % p for i in range(p)]  # c+1, c+2, ..., c
    if (direction, start) == ("forward", "own"):
        return [(c + i) % p for i in range(p)]  # c, c+1, ..., c-1 (Open MPI)
    if (direction, start) == ("reverse", "next"):
        return [(c - 1 - i) % p for i in range(p)]  # c-1, c-2, ..., c (Gloo)
    return [(c - i) % p for i in range(p)]  # c, c-1, ..., c+1


def _ring_fold(xs, direction="forward", start="next", split="front") -> np.ndarray:
    p, n = len(xs), xs[0].size
    out = np.empty_like(xs[0])
    for c, (lo, hi) in enumerate(_cut(n, p, split, xs[0].itemsize)):
        ranks = _walk(c, p, direction, start)
        acc = xs[ranks[0]][lo:hi].copy()
        for r in ranks[1:]:
            acc = acc + xs[r][lo:hi]  # the partial on the left, the next rank's chunk on the right
        out[lo:hi] = acc
    return out


def _naive_fold(xs, fold="left") -> np.ndarray:
    if fold == "left":
        acc = xs[0].copy()
        for x in xs[1:]:
            acc = acc + x
        return acc
    acc = xs[-1].copy()
    for x in xs[-2::-1]:
        acc = x + acc  # x0 + (x1 + (... + x(p-1)))
    return acc


RING_OPTIONS = [dict(direction=d, start=s, split=sp) for d in ("forward", "reverse")
                for s in ("next", "own") for sp in ("front", "last", "ceil", "gloo")]


def _label(opts: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in opts.items()) or "default"


@pytest.mark.parametrize("p", PROCESS_COUNTS)
@pytest.mark.parametrize("opts", RING_OPTIONS, ids=_label)
def test_ring_allreduce_is_the_stated_fold(opts, p):
    for n in COUNTS:
        xs = make_inputs("adversarial", "float32", n, p)
        want = _ring_fold(xs, **opts)
        result = refcoll.simulate("allreduce", xs, algorithm="ring", **opts)
        for r, out in enumerate(result.outputs):
            assert _bits(out) == _bits(want), f"n={n}, rank {r}"


def test_the_cuts_differ_where_the_test_needs_them_to():
    # Otherwise the fold tests could not tell the rules apart.
    for p in PROCESS_COUNTS:
        cuts = {tuple(_cut(121, p, split, 4)) for split in ("front", "last", "ceil", "gloo")}
        assert len(cuts) == 4, p


@pytest.mark.parametrize("p", PROCESS_COUNTS)
@pytest.mark.parametrize("opts", [{}, {"direction": "reverse"}, {"start": "own"},
                                  {"direction": "reverse", "split": "gloo"},
                                  {"split": "last"}], ids=_label)
def test_ring_reduce_scatter_is_block_r_of_the_same_allreduce(opts, p):
    n = 23
    xs = make_inputs("adversarial", "float64", n, p)
    full = _ring_fold(xs, **opts)
    result = refcoll.simulate("reduce_scatter", xs, algorithm="ring", **opts)
    for r, out in enumerate(result.outputs):
        lo, hi = _cut(n, p, "front", 8)[r]
        assert _bits(out) == _bits(full[lo:hi]), f"rank {r}"


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter"])
@pytest.mark.parametrize("p", [3, 4])
def test_option_costs_hold_to_the_ledger(collective, p):
    record = algorithms.get("ring")
    for opts in RING_OPTIONS if collective == "allreduce" else [{"direction": "reverse"},
                                                                {"split": "gloo"}]:
        for n in (0, 2, 23):
            xs = make_inputs("exact", "float32", n, p)
            ledger = refcoll.simulate(collective, xs, algorithm="ring", **opts).ledger
            assert ledger.counts() == record.costs[collective](p, n, 4, **opts).counts(), (opts, n)


@pytest.mark.parametrize("p", PROCESS_COUNTS)
@pytest.mark.parametrize("fold", ["left", "right"])
def test_naive_folds(fold, p):
    n = 23
    xs = make_inputs("adversarial", "float32", n, p)
    want = _naive_fold(xs, fold)
    outs = refcoll.simulate("allreduce", xs, algorithm="naive", fold=fold).outputs
    assert all(_bits(out) == _bits(want) for out in outs)
    for root in (0, p - 1, 1):  # the root changes who receives, not the order
        out = refcoll.simulate("reduce", xs, algorithm="naive", fold=fold, root=root).outputs[root]
        assert _bits(out) == _bits(want), root
    scattered = refcoll.simulate("reduce_scatter", xs, algorithm="naive", fold=fold).outputs
    assert _bits(np.concatenate(scattered)) == _bits(want)


def test_in_place_calls_give_the_out_of_place_bits():
    p = 4
    xs = make_inputs("adversarial", "float32", 9, p)

    def body(t):
        mine = xs[t.rank].copy()
        refcoll.reduce(mine, 2, t, algorithm="naive", fold="right", out=mine)
        ring = xs[t.rank].copy()
        refcoll.allreduce(ring, t, algorithm="ring", start="own", direction="reverse", out=ring)
        return mine, ring

    results = SimWorld(p).run(body)
    assert _bits(results[2][0]) == _bits(_naive_fold(xs, "right"))
    want = _ring_fold(xs, direction="reverse", start="own")
    assert all(_bits(ring) == _bits(want) for _, ring in results)


def test_defaults_are_todays_order():
    xs = make_inputs("adversarial", "float32", 23, 4)
    default = refcoll.simulate("allreduce", xs, algorithm="ring").outputs
    spelled = refcoll.simulate("allreduce", xs, algorithm="ring", direction="forward",
                               start="next", split="front").outputs
    assert [_bits(a) for a in default] == [_bits(b) for b in spelled]
    assert _bits(default[0]) == _bits(_ring_fold(xs))
    naive = refcoll.simulate("allreduce", xs, algorithm="naive").outputs[0]
    assert _bits(naive) == _bits(_naive_fold(xs, "left"))


@pytest.mark.parametrize("algorithm,collective,options,allowed", [
    ("ring", "allreduce", {"direction": "left"}, "forward, reverse"),
    ("ring", "allreduce", {"start": 1}, "next, own"),
    ("ring", "allreduce", {"split": "middle"}, "front, last, ceil, gloo"),
    ("ring", "reduce_scatter", {"direction": "up"}, "forward, reverse"),
    ("naive", "allreduce", {"fold": "middle"}, "left, right"),
    ("naive", "reduce", {"fold": None}, "left, right"),
])
def test_bad_option_values_are_refused_naming_the_allowed_ones(algorithm, collective, options,
                                                                allowed):
    xs = make_inputs("exact", "float32", 5, 3)
    with pytest.raises(UsageError, match=allowed):
        refcoll.simulate(collective, xs, algorithm=algorithm, **options)
    with pytest.raises(UsageError, match=allowed):  # one rank: refused all the same
        refcoll.simulate(collective, xs[:1], algorithm=algorithm, **options)


def test_options_the_collective_does_not_take_are_refused():
    xs = make_inputs("exact", "float32", 6, 3)
    with pytest.raises(UsageError, match="(does not take|takes no).*drop it"):
        refcoll.simulate("allgather", xs, algorithm="ring", direction="reverse")
    with pytest.raises(UsageError, match="(does not take|takes no).*drop it"):
        refcoll.simulate("broadcast", xs, algorithm="naive", fold="right")


@pytest.mark.parametrize("name,collective", [("ring", "allreduce"), ("ring", "reduce_scatter"),
                                             ("naive", "allreduce"), ("naive", "reduce")])
@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_listed_orders_are_distinct(name, collective, p):
    listed = algorithms.get(name).reduction_orders(collective, p)
    assert listed[0] == {} and len(listed) <= 8
    xs = make_inputs("adversarial", "float32", 121, p)
    seen = [_outputs(collective, xs, name, opts) for opts in listed]
    assert len(set(seen)) == len(seen), f"two listed option sets give the same bits: {listed}"


def _outputs(collective, xs, name, opts) -> bytes:
    res = refcoll.simulate(collective, xs, algorithm=name, **opts)
    return b"".join(_bits(o) for o in res.outputs if o is not None)


def test_the_orders_left_out_repeat_a_listed_one():
    xs2 = make_inputs("adversarial", "float32", 121, 2)
    for opts in RING_OPTIONS:  # two ranks: x0 op x1 whatever the walk and the cut
        assert _outputs("allreduce", xs2, "ring", opts) == _outputs("allreduce", xs2, "ring", {})
    assert (_outputs("allreduce", xs2, "naive", {"fold": "right"})
            == _outputs("allreduce", xs2, "naive", {}))
    xs3 = make_inputs("adversarial", "float32", 121, 3)
    # three ranks: the reverse walk is the forward one
    for split in ("front", "last", "ceil", "gloo"):
        forward = _outputs("allreduce", xs3, "ring", {"split": split})
        reverse = _outputs("allreduce", xs3, "ring", {"direction": "reverse", "split": split})
        assert reverse == forward
    assert (_outputs("reduce_scatter", xs3, "ring", {"direction": "reverse"})
            == _outputs("reduce_scatter", xs3, "ring", {}))


MPI_SCRIPT = textwrap.dedent("""
    import json
    import sys
    import numpy as np
    from mpi4py import MPI
    import refcoll
    from refcoll.verify.inputs import make_input

    comm = MPI.COMM_WORLD
    cases = json.loads(sys.argv[2])
    x = make_input("adversarial", "float32", 1001, comm.rank, comm.size)
    outs = {}
    for i, (collective, algorithm, options) in enumerate(cases):
        call = getattr(refcoll, collective)
        outs[f"c{i}"] = call(x, comm, algorithm=algorithm, **options)
    y = x.copy()
    refcoll.allreduce(y, comm, algorithm="ring", start="own", out=y)
    outs["inplace"] = y
    np.savez(f"{sys.argv[1]}/rank{comm.rank}.npz", **outs)
""")
MPI_CASES = [("allreduce", "ring", {}), ("allreduce", "ring", {"start": "own"}),
             ("allreduce", "ring", {"direction": "reverse", "split": "gloo"}),
             ("allreduce", "ring", {"direction": "reverse", "start": "own", "split": "last"}),
             ("allreduce", "ring", {"split": "ceil"}),
             ("reduce_scatter", "ring", {"direction": "reverse"}),
             ("reduce_scatter", "ring", {"direction": "reverse", "split": "gloo"}),
             ("allreduce", "naive", {"fold": "right"}),
             ("reduce_scatter", "naive", {"fold": "right"})]


@pytest.mark.skipif(mpiexec_path() is None,
                    reason="no mpiexec: install with pip install 'refcoll[mpi]'")
def test_mpi_gives_the_simulators_bits_under_every_order(tmp_path):
    p = 3
    res = run_script(tmp_path, p, MPI_SCRIPT, [str(tmp_path), json.dumps(MPI_CASES)])
    assert res.returncode == 0, res.stderr[-3000:]
    got = [np.load(tmp_path / f"rank{r}.npz") for r in range(p)]
    xs = make_inputs("adversarial", "float32", 1001, p)
    for i, (collective, algorithm, options) in enumerate(MPI_CASES):
        want = refcoll.simulate(collective, xs, algorithm=algorithm, **options).outputs
        for r in range(p):
            assert _bits(got[r][f"c{i}"]) == _bits(want[r]), (collective, algorithm, options, r)
    own = refcoll.simulate("allreduce", xs, algorithm="ring", start="own").outputs
    assert all(_bits(got[r]["inplace"]) == _bits(own[r]) for r in range(p))


@pytest.mark.parametrize("p", [3, 4, 5])
def test_reverse_own_reduce_scatter_is_mpich_pairwise_fold(p):
    """MPICH's pairwise reduce-scatter: chunk r = ((x_r + x_(r-1)) + x_(r-2)) + ... + x_(r+1)."""
    rng = np.random.default_rng(p)
    n = 7 * p + 2
    xs = [(rng.standard_normal(n) * 10.0 ** rng.integers(-6, 7, n)).astype(np.float32)
          for _ in range(p)]
    res = refcoll.simulate("reduce_scatter", xs, algorithm="ring", op="sum",
                           direction="reverse", start="own")
    bounds = chunk_bounds(n, p)
    for r in range(p):
        lo, hi = bounds[r]
        acc = xs[r][lo:hi].copy()
        for i in range(1, p):
            acc = (acc + xs[(r - i) % p][lo:hi]).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(res.outputs[r]).view(np.uint32),
                                      acc.view(np.uint32))
    assert {"direction": "reverse", "start": "own"} in ring_orders("reduce_scatter", p)
