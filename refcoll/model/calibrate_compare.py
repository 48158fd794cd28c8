"""What ``refcoll model --calibrate`` reports: predicted against measured all-reduce times.

:class:`Comparison` holds the rows :func:`~refcoll.model.calibrate.
compare_with_measurement` measured and the calibration they were predicted
from, and scores them the way cost models are scored against measurement
(ASTRA-sim reports its geometric-mean error against NCCL): the geometric-mean
error, the count within 30%, the worst row, for the measured-step model with
and without its scheduling term and for the textbook α-β-γ fit.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ..core.calibration import Calibration
from .calibrate_sched import expected_share

__all__ = ["Comparison", "machine_busy"]


def machine_busy() -> float | None:
    """Return the CPU seconds every process on this machine has used so far (None: unknown).

    From ``/proc/stat`` (Linux): user, nice, system, irq, softirq and steal time,
    in clock ticks.
    """
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            fields = fh.readline().split()
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
    return (user + nice + system + irq + softirq + steal) / ticks


def _log_error(predicted: float, measured: float) -> float | None:
    """Return ``|ln(predicted/measured)|``, or None where either is not a positive time."""
    if predicted > 0 and measured > 0 and math.isfinite(predicted / measured):
        return abs(math.log(predicted / measured))
    return None


@dataclass(frozen=True)
class Comparison:
    """Predicted against measured all-reduce times on this machine.

    Attributes:
        calibration: what the predictions were made from.
        rows: by algorithm then size: ``algorithm`` (``auto`` names what it
            resolved to), ``bytes``, ``predicted`` (measured-step model, its
            scheduling wait included), ``wait`` (that wait:
            :func:`~refcoll.model.calibrate.scheduling_wait`),
            ``predicted_without_wait``,
            ``predicted_fit`` (α-β-γ fit), ``measured``, ``ratio`` =
            predicted / measured.
        others: the share of the machine's CPU time that other processes used
            while this ran (None where unknown): above a few percent, the
            measurements shared the cores with someone else's work.
        cores: the machine's cores (0: unknown).
        back_to_back: each measured call followed the one before it; otherwise
            a barrier (:func:`~refcoll.model.calibrate.compare_with_measurement`).
    """

    calibration: Calibration
    rows: list[dict]
    others: float | None
    cores: int = 0
    back_to_back: bool = False

    def within(self, tolerance: float = 0.3, *, fit: bool = False,
               key: str | None = None) -> int:
        """Return how many predictions (``key``: which column) are within ``tolerance``."""
        key = key or ("predicted_fit" if fit else "predicted")
        return sum(abs(r[key] / r["measured"] - 1) <= tolerance for r in self.rows
                   if r["measured"])

    def geomean_error(self, key: str = "predicted") -> float | None:
        """Return ``exp(mean |ln(predicted/measured)|) - 1``: the geometric-mean error.

        A prediction twice and one half the measured time both count as 100%;
        rows without a positive measured time are left out (None if all are).
        """
        errors = [e for e in (_log_error(r[key], r["measured"]) for r in self.rows)
                  if e is not None]
        return math.expm1(sum(errors) / len(errors)) if errors else None

    def worst(self, key: str = "predicted") -> dict | None:
        """Return the row whose prediction (``key``) is furthest from the measured time."""
        scored = [(e, r) for r in self.rows
                  if (e := _log_error(r[key], r["measured"])) is not None]
        return max(scored, key=lambda pair: pair[0])[1] if scored else None

    def scheduling(self) -> dict:
        """Return the scheduling term's inputs: ranks, cores, runnable tasks, q and W ranges."""
        cal = self.calibration
        runnable = cal.load * self.cores if cal.load is not None and self.cores else None
        qs = [q for row in cal.waits for q in (row[2], row[4])]
        ws = [w for row in cal.waits for w in (row[3], row[5]) if w > 0]
        return {"ranks": cal.ranks, "cores": self.cores, "runnable": runnable,
                "expected_q": expected_share(runnable, self.cores),
                "q_min": min(qs, default=None), "q_max": max(qs, default=None),
                "wait_min": min(ws, default=None), "wait_max": max(ws, default=None)}

    def summary_lines(self) -> list[str]:
        """Return the report's closing lines: accuracy with and without the scheduling term."""
        lines = []
        for key, label in (("predicted", "measured steps + scheduling wait"),
                           ("predicted_without_wait", "measured steps alone"),
                           ("predicted_fit", "α-β-γ fit")):
            error, worst = self.geomean_error(key), self.worst(key)
            if error is None or worst is None:
                continue
            lines.append(f"{label}: geometric-mean error {100 * error:.1f}%, "
                         f"{self.within(key=key)} of {len(self.rows)} predictions within 30%, "
                         "worst "
                         f"{worst['algorithm']} at {worst['bytes']} B "
                         f"(predicted/measured {worst[key] / worst['measured']:.2f})")
        s = self.scheduling()
        if s["q_max"] is not None:
            expected = "" if s["expected_q"] is None else (
                f"; 1 - cores/runnable = {s['expected_q']:.2f} "
                f"({s['runnable']:.1f} runnable tasks on {s['cores']} cores)")
            waits = ("no step waited" if s["wait_max"] is None else
                     f"W {1e6 * s['wait_min']:.0f}-{1e6 * s['wait_max']:.0f} µs")
            lines.append(f"scheduling: {s['ranks']} ranks; steps that waited for a peer q "
                         f"{s['q_min']:.2f}-{s['q_max']:.2f}, {waits}{expected}")
        return lines

    def to_json(self) -> dict:
        """Return the comparison as a JSON-ready dict."""
        return {"calibration": self.calibration.to_json(), "rows": self.rows,
                "others_cpu_share": self.others, "within_30_percent": self.within(),
                "fit_within_30_percent": self.within(fit=True),
                "geomean_error": self.geomean_error(),
                "geomean_error_without_wait": self.geomean_error("predicted_without_wait"),
                "geomean_error_fit": self.geomean_error("predicted_fit"),
                "scheduling": self.scheduling(), "back_to_back": self.back_to_back}
