"""Threshold sparsification (Strom 2015): send every element with ``|x| >= threshold``.

The payload's size depends on the data. Indices ascending, int32 (int64 past
``2**31 - 1`` elements), values in the tensor's dtype. Not linear, biased: use
with error feedback, which carries the small elements until they grow.
On CuPy arrays the same indices and values, found on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..core.xp import array_namespace
from .base import Compressor, Payload, check_float, index_dtype, register
from .topk import scatter_values

__all__ = ["Threshold"]


@register
@dataclass(frozen=True)
class Threshold(Compressor):
    """Keep the elements whose magnitude reaches ``threshold``."""

    name: ClassVar[str] = "threshold"
    threshold: float = 1e-3

    def __post_init__(self):
        if not self.threshold >= 0:
            raise ValueError(f"threshold must be >= 0, got {self.threshold}")

    def compress(self, x, state) -> Payload:
        """Return the values at or above the threshold and their indices."""
        check_float(x, self.name)
        xp = array_namespace(x)
        flat = x.reshape(-1)
        idx = xp.flatnonzero(xp.abs(flat) >= self.threshold)
        return self._payload(
            x, {"values": flat[idx], "indices": idx.astype(index_dtype(flat.size))}
        )

    def decompress(self, payload: Payload) -> np.ndarray:
        """Return zeros with the kept values in place."""
        return scatter_values(payload)
