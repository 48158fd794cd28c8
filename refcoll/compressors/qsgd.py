"""QSGD: stochastic quantisation to ``s`` levels per bucket (Alistarh et al. 2017).

For each bucket ``v`` of ``bucket`` elements (the last may be shorter), with
``r_i = s |v_i| / ||v||_2``:

    Q(v)_i = ||v||_2 · sign(v_i) · l_i / s,
    l_i = floor(r_i) + 1 with probability r_i - floor(r_i), else floor(r_i).

``E[Q(v)] = v`` (unbiased) and, by Lemma 3.1,
``E||Q(v) - v||^2 <= min(d/s^2, sqrt(d)/s) ||v||^2`` for a bucket of ``d`` elements.
Wire: one float32 norm per bucket and one signed level ``sign·l`` per element,
int8 for ``s <= 127`` and int16 up to 32767 (the paper's Elias coding of the
levels is not used: fixed-width codes keep payload sizes predictable).
Not linear: each rank's norms are its own.

On CuPy arrays the rounding draws come from the state's device generator
(:func:`refcoll.core.xp.device_generator`), and the norms are sums the device may
round differently in the last bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..core.xp import array_namespace, device_generator
from .base import Compressor, Payload, check_float, compute_dtype, register

__all__ = ["QSGD"]


@register
@dataclass(frozen=True)
class QSGD(Compressor):
    """``levels`` quantisation levels, norms per ``bucket`` elements, stochastic rounding."""

    name: ClassVar[str] = "qsgd"
    unbiased: ClassVar[bool] = True
    levels: int = 16
    bucket: int = 512

    def __post_init__(self):
        if not 1 <= self.levels <= 32767:
            raise ValueError(f"levels must be in 1..32767, got {self.levels}")
        if self.bucket < 1:
            raise ValueError(f"bucket must be >= 1, got {self.bucket}")

    def _width(self, n: int) -> int:
        """Return the elements a bucket of a tensor of ``n`` holds: ``bucket``, or ``n`` when
        the tensor fills less than one (no bucket of mostly padding to draw for)."""
        return max(1, min(self.bucket, n))

    def _buckets(self, flat):
        width = self._width(flat.size)
        rows = math.ceil(flat.size / width)
        padded = array_namespace(flat).zeros(rows * width, dtype=flat.dtype)
        padded[: flat.size] = flat
        return padded.reshape(rows, width)

    def compress(self, x, state) -> Payload:
        """Return per-bucket norms and the signed levels, drawn with ``state.rng``."""
        check_float(x, self.name)
        xp = array_namespace(x)
        cd = compute_dtype(x.dtype)
        flat = x.reshape(-1).astype(cd)
        buckets = self._buckets(flat)
        norms = xp.sqrt(xp.einsum("ij,ij->i", buckets, buckets))
        with np.errstate(invalid="ignore", divide="ignore"):
            scaled = xp.where(norms[:, None] > 0, xp.abs(buckets) / norms[:, None], 0) * self.levels
        lower = xp.floor(scaled)
        up = device_generator(state, xp).random(scaled.shape, dtype=cd) < (scaled - lower)
        level = xp.minimum(lower + up, self.levels)
        code = np.int8 if self.levels <= 127 else np.int16
        signed = (xp.copysign(level, buckets).reshape(-1)[: flat.size]).astype(code)
        return self._payload(x, {"norms": norms.astype(cd), "levels": signed})

    def decompress(self, payload: Payload) -> np.ndarray:
        """Return ``norm · level / s`` per element."""
        levels = payload.arrays["levels"]
        norms = payload.arrays["norms"]
        per_element = array_namespace(norms).repeat(norms, self._width(levels.size))[: levels.size]
        out = per_element * levels / norms.dtype.type(self.levels)
        return out.astype(payload.dtype).reshape(payload.shape)
