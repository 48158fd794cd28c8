"""PowerSGD: rank-r approximation by one warm-started power-iteration step (Vogels et al. 2019).

A tensor of shape ``(m, ...)`` is read as the matrix ``M`` of shape ``(m, n)``,
``n`` the product of the other dimensions. With ``Q`` (``n × r``) from the
previous step on this state (at first standard normal from the seed shared by
all ranks, so every rank starts from the same ``Q``), Algorithm 1 of the paper:

0. ``Q = orthogonalise(Q)``   (the warm start's scale is the last gradient's: drop it)
1. ``P = M Q``
2. ``P = orthogonalise(P)``   (Gram–Schmidt, each column divided by its norm)
3. ``Q = M^T P``               (kept in the state: the next step's warm start)
4. decompress: ``M ≈ P Q^T``

Step 0 is PyTorch's ``powerSGD_hook``'s too. Without it ``P``'s scale follows
``|M|²``, and a small gradient's columns fall below ``eps`` and shrink the result
step after step. A column of norm at most ``eps`` (0 by default) counts as zero:
in ``P`` it stays zero (that direction of ``M`` is empty, so nothing is lost);
in the warm start it is drawn again from the shared seed, since a zero ``Q``
(after an all-zero gradient, such as an unused parameter's) would make every
later ``P = M Q`` zero and silence the tensor for good.

Wire: ``P`` and ``Q``, ``(m + n) · r`` elements in float32 (float64 for float64
tensors). Vectors (``ndim < 2``) are sent uncompressed, and so is any matrix for
which compression does not pay: a matrix is compressed only when
``(m + n) · r · min_rate < m · n``. With ``r = min(m, n)`` the reconstruction is
exact up to rounding. A single compress makes one rank's step.

In a data-parallel all-reduce (the ``allreduce`` pattern) ``P`` and ``Q`` are
each summed over ranks, linear in the shared basis; :meth:`PowerSGD.allreduce_rounds`
declares the two rounds of the paper's Algorithm 1:

1. ``P = M Q``, all-reduced (summed);
2. ``P = orthogonalise(P)`` on every rank alike;
3. ``Q = M^T P``, all-reduced with the call's op; the reduced ``Q`` is every
   rank's next warm start;
4. the result is ``P Q^T``.

This rank's own contribution is ``P Q_local^T`` (the shared ``P``, its ``Q``
before the sum): what error feedback subtracts, as in the paper's reference code.

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
from .base import Compressor, Payload, Round, Rounds, check_float, compute_dtype, register

__all__ = ["PowerSGD", "orthogonalise"]


def orthogonalise(matrix, eps: float = 0.0, fill=None) -> None:
    """Orthonormalise the columns of ``matrix`` in place (modified Gram–Schmidt).

    A column whose norm (after the earlier columns are taken out of it) is at
    most ``eps`` counts as zero: it becomes zero, or, given ``fill`` (a matrix of
    the same shape), ``fill``'s column made orthonormal to the earlier ones.
    Any other column is divided by its norm. On the device the norm stays there
    (no read back per column).
    """
    xp = array_namespace(matrix)
    for i in range(matrix.shape[1]):
        column = matrix[:, i]
        norm = xp.linalg.norm(column)
        kept = norm > eps
        column /= xp.where(kept, norm, 1)
        if fill is None:
            column *= kept
        else:
            done = matrix[:, :i]
            seed = fill[:, i] - done @ (done.T @ fill[:, i])
            column[...] = xp.where(kept, column, seed / xp.linalg.norm(seed))
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1 :]
            rest -= xp.outer(column, column @ rest)


@register
@dataclass(frozen=True)
class PowerSGD(Compressor):
    """Rank-``rank`` factors ``P``, ``Q`` with a warm-started ``Q``."""

    name: ClassVar[str] = "powersgd"
    linear: ClassVar[bool] = True
    matrices: ClassVar[bool] = True
    rank: int = 4
    min_rate: float = 2.0
    eps: float = 0.0

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"rank must be >= 1, got {self.rank}")
        if not 0 <= self.min_rate < math.inf:  # (NaN too: it would switch compression off)
            raise ValueError(f"min_rate must be a finite number >= 0, got {self.min_rate}")
        if not 0 <= self.eps < math.inf:  # (inf: every column zero, every gradient zero)
            raise ValueError(f"eps must be a finite number >= 0, got {self.eps}")

    def plan(self, shape: tuple) -> tuple[int, int, int] | None:
        """Return ``(m, n, r)`` for a tensor this compresses, or None when it goes whole."""
        if len(shape) < 2:
            return None
        m, n = shape[0], math.prod(shape[1:])
        r = min(self.rank, m, n)
        if r == 0 or not (m + n) * r * self.min_rate < m * n:
            return None
        return m, n, r

    def shared_factors(self, shape: tuple) -> tuple[int, int] | None:
        """Return the elements of ``P`` and of ``Q`` (``m·r``, ``n·r``), or None: sent whole."""
        plan = self.plan(tuple(shape))
        if plan is None:
            return None
        m, n, r = plan
        return m * r, n * r

    def _start(self, x, state, plan):
        """Return ``M`` in the compute dtype, the orthonormal warm start ``Q`` (step 0) and
        ``Q``'s key in the memory."""
        m, n, r = plan
        cd = compute_dtype(x.dtype)
        key = ("powersgd.q", m, n, r)
        first = array_namespace(x).asarray(
            state.shared_rng(m, n, r).standard_normal((n, r)).astype(cd))
        q = state.memory.get(key)
        q = first if q is None else q.copy()  # the memory keeps the reduced Q as it came
        orthogonalise(q, self.eps, fill=first)
        return x.reshape(m, n).astype(cd), q, key

    def compress(self, x, state) -> Payload:
        """Return ``P`` and ``Q`` (or the tensor itself); keep ``Q`` in ``state.memory``."""
        check_float(x, self.name)
        plan = self.plan(x.shape)
        if plan is None:
            return self._payload(x, {"values": x.reshape(-1)})
        matrix, q, key = self._start(x, state, plan)
        p = matrix @ q
        orthogonalise(p, self.eps)
        q = matrix.T @ p
        state.memory[key] = q
        return self._payload(x, {"p": p, "q": q})

    def allreduce_rounds(self, x, state, *, size: int, op: str) -> Rounds:
        """Sum ``P``, orthogonalise it, reduce ``Q`` with ``op``: steps 1-4 above.

        A tensor this leaves whole takes the default single round.
        """
        plan = self.plan(x.shape)
        if plan is None:
            return (yield from super().allreduce_rounds(x, state, size=size, op=op))
        matrix, q, key = self._start(x, state, plan)
        p = (yield Round({"p": matrix @ q}, "sum"))["p"]
        orthogonalise(p, self.eps)
        q_local = matrix.T @ p
        q = (yield Round({"q": q_local}, op))["q"]
        state.memory[key] = q
        local = self._payload(x, {"p": p, "q": q_local})
        return local, self.decompress(self._payload(x, {"p": p, "q": q}))

    def decompress(self, payload: Payload) -> np.ndarray:
        """Return ``P Q^T`` in the tensor's shape and dtype (or the tensor sent whole)."""
        if "values" in payload.arrays:
            return payload.arrays["values"].reshape(payload.shape).copy()
        p, q = payload.arrays["p"], payload.arrays["q"]
        return (p @ q.T).astype(payload.dtype).reshape(payload.shape)
