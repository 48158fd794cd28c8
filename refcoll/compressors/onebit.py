"""1-bit SGD (Seide et al. 2014): a sign bit per element and two reconstruction values.

Each element becomes the bit ``x >= 0``, packed eight to a byte. Per block
(``block = 0``: the whole tensor) two float32 values go with the bits: the mean
of the elements with bit 1 and the mean of those with bit 0 (0 when a side is
empty), which minimise the squared error for that bit pattern. Wire bytes:
``ceil(n / 8) + 8 * blocks``. Biased and not linear: it needs error feedback
(Seide et al. quantise ``x + residual``).

On CuPy arrays: the same bits; the means are sums, which the device may round
differently in the last bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..core.xp import array_namespace
from ._blocks import Blockwise, block_sum, expand
from .base import Payload, check_float, compute_dtype, register
from .sign import pack_signs, unpack_signs

__all__ = ["OneBit"]


@register
@dataclass(frozen=True)
class OneBit(Blockwise):
    """Sign bits plus the mean of the non-negative and of the negative elements."""

    name: ClassVar[str] = "onebit"
    # Two-phase compressed all-reduce by default (1-bit Adam's scheme); gather too.
    declared_patterns: ClassVar[tuple[str, ...]] = ("twophase", "gather")

    def compress(self, x, state) -> Payload:
        """Return packed bits and the per-block means of each side."""
        check_float(x, self.name)
        xp = array_namespace(x)
        flat = x.reshape(-1)
        cd = compute_dtype(x.dtype)
        values = flat.astype(cd)
        positive = flat >= 0
        pos_count = block_sum(positive.astype(cd), self.block)
        neg_count = block_sum((~positive).astype(cd), self.block)
        pos_sum = block_sum(xp.where(positive, values, 0), self.block)
        neg_sum = block_sum(xp.where(positive, 0, values), self.block)
        with np.errstate(invalid="ignore", divide="ignore"):
            pos_mean = xp.where(pos_count > 0, pos_sum / pos_count, 0).astype(cd)
            neg_mean = xp.where(neg_count > 0, neg_sum / neg_count, 0).astype(cd)
        return self._payload(
            x, {"signs": pack_signs(flat), "pos_means": pos_mean, "neg_means": neg_mean}
        )

    def decompress(self, payload: Payload) -> np.ndarray:
        """Return each element's side mean."""
        n = int(np.prod(payload.shape))
        xp = array_namespace(payload.arrays["pos_means"])
        bits = unpack_signs(payload.arrays["signs"], n)
        pos = expand(payload.arrays["pos_means"], n, self.block)
        neg = expand(payload.arrays["neg_means"], n, self.block)
        return xp.where(bits, pos, neg).astype(payload.dtype).reshape(payload.shape)
