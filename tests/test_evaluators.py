"""Every evaluator gives, bit for bit, what the simulated algorithm gives.

``refcoll check --identify`` computes some orders with an evaluator
(:mod:`refcoll.verify.evaluators`) instead of simulating the algorithm. The
principle "the oracle is the algorithm itself" holds only while each evaluator
equals its algorithm's simulated run: here over the battery's inputs (every kind,
reducing dtype and op, the battery's sizes, p from 1 to 9, every order identify
tries) and over the golden vectors of the algorithms that have one, non-finite
values included.
"""

from __future__ import annotations

import numpy as np
import pytest

from refcoll.core.bits import same_bits
from refcoll.core.ops import DTYPES, supports
from refcoll.verify import vectors
from refcoll.verify.conformance.cases import default_sizes
from refcoll.verify.evaluators import EVALUATORS, evaluate
from refcoll.verify.identify import candidate_orders, identify
from refcoll.verify.inputs import make_inputs
from refcoll.verify.oracle import expected_outputs

DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "int8", "int32", "uint16")


def _same(a, b) -> bool:
    return len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))


def _orders(p: int):
    return [(name, options) for name, options in candidate_orders("allreduce", p)
            if name in EVALUATORS]


def _grid(p: int, whole: bool):
    """Yield ``(dtype, op, kind, n)``: the battery's whole grid, or a cross-section of it."""
    for dtype in DTYPE_NAMES:
        for op in ("sum", "avg", "prod", "min", "max"):
            if not supports(op, dtype):
                continue
            kinds = ("exact", "random", "adversarial") if dtype.startswith(("float", "bf")) \
                else ("exact",)
            for kind in kinds:
                for n in default_sizes(p) if dtype == "float32" else (p + 1, 37):
                    if whole or (dtype, kind, n) in CROSS_SECTION.get(op, ()):
                        yield dtype, op, kind, n


#: The default run's cross-section: every op on float32 at two sizes, each other dtype once.
CROSS_SECTION = {
    "sum": {("float32", "random", 0), ("float32", "random", 5003), ("float32", "exact", 5003),
            ("float32", "adversarial", 5003), ("float16", "random", 37),
            ("float64", "random", 37), ("int32", "exact", 37), ("int8", "exact", 37)},
    "avg": {("float32", "random", 5003), ("bfloat16", "random", 37), ("uint16", "exact", 37)},
    "prod": {("float32", "random", 5003)},
    "min": {("float32", "random", 5003)},
    "max": {("float32", "random", 5003), ("float16", "random", 37)},
}


def _check_grid(p: int, whole: bool) -> int:
    checked = 0
    for dtype, op, kind, n in _grid(p, whole):
        inputs = make_inputs(kind, DTYPES[dtype], n, p, op=op, seed=p)
        for name, options in _orders(p):
            got = evaluate("allreduce", inputs, algorithm=name, op=op, **options)
            if got is None:
                continue
            want = expected_outputs("allreduce", inputs, algorithm=name, op=op, **options)
            assert _same(got, want), (name, options, dtype, op, kind, n)
            checked += 1
    return checked


@pytest.mark.parametrize("p", [3, 6])
def test_every_evaluator_is_its_algorithm_on_a_cross_section_of_the_battery(p):
    assert _check_grid(p, whole=False) > 100


@pytest.mark.slow
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 6, 8, 9])
def test_every_evaluator_is_its_algorithm_on_the_batterys_whole_grid(p):
    assert _check_grid(p, whole=True) > 100 or p == 1


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # inf - inf and the overflow, on purpose
def test_non_finite_values_fold_as_the_algorithm_folds_them():
    p = 5
    inputs = make_inputs("random", np.dtype(np.float32), 41, p, seed=9)
    inputs[1][3], inputs[2][3] = np.inf, -np.inf  # inf - inf: NaN
    inputs[3][7] = np.nan
    inputs[4][11] = np.float32(3e38)  # an overflow to inf on the way
    inputs[0][11] = np.float32(3e38)
    for name, options in _orders(p):
        got = evaluate("allreduce", inputs, algorithm=name, op="sum", **options)
        if got is not None:
            want = expected_outputs("allreduce", inputs, algorithm=name, op="sum", **options)
            assert _same(got, want), (name, options)
    for name, options in candidate_orders("allreduce", p):  # and block by block
        want = expected_outputs("allreduce", inputs, algorithm=name, op="sum", **options)
        got = _blockwise_outputs(inputs, name, options, "sum", cuts=(4, 9, 30))
        assert got is not None and _same(got, want), (name, options)


def test_every_evaluator_is_its_algorithm_on_the_golden_vectors():
    checked = 0
    for v in vectors.plan():
        if v.algorithm not in EVALUATORS or v.collective != "allreduce":
            continue
        inputs = v.inputs()
        got = evaluate("allreduce", inputs, algorithm=v.algorithm, op=v.op or "sum",
                       **dict(v.options))
        if got is None:  # an option no evaluator covers (the switch's int mode): simulated
            continue
        assert _same(got, v.run(inputs)), v.filename
        checked += 1
    assert checked >= 40


def test_what_no_evaluator_covers_is_left_to_the_simulator():
    inputs = make_inputs("random", np.dtype(np.float32), 10, 6, seed=1)
    assert evaluate("allreduce", inputs, algorithm="switch", mode="int") is None
    assert evaluate("reduce_scatter", inputs, algorithm="ring") is None
    assert evaluate("allreduce", inputs, algorithm="hierarchical", ranks_per_node=4) is None
    assert evaluate("allreduce", inputs, algorithm="hierarchical", pipeline=2) is None
    assert evaluate("allreduce", inputs, algorithm="tree") is None


def test_identify_names_the_same_orders_with_and_without_evaluators(monkeypatch):
    p = 6
    inputs = make_inputs("adversarial", np.dtype(np.float32), 301, p, seed=4)
    for truth in ("switch", "ring", "hierarchical"):
        outputs = expected_outputs("allreduce", inputs, algorithm=truth)
        fast = identify(inputs, outputs, known=[])
        with monkeypatch.context() as m:
            m.setattr("refcoll.verify.identify.evaluate", lambda *a, **k: None)
            slow = identify(inputs, outputs, known=[])
        assert fast.matches == slow.matches and truth in fast.matches
        assert [c.digest for c in fast.candidates] == [c.digest for c in slow.candidates]
        assert [(c.differing, c.ulps) for c in fast.candidates] == \
            [(c.differing, c.ulps) for c in slow.candidates]


@pytest.mark.parametrize("p", [1, 2, 5, 8])
def test_the_rings_blocks_are_its_algorithm_block_by_block(p):
    # check --algorithm ring and refcoll oracle --algorithm ring fold the ring block by
    # block (evaluators.ring_blocks): each block, of any length and wherever it cuts the
    # ring's chunks, holds the simulated run's elements, under every order option.
    from refcoll.verify.evaluators import rank_blockwise, ring_blocks

    for dtype, op, kind, n in [("float32", "sum", "adversarial", 1003),
                               ("bfloat16", "avg", "random", 37), ("int32", "sum", "exact", 40),
                               ("float16", "max", "random", 0)]:
        xs = make_inputs(kind, dtype, n, p, op=op, seed=p)
        cols = np.stack(xs).reshape(p, -1)
        for name, options in candidate_orders("allreduce", p):
            if name != "ring":
                continue
            want = expected_outputs("allreduce", xs, algorithm="ring", op=op, **options)[0]
            fold = ring_blocks("allreduce", p, n, np.dtype(xs[0].dtype).itemsize, op=op,
                               **options)
            for length in (1, 7, n or 1):
                blocks = [fold(cols[:, lo:lo + length], lo) for lo in range(0, n, length)]
                got = np.concatenate(blocks) if blocks else np.empty(0, xs[0].dtype)
                assert same_bits(got, want.reshape(-1)), (dtype, op, options, length)
    assert ring_blocks("reduce_scatter", p, 10, 4) is None
    assert rank_blockwise("reduce_scatter", p, 10, 4, algorithm="tree") is None  # none such


def _blockwise_outputs(xs, name, options, op, cuts, collective="allreduce", root=0):
    """Every rank's output of ``name`` from its rank block evaluator, block by block."""
    from refcoll.verify.evaluators import rank_blockwise

    p, n = len(xs), xs[0].size
    cols = np.stack(xs).reshape(p, -1)
    fold = rank_blockwise(collective, p, n, cols.dtype.itemsize, algorithm=name, op=op,
                          root=root, **options)
    if fold is None:
        return None
    bounds = [0, *[c for c in cuts if 0 < c < n], n]
    blocks = [fold(cols[:, lo:hi], lo) for lo, hi in zip(bounds, bounds[1:]) if lo < hi]
    return [None if blocks[0][r] is None else np.concatenate([b[r] for b in blocks])
            for r in range(p)]


@pytest.mark.parametrize("p", [3, 4, 8])
def test_every_orders_rank_blocks_are_its_algorithm_block_by_block(p):
    # check --identify of an all-reduce larger than memory tries each order block by block
    # (evaluators.rank_blockwise): every candidate order, cut anywhere, against the
    # algorithm run on the whole buffer, every rank's bits.
    for dtype, op, kind, n in [("float32", "sum", "adversarial", 301),
                               ("bfloat16", "avg", "random", 37), ("float32", "prod", "random", 9),
                               ("int32", "sum", "exact", 40), ("float16", "max", "random", 3)]:
        xs = make_inputs(kind, dtype, n, p, op=op, seed=p)
        for name, options in candidate_orders("allreduce", p):
            want = expected_outputs("allreduce", xs, algorithm=name, op=op, **options)
            got = _blockwise_outputs(xs, name, options, op, cuts=(5, 70, n // 2 + 1))
            assert got is not None and _same(got, [np.asarray(w).reshape(-1) for w in want]), \
                (name, options, dtype, op, n)
        for name, options in candidate_orders("reduce", p):  # to the last rank
            want = expected_outputs("reduce", xs, algorithm=name, op=op, root=p - 1, **options)
            got = _blockwise_outputs(xs, name, options, op, cuts=(5, 70, n // 2 + 1),
                                     collective="reduce", root=p - 1)
            assert got is not None and got[:-1] == [None] * (p - 1), (name, options)
            assert same_bits(got[-1], np.asarray(want[-1]).reshape(-1)), (name, options, dtype)


def test_identify_block_by_block_gives_what_whole_arrays_give():
    from refcoll.verify.identify import identify_blocks

    p = 6
    xs = make_inputs("adversarial", np.dtype(np.float32), 700, p, seed=5)
    for truth, options in (("dbtree", {}), ("hierarchical", {"ranks_per_node": 3}),
                           ("rabenseifner", {"pairing": "near"})):
        outputs = expected_outputs("allreduce", xs, algorithm=truth, **options)
        whole = identify(xs, outputs, known=[])
        blocks = identify_blocks(xs, outputs, known=[], budget=8 * p * 4 * 97)  # 97 a block
        assert blocks.matches == whole.matches and blocks.untried == []
        assert any(label.startswith(truth) for label in blocks.matches)
        assert [(c.label, c.differing, c.total, c.ulps) for c in blocks.candidates] == \
            [(c.label, c.differing, c.total, c.ulps) for c in whole.candidates]
        assert blocks.groups(blocks.matches) == whole.groups(whole.matches)
    outputs[2] = outputs[2].copy()
    outputs[2][650] = np.nextafter(outputs[2][650], np.float32(np.inf))  # rank 2 alone, 1 ulp
    blocks = identify_blocks(xs, outputs, known=[], budget=8 * p * 4 * 97)
    assert not blocks.matches and blocks.nearest[1:] == (1, p * 700)
    assert blocks.nearest == identify(xs, outputs, known=[]).nearest
    reduced = expected_outputs("reduce", xs, algorithm="tree", root=2, radix=3,
                               subtrees="shrinking")
    whole = identify(xs, reduced, collective="reduce", root=2, known=[])
    blocks = identify_blocks(xs, reduced, collective="reduce", root=2, known=[], budget=9999)
    assert "tree(radix=3, subtrees=shrinking)" in blocks.matches == whole.matches
    assert [(c.label, c.differing, c.ulps) for c in blocks.candidates] == \
        [(c.label, c.differing, c.ulps) for c in whole.candidates]
    outputs[4] = outputs[4][:-1]  # of another size: every element differs, as identify says
    blocks = identify_blocks(xs, outputs, known=[], budget=8 * p * 4 * 97)
    assert blocks.nearest == identify(xs, outputs, known=[]).nearest == \
        (blocks.nearest[0], 1 + 699, p * 700 - 1)


def _held_outputs(xs, name, options, op, cuts, collective, root=0):
    """Every holding rank's output from the order's block evaluator, fed the reference
    vector cut at ``cuts``: a reduction's operands, or a data movement's data."""
    from refcoll.verify.evaluators import DATA_MOVEMENT, rank_blockwise
    from refcoll.verify.oracle import spans_held

    p, n = len(xs), xs[0].size
    cols = np.stack(xs).reshape(p, -1)
    data = cols.reshape(-1) if collective == "allgather" else cols[root]
    fold = rank_blockwise(collective, p, n, cols.dtype.itemsize, algorithm=name, op=op,
                          root=root, **options)
    spans = spans_held(collective, p, n, root)
    total = p * n if collective == "allgather" else n
    bounds = [0, *sorted({c for c in cuts if 0 < c < total}), total]
    held = {r: [np.empty(0, cols.dtype)] for r in spans}
    for lo, hi in zip(bounds, bounds[1:]):
        predicted = fold(data[lo:hi] if collective in DATA_MOVEMENT else cols[:, lo:hi], lo)
        for r, span in spans.items():
            a, b = max(lo, span.start), min(hi, span.stop)
            if a < b:
                held[r].append(predicted[r][a - lo:b - lo])
    return {r: np.concatenate(parts) for r, parts in held.items()}


@pytest.mark.parametrize("p", [3, 4, 5, 8])
def test_every_reduce_scatter_allgather_and_broadcast_order_block_by_block(p):
    # check --algorithm, --identify and oracle of these collectives read their files a
    # block at a time (evaluators.rank_blockwise): every candidate order, cut anywhere
    # (across the chunks the ranks hold), against the algorithm run on the whole buffer.
    for dtype, op, kind, n in [("float32", "sum", "adversarial", 301),
                               ("bfloat16", "avg", "random", 37), ("float32", "prod", "random", 9),
                               ("int32", "sum", "exact", 40), ("float16", "max", "random", 3)]:
        xs = make_inputs(kind, dtype, n, p, op=op, seed=p)
        for collective in ("reduce_scatter", "allgather", "broadcast"):
            total = p * n if collective == "allgather" else n
            for name, options in candidate_orders(collective, p):
                want = expected_outputs(collective, xs, algorithm=name, op=op, root=p - 1,
                                        **options)
                got = _held_outputs(xs, name, options, op, (1, 5, total // 3 + 1, total - 2),
                                    collective, root=p - 1)
                assert all(same_bits(got[r], np.asarray(want[r]).reshape(-1))
                           for r in range(p)), (collective, name, options, dtype, op)


def test_autos_blocks_are_those_of_what_it_picks_as_the_simulator_runs_it(monkeypatch):
    # check and oracle --algorithm auto of a reduction read block by block too: auto's pick
    # in the oracle's simulator depends on the collective, p, count and width alone (and on
    # REFCOLL_ALGO), so the picked algorithm's blocks are auto's, across the sizes where
    # the pick changes.
    from refcoll.verify.evaluators import rank_blockwise

    for p, n in [(2, 7), (3, 1000), (4, 5000), (5, 40000), (8, 300000), (16, 100)]:
        xs = make_inputs("adversarial", "float32", n, p, seed=p)
        for collective in ("allreduce", "reduce", "reduce_scatter"):
            want = expected_outputs(collective, xs, algorithm="auto", root=p - 1)
            got = _held_outputs(xs, "auto", {}, "sum", (n // 3, n // 2 + 1), collective,
                                root=p - 1)
            assert all(same_bits(got[r], np.asarray(want[r]).reshape(-1)) for r in got), \
                (p, n, collective)
    monkeypatch.setenv("REFCOLL_ALGO", "ring")
    xs = make_inputs("adversarial", "float32", 300, 5, seed=1)
    got = _held_outputs(xs, "auto", {}, "sum", (100,), "allreduce")
    assert all(same_bits(got[r], expected_outputs("allreduce", xs, algorithm="ring")[r])
               for r in got)
    monkeypatch.setenv("REFCOLL_TUNING_FILE", "tuning.json")  # its rules: the simulator's
    assert rank_blockwise("allreduce", 5, 300, 4, algorithm="auto") is None


def test_identify_block_by_block_of_the_other_collectives_gives_what_whole_arrays_give():
    from refcoll.verify.identify import identify_blocks

    p, n = 5, 203
    xs = make_inputs("adversarial", np.dtype(np.float32), n, p, seed=7)
    for collective, truth in (("reduce_scatter", "bruck"), ("reduce_scatter", "rabenseifner"),
                              ("reduce_scatter", "ring"), ("allgather", "ring"),
                              ("broadcast", "tree")):
        outputs = expected_outputs(collective, xs, algorithm=truth, root=3)
        whole = identify(xs, outputs, collective=collective, root=3, known=[])
        blocks = identify_blocks(xs, outputs, collective=collective, root=3, known=[],
                                 budget=8 * p * 4 * 31)  # 31 elements a block
        assert truth in blocks.matches == whole.matches and blocks.untried == []
        assert [(c.label, c.differing, c.total, c.ulps) for c in blocks.candidates] == \
            [(c.label, c.differing, c.total, c.ulps) for c in whole.candidates], collective
    outputs = expected_outputs("reduce_scatter", xs, algorithm="bruck")
    outputs[1] = outputs[1].copy()
    outputs[1][7] = np.nextafter(outputs[1][7], np.float32(np.inf))  # rank 1 alone, 1 ulp
    outputs[4] = outputs[4][:-1]  # of another size: every element differs
    whole = identify(xs, outputs, collective="reduce_scatter", known=[])
    blocks = identify_blocks(xs, outputs, collective="reduce_scatter", known=[], budget=999)
    assert not blocks.matches and blocks.nearest == whole.nearest
    assert blocks.nearest[0] == "bruck" and blocks.nearest[1] == 1 + outputs[4].size


def test_every_orders_rank_blocks_are_its_algorithm_on_the_golden_vectors():
    checked = 0
    for v in vectors.plan():
        if v.algorithm == "auto":
            continue
        inputs = [np.asarray(x).reshape(-1) for x in v.inputs()]
        n = inputs[0].size
        if v.collective in ("reduce_scatter", "allgather", "broadcast"):
            options = dict(v.options)
            root = options.pop("root", 0)
            got = _held_outputs(inputs, v.algorithm, options, v.op or "sum",
                                (3, n // 2 + 1), v.collective, root=root)
            assert all(same_bits(got[r], np.asarray(w).reshape(-1))
                       for r, w in enumerate(v.run(v.inputs()))), v.filename
            checked += 1
            continue
        if v.collective != "allreduce" or not n:
            continue
        got = _blockwise_outputs(inputs, v.algorithm, dict(v.options), v.op or "sum",
                                 cuts=(3, n // 2 + 1))
        options = dict(v.options)
        if got is None:  # nodes of unequal size (the leader fallback), the switch's int mode
            assert (v.algorithm == "hierarchical" and len(inputs) % options["ranks_per_node"]) \
                or options.get("mode") == "int", v.filename
            continue
        assert _same(got, [np.asarray(w).reshape(-1) for w in v.run(v.inputs())]), v.filename
        checked += 1
    assert checked >= 40
