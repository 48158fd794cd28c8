"""Scaled sign compression (signSGD, Bernstein et al. 2018; EF-signSGD, Karimireddy et al. 2019).

Each element becomes one bit, ``x >= 0`` (zero is sent as ``+``), packed eight
to a byte with ``np.packbits`` (big-endian bit order, the last byte zero-padded);
each block of ``block`` elements (``block = 0``: the whole tensor) gets one
float32 scale ``||x_block||_1 / len(block)``, so decompression returns
``±scale``. Wire bytes: ``ceil(n / 8) + 4 * blocks``. Biased, not linear: use
with error feedback.

On CuPy arrays the bits are packed on the device (``cupy.packbits``, the same
bytes); the scales are sums, which the device may round differently in the
last bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..core.xp import array_namespace
from ._blocks import Blockwise, block_lengths, block_sum, expand
from .base import Payload, check_float, compute_dtype, register

__all__ = ["Sign", "pack_signs", "unpack_signs"]


def pack_signs(flat):
    """Return the bits ``flat >= 0`` packed eight to a byte."""
    xp = array_namespace(flat)
    if xp is not np and flat.size == 0:
        return xp.zeros(0, dtype=np.uint8)  # CuPy packs nothing into the input's own dtype
    return xp.packbits(flat >= 0)


def unpack_signs(packed, n: int):
    """Return ``n`` booleans from packed sign bits."""
    xp = array_namespace(packed)
    if xp is np:
        return np.unpackbits(packed, count=n).astype(bool)
    return xp.unpackbits(packed)[:n].astype(bool)  # CuPy's unpackbits has no count


@register
@dataclass(frozen=True)
class Sign(Blockwise):
    """One bit per element and one L1 scale per block."""

    name: ClassVar[str] = "sign"
    # Two-phase compressed all-reduce by default (1-bit Adam's scheme); gather too.
    declared_patterns: ClassVar[tuple[str, ...]] = ("twophase", "gather")

    def compress(self, x, state) -> Payload:
        """Return packed sign bits and the per-block mean magnitudes."""
        check_float(x, self.name)
        xp = array_namespace(x)
        flat = x.reshape(-1)
        cd = compute_dtype(x.dtype)
        magnitude = xp.abs(flat).astype(cd)
        lengths = block_lengths(flat.size, self.block, xp).astype(cd)
        scales = block_sum(magnitude, self.block) / lengths
        return self._payload(x, {"signs": pack_signs(flat), "scales": scales.astype(cd)})

    def decompress(self, payload: Payload) -> np.ndarray:
        """Return ``±scale`` per element."""
        n = int(np.prod(payload.shape))
        xp = array_namespace(payload.arrays["scales"])
        bits = unpack_signs(payload.arrays["signs"], n)
        scale = expand(payload.arrays["scales"], n, self.block)
        return xp.where(bits, scale, -scale).astype(payload.dtype).reshape(payload.shape)
