"""The findings of :func:`refcoll.verify.oracle.check_outputs`, each one check's verdict.

A finding names the rank and the element of that rank's own output (for
reduce-scatter also the element of the whole reduced vector, labelled
``global``), counts every element it found wrong, and says by which rule a
result conforms (:mod:`refcoll.verify.ieee`).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

import numpy as np

from ..core.bits import differing as differing_elements
from ..core.bits import same_bits
from ..core.ops import dtype_name
from .ieee import CONVENTIONS, avg_allowance, explain, judge_extremum, judge_float
from .screen import Estimate, screened

__all__ = ["Finding", "CheckReport", "elements", "show", "where", "shape_finding",
           "IdenticalCheck", "ExactCheck", "ExtremumCheck", "BoundCheck", "ContributionCheck",
           "BOUND_ALONE", "ANALYSED", "renumbered"]

#: The note of a float check that passed on the error bound alone.
BOUND_ALONE = ("passed on the error bound alone, which cannot see a contribution smaller than "
               "the bound: rerun with inputs from `refcoll gen-inputs --kind exact` (every "
               "order gives the same bits there)")

#: How many differing elements per rank the contribution analysis looks at.
ANALYSED = 50


#: An element a finding names: ``rank R['s output] element S`` or ``global element G``.
_NAMED = re.compile(r"(rank (\d+)(?:'s output)? )?(global )?element (\d+)")


def renumbered(text: str, real) -> str:
    """Return a finding's ``text`` with each element it names as ``real(rank, whole, s)``
    numbers it: a judge of sampled elements names their places among the sampled ones,
    and ``real`` the output's own (``rank``: the rank named before it, or None;
    ``whole``: a global element)."""
    def named(match: re.Match) -> str:
        rank = None if match.group(2) is None else int(match.group(2))
        element = real(rank, match.group(3) is not None, int(match.group(4)))
        return f"{match.group(1) or ''}{match.group(3) or ''}element {element}"
    return _NAMED.sub(named, text)


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

    ``outputs`` are arrays or :class:`~refcoll.verify.npy.NpyFile` s (shape and dtype
    alone are read). Where more than one shape is allowed (allgather: flat, or one row
    per rank), every rank must use the same one.
    """
    bad, shapes = [], set()
    for r, allowed in expected.items():
        out = outputs[r]
        if out is None:
            bad.append(f"rank {r}: no output")
            continue
        shapes.add(out.shape)
        if out.dtype != dtype or out.shape not in allowed:
            want = " or ".join(_shape_text(dtype, s) for s in allowed)
            bad.append(f"rank {r}: {_shape_text(out.dtype, out.shape)}, expected {want}")
    if not bad and len(shapes) > 1 and any(len(allowed) > 1 for allowed in expected.values()):
        bad.append("ranks' outputs differ in shape: " + ", ".join(
            f"rank {r} {tuple(outputs[r].shape)}" for r in expected))
    return Finding("shapes and dtypes", not bad, "; ".join(bad[:4]),
                   {"problems": len(bad)} if bad else {})


# ----------------------------------------------------------- checks, block by block
#
# Each check below judges a rank's output one block of elements at a time, so
# ``refcoll check`` reads files of any size in bounded memory. ``summarize`` judges
# one block of one rank (indices local to the block) and returns what the finding
# needs of it; ``merge`` adds a summary at the block's place in the rank's output;
# ``finding`` is the verdict over every block. A rank whose block holds the first
# rank's bits is merged from the first rank's summary, unjudged twice. Every rank's
# figures are kept apart and combined in rank order at the end, so the findings are
# those of one pass over whole arrays: the first rank (then element) wrong, the
# worst element (the first of the largest), the counts over every rank.


class IdenticalCheck:
    """Every rank holds the first rank's bits; where all the others differ from it, whether
    they agree among themselves (then the first rank is the one that differs)."""

    label = "identical on every rank"

    def __init__(self, ranks):
        self.ranks, self.count, self.first = list(ranks), {}, {}
        self.apart: set[int] = set()  # ranks past the second that differ from the second
        self.unsure = False  # a block of one of them could not be set beside the second's
        self._second = (-1, True, None)  # the second rank's block: (offset, head's bits?, it)

    def add(self, r: int, offset: int, got: np.ndarray, first: np.ndarray) -> bool:
        """Compare rank ``r``'s block with the first rank's; return whether they are the same."""
        if same_bits(got, first):  # (the common case, in one pass and no index array)
            return True
        diff = differing_elements(got, first)
        if not diff.size:
            return True
        self.count[r] = self.count.get(r, 0) + int(diff.size)
        if r not in self.first:
            i = int(diff[0])
            self.first[r] = (offset + i, show(got[i]), show(first[i]))
        return False

    def beside_second(self, r: int, offset: int, same: bool, got: np.ndarray) -> None:
        """Note whether rank ``r``'s block (``same``: it holds the first rank's bits) is the
        second rank's, whose own block comes first (ranks in order)."""
        if r == self.ranks[1]:
            self._second = (offset, same, got)
            return
        at, second_same, second = self._second
        if r in self.apart or (same and second_same and at == offset):
            return  # (both hold the first rank's bits here)
        if at != offset:
            self.unsure = True
        elif same != second_same or (not same_bits(got, second)
                                     and differing_elements(got, second).size):
            self.apart.add(r)

    def finding(self, sizes: dict) -> Finding:
        head = self.ranks[0]
        differing = [r for r in self.ranks if r in self.count]
        detail = ""
        if len(self.ranks) > 2 and differing == self.ranks[1:] and not self.apart \
                and not self.unsure:
            r = self.ranks[1]  # every other rank agrees: the first rank is the odd one
            i, value, theirs = self.first[r]
            detail = (f"rank {head} differs from every other rank, which agree among "
                      f"themselves; first: rank {head} element {i} is {theirs}, the others "
                      f"have {value} ({self.count[r]} of {sizes[head]} elements of rank "
                      f"{head} differ)")
            return Finding(self.label, False, detail, {"differing_ranks": [head]})
        if differing:
            r = differing[0]
            i, value, theirs = self.first[r]
            detail = (f"ranks {differing} differ from rank {head}; first: rank {r} element {i} "
                      f"is {value}, rank {head} has {theirs} ({self.count[r]} of {sizes[r]} "
                      f"elements of rank {r} differ)")
        return Finding(self.label, not differing, detail, {"differing_ranks": differing})


class _PerRank:
    """A check whose figures are kept per rank: ``count`` wrong, the ``first`` wrong."""

    def __init__(self):
        self.count, self.first = {}, {}

    def merge(self, r: int, offset: int, summary) -> None:
        if summary is None:
            return
        n, first = summary
        self.count[r] = self.count.get(r, 0) + n
        if first is not None and r not in self.first:
            self.first[r] = (offset + first[0], *first[1:])

    def first_rank(self) -> int | None:
        """The lowest rank with a wrong element (None: none)."""
        return min(self.first, default=None)


class ExactCheck(_PerRank):
    """Integers and data movement, bit for bit against the fold (or the data moved).

    ``nans_alike``: a NaN matches any NaN (:func:`~refcoll.core.bits.differing`), for a
    float reduction judged against an order's prediction.
    """

    label = "exact (integers, min/max, data movement)"

    def __init__(self, nans_alike: bool = False, label: str | None = None):
        super().__init__()
        self.nans_alike = nans_alike
        if label is not None:
            self.label = label

    def summarize(self, got: np.ndarray, want: np.ndarray):
        diff = differing_elements(got, want, nans_alike=self.nans_alike) if want.size else ()
        if not len(diff):
            return None
        i = int(diff[0])
        return len(diff), (i, show(got[i]), show(want[i]))

    def finding(self, parts: dict, sizes: dict) -> Finding:
        r = self.first_rank()
        if r is None:
            return Finding(self.label, True)
        i, value, want = self.first[r]
        total, n0 = sum(self.count.values()), self.count[r]
        text = (f"{where(r, i, parts[r])} is {value}, expected {want} ({n0} of {sizes[r]} "
                "differ)")
        more = f"; {elements(total)} differ on all ranks" if total > n0 else ""
        return Finding(self.label, False, text + more,
                       {"rank": r, "index": i, "differ": int(total)})


class ExtremumCheck(_PerRank):
    """Float min/max: the extremum, any zero sign where both zeros are operands, and
    where an operand is NaN what either convention can give (:mod:`refcoll.verify.ieee`)."""

    label = "exact (integers, min/max, data movement)"

    def __init__(self, op: str):
        super().__init__()
        self.op, self.conventions = op, {key: 0 for key in CONVENTIONS}

    def summarize(self, cols: np.ndarray, got: np.ndarray):
        ok, convention = judge_extremum(self.op, cols, got)
        counts = {key: int(((convention == key) & ok).sum()) for key in CONVENTIONS}
        bad = np.flatnonzero(~ok)
        first = None
        if bad.size:
            i = int(bad[0])
            first = (i, show(got[i]), cols[:, i].astype(np.float64), float(got[i]), cols.dtype)
        return counts, (int(bad.size), first)

    def merge(self, r: int, offset: int, summary) -> None:
        counts, wrong = summary
        for key, n in counts.items():
            self.conventions[key] += n
        super().merge(r, offset, wrong)

    def finding(self, parts: dict) -> Finding:
        used = {key: n for key, n in self.conventions.items() if n}
        follows = "; ".join(f"{elements(n)} (counted on every rank): {CONVENTIONS[key]}"
                            for key, n in used.items())
        r = self.first_rank()
        if r is None:
            return Finding(self.label, True, follows, {"conventions": used} if used else {})
        i, value, column, number, dtype = self.first[r]
        why = explain(self.op, column, number, dtype)
        total = sum(self.count.values())
        detail = f"{where(r, i, parts[r])} is {value}: {why} ({elements(total)} wrong)"
        return Finding(self.label, False, detail + (f"; {follows}" if follows else ""),
                       {"rank": r, "index": i, "value": value, "why": why, "differ": int(total),
                        "conventions": used})


class BoundCheck:
    """Float sum/avg/prod: the bound on finite results, the rules on the rest."""

    label = "within the error bound"

    def __init__(self, op: str, dtype):
        self.op, self.dtype = op, dtype
        self.failed = self.special = 0
        self.worst = {}  # rank -> (fraction, index, the element's figures)

    def summarize(self, cols: np.ndarray, got: np.ndarray, ref):
        """Judge one block: ``cols`` the operands as the dtype, ``ref`` their reference
        (or its :class:`~refcoll.verify.screen.Estimate`, which decides most elements)."""
        if isinstance(ref, Estimate):
            failed, special, i, judged, j = screened(ref, got.astype(np.float64))
        else:
            judged = judge_float(self.op, cols, got.astype(np.float64), self.dtype, ref)
            i = j = int(np.argmax(judged.fraction))
            failed, special = int((~judged.ok).sum()), int(judged.special.sum())
        odd, ok = bool(judged.special[j]), bool(judged.ok[j])
        figures = {"value": float(got[i]), **judged.numbers(j),
                   "fraction_of_bound": float(judged.fraction[j]), "special": odd}
        why = (cols[:, i].copy(), float(got[i])) if odd or not ok else None
        return failed, special, i, figures, why, ok

    def merge(self, r: int, offset: int, summary) -> None:
        failed, special, i, figures, why, ok = summary
        self.failed += failed
        self.special += special
        if r not in self.worst or figures["fraction_of_bound"] > self.worst[r][0]:
            self.worst[r] = (figures["fraction_of_bound"], offset + i, figures, why, ok)

    def finding(self, parts: dict) -> Finding:
        scale_name = "|Π x_i|" if self.op == "prod" else ("Σ|x_i|/p" if self.op == "avg"
                                                         else "Σ|x_i|")
        best = None
        for r in sorted(self.worst):  # the first rank of the largest fraction
            if best is None or self.worst[r][0] > self.worst[best][0]:
                best = r
        if best is None:
            return Finding(self.label, True, "no elements")
        _, i, figures, why, ok = self.worst[best]
        worst = {"rank": best, "index": i, **figures}
        if why is not None:
            worst["why"] = explain(self.op, why[0], why[1], self.dtype, legal=ok)
        at = where(best, i, parts[best])
        if worst["special"] or np.isinf(worst["fraction_of_bound"]):
            detail = f"{at} is {worst['value']!r}: {worst['why']}"
        else:
            detail = (f"worst: {at}: {worst['value']!r} vs exact {worst['exact']!r}, error "
                      f"{worst['error']:.3g} = {worst['ulps']:.3g} ulp of {scale_name} "
                      f"({worst['scale']:.3g}), {100 * worst['fraction_of_bound']:.3g}% of "
                      "the bound")
        if self.failed:
            detail = f"{elements(self.failed)} outside the bound or the IEEE rules; " + detail
        elif self.special:
            detail += (f"; {elements(self.special)} with non-finite operands or results judged "
                       "by the IEEE rules (spec/README.md)")
        worst.pop("special")
        return Finding(self.label, self.failed == 0, detail,
                       {**worst, "violations": self.failed, "scale_name": scale_name,
                        "ieee_rules": self.special})


class ContributionCheck:
    """Name ranks whose contribution is missing or counted twice, from exact inputs.

    Every partial sum of such inputs is exact, so every order gives ``S``; rank ``q`` is
    missing where ``S - x_q`` is the result and counted twice where ``S + x_q`` is. An
    ``avg`` divided after the sum gives ``fl(S/p)``; one computed as NCCL computes a
    float average, each input times ``fl(1/p)`` and rounded, then summed, may round
    elsewhere within the bound of every average, ``γ(p)·Σ|x|/p`` (and the smallest
    subnormal): so an ``avg`` differs where it is neither, and is missing or twice
    ``x_q`` where it lies within that distance of ``(S ∓ x_q)/p``. The first
    :data:`ANALYSED` differing elements of each rank are analysed.
    """

    label = "every rank's contribution counted once"

    def __init__(self, divides: bool, p: int, dtype):
        self.divides, self.p, self.dtype = divides, p, dtype
        self.count, self.problems = {}, {}

    def _is(self, total, g, allowed) -> np.ndarray:
        """Return where ``g`` is what a sum of ``total`` gives (``avg``: either division)."""
        if not self.divides:
            return g == total
        mean = total / self.p
        with np.errstate(invalid="ignore"):
            return (g == mean.astype(self.dtype).astype(np.float64)) \
                | (np.abs(g - mean) <= allowed)

    def summarize(self, cols: np.ndarray, got: np.ndarray, room: int = ANALYSED):
        cols = cols.astype(np.float64)
        exact = cols.sum(axis=0)
        g = got.astype(np.float64)
        allowed = None
        if self.divides:  # NCCL's pre-multiplied average rounds within the avg bound
            allowed = avg_allowance(np.abs(cols).sum(axis=0), self.p, self.dtype)
        bad = np.flatnonzero(~self._is(exact, g, allowed))
        problems = []
        for i in bad[:room]:
            column, near = cols[:, i], None if allowed is None else allowed[i]
            missing = np.flatnonzero(self._is(exact[i] - column, g[i], near) & (column != 0))
            twice = np.flatnonzero(self._is(exact[i] + column, g[i], near) & (column != 0))
            problems.append((int(i), [int(q) for q in missing], [int(q) for q in twice]))
        return int(bad.size), problems

    def room(self, r: int) -> int:
        """How many more of rank ``r``'s differing elements are analysed."""
        return ANALYSED - len(self.problems.get(r, ()))

    def merge(self, r: int, offset: int, summary) -> None:
        n, problems = summary
        self.count[r] = self.count.get(r, 0) + n
        kept = self.problems.setdefault(r, [])
        kept.extend((offset + i, m, t) for i, m, t in problems[:ANALYSED - len(kept)])

    def finding(self, parts: dict) -> Finding:
        problems = [(r, *pr) for r in sorted(self.problems) for pr in self.problems[r]]
        if not problems:
            return Finding(self.label, True)

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
        total_bad = sum(self.count.values())
        detail = (f"{what} (first at {where(r, i, parts[r])}; candidates there: missing "
                  f"{missing}, twice {twice}; {elements(total_bad)} differ, the first "
                  f"{len(problems)} analysed)")
        return Finding(self.label, False, detail,
                       {"rank": r, "index": i, "missing": culprit_missing,
                        "twice": culprit_twice, "differ": int(total_bad),
                        "analysed": len(problems)})
