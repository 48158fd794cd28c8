"""The findings of :func:`refcoll.verify.oracle.check_outputs`, each one check's verdict.

A finding names the rank and the element of that rank's own output (for
reduce-scatter also the element of the whole reduced vector, labelled
``global``), counts every element it found wrong, and says by which rule a
result conforms (:mod:`refcoll.verify.ieee`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from ..core.bits import differing as differing_elements
from ..core.ops import dtype_name
from .ieee import CONVENTIONS, explain, judge_extremum, judge_float, reference

__all__ = ["Finding", "CheckReport", "elements", "show", "where", "shape_finding",
           "identical_finding", "exact_finding", "extremum_finding", "bound_finding",
           "contribution_finding", "BOUND_ALONE"]

#: The note of a float check that passed on the error bound alone.
BOUND_ALONE = ("passed on the error bound alone, which cannot see a contribution smaller than "
               "the bound: rerun with inputs from `refcoll gen-inputs --kind exact` (every "
               "order gives the same bits there)")

#: How many differing elements per rank the contribution analysis looks at.
ANALYSED = 50


@dataclass
class Finding:
    """One check of :func:`check_outputs`: its name, verdict and what it found."""

    check: str
    passed: bool
    detail: str = ""
    data: dict = field(default_factory=dict)


@dataclass
class CheckReport:
    """Everything :func:`check_outputs` found; ``conforming`` when every check passed.

    ``notes`` say what the checks could not see (e.g. a pass on the bound alone).
    """

    collective: str
    op: str
    algorithm: str | None
    ranks: int
    count: int
    dtype: str
    findings: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    @property
    def conforming(self) -> bool:
        return all(f.passed for f in self.findings)

    def to_json(self) -> dict:
        return {"collective": self.collective, "op": self.op, "algorithm": self.algorithm,
                "ranks": self.ranks, "count": self.count, "dtype": self.dtype,
                "conforming": self.conforming, "findings": [asdict(f) for f in self.findings],
                "notes": list(self.notes)}


def elements(n: int) -> str:
    """Return ``"1 element"`` or ``"n elements"``."""
    return f"{n} element" if n == 1 else f"{n} elements"


def show(value) -> str:
    """Format one element for a report: the value, and its bits for floats."""
    v = np.asarray(value)
    if v.dtype.kind in "iu":
        return str(int(v))
    bits = v.reshape(1).view(f"uint{8 * v.dtype.itemsize}")[0]
    return f"{float(v)!r} (0x{int(bits):0{2 * v.dtype.itemsize}x})"


def where(rank: int, index: int, part: slice) -> str:
    """Name element ``index`` of rank ``rank``'s output; ``part`` is its slice of the whole."""
    start = part.start or 0
    glob = f" (global element {index + start})" if start or part.stop is not None else ""
    return f"rank {rank}'s output element {index}{glob}"


def _shape_text(dtype, shape) -> str:
    return f"{dtype_name(dtype)} shaped {tuple(shape)}"


def shape_finding(expected: dict, outputs, dtype) -> Finding:
    """Check each rank's output dtype and shape against ``expected`` (rank -> allowed shapes).

    Where more than one shape is allowed (allgather: flat, or one row per rank), every
    rank must use the same one.
    """
    bad, shapes = [], set()
    for r, allowed in expected.items():
        out = outputs[r]
        if out is None:
            bad.append(f"rank {r}: no output")
            continue
        out = np.asarray(out)
        shapes.add(out.shape)
        if out.dtype != dtype or out.shape not in allowed:
            want = " or ".join(_shape_text(dtype, s) for s in allowed)
            bad.append(f"rank {r}: {_shape_text(out.dtype, out.shape)}, expected {want}")
    if not bad and len(shapes) > 1 and any(len(allowed) > 1 for allowed in expected.values()):
        bad.append("ranks' outputs differ in shape: " + ", ".join(
            f"rank {r} {tuple(np.asarray(outputs[r]).shape)}" for r in expected))
    return Finding("shapes and dtypes", not bad, "; ".join(bad[:4]),
                   {"problems": len(bad)} if bad else {})


def identical_finding(got: dict, ranks) -> Finding:
    """Check that every rank holds rank 0's bits."""
    first = ranks[0]
    differing = [r for r in ranks if differing_elements(got[r], got[first]).size]
    detail = ""
    if differing:
        r = differing[0]
        diff = differing_elements(got[r], got[first])
        i = int(diff[0])
        detail = (f"ranks {differing} differ from rank {first}; first: rank {r} element {i} is "
                  f"{show(got[r][i])}, rank {first} has {show(got[first][i])} ({len(diff)} of "
                  f"{got[r].size} elements of rank {r} differ)")
    return Finding("identical on every rank", not differing, detail,
                   {"differing_ranks": differing})


def exact_finding(refs, got, ranks, parts) -> Finding:
    """Check integers and data movement bit for bit against the fold."""
    label = "exact (integers, min/max, data movement)"
    total, first = 0, None
    for r in ranks:
        want = refs[r][0]
        diff = differing_elements(got[r], want) if want.size else []
        total += len(diff)
        if len(diff) and first is None:
            i = int(diff[0])
            first = {"rank": r, "index": i}
            n0 = len(diff)
            text = (f"{where(r, i, parts[r])} is {show(got[r][i])}, expected {show(want[i])} "
                    f"({len(diff)} of {want.size} differ)")
    if first is None:
        return Finding(label, True)
    more = f"; {elements(total)} differ on all ranks" if total > n0 else ""
    return Finding(label, False, text + more,
                   {**first, "differ": int(total)})


def extremum_finding(op: str, columns, got, ranks, parts) -> Finding:
    """Check float min/max: the extremum, any zero sign where both zeros are operands, and
    where an operand is NaN what either convention can give (:mod:`refcoll.verify.ieee`)."""
    label = "exact (integers, min/max, data movement)"
    total, first = 0, None
    counts = {key: 0 for key in CONVENTIONS}
    for r in ranks:
        cols = columns[r]
        ok, convention = judge_extremum(op, cols, got[r])
        for key in counts:
            counts[key] += int(((convention == key) & ok).sum())
        bad = np.flatnonzero(~ok)
        total += bad.size
        if bad.size and first is None:
            i = int(bad[0])
            first = {"rank": r, "index": i, "value": show(got[r][i]),
                     "why": explain(op, cols[:, i].astype(np.float64), float(got[r][i]),
                                    cols.dtype)}
    used = {key: n for key, n in counts.items() if n}
    follows = "; ".join(f"{elements(n)} (counted on every rank): {CONVENTIONS[key]}"
                        for key, n in used.items())
    if first is None:
        return Finding(label, True, follows, {"conventions": used} if used else {})
    detail = (f"{where(first['rank'], first['index'], parts[first['rank']])} is {first['value']}:"
              f" {first['why']} ({elements(total)} wrong)")
    return Finding(label, False, detail + (f"; {follows}" if follows else ""),
                   {**first, "differ": int(total), "conventions": used})


def bound_finding(op: str, columns, got, ranks, parts, dtype) -> Finding:
    """Check float sum/avg/prod: the bound on finite results, the rules on the rest."""
    label = "within the error bound"
    scale_name = "|Π x_i|" if op == "prod" else ("Σ|x_i|/p" if op == "avg" else "Σ|x_i|")
    worst, failed, special = None, 0, 0
    shared = {}  # ranks holding the same elements share the exact results and bounds
    for r in ranks:
        cols = columns[r]
        if cols.shape[1] == 0:
            continue
        key = (parts[r].start, parts[r].stop)
        if key not in shared:
            shared[key] = reference(op, cols.astype(np.float64), dtype)
        judged = judge_float(op, cols, got[r].astype(np.float64), dtype, shared[key])
        failed += int((~judged.ok).sum())
        special += int(judged.special.sum())
        i = int(np.argmax(judged.fraction))
        if worst is None or judged.fraction[i] > worst["fraction_of_bound"]:
            worst = {"rank": r, "index": i, "value": float(got[r][i]), **judged.numbers(i),
                     "fraction_of_bound": float(judged.fraction[i]),
                     "special": bool(judged.special[i])}
            if judged.special[i] or not judged.ok[i]:
                worst["why"] = explain(op, cols[:, i], float(got[r][i]), dtype,
                                       legal=bool(judged.ok[i]))
    if worst is None:
        return Finding(label, True, "no elements")
    at = where(worst["rank"], worst["index"], parts[worst["rank"]])
    if worst["special"] or np.isinf(worst["fraction_of_bound"]):
        detail = f"{at} is {worst['value']!r}: {worst['why']}"
    else:
        detail = (f"worst: {at}: {worst['value']!r} vs exact {worst['exact']!r}, error "
                  f"{worst['error']:.3g} = {worst['ulps']:.3g} ulp of {scale_name} "
                  f"({worst['scale']:.3g}), {100 * worst['fraction_of_bound']:.3g}% of the bound")
    if failed:
        detail = f"{elements(failed)} outside the bound or the IEEE rules; " + detail
    elif special:
        detail += (f"; {elements(special)} with non-finite operands or results judged by the "
                   "IEEE rules (spec/README.md)")
    worst.pop("special")
    return Finding(label, failed == 0, detail, {**worst, "violations": failed,
                                                "scale_name": scale_name, "ieee_rules": special})


def contribution_finding(columns, got, ranks, parts, divides: bool, p: int, dtype) -> Finding:
    """Name ranks whose contribution is missing or counted twice, from exact inputs.

    Every partial sum of such inputs is exact, so every order gives ``S`` (``avg``:
    ``fl(S/p)``); rank ``q`` is missing where ``fl((S - x_q)/p)`` is the result and
    counted twice where ``fl((S + x_q)/p)`` is.
    """
    label = "every rank's contribution counted once"

    def finish(total):
        if not divides:
            return total
        return np.asarray(total / p).astype(dtype).astype(np.float64)

    problems, total_bad = [], 0
    for r in ranks:
        cols = columns[r].astype(np.float64)
        exact = cols.sum(axis=0)
        g = got[r].astype(np.float64)
        bad = np.flatnonzero(~(g == finish(exact)))
        total_bad += bad.size
        for i in bad[:ANALYSED]:
            column = cols[:, i]
            missing = np.flatnonzero((finish(exact[i] - column) == g[i]) & (column != 0))
            twice = np.flatnonzero((finish(exact[i] + column) == g[i]) & (column != 0))
            problems.append((r, int(i), [int(q) for q in missing], [int(q) for q in twice]))
    if not problems:
        return Finding(label, True)

    def common(kind):
        return sorted(set.intersection(*[set(pr[kind]) for pr in problems]))

    r, i, missing, twice = problems[0]
    culprit_missing, culprit_twice = common(2), common(3)
    if culprit_missing:
        what = f"rank {culprit_missing[0]}'s contribution is missing"
    elif culprit_twice:
        what = f"rank {culprit_twice[0]}'s contribution is counted twice"
    else:
        what = "the result is not a sum of each rank's input once"
    detail = (f"{what} (first at {where(r, i, parts[r])}; candidates there: missing {missing}, "
              f"twice {twice}; {elements(total_bad)} differ, the first {len(problems)} analysed)")
    return Finding(label, False, detail,
                   {"rank": r, "index": i, "missing": culprit_missing, "twice": culprit_twice,
                    "differ": int(total_bad), "analysed": len(problems)})
