"""Non-blocking calls outstanding together: what the per-case twins of the battery cannot show.

Every battery case already runs its non-blocking twin beside the blocking call
(:func:`refcoll.verify.conformance.run.run_case`). The scenarios here put many
calls in flight at once, as a training step does, and check each result against
the blocking call with the same arguments, bit for bit:

* ``one communicator``: every collective with every algorithm that implements it,
  float32 and int32, all issued before any is waited for, with a blocking call
  in the middle (MPI queues it behind those issued before it);
* ``split communicators``: calls outstanding on the world and on two halves of it
  at once, each rank issuing the two communicators' calls in a different
  interleaving (legal: MPI orders the calls of each communicator, not across
  them);
* ``an error among them``: three calls in flight, the middle one with a count
  that differs on the last rank: it raises the same MismatchError from
  ``wait()`` on every rank, the other two complete, and the communicator still
  works after it.

Each rank checks its own results; rank 0 gathers the reports and broadcasts the
verdict, as for the battery's cases.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ... import algorithms
from ...calls.collectives import COLLECTIVE_FUNCTIONS
from ...calls.nonblocking import NONBLOCKING_FUNCTIONS, wait_all
from ...core.bits import first_difference, same_bits
from ...core.errors import MismatchError
from .control import bcast_report, gather_reports

__all__ = ["ScenarioResult", "SCENARIOS", "run_outstanding"]


@dataclass
class ScenarioResult:
    """One scenario's verdict (the same on every rank)."""

    name: str
    calls: int
    passed: bool
    reason: str = ""

    def to_json(self) -> dict:
        return {"scenario": self.name, "calls": self.calls, "passed": self.passed,
                "reason": self.reason}


def _calls(t, seed: int) -> list[tuple]:
    """Return ``(collective, algorithm, x, kwargs)`` of every call the first scenario makes."""
    rng = np.random.default_rng([seed, t.rank])
    inputs = [rng.standard_normal(1001).astype(np.float32),
              rng.integers(-1000, 1000, 37).astype(np.int32)]
    calls = []
    for name in algorithms.names():
        algo = algorithms.get(name)
        if algo.extra_ranks is not None or algo.chooses:
            continue  # switches need ranks of their own; auto is each size's other algorithm
        for collective in algo.implementations:
            for x in inputs:
                kwargs = {"algorithm": name}
                if collective in ("broadcast", "reduce"):
                    kwargs["root"] = t.size - 1
                if collective in ("allreduce", "reduce_scatter", "reduce"):
                    kwargs["op"] = "sum"
                calls.append((collective, x, kwargs))
    return calls


def _run(calls_table, collective, x, t, kwargs):
    kwargs = dict(kwargs)
    root = kwargs.pop("root", None)
    fn = calls_table[collective]
    return fn(x, root, t, **kwargs) if root is not None else fn(x, t, **kwargs)


def _compare(what: str, got, want) -> list[str]:
    if got is None or want is None:
        return [] if got is None and want is None else [f"{what}: one of the results is None"]
    a, b = np.asarray(got).reshape(-1), np.asarray(want).reshape(-1)
    if a.dtype != b.dtype or a.size != b.size:
        return [f"{what}: {a.dtype}[{a.size}] where the blocking call gives {b.dtype}[{b.size}]"]
    if not same_bits(a, b):
        return [f"{what}: {first_difference(a, b)}"]
    return []


def _one_communicator(t, seed: int) -> tuple[int, list[str]]:
    calls = _calls(t, seed)
    middle = len(calls) // 2
    handles = []
    for i, (collective, x, kwargs) in enumerate(calls):
        handles.append(_run(NONBLOCKING_FUNCTIONS, collective, x, t, kwargs))
        if i == middle:  # a blocking call among them runs in its place in the order
            blocking_middle = _run(COLLECTIVE_FUNCTIONS, collective, x, t, kwargs)
    results = wait_all(handles)
    problems = _compare(f"blocking {calls[middle][0]} issued among them",
                        blocking_middle, results[middle])
    for (collective, x, kwargs), got in zip(calls, results):
        want = _run(COLLECTIVE_FUNCTIONS, collective, x, t, kwargs)
        problems += _compare(f"{kwargs['algorithm']} {collective} {x.dtype}", got, want)
    return len(calls) + 1, problems


def _split_communicators(t, seed: int) -> tuple[int, list[str]]:
    half = t.split(t.rank % 2, t.rank)
    rng = np.random.default_rng([seed, t.rank, 1])
    xs = [rng.standard_normal(n).astype(np.float32) for n in (513, 4099, 7)]
    plan = [(t, "allreduce", xs[0], {"algorithm": "ring", "op": "sum"}),
            (t, "allgather", xs[2], {"algorithm": "ring"}),
            (t, "reduce_scatter", xs[1], {"algorithm": "rabenseifner", "op": "sum"})]
    plan_half = [(half, "allreduce", xs[1], {"algorithm": "tree", "op": "sum"}),
                 (half, "broadcast", xs[0], {"algorithm": "naive", "root": 0})]
    # Even ranks issue the world's calls first, odd ranks their half's first.
    order = plan + plan_half if t.rank % 2 == 0 else plan_half + plan
    handles = [_run(NONBLOCKING_FUNCTIONS, c, x, comm, kw) for comm, c, x, kw in order]
    blocking_half = _run(COLLECTIVE_FUNCTIONS, "allreduce", xs[2], half,
                         {"algorithm": "ring", "op": "max"})  # queued behind the half's calls
    results = wait_all(handles)
    problems = []
    for (comm, c, x, kw), got in zip(order, results):
        where = "world" if comm is t else "half"
        problems += _compare(f"{kw['algorithm']} {c} on the {where}", got,
                             _run(COLLECTIVE_FUNCTIONS, c, x, comm, kw))
    problems += _compare("blocking max on the half", blocking_half,
                         _run(COLLECTIVE_FUNCTIONS, "allreduce", xs[2], half,
                              {"algorithm": "ring", "op": "max"}))
    return len(order) + 1, problems


def _error_among_them(t, seed: int) -> tuple[int, list[str]]:
    x = np.arange(12, dtype=np.float32) + t.rank
    odd = np.ones(12 + (t.rank == t.size - 1 and t.size > 1), np.float32)
    first = NONBLOCKING_FUNCTIONS["allreduce"](x, t, algorithm="ring")
    middle = NONBLOCKING_FUNCTIONS["allreduce"](odd, t, algorithm="ring")
    last = NONBLOCKING_FUNCTIONS["allgather"](x, t, algorithm="ring")
    problems = []
    try:
        middle.wait()
        if t.size > 1:
            problems.append("a count that differs on the last rank did not raise from wait()")
    except MismatchError as exc:
        if "count" not in str(exc):
            problems.append(f"the mismatch error does not name the count: {exc}")
        if middle.exception() is not exc:
            problems.append("exception() does not return the error wait() raised")
    problems += _compare("the call before the failing one", first.wait(),
                         COLLECTIVE_FUNCTIONS["allreduce"](x, t, algorithm="ring"))
    problems += _compare("the call after the failing one", last.wait(),
                         COLLECTIVE_FUNCTIONS["allgather"](x, t, algorithm="ring"))
    return 3, problems


#: The scenarios, by name, in the order they run.
SCENARIOS = {
    "one communicator": _one_communicator,
    "split communicators": _split_communicators,
    "an error among them": _error_among_them,
}


def run_outstanding(t, ctl, *, seed: int = 0) -> list[ScenarioResult]:
    """Run every scenario on every rank of ``t``; return the verdicts (on every rank of ``ctl``).

    ``ctl`` spans ``t``'s ranks and perhaps more (switch processes, which pass
    ``t=None``, run nothing and hear the verdicts); it carries the reports.
    """
    results = []
    for name, scenario in SCENARIOS.items():
        try:
            calls, problems = scenario(t, seed) if t is not None else (0, [])
        except Exception as exc:  # noqa: BLE001 - a failing scenario is a verdict
            calls, problems = 0, [f"raised {type(exc).__name__}: {exc}"]
        reports = gather_reports(ctl, {"problems": problems[:3], "calls": calls})
        verdict = None
        if ctl.rank == 0:
            verdict = {"calls": max(rep["calls"] for rep in reports),
                       "problems": [f"rank {r}: {'; '.join(rep['problems'])}"
                                    for r, rep in enumerate(reports) if rep["problems"]]}
        verdict = bcast_report(ctl, verdict)
        results.append(ScenarioResult(name, verdict["calls"], not verdict["problems"],
                                      "; ".join(verdict["problems"])))
    return results
