"""Running a case: each rank runs the collective on its input and checks its own output.

Inputs are deterministic per (case, rank), so each rank regenerates every rank's
input and computes the expected result locally; only reports and verdicts
travel, over a separate control transport (:mod:`.control`). On GPUs (``xp``
CuPy) each rank's input is copied to its GPU, the collective must return a
device array, and the checks run on host copies of the results, against the
same host references: a GPU run is held to the CPU's bits.

The battery runs its cases a group at a time (:attr:`Case.group`, one row of
the summary): the group's ranks run its cases one after another, each case
ending in a barrier of those ranks alone, and keep their reports; then every
rank sends rank 0 the whole group's reports at once, and rank 0 broadcasts
the group's verdicts. The ranks a group leaves out (switch processes the
group's algorithm does not use) run nothing and sleep until the verdicts come.
What a case is judged on, and so its verdict, is the same as when each case
exchanged its own. A case's expected results and the simulator's prediction
depend neither on the mode nor on the rank: each is computed once, on the
first of the case's two modes, and on rank 0 alone for the prediction.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
from typing import Callable, Sequence

import numpy as np

from ...algorithms._util import overlaps
from ...calls.agree import barrier
from ...calls.collectives import COLLECTIVE_FUNCTIONS, device_for
from ...calls.nonblocking import NONBLOCKING_FUNCTIONS
from ...core import xp as xp_module
from ...core.bits import first_difference, same_bits
from ...core.chunking import chunk_slice
from ...core.errors import CollectiveTimeout
from ...core.ops import DTYPES
from ..inputs import make_inputs
from ..oracle import error_bound, exact_reduce, fold, violations
from .cases import Case, CaseResult, ordered
from .control import bcast_report_list, control_channel, gather_report_lists
from .judge import digest, judge, misplaced, oracle_algorithm, oracle_options, predicted_digests

__all__ = ["run_case", "run_battery", "inputs_lock"]

#: Simulated ranks are threads of one process: they make each case's inputs once, in turn.
inputs_lock = threading.Lock()


def _run_collective(t, case: Case, x, xp=np, calls=COLLECTIVE_FUNCTIONS):
    """Run the case's collective on this rank's ``x``; return (output, in-place target).

    ``calls``: the collectives by name; :data:`NONBLOCKING_FUNCTIONS` gives the
    non-blocking twin, whose "output" is then its handle.
    """
    size, rank = case.ranks, t.rank
    opts = {"algorithm": case.algorithm, **case.kwargs}
    call = calls[case.collective]
    if case.collective == "allreduce":
        return call(x, t, op=case.op, out=x if case.inplace else None, **opts), x
    if case.collective == "reduce_scatter":
        target = x[chunk_slice(x.size, size, rank)] if case.inplace else None
        return call(x, t, op=case.op, out=target, **opts), target
    if case.collective == "allgather":
        if case.inplace:
            buf = xp.empty((size, x.size), dtype=x.dtype)
            buf[rank] = x
            return call(buf[rank], t, out=buf, **opts), buf
        return call(x, t, **opts), None
    if case.collective == "broadcast":
        return call(x, case.root, t, out=x if case.inplace else None, **opts), x
    target = x if (case.inplace and rank == case.root) else None
    return call(x, case.root, t, op=case.op, out=target, **opts), target


def _twin_problems(case: Case, twin, output, xp=np) -> list[str]:
    """Compare the non-blocking twin's result with the blocking call's: the same bits, or why not.
    """
    handle, target = twin
    try:
        result = handle.wait()
    except Exception as exc:  # noqa: BLE001 - a verdict
        return [f"non-blocking twin raised {type(exc).__name__}: {exc}"]
    if result is None or output is None:
        return [] if result is None and output is None else [
            f"non-blocking twin returned {'None' if result is None else 'a result'}, the "
            f"blocking call {'None' if output is None else 'a result'}"]
    if case.inplace and target is not None and result.size and not overlaps(result, target):
        return ["non-blocking twin (in place) did not return its out= buffer"]
    got, want = xp_module.to_host(result), xp_module.to_host(output)
    if got.shape != want.shape or got.dtype != want.dtype:
        return [f"non-blocking twin returned {got.dtype}{list(got.shape)}, the blocking call "
                f"{want.dtype}{list(want.shape)}"]
    if not same_bits(got, want):
        return [f"non-blocking twin differs from the blocking call: "
                f"{first_difference(got.reshape(-1), want.reshape(-1))}"]
    return []


@functools.lru_cache(maxsize=4)
def _case_inputs(kind: str, dtype: str, count: int, size: int, op: str, seed: int):
    """Every rank's input, read-only, shared by the simulated ranks of one process."""
    inputs = make_inputs(kind, DTYPES[dtype], count, size, op=op, seed=seed)
    for x in inputs:
        x.flags.writeable = False
    return tuple(inputs)


def _both_modes(case: Case) -> Case:
    """Return the case out of place: what its references and prediction are kept under.

    The mode changes where the result lands, not the result: the expected
    results and the simulator's prediction (which calls out of place) of a
    case in place are those of the same case out of place.
    """
    return dataclasses.replace(case, inplace=False)


def _reference(case: Case, seed: int) -> dict:
    """The case's expected results over all ranks, computed once per process for both modes."""
    return _mode_reference(_both_modes(case), seed)


@functools.lru_cache(maxsize=4)
def _mode_reference(case: Case, seed: int) -> dict:
    """The expected results of ``case`` (out of place) over all ranks.

    ``full``: the naive fold (or the gathered / broadcast data); for cases whose
    result depends on the order, ``exact`` and ``bound`` too.
    """
    inputs = _case_inputs(case.kind, case.dtype, case.count, case.ranks, case.op or "sum", seed)
    if case.collective == "allgather":
        return {"full": np.stack(inputs)}
    if case.collective == "broadcast":
        return {"full": inputs[case.root]}
    ref = {"full": fold(case.op, inputs)}
    if ordered(case):
        ref["exact"] = exact_reduce(case.op, inputs)
        ref["bound"] = error_bound(case.op, inputs, DTYPES[case.dtype])
    return ref


def _expected(case: Case, ref: dict, rank: int, key: str = "full"):
    """This rank's part of a reference array (``None`` on non-roots of reduce)."""
    if case.collective == "reduce" and rank != case.root:
        return None
    full = ref[key]
    if case.collective == "reduce_scatter":
        return full[chunk_slice(full.size, case.ranks, rank)]
    return full


def _local_checks(t, case: Case, seed: int, x, before, output, target, error,
                  xp=np) -> list[str]:
    """Return this rank's problems with its own output (empty: all good).

    ``x`` and ``output`` are arrays of ``xp``; ``before`` is the input as it was,
    on the host. Values are compared on host copies.
    """
    rank = t.rank
    if error is not None:
        return [f"raised {type(error).__name__}: {error}"]
    problems = []
    with inputs_lock:
        ref = _reference(case, seed)
    expected = _expected(case, ref, rank)
    if expected is None:
        if output is not None:
            problems.append("non-root rank of reduce returned a result")
        return problems
    if output is None:
        return ["returned None"]
    elsewhere = misplaced(output, xp)
    if elsewhere:
        return [elsewhere]
    if output.dtype != expected.dtype or output.size != expected.size:
        return [f"output is {output.dtype}[{output.size}], "
                f"expected {expected.dtype}[{expected.size}]"]
    if case.inplace and target is not None and output.size and not overlaps(output, target):
        problems.append("in-place call did not return its out= buffer")
    if not case.inplace and not np.array_equal(xp_module.to_host(x).view(np.uint8),
                                               before.view(np.uint8)):
        problems.append("input was modified by an out-of-place call")
    got = xp_module.to_host(output).reshape(-1)
    want = expected.reshape(-1)
    if ordered(case):
        idx, err, bound = violations(got, _expected(case, ref, rank, "exact"),
                                     _expected(case, ref, rank, "bound"))
        if len(idx):
            problems.append(f"element {int(idx[0])} off by {err[0]:.3g}, over the error bound "
                            f"{bound[0]:.3g} ({len(idx)} elements outside the bound)")
    elif case.op in ("min", "max") and case.kind == "random":
        if not np.array_equal(got, want, equal_nan=True):
            problems.append(first_difference(got, want))
    elif not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
        problems.append(first_difference(got, want))
    return problems


def _prediction(case: Case, seed: int, algorithm: str, options: dict) -> tuple[str, ...]:
    """The simulator's predicted digests for ``case`` as it ran (``algorithm``, ``options``)."""
    return _mode_prediction(_both_modes(case), seed, algorithm, tuple(sorted(options.items())))


@functools.lru_cache(maxsize=4)
def _mode_prediction(case: Case, seed: int, algorithm: str, options: tuple) -> tuple[str, ...]:
    """The predicted digests of ``case`` (out of place), kept for its other mode."""
    with inputs_lock:
        inputs = _case_inputs(case.kind, case.dtype, case.count, case.ranks, case.op or "sum",
                              seed)
    return tuple(predicted_digests(case, inputs, algorithm, dict(options)))


#: What a rank outside a case's ranks reports: nothing wrong, no result.
IDLE_REPORT = {"problems": [], "digest": digest(None).hex()}


def _left_unreceived(t, case_ctl) -> list[str]:
    """Return the messages to this rank the case left unreceived, looked for between barriers.

    After the first barrier every rank has finished the case, so nothing of it
    may still be in flight; the second keeps a rank that looked from starting the
    next case (and sending its first message) before every rank has looked.
    """
    barrier(case_ctl)
    left = [f"{m} left unreceived" for m in t.unreceived()]
    barrier(case_ctl)
    return left


def _run_on_rank(t, case_ctl, case: Case, *, seed: int, xp,
                 nonblocking: bool) -> tuple[dict, tuple | None]:
    """Run one case on this rank of the case's ranks; return its report and, on rank 0, its oracle.

    ``t`` and ``case_ctl`` span the case's ranks (``case.total``), ``case_ctl``
    for the barrier that ends the case. Ranks ``case.ranks .. case.total-1`` hold
    no data (switches): they serve the call with a template buffer and must get
    ``None`` back. The oracle is ``(algorithm, options)`` as they ran
    (:func:`oracle_algorithm`, :func:`oracle_options`), on rank 0 only (None elsewhere).
    """
    rank = case_ctl.rank
    problems: list[str] = []
    output = None
    # The transport the calls run on (device arrays: its wrapper, agreed on by every rank of
    # ``t`` here rather than inside a call that might fail first); auto resolves on it.
    carrier = device_for(t, xp.zeros(0, np.uint8))
    if rank < case.ranks:
        with inputs_lock:  # simulated ranks are threads: generate each case's inputs once
            inputs = _case_inputs(case.kind, case.dtype, case.count, case.ranks,
                                  case.op or "sum", seed)
        x = xp.array(inputs[rank])  # a writeable copy, on the device for a GPU run
        twin = (_run_collective(t, case, xp.array(inputs[rank]), xp, NONBLOCKING_FUNCTIONS)
                if nonblocking else None)
        target = error = None
        try:
            output, target = _run_collective(t, case, x, xp)
        except (CollectiveTimeout, MemoryError):
            raise  # the job cannot go on, and no verdict on the algorithm: the caller aborts it
        except Exception as exc:  # noqa: BLE001 - a failing case is a verdict, not a crash
            error = exc
        if twin is not None:
            problems += _twin_problems(case, twin, output, xp) if error is None else []
        problems += _left_unreceived(t, case_ctl)
        problems += _local_checks(t, case, seed, x, inputs[rank], output, target, error, xp)
    else:
        template = xp.zeros(case.count, DTYPES[case.dtype])  # every input's shape and dtype
        try:
            twin = (_run_collective(t, case, template.copy(), xp, NONBLOCKING_FUNCTIONS)
                    if nonblocking else None)
            served, _ = _run_collective(t, case, template, xp)
            if served is not None:
                problems.append("a rank without data (switch) returned a result")
            if twin is not None and twin[0].wait() is not None:
                problems.append("a rank without data (switch) got a result from the "
                                "non-blocking twin")
        except Exception as exc:  # noqa: BLE001
            problems.append(f"raised {type(exc).__name__}: {exc}")
        problems += _left_unreceived(t, case_ctl)
    oracle = None
    if rank == 0:
        algorithm = oracle_algorithm(carrier, case.algorithm, case.collective, case.count,
                                     case.dtype)
        oracle = (algorithm, oracle_options(t, algorithm, case.kwargs))
    return {"problems": problems, "digest": digest(output).hex()}, oracle


def _run_cases(t, case_ctl, ctl, cases: Sequence[Case], *, seed: int, xp,
               nonblocking: bool) -> list[CaseResult]:
    """Run cases of one size on the ranks of ``t``, then judge them all in one exchange.

    Every case has the same ``total``. ``t`` and ``case_ctl`` span its ranks
    (``None`` on the others), ``ctl`` every rank of the battery; it carries the
    reports and verdicts, one message each way for all of ``cases``.
    """
    if case_ctl is not None:
        mine = [_run_on_rank(t, case_ctl, case, seed=seed, xp=xp, nonblocking=nonblocking)
                for case in cases]
    else:
        mine = [(IDLE_REPORT, None)] * len(cases)
    reports = gather_report_lists(ctl, [report for report, _ in mine])
    verdicts = None
    if ctl.rank == 0:
        verdicts = []
        for case, case_reports, (_, (algorithm, options)) in zip(cases, reports, mine):
            predicted = functools.partial(_prediction, case, seed, algorithm, options)
            verdicts.append(judge(case, case_reports, algorithm, predicted))
    verdicts = bcast_report_list(ctl, verdicts, len(cases))
    return [CaseResult(case, not verdict, "; ".join(verdict))
            for case, verdict in zip(cases, verdicts)]


def run_case(t, ctl, case: Case, *, seed: int = 0, xp=np, nonblocking: bool = True) -> CaseResult:
    """Run one case on the case's ranks of ``t`` (``t`` is None on idle ranks).

    ``ctl`` spans every rank of the battery and carries the verdicts. Ranks
    ``case.ranks .. case.total-1`` hold no data (switches): they serve the call
    with a template buffer and must get ``None`` back. ``xp`` is the array
    module the inputs are made in (CuPy: on this rank's GPU). With
    ``nonblocking``, the case's non-blocking twin (``iallreduce`` for
    ``allreduce``...) is issued first, on a copy of the input, so the blocking
    call queues behind it (MPI's order); its result must be the blocking call's,
    bit for bit.
    """
    case_ctl = control_channel(ctl, case.total)
    return _run_cases(t, case_ctl, ctl, [case], seed=seed, xp=xp, nonblocking=nonblocking)[0]


def run_battery(t, cases: Sequence[Case], *, seed: int = 0,
                progress: Callable[[int, int, CaseResult], None] | None = None,
                xp=np, nonblocking: bool = True) -> list[CaseResult]:
    """Run ``cases`` on every rank of ``t`` (all ranks pass the same list), on arrays of ``xp``.

    Consecutive cases of one group (:attr:`Case.group`) run together and are
    judged in one exchange (the module's docstring); ``progress`` still hears of
    every case, in order. ``nonblocking``: also run each case's non-blocking
    twin (:func:`run_case`).
    """
    ctl = control_channel(t)
    # One communicator per rank count the cases need, and the control channel of its ranks,
    # split once.
    by_size = {t.size: (t, ctl)}
    results = []
    for (_, total), group in itertools.groupby(cases, key=lambda case: (case.group, case.total)):
        if total not in by_size:
            by_size[total] = (t.split(0 if t.rank < total else -1, t.rank),
                              control_channel(ctl, total))
        ranks, case_ctl = by_size[total]
        for result in _run_cases(ranks, case_ctl, ctl, list(group), seed=seed, xp=xp,
                                 nonblocking=nonblocking):
            results.append(result)
            if progress is not None:
                progress(len(results) - 1, len(cases), result)
    return results
