"""Overlap: how much of the buckets' communication the backward pass hides, and a step's time.

The backward pass produces gradients at a uniform rate per parameter, last
layers first; gradients are grouped into buckets in that order, and bucket
``i``'s all-reduce starts when its last gradient is ready and the previous
bucket's all-reduce has finished (one communication stream). The communication
after the backward pass ends is exposed; what runs before it is hidden. So one
bucket hides nothing, and no number of buckets hides more than the backward
pass, less the last bucket's share of it. Computation and communication are
assumed not to slow each other down.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

__all__ = ["overlap", "StepTime"]


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
