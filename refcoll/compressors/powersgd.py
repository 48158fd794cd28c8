"""PowerSGD: rank-r approximation by one warm-started power-iteration step (Vogels et al. 2019).

A tensor of shape ``(m, ...)`` is read as the matrix ``M`` of shape ``(m, n)``,
``n`` the product of the other dimensions. With ``Q`` (``n × r``) from the
previous step on this state (at first standard normal from the seed shared by
all ranks, so every rank starts from the same ``Q``), Algorithm 1 of the paper:

1. ``P = M Q``
2. ``P = orthogonalise(P)``   (Gram–Schmidt, each column divided by max(norm, eps))
3. ``Q = M^T P``               (kept in the state: the next step's warm start)
4. decompress: ``M ≈ P Q^T``

Wire: ``P`` and ``Q``, ``(m + n) · r`` elements in float32 (float64 for float64
tensors). Vectors (``ndim < 2``) are sent uncompressed, and so is any matrix for
which compression does not pay: a matrix is compressed only when
``(m + n) · r · min_rate < m · n``. With ``r = min(m, n)`` the reconstruction is
exact up to rounding. In a data-parallel all-reduce ``P`` and ``Q`` are each
summed over ranks (linear in the shared basis) — that two-round scheme is the
collective's job; a single compress here makes one rank's step.

On CuPy arrays the first ``Q`` is drawn on the host from the shared seed (the
same numbers) and copied to the device; the products run in the device's BLAS,
whose summation order (and so the last bits) differs from the CPU's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..core.xp import array_namespace
from .base import Compressor, Payload, compute_dtype, check_float, register

__all__ = ["PowerSGD", "orthogonalise"]


def orthogonalise(matrix, eps: float) -> None:
    """Orthonormalise the columns of ``matrix`` in place (modified Gram–Schmidt).

    A column is divided by ``max(norm, eps)``: a (numerically) zero column stays
    near zero instead of dividing by zero, and any other column is not biased.
    On the device the norm stays there (no read back per column).
    """
    xp = array_namespace(matrix)
    for i in range(matrix.shape[1]):
        column = matrix[:, i]
        norm = xp.linalg.norm(column)
        column /= max(norm, eps) if xp is np else xp.maximum(norm, column.dtype.type(eps))
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1 :]
            rest -= xp.outer(column, column @ rest)


@register
@dataclass(frozen=True)
class PowerSGD(Compressor):
    """Rank-``rank`` factors ``P``, ``Q`` with a warm-started ``Q``."""

    name: ClassVar[str] = "powersgd"
    linear: ClassVar[bool] = True
    rank: int = 4
    min_rate: float = 2.0
    eps: float = 1e-8

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"rank must be >= 1, got {self.rank}")
        if self.min_rate < 0:
            raise ValueError(f"min_rate must be >= 0, got {self.min_rate}")

    def plan(self, shape: tuple) -> tuple[int, int, int] | None:
        """Return ``(m, n, r)`` for a tensor this compresses, or None when it goes whole."""
        if len(shape) < 2:
            return None
        m, n = shape[0], math.prod(shape[1:])
        r = min(self.rank, m, n)
        if r == 0 or not (m + n) * r * self.min_rate < m * n:
            return None
        return m, n, r

    def compress(self, x, state) -> Payload:
        """Return ``P`` and ``Q`` (or the tensor itself); keep ``Q`` in ``state.memory``."""
        check_float(x, self.name)
        plan = self.plan(x.shape)
        if plan is None:
            return self._payload(x, {"values": x.reshape(-1)})
        m, n, r = plan
        xp = array_namespace(x)
        cd = compute_dtype(x.dtype)
        matrix = x.reshape(m, n).astype(cd)
        key = ("powersgd.q", m, n, r)
        q = state.memory.get(key)
        if q is None:
            q = xp.asarray(state.shared_rng(m, n, r).standard_normal((n, r)).astype(cd))
        p = matrix @ q
        orthogonalise(p, self.eps)
        q = matrix.T @ p
        state.memory[key] = q
        return self._payload(x, {"p": p, "q": q})

    def decompress(self, payload: Payload) -> np.ndarray:
        """Return ``P Q^T`` in the tensor's shape and dtype (or the tensor sent whole)."""
        if "values" in payload.arrays:
            return payload.arrays["values"].reshape(payload.shape).copy()
        p, q = payload.arrays["p"], payload.arrays["q"]
        return (p @ q.T).astype(payload.dtype).reshape(payload.shape)
