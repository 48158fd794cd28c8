"""Expected results: the naive fold, the exactly computed reduction, and error bounds.

* :func:`fold` is the naive algorithm's specification: ``((x0 op x1) op x2) ...``
  in rank order, then ``avg``'s division. The naive algorithm must equal it bit for
  bit, and so must every algorithm on ``exact`` inputs.
* :func:`exact_reduce` computes the mathematically exact sum (error-free
  transformations in double-double, far below any input's precision) or product.
* :func:`error_bound` is the rigorous bound of floating-point summation: any
  summation tree of ``p`` terms rounds each element at most ``p-1`` times, so
  ``|computed - exact| <= γ(p-1)·Σ|x_i|`` with ``γ(k) = k·u/(1-k·u)`` (Higham,
  *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §4.2). ``avg`` adds
  one rounded division: ``γ(p)·Σ|x_i|/p``; ``prod``: ``γ(p-1)·|Π x_i|`` plus
  gradual underflow's absolute error; ``min``/``max``: 0.
* :func:`check_outputs` judges another implementation's outputs: shapes, bits
  across ranks, and every element against what a legal order of IEEE operations
  can give (:mod:`refcoll.verify.ieee`: the bound for finite results, rules for
  overflow, underflow, NaN and infinities), its findings built by
  :mod:`refcoll.verify.findings`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from ml_dtypes import finfo

from ..calls.collectives import simulate
from ..core.bits import differing as differing_elements
from ..core.chunking import chunk_slice
from ..core.errors import UsageError
from ..core.ops import dtype_name, exact_integer_limit, get_op, is_float, is_integer, unit_roundoff
from .findings import (
    BOUND_ALONE,
    CheckReport,
    Finding,
    bound_finding,
    contribution_finding,
    exact_finding,
    extremum_finding,
    identical_finding,
    shape_finding,
    show,
    where,
)
from .ieee import gamma, ulps

__all__ = ["fold", "exact_reduce", "error_bound", "gamma", "bound_violations", "violations",
           "check_outputs", "CheckReport", "Finding", "expected_outputs", "ulps"]


def fold(op, arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Return ``((x0 op x1) op x2) ... op x(p-1)`` in the arrays' dtype, ``avg`` finished."""
    reduction = get_op(op)
    out = np.array(arrays[0], copy=True).reshape(-1)
    for x in arrays[1:]:
        reduction.apply(out, np.asarray(x).reshape(-1), out)
    reduction.finalize(out, len(arrays))
    return out


def _two_sum_total(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Return Σ x_i per element, exact to within ~p·2**-104·Σ|x_i| (double-double)."""
    hi = np.zeros(np.asarray(arrays[0]).size, dtype=np.float64)
    lo = np.zeros_like(hi)
    with np.errstate(invalid="ignore", over="ignore"):
        for x in arrays:
            a = np.asarray(x).reshape(-1).astype(np.float64)
            s = hi + a
            bp = s - hi
            lo += (hi - (s - bp)) + (a - bp)
            hi = s
        return hi + lo


def exact_reduce(op, arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Return the reduction computed exactly (to float64), before rounding to the dtype."""
    reduction = get_op(op)
    p = len(arrays)
    if reduction.name in ("sum", "avg"):
        total = _two_sum_total(arrays)
        return total / p if reduction.name == "avg" else total
    if reduction.name == "prod":
        out = np.ones(np.asarray(arrays[0]).size, dtype=np.float64)
        for x in arrays:
            out *= np.asarray(x).reshape(-1).astype(np.float64)
        return out
    return fold(reduction, [np.asarray(x).astype(np.float64) for x in arrays])


def error_bound(op, arrays: Sequence[np.ndarray], dtype=None) -> np.ndarray:
    """Return the elementwise bound on ``|computed - exact|`` for any reduction order."""
    reduction = get_op(op)
    dt = np.dtype(dtype if dtype is not None else np.asarray(arrays[0]).dtype)
    p = len(arrays)
    n = np.asarray(arrays[0]).size
    if not is_float(dt) or reduction.name in ("min", "max") or p == 1 and reduction.name != "avg":
        return np.zeros(n, dtype=np.float64)
    u = unit_roundoff(dt)
    slack = 1.0 + 2.0 ** -40  # covers float64's own roundings in computing the bound
    if reduction.name == "prod":
        # The float64 reference is itself rounded p-1 times: widen by its own error.
        reference = np.abs(exact_reduce("prod", arrays))
        reference_error = gamma(p - 1, 2.0 ** -53) * reference * slack
        # Gradual underflow: each of the p-1 roundings may fall in the subnormal range
        # and add up to half the smallest subnormal, later multiplied by at most the
        # product of the operands above 1 in magnitude.
        above = np.ones(n, dtype=np.float64)
        with np.errstate(over="ignore"):
            for x in arrays:
                a = np.abs(np.asarray(x).reshape(-1).astype(np.float64))
                above *= np.where(a > 1, a, 1.0)
        gradual = (p - 1) * 0.5 * float(finfo(dt).smallest_subnormal) * above * (1 + gamma(p, u))
        return (gamma(p - 1, u) * (reference + reference_error) + reference_error
                + gradual) * slack
    absolute = np.zeros(n, dtype=np.float64)
    for x in arrays:
        absolute += np.abs(np.asarray(x).reshape(-1).astype(np.float64))
    # Σ|x| summed in float64 may come out low by (p-1)·2**-53 of itself, and the
    # double-double "exact" value is rounded once to float64: widen by both.
    absolute *= 1.0 + p * 2.0 ** -52
    reference_error = (2.0 ** -52 * np.abs(exact_reduce(reduction, arrays))
                       + p * 2.0 ** -104 * absolute)
    if reduction.name == "avg":
        # One more rounding for the division, and an underflowing quotient may
        # lose up to half the smallest subnormal.
        tiny = float(np.finfo(np.float64).tiny) if dt == np.float64 else 0.0
        tiny = max(tiny, float(finfo(dt).smallest_subnormal))
        return gamma(p, u) * absolute / p * slack + tiny + reference_error
    return gamma(p - 1, u) * absolute * slack + reference_error


def bound_violations(op, arrays: Sequence[np.ndarray], result: np.ndarray):
    """Return ``(indices, errors, bounds)`` of elements outside the error bound.

    Elements whose exact value is not finite (an input NaN or Inf) are skipped.
    """
    exact = exact_reduce(op, arrays)
    bound = error_bound(op, arrays, np.asarray(result).dtype)
    return violations(result, exact, bound)


def violations(result: np.ndarray, exact: np.ndarray, bound: np.ndarray):
    """Return ``(indices, errors, bounds)`` where ``|result - exact| > bound``."""
    got = np.asarray(result).reshape(-1).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(got - exact)
        bad = np.isfinite(exact) & ~(err <= bound)
    idx = np.flatnonzero(bad)
    return idx, err[idx], bound[idx]


# ------------------------------------------------------------- judging outputs

def expected_outputs(collective: str, inputs, *, algorithm: str, op="sum", root: int = 0,
                     **options) -> list:
    """Return every rank's output of ``algorithm``, bit for bit, from the simulator."""
    if collective in ("broadcast", "reduce"):
        options["root"] = root
    if collective in ("allgather", "broadcast"):
        return simulate(collective, inputs, algorithm=algorithm, **options).outputs
    return simulate(collective, inputs, algorithm=algorithm, op=op, **options).outputs


def _parts(collective: str, inputs, root: int) -> dict:
    """Return rank -> the slice of the reduced vector its output holds, for ranks with one."""
    p = len(inputs)
    n = int(np.asarray(inputs[0]).size)
    if collective == "reduce":
        return {root: slice(None)}
    if collective == "reduce_scatter":
        return {r: chunk_slice(n, p, r) for r in range(p)}
    return {r: slice(None) for r in range(p)}


def _shapes(collective: str, inputs, parts: dict) -> dict:
    """Return rank -> the output shapes allowed (allgather: flat, or one row per rank)."""
    p = len(inputs)
    shape = np.asarray(inputs[0]).shape
    n = int(np.asarray(inputs[0]).size)
    if collective == "allgather":
        return {r: [(p * n,), (p, *shape)] for r in parts}
    if collective == "reduce_scatter":
        return {r: [(len(range(n)[sl]),)] for r, sl in parts.items()}
    return {r: [shape] for r in parts}


def _reference(collective: str, inputs, op, parts: dict, root: int) -> dict:
    """Return rank -> (the naive fold's part, the operands' columns ``(p, k)`` or None)."""
    flat = [np.asarray(x).reshape(-1) for x in inputs]
    if collective == "allgather":
        whole = np.concatenate(flat)
        return {r: (whole, None) for r in parts}
    if collective == "broadcast":
        return {r: (flat[root], None) for r in parts}
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        full = fold(op, flat)
    stacked = np.stack(flat)
    return {r: (full[sl], stacked[:, sl]) for r, sl in parts.items()}


def check_outputs(inputs, outputs, *, collective: str = "allreduce", op="sum",
                  algorithm: str | None = None, root: int = 0) -> CheckReport:
    """Judge another implementation's per-rank ``outputs`` for ``inputs``.

    Checks dtypes and shapes (all-reduce, broadcast, reduce: the input's shape;
    reduce-scatter: the rank's chunk, flat; allgather: ``(p*n,)`` or
    ``(p, *shape)``; the same on every rank); that every rank holds the same bits
    (all-reduce, allgather, broadcast); integers and data movement bit for bit;
    float ``min``/``max`` by :func:`refcoll.verify.ieee.judge_extremum`; float
    ``sum``/``avg``/``prod`` by what a legal order of IEEE operations can give
    (:func:`refcoll.verify.ieee.judge_float`: the error bound for finite results,
    worst element in ulps of the bound's own scale and as a fraction of it); with
    ``algorithm``, bit-exactness against the simulator (first differing element
    and how many differ); and, for inputs whose sums are exact, which rank's
    contribution is missing or counted twice. ``notes`` say when a float check
    passed on the bound alone. Elements are named by their index in the rank's
    own output (reduce-scatter: with the global index too).

    Raises:
        UsageError: the outputs cannot be judged (wrong number of ranks, missing files).
    """
    reduction = get_op(op) if collective in ("allreduce", "reduce_scatter", "reduce") else None
    p = len(inputs)
    if any(x is None for x in inputs):
        raise UsageError("an input rank file is missing")
    if len(outputs) < p:
        outputs = list(outputs) + [None] * (p - len(outputs))
    dtype = np.asarray(inputs[0]).dtype
    report = CheckReport(collective, reduction.name if reduction else "-", algorithm, p,
                         int(np.asarray(inputs[0]).size), dtype_name(dtype))
    parts = _parts(collective, inputs, root)
    report.findings.append(shape_finding(_shapes(collective, inputs, parts), outputs, dtype))
    if not report.findings[-1].passed:
        return report
    refs = _reference(collective, inputs, reduction.name if reduction else "sum", parts, root)
    ranks = sorted(parts)
    got = {r: np.asarray(outputs[r]).reshape(-1) for r in ranks}
    if collective in ("allreduce", "allgather", "broadcast") and p > 1:
        report.findings.append(identical_finding(got, ranks))
    columns = {r: refs[r][1] for r in ranks}
    name = reduction.name if reduction else None
    floats_ordered = is_float(dtype) and name in ("sum", "avg", "prod")
    if floats_ordered:
        report.findings.append(bound_finding(name, columns, got, ranks, parts, dtype))
    elif is_float(dtype) and name in ("min", "max"):
        report.findings.append(extremum_finding(name, columns, got, ranks, parts))
    else:
        report.findings.append(exact_finding(refs, got, ranks, parts))
    if algorithm is not None:
        report.findings.append(_oracle_finding(collective, inputs, got, ranks, parts, algorithm,
                                               reduction, root))
    exact_inputs = name in ("sum", "avg") and _sums_are_exact(inputs)
    if exact_inputs:
        report.findings.append(contribution_finding(columns, got, ranks, parts, reduction.divides,
                                                    p, dtype))
    if floats_ordered and algorithm is None and not exact_inputs and report.conforming:
        report.notes.append(BOUND_ALONE)
    return report


def _oracle_finding(collective, inputs, got, ranks, parts, algorithm, reduction,
                    root) -> Finding:
    label = f"bit-exact against {algorithm}"
    predicted = expected_outputs(collective, inputs, algorithm=algorithm,
                                 op=reduction.name if reduction else "sum", root=root)
    total = 0
    first = None
    for r in ranks:
        want = np.asarray(predicted[r]).reshape(-1)
        diff = differing_elements(got[r], want) if want.size else []
        total += len(diff)
        if len(diff) and first is None:
            i = int(diff[0])
            first = {"rank": r, "index": i, "value": show(got[r][i]), "expected": show(want[i])}
    if first is None:
        return Finding(label, True, "conforming, bit-exact")
    return Finding(label, False, f"{where(first['rank'], first['index'], parts[first['rank']])} "
                   f"is {first['value']}, {algorithm} gives {first['expected']}; {total} "
                   "elements differ", {**first, "differ": total})


def _sums_are_exact(inputs) -> bool:
    """Whether every partial sum of these inputs is exact (integer-valued, small enough)."""
    dt = np.asarray(inputs[0]).dtype
    if is_integer(dt):
        return False  # wrapping sums are exact anyway; the exact check covers them
    stacked = np.stack([np.asarray(x).reshape(-1).astype(np.float64) for x in inputs])
    with np.errstate(invalid="ignore", over="ignore"):
        return bool(np.all(stacked == np.round(stacked))
                    and np.all(np.abs(stacked).sum(axis=0) <= exact_integer_limit(dt)))
