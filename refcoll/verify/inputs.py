"""Deterministic test inputs: each rank can regenerate every other rank's input.

The same (kind, dtype, count, rank, size, seed) gives the same array on every
machine, so each rank can regenerate every other rank's input and compute the
expected result without communicating.

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
* ``adversarial``: the worst case of the summation error bound. Per element one
  rank holds the power of two ``B = M`` (the spacing just above it is 2) and
  every other rank a value in ``[0.75, 1)`` of the same sign, which a partial sum
  holding ``B`` absorbs whole: an order that meets ``B`` first loses
  ``≈ (p-1)·u·Σ|x|``, the γ(p-1) bound itself. On every other element a second
  rank holds ``-B`` (MPICH's ``allred_float`` idea), so the large values cancel
  and the small ones that survive show the order. Which ranks hold ``±B``, and
  the sign, are drawn per element from a generator every rank shares. ``prod``:
  magnitudes in ``[1, 1 + min(1/8, 1/p))`` with random mantissas and signs, so
  every partial product rounds and none can overflow (``|Π| < e``).

The rank files these inputs are written to and read from (``rank<r>.npy`` and
``meta.json``) are :mod:`refcoll.verify.rankfiles`'; :func:`write_rank_files` and
:func:`read_rank_files` are re-exported here.
"""

from __future__ import annotations

import zlib

import numpy as np

from ..core.ops import dtype_name, exact_integer_limit, get_dtype, is_integer
from .rankfiles import read_rank_files, write_rank_files

__all__ = ["KINDS", "make_input", "make_inputs", "write_rank_files", "read_rank_files"]

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
    return _adversarial(dt, count, rank, size, op, seed, rng)


def _adversarial(dt: np.dtype, count: int, rank: int, size: int, op: str, seed: int,
                 rng) -> np.ndarray:
    """Return rank ``rank``'s ``adversarial`` input (see the module docstring)."""
    if op == "prod":
        magnitude = 1.0 + rng.uniform(0.0, min(0.125, 1.0 / size), size=count)
        return (magnitude * rng.choice(np.array([-1.0, 1.0]), size=count)).astype(dt)
    # The layout (who holds +B, who -B, the sign) is the same on every rank: its
    # generator is seeded without the rank.
    shared = np.random.default_rng([seed, size, count, zlib.crc32(b"adversarial/layout")])
    sign = shared.choice(np.array([-1.0, 1.0]), size=count)
    holder = shared.integers(0, size, size=count)
    canceller = (holder + shared.integers(1, max(size, 2), size=count)) % size
    cancels = (np.arange(count) % 2 == 1) & (size > 1)
    # B = M = 2**(mantissa bits + 1): the spacing just above B is 2, so a partial
    # sum B + s with a same-sign s below 1 rounds back to B.
    big = float(exact_integer_limit(dt))
    values = sign * rng.uniform(0.75, 1.0, size=count)
    values[holder == rank] = sign[holder == rank] * big
    values[cancels & (canceller == rank)] = -sign[cancels & (canceller == rank)] * big
    return values.astype(dt)


def make_inputs(kind: str, dtype, count: int, size: int, *, op: str = "sum",
                seed: int = 0) -> list[np.ndarray]:
    """Return every rank's input, by rank."""
    return [make_input(kind, dtype, count, r, size, op=op, seed=seed) for r in range(size)]
