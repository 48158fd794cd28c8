"""Threshold sparsification (Strom 2015): send every element with ``|x| >= threshold``.

The payload's size depends on the data. Indices ascending, int32 (int64 past
``2**31 - 1`` elements), values in the tensor's dtype; a NaN is kept (as
:mod:`~refcoll.compressors.topk` keeps it), so an overflow stays visible after the
all-reduce. Not linear, biased: use
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


def not_below(threshold: float, dtype) -> np.generic:
    """Return the least value of ``dtype`` not below ``threshold``: ``|x| >= it`` in ``dtype``
    is then ``|x| >= threshold`` exactly. (A Python float compared with a float16 array is
    rounded to float16 first, and 0.1 becomes 0.0999756: a value below it would be kept.)"""
    with np.errstate(over="ignore"):  # past the dtype's range: inf, which only inf reaches
        value = np.array(threshold, dtype=dtype)
        if float(value) < threshold:
            value = np.nextafter(value, np.array(np.inf, dtype=dtype))
    return value[()]


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
        magnitude = xp.abs(flat)  # NaN is kept, as topk keeps it: an overflow stays visible
        at_least = not_below(self.threshold, flat.dtype)
        idx = xp.flatnonzero((magnitude >= at_least) | xp.isnan(magnitude))
        return self._payload(
            x, {"values": flat[idx], "indices": idx.astype(index_dtype(flat.size))}
        )

    def decompress(self, payload: Payload) -> np.ndarray:
        """Return zeros with the kept values in place."""
        return scatter_values(payload)
