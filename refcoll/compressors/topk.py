"""Top-k sparsification (Aji and Heafield 2017; Lin et al. 2018, Deep Gradient Compression).

Send the ``k = max(1, round(ratio * n))`` elements of largest magnitude (``k = 0``
when ``n = 0``, at most ``n``), as ascending int32 indices (int64 past
``2**31 - 1`` elements) and their values in the tensor's dtype.

Selection, not a sort: ``np.argpartition`` finds the k-th largest magnitude
``t`` in O(n); every element with ``|x| > t`` is kept, and the remaining places
go to elements with ``|x| == t`` **in ascending index order**, so ties are broken
by the lower index and the result is deterministic on every platform.
The tensor must be finite (NaN has no magnitude order). Not linear: different
ranks pick different indices, so payloads are gathered and summed after
decompression. Biased: use with error feedback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .base import Compressor, Payload, check_float, index_dtype, register

__all__ = ["TopK", "topk_indices", "scatter_values"]


def topk_indices(magnitude: np.ndarray, k: int) -> np.ndarray:
    """Return the ascending indices of the k largest entries, ties to the lower index."""
    n = magnitude.size
    if k >= n:
        return np.arange(n)
    if k == 0:
        return np.arange(0)
    boundary = magnitude[np.argpartition(magnitude, n - k)[n - k]]
    above = np.flatnonzero(magnitude > boundary)
    ties = np.flatnonzero(magnitude == boundary)[: k - above.size]
    return np.union1d(above, ties) if ties.size else above


def scatter_values(payload: Payload) -> np.ndarray:
    """Return a zero tensor with the payload's values at its indices."""
    out = np.zeros(int(np.prod(payload.shape)), dtype=payload.dtype)
    out[payload.arrays["indices"]] = payload.arrays["values"]
    return out.reshape(payload.shape)


@register
@dataclass(frozen=True)
class TopK(Compressor):
    """Keep the k largest magnitudes; ``ratio`` is k / n."""

    name: ClassVar[str] = "topk"
    ratio: float = 0.01

    def __post_init__(self):
        if not 0 < self.ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {self.ratio}")

    def k(self, n: int) -> int:
        """Return how many elements a tensor of ``n`` elements keeps."""
        return min(n, max(1, round(self.ratio * n))) if n else 0

    def compress(self, x, state) -> Payload:
        """Return the k largest-magnitude values and their indices."""
        check_float(x, self.name)
        flat = x.reshape(-1)
        idx = topk_indices(np.abs(flat), self.k(flat.size))
        return self._payload(
            x, {"values": flat[idx], "indices": idx.astype(index_dtype(flat.size))}
        )

    def decompress(self, payload: Payload) -> np.ndarray:
        """Return zeros with the kept values in place."""
        return scatter_values(payload)
