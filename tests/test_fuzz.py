"""Property-based fuzzing of every registered algorithm over the simulator (hypothesis).

One drawn case is: an algorithm (every entry of the registry, ``auto`` and
``switch`` included), a collective it implements, ``p`` data ranks (1..9), a count
(0..300), a dtype and op that go together (:func:`refcoll.core.ops.supports`),
the algorithm's options (``hierarchical``: ``ranks_per_node`` 1..p and ``inter``;
``tree``/``dbtree``: ``segment`` 1..64; ``switch``: ``radix`` 2..4, ``packet``
1..64, ``slots`` 1..4), in place or out of place, the root, the input kind
(``exact``/``random``, :mod:`refcoll.verify.inputs`) and the seed. In the
default test a call splits its buffer into at most :data:`MAX_PIECES` segments
or packets (``segment`` and ``packet`` at least count / MAX_PIECES), each a
message per tree edge: enough to fill every pipeline drawn (at most 4 levels at
9 ranks) and to reuse a switch's pool of at most 4 slots four times over; the
ledger tests of test_tree.py and test_switch.py run calls of over a hundred.

The case runs through the public API on a :class:`~refcoll.SimWorld` (argument
agreement on, in place as the API documents it per collective; switch ranks
added after the data ranks), and the checks are:

* it finishes: a :class:`~refcoll.DeadlockError` fails the test, and a world
  timeout turns a hang into a failure too;
* every rank's result is bitwise what :func:`refcoll.simulate` predicts for the
  same algorithm and options (the out-of-place oracle run), so in place and out
  of place agree bit for bit;
* integers, ``exact`` float inputs, ``min``/``max``, allgather and broadcast:
  equal to :func:`refcoll.verify.oracle.fold` (the gathered or broadcast data) bit for
  bit (``min``/``max`` of ``random`` floats by value: a ``±0`` tie's sign shows
  the order);
* ``random`` floats with ``sum``/``avg``/``prod``: no element outside
  :func:`refcoll.verify.oracle.bound_violations`;
* all-reduce, allgather and broadcast: every rank holds the same bits;
* out of place: the input is unchanged; in place: the result is the ``out=``
  buffer; no message is left unreceived;
* the oracle run's ledger equals the algorithm's cost function with the same
  options (except ``hierarchical`` over ``naive``/``dbtree``/``auto``, whose
  counts :func:`refcoll.core.cost.hierarchical_allreduce` documents as estimates).

The default test is deterministic (``derandomize=True``) and small enough for
CI; ``test_fuzz_long`` (``-m slow``) runs many more examples, and
``REFCOLL_FUZZ_EXAMPLES`` sets how many.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, note, settings
from hypothesis import strategies as st

import refcoll
from refcoll import algorithms
from refcoll.core.chunking import chunk_slice
from refcoll.core.errors import DeadlockError
from refcoll.core.ops import DTYPES, OPS, is_float, supports
from refcoll.transport import SimWorld
from refcoll.verify.inputs import make_inputs
from refcoll.verify.oracle import bound_violations, fold

MAX_P = 9
#: The rank counts, in shrinking order (a failure shrinks towards p = 2). A
#: ``sampled_from`` spreads the draws evenly where ``integers`` piles half of
#: them on p = 1 once a case draws many values.
P_CHOICES = (*range(2, MAX_P + 1), 1)
MAX_COUNT = 300
#: The most segments (tree, dbtree) or packets (switch) a call of the default test
#: splits its buffer into; ``test_fuzz_long`` draws any.
MAX_PIECES = 16
#: Seconds any one simulated wait may take: a hang fails the example instead of CI.
WAIT_LIMIT = 60.0
REDUCING = ("allreduce", "reduce_scatter", "reduce")
ROOTED = ("broadcast", "reduce")
#: Collectives whose result every rank must hold bit for bit.
REPLICATED = ("allreduce", "allgather", "broadcast")
#: Inter-node all-reduces whose hierarchical composition cost.py states exactly.
EXACT_INTER = ("ring", "recursive_doubling", "rabenseifner", "tree")
#: What hierarchical may run across nodes: any flat all-reduce without extra ranks.
INTER = tuple(n for n in algorithms.names("allreduce")
              if n != "hierarchical" and algorithms.get(n).extra_ranks is None)


@dataclass(frozen=True)
class FuzzCase:
    """One drawn case; ``repr`` is a reproducer."""

    algorithm: str
    collective: str
    p: int
    count: int
    dtype: str
    op: str | None
    kind: str
    inplace: bool
    root: int
    options: tuple
    seed: int

    @property
    def kwargs(self) -> dict:
        return dict(self.options)

    @property
    def order_dependent(self) -> bool:
        """Whether the result depends on the reduction order (judged by the bound)."""
        return (self.kind == "random" and self.op in ("sum", "avg", "prod")
                and is_float(DTYPES[self.dtype]))

    def reproducer(self) -> str:
        root = f", root={self.root}" if self.collective in ROOTED else ""
        op = f", op={self.op!r}" if self.op else ""
        opts = "".join(f", {k}={v!r}" for k, v in self.options)
        return (f"xs = make_inputs({self.kind!r}, {self.dtype!r}, {self.count}, {self.p}, "
                f"op={self.op or 'sum'!r}, seed={self.seed}); refcoll.simulate("
                f"{self.collective!r}, xs, algorithm={self.algorithm!r}{op}{root}{opts})"
                f"  # inplace={self.inplace}")


@st.composite
def algorithm_options(draw, name: str, p: int, count: int,
                      max_pieces: int | None = None) -> tuple:
    """Draw the options of ``name``; absent keys keep the algorithm's defaults.

    ``max_pieces``: the most segments or packets a call of ``count`` elements may
    split its buffer into (``None``: any).
    """
    least = 1 if max_pieces is None else max(1, -(-count // max_pieces))
    options = {}
    if name == "hierarchical":
        if draw(st.booleans()):
            options["ranks_per_node"] = draw(st.integers(1, p))
        options["inter"] = draw(st.sampled_from(INTER))
    elif name in ("tree", "dbtree"):
        if draw(st.integers(0, 4)):  # mostly segmented, sometimes the default
            options["segment"] = draw(st.integers(least, 64))
    elif name == "switch":
        options["radix"] = draw(st.integers(2, 4))
        options["packet"] = draw(st.integers(least, 64))
        options["slots"] = draw(st.integers(1, 4))
    return tuple(sorted(options.items()))


@st.composite
def fuzz_cases(draw, max_pieces: int | None = None) -> FuzzCase:
    name = draw(st.sampled_from(list(algorithms.REGISTRY)))
    collective = draw(st.sampled_from(algorithms.get(name).collectives))
    p = draw(st.sampled_from(P_CHOICES))
    count = draw(st.integers(0, MAX_COUNT))
    op = draw(st.sampled_from(list(OPS))) if collective in REDUCING else None
    dtype = draw(st.sampled_from([d for d in DTYPES if supports(op, d)]))
    kind = draw(st.sampled_from(["exact", "random"])) if is_float(DTYPES[dtype]) else "exact"
    inplace = draw(st.booleans())
    root = draw(st.integers(0, p - 1)) if collective in ROOTED else 0
    options = draw(algorithm_options(name, p, count, max_pieces))
    seed = draw(st.integers(0, 2**16))
    return FuzzCase(name, collective, p, count, dtype, op, kind, inplace, root, options, seed)


# ------------------------------------------------------------------- running a case

def _call(t, case: FuzzCase, x: np.ndarray):
    """Run the case's public collective on this rank; return ``(result, out= buffer or None)``."""
    rank = t.rank
    opts = {"algorithm": case.algorithm, **case.kwargs}
    if case.collective == "allreduce":
        target = x if case.inplace else None
        return refcoll.allreduce(x, t, op=case.op, out=target, **opts), target
    if case.collective == "reduce_scatter":  # in place: out= is chunk r of the input
        target = x[chunk_slice(x.size, t.size, rank)] if case.inplace else None
        return refcoll.reduce_scatter(x, t, op=case.op, out=target, **opts), target
    if case.collective == "allgather":  # in place: the input is row r of out=
        if not case.inplace:
            return refcoll.allgather(x, t, **opts), None
        target = np.empty((t.size, x.size), dtype=x.dtype)
        target[rank] = x
        return refcoll.allgather(target[rank], t, out=target, **opts), target
    if case.collective == "broadcast":
        target = x if case.inplace else None
        return refcoll.broadcast(x, case.root, t, out=target, **opts), target
    target = x if (case.inplace and rank == case.root) else None
    return refcoll.reduce(x, case.root, t, op=case.op, out=target, **opts), target


def _extra_ranks(case: FuzzCase) -> int:
    algo = algorithms.get(case.algorithm)
    return 0 if algo.extra_ranks is None else algo.extra_ranks(case.p, **case.kwargs)


def run_public(case: FuzzCase, inputs: list[np.ndarray]):
    """Run the case over the public API on a SimWorld; return per-rank (x, result, target)."""
    switches = _extra_ranks(case)
    world = SimWorld(case.p + switches, timeout=WAIT_LIMIT)
    args = [(x.copy(),) for x in inputs] + [(np.zeros_like(inputs[0]),)] * switches
    transports = {}

    def rank_main(t, x):
        transports[t.rank] = t
        result, target = _call(t, case, x)
        return x, result, target

    ran = world.run(rank_main, args)
    unreceived = [m for t in transports.values() for m in t.unreceived()]
    assert not unreceived, f"left unreceived: {unreceived[:3]}"
    for served in ran[case.p:]:
        assert served[1] is None, "a switch rank returned a result"
    return ran[:case.p]


def expected_results(case: FuzzCase, inputs) -> list:
    """Every rank's reference: the fold (its chunk), the gathered rows, or the root's data."""
    p, n = case.p, case.count
    if case.collective == "allgather":
        return [np.stack(inputs)] * p
    if case.collective == "broadcast":
        return [inputs[case.root]] * p
    full = fold(case.op, inputs)
    if case.collective == "reduce_scatter":
        return [full[chunk_slice(n, p, r)] for r in range(p)]
    if case.collective == "reduce":
        return [full if r == case.root else None for r in range(p)]
    return [full] * p


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def _first_difference(got: np.ndarray, want: np.ndarray) -> str:
    g = got.reshape(-1).view(np.uint8).reshape(got.size, -1)
    w = want.reshape(-1).view(np.uint8).reshape(want.size, -1)
    differs = np.flatnonzero((g != w).any(axis=1))
    i = int(differs[0])
    return (f"element {i} is {got.reshape(-1)[i]!r}, expected {want.reshape(-1)[i]!r} "
            f"({len(differs)} of {got.size} differ)")


def check_case(case: FuzzCase) -> None:
    """Run one case and assert every property of the module docstring."""
    dtype = DTYPES[case.dtype]
    inputs = make_inputs(case.kind, dtype, case.count, case.p, op=case.op or "sum",
                         seed=case.seed)
    predict = {"root": case.root} if case.collective in ROOTED else {}
    try:
        ran = run_public(case, inputs)
        oracle = refcoll.simulate(case.collective, inputs, algorithm=case.algorithm,
                                  op=case.op or "sum", timeout=WAIT_LIMIT, **predict,
                                  **case.kwargs)
    except DeadlockError as exc:
        pytest.fail(f"deadlock detector fired: {exc}\n{case.reproducer()}")
    expected = expected_results(case, inputs)

    for r, (x, result, target) in enumerate(ran):
        where = f"rank {r}"
        want, predicted = expected[r], oracle.outputs[r]
        if want is None:
            assert result is None, f"{where}: a non-root of reduce returned a result"
            assert predicted is None
            continue
        assert result is not None, f"{where}: returned None"
        assert result.dtype == dtype and result.size == want.size, (
            f"{where}: got {result.dtype}[{result.size}], expected {dtype}[{want.size}]")
        got = result.reshape(-1)
        if case.inplace:
            assert target is None or got.size == 0 or np.shares_memory(result, target), (
                f"{where}: an in-place call did not return its out= buffer")
        else:
            assert _bits(x) == _bits(inputs[r]), f"{where}: an out-of-place call modified its input"
        assert _bits(got) == _bits(np.asarray(predicted).reshape(-1)), (
            f"{where}: differs from refcoll.simulate's prediction: "
            f"{_first_difference(got, np.asarray(predicted))}")
        flat_want = want.reshape(-1)
        if case.order_dependent:
            sl = chunk_slice(case.count, case.p, r) if case.collective == "reduce_scatter" \
                else slice(None)
            idx, err, bound = bound_violations(case.op, [a[sl] for a in inputs], got)
            assert not len(idx), (f"{where}: element {int(idx[0])} off by {err[0]:.3g}, over "
                                  f"the error bound {bound[0]:.3g} ({len(idx)} elements)")
        elif case.op in ("min", "max") and case.kind == "random":
            assert np.array_equal(got, flat_want, equal_nan=True), (
                f"{where}: {_first_difference(got, flat_want)}")
        else:
            assert _bits(got) == _bits(flat_want), f"{where}: {_first_difference(got, flat_want)}"

    if case.collective in REPLICATED:
        first = _bits(ran[0][1])
        differing = [r for r, (_, result, _) in enumerate(ran) if _bits(result) != first]
        assert not differing, f"ranks {differing} hold different bits from rank 0"

    _check_cost(case, oracle.ledger, dtype.itemsize)


def _check_cost(case: FuzzCase, ledger, itemsize: int) -> None:
    algo = algorithms.get(case.algorithm)
    cost_fn = algo.costs.get(case.collective)
    if cost_fn is None:
        return
    if case.algorithm == "hierarchical" and case.kwargs.get("inter", "ring") not in EXACT_INTER:
        return  # documented as estimates in refcoll.core.cost.hierarchical_allreduce
    predicted = cost_fn(case.p, case.count, itemsize, **case.kwargs)
    assert ledger.counts() == predicted.counts(), (
        f"the ledger {ledger.counts()} differs from {case.algorithm}'s cost function "
        f"{predicted.counts()}")


# ----------------------------------------------------------------------------- tests

#: Options of the explicit examples: odd node shapes, short segments, small pools.
_EXAMPLE_OPTIONS = {
    "hierarchical": ((("inter", "ring"), ("ranks_per_node", 2)),
                     (("inter", "rabenseifner"), ("ranks_per_node", 2))),
    "tree": ((("segment", 3),), (("segment", 1),)),
    "dbtree": ((("segment", 3),), (("segment", 1),)),
    "switch": ((("packet", 3), ("radix", 2), ("slots", 2)),
               (("packet", 1), ("radix", 3), ("slots", 1))),
}


def covering_cases() -> list[FuzzCase]:
    """Two fixed cases per (algorithm, collective) of the registry, so each always runs.

    5 ranks, 7 elements, random float32 ``sum`` in place at root 4 (unequal
    nodes 2+2+1 for hierarchical); and 4 ranks, 3 elements (n < p), int32 ``avg``
    out of place at root 1 (equal nodes).
    """
    cases = []
    for name, algo in algorithms.REGISTRY.items():
        first, second = _EXAMPLE_OPTIONS.get(name, ((), ()))
        for coll in algo.collectives:
            reducing = coll in REDUCING
            cases.append(FuzzCase(name, coll, 5, 7, "float32", "sum" if reducing else None,
                                  "random", True, 4 if coll in ROOTED else 0, first, 1))
            cases.append(FuzzCase(name, coll, 4, 3, "int32", "avg" if reducing else None,
                                  "exact", False, 1 if coll in ROOTED else 0, second, 2))
    return cases


def with_covering_examples(test):
    """Add :func:`covering_cases` to a hypothesis test as explicit examples."""
    for case in covering_cases():
        test = example(case)(test)
    return test


@pytest.fixture(autouse=True, scope="module")
def short_switch_interval():
    """Let simulated ranks hand over the GIL after 1 ms instead of 5 ms.

    Every rendezvous wakes a waiting thread, which otherwise waits for the
    running one's 5 ms switch interval: a 4-5x faster wall time, same results.
    """
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-3)
    yield
    sys.setswitchinterval(previous)


@settings(max_examples=250, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@with_covering_examples
@given(fuzz_cases(max_pieces=MAX_PIECES))
def test_fuzz(case):
    note(case.reproducer())
    check_case(case)


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("REFCOLL_FUZZ_EXAMPLES", "3000")), deadline=None,
          database=None, suppress_health_check=[HealthCheck.too_slow])
@given(fuzz_cases())
def test_fuzz_long(case):
    """Run it long once: random (not derandomized) draws; ``--hypothesis-seed`` replays one run."""
    note(case.reproducer())
    check_case(case)
