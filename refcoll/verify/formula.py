"""refcoll's inputs as a formula of (seed, rank, index): made anywhere, at any scale, no files.

A library tested at thousands of ranks and billions of elements cannot ship
rank files around. These inputs are a counter-based formula instead: element
``i`` of rank ``r`` is a function of ``(seed, r, i)`` alone, so a rank, a GPU
kernel or a checker makes any element without making the others. The formula
is written once in C in ``spec/inputs.md`` (a test compiles it with the machine's
compiler and compares its bits with this module's); :func:`values` is the same
formula on NumPy arrays of indices.

The generator is SplitMix64's finaliser (Steele, Lea and Flood, "Fast splittable
pseudorandom number generators", OOPSLA 2014) chained over the counter:
``bits(seed, stream, i) = mix(mix(mix(seed) ^ stream) ^ i)``, all in 64-bit
unsigned arithmetic that wraps; rank ``r`` draws from stream ``r``, and the
choices every rank shares (which rank holds the large value of an element) from
streams past every rank's. Kinds, for the op ``sum`` (and ``avg``):

* ``exact``: every order gives the same bits. A float element is the integer
  ``bits % (2m + 1) - m`` with ``m = M // p`` (every integer up to ``M`` exact in
  the dtype, so every partial sum is exact); with ``p > M`` only the first ``M``
  ranks draw from ``[-1, 1]`` and the others hold 0. An integer element is the
  low bits of ``bits`` (integer sums wrap: exact in any order).
* ``adversarial``: the order shows in the bits. Element ``i``'s large rank
  ``b = bits(seed, BIG, i) % p`` holds ``±M`` (sign: the top bit of the same
  draw) and on odd ``i`` the rank ``(b + 1 + bits(seed, PAIR, i) % (p - 1)) % p``
  holds the opposite, so the large values cancel; every other rank holds a value
  in ``[0.75, 1)`` of the large value's sign, ``0.75 + (bits >> 11)·2**-55``,
  rounded to the dtype. An order that meets ``M`` first absorbs the small
  values whole: refcoll's ``adversarial`` inputs' idea
  (:mod:`refcoll.verify.inputs`), made by formula.

:data:`SPEC_PATTERN` is how ``refcoll check --inputs`` names them:
``adversarial:seed=7,p=64,count=16777216``.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

from ..core.errors import UsageError
from ..core.ops import dtype_name, exact_integer_limit, get_dtype, is_float, is_integer

__all__ = ["FORMULA_KINDS", "STREAM_BIG", "STREAM_PAIR", "STREAM_SAMPLE", "bits", "values",
           "inputs", "parse_spec", "sample_indices", "SPEC_PATTERN", "Spec", "FormulaInput"]

FORMULA_KINDS = ("exact", "adversarial")

#: Streams of the choices every rank shares: past any rank's (ranks draw streams 0..p-1).
STREAM_BIG = 0xFFFFFFFF00000001
STREAM_PAIR = 0xFFFFFFFF00000002
#: The stream ``--sample`` draws the elements it judges from.
STREAM_SAMPLE = 0xFFFFFFFF00000003

_GOLDEN, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_U64 = np.uint64

#: ``KIND:seed=S,p=P,count=N[,dtype=D]``: what ``refcoll check --inputs`` takes.
SPEC_PATTERN = re.compile(r"^(?P<kind>[a-z]+):seed=(?P<seed>[0-9]{1,20}),p=(?P<p>[0-9]{1,20}),"
                          r"count=(?P<count>[0-9]{1,20})"  # (ASCII digits; 2**64 has 20)
                          r"(?:,dtype=(?P<dtype>[a-z0-9_]{1,32}))?$")


class Spec(NamedTuple):
    """A formula world as ``--inputs`` names it; ``dtype`` ``None``: the outputs' own
    (their ``meta.json``'s, else their header's)."""

    kind: str
    seed: int
    p: int
    count: int
    dtype: np.dtype | None = None

    def __str__(self) -> str:
        named = "" if self.dtype is None else f",dtype={dtype_name(self.dtype)}"
        return f"{self.kind}:seed={self.seed},p={self.p},count={self.count}{named}"


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = z + _U64(_GOLDEN)
        z = (z ^ (z >> _U64(30))) * _U64(_M1)
        z = (z ^ (z >> _U64(27))) * _U64(_M2)
    return z ^ (z >> _U64(31))


def bits(seed: int, stream: int, index) -> np.ndarray:
    """Return ``mix(mix(mix(seed) ^ stream) ^ index)`` for each index (uint64)."""
    head = _mix(np.array([seed], dtype=_U64))[0]
    key = _mix(np.array([head ^ _U64(stream)], dtype=_U64))[0]
    return _mix(np.asarray(index, dtype=_U64) ^ key)


def values(kind: str, dtype, p: int, rank: int, index, *, seed: int = 0) -> np.ndarray:
    """Return rank ``rank``'s elements at ``index`` (an array of indices) of a world of ``p``."""
    dt = get_dtype(dtype)
    index = np.asarray(index, dtype=_U64)
    if kind not in FORMULA_KINDS:
        raise UsageError(f"unknown formula kind {kind!r}: choose {', '.join(FORMULA_KINDS)}")
    if not 0 <= rank < p:
        raise UsageError(f"rank {rank} is not one of the {p} ranks")
    own = bits(seed, rank, index)
    if kind == "exact":
        if is_integer(dt):
            width = 8 * dt.itemsize
            low = own & _U64((1 << width) - 1)
            return low.astype(np.dtype(f"uint{width}")).view(dt)
        limit = exact_integer_limit(dt)
        m = limit // p if p <= limit else (1 if rank < limit else 0)
        drawn = (own % _U64(2 * m + 1)).astype(np.int64) - m
        return drawn.astype(np.float64).astype(dt)
    if not is_float(dt):
        raise UsageError(f"adversarial inputs are floats; {dtype_name(dt)} is not: use exact"
                         + (" (outputs of bfloat16 or float8 stored as their bits? name the "
                            "type: --inputs ...,dtype=bfloat16)" if dt.kind == "u" else ""))
    large = float(exact_integer_limit(dt))
    big_draw = bits(seed, STREAM_BIG, index)
    big = (big_draw % _U64(p)).astype(np.int64)
    sign = np.where((big_draw >> _U64(63)) == _U64(1), -1.0, 1.0)
    small = 0.75 + (own >> _U64(11)).astype(np.float64) * 2.0 ** -55
    out = sign * small
    out = np.where(big == rank, sign * large, out)
    if p > 1:
        pair = ((big + 1 + (bits(seed, STREAM_PAIR, index) % _U64(p - 1)).astype(np.int64))
                % p)
        odd = (index & _U64(1)) == _U64(1)
        out = np.where(odd & (pair == rank), -sign * large, out)
    return out.astype(dt)


def inputs(kind: str, dtype, p: int, count: int, *, seed: int = 0, start: int = 0,
           stop: int | None = None) -> list[np.ndarray]:
    """Return every rank's elements ``start..stop`` (default: all ``count``), by rank."""
    stop = count if stop is None else stop
    index = np.arange(start, stop, dtype=_U64)
    return [values(kind, dtype, p, r, index, seed=seed) for r in range(p)]


class FormulaInput:
    """One rank's formula input, made block by block as :func:`~refcoll.verify.oracle.check_outputs`
    reads it (the interface of :class:`~refcoll.verify.npy.NpyFile`): no array of
    ``count`` elements is ever held."""

    def __init__(self, kind: str, dtype, p: int, rank: int, count: int, *, seed: int = 0):
        self.kind, self.p, self.rank, self.seed = kind, p, rank, seed
        self.dtype, self.size, self.shape, self.ndim = get_dtype(dtype), count, (count,), 1

    def read(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Return elements ``lo .. hi-1`` (all by default)."""
        index = np.arange(lo, self.size if hi is None else hi, dtype=_U64)
        return values(self.kind, self.dtype, self.p, self.rank, index, seed=self.seed)

    def whole(self) -> np.ndarray:
        return self.read()


def parse_spec(text: str) -> Spec:
    """Return the :class:`Spec` of ``KIND:seed=S,p=P,count=N[,dtype=D]``.

    ``dtype``: the outputs' (bfloat16 and float8 files hold their unsigned bits,
    whose header alone cannot say which type they are).

    Raises:
        UsageError: another form, an unknown kind or dtype, or p < 1.
    """
    m = SPEC_PATTERN.match(text.strip())
    if m is None:
        shown = text if len(text) <= 80 else text[:60] + "..."
        raise UsageError(f"--inputs {shown!r}: write KIND:seed=S,p=P,count=N[,dtype=D], e.g. "
                         "adversarial:seed=7,p=64,count=16777216")
    kind, seed, p, count = m["kind"], int(m["seed"]), int(m["p"]), int(m["count"])
    if kind not in FORMULA_KINDS:
        raise UsageError(f"--inputs {text!r}: kind {kind!r} is not one of "
                         f"{', '.join(FORMULA_KINDS)}")
    if p < 1 or seed >= 1 << 64:
        raise UsageError(f"--inputs {text!r}: p must be at least 1 and seed below 2**64")
    if p > MAX_SPEC_RANKS or p * count > MAX_SPEC_ELEMENTS:
        raise UsageError(f"--inputs {text!r}: at most {MAX_SPEC_RANKS} ranks (MPI's int) and "
                         f"2**53 elements in all (p·count: an allgather's output; every index "
                         f"exact in a float64)")
    try:
        dtype = None if m["dtype"] is None else get_dtype(m["dtype"])
    except UsageError as exc:
        raise UsageError(f"--inputs {text!r}: {exc}") from None
    return Spec(kind, seed, p, count, dtype)


#: The largest world ``--inputs`` names: MPI's ranks are C ints; and its most elements,
#: ``p·count`` (an all-gather's output), so that every index and length is exact in a
#: float64 and far from int64's end.
MAX_SPEC_RANKS, MAX_SPEC_ELEMENTS = 2**31 - 1, 2**53


def sample_indices(count: int, k: int, *, seed: int = 0) -> np.ndarray:
    """Return ``min(k, count)`` distinct element indices to judge, sorted: the first and
    the last, and the others drawn uniformly from between them.

    Drawn from :data:`STREAM_SAMPLE` (the same for every checker of the same run): the
    draw ``j`` is ``1 + bits(seed, STREAM_SAMPLE, j) % (count - 2)``, and the first
    ``k - 2`` distinct draws are kept, in the order drawn, so each is as likely as any
    other element to be judged. When ``k - 2`` is more than half of the elements
    between, those with the ``k - 2`` smallest ``bits(seed, STREAM_SAMPLE, i)`` are
    taken instead (``k`` distinct draws would take too many).
    """
    if count <= 0 or k <= 0:
        return np.zeros(0, dtype=np.int64)
    if k >= count:
        return np.arange(count, dtype=np.int64)
    ends = np.array([0, count - 1][:k], dtype=np.int64)
    inner, want = count - 2, k - 2
    if want <= 0:
        return np.unique(ends)
    if 2 * want > inner:  # dense: rank every element between by its draw
        keys = bits(seed, STREAM_SAMPLE, np.arange(inner, dtype=_U64))
        middle = 1 + np.argpartition(keys, want - 1)[:want]
    else:
        drawn, made = np.zeros(0, dtype=np.int64), 0
        while True:
            more = bits(seed, STREAM_SAMPLE, np.arange(made, made + 2 * want, dtype=_U64))
            drawn = np.concatenate([drawn, 1 + (more % _U64(inner)).astype(np.int64)])
            made += 2 * want
            values_, first = np.unique(drawn, return_index=True)
            if values_.size >= want:
                break
        middle = values_[np.argsort(first)[:want]]  # the first distinct draws, in draw order
    return np.sort(np.concatenate([ends, middle]))
