"""Verdicts: what a rank's output must be, how rank 0 judges a case, and the summary rows.

A case passes when no rank reports a problem with its own output, every rank
holds the same bits where the collective gives every rank the same result, and,
where the result depends on the reduction order, every rank's bits equal the
simulator's prediction for the algorithm that ran (``auto`` resolved on the real
transport, the real nodes for an algorithm that takes the node shape).
"""

from __future__ import annotations

import hashlib
from typing import Callable, Sequence

import numpy as np

from ... import algorithms
from ...calls.auto import resolve
from ...calls.collectives import simulate
from ...core import xp as xp_module
from ...core.ops import DTYPES
from .cases import Case, CaseResult, ordered

__all__ = ["digest", "misplaced", "oracle_algorithm", "oracle_options", "predicted_digests",
           "judge", "group_rows"]


def digest(arr) -> bytes:
    """Return a short digest of an array's bytes (``b"none"`` for no result)."""
    if arr is None:
        return b"none"
    return hashlib.blake2b(np.ascontiguousarray(xp_module.to_host(arr)).tobytes(),
                           digest_size=16).digest()


def misplaced(output, xp) -> str:
    """Return why ``output`` is not an array of ``xp`` like the input, or ``""``."""
    if xp_module.array_namespace(output) is xp:
        return ""
    return (f"returned a {type(output).__module__}.{type(output).__name__} for {xp.__name__} "
            "input: the result must live where the input does")


def oracle_algorithm(t, name: str, collective: str, count: int, dtype: str) -> str:
    """Return the algorithm the simulator must run to predict ``t``'s call of ``name``.

    An algorithm that chooses another per call (``auto``) is resolved on ``t``,
    the transport the calls ran on (for device arrays, its wrapper), so the oracle
    predicts the algorithm its calibration picked.
    """
    if algorithms.get(name).chooses:
        return resolve(t, collective, count, DTYPES[dtype].itemsize)
    return name


def oracle_options(t, name: str, options: dict) -> dict:
    """Return the options that predict ``name`` on ``t``: the real node shape added.

    An algorithm that takes the node shape through an option and ran without it
    found the nodes itself (``MPI_COMM_TYPE_SHARED``), and they shape its order:
    predict with them, assuming the launcher placed consecutive ranks on a node,
    as MPICH's does. The layout is already on ``t`` (the run made it).
    """
    option = algorithms.get(name).node_option
    if option is None or option in options:
        return options
    sizes = algorithms.node_layout(t).sizes
    return dict(options, **{option: sizes[0]}) if len(sizes) > 1 else options


def predicted_digests(case: Case, inputs, algorithm: str, options: dict) -> list[str]:
    """Return the digest of every data rank's output that the simulator predicts for ``case``.

    ``algorithm`` and ``options`` are those that ran (:func:`oracle_algorithm`,
    :func:`oracle_options`). The simulator calls out of place: the prediction
    is the same for the case in either mode.
    """
    predicted = simulate(case.collective, inputs, algorithm=algorithm, op=case.op,
                         **({"root": case.root} if case.collective == "reduce" else {}),
                         **options)
    return [digest(want).hex() for want in predicted.outputs]


def judge(case: Case, reports: list[dict], algorithm: str,
          predicted: Callable[[], Sequence[str]]) -> list[str]:
    """Return rank 0's verdict: every rank's problems, rank agreement, and the ordered oracle.

    ``algorithm`` is the one that ran (:func:`oracle_algorithm`); ``predicted()``
    returns the digests the simulator predicts for it (:func:`predicted_digests`),
    asked for only when the result depends on the order and no rank reported a problem.
    """
    problems = [f"rank {r}: {msg}" for r, rep in enumerate(reports) for msg in rep["problems"]]
    digests = [rep["digest"] for rep in reports[: case.ranks]]
    if case.collective in ("allreduce", "allgather", "broadcast") and len(set(digests)) > 1:
        differing = [r for r, d in enumerate(digests) if d != digests[0]]
        problems.append(f"ranks {differing} hold different bits from rank 0")
    if ordered(case) and not problems:
        for r, (want, got) in enumerate(zip(predicted(), digests)):
            if want != got:
                problems.append(f"rank {r}: differs from the simulator's bit-exact prediction "
                                f"for {algorithm}")
    return problems


def group_rows(results: Sequence[CaseResult]) -> list[dict]:
    """Summarize results by (algorithm, collective, op, options): one row per group."""
    groups: dict[tuple, dict] = {}
    for res in results:
        c = res.case
        key = (c.algorithm, c.collective, c.op or "-", c.options)
        options = " ".join(f"{k}={v}" for k, v in c.options)
        row = groups.setdefault(key, {"algorithm": c.algorithm, "collective": c.collective,
                                      "op": c.op or "-", "options": options, "dtypes": set(),
                                      "cases": 0,
                                      "passed": 0, "failed": 0, "first_failure": ""})
        row["dtypes"].add(c.dtype)
        row["cases"] += 1
        if res.passed:
            row["passed"] += 1
        else:
            row["failed"] += 1
            if not row["first_failure"]:
                row["first_failure"] = f"{c.id}: {res.reason}"
    rows = []
    for row in groups.values():
        row["dtypes"] = len(row["dtypes"])
        rows.append(row)
    return rows
