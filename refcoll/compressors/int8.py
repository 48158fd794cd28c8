"""Block-wise symmetric int8 quantisation with an absmax scale per block.

Per block of ``block`` elements: ``scale = max|x| / 127`` (float32; 0 for an
all-zero block), ``q = round(x / scale)`` (half to even) as int8 in
``[-127, 127]``; decompression is ``q * scale``, within ``scale / 2`` of ``x``.
Wire bytes: ``n + 4 * ceil(n / block)``. Each rank's scales are its own, so
payloads are not linear (summing them needs a shared scale agreed first).

On CuPy arrays the result is the same bits: a maximum, a correctly rounded
division and a rounding, all exact on the device too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..gpu import array_namespace
from ._blocks import block_max, expand
from .base import Compressor, Payload, check_float, compute_dtype, register

__all__ = ["Int8"]


@register
@dataclass(frozen=True)
class Int8(Compressor):
    """Symmetric int8 with one absmax scale per ``block`` elements."""

    name: ClassVar[str] = "int8"
    block: int = 256

    def __post_init__(self):
        if self.block < 1:
            raise ValueError(f"block must be >= 1, got {self.block}")

    def compress(self, x, state) -> Payload:
        """Return int8 codes and the per-block scales."""
        check_float(x, self.name)
        xp = array_namespace(x)
        cd = compute_dtype(x.dtype)
        flat = x.reshape(-1).astype(cd)
        scales = block_max(xp.abs(flat), self.block) / cd.type(127)
        per_element = expand(scales, flat.size, self.block)
        with np.errstate(invalid="ignore", divide="ignore"):
            codes = xp.where(per_element > 0, xp.rint(flat / per_element), 0)
        codes = xp.clip(codes, -127, 127).astype(np.int8)
        return self._payload(x, {"codes": codes, "scales": scales.astype(cd)})

    def decompress(self, payload: Payload) -> np.ndarray:
        """Return ``codes * scale``."""
        codes = payload.arrays["codes"]
        scale = expand(payload.arrays["scales"], codes.size, self.block)
        return (codes * scale).astype(payload.dtype).reshape(payload.shape)
