"""Which results a legal order of IEEE 754 operations can give: the oracle's rules.

MPI lets an implementation apply a commutative predefined op in any order and
any grouping (the standard's ``MPI_REDUCE`` section), so a conforming ``sum``,
``prod`` or ``avg`` is any result of *some* reduction tree over the ``p``
operands, in any operand order, each operation correctly rounded in the dtype
(``avg``: then one rounded division by ``p``). This module decides, element by
element, whether a result can be one of those, by rules that hold for any ``p``,
trying trees only inside a rounding band of a few operands (spec/README.md,
"What a legal order can give", states them for readers):

* **Finite results** of finite operands are judged by the error bound of every
  tree (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §2.2,
  §3.1, §4.2): ``γ(p-1)·Σ|x_i|`` for ``sum`` (a sum that underflows is exact,
  so no term for it), ``γ(p)·Σ|x_i|/p`` plus the smallest subnormal for ``avg``,
  and for ``prod`` ``γ(p-1)·|Π x_i|`` plus gradual underflow's absolute error:
  each of the ``p-1`` roundings may fall in the subnormal range and add up to
  half the smallest subnormal, later multiplied by at most the product of the
  operands above 1. Everything is computed with a power-of-two scale per
  element, so float64 operands near its overflow threshold are judged too.
* **Overflow** is reachable when some subset of the operands can round past the
  largest finite value: for ``sum`` the positive (negative) operands, whose
  computed sum in any tree is at most ``(1+γ(k-1))`` times their exact sum; for
  ``prod`` the operands of magnitude above 1. ``+inf`` conforms where it is
  reachable (or an operand is ``+inf``); ``NaN`` where ``+inf`` and ``-inf``
  (``prod``: ``inf`` and ``0``) are both reachable, from disjoint operands, or
  an operand is NaN. A finite result of an element every order overflows falls
  outside the bound by itself (``avg``: not even there, since an average
  computed as NCCL's pre-multiplied sum does not overflow). Inside the rounding
  band (a subset whose exact sum lies within ``γ(k-1)`` of the threshold) one
  order, the fold, is tried, then every tree when at most :data:`ENUMERATE`
  operands take part; beyond that the band is given the benefit of the doubt.
* **Underflow to zero** of a ``prod`` is reachable when the operands below 1 in
  magnitude, multiplied in some tree, can round to 0: their exact product times
  ``(1-γ(k-1))`` is at most ``(k-1)`` times half the smallest subnormal.
* **Signs**: a product's sign is the exclusive or of its operands' signs, zeros
  and infinities included. A sum (or average) of zeros only is ``-0`` exactly when
  every operand is ``-0``, in any order and at any width (``-0 + -0 = -0``,
  ``+0 + -0 = +0``); a zero sum of other operands is not judged by its sign (an
  exact cancellation gives ``+0``, but a sum accumulated wider than its type may
  round a tiny negative total to ``-0``).
* **Non-finite operands**: a NaN operand forces NaN; ``+inf`` and ``-inf``
  operands together force NaN (``prod``: an infinity and a zero); a single
  infinity forces that infinity, or NaN where the other side is reachable.
* **min/max**: MPI does not define them on NaN. refcoll computes IEEE 754-2019
  ``maximum``/``minimum`` (NaN propagates, NumPy's ``np.maximum``); MPICH
  (``MPL_MAX`` of ``src/mpl/include/mpl_base.h``, applied by
  ``src/mpi/coll/op/opmax.c``) and Open MPI
  (``ompi/mca/op/base/op_base_functions.c``) compute C's ``a > b ? a : b``, which
  returns its second operand whenever a NaN is compared. With operands in any
  position and any tree, that convention can keep the NaN or drop it at any
  node and return the maximum of the operands combined after it: any input
  value. So NaN, or any of the element's non-NaN operand values, conforms where
  an operand is NaN; elsewhere only the maximum, of either zero sign where both
  ``+0`` and ``-0`` are operands (the order decides the tie).

float8_e4m3fn has no infinity: its overflow gives NaN, so there "inf
reachable" means NaN conforms.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..core.ops import finfo

__all__ = ["gamma", "ulps", "Reference", "reference", "sum_bound", "Judged", "judge_float",
           "zero_signs_wrong", "judge_extremum", "explain", "CONVENTIONS"]

#: The label of each convention a min/max result with a NaN operand follows.
CONVENTIONS = {
    "propagated": "NaN propagated (IEEE 754-2019 maximum/minimum, refcoll's rule)",
    "number": "maxNum/minNum (IEEE 754-2008): the extremum of the non-NaN operands",
    "dropped": "NaN dropped (C's a > b ? a : b, as MPICH and Open MPI)",
}

_SLACK = 1.0 + 2.0 ** -40  # covers float64's own roundings in computing a bound
_LIMIT = 1100  # exponent differences beyond this over- or underflow float64 anyway


def gamma(k, u: float):
    """Return ``γ(k) = k·u / (1 - k·u)`` (``inf`` when ``k·u >= 1``); ``k`` may be an array."""
    ku = np.asarray(k, dtype=np.float64) * u
    with np.errstate(divide="ignore"):
        out = np.where(ku < 1.0, ku / np.maximum(1.0 - ku, 2.0 ** -60), np.inf)
    return float(out) if out.ndim == 0 else out


def ulps(error: float, value: float, dtype) -> float:
    """Return ``error`` in units in the last place of ``value`` in ``dtype``."""
    info = finfo(np.dtype(dtype))
    magnitude = abs(float(value))
    tiny = float(info.smallest_subnormal)
    if magnitude < float(info.smallest_normal):
        return abs(error) / tiny
    spacing = 2.0 ** (np.floor(np.log2(magnitude)) - info.nmant)
    return abs(error) / spacing


def _unit(dtype) -> float:
    return float(2.0 ** -(finfo(np.dtype(dtype)).nmant + 1))


def _has_inf(dtype) -> bool:
    with np.errstate(invalid="ignore", over="ignore"):
        return bool(np.isinf(np.array(np.inf).astype(dtype)))


def _scaled(x, e, by):
    """Return ``x·2**(e - by)``, the exponent difference clipped to float64's reach."""
    return np.ldexp(x, np.clip(np.asarray(e) - by, -_LIMIT, _LIMIT).astype(np.int64))


def _product(mags: np.ndarray, mask: np.ndarray):
    """Return ``(m, e)`` with ``Π mags[mask] = m·2**e`` per column, ``1·2**0`` where empty."""
    m = np.ones(mags.shape[1])
    e = np.zeros(mags.shape[1], dtype=np.int64)
    for row, use in zip(mags, mask):
        mi, ei = np.frexp(np.where(use, row, 1.0))
        m, ex = np.frexp(m * mi)
        e = e + ei + ex
    return m, e


def _exceeds(m, e, limit: float):
    """Return ``m·2**e > limit`` for a positive float64 ``limit``."""
    lm, le = np.frexp(limit)
    return _scaled(m, e, le) > lm


def _at_most(m, e, lm: float, le: int):
    """Return ``m·2**e <= lm·2**le``."""
    return _scaled(m, e, le) <= lm


#: Up to this many operands take part, a result in the rounding band is settled by
#: trying every tree (``(2k-3)!!`` of them: 945 for 6).
ENUMERATE = 6


def _overflowed(r):
    return ~np.isfinite(r.astype(np.float64))


def _vanished(r):
    return r.astype(np.float64) == 0


@functools.lru_cache(maxsize=None)
def _trees(k: int) -> tuple:
    """Return every full binary tree over leaves ``0..k-1`` (nested pairs), each once:
    leaf ``k-1`` inserted above the root or into either side of every tree of ``k-1``."""
    if k == 1:
        return (0,)

    def insert(tree, leaf):
        yield (tree, leaf)
        if isinstance(tree, tuple):
            for t in insert(tree[0], leaf):
                yield (t, tree[1])
            for t in insert(tree[1], leaf):
                yield (tree[0], t)

    return tuple(t for smaller in _trees(k - 1) for t in insert(smaller, k - 1))


def _settle(maybe, rows, key, count, ufunc, hit, dtype):
    """Decide, where ``maybe``, whether some tree over a column's operands ``hit``s.

    ``rows`` holds each column's operands with the neutral element (0 for a sum, 1 for
    a product) in place of those that cannot help; ``key`` sorts the others first and
    ``count`` says how many they are. One tree (the fold) settles most columns; the
    rest are settled by every tree when at most :data:`ENUMERATE` operands take part,
    and given the benefit of the doubt beyond.
    """
    out = np.asarray(maybe).copy()
    idx = np.flatnonzero(out)
    if not idx.size:
        return out
    order = np.argsort(key[:, idx], axis=0, kind="stable")
    vals = np.take_along_axis(rows[:, idx], order, axis=0).astype(dtype)
    with np.errstate(all="ignore"):
        acc = vals[0].copy()
        for row in vals[1:]:
            acc = ufunc(acc, row)
        found = hit(acc)
        small = ~found & (count[idx] <= ENUMERATE)
        if small.any():
            sub = vals[:, small]
            k = int(count[idx][small].max())
            memo = {}

            def value(tree):
                if not isinstance(tree, tuple):
                    return sub[tree]
                if tree not in memo:
                    memo[tree] = ufunc(value(tree[0]), value(tree[1]))
                return memo[tree]

            reached = np.zeros(sub.shape[1], dtype=bool)
            for tree in _trees(max(k, 1)):
                reached |= hit(value(tree))
            found[np.flatnonzero(small)] = reached
            found |= ~small & ~found & (count[idx] > ENUMERATE)
        else:
            found |= count[idx] > ENUMERATE
    out[idx] = found
    return out


@dataclass
class Reference:
    """What the operands alone decide, per element, in units of ``2**e`` (``e`` per element):
    the exact result, the bound, the scale the bound is built on (``Σ|x_i|``,
    ``Σ|x_i|/p`` or ``|Π x_i|``), and for ``prod`` the result's sign. Computed once
    and shared by every rank that holds the same elements."""

    op: str
    dtype: np.dtype
    cols: np.ndarray
    exact: np.ndarray
    bound: np.ndarray
    scale: np.ndarray
    e: np.ndarray
    sign: np.ndarray | None
    finite: np.ndarray  # no operand of the column is NaN or infinite

    def part(self, columns: slice) -> "Reference":
        """Return the reference of some of the columns (every figure is per column)."""
        return Reference(self.op, self.dtype, self.cols[:, columns], self.exact[columns],
                         self.bound[columns], self.scale[columns], self.e[columns],
                         None if self.sign is None else self.sign[columns],
                         self.finite[columns])


@dataclass
class Judged:
    """Per element: ``ok``; whether a rule rather than the bound judged it (``special``);
    ``fraction`` (error / bound; ``inf`` where a rule fails, 0 where one passes) and
    ``error`` in units of ``2**e``. :meth:`numbers` gives one element's figures."""

    ok: np.ndarray
    special: np.ndarray
    fraction: np.ndarray
    error: np.ndarray
    ref: Reference

    def numbers(self, i: int) -> dict:
        """Return element ``i``'s exact value, error, bound and scale (float64, unscaled;
        ``inf`` beyond float64) and the error in ulps of the scale in the dtype."""
        ref, e = self.ref, self.ref.e[i]
        spacing = _spacing(ref.scale[i], e, ref.dtype)
        with np.errstate(over="ignore", invalid="ignore"):
            return {"exact": float(_scaled(ref.exact[i], e, 0)),
                    "error": float(_scaled(self.error[i], e, 0)),
                    "ulps": 0.0 if self.special[i] else float(self.error[i] / spacing),
                    "scale": float(_scaled(ref.scale[i], e, 0)),
                    "bound": float(_scaled(ref.bound[i], e, 0))}


def _classes(op: str, cols: np.ndarray, dtype) -> dict:
    """Return per column which non-finite (and, for prod, zero) results are reachable."""
    u = _unit(dtype)
    info = finfo(np.dtype(dtype))
    top = float(info.max)
    p = cols.shape[0]
    nan_in = np.isnan(cols).any(axis=0)
    pinf_in = (cols == np.inf).any(axis=0)
    ninf_in = (cols == -np.inf).any(axis=0)
    finite = np.isfinite(cols)
    if op in ("sum", "avg"):
        safe = np.where(finite, cols, 0.0)
        _, e = np.frexp(np.abs(safe).max(axis=0))

        def reach(sign):
            part = np.where(sign * safe > 0, np.abs(safe), 0.0)
            k = (part > 0).sum(axis=0)
            upper = _scaled(part, 0, e).sum(axis=0) * (1 + gamma(np.maximum(k - 1, 0), u))
            maybe = (k > 1) & (upper * (1 + p * 2.0 ** -52) > _scaled(top, 0, e))
            return _settle(maybe, part, -part, k, np.add, _overflowed, dtype)

        can_p, can_n = reach(1.0), reach(-1.0)
        nan = nan_in | (pinf_in & ninf_in) | (pinf_in & can_n) | (ninf_in & can_p) | (can_p & can_n)
        pinf = ~nan_in & ~ninf_in & (pinf_in | can_p)
        ninf = ~nan_in & ~pinf_in & (ninf_in | can_n)
        found = {"nan": nan, "+inf": pinf, "-inf": ninf, "zero": None,
                 "finite": ~(nan_in | pinf_in | ninf_in), "sign": None}
    else:
        mags = np.abs(np.where(finite, cols, 1.0))
        zero_in = (cols == 0).any(axis=0)
        inf_in = pinf_in | ninf_in
        big, small = mags > 1, (mags < 1) & (mags > 0)
        kb, ks = big.sum(axis=0), small.sum(axis=0)
        mb, eb = _product(mags, big)
        maybe = (kb > 1) & _exceeds(mb * (1 + gamma(np.maximum(kb - 1, 0), u))
                                    * (1 + p * 2.0 ** -52), eb, top)
        ones = np.where(big, mags, 1.0)
        can_inf = inf_in | _settle(maybe, ones, -ones, kb, np.multiply, _overflowed, dtype)
        ms, es = _product(mags, small)
        tm, te = np.frexp(float(info.smallest_subnormal))
        # Some tree of the operands below 1 rounds to 0: their computed product is at
        # least (1-γ(k-1)) times the exact one, less (k-2) roundings of half a subnormal.
        shrunk = ms * (1 - gamma(np.maximum(ks - 1, 0), u)) * (1 - p * 2.0 ** -52)
        maybe = (ks > 1) & _at_most(shrunk / np.maximum(ks - 1, 1), es, tm * 0.5, te)
        ones = np.where(small, mags, 1.0)
        reach_zero = _settle(maybe, ones, ones, ks, np.multiply, _vanished, dtype)
        can_zero = zero_in | reach_zero
        nan = nan_in | (inf_in & zero_in) | (can_inf & can_zero)
        infs = ~nan_in & ~zero_in & can_inf
        found = {"nan": nan, "+inf": infs, "-inf": infs, "zero": ~nan_in & ~inf_in & can_zero,
                 "finite": ~(nan_in | inf_in | zero_in),
                 "sign": np.signbit(np.where(np.isnan(cols), 0.0, cols)).sum(axis=0) % 2 == 1}
    if not _has_inf(dtype):  # float8_e4m3fn: overflow gives NaN
        found["nan"] = found["nan"] | found["+inf"] | found["-inf"]
        found["+inf"] = found["-inf"] = np.zeros_like(nan_in)
    return found


def _two_sum(xs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return ``(Σ x, Σ|x|, max|x|)`` of the rows of ``xs`` (any float dtype) in float64:
    the sum in double-double, exact to ``~p·2**-104·Σ|x|`` (Knuth's two-sum), ``Σ|x|``
    rounded row by row.

    Each row's step is ``s = hi + a; bp = s - hi; lo += (hi - (s - bp)) + (a - bp);
    hi = s``, computed in place (the same operations, so the same bits, without a new
    array per operation or a float64 copy of ``xs``) on tiles of :data:`_TILE` columns,
    whose buffers stay in a core's cache. ``max|x|`` is only kept for float64 operands
    (the only ones a sum can carry past float64's range); it is 0 for the others."""
    k = xs.shape[1]
    out = np.zeros((3, k))
    for j in range(0, k, _TILE):
        _tile(xs, out, j, min(k, j + _TILE))
    return out[0], out[1], out[2]


def _tile(xs: np.ndarray, out: np.ndarray, j: int, stop: int) -> None:
    """:func:`_two_sum` of columns ``j .. stop-1``, into those columns of ``out``."""
    hi, lo, s, bp, t, a = (np.zeros(stop - j) for _ in range(6))
    absolute, biggest = out[1, j:stop], out[2, j:stop]
    wide = xs.dtype.itemsize >= 8
    for row in xs[:, j:stop]:
        a[...] = row
        np.add(hi, a, out=s)
        np.subtract(s, hi, out=bp)
        np.subtract(s, bp, out=t)
        np.subtract(hi, t, out=t)
        np.subtract(a, bp, out=bp)
        np.add(t, bp, out=t)
        np.add(lo, t, out=lo)
        hi, s = s, hi
        np.abs(a, out=t)
        np.add(absolute, t, out=absolute)
        if wide:
            np.maximum(biggest, t, out=biggest)
    np.add(hi, lo, out=out[0, j:stop])


#: Columns :func:`_two_sum` works on at once (its buffers fit in a core's cache).
_TILE = 16384

def _sums(cols: np.ndarray):
    """Return ``(Σ x, Σ|x|, e, finite)`` of the columns of ``cols``, in units of ``2**e``.

    Non-finite operands count as 0 (the rules judge their columns; ``finite`` says
    which columns have none). Only float64 operands can sum past float64's range:
    those columns are scaled by ``2**-e``, ``e`` their largest operand's exponent.
    One pass over ``cols`` when every operand is finite and none is that large.
    """
    exact, absolute, biggest = _two_sum(cols)
    _, top = np.frexp(biggest)
    if np.isfinite(absolute).all() and not (top > 1000).any():
        return exact, absolute, np.zeros(cols.shape[1], dtype=top.dtype), \
            np.ones(cols.shape[1], dtype=bool)
    cols = np.asarray(cols, dtype=np.float64)
    finite = np.isfinite(cols)
    safe = np.where(finite, cols, 0.0)
    _, top = np.frexp(np.abs(safe).max(axis=0))
    e = np.where(top > 1000, top, 0)
    exact, absolute, _ = _two_sum(_scaled(safe, 0, e) if e.any() else safe)
    return exact, absolute, e, finite.all(axis=0)


def reference(op: str, cols: np.ndarray, dtype) -> Reference:
    """Return the exact results and bounds of the ``(p, k)`` operands ``cols`` (the
    dtype's, or float64)."""
    p = cols.shape[0]
    u = _unit(dtype)
    info = finfo(np.dtype(dtype))
    tiny = float(info.smallest_subnormal)
    sign = None
    with np.errstate(invalid="ignore", over="ignore", divide="ignore", under="ignore"):
        if op in ("sum", "avg"):
            exact, absolute, e, finite = _sums(cols)
            exact, bound, scale = sum_bound(op, p, dtype, exact, absolute, e)
        else:
            cols = np.asarray(cols, dtype=np.float64)
            finite_ops = np.isfinite(cols)
            finite = finite_ops.all(axis=0)
            mags = np.abs(cols if finite.all() else np.where(finite_ops, cols, 0.0))
            m, ex = _product(mags, mags > 0)
            mb, eb = _product(mags, mags > 1)
            tm, te = np.frexp(tiny)
            e = np.maximum(ex, eb + te)
            sign = np.signbit(np.where(np.isnan(cols), 0.0, cols)).sum(axis=0) % 2 == 1
            exact = np.where(sign, -1.0, 1.0) * _scaled(m, ex, e)
            magnitude = np.abs(exact)
            ref_err = gamma(p - 1, 2.0 ** -53) * magnitude * _SLACK
            gradual = (p - 1) * 0.5 * _scaled(mb * tm, eb + te, e) * (1 + gamma(p, u))
            bound = (gamma(p - 1, u) * (magnitude + ref_err) + ref_err + gradual) * _SLACK
            scale = magnitude
    return Reference(op, np.dtype(dtype), cols, exact, bound, scale, e, sign, finite)


def avg_allowance(absolute, p: int, dtype):
    """Return how far from ``S/p`` any conforming ``avg`` of exact sums may round:
    ``γ(p)·Σ|x|/p`` and the smallest subnormal (``absolute``: ``Σ|x|``, exact), the bound
    :func:`sum_bound` gives an ``avg``, which NCCL's pre-multiplied sum keeps within."""
    tiny = float(finfo(np.dtype(dtype)).smallest_subnormal)
    return gamma(p, _unit(dtype)) * (absolute / p) * _SLACK + tiny


def sum_bound(op: str, p: int, dtype, exact, absolute, e) -> tuple:
    """Return ``(exact, bound, scale)`` of a ``sum``/``avg`` from ``Σ x`` (``exact``, in
    double-double rounded to float64) and ``Σ|x|`` (``absolute``, rounded row by row), both
    in units of ``2**e``: the bound of every tree, plus the reference's own error."""
    u = _unit(dtype)
    tiny = float(finfo(np.dtype(dtype)).smallest_subnormal)
    absolute = absolute * (1.0 + p * 2.0 ** -52)
    ref_err = 2.0 ** -52 * np.abs(exact) + p * 2.0 ** -104 * absolute
    if op == "avg":
        exact, absolute = exact / p, absolute / p
        floor = max(tiny, float(np.finfo(np.float64).tiny)) \
            if np.dtype(dtype) == np.float64 else tiny
        bound = gamma(p, u) * absolute * _SLACK + _scaled(floor, 0, e) + ref_err
    else:
        bound = gamma(p - 1, u) * absolute * _SLACK + ref_err
    return exact, bound, absolute


def zero_signs_wrong(cols: np.ndarray, got: np.ndarray, zeros=None) -> np.ndarray:
    """Return per column whether a sum of zeros only has the wrong sign: ``-0`` exactly when
    every operand is ``-0`` (``zeros``: which columns hold zeros only, when known)."""
    if zeros is None:
        zeros = ~(cols != 0).any(axis=0)  # (NaN: not a zero)
    wrong = np.zeros(got.shape, bool)
    where = np.flatnonzero(zeros & (got == 0))
    if where.size:
        negative = np.signbit(np.asarray(cols[:, where], dtype=np.float64)).all(axis=0)
        wrong[where] = np.signbit(got[where]) != negative
    return wrong


def judge_float(op: str, cols: np.ndarray, got: np.ndarray, dtype,
                ref: Reference | None = None) -> Judged:
    """Judge float ``sum``/``avg``/``prod`` results ``got`` (one per column of ``cols``,
    the ``(p, k)`` operands, both as float64) by the rules of the module docstring.

    ``ref``: :func:`reference` of the same operands, when already computed.
    """
    ref = ref if ref is not None else reference(op, cols, dtype)
    got = np.asarray(got, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore", under="ignore"):
        error = np.abs((_scaled(got, 0, ref.e) if ref.e.any() else got) - ref.exact)
        frac = np.where(ref.bound > 0, error / ref.bound, np.where(error > 0, np.inf, 0.0))
        frac = np.where(np.isnan(frac), np.inf, frac)
        ok = frac <= 1.0
        special = ~np.isfinite(got) | ~ref.finite
        if op == "prod":
            special |= (got == 0) | (ref.cols == 0).any(axis=0)
        where = np.flatnonzero(special)
        if where.size:  # the rules, only where they apply
            found = _classes(op, np.asarray(ref.cols[:, where], dtype=np.float64), dtype)
            g = got[where]
            passed = ((np.isnan(g) & found["nan"]) | ((g == np.inf) & found["+inf"])
                      | ((g == -np.inf) & found["-inf"]))
            if op == "prod":
                passed |= (g == 0) & found["zero"]
            ok[where] = passed
        if op == "prod":
            ok &= np.isnan(got) | (np.signbit(got) == ref.sign)
        else:
            ok &= ~zero_signs_wrong(ref.cols, got)
        frac = np.where(special, np.where(ok, 0.0, np.inf), np.where(ok | (frac > 1), frac,
                                                                      np.inf))
    return Judged(ok, special, frac, error, ref)


def _spacing(scale_s, e, dtype):
    """Return the dtype's spacing at magnitude ``scale_s·2**e``, in units of ``2**e``."""
    info = finfo(np.dtype(dtype))
    _, se = np.frexp(scale_s)
    _, sub = np.frexp(float(info.smallest_subnormal))
    exponent = np.maximum(se + e - 1 - info.nmant, sub - 1)
    return _scaled(1.0, exponent, e)


def judge_extremum(op: str, cols: np.ndarray, got: np.ndarray):
    """Judge float ``min``/``max`` results: ``(ok, convention)`` per column.

    ``cols`` holds the ``(p, k)`` operands and ``got`` the results, in the dtype.
    ``convention`` is ``""`` where no operand is NaN, else a key of :data:`CONVENTIONS`.
    """
    cols = np.asarray(cols)
    got = np.asarray(got)
    wide = cols.astype(np.float64)
    g = got.astype(np.float64)
    width = f"u{cols.dtype.itemsize}"
    words = np.ascontiguousarray(cols).view(width)
    gwords = np.ascontiguousarray(got).view(width)
    nan_cols = np.isnan(wide)
    nan_in = nan_cols.any(axis=0)
    with np.errstate(invalid="ignore"):
        pick = np.fmax if op == "max" else np.fmin
        best = pick.reduce(np.where(nan_cols, np.nan, wide), axis=0) if cols.shape[0] else g
        is_operand = ((words == gwords) & ~nan_cols).any(axis=0)
        nan_out = np.isnan(g)
        equals_best = g == best
    ok = np.where(nan_out, nan_in, is_operand & (nan_in | equals_best))
    convention = np.where(~nan_in, "", np.where(nan_out, "propagated",
                                                np.where(equals_best, "number", "dropped")))
    return ok, convention


def explain(op: str, column: np.ndarray, value: float, dtype, *, legal: bool = False) -> str:
    """Say, for one element, which rule its result breaks (``legal``: which rule allows it)."""
    column = np.asarray(column, dtype=np.float64)
    v = float(value)
    if op in ("min", "max"):
        if np.isnan(v):
            return "no operand is NaN, so no order gives NaN"
        return (f"not the {op} of the operands" if not np.isnan(column).any()
                else "not NaN and not one of the operands")
    found = {key: (None if val is None else bool(np.asarray(val)[0]))
             for key, val in _classes(op, column.reshape(-1, 1), dtype).items()}
    if np.isnan(column).any():
        return "an operand is NaN, so every order gives NaN"
    if op == "prod" and found["sign"] is not None and not np.isnan(v) and \
            bool(np.signbit(v)) != found["sign"]:
        return f"the operands' signs give a {'negative' if found['sign'] else 'positive'} product"
    if op != "prod" and zero_signs_wrong(column.reshape(-1, 1), np.array([v]))[0]:
        negative = bool(np.signbit(column).all())
        return ("every operand is -0, so every order gives -0.0" if negative else
                "the operands are zeros, not all -0, so every order gives +0.0")
    allowed = [name for key, name in (("nan", "NaN"), ("+inf", "+inf"), ("-inf", "-inf"))
               if found[key]]
    if op == "prod" and found["zero"]:
        allowed.append("0")
    if found["finite"]:
        allowed.append("finite values within the bound")
    what = "NaN" if np.isnan(v) else ("+inf" if v == np.inf else "-inf" if v == -np.inf
                                      else "0" if v == 0 and op == "prod" else "this value")
    if legal:
        return f"a legal order gives {what} (legal here: {', '.join(allowed)})"
    return f"no legal order gives {what}: legal are " + (", ".join(allowed) or "none")
