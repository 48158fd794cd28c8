"""Deterministic test inputs: the same (kind, dtype, count, rank, size, seed) gives
the same array on every machine, so each rank can regenerate every other rank's
input and compute the expected result without communicating.

Kinds:

* ``exact``: results exact in any reduction order (nccl-tests' "verifiable"
  idea). Integers: any values (integer arithmetic wraps, which is exact and
  order-independent). Floats, per op: ``sum``/``avg``: integers in ``[-m, m]``
  with ``m = M // p`` where every integer up to ``M`` is exact in the dtype, so every
  partial sum is exact (when ``p > M``, as for float8 at many ranks, only the
  first ``M`` ranks contribute and the rest send zeros); ``prod``: ``±1`` with one
  ``±2`` per element (at rank ``i mod p``), so every partial product is a power
  of two; ``min``/``max``: distinct nonzero integers of random sign (no ``±0``
  ties, whose order a reduction may reveal).
* ``random``: standard normal values (``prod``: magnitudes in [0.8, 1.25] of
  random sign, so products neither overflow nor underflow) rounded to the dtype;
  results depend on the reduction order.
* ``adversarial``: large values of both signs that cancel across ranks, plus
  small ones (MPICH's ``allred_float`` idea): sums whose bits expose the order.
"""

from __future__ import annotations

import zlib

import numpy as np

from .ops import dtype_name, exact_integer_limit, get_dtype, is_integer

__all__ = ["KINDS", "make_input", "make_inputs"]

KINDS = ("exact", "random", "adversarial")


def _rng(kind: str, dtype, count: int, rank: int, size: int, op: str, seed: int):
    salt = zlib.crc32(f"{kind}/{dtype_name(dtype)}/{op}".encode())
    return np.random.default_rng([seed, rank, size, count, salt])


def make_input(kind: str, dtype, count: int, rank: int, size: int, *, op: str = "sum",
               seed: int = 0) -> np.ndarray:
    """Return rank ``rank``'s input of ``count`` elements for a world of ``size`` ranks."""
    if kind not in KINDS:
        raise ValueError(f"unknown input kind {kind!r}: choose one of {', '.join(KINDS)}")
    dt = get_dtype(dtype)
    rng = _rng(kind, dt, count, rank, size, op, seed)
    if is_integer(dt):
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=count, dtype=dt, endpoint=True)
    if kind == "exact":
        limit = exact_integer_limit(dt)
        if op in ("sum", "avg"):
            m = max(1, limit // size)
            contributing = min(size, limit // m)
            if rank >= contributing:
                return np.zeros(count, dtype=dt)
            return rng.integers(-m, m, size=count, endpoint=True).astype(dt)
        if op == "prod":
            values = rng.choice(np.array([-1.0, 1.0]), size=count)
            values[(np.arange(count) % size) == rank] *= 2.0
            return values.astype(dt)
        values = rng.integers(1, limit, size=count, endpoint=True).astype(np.float64)
        return (values * rng.choice(np.array([-1.0, 1.0]), size=count)).astype(dt)
    if kind == "random":
        if op == "prod":
            magnitude = rng.uniform(0.8, 1.25, size=count)
            return (magnitude * rng.choice(np.array([-1.0, 1.0]), size=count)).astype(dt)
        return rng.standard_normal(count).astype(dt)
    # adversarial: +L on even ranks, -L on odd ranks (sign flipped per element), plus
    # small values, so partial sums cancel and the surviving low bits depend on order.
    big = float(exact_integer_limit(dt)) * 4.0
    sign = np.where((np.arange(count) + rank) % 2 == 0, 1.0, -1.0)
    small = rng.uniform(-1.0, 1.0, size=count) * rng.choice(np.array([1.0, 2.0 ** -10]), size=count)
    return (sign * big + small).astype(dt)


def make_inputs(kind: str, dtype, count: int, size: int, *, op: str = "sum",
                seed: int = 0) -> list[np.ndarray]:
    """Return every rank's input, by rank."""
    return [make_input(kind, dtype, count, r, size, op=op, seed=seed) for r in range(size)]
