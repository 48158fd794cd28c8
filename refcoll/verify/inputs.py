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
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np

from ..core.errors import UsageError
from ..core.ops import dtype_name, exact_integer_limit, get_dtype, is_integer

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


# ------------------------------------------------------------------ rank files

def _storage(dtype: np.dtype) -> np.dtype:
    """Return how ``dtype`` is stored in ``.npy``: ml_dtypes types as unsigned bits."""
    if dtype.kind == "V" or dtype.name.startswith(("bfloat16", "float8")):
        return np.dtype(f"uint{8 * dtype.itemsize}")
    return dtype


def write_rank_files(directory, arrays, *, meta: dict | None = None) -> None:
    """Write ``rank<r>.npy`` for each array and ``meta.json`` naming the dtype.

    bfloat16 and float8 arrays are stored as their unsigned-integer bits (``.npy``
    cannot name ml_dtypes' types); ``meta.json`` records the real dtype, so any
    language can read the bits back.
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    first = next((a for a in arrays if a is not None), None)
    info = dict(meta or {})
    if first is not None:
        info.setdefault("dtype", dtype_name(first.dtype))
        info["stored_as"] = str(_storage(first.dtype))
    for r, arr in enumerate(arrays):
        if arr is not None:
            np.save(path / f"rank{r}.npy", np.ascontiguousarray(arr).view(_storage(arr.dtype)))
    (path / "meta.json").write_text(json.dumps(info, indent=2) + "\n")


def read_rank_files(directory, *, dtype=None, size: int | None = None) -> list:
    """Read ``rank<r>.npy`` files, ``None`` for a missing rank (up to ``size`` ranks).

    The dtype comes from ``dtype``, else ``meta.json``, else the files themselves;
    arrays stored as bits are viewed back as that dtype.
    """
    path = Path(directory)
    if not path.is_dir():
        raise UsageError(f"{directory}: no such directory")
    meta_file = path / "meta.json"
    meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
    want = get_dtype(dtype or meta["dtype"]) if (dtype or "dtype" in meta) else None
    ranks = sorted(int(f.stem[4:]) for f in path.glob("rank*.npy") if f.stem[4:].isdigit())
    if not ranks and size is None:
        raise UsageError(f"{directory}: no rank<r>.npy files")
    count = size if size is not None else ranks[-1] + 1
    arrays = []
    for r in range(count):
        f = path / f"rank{r}.npy"
        if not f.exists():
            arrays.append(None)
            continue
        try:
            arr = np.load(f, allow_pickle=False)
        except ValueError as exc:
            raise UsageError(f"{f}: not a readable .npy file ({exc})") from None
        if want is not None and arr.dtype != want:
            if arr.dtype.itemsize != want.itemsize or arr.dtype.kind not in "uiV":
                raise UsageError(f"{f}: holds {arr.dtype}, expected {dtype_name(want)}")
            arr = arr.view(want)
        arrays.append(arr)
    return arrays
