"""What the oracle's findings say: shapes, indices, counts, error scales and notes.

Each wrong output is built here from refcoll's own result, and the expected index,
count or scale is computed here from what was changed.
"""

import numpy as np
import pytest

from refcoll.core.chunking import chunk_slice
from refcoll.verify.findings import ANALYSED, BOUND_ALONE
from refcoll.verify.inputs import make_inputs
from refcoll.verify.oracle import check_outputs, expected_outputs, fold

N = 1001


def finding(report, prefix):
    return next(f for f in report.findings if f.check.startswith(prefix))


@pytest.mark.parametrize("shape", [(N, 1), (1, N)])
def test_a_wrong_shape_on_one_rank_fails(shape):
    xs = make_inputs("random", "float32", N, 3)
    outs = list(expected_outputs("allreduce", xs, algorithm="ring"))
    outs[1] = outs[1].reshape(shape)
    report = check_outputs(xs, outs)
    shapes = finding(report, "shapes and dtypes")
    assert not report.conforming and not shapes.passed
    assert f"rank 1: float32 shaped {shape}, expected float32 shaped ({N},)" in shapes.detail
    assert "rank 0" not in shapes.detail and "rank 2" not in shapes.detail


def test_allgather_may_be_flat_or_one_row_per_rank_but_the_same_on_every_rank():
    xs = make_inputs("random", "float32", 7, 3)
    whole = np.concatenate(xs)
    assert check_outputs(xs, [whole] * 3, collective="allgather").conforming
    assert check_outputs(xs, [whole.reshape(3, 7)] * 3, collective="allgather").conforming
    mixed = check_outputs(xs, [whole, whole.reshape(3, 7), whole], collective="allgather")
    assert not mixed.conforming
    assert "differ in shape" in finding(mixed, "shapes").detail
    wrong = check_outputs(xs, [whole.reshape(7, 3)] * 3, collective="allgather")
    assert not wrong.conforming


def test_reduce_scatter_chunks_must_be_flat_and_their_own_length():
    xs = make_inputs("random", "float64", 10, 4)
    outs = list(expected_outputs("reduce_scatter", xs, algorithm="ring"))
    assert check_outputs(xs, outs, collective="reduce_scatter").conforming
    outs[3] = outs[3].reshape(1, -1)
    assert not check_outputs(xs, outs, collective="reduce_scatter").conforming


def test_reduce_scatter_names_the_ranks_own_element_and_the_global_one():
    p, n = 4, 10007
    xs = make_inputs("random", "float64", n, p)
    outs = [o.copy() for o in expected_outputs("reduce_scatter", xs, algorithm="ring")]
    local = 5
    outs[2][local] += 1.0
    start = chunk_slice(n, p, 2).start
    report = check_outputs(xs, outs, collective="reduce_scatter")
    bound = finding(report, "within the error bound")
    assert not bound.passed and bound.data["rank"] == 2 and bound.data["index"] == local
    assert f"rank 2's output element {local} (global element {start + local})" in bound.detail
    with_algorithm = check_outputs(xs, outs, collective="reduce_scatter", algorithm="ring")
    bits = finding(with_algorithm, "bit-exact")
    assert f"rank 2's output element {local} (global element {start + local})" in bits.detail


def test_every_differing_element_is_counted_and_only_the_analysis_is_capped():
    p = 4
    xs = make_inputs("exact", "float32", 10007, p)
    without_1 = fold("sum", [xs[0], xs[2], xs[3]])
    want = int(np.count_nonzero(xs[1]))  # where rank 1's input is 0, dropping it changes nothing
    report = check_outputs(xs, [without_1] * p)
    counted = finding(report, "every rank's contribution")
    assert not counted.passed and counted.data["missing"] == [1]
    assert counted.data["differ"] == p * want
    assert counted.data["analysed"] == p * ANALYSED
    assert f"{p * want} elements differ, the first {p * ANALYSED} analysed" in counted.detail


def test_the_error_is_reported_in_ulps_of_the_bounds_own_scale():
    """A conforming float64 sum whose large parts cancel: the error in ulps of Σ|x_i|."""
    p = 4
    xs = make_inputs("adversarial", "float64", 2001, p)
    outs = expected_outputs("allreduce", xs, algorithm="ring")
    report = check_outputs(xs, outs)
    bound = finding(report, "within the error bound")
    assert report.conforming
    i = bound.data["index"]
    absolute = sum(abs(float(x[i])) for x in xs)
    spacing = 2.0 ** (np.floor(np.log2(absolute)) - 52)
    assert bound.data["scale"] == pytest.approx(absolute, rel=1e-12)
    assert bound.data["ulps"] == pytest.approx(bound.data["error"] / spacing, rel=1e-9)
    assert bound.data["ulps"] <= p - 1  # an error within the bound is at most p-1 of these ulps
    assert "ulp of Σ|x_i|" in bound.detail and "% of the bound" in bound.detail
    # where the large values cancelled, the error dwarfs the ulp of the tiny result
    cancelled = [j for j in range(2001) if abs(float(outs[0][j])) < 2 and
                 float(abs(outs[0][j].astype(np.float64) - sum(float(x[j]) for x in xs))) > 0]
    assert cancelled


def test_a_pass_on_the_bound_alone_says_so_and_how_to_see_more():
    xs = make_inputs("random", "float32", 101, 3)
    outs = expected_outputs("allreduce", xs, algorithm="ring")
    alone = check_outputs(xs, outs)
    assert alone.conforming and alone.notes == [BOUND_ALONE]
    assert alone.to_json()["notes"] == [BOUND_ALONE]
    assert "gen-inputs --kind exact" in BOUND_ALONE
    assert check_outputs(xs, outs, algorithm="ring").notes == []
    exact = make_inputs("exact", "float32", 101, 3)
    assert check_outputs(exact, expected_outputs("allreduce", exact, algorithm="ring")).notes == []
    ints = make_inputs("random", "int32", 101, 3)
    assert check_outputs(ints, expected_outputs("allreduce", ints, algorithm="ring")).notes == []
    # a dropped rank whose values are below the bound passes on the bound alone: hence the note
    small = [x.copy() for x in make_inputs("random", "float32", 101, 3)]
    small[2] *= np.float32(2.0 ** -30)
    dropped = fold("sum", small[:2])
    report = check_outputs(small, [dropped] * 3)
    assert report.conforming and report.notes == [BOUND_ALONE]


def test_json_keeps_its_keys():
    xs = make_inputs("random", "float32", 11, 2)
    data = check_outputs(xs, expected_outputs("allreduce", xs, algorithm="ring")).to_json()
    assert {"collective", "op", "algorithm", "ranks", "count", "dtype", "conforming",
            "findings", "notes"} <= set(data)
    assert {"check", "passed", "detail", "data"} <= set(data["findings"][0])


def test_a_legal_infinity_is_reported_as_legal():
    """3e38, 3e38, -3e38, -3e38: +inf conforms, and the detail says which results are legal."""
    f32 = np.float32
    inputs = [np.array([v], f32) for v in (3e38, 3e38, -3e38, -3e38)]
    report = check_outputs(inputs, [np.array([np.inf], f32)] * 4)
    bound = next(f for f in report.findings if f.check == "within the error bound")
    assert bound.passed
    assert "a legal order gives +inf" in bound.detail and "no legal order" not in bound.detail
