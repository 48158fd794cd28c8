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

import contextlib
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np

from ..calls.collectives import simulate
from ..core.chunking import chunk_slice
from ..core.errors import UsageError
from ..core.ops import (
    dtype_name,
    exact_integer_limit,
    finfo,
    get_op,
    is_float,
    is_integer,
    unit_roundoff,
)
from .evaluators import DATA_MOVEMENT, rank_blockwise
from .findings import (
    BOUND_ALONE,
    BoundCheck,
    CheckReport,
    ContributionCheck,
    ExactCheck,
    ExtremumCheck,
    Finding,
    IdenticalCheck,
    shape_finding,
    where,
)
from .ieee import gamma, ulps
from .npy import NpyFile
from .screen import estimate

__all__ = ["fold", "exact_reduce", "error_bound", "gamma", "bound_violations", "violations",
           "check_outputs", "CheckReport", "Finding", "expected_outputs", "ulps", "stacked",
           "reference_blocks", "spans_held", "block_operands", "held_parts", "block_length",
           "shapes_judged", "flat_operand"]


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


def _parts(collective: str, p: int, n: int, root: int) -> dict:
    """Return rank -> the slice of the reduced vector its output holds, for ranks with one."""
    if collective == "reduce":
        return {root: slice(None)}
    if collective == "reduce_scatter":
        return {r: chunk_slice(n, p, r) for r in range(p)}
    return {r: slice(None) for r in range(p)}


def _shapes(collective: str, p: int, shape: tuple, parts: dict) -> dict:
    """Return rank -> the output shapes allowed (allgather: flat, or one row per rank)."""
    n = math.prod(shape)
    if collective == "allgather":
        return {r: [(p * n,), (p, *shape)] for r in parts}
    if collective == "reduce_scatter":
        return {r: [(len(range(n)[sl]),)] for r, sl in parts.items()}
    return {r: [shape] for r in parts}


def shapes_judged(collective: str, p: int, shape: tuple, root: int, outputs, dtype) -> Finding:
    """Return :func:`check_outputs`' first finding: each rank's output (an array or a
    file's header) of ``dtype`` and the shape the collective gives for inputs of ``shape``."""
    parts = _parts(collective, p, math.prod(shape), root)
    return shape_finding(_shapes(collective, p, tuple(shape), parts), outputs, dtype)


#: The bytes one block of :func:`check_outputs` holds: every rank's operands and
#: outputs and the bound's float64 work arrays. What ``refcoll check`` needs beside its
#: own code is about three times this (the block read ahead, the judgement's
#: temporaries), whatever the count.
BLOCK_BYTES = 32 << 20


def block_length(p: int, itemsize: int, budget: int = BLOCK_BYTES) -> int:
    """Return the elements of each rank a block holds: ``budget`` over ``p`` operands,
    ``p`` outputs and about 14 float64 work arrays per element. Reading ahead holds a
    second block's operands and outputs."""
    return max(1, budget // (2 * p * itemsize + 112))


def _lazy(x) -> bool:
    """Whether ``x`` is read block by block (an :class:`~refcoll.verify.npy.NpyFile`, a
    :class:`~refcoll.verify.formula.FormulaInput`: ``read(lo, hi)`` and ``whole()``)."""
    return hasattr(x, "read") and hasattr(x, "whole")


def flat_operand(x):
    """Return an array flat (a lazy one stays itself: it is read block by block)."""
    return x if _lazy(x) else np.asarray(x).reshape(-1)


def _read(x, lo: int, hi: int) -> np.ndarray:
    return x.read(lo, hi) if _lazy(x) else x[lo:hi]


def spans_held(collective: str, p: int, n: int, root: int) -> dict:
    """Return rank -> the elements of the reference vector its output holds (a range),
    for the ranks with an output (an all-gather's vector is every input in rank order)."""
    parts = _parts(collective, p, n, root)
    total = p * n if collective == "allgather" else n
    return {r: range(total)[parts[r]] for r in sorted(parts)}


def block_operands(collective: str, inputs, lo: int, hi: int, q: int, n: int, root: int,
                   dtype) -> np.ndarray:
    """Return what reference elements ``lo .. hi-1`` are made from: a reduction's
    operands, every rank's (``(p, hi - lo)``), or a data movement's elements, the input
    they are (an all-gather's input ``q``, a broadcast's root's)."""
    if collective not in DATA_MOVEMENT:
        return stacked(inputs, lo, hi, dtype)
    source, base = (q, q * n) if collective == "allgather" else (root, 0)
    return _read(inputs[source], lo - base, hi - base)


def held_parts(lo: int, hi: int, outputs: dict, spans: dict) -> list:
    """Return each rank's part of reference elements ``lo .. hi-1``, as
    ``(rank, offset, a, b, got)``: its output's elements from ``offset``, which are the
    reference's ``a .. b-1`` (``outputs``: rank -> its flat output, or file)."""
    parts = []
    for r, span in spans.items():
        a, b = max(lo, span.start), min(hi, span.stop)
        if a < b:
            parts.append((r, a - span.start, a, b, _read(outputs[r], a - span.start,
                                                           b - span.start)))
    return parts


class _Held:
    """Each rank's part of a block of the reference vector, read on the judging thread.

    Where every rank's output holds the whole block and is a file (an all-reduce, an
    all-gather or a broadcast judged from files), the parts are read into the rows of one
    buffer kept from block to block, so a block's reads fault in no fresh pages, and
    :func:`_alike` compares every row with the first in one pass. Nothing judged keeps
    a view of the buffer past its block: findings copy what they report."""

    def __init__(self, outputs: dict, spans: dict):
        self.outputs, self.spans, self.buffer = outputs, spans, None
        files = list(outputs.values())
        self.stackable = (len(files) > 1 and all(isinstance(x, NpyFile) for x in files)
                          and len({x.dtype for x in files}) == 1
                          and len({(s.start, s.stop) for s in spans.values()}) == 1)

    def read(self, lo: int, hi: int) -> tuple:
        """Return ``(parts, rows)``: :func:`held_parts`'s parts of elements ``lo .. hi-1``
        and, where they were read as one buffer's rows, that ``(ranks, hi - lo)`` array
        (else None)."""
        if not self.stackable:
            return held_parts(lo, hi, self.outputs, self.spans), None
        span = next(iter(self.spans.values()))
        a, b = max(lo, span.start), min(hi, span.stop)
        if a >= b:
            return [], None
        files = list(self.outputs.values())
        if self.buffer is None or self.buffer.shape[1] < b - a:
            self.buffer = np.empty((len(files), b - a), dtype=files[0].dtype)
        rows = self.buffer[:, :b - a]
        offset = a - span.start
        for row, x in zip(rows, files):
            x.read(offset, offset + b - a, out=row)
        return [(r, offset, a, b, row) for r, row in zip(self.outputs, rows)], rows


def _alike(rows: np.ndarray) -> np.ndarray:
    """Return, for each row, whether it holds the first row's bits (one pass for all)."""
    size = rows.dtype.itemsize  # (as bytes where no unsigned type has its width)
    words = rows.view(f"u{size}" if size in (1, 2, 4, 8) else np.uint8)
    return (words == words[0]).all(axis=1)


def stacked(xs, lo: int, hi: int, dtype) -> np.ndarray:
    """Return elements ``lo .. hi-1`` of every ``xs`` as rows of one ``(p, hi - lo)`` array."""
    cols = np.empty((len(xs), hi - lo), dtype=dtype)
    for row, x in zip(cols, xs):
        if isinstance(x, NpyFile):
            x.read(lo, hi, out=row)
        else:
            row[...] = _read(x, lo, hi)
    return cols


def reference_blocks(collective: str, p: int, n: int, length: int):
    """Yield ``(lo, hi, q)``: blocks of the reference vector, each within one input ``q``
    (allgather's vector is every input in rank order; the others are ``n`` long)."""
    for q in range(p if collective == "allgather" else 1):
        for lo in range(0, n, length):
            yield q * n + lo, q * n + min(n, lo + length), q


def _read_ahead(blocks: list, read, files: list):
    """Yield ``(block, read(block))`` for each block, reading the next block's files (and
    working out its reference) on a thread of its own while the caller judges this one
    (the reads release the GIL, and so do NumPy's loops: on two cores the two halves
    of the work run side by side). Where
    nothing is read from a file, or there is one block, everything runs here."""
    if not files or len(blocks) < 2:
        for block in blocks:
            yield block, read(block)
        return
    with ThreadPoolExecutor(1, thread_name_prefix="refcoll-read") as pool:
        ahead = pool.submit(read, blocks[0])
        for k, block in enumerate(blocks):
            data = ahead.result()
            if k + 1 < len(blocks):
                ahead = pool.submit(read, blocks[k + 1])
            yield block, data


def _wholes(inputs) -> list:
    return [x.whole() if _lazy(x) else x for x in inputs]


def check_outputs(inputs, outputs, *, collective: str = "allreduce", op="sum",
                  algorithm: str | None = None, root: int = 0,
                  budget: int = BLOCK_BYTES) -> CheckReport:
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

    Inputs and outputs are arrays, or files and formulas read block by block
    (:class:`~refcoll.verify.npy.NpyFile`, :class:`~refcoll.verify.formula.FormulaInput`):
    every check goes through the elements in blocks of :func:`block_length`
    (``budget`` bytes of operands), so memory is bounded whatever the count, and the
    findings are the same, bit for bit and word for word, for any block length. With
    ``algorithm`` the simulator runs on whole inputs.

    Raises:
        UsageError: the outputs cannot be judged (wrong number of ranks, missing files).
    """
    reduction = get_op(op) if collective in ("allreduce", "reduce_scatter", "reduce") else None
    p = len(inputs)
    if any(x is None for x in inputs):
        raise UsageError("an input rank file is missing")
    inputs = [x if _lazy(x) else np.asarray(x) for x in inputs]
    outputs = [x if x is None or _lazy(x) else np.asarray(x) for x in outputs]
    if len(outputs) < p:
        outputs = list(outputs) + [None] * (p - len(outputs))
    dtype, n = inputs[0].dtype, int(inputs[0].size)
    report = CheckReport(collective, reduction.name if reduction else "-", algorithm, p, n,
                         dtype_name(dtype))
    parts = _parts(collective, p, n, root)
    report.findings.append(shapes_judged(collective, p, inputs[0].shape, root, outputs, dtype))
    if not report.findings[-1].passed:
        return report
    ranks = sorted(parts)
    spans = spans_held(collective, p, n, root)  # the reference elements each rank holds
    name = reduction.name if reduction else None
    judge = _Judge(collective, name, reduction, p, n, dtype, ranks)
    if algorithm is not None:
        fold = rank_blockwise(collective, p, n, dtype.itemsize, algorithm=algorithm,
                              op=name or "sum", root=root)
        check = ExactCheck(nans_alike=name is not None)  # a reduction's NaN: any NaN
        if fold is not None:  # the algorithm's result block by block (evaluators.py)
            judge.oracle = (check, fold)
        else:
            predicted = expected_outputs(collective, _wholes(inputs), algorithm=algorithm,
                                         op=name or "sum", root=root)
            judge.oracle = (check, [None if x is None else np.asarray(x).reshape(-1)
                                    for x in predicted])
    flat_in = [flat_operand(x) for x in inputs]
    got_files = {r: flat_operand(outputs[r]) for r in ranks}
    files = [x for x in [*flat_in, *got_files.values()] if isinstance(x, NpyFile)]
    blocks = list(reference_blocks(collective, p, n, block_length(p, dtype.itemsize, budget)))

    held = _Held(got_files, spans)

    def read(block):
        return judge.read(*block, flat_in, root)
    try:
        with contextlib.closing(_read_ahead(blocks, read, files)) as ahead:
            for block, data in ahead:  # a failure closes the reads before the files
                judge.block(*block, data, held.read(block[0], block[1]))
    finally:
        for x in files:
            x.close()
    sizes = {r: len(spans[r]) for r in ranks}
    report.findings.extend(judge.findings(parts, sizes, algorithm))
    floats_ordered = is_float(dtype) and name in ("sum", "avg", "prod")
    if floats_ordered and algorithm is None and not judge.exact_inputs and report.conforming \
            and judge.exact_product is None:
        report.notes.append(BOUND_ALONE)
    return report


class _Judge:
    """The checks of :func:`check_outputs`, fed one block of the reference vector at a time."""

    def __init__(self, collective, name, reduction, p, n, dtype, ranks):
        self.collective, self.name, self.n, self.dtype = collective, name, n, dtype
        self.ranks = ranks
        self.identical = (IdenticalCheck(ranks) if collective in
                          ("allreduce", "allgather", "broadcast") and p > 1 else None)
        floats = is_float(dtype)
        self.bound = BoundCheck(name, dtype) if floats and name in ("sum", "avg", "prod") \
            else None
        self.extremum = ExtremumCheck(name) if floats and name in ("min", "max") else None
        self.exact = ExactCheck() if self.bound is None and self.extremum is None else None
        self.exact_inputs = name in ("sum", "avg") and not is_integer(dtype)
        self.contribution = (ContributionCheck(reduction.divides, p, dtype)
                             if self.exact_inputs else None)
        # A float product whose every partial product is exact (integer operands, small
        # enough) has one result whatever the order: judged bit for bit, as exact sums are.
        self.exact_product = (ExactCheck(label="exact (a product every order gives exactly)")
                              if floats and name == "prod" else None)
        self.oracle = None

    def read(self, lo, hi, q, inputs, root) -> tuple:
        """Read what judging reference elements ``lo .. hi-1`` takes from the inputs: the
        operands (a reduction's ``(p, hi - lo)`` block) and their reference, or the one
        input the outputs must equal. On the read-ahead thread, this is the half of the
        work that runs beside the judging of the block before."""
        data = block_operands(self.collective, inputs, lo, hi, q, self.n, root, self.dtype)
        if self.name is None:
            return None, data, None
        want, ref = self._reference(data)
        return data, want, ref

    def block(self, lo, hi, q, data, held: tuple) -> None:
        """Judge reference elements ``lo .. hi-1`` (:meth:`read`'s ``data``) on every rank
        that holds some of them (``held``: :meth:`_Held.read`'s parts and rows)."""
        cols, want, ref = data
        parts, rows = held
        if cols is not None:  # a reduction
            if self.exact_inputs:
                self.exact_inputs = _sums_are_exact(cols)
            if self.exact_product is not None and not _products_are_exact(cols):
                self.exact_product = None  # some order rounds: the bound alone judges
        block_predicted = None
        if self.oracle is not None and callable(self.oracle[1]):  # every rank's
            block_predicted = self.oracle[1](want if cols is None else cols, lo)
        # every rank's differing elements still to analyse fit in the first rank's summary
        room = max(map(self.contribution.room, self.ranks)) if self.exact_inputs else 0
        head, head_got, head_summaries = self.ranks[0], None, None
        alike = None if rows is None or self.identical is None else _alike(rows)
        for k, (r, offset, a, b, got) in enumerate(parts):
            same = False
            if self.identical is not None:
                if r == head:
                    head_got = got
                else:
                    same = (alike is not None and alike[k]) or \
                        self.identical.add(r, offset, got, head_got)
                    self.identical.beside_second(r, offset, same, got)
            if same and head_summaries is not None:
                summaries = head_summaries
            else:
                sl = slice(a - lo, b - lo)
                summaries = self._summaries(got, None if cols is None else cols[:, sl],
                                            None if want is None else want[sl], ref, sl, room)
            if r == head:
                head_summaries = summaries
            self._merge(r, offset, summaries)
            if self.oracle is not None:
                check, predicted = self.oracle
                want_r = (block_predicted[r][a - lo:b - lo] if block_predicted is not None
                          else predicted[r][offset:offset + b - a])
                check.merge(r, offset, check.summarize(got, want_r))

    def _reference(self, cols):
        if self.exact is not None:
            with np.errstate(over="ignore", invalid="ignore", under="ignore"):
                return fold(self.name, list(cols)), None
        if self.bound is not None:
            return None, estimate(self.name, cols, self.dtype)
        return None, None

    def _summaries(self, got, cols, want, ref, sl, room: int) -> dict:
        out = {}
        if self.bound is not None and got.size:
            out["bound"] = self.bound.summarize(cols, got, ref.part(sl))
        if self.extremum is not None:
            out["extremum"] = self.extremum.summarize(cols, got)
        if self.exact is not None:
            out["exact"] = self.exact.summarize(got, want)
        if self.exact_inputs:
            out["contribution"] = self.contribution.summarize(cols, got, room)
        if self.exact_product is not None and got.size:
            with np.errstate(over="ignore", invalid="ignore", under="ignore"):
                out["exact_product"] = self.exact_product.summarize(got, fold("prod", list(cols)))
        return out

    def _merge(self, r, offset, summaries: dict) -> None:
        for key, summary in summaries.items():
            getattr(self, key).merge(r, offset, summary)

    def findings(self, parts, sizes, algorithm) -> list:
        found = []
        if self.identical is not None:
            found.append(self.identical.finding(sizes))
        if self.bound is not None:
            found.append(self.bound.finding(parts))
        elif self.extremum is not None:
            found.append(self.extremum.finding(parts))
        else:
            found.append(self.exact.finding(parts, sizes))
        if self.oracle is not None:
            found.append(_oracle_finding(self.oracle[0], parts, algorithm))
        if self.exact_inputs:
            found.append(self.contribution.finding(parts))
        if self.exact_product is not None:
            found.append(self.exact_product.finding(parts, sizes))
        return found


def _oracle_finding(check: ExactCheck, parts, algorithm) -> Finding:
    label = f"bit-exact against {algorithm}"
    r = check.first_rank()
    if r is None:
        return Finding(label, True, "conforming, bit-exact")
    i, value, expected = check.first[r]
    total = sum(check.count.values())
    return Finding(label, False, f"{where(r, i, parts[r])} is {value}, {algorithm} gives "
                   f"{expected}; {total} element{' differs' if total == 1 else 's differ'}",
                   {"rank": r, "index": i, "value": value, "expected": expected,
                    "differ": total})


def _products_are_exact(cols: np.ndarray) -> bool:
    """Whether every partial product of the float operands ``cols`` (``(p, k)``) is exact:
    integer-valued, and the product of their magnitudes (each at least 1; a zero makes
    the product an exact zero) within the dtype's exact integers."""
    stacked = cols.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        if not np.all(stacked == np.round(stacked)):
            return False
        # (below the limit, not at it: float64's own product of float64 operands may round
        # up to 2**53 exactly, and a product every factor of which is >= 1 only grows)
        return bool(np.all(np.maximum(np.abs(stacked), 1.0).prod(axis=0)
                           < exact_integer_limit(cols.dtype)))


def _sums_are_exact(cols: np.ndarray) -> bool:
    """Whether every partial sum of the float operands ``cols`` (``(p, k)``) is exact
    (integer-valued, small enough); integers' wrapping sums are the exact check's."""
    dt = cols.dtype
    stacked = cols.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        return bool(np.all(stacked == np.round(stacked))
                    and np.all(np.abs(stacked).sum(axis=0) <= exact_integer_limit(dt)))
