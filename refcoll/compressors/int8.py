"""Block-wise symmetric int8 quantisation with an absmax scale per block.

Per block of ``block`` elements: ``scale = max|x| / 127`` (float32; 0 for an
all-zero block), ``q = round(x / scale)`` (half to even) as int8 in
``[-127, 127]``; decompression is ``q * scale``, within ``scale / 2`` of ``x``.
Wire bytes: ``n + 4 * ceil(n / block)``. Each rank's scales are its own, so
these payloads are not linear: they are gathered (the default pattern).

Its ``allreduce`` pattern (:meth:`Int8.allreduce_rounds`) shares the scales
instead: the ranks first all-reduce each block's ``max|x|`` (``max``), then
quantise against ``scale = shared max / L`` with ``L = 127 // p`` levels, so the
sum of ``p`` codes stays within int8 and the codes are summed by any all-reduce
algorithm as int8. It trades resolution for linearity: ``L`` falls as ``p``
grows (31 levels at 4 ranks, 1 at 64), so each element is within
``p · scale / 2`` of the exact sum.

On CuPy arrays the result is the same bits: a maximum, a correctly rounded
division and a rounding, all exact on the device too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..core.errors import UsageError
from ..core.ops import get_op
from ..core.xp import array_namespace
from ._blocks import block_max, expand
from .base import (
    Compressor,
    Payload,
    Round,
    Rounds,
    check_float,
    compute_dtype,
    register,
    too_many_ranks,
)

__all__ = ["Int8"]


@register
@dataclass(frozen=True)
class Int8(Compressor):
    """Symmetric int8 with one absmax scale per ``block`` elements."""

    name: ClassVar[str] = "int8"
    # Gathered with per-rank scales by default; all-reduced with shared scales by choice.
    declared_patterns: ClassVar[tuple[str, ...]] = ("gather", "allreduce")
    # The sum of the ranks' codes, each within ±127 // ranks, must fit in int8.
    most_ranks: ClassVar[int] = 127
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
        codes = self.encode(flat, scales, 127)
        return self._payload(x, {"codes": codes, "scales": scales.astype(cd)})

    def decompress(self, payload: Payload) -> np.ndarray:
        """Return ``codes * scale``."""
        return self.decode(payload.arrays["codes"], payload.arrays["scales"]).astype(
            payload.dtype).reshape(payload.shape)

    def allreduce_rounds(self, x, state, *, size: int, op: str) -> Rounds:
        """Agree on shared scales, then sum the codes as int8.

        1. all-reduce (``max``) each block's ``max|x|``; ``scale = max / L``
           with ``L = 127 // size`` levels per side;
        2. quantise against the shared scales and sum the codes (``sum``): the
           sum of ``size`` codes within ``±L`` fits in int8;
        3. decode the sum with the shared scales (``avg``: divided by ``size``).
        """
        levels = 127 // size
        if size > self.most_ranks:
            raise UsageError(too_many_ranks(self, size))
        cd = compute_dtype(x.dtype)
        flat = x.reshape(-1).astype(cd)
        local = block_max(array_namespace(x).abs(flat), self.block)
        shared = (yield Round({"max": local}, "max"))["max"]
        scales = shared / cd.type(levels)
        codes = self.encode(flat, scales, levels)
        total = (yield Round({"codes": codes}, "sum"))["codes"]
        result = self.decode(total, scales)
        get_op(op).finalize(result.reshape(-1), size)
        return (self._payload(x, {"codes": codes, "scales": scales}),
                result.astype(x.dtype).reshape(x.shape))

    def encode(self, flat, scales, levels: int):
        """Return ``round(flat / scale)`` per block, within ``±levels``, as int8.

        A block whose scale is 0 (all zeros) gives codes 0.
        """
        xp = array_namespace(flat)
        per_element = expand(scales, flat.size, self.block)
        with np.errstate(invalid="ignore", divide="ignore"):
            codes = xp.where(per_element > 0, xp.rint(flat / per_element), 0)
        return xp.clip(codes, -levels, levels).astype(np.int8)

    def decode(self, codes, scales):
        """Return ``codes * scale`` per block, in the scales' dtype."""
        return codes * expand(scales, codes.size, self.block)
