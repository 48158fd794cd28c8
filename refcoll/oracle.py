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
  one rounded division: ``γ(p)·Σ|x_i|/p``; ``prod``: ``γ(p-1)·|Π x_i|``;
  ``min``/``max``: 0.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .ops import get_op, is_float, unit_roundoff

__all__ = ["fold", "exact_reduce", "error_bound", "gamma", "bound_violations", "violations"]


def fold(op, arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Return ``((x0 op x1) op x2) ... op x(p-1)`` in the arrays' dtype, ``avg`` finished."""
    reduction = get_op(op)
    out = np.array(arrays[0], copy=True).reshape(-1)
    for x in arrays[1:]:
        reduction.apply(out, np.asarray(x).reshape(-1), out)
    reduction.finalize(out, len(arrays))
    return out


def gamma(k: int, u: float) -> float:
    """Return ``γ(k) = k·u / (1 - k·u)``, or ``inf`` when ``k·u >= 1``."""
    ku = k * u
    return ku / (1.0 - ku) if ku < 1.0 else float("inf")


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
        return (gamma(p - 1, u) * (reference + reference_error) + reference_error) * slack
    absolute = np.zeros(n, dtype=np.float64)
    for x in arrays:
        absolute += np.abs(np.asarray(x).reshape(-1).astype(np.float64))
    # Σ|x| summed in float64 may come out low by (p-1)·2**-53 of itself, and the
    # double-double "exact" value is rounded once to float64: widen by both.
    absolute *= 1.0 + p * 2.0 ** -52
    reference_error = 2.0 ** -52 * np.abs(exact_reduce(reduction, arrays)) + p * 2.0 ** -104 * absolute
    if reduction.name == "avg":
        # One more rounding for the division, and an underflowing quotient may
        # lose up to half the smallest subnormal.
        tiny = float(np.finfo(np.float64).tiny) if dt == np.float64 else 0.0
        from ml_dtypes import finfo

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
