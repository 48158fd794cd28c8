"""Overlap: how much of the buckets' communication the backward pass hides, and a step's time.

The backward pass produces gradients at a uniform rate per parameter, last
layers first; gradients are grouped into buckets in that order, and bucket
``i``'s all-reduce starts when its last gradient is ready and the previous
bucket's all-reduce has finished (one communication stream). The communication
after the backward pass ends is exposed; what runs before it is hidden. So one
bucket hides nothing, and no number of buckets hides more than the backward
pass, less the last bucket's share of it. Computation and communication are
assumed not to slow each other down.

For a measured step (``refcoll train --layers``), :func:`predict_step` takes
each bucket's ready time from a real backward pass instead of the uniform rate,
and :func:`fit_link` reads α and β off measured all-reduces with the counts the
model prices, so ``refcoll model`` can be given the machine's own link.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

from .cluster import Cluster
from .pricing import allreduce_estimate

__all__ = ["overlap", "StepTime", "predict_step", "fit_link"]


def overlap(ready: Sequence[float], comm: Sequence[float], backward: float) -> tuple[float, float]:
    """Return ``(exposed, hidden)`` communication of buckets all-reduced during the backward pass.

    Bucket ``i`` is ready at ``ready[i]`` seconds into the backward pass and
    takes ``comm[i]``; one communication stream runs them in order, each
    starting when it is ready and the previous one is done. What runs after
    ``backward`` is exposed, the rest hidden.
    """
    end = -backward  # clocks run from the end of the backward pass, so exposed time is exact
    for at, seconds in zip(ready, comm):
        end = max(at - backward, end) + seconds
    exposed = max(end, 0.0)
    return exposed, max(sum(comm) - exposed, 0.0)


def predict_step(ready, backward_measured, backward: float,
                 comm: Sequence[float]) -> tuple[float, float]:
    """Return :func:`overlap` of buckets whose ready times were measured in a backward pass.

    ``ready[i]`` is the time from the start of a measured backward pass of
    ``backward_measured`` seconds to bucket ``i``'s last gradient, or ``ready``
    holds one such list per measured step (with ``backward_measured`` one time
    per step) and each bucket's median fraction is taken. The fractions are
    applied to ``backward`` (say, the backward pass measured without
    communication); ``comm[i]`` is bucket ``i``'s all-reduce time.
    """
    ready = np.atleast_2d(np.asarray(ready, float))
    fractions = np.median(ready / np.asarray(backward_measured, float).reshape(-1, 1), axis=0)
    return overlap([float(f) * backward for f in fractions], list(comm), backward)


def fit_link(measured: dict[int, float], ranks: int, algorithm: str) -> tuple[float, float]:
    """Return the ``(α, β)`` with which the model's price of ``algorithm`` fits measured times.

    ``measured`` maps an all-reduce's bytes (float32) to its seconds on
    ``ranks`` ranks of one node. Each size's α rounds and β bytes are the
    model's own (:func:`~refcoll.model.pricing.allreduce_estimate`,
    reduction free), fitted by least squares on the relative error. When the
    fit gives a negative α or a β that is not positive (a small message timed
    slower than a large one: noise), the better of the two one-term fits, α
    alone or β alone, in the same least squares. One rank, or nothing
    measured: ``(0, 1e-12)``.
    """
    rows = []  # (α rounds, β bytes, seconds) of each size
    for nbytes, seconds in measured.items():
        phases = allreduce_estimate(Cluster(1, ranks, 1.0, 1.0), algorithm, nbytes // 4, 4).phases
        if seconds > 0 and sum(ph.bytes for ph in phases):
            rows.append((sum(ph.rounds for ph in phases), sum(ph.bytes for ph in phases), seconds))
    if ranks < 2 or not rows:
        return 0.0, 1e-12
    scaled = np.array([[r / s, b / s] for r, b, s in rows], float)
    alpha, beta = np.linalg.lstsq(scaled, np.ones(len(rows)), rcond=None)[0]
    if alpha < 0 or beta <= 0:  # the best fit on the boundary: one of the two terms alone
        alpha, beta = min(((0.0, _alone(scaled[:, 1])), (_alone(scaled[:, 0]), 0.0)),
                          key=lambda fit: float(np.sum((scaled @ np.array(fit) - 1) ** 2)))
    return float(alpha), float(max(beta, 1e-15))


def _alone(column: np.ndarray) -> float:
    """Return the least-squares factor ``c`` of ``c · column ≈ 1`` (relative error), ≥ 0."""
    return max(float(column.sum() / (column @ column)), 0.0)


@dataclass(frozen=True)
class StepTime:
    """One training step's modelled time with one set of techniques.

    Attributes:
        label: which techniques (``baseline``, ``+topology``...).
        algorithm: the all-reduce (or the compressed pattern's collective).
        compressor: spec, or None.
        pattern: compressed pattern, or None.
        buckets: buckets actually made.
        comm: total communication time (every bucket's collective, local work included).
        exposed: communication not hidden under the backward pass.
        step: ``forward + backward + exposed``.
        speedup: baseline step / this step.
        gain: previous row's step / this step.
    """

    label: str
    algorithm: str
    compressor: str | None
    pattern: str | None
    buckets: int
    comm: float
    exposed: float
    step: float
    speedup: float = 1.0
    gain: float = 1.0

    @property
    def fraction(self) -> float:
        """Return the share of the step spent in exposed communication."""
        return self.exposed / self.step if self.step else 0.0

    def to_json(self) -> dict:
        """Return the row as a JSON-ready dict."""
        return {**asdict(self), "hidden": self.comm - self.exposed,
                "comm_fraction": self.fraction}
