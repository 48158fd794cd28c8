"""The oracle's IEEE rules: overflow, underflow, NaN and infinities judged by what legal
orders give (spec/README.md, "What a legal order can give").

Every expectation is derived here, independently of :mod:`refcoll.verify.ieee`: the
legal results of an element are found by enumerating every reduction tree over its
``p`` operands (every full binary tree with its leaves in any order, each operation
rounded in the dtype by NumPy), and for ``max``/``min`` also every operand position
under C's ``a > b ? a : b``. A non-finite (or, for ``prod``, zero) result conforms
exactly when some tree gives it; a finite result that some tree gives must conform,
and one outside the documented bound, computed here with exact fractions, must not.
"""

from fractions import Fraction

import numpy as np
import pytest
from ml_dtypes import finfo

from refcoll.core.ops import get_dtype
from refcoll.verify.inputs import make_inputs
from refcoll.verify.oracle import check_outputs, expected_outputs

#: refcoll's own reductions overflow on these operands, as IEEE arithmetic does.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")

ALGORITHMS = ("naive", "ring", "tree")
f32 = np.float32


def trees(leaves):
    """Yield every full binary tree over ``leaves`` (as nested pairs), each once."""
    if len(leaves) == 1:
        yield leaves[0]
        return
    for smaller in trees(leaves[:-1]):
        yield from _insert(smaller, leaves[-1])


def _insert(tree, leaf):
    yield (tree, leaf)  # above the root
    if isinstance(tree, tuple):
        left, right = tree
        for t in _insert(left, leaf):
            yield (t, right)
        for t in _insert(right, leaf):
            yield (left, t)


def evaluate(tree, values, combine):
    if not isinstance(tree, tuple):
        return values[tree]
    return combine(evaluate(tree[0], values, combine), evaluate(tree[1], values, combine))


def oriented(tree):
    """Yield ``tree`` with every choice of which child is the left operand."""
    if not isinstance(tree, tuple):
        yield tree
        return
    for a in oriented(tree[0]):
        for b in oriented(tree[1]):
            yield (a, b)
            yield (b, a)


def _rounded(ufunc):
    def combine(a, b):
        with np.errstate(all="ignore"):
            return ufunc(a, b)
    return combine


def c_max(a, b):
    return a if a > b else b


def c_min(a, b):
    return a if a < b else b


def tree_results(op, column, dtype):
    """Return every result a legal order gives for one element, as dtype scalars."""
    values = [np.asarray(v, dtype=dtype)[()] for v in column]
    p = len(values)
    found = []
    if op in ("max", "min"):
        for t in trees(list(range(p))):
            for o in oriented(t):
                found.append(evaluate(o, values, c_max if op == "max" else c_min))
                found.append(evaluate(o, values, _rounded(np.maximum if op == "max"
                                                          else np.minimum)))
        return found
    combine = _rounded(np.multiply if op == "prod" else np.add)
    for t in trees(list(range(p))):
        r = evaluate(t, values, combine)
        if op == "avg":
            with np.errstate(all="ignore"):
                r = np.asarray(np.float64(r) / p).astype(dtype)[()]
        found.append(r)
    return found


def same(a, b) -> bool:
    a, b = np.float64(a), np.float64(b)
    return (np.isnan(a) and np.isnan(b)) or (a == b and np.signbit(a) == np.signbit(b))


def outside_bound(op, column, value, dtype) -> bool:
    """Whether a finite ``value`` lies outside the documented bound (exact fractions)."""
    info = finfo(np.dtype(dtype))
    u = Fraction(1, 2 ** (info.nmant + 1))
    p = len(column)
    xs = [Fraction(float(v)) for v in column]

    def gamma(k):
        return k * u / (1 - k * u)

    if op == "prod":
        exact = Fraction(1)
        above = Fraction(1)
        for x in xs:
            exact *= x
            above *= max(abs(x), Fraction(1))
        tiny = Fraction(float(info.smallest_subnormal))
        bound = gamma(p - 1) * abs(exact) + (p - 1) * tiny / 2 * above * (1 + gamma(p))
    else:
        exact = sum(xs)
        bound = gamma(p - 1) * sum(abs(x) for x in xs)
    return abs(Fraction(float(value)) - exact) > bound * (1 + Fraction(1, 2 ** 30))


def verdict(op, column, value, dtype):
    """Judge an all-reduce whose every rank returns ``value`` for this one element."""
    inputs = [np.array([v], dtype=dtype) for v in column]
    out = np.array([value], dtype=dtype)
    return check_outputs(inputs, [out] * len(column), op=op)


MAX32 = float(np.finfo(f32).max)
TINY32 = float(finfo(f32).smallest_subnormal)

#: (name, op, operands, candidates to judge besides every tree's results)
CASES = [
    ("sum overflows in every order", "sum", [2e38] * 4, [np.inf, -np.inf, np.nan, MAX32]),
    ("sum overflows in some orders", "sum", [3e38, 3e38, -3e38, -3e38],
     [np.inf, -np.inf, np.nan, 0.0, 1e33]),
    ("sum in the rounding band, short of overflow", "sum", [MAX32 / 2, MAX32 / 2, 1.0],
     [np.inf, MAX32, np.nan]),
    ("prod in the rounding band, short of overflow", "prod", [2.0 ** 64, 2.0 ** 63, 1.99999988],
     [np.inf, MAX32]),
    ("sum of subnormals is exact", "sum", [TINY32, 3 * TINY32, -TINY32, 2 * TINY32],
     [5 * TINY32, 4 * TINY32, 0.0, np.inf]),
    ("prod underflows to zero", "prod", [1e-12] * 4, [0.0, -0.0, TINY32, 2 * TINY32, np.inf]),
    ("prod overflows", "prod", [1e10] * 4, [np.inf, -np.inf, np.nan, MAX32, 0.0]),
    ("prod overflows negative", "prod", [1e10, -1e10, 1e10, 1e10], [np.inf, -np.inf, np.nan]),
    ("prod is subnormal", "prod", [1e-7, 1e-7, 1e-7, 1e-21],
     [1e-42, 1e-42 + 3 * TINY32, -1e-42, 0.0]),
    ("prod overflows and underflows", "prod", [1e30, 1e30, 1e-30, 1e-30],
     [np.inf, -np.inf, np.nan, 0.0, 1.0, -0.0]),
    ("prod: gradual underflow, then scaled up", "prod", [1e-40, 0.6, 1e30, 3.0],
     [1.8e-10, np.inf, 0.0]),
    ("a NaN operand forces NaN", "sum", [1.0, np.nan, 2.0, 3.0], [np.nan, 6.0, np.inf]),
    ("+inf and -inf force NaN", "sum", [np.inf, -np.inf, 1.0, 2.0], [np.nan, np.inf, 3.0]),
    ("+inf, and negatives that overflow", "sum", [np.inf, -3e38, -3e38, 1.0],
     [np.inf, np.nan, -np.inf, MAX32, 1.0]),
    ("+inf alone", "avg", [np.inf, 1.0, 2.0], [np.inf, np.nan, 1.0]),
    ("an infinity times zero", "prod", [np.inf, 0.0, 2.0], [np.nan, np.inf, 0.0]),
    ("zero operand, overflow elsewhere", "prod", [0.0, 3e38, 3e38], [0.0, np.nan, np.inf, -0.0]),
    ("max with a NaN", "max", [1.0, np.nan, 5.0, 3.0], [np.nan, 5.0, 1.0, 3.0, 4.0, -1.0]),
    ("min with two NaNs", "min", [np.nan, 2.0, np.nan, -1.0], [np.nan, -1.0, 2.0, 0.0]),
    ("max of both zeros", "max", [0.0, -0.0, -1.0], [0.0, -0.0, -1.0]),
    ("min of negative zeros", "min", [-0.0, -0.0, 1.0], [-0.0, 0.0]),
    ("sum of negative zeros", "sum", [-0.0, -0.0, -0.0], [0.0, -0.0, TINY32]),
    ("sum of zeros of both signs", "sum", [-0.0, 0.0, -0.0], [0.0, -0.0]),
    ("avg of negative zeros", "avg", [-0.0, -0.0, -0.0], [0.0, -0.0]),
    ("a cancellation: its zero's sign is not judged", "sum", [1.0, -1.0, -0.0], [0.0, -0.0]),
]


@pytest.mark.parametrize("name, op, column, extra", CASES, ids=[c[0] for c in CASES])
def test_every_legal_result_conforms_and_the_rest_do_not(name, op, column, extra):
    legal = tree_results(op, column, f32)
    for value in legal:
        report = verdict(op, column, value, f32)
        assert report.conforming, (name, float(value), [f.detail for f in report.findings])
    for value in extra:
        value = np.asarray(value, dtype=f32)[()]
        reachable = any(same(value, r) for r in legal)
        report = verdict(op, column, value, f32)
        if reachable:
            assert report.conforming, (name, float(value))
        elif (not np.isfinite(value) or op in ("max", "min") or (op == "prod" and value == 0)
              or not np.isfinite(np.asarray(column, f32)).all()
              or (value == 0 and not np.any(np.asarray(column) != 0))):  # zeros: the sign rule
            assert not report.conforming, (name, float(value))
        else:  # finite values no order gives: the bound decides
            assert report.conforming == (not outside_bound(op, column, value, f32)), \
                (name, float(value))


@pytest.mark.parametrize("name, op, column, extra", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("p_algorithm", ALGORITHMS)
def test_refcolls_own_outputs_conform(name, op, column, extra, p_algorithm):
    inputs = [np.array([v], dtype=f32) for v in column]
    outputs = expected_outputs("allreduce", inputs, algorithm=p_algorithm, op=op)
    report = check_outputs(inputs, outputs, op=op)
    assert report.conforming, [f.detail for f in report.findings]


def test_a_failing_element_says_which_rule_it_breaks():
    report = verdict("sum", [1.0, np.nan, 2.0], 3.0, f32)
    bound = next(f for f in report.findings if f.check == "within the error bound")
    assert not bound.passed and "an operand is NaN, so every order gives NaN" in bound.detail
    report = verdict("prod", [1e-12] * 4, -0.0, f32)
    bound = next(f for f in report.findings if f.check == "within the error bound")
    assert "positive product" in bound.detail
    report = verdict("sum", [2e38] * 4, -np.inf, f32)
    bound = next(f for f in report.findings if f.check == "within the error bound")
    assert "no legal order gives -inf: legal are +inf" in bound.detail
    report = verdict("sum", [-0.0] * 3, 0.0, f32)
    bound = next(f for f in report.findings if f.check == "within the error bound")
    assert "every operand is -0, so every order gives -0.0" in bound.detail
    report = verdict("avg", [-0.0, 0.0], -0.0, f32)
    bound = next(f for f in report.findings if f.check == "within the error bound")
    assert "not all -0, so every order gives +0.0" in bound.detail


def test_a_zero_sum_of_the_wrong_sign_is_caught_among_many_elements_on_the_fast_path():
    """The screen judges most elements by the bound alone; a zero of the wrong sign, which
    the bound cannot see (0 from 0), is judged by the sign rule there too, among
    zeros of the right sign that cost nothing."""
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal(4096).astype(f32) for _ in range(3)]
    for x in inputs:
        x[:1000] = -0.0
    outputs = expected_outputs("allreduce", inputs, algorithm="ring")
    assert check_outputs(inputs, outputs).conforming
    assert all(np.signbit(o[:1000]).all() for o in outputs)
    outputs[2][777] = 0.0
    report = check_outputs(inputs, outputs)
    bound = next(f for f in report.findings if f.check == "within the error bound")
    assert not report.conforming and "rank 2's output element 777" in bound.detail


@pytest.mark.parametrize("value, convention", [
    (np.nan, "NaN propagated (IEEE 754-2019"),
    (5.0, "maxNum/minNum (IEEE 754-2008)"),
    (3.0, "NaN dropped (C's a > b ? a : b, as MPICH and Open MPI)"),
])
def test_max_with_a_nan_says_which_convention_the_result_follows(value, convention):
    report = verdict("max", [1.0, np.nan, 5.0, 3.0], value, f32)
    assert report.conforming
    assert convention in report.findings[-1].detail


def _extreme_columns(rng, dtype, op, n):
    """Operands of one sign or both near the dtype's overflow (sum) or its limits (prod)."""
    top = float(finfo(np.dtype(dtype)).max)
    if op == "sum":
        mags = top * rng.uniform(0.2, 0.6, size=(4, n))
        signs = np.where(rng.uniform(size=(4, n)) < 0.7, 1.0, -1.0)
        return (mags * signs).astype(dtype)
    exponent = np.log2(top)
    logs = rng.uniform(-0.55, 0.55, size=(4, n)) * exponent
    signs = np.where(rng.uniform(size=(4, n)) < 0.5, 1.0, -1.0)
    return (signs * np.exp2(logs)).astype(dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("op", ["sum", "avg", "prod"])
def test_every_tree_on_extreme_operands_conforms(dtype, op):
    """No false alarm: every tree's result on operands near overflow and underflow conforms."""
    dt = get_dtype(dtype)
    rng = np.random.default_rng([4, len(dtype), len(op)])
    cols = _extreme_columns(rng, dt, "sum" if op == "avg" else op, 24)
    inputs = [row.copy() for row in cols]
    per_tree = {}
    for j in range(cols.shape[1]):
        for t, value in enumerate(tree_results(op, cols[:, j], dt)):
            per_tree.setdefault(t, np.empty(cols.shape[1], dtype=dt))[j] = value
    assert any(not np.isfinite(out.astype(np.float64)).all() for out in per_tree.values())
    for out in per_tree.values():
        report = check_outputs(inputs, [out] * 4, op=op)
        assert report.conforming, [f.detail for f in report.findings]


def test_avg_on_exact_inputs_at_three_ranks_conforms_and_names_a_missing_rank():
    inputs = make_inputs("exact", "float32", 101, 3, op="avg")
    for name in ALGORITHMS:
        report = check_outputs(inputs, expected_outputs("allreduce", inputs, algorithm=name,
                                                        op="avg"), op="avg")
        assert report.conforming, (name, [f.detail for f in report.findings])
    stacked = np.stack(inputs).astype(np.float64)
    without_1 = ((stacked.sum(axis=0) - stacked[1]) / 3).astype(f32)
    report = check_outputs(inputs, [without_1] * 3, op="avg")
    finding = next(f for f in report.findings if f.check.startswith("every rank"))
    assert not finding.passed and finding.data["missing"] == [1]
    twice = ((stacked.sum(axis=0) + stacked[2]) / 3).astype(f32)
    finding = next(f for f in check_outputs(inputs, [twice] * 3, op="avg").findings
                   if f.check.startswith("every rank"))
    assert not finding.passed and finding.data["twice"] == [2]


def test_eight_ranks_judged_by_the_rules_beyond_enumeration():
    """At p = 8 no tree is tried in the test: two operands of a sign overflow, so each
    infinity is reachable, and NaN where both are; four 2e38 and four ones only +inf."""
    both = [3e38] * 4 + [-3e38] * 4
    for value in (np.inf, -np.inf, np.nan):
        assert verdict("sum", both, value, f32).conforming
    one_sign = [2e38] * 4 + [1.0] * 4
    assert verdict("sum", one_sign, np.inf, f32).conforming
    for value in (-np.inf, np.nan, MAX32):
        assert not verdict("sum", one_sign, value, f32).conforming
    assert not verdict("sum", [1.0] * 8, np.inf, f32).conforming


def test_infinite_operands_are_judged_without_a_warning():
    """+inf and -inf operands make the screen's sums NaN: judged by the rules, silently (a
    warning on stderr would break check's one-line output)."""
    import warnings

    inputs = [np.array([np.inf, 1.0] * 50, f32), np.array([-np.inf, 1.0] * 50, f32),
              np.array([1.0, 1.0] * 50, f32)]
    outputs = [np.array([np.nan, 3.0] * 50, f32)] * 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_outputs(inputs, outputs).conforming
