"""TernGrad: stochastic ternary gradients (Wen et al. 2017).

Per block (``block = 0``: the whole tensor) with ``s = max|g|``: each element
becomes ``sign(g_i) · b_i`` with ``b_i ~ Bernoulli(|g_i| / s)``, and
decompression is ``s · t_i``, so ``E[s · t_i] = g_i`` (unbiased). The ternary
codes are packed four to a byte (2 bits: 0 for -1, 1 for 0, 2 for +1, first
element in the low bits); one float32 scale per block. Wire bytes:
``ceil(n / 4) + 4 * blocks``. The paper's gradient clipping is left to the caller.

On CuPy arrays the Bernoulli draws come from the state's device generator
(:func:`refcoll.core.xp.device_generator`): reproducible from the seed, but other
draws than the CPU's; the codes are packed on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..core.xp import array_namespace, device_generator
from ._blocks import Blockwise, block_max, expand
from .base import Payload, check_float, compute_dtype, register

__all__ = ["TernGrad", "pack_ternary", "unpack_ternary"]

_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)


def _shifts(xp):
    return _SHIFTS if xp is np else xp.asarray(_SHIFTS)


def pack_ternary(ternary):
    """Return values in {-1, 0, 1} packed four to a byte."""
    xp = array_namespace(ternary)
    codes = xp.zeros(math.ceil(ternary.size / 4) * 4, dtype=np.uint8)
    codes[: ternary.size] = ternary + 1
    fields = codes.reshape(-1, 4) << _shifts(xp)
    if xp is np:
        return np.bitwise_or.reduce(fields, axis=1).astype(np.uint8)
    # The four fields occupy disjoint bits: OR them pairwise (no ufunc.reduce needed).
    return (fields[:, 0] | fields[:, 1]) | (fields[:, 2] | fields[:, 3])


def unpack_ternary(packed, n: int):
    """Return ``n`` values in {-1, 0, 1} as int8."""
    codes = (packed[:, None] >> _shifts(array_namespace(packed))) & 3
    return codes.reshape(-1)[:n].astype(np.int8) - 1


@register
@dataclass(frozen=True)
class TernGrad(Blockwise):
    """Ternary {-s, 0, s} per element with stochastic rounding; ``s`` per block."""

    name: ClassVar[str] = "terngrad"
    unbiased: ClassVar[bool] = True

    def compress(self, x, state) -> Payload:
        """Return packed ternary codes and the per-block max magnitudes."""
        check_float(x, self.name)
        xp = array_namespace(x)
        cd = compute_dtype(x.dtype)
        flat = x.reshape(-1).astype(cd)
        magnitude = xp.abs(flat)
        scales = block_max(magnitude, self.block)
        per_element = expand(scales, flat.size, self.block)
        with np.errstate(invalid="ignore", divide="ignore"):
            prob = xp.where(per_element > 0, magnitude / per_element, 0)
        keep = device_generator(state, xp).random(flat.size, dtype=cd) < prob
        ternary = (xp.sign(flat) * keep).astype(np.int8)
        return self._payload(x, {"codes": pack_ternary(ternary), "scales": scales.astype(cd)})

    def decompress(self, payload: Payload) -> np.ndarray:
        """Return ``s · t`` per element."""
        n = int(np.prod(payload.shape))
        ternary = unpack_ternary(payload.arrays["codes"], n)
        scale = expand(payload.arrays["scales"], n, self.block)
        return (scale * ternary).astype(payload.dtype).reshape(payload.shape)
