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

from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np
from ml_dtypes import finfo

from ..calls.collectives import simulate
from ..core.bits import differing as differing_elements
from ..core.chunking import chunk_slice
from ..core.errors import UsageError
from ..core.ops import (dtype_name, exact_integer_limit, get_op, is_float, is_integer,
                        unit_roundoff)

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

def ulps(error: float, value: float, dtype) -> float:
    """Return ``error`` in units in the last place of ``value`` in ``dtype``."""
    info = finfo(np.dtype(dtype))
    magnitude = abs(float(value))
    tiny = float(info.smallest_subnormal)
    if magnitude < float(info.smallest_normal):
        return abs(error) / tiny
    spacing = 2.0 ** (np.floor(np.log2(magnitude)) - info.nmant)
    return abs(error) / spacing


@dataclass
class Finding:
    """One check of :func:`check_outputs`: its name, verdict and what it found."""

    check: str
    passed: bool
    detail: str = ""
    data: dict = field(default_factory=dict)


@dataclass
class CheckReport:
    """Everything :func:`check_outputs` found; ``conforming`` when every check passed."""

    collective: str
    op: str
    algorithm: str | None
    ranks: int
    count: int
    dtype: str
    findings: list = field(default_factory=list)

    @property
    def conforming(self) -> bool:
        return all(f.passed for f in self.findings)

    def to_json(self) -> dict:
        return {"collective": self.collective, "op": self.op, "algorithm": self.algorithm,
                "ranks": self.ranks, "count": self.count, "dtype": self.dtype,
                "conforming": self.conforming, "findings": [asdict(f) for f in self.findings]}


def expected_outputs(collective: str, inputs, *, algorithm: str, op="sum", root: int = 0,
                     **options) -> list:
    """Return every rank's output of ``algorithm``, bit for bit, from the simulator."""
    if collective in ("broadcast", "reduce"):
        options["root"] = root
    if collective in ("allgather", "broadcast"):
        return simulate(collective, inputs, algorithm=algorithm, **options).outputs
    return simulate(collective, inputs, algorithm=algorithm, op=op, **options).outputs


def _reference(collective: str, inputs, op, root: int):
    """Per-rank (naive fold, exact, bound) triples; exact and bound None where not float."""
    p = len(inputs)
    flat = [np.asarray(x).reshape(-1) for x in inputs]
    if collective == "allgather":
        whole = np.stack(flat).reshape(-1)
        return [(whole, None, None)] * p
    if collective == "broadcast":
        return [(flat[root], None, None)] * p
    full = fold(op, flat)
    exact = bound = None
    if is_float(flat[0].dtype):
        exact, bound = exact_reduce(op, flat), error_bound(op, flat)
    refs = []
    for r in range(p):
        if collective == "reduce" and r != root:
            refs.append(None)
            continue
        sl = chunk_slice(full.size, p, r) if collective == "reduce_scatter" else slice(None)
        refs.append((full[sl], None if exact is None else exact[sl],
                     None if bound is None else bound[sl]))
    return refs


def _show(value) -> str:
    """Format one element for a report: the value, and its bits for floats."""
    v = np.asarray(value)
    if v.dtype.kind in "iu":
        return str(int(v))
    bits = v.reshape(1).view(f"uint{8 * v.dtype.itemsize}")[0]
    return f"{float(v)!r} (0x{int(bits):0{2 * v.dtype.itemsize}x})"


def check_outputs(inputs, outputs, *, collective: str = "allreduce", op="sum",
                  algorithm: str | None = None, root: int = 0) -> CheckReport:
    """Judge another implementation's per-rank ``outputs`` for ``inputs``.

    Checks shapes and dtypes; that every rank holds the same bits (all-reduce,
    allgather, broadcast); integers (and min/max) exact; floats within the error
    bound of the exactly computed result (worst element with its error in ULPs and
    as a fraction of the bound); with ``algorithm``, bit-exactness against the
    simulator (first differing element and how many differ); and, for inputs whose
    sums are exact, which rank's contribution is missing or counted twice.

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
    refs = _reference(collective, inputs, reduction.name if reduction else "sum", root)
    # Shapes and dtypes, and which ranks must have an output at all.
    bad = []
    for r, (ref, out) in enumerate(zip(refs, outputs)):
        if ref is None:
            continue
        if out is None:
            bad.append(f"rank {r}: no output")
        elif out.dtype != dtype or out.size != ref[0].size:
            bad.append(f"rank {r}: {out.dtype}[{out.size}], "
                       f"expected {dtype_name(dtype)}[{ref[0].size}]")
    report.findings.append(Finding("shapes and dtypes", not bad, "; ".join(bad[:4])))
    if bad:
        return report
    ranks = [r for r, ref in enumerate(refs) if ref is not None]
    got = {r: np.asarray(outputs[r]).reshape(-1) for r in ranks}
    if collective in ("allreduce", "allgather", "broadcast") and p > 1:
        differing = [r for r in ranks if differing_elements(got[r], got[0]).size]
        detail = ""
        if differing:
            r = differing[0]
            i = int(differing_elements(got[r], got[0])[0])
            detail = (f"ranks {differing} differ from rank 0; first: rank {r} element {i} is "
                      f"{_show(got[r][i])}, rank 0 has {_show(got[0][i])}")
        report.findings.append(Finding("identical on every rank", not differing, detail,
                                       {"differing_ranks": differing}))
    floats_ordered = (is_float(dtype) and reduction is not None
                      and reduction.name in ("sum", "avg", "prod"))
    if floats_ordered:
        report.findings.append(_bound_finding(refs, got, ranks, dtype))
    else:
        report.findings.append(_exact_finding(refs, got, ranks, reduction))
    if algorithm is not None:
        report.findings.append(_oracle_finding(collective, inputs, got, ranks, algorithm,
                                               reduction, root))
    if reduction is not None and reduction.name in ("sum", "avg") and _sums_are_exact(inputs):
        report.findings.append(_contribution_finding(inputs, refs, got, ranks, reduction,
                                                     collective))
    return report


def _exact_finding(refs, got, ranks, reduction) -> Finding:
    label = "exact (integers, min/max, data movement)"
    for r in ranks:
        want = refs[r][0]
        diff = differing_elements(got[r], want) if want.size else []
        if len(diff):
            i = int(diff[0])
            return Finding(label, False, f"rank {r} element {i} is {_show(got[r][i])}, expected "
                           f"{_show(want[i])} ({len(diff)} of {want.size} differ)",
                           {"rank": r, "index": i, "differ": int(len(diff))})
    return Finding(label, True)


def _bound_finding(refs, got, ranks, dtype) -> Finding:
    worst = None
    violations_total = 0
    for r in ranks:
        _, exact, bound = refs[r]
        if exact.size == 0:
            continue
        g = got[r].astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            err = np.abs(g - exact)
            frac = np.where(bound > 0, err / bound, np.where(err > 0, np.inf, 0.0))
        frac = np.where(np.isfinite(exact), frac, 0.0)
        frac = np.where(np.isnan(frac), np.inf, frac)
        violations_total += int((frac > 1).sum())
        i = int(np.argmax(frac))
        if worst is None or frac[i] > worst["fraction_of_bound"]:
            worst = {"rank": r, "index": i, "value": float(g[i]), "exact": float(exact[i]),
                     "error": float(err[i]), "ulps": ulps(float(err[i]), float(exact[i]), dtype),
                     "bound": float(bound[i]), "fraction_of_bound": float(frac[i])}
    if worst is None:
        return Finding("within the error bound", True, "no elements")
    detail = (f"worst: rank {worst['rank']} element {worst['index']}: {worst['value']!r} vs exact "
              f"{worst['exact']!r}, {worst['ulps']:.3g} ulp, "
              f"{100 * worst['fraction_of_bound']:.3g}% of the bound")
    if violations_total:
        detail = f"{violations_total} elements outside the bound; " + detail
    return Finding("within the error bound", violations_total == 0, detail,
                   {**worst, "violations": violations_total})


def _oracle_finding(collective, inputs, got, ranks, algorithm, reduction, root) -> Finding:
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
            first = {"rank": r, "index": i, "value": _show(got[r][i]), "expected": _show(want[i])}
    if first is None:
        return Finding(label, True, "conforming, bit-exact")
    return Finding(label, False, f"rank {first['rank']} element {first['index']} is "
                   f"{first['value']}, {algorithm} gives {first['expected']}; {total} elements "
                   "differ", {**first, "differ": total})


def _sums_are_exact(inputs) -> bool:
    """Whether every partial sum of these inputs is exact (integer-valued, small enough)."""
    dt = np.asarray(inputs[0]).dtype
    if is_integer(dt):
        return False  # wrapping sums are exact anyway; the exact check covers them
    stacked = np.stack([np.asarray(x).reshape(-1).astype(np.float64) for x in inputs])
    return bool(np.all(stacked == np.round(stacked))
                and np.all(np.abs(stacked).sum(axis=0) <= exact_integer_limit(dt)))


def _contribution_finding(inputs, refs, got, ranks, reduction, collective) -> Finding:
    """Name ranks whose contribution is missing or counted twice, from exact inputs."""
    stacked = np.stack([np.asarray(x).reshape(-1).astype(np.float64) for x in inputs])
    p = len(inputs)
    problems = []
    for r in ranks:
        sl = chunk_slice(stacked.shape[1], p, r) if collective == "reduce_scatter" else slice(None)
        exact = stacked[:, sl].sum(axis=0)
        diff = got[r].astype(np.float64) * (p if reduction.name == "avg" else 1) - exact
        for i in np.flatnonzero(diff != 0)[:50]:
            column = stacked[:, sl][:, i]
            missing = [int(q) for q in np.flatnonzero(column == -diff[i]) if column[q] != 0]
            twice = [int(q) for q in np.flatnonzero(column == diff[i]) if column[q] != 0]
            problems.append((r, int(i) + (sl.start or 0), missing, twice))
    if not problems:
        return Finding("every rank's contribution counted once", True)
    # A rank that explains every differing element is the culprit; report it.
    def common(kind):
        sets = [set(m if kind == 0 else t) for _, _, m, t in problems]
        return sorted(set.intersection(*sets)) if sets else []

    r, i, missing, twice = problems[0]
    culprit_missing, culprit_twice = common(0), common(1)
    if culprit_missing:
        what = f"rank {culprit_missing[0]}'s contribution is missing"
    elif culprit_twice:
        what = f"rank {culprit_twice[0]}'s contribution is counted twice"
    else:
        what = "the result is not a sum of each rank's input once"
    detail = (f"{what} (first at rank {r}'s output element {i}; candidates there: missing "
              f"{missing}, twice {twice}; {len(problems)} elements checked differ)")
    return Finding("every rank's contribution counted once", False, detail,
                   {"rank": r, "index": i, "missing": culprit_missing, "twice": culprit_twice})
