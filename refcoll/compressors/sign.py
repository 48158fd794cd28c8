"""Scaled sign compression (signSGD, Bernstein et al. 2018; EF-signSGD, Karimireddy et al. 2019).

Each element becomes one bit, ``x >= 0`` (zero is sent as ``+``), packed eight
to a byte with ``np.packbits`` (big-endian bit order, the last byte zero-padded);
each block of ``block`` elements (``block = 0``: the whole tensor) gets one
float32 scale ``||x_block||_1 / len(block)``, so decompression returns
``±scale``. Wire bytes: ``ceil(n / 8) + 4 * blocks``. Biased, not linear: use
with error feedback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ._blocks import Blockwise, block_lengths, block_sum, expand
from .base import Payload, check_float, compute_dtype, register

__all__ = ["Sign", "pack_signs", "unpack_signs"]


def pack_signs(flat: np.ndarray) -> np.ndarray:
    """Return the bits ``flat >= 0`` packed eight to a byte."""
    return np.packbits(flat >= 0)


def unpack_signs(packed: np.ndarray, n: int) -> np.ndarray:
    """Return ``n`` booleans from packed sign bits."""
    return np.unpackbits(packed, count=n).astype(bool)


@register
@dataclass(frozen=True)
class Sign(Blockwise):
    """One bit per element and one L1 scale per block."""

    name: ClassVar[str] = "sign"

    @property
    def patterns(self) -> tuple[str, ...]:
        """Two-phase compressed all-reduce by default (1-bit Adam's scheme); gather too."""
        return ("twophase", "gather")

    def compress(self, x, state) -> Payload:
        """Return packed sign bits and the per-block mean magnitudes."""
        check_float(x, self.name)
        flat = x.reshape(-1)
        cd = compute_dtype(x.dtype)
        magnitude = np.abs(flat).astype(cd)
        scales = block_sum(magnitude, self.block) / block_lengths(flat.size, self.block).astype(cd)
        return self._payload(x, {"signs": pack_signs(flat), "scales": scales.astype(cd)})

    def decompress(self, payload: Payload) -> np.ndarray:
        """Return ``±scale`` per element."""
        n = int(np.prod(payload.shape))
        bits = unpack_signs(payload.arrays["signs"], n)
        scale = expand(payload.arrays["scales"], n, self.block)
        return np.where(bits, scale, -scale).astype(payload.dtype).reshape(payload.shape)
