"""A library's own collectives judged by the oracle: what ``verify --backend torch|mpi`` share.

A library's collective has no algorithm to name: a case is (collective, op, dtype,
count, in place or not, input kind), with the battery's inputs
(:func:`refcoll.verify.inputs.make_input`). Each rank calls the library on its
input; rank 0 gathers every rank's output over a control transport of its own
(the communicator under test carries only the calls under test) and judges them
as ``refcoll check`` judges another library
(:func:`refcoll.verify.oracle.check_outputs`): every rank the same bits where all
get the same result; integers, ``min``/``max`` and data movement bit for bit;
float ``sum``/``avg``/``prod`` within the error bound and, on ``exact`` inputs, the
naive fold's bits, as the battery holds refcoll's own; an out-of-place input
unchanged. Each order-dependent case records which refcoll orders give its bits
(:func:`refcoll.verify.identify.identify`).

Each (collective, op, dtype) is first tried on a small input; what the library
refuses there (or :meth:`LibraryJudge.refusal` knows it lacks, as MPI lacks an
average) is listed as not supported, never as failed; a case that raises after its
probe passed fails. :class:`LibraryJudge` is the run; a library's judge says how
to call it (:mod:`refcoll.torch.judge`, :mod:`refcoll.baselines.mpi_judge`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ...calls.agree import gather_records
from ...core.bits import first_difference, same_bits
from ...core.chunking import chunk_slice
from ...core.errors import UsageError
from ...core.ops import DTYPES, OPS, get_dtype, get_op, is_float
from ..identify import identify
from ..inputs import make_input
from ..oracle import check_outputs, fold
from .cases import Case, CaseResult, call_cases, default_sizes, ordered
from .control import bcast_report, gather_reports
from .judge import group_rows

__all__ = ["build_library_cases", "verdict", "LibraryReport", "LibraryJudge", "first_line"]


def build_library_cases(p: int, label: str, calls: dict, in_place_only: Sequence[str], *,
                        collectives: Sequence[str] | None = None,
                        ops: Sequence[str] | None = None, dtypes: Sequence[str] | None = None,
                        sizes: Sequence[int] | None = None,
                        inplace: Sequence[bool] = (False, True),
                        allow_empty: bool = True) -> list[Case]:
    """Return the cases for a library's collectives on ``p`` ranks, grouped by (collective, op).

    ``calls``: refcoll's collective -> the library's call; ``in_place_only``: the
    collectives the library offers in place only. ``None`` means every
    collective, op and dtype, and the battery's sizes. A case's ``algorithm`` is
    ``label`` (``gloo``, ``mpi``); its root the battery's, ``(count + 1) % p``.
    Raises :class:`UsageError` for an unknown name, and with ``allow_empty=False``
    for a selection that leaves no case, saying why.
    """
    colls = list(collectives) if collectives is not None else list(calls)
    if set(colls) - set(calls):
        raise UsageError(f"unknown collective {sorted(set(colls) - set(calls))[0]!r}: "
                         f"choose one of {', '.join(calls)}")
    op_names = [get_op(o).name for o in (ops if ops is not None else OPS)]
    dtype_names = list(dtypes) if dtypes is not None else list(DTYPES)
    for d in dtype_names:
        get_dtype(d)
    size_list = list(sizes) if sizes is not None else default_sizes(p)
    cases = []
    for coll in colls:
        modes = [m for m in inplace if m or coll not in in_place_only]
        cases += call_cases(label, coll, (), p, p, op_names, dtype_names, size_list, modes)
    if not cases and not allow_empty:
        raise UsageError("no case matches the selection: " + _why_no_case(
            p, colls, op_names, dtype_names, size_list, list(inplace), calls, in_place_only))
    return cases


def _why_no_case(p, colls, op_names, dtype_names, size_list, modes, calls,
                 in_place_only) -> str:
    empty = [what for what, chosen in (("collective", colls), ("dtype", dtype_names),
                                       ("size", size_list), ("mode", modes)) if not chosen]
    if p < 1 or empty:
        return f"at least 1 rank and one {empty[0] if empty else 'rank'} are needed"
    if not op_names:
        return "no op is selected; name at least one, or all"
    if True not in modes and all(c in in_place_only for c in colls):
        return (f"{', '.join(calls[c] for c in in_place_only)} work in place only, so "
                "--inplace no leaves nothing of them: use --inplace both")
    return (f"no selected op ({', '.join(op_names) or 'none'}) is defined on a selected dtype "
            f"({', '.join(dtype_names)}): `refcoll list` shows the ops each dtype takes")


# ---------------------------------------------------------------------- verdicts

def _inexact(case: Case, inputs, outputs) -> list[str]:
    """Return where an ``exact`` case's float sum or avg is not the fold's bits.

    The oracle bounds float sums and averages; exact inputs give every order the
    same bits, so they must be the fold's. (A product every order gives exactly
    the oracle judges bit for bit itself.)
    """
    if case.kind != "exact" or case.op not in ("sum", "avg") or \
            not is_float(DTYPES[case.dtype]):
        return []
    full = fold(case.op, inputs)
    for r, out in enumerate(outputs):
        if out is None:
            continue
        want = full[chunk_slice(full.size, case.ranks, r)] if \
            case.collective == "reduce_scatter" else full
        if not same_bits(out, want):
            return [f"rank {r}: exact inputs, yet not the exact result: "
                    f"{first_difference(out, want)}"]
    return []


def verdict(case: Case, inputs, outputs, problems: Sequence[str] = ()) -> dict:
    """Return the verdict on one case's per-rank ``outputs`` (``None`` where a rank has none).

    ``inputs``: every rank's input as passed; ``problems``: what the ranks found
    themselves. Returns ``{"problems": [...], "same_bits": orders or None}``
    (passed when ``problems`` is empty; orders for order-dependent cases only).
    """
    problems = list(problems)
    if problems:
        return {"problems": problems, "same_bits": None}
    report = check_outputs(inputs, outputs, collective=case.collective, op=case.op or "sum",
                           root=case.root)
    problems = [f"{f.check}: {f.detail}" for f in report.findings if not f.passed]
    problems += _inexact(case, inputs, outputs)
    same = identify(inputs, outputs, collective=case.collective, op=case.op or "sum",
                    root=case.root, known=[]).matches if ordered(case) and not problems else None
    return {"problems": problems, "same_bits": same}


@dataclass
class LibraryReport:
    """What a run found: ``results`` (a ``CaseResult`` per case run), ``unsupported``
    (per (collective, op, dtype) the library refused: its ``call``, the ``reason`` and
    the ``cases`` not run) and ``same_bits`` (``"collective op dtype"`` -> the refcoll
    orders whose simulated results equal the library's on every order-dependent case
    of that class).
    """

    library: str
    version: str
    backend: str
    world_size: int
    seed: int
    launcher: str
    results: list = field(default_factory=list)
    unsupported: list = field(default_factory=list)
    same_bits: dict = field(default_factory=dict)

    @property
    def passed(self) -> int:
        return sum(r.passed for r in self.results)

    @property
    def failed(self) -> int:
        return len(self.results) - self.passed

    def unsupported_summary(self) -> list[dict]:
        """Return the refused classes merged: per call and reason, dtypes refused the same ops."""
        ops: dict[tuple, list] = {}
        for u in self.unsupported:
            ops.setdefault((u["call"], u["reason"], u["dtype"]), []).append(u["op"])
        merged: dict[tuple, dict] = {}
        for (call, reason, dtype), refused in ops.items():
            merged.setdefault((call, reason, tuple(refused)), {"call": call, "ops": refused,
                               "dtypes": [], "reason": reason})["dtypes"].append(dtype)
        return list(merged.values())

    def to_json(self) -> dict:
        """Return the report as ``refcoll verify --backend ... --json`` writes it."""
        return {"backend": self.library, "version": self.version, "library": self.backend,
                "launcher": self.launcher, "world_size": self.world_size, "seed": self.seed,
                "passed": self.passed, "failed": self.failed,
                "not_supported": sum(u["cases"] for u in self.unsupported),
                "groups": group_rows(self.results), "unsupported": self.unsupported,
                "same_bits": self.same_bits, "cases": [r.to_json() for r in self.results]}


# -------------------------------------------------------------------------- runs

class LibraryJudge:
    """A library's collectives on a communicator, judged on rank 0.

    A subclass sets :attr:`calls` and :attr:`in_place_only` and says how to call
    the library (:meth:`_call`) and read a result back (:meth:`_host`); ``ctl``
    is a transport of the same ranks that only the verdicts travel over.
    """

    #: refcoll's collective -> the library's call, and those it offers in place only.
    calls: dict = {}
    in_place_only: tuple = ()
    #: Whether an in-place reduce's ranks other than the root send their input as it is
    #: (MPI's: only the root passes MPI_IN_PLACE), so it must be left unchanged there too.
    sends_off_root = False
    #: What names the exchange of verdicts in a timeout.
    exchange = "refcoll verify --backend"
    report_class = LibraryReport

    def __init__(self, *, rank: int, size: int, ctl, library: str, version: str,
                 backend: str, launcher: str):
        self.rank, self.size, self.ctl = rank, size, ctl
        self.library, self.version, self.backend, self.launcher = (library, version, backend,
                                                                   launcher)
        self._refused: dict[tuple, str | None] = {}

    def cases(self, **filters) -> list[Case]:
        """Return this library's cases for this communicator; an empty selection is an error."""
        return build_library_cases(self.size, self.backend, self.calls, self.in_place_only,
                                   allow_empty=False, **filters)

    def share(self, obj):
        """Return rank 0's small JSON object on every rank (a verdict, an error)."""
        with self.ctl.call(self.exchange):
            return bcast_report(self.ctl, obj)

    def gather(self, obj) -> list | None:
        """Return every rank's small JSON object on rank 0 (None on the others)."""
        with self.ctl.call(self.exchange):
            return gather_reports(self.ctl, obj)

    # ------------------------------------------------------------ the hooks

    def input(self, case: Case, rank: int, seed: int) -> np.ndarray:
        """Return rank ``rank``'s input as the battery makes it (a library may pad it)."""
        return make_input(case.kind, DTYPES[case.dtype], case.count, rank, case.ranks,
                          op=case.op or "sum", seed=seed)

    def output_count(self, case: Case, rank: int) -> int:
        """Return the elements of rank ``rank``'s result (reduce_scatter: its chunk)."""
        n, p = case.count, case.ranks
        if case.collective == "reduce_scatter":
            part = chunk_slice(n, p, rank)
            return part.stop - part.start
        return n * p if case.collective == "allgather" else n

    def refusal(self, collective: str, op: str | None, dtype: str) -> str | None:
        """Return why the library cannot take this class without trying it (None: try it)."""
        return None

    def refusal_errors(self) -> tuple:
        """Return the exceptions a probe may meet that mean the library refuses the class."""
        return (Exception,)

    def _call(self, case: Case, mine: np.ndarray):
        """Run the library's collective on this rank's input; return (result, input as passed).

        The result is ``None`` on a rank that gets none (a reduce's non-roots).
        """
        raise NotImplementedError

    def _host(self, result) -> np.ndarray:
        """Return a host copy of a result as a NumPy array of refcoll's dtype."""
        return np.array(result, copy=True)

    # ------------------------------------------------------------ the run

    def refused(self, collective: str, op: str | None, dtype: str) -> str | None:
        """Return why the library refuses ``collective``, ``op`` on ``dtype`` (None: it takes it).

        Tried once per run on a small exact input on every rank; any rank's
        exception (its message, first line) is the answer on every rank.
        """
        key = (collective, op, dtype)
        if key not in self._refused:
            error = self.refusal(*key)
            if error is None:
                probe = Case(self.backend, collective, op, dtype, self.size, False, "exact", 0,
                             (), self.size, self.size)
                try:
                    self._call(probe, self.input(probe, self.rank, 0))
                except self.refusal_errors() as exc:  # a refusal is an answer, not a crash
                    error = f"{type(exc).__name__}: {first_line(exc)}"
            with self.ctl.call(self.exchange):
                reports = gather_reports(self.ctl, {"error": error})
                answer = None
                if self.rank == 0:
                    answer = next((rep["error"] for rep in reports if rep["error"]), None)
                self._refused[key] = bcast_report(self.ctl, {"error": answer})["error"]
        return self._refused[key]

    def run_case(self, case: Case, *, seed: int = 0) -> tuple[CaseResult, list | None]:
        """Run one case on every rank; return its verdict and the orders it matches (every rank)."""
        mine = self.input(case, self.rank, seed)
        problems: list[str] = []
        result = None
        try:
            out, x = self._call(case, mine)
            result = None if out is None else self._host(out)
            sent = not case.inplace and case.collective not in self.in_place_only
            off_root = (self.sends_off_root and case.inplace and case.collective == "reduce"
                        and self.rank != case.root)
            if (sent or off_root) and not same_bits(self._host(x), mine):
                problems.append("input was modified by an out-of-place call" if sent else
                                "a rank other than the root's send buffer was modified")
        except Exception as exc:  # noqa: BLE001 - a failing call is a verdict, not a crash
            problems.append(f"raised {type(exc).__name__}: {first_line(exc)}")
        itemsize = DTYPES[case.dtype].itemsize
        nbytes = self.output_count(case, self.rank) * itemsize
        has = result is not None and result.nbytes == nbytes
        if result is not None and not has:
            problems.append(f"returned {result.nbytes} B where {nbytes} B were expected")
        # Every rank sends a record of the largest result's size (reduce_scatter's chunks
        # differ by an element at most), its own result first.
        width = max(self.output_count(case, r) for r in range(self.size)) * itemsize
        record = np.zeros(width, np.uint8)
        if has:
            record[:nbytes] = result.reshape(-1).view(np.uint8)
        with self.ctl.call(self.exchange):
            reports = gather_reports(self.ctl, {"problems": problems, "output": has})
            records = gather_records(self.ctl, record) if width else [record] * self.size
            found = self._judge(case, seed, reports, records) if self.rank == 0 else None
            found = bcast_report(self.ctl, found)
        return (CaseResult(case, not found["problems"], "; ".join(found["problems"])),
                found["same_bits"])

    def _judge(self, case: Case, seed: int, reports, records) -> dict:
        inputs = [self.input(case, r, seed) for r in range(self.size)]
        dtype = DTYPES[case.dtype]
        outputs = [rec[:self.output_count(case, r) * dtype.itemsize].view(dtype)
                   if rep["output"] and not (case.collective == "reduce" and r != case.root)
                   else None for r, (rep, rec) in enumerate(zip(reports, records))]
        return verdict(case, inputs, outputs, [f"rank {r}: {msg}" for r, rep in
                                               enumerate(reports) for msg in rep["problems"]])

    def run(self, cases: Sequence[Case], *, seed: int = 0,
            on_group: Callable[[dict], None] | None = None) -> LibraryReport:
        """Run ``cases`` (every rank the same list); return the report on every rank.

        ``on_group`` is given each group's :func:`group_rows` row (collective
        and op), with ``call`` (the library's name), ``failed_dtypes`` and
        ``same_bits`` (dtype -> the orders matched) added, once its last case is
        judged; a group whose every case the library refused has no row.
        """
        report = self.report_class(self.library, self.version, self.backend, self.size, seed,
                                   self.launcher)
        refused: dict[tuple, dict] = {}
        group: list = []
        for i, case in enumerate(cases):
            key = (case.collective, case.op, case.dtype)
            reason = self.refused(*key)
            if reason is not None:
                refused.setdefault(key, {
                    "collective": case.collective, "call": self.calls[case.collective],
                    "op": case.op or "-", "dtype": case.dtype, "reason": reason, "cases": 0}
                )["cases"] += 1
            else:
                result, same = self.run_case(case, seed=seed)
                report.results.append(result)
                group.append(result)
                name = f"{case.collective} {case.op} {case.dtype}"
                if same is None and ordered(case) and not result.passed:
                    same = []  # a failed case's bits are no order's
                if same is not None:  # the orders that match every case of the class so far
                    report.same_bits[name] = [o for o in report.same_bits.get(name, same)
                                              if o in same]
            following = cases[i + 1] if i + 1 < len(cases) else None
            if group and (following is None or (following.collective, following.op) != (
                    case.collective, case.op)):
                if on_group is not None:
                    on_group(self._row(group, report))
                group = []
        report.unsupported = list(refused.values())
        return report

    def _row(self, group: list, report: LibraryReport) -> dict:
        row = group_rows(group)[0]
        case = group[0].case
        row["call"] = self.calls[case.collective]
        row["failed_dtypes"] = list(dict.fromkeys(r.case.dtype for r in group if not r.passed))
        row["same_bits"] = {name.split()[-1]: labels for name, labels in report.same_bits.items()
                            if name.startswith(f"{case.collective} {case.op} ")}
        return row


def first_line(exc: BaseException) -> str:
    """Return an exception's message, first line (its repr when it has none)."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
