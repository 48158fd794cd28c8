"""Judging a block of sums without most of its exact sums: the bound check's fast path.

The bound check (:func:`refcoll.verify.ieee.judge_float`) compares each ``sum`` or
``avg`` with the exact sum of its operands, computed in double-double: about ten
NumPy passes per operand, most of ``refcoll check``'s time. Most elements need
far less. The plain float64 sum ``S̃`` of the operands and their ``Σ|x|`` (a float64
copy of a tile of operands, summed down its columns by a matrix-vector product, in
whatever order the BLAS takes) are within a known distance of the exact figures
whatever the order: ``|S̃ - S| ≤ γ₅₃(p-1)·Σ|x|`` (Higham, §4.2), and two orders'
``Σ|x|`` within ``2γ₅₃(p-1)`` of each other, so each element's error, bound and
fraction of the bound lie in known intervals. An element whose interval lies wholly
below or above 1 has its verdict already. Only the elements whose interval straddles
1, and those whose interval reaches the largest lower end (any of them may be the
worst element the report describes), get the exact reference, computed by the same
code on those columns alone. The counts, the verdicts and the worst element's
figures are therefore the exact path's, bit for bit:
``tests/test_check_streamed.py`` holds them to it.

Where the operands' sums are exact in float64 (integer-valued operands whose
``Σ|x|`` is at most ``2**53``: refcoll's exact inputs), every partial sum in every
order is exact, so ``S̃`` *is* the exact sum, and the reference is built from it
directly. Where neither shortcut helps (many elements at one fraction, as when every
result is exact, or the operands are float64, whose sums may need scaling), the
whole exact reference is computed, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .ieee import Reference, judge_float, reference, sum_bound, zero_signs_wrong

__all__ = ["Estimate", "estimate", "screened"]

#: How far the estimate may be from the exact path's figures, in units of ``p·2**-53``
#: times ``Σ|x|`` (an error) or times the bound (the bound): at least four times what
#: the analysis gives (``γ₅₃(p-1)`` for the plain sum, ``2**-53`` and ``p·2**-104`` for
#: the double-double's rounding, ``2γ₅₃(p-1)`` between this ``Σ|x|`` and the exact
#: path's, the float64 roundings of the error and the bound).
_MARGIN = 16.0

#: Bytes of float64 operands the estimate works on at once (they stay in a core's cache).
_TILE_BYTES = 1 << 20

#: The most columns, as a share of the block, worth judging exactly one by one; past
#: it the block's exact reference is computed whole.
_FEW = 1 / 16


@dataclass
class Estimate:
    """The plain float64 sums of a block's columns and what they give: a stand-in for
    :class:`~refcoll.verify.ieee.Reference` that :func:`screened` judges with."""

    op: str
    dtype: np.dtype
    cols: np.ndarray
    sums: np.ndarray  # Σ x in float64, in the BLAS's order
    absolutes: np.ndarray  # Σ|x| in float64, in the BLAS's order
    plain: np.ndarray  # the result sum_bound makes of them (avg: / p)
    scale: np.ndarray  # the scale of the bound (Σ|x| made larger by its rounding; avg: / p)
    bound: np.ndarray  # the bound sum_bound gives for them
    finite: np.ndarray  # no operand of the column is NaN or infinite

    def part(self, columns: slice) -> "Estimate":
        """Return the estimate of some of the columns."""
        return Estimate(self.op, self.dtype, self.cols[:, columns], self.sums[columns],
                        self.absolutes[columns], self.plain[columns], self.scale[columns],
                        self.bound[columns], self.finite[columns])


def estimate(op: str, cols: np.ndarray, dtype) -> "Estimate | Reference":
    """Return the :class:`Estimate` of a block's ``(p, k)`` operands for ``sum``/``avg`` of
    a type narrower than float64, or else their exact :func:`reference`."""
    dtype = np.dtype(dtype)
    if op not in ("sum", "avg") or dtype.itemsize >= 8 or cols.dtype.itemsize >= 8:
        return reference(op, cols, dtype)
    p, k = cols.shape
    sums, absolutes = np.empty(k), np.empty(k)
    ones = np.ones(p)
    tile = max(256, _TILE_BYTES // (8 * p))
    buffer = np.empty((p, min(k, tile)))
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf: the rules judge NaN
        for j in range(0, k, tile):
            stop = min(k, j + tile)
            wide = buffer[:, :stop - j]
            wide[...] = cols[:, j:stop]
            np.matmul(ones, wide, out=sums[j:stop])
            np.abs(wide, out=wide)
            np.matmul(ones, wide, out=absolutes[j:stop])
        finite = np.isfinite(absolutes)  # float64 cannot overflow on p narrower operands
        plain, bound, scale = sum_bound(op, p, dtype, sums, absolutes, _no_scaling(k))
    return Estimate(op, dtype, cols, sums, absolutes, plain, scale, bound, finite)


def screened(est: Estimate, got: np.ndarray) -> tuple:
    """Judge one rank's results ``got`` (float64, one per column) against an estimate.

    Returns ``(failed, special, i, judged, j)``: the elements outside the bound or
    the IEEE rules, those the rules judged, the worst element ``i`` (the first of the
    largest fraction of the bound, as ``np.argmax`` over the exact path's fractions
    finds it), and the exact :class:`~refcoll.verify.ieee.Judged` of some columns
    that include ``i``, at position ``j``.
    """
    op, dtype, cols = est.op, est.dtype, est.cols
    p, k = cols.shape
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        error = np.abs(got - est.plain)
        slack = _MARGIN * p * 2.0 ** -53
        off = slack * est.scale + 2.0 ** -50 * error  # how far error may be from exact's
        low = np.maximum(error - off, 0.0) / (est.bound * (1.0 + slack))
        high = (error + off) / (est.bound * (1.0 - slack))
        unsure = ~(np.isfinite(got) & est.finite & (est.bound > 0)) | np.isnan(high)
        zeros = est.absolutes == 0  # zeros only: a result of the wrong zero sign is wrong
        if zeros.any():
            unsure |= zero_signs_wrong(cols, got, zeros)
        high[unsure] = np.inf  # the IEEE rules, or a bound of 0: the exact path decides
        low[unsure] = 0.0
    top = low.max() if k else 0.0
    need = np.flatnonzero(unsure | ((low <= 1.0) & (high > 1.0)) | (high >= top))
    if need.size > max(64, _FEW * k):
        ref = _exact_sums(est) or reference(op, cols, dtype)
        judged = judge_float(op, cols, got, dtype, ref)
        i = int(np.argmax(judged.fraction))
        return int((~judged.ok).sum()), int(judged.special.sum()), i, judged, i
    certain_bad = low > 1.0
    certain_bad[need] = False
    part = cols[:, need]
    judged = judge_float(op, part, got[need], dtype, reference(op, part, dtype))
    j = int(np.argmax(judged.fraction))
    failed = int(certain_bad.sum()) + int((~judged.ok).sum())
    return failed, int(judged.special.sum()), int(need[j]), judged, j


def _exact_sums(est: Estimate) -> Reference | None:
    """Return the exact reference built from the plain sums where they are exact: every
    operand finite and an integer, and ``Σ|x|`` at most ``2**53``, so every partial sum
    is exact, the double-double's low word stays 0 and its high word is ``sums``."""
    cols = est.cols
    if not (est.finite.all() and (est.absolutes <= 2.0 ** 53).all()):
        return None
    if not all(np.array_equal(row, np.round(row)) for row in cols):
        return None
    k = cols.shape[1]
    with np.errstate(invalid="ignore", over="ignore"):
        exact, bound, scale = sum_bound(est.op, cols.shape[0], est.dtype, est.sums,
                                        est.absolutes, _no_scaling(k))
    return Reference(est.op, est.dtype, cols, exact, bound, scale, _no_scaling(k), None,
                     np.ones(k, dtype=bool))


def _no_scaling(k: int) -> np.ndarray:
    """The exponents of columns summed unscaled (as :func:`~refcoll.verify.ieee.reference`
    makes them: only float64 operands are ever scaled)."""
    return np.zeros(k, dtype=np.int32)
