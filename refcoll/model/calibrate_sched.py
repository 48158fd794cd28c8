"""The scheduling term of the measured-step model: rounds that wait for a descheduled peer.

A round of an all-reduce completes only when its peers run. With ``r``
runnable tasks (this job's ranks and anyone else's) on ``c`` cores, a peer is
off its core a share ``1 - c/r`` of the time (0 when ``r <= c``), and a round
that needs it waits until the scheduler gives it a core back: for a peer that
yields (:data:`refcoll.transport.deadline.POLLS_BEFORE_YIELD`), the rest of the
share of the round's work that another rank on that core holds; behind someone
else's process, up to a time slice (Linux's EEVDF ``base_slice``, 0.75 ms and
up, half of it on average). Each round therefore costs its median time ``m``
(what :func:`~refcoll.model.calibrate.predict` sums) plus a wait
``S``:

* ``S = 0`` with probability ``1 - q``: the peers were running;
* else ``S`` is exponential with mean ``W``: the time slice share the round
  waited.

``q`` and ``W`` are measured, not fitted: from every ring step the calibration
times (:func:`wait_summary`), a step is a wait when it exceeds its rank's
median by more than :data:`WAIT_THRESHOLD` of it; ``q`` is the share of such
steps over every rank, ``W`` the exponential's mean estimated from their
median excess (``median / ln 2``), which a rare outage of a tenth of a second
does not move. On a quiet machine with a core
per rank ``q`` is near 0 and the term vanishes; :func:`expected_share` is the
``1 - c/r`` above, printed beside the measured ``q`` as a check, never used to
predict.

A call of ``R`` rounds waits ``S_1 + ... + S_R``, independent rounds, and a
timed call is reported by its median over repeats, so the term is the median
of that sum (:func:`wait_median`): ``N`` of the rounds wait, binomial
``(R, q)``, and ``N`` exponential waits add up to a gamma-distributed time, so

    P(S_1 + ... + S_R <= x) = Σ_n C(R, n) q^n (1-q)^(R-n) · P(Γ(n, W) <= x)

with ``P(Γ(n, W) <= x) = 1 - e^(-x/W) Σ_{k<n} (x/W)^k / k!`` (1 for ``n = 0``),
and the term is the ``x`` where it reaches 1/2. It is 0 when more than half the
calls wait in no round (``(1-q)^R >= 1/2``), near ``R·q·W`` when many rounds
wait: a long call on oversubscribed cores pays the mean wait of every round,
where a median step shows none of it.

That sum treats rounds as independent, and they are not. When every round waits
for a slice, a long round is followed by a short one, because the peer ran
meanwhile. When another job runs in bursts, waits come in runs. So where the
calibration also measured runs of consecutive steps, it uses the sum itself
(:func:`stretch`): the median, over every run of ``R`` consecutive ``later``
steps on every rank, of the time the run took beyond ``R`` of its rank's median
step, and never less than 0. That is ``wait(R)`` measured with whatever
correlation the rounds really have. The formula above remains the term for a
record that holds only ``q`` and ``W``.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

__all__ = ["WAIT_THRESHOLD", "wait_summary", "wait_cdf", "wait_median", "stretch",
           "expected_share", "waits_at"]

#: A step counts as a wait when it exceeds its rank's median step by more than
#: this share of that median: a round that took half as long again as usual.
WAIT_THRESHOLD = 0.5


def wait_summary(samples: np.ndarray) -> tuple[float, float]:
    """Return ``(q, W)``: the share of steps that waited and their mean wait, in seconds.

    ``W`` is ``median(excess) / ln 2``: the mean of an exponential wait, from its median.

    Args:
        samples: ``(ranks, steps)`` step times in seconds, one row per rank; a
            row of zeros (a rank that timed nothing) is left out.
    """
    rows = [row for row in np.atleast_2d(np.asarray(samples, dtype=np.float64)) if row.any()]
    if not rows:
        return 0.0, 0.0
    excess = np.concatenate([row - np.median(row) for row in rows])
    limits = np.concatenate([np.full(row.size, WAIT_THRESHOLD * np.median(row)) for row in rows])
    waited = excess[excess > limits]
    if not waited.size:
        return 0.0, 0.0
    # The exponential's mean from its median: a rare outage of a tenth of a second,
    # which no median call sees, would set a plain mean.
    return waited.size / excess.size, float(np.median(waited)) / math.log(2)


def stretch(samples: np.ndarray, rounds: int) -> float:
    """Return the median time ``rounds`` consecutive steps take beyond ``rounds`` median steps.

    Args:
        samples: ``(ranks, steps)`` step times in seconds, each row in the order
            they were timed; a row of zeros (a rank that timed nothing) is left out.
        rounds: how many consecutive steps make a run (``R``).

    Every run of ``rounds`` consecutive steps of every rank counts once; the
    result is never below 0 (0 when no row holds that many steps).
    """
    sums: list[np.ndarray] = []
    for row in np.atleast_2d(np.asarray(samples, dtype=np.float64)):
        if row.any() and row.size >= rounds >= 1:
            sums.append(np.convolve(row - np.median(row), np.ones(rounds), mode="valid"))
    return max(float(np.median(np.concatenate(sums))), 0.0) if sums else 0.0


def wait_cdf(x: float, rounds: int, q: float, mean_wait: float) -> float:
    """Return ``P(S_1 + ... + S_rounds <= x)`` for the waits of the module docstring."""
    if x < 0:
        return 0.0
    if rounds <= 0 or q <= 0 or mean_wait <= 0:
        return 1.0
    if q >= 1.0:
        return _gamma_cdf(rounds, x / mean_wait)
    y, total, poisson = x / mean_wait, (1 - q) ** rounds, 0.0  # n = 0: no round waited
    for n in range(1, rounds + 1):
        # Everything in logarithms, so that many rounds overflow nothing.
        binomial = math.exp(math.lgamma(rounds + 1) - math.lgamma(n + 1)
                            - math.lgamma(rounds - n + 1) + n * math.log(q)
                            + (rounds - n) * math.log1p(-q))
        poisson += math.exp((n - 1) * math.log(y) - y - math.lgamma(n)) if y > 0 else float(n == 1)
        total += binomial * max(1.0 - poisson, 0.0)
    return min(total, 1.0)


def _gamma_cdf(n: int, y: float) -> float:
    """Return ``P(Γ(n, 1) <= y)`` for a whole ``n >= 1``: one less the Poisson ``P(N < n)``."""
    if y <= 0:
        return 0.0
    below = sum(math.exp(k * math.log(y) - y - math.lgamma(k + 1)) for k in range(n))
    return max(1.0 - below, 0.0)


def wait_median(rounds: int, q: float, mean_wait: float) -> float:
    """Return the median, over calls, of the scheduling waits of a call of ``rounds`` rounds.

    The ``x`` where :func:`wait_cdf` reaches 1/2, by bisection (the CDF is
    monotone); 0 when half the calls wait in no round.
    """
    if rounds <= 0 or q <= 0 or mean_wait <= 0 or (1 - min(q, 1.0)) ** rounds >= 0.5:
        return 0.0
    low, high = 0.0, mean_wait * (rounds + 10)
    while wait_cdf(high, rounds, q, mean_wait) < 0.5:
        high *= 2
    while high - low > 1e-9 * high:
        middle = (low + high) / 2
        if wait_cdf(middle, rounds, q, mean_wait) < 0.5:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def expected_share(runnable: float | None, cores: int) -> float | None:
    """Return ``1 - c/r``: the share of the time a task is off its core (``r`` runnable tasks).

    The explanation of ``q``, for a report: None where the runnable count is unknown.
    """
    if runnable is None or cores < 1:
        return None
    return max(0.0, 1.0 - cores / runnable) if runnable > 0 else 0.0


def waits_at(table: Sequence[tuple[int, float, float]], message: float) -> tuple[float, float]:
    """Return ``(q, W)`` at ``message`` bytes from ``(message, q, W)`` rows sorted by message.

    Linear in ``log(message)`` between rows (``q`` may be 0, so not log-log);
    outside them, the nearest row.
    """
    if not table:
        return 0.0, 0.0
    if len(table) == 1 or message <= table[0][0]:
        return table[0][1], table[0][2]
    if message >= table[-1][0]:
        return table[-1][1], table[-1][2]
    for (x0, q0, w0), (x1, q1, w1) in zip(table, table[1:]):
        if x0 <= message <= x1:
            share = math.log(message / x0) / math.log(x1 / x0) if x1 > x0 else 0.0
            return q0 + share * (q1 - q0), w0 + share * (w1 - w0)
    return table[-1][1], table[-1][2]
