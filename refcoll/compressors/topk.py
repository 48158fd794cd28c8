"""Top-k sparsification (Aji and Heafield 2017; Lin et al. 2018, Deep Gradient Compression).

Send the ``k = max(1, round(ratio * n))`` elements of largest magnitude (``k = 0``
when ``n = 0``, at most ``n``), as ascending int32 indices (int64 past
``2**31 - 1`` elements) and their values in the tensor's dtype.

Selection, not a sort: ``np.argpartition`` finds the k-th largest magnitude
``t`` in O(n); every element with ``|x| > t`` is kept, and the remaining places
go to elements with ``|x| == t`` **in ascending index order**, so ties are broken
by the lower index and the result is deterministic on every platform.
A NaN counts as the largest magnitude (above infinity, as its bits are), so a
gradient that overflowed stays non-finite after the all-reduce, for AMP's
GradScaler to see and skip the step. Not linear: different
ranks pick different indices, so payloads are gathered and summed after
decompression. Biased: use with error feedback.

On CuPy arrays the selection is :func:`select_by_bits`, a radix selection by
bisection on the magnitudes' bit patterns (CuPy's ``argpartition`` sorts): the
same indices, ties included, in one counting pass per bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..core.xp import array_namespace
from .base import Compressor, Payload, check_float, index_dtype, kept_count, register

__all__ = ["TopK", "topk_indices", "select_by_bits", "scatter_values"]


def topk_indices(magnitude, k: int):
    """Return the ascending indices of the k largest entries, ties to the lower index, NaN
    the largest of all."""
    xp = array_namespace(magnitude)
    n = magnitude.size
    if k >= n:
        return xp.arange(n)
    if k == 0:
        return xp.arange(0)
    if xp is not np:
        return select_by_bits(magnitude, k)  # a NaN's bits are above infinity's: the largest
    if np.isnan(magnitude).any():  # NaN the largest, above inf, as its bits are: the device's
        return select_by_bits(magnitude, k)  # order, so a non-finite tensor stays so
    boundary = magnitude[np.argpartition(magnitude, n - k)[n - k]]
    above = np.flatnonzero(magnitude > boundary)
    ties = np.flatnonzero(magnitude == boundary)[: k - above.size]
    return np.union1d(above, ties) if ties.size else above


def select_by_bits(magnitude, k: int):
    """Return :func:`topk_indices` of non-negative floats by bisection on their bits, no sort.

    Non-negative IEEE floats order as their bit patterns read as unsigned
    integers do, so the k-th largest magnitude is the largest pattern ``t`` with
    at least ``k`` patterns ``>= t``: a bisection over the integers, one
    counting pass over the tensor per bit. Then, as in the NumPy path, every
    element above ``t`` is kept and the first ``k - above`` equal to ``t`` by
    index. Works on NumPy and CuPy arrays; ``0 < k < magnitude.size``.
    """
    xp = array_namespace(magnitude)
    bits = magnitude.view(np.dtype(f"u{magnitude.dtype.itemsize}"))
    word = bits.dtype.type
    low, high = 0, int(bits.max())
    while low < high:
        middle = (low + high + 1) // 2
        if int(xp.count_nonzero(bits >= word(middle))) >= k:
            low = middle
        else:
            high = middle - 1
    boundary = word(low)
    above = bits > boundary
    ties = bits == boundary
    wanted = k - int(xp.count_nonzero(above))
    if int(xp.count_nonzero(ties)) > wanted:
        ties &= xp.cumsum(ties, dtype=np.int64) <= wanted
    return xp.flatnonzero(above | ties)


def scatter_values(payload: Payload):
    """Return a zero tensor with the payload's values at its indices."""
    xp = array_namespace(payload.arrays["values"])
    out = xp.zeros(int(np.prod(payload.shape)), dtype=payload.dtype)
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
        return kept_count(self.ratio, n)

    keeps = k

    def compress(self, x, state) -> Payload:
        """Return the k largest-magnitude values and their indices."""
        check_float(x, self.name)
        flat = x.reshape(-1)
        idx = topk_indices(array_namespace(x).abs(flat), self.k(flat.size))
        return self._payload(
            x, {"values": flat[idx], "indices": idx.astype(index_dtype(flat.size))}
        )

    def decompress(self, payload: Payload) -> np.ndarray:
        """Return zeros with the kept values in place."""
        return scatter_values(payload)
