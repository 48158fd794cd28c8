"""The one calibration record: α, β and γ of a machine, with their units.

``auto`` (:mod:`refcoll.calls.auto`) prices each candidate's exact counts with
it; the cluster model (:mod:`refcoll.measure.model`) prices phases with it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["Calibration", "DEFAULT"]


@dataclass(frozen=True)
class Calibration:
    """α (s per message), β (s per byte), γ (s per element combined), and where they came from.

    ``key`` is the :class:`CalibrationKey` text it was measured under, ``measured_at``
    the Unix time of the measurement and ``load`` the runnable tasks per core while
    it ran (see :func:`measure`); all three are empty for :data:`DEFAULT`.
    """

    alpha: float
    beta: float
    gamma: float
    source: str = "default"
    key: str = ""
    measured_at: float | None = None
    load: float | None = None

    def age(self, now: float | None = None) -> float | None:
        """Return seconds since the measurement (None for a fixed calibration)."""
        if self.measured_at is None:
            return None
        return (time.time() if now is None else now) - self.measured_at


#: Shared-memory MPI on a current CPU: ~3 µs latency, ~4 GB/s, ~1 G additions/s.
DEFAULT = Calibration(alpha=3e-6, beta=1 / 4e9, gamma=1e-9, source="default")
