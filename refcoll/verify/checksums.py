"""Block checksums: every element of every call judged, in a few numbers per block.

A sample of ``k`` of ``n`` elements sees one wrong element with probability
``k/n``. Silent data corruption is exactly one wrong element, so watch mode also
checks every element, by algorithm-based fault tolerance (Huang and Abraham,
"Algorithm-Based Fault Tolerance for Matrix Operations", IEEE Trans. Computers,
1984): a reduction is linear, so a weighted sum of its output's elements is the
same weighted sum of its inputs' elements, summed over the ranks.

Elements are cut into blocks of ``B`` (:func:`block_size`). Every rank sums each
block with the same weights ``w_i`` in ``[1, 2)`` (a counter-based draw,
:data:`WEIGHTS`), in float64, giving per block

* ``c = Σ w_i·x_i``, the checksum, and ``a = Σ w_i·|x_i|``, its scale,

of its input (before the call) and of its output, and ``max |x_i|``, which says
whether any element's sum can overflow. For a sum, block ``j`` of rank
``r``'s output conforms only if

    ``|c_out[r, j] - Σ_q c_in[q, j]| <= γ(p-1)·Σ_q a_in[q, j] + float64's roundings``

since any summation order leaves each element within ``γ(p-1)·Σ_q |x_q,i|`` of
the exact sum (the oracle's bound, :mod:`refcoll.verify.ieee`), and the weighted
sum of those errors is at most the weighted sum of their bounds. The float64
roundings of the checksums themselves (a dot product of ``B`` terms: at most
``γ64(B)`` times its scale; ``p`` checksums summed: ``γ64(p)``) are added, so the
test is rigorous: a conforming library never fails it. ``avg`` divides by ``p``
(one rounding more: ``γ(p)``, and the smallest subnormal per element);
``premul_sum`` and watch mode's own ``avg`` on Gloo scale each input by ``f``
first (one rounding of ``u·|f|·|x|``).

What it catches. An element off by ``δ`` moves its block's checksum by
``w_i·δ >= δ``, so every ``δ`` above the block's allowance (:func:`smallest_caught`:
about ``2·γ(p)·B`` times the mean ``Σ_q |x_q|`` of the block's elements) is
caught, in every call. :func:`block_size` picks ``B`` so that the allowance is at
most 1/8 of 1 % of that mean: one element off by 1 % of a typical element's
magnitude is caught with a margin of 8, while the checksums stay ``3·n/B`` numbers
(``B`` = 4096 for float32 on 2 ranks: 384 KiB a rank for a 256 MiB call). A NaN
or infinity in the output, or a flipped exponent bit (a factor of at least 2, so
``δ >= |y_i|/2``), is caught where the inputs are finite. Wider types need smaller
blocks: bfloat16's ``u = 2**-8`` leaves blocks of :data:`SMALLEST_BLOCK`, whose
allowance :func:`smallest_caught` states. Rank agreement and the exact bits are
the sampled check's (:mod:`refcoll.torch.watch`), which also names an element.
"""

from __future__ import annotations

import functools

import numpy as np

from ..core.ops import finfo, unit_roundoff
from .formula import bits
from .ieee import gamma

__all__ = ["WEIGHTS", "SMALLEST_BLOCK", "LARGEST_BLOCK", "block_size", "weights", "checksums",
           "judge_sums", "smallest_caught", "BadBlock", "block_elements"]

#: The stream of the weights (past every rank's and the formula's shared streams).
WEIGHTS = 0xFFFFFFFF00000010

#: The fewest and most elements of a block.
SMALLEST_BLOCK, LARGEST_BLOCK = 16, 8192

#: Where :func:`block_size` puts a block's allowance: this fraction of 1 % of the mean
#: ``Σ_q |x_q|`` of its elements.
MARGIN = 8

_SLACK = 1.0 + 2.0 ** -40  # float64's own roundings in computing the allowance
_U64 = 2.0 ** -53


@functools.lru_cache(maxsize=None)
def block_size(p: int, dtype) -> int:
    """Return the elements per block for ``p`` ranks' ``dtype`` (a power of two)."""
    allowance = 2.0 * gamma(p, unit_roundoff(dtype))  # per element (avg: γ(p)), w <= 2
    b = int(0.01 / (MARGIN * allowance)) if allowance else LARGEST_BLOCK
    b = 1 << max(0, b.bit_length() - 1)
    return max(SMALLEST_BLOCK, min(LARGEST_BLOCK, b))


@functools.lru_cache(maxsize=None)
def weights(b: int) -> np.ndarray:
    """Return the ``b`` shared weights ``1 + bits·2**-53`` in ``[1, 2)`` (every block's;
    made once per ``b``, read-only)."""
    w = 1.0 + (bits(0, WEIGHTS, np.arange(b, dtype=np.uint64)) >> np.uint64(11)
               ).astype(np.float64) * _U64
    w.flags.writeable = False
    return w


def checksums(x: np.ndarray, b: int, rows: int = 1 << 10) -> np.ndarray:
    """Return ``(3, ceil(n/b))`` float64: each block's ``Σ w·x``, ``Σ w·|x|`` and ``max |x|``.

    ``x`` is flat, of any float dtype (the last block is zero-padded). Computed
    ``rows`` blocks at a time (one float64 copy of that many blocks), by a
    matrix-vector product: each is a dot product of ``b`` terms, whatever order
    the BLAS sums them in.
    """
    w = weights(b)
    n = x.size
    whole, tail = divmod(n, b)
    out = np.empty((3, whole + (tail > 0)))
    # A non-finite element makes its block's checksums non-finite, which the judge
    # reads as such: no warning for it (nor for a BLAS's stray floating-point flags), and
    # never a raise (np.seterr(all="raise")), here on the caller's thread, before the call
    with np.errstate(all="ignore"):
        for lo in range(0, whole, rows):
            hi = min(whole, lo + rows)
            _sum_blocks(x[lo * b:hi * b].reshape(hi - lo, b), w, out[:, lo:hi])
        if tail:  # the last block, shorter: its missing elements count as zeros
            _sum_blocks(x[whole * b:].reshape(1, tail), w[:tail], out[:, whole:])
    return out


def _sum_blocks(blocks: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
    """Write ``Σ w·x``, ``Σ w·|x|`` and ``max |x|`` of each row of ``blocks`` into ``out``."""
    part = blocks.astype(np.float64)  # (a copy, even of float64: |x| is taken in place)
    np.matmul(part, w, out=out[0])
    np.abs(part, out=part)
    np.matmul(part, w, out=out[1])
    np.maximum.reduce(part, axis=1, out=out[2])


class BadBlock:
    """A block whose output checksum is outside what any conforming order can give."""

    def __init__(self, rank: int, block: int, b: int, n: int, got: float, want: float,
                 allowed: float):
        self.rank, self.block, self.got, self.want, self.allowed = rank, block, got, want, allowed
        self.lo, self.hi = block * b, min(n, (block + 1) * b)

    def __str__(self) -> str:
        return (f"rank {self.rank}'s elements {self.lo}..{self.hi - 1} (block {self.block}): "
                f"their checksum is {self.got!r}, the inputs' is {self.want!r}, and any order "
                f"of a conforming library stays within {self.allowed:.3g} of it")


def judge_sums(inputs: np.ndarray, outputs: np.ndarray, *, p: int, dtype, op: str, b: int,
               n: int | None, factor: float | None = None, ranks=None, full=None) -> list[BadBlock]:
    """Judge output checksums against input checksums; return the blocks that fail.

    ``inputs``: ``(p, 3, blocks)``, each rank's :func:`checksums` of its input (of
    the part reduced into these outputs); ``outputs``: ``(r, 3, blocks)`` of the
    ranks ``ranks`` (default: every rank) holding that reduced part. ``op`` is
    ``sum`` or ``avg``; ``factor`` scales every input first (``premul_sum``, or an
    ``avg`` done as a sum of pre-scaled inputs): one for every rank, or a sequence of
    each rank's own (NCCL's pre-multiplier is each rank's). Blocks whose inputs are not all
    finite, or whose sum may overflow the dtype, are left to the sampled check.
    ``full``: the elements of each block, where the blocks are those of several
    calls side by side (then a bad block's place is the caller's to name).
    """
    u = unit_roundoff(dtype)
    # Each rank's inputs times its factor: Σ_q f_q·c_q, and the scales Σ_q |f_q|·a_q
    f = np.ones((p, 1)) if factor is None else \
        np.broadcast_to(np.asarray(factor, dtype=np.float64).reshape(-1, 1), (p, 1))
    with np.errstate(over="ignore", invalid="ignore"):  # no element can reach overflow
        want = (f * inputs[:, 0]).sum(axis=0)
        scale = (np.abs(f) * inputs[:, 1]).sum(axis=0)  # (scaled by the factors)
        top = (np.abs(f) * inputs[:, 2]).sum(axis=0)  # at least every element's Σ_q |f_q·x_q|
        judged = np.isfinite(scale) & (top * (1 + gamma(p, u)) < _largest(dtype))
    if full is None:
        full = block_elements(n, b)
    scaled = 0.0
    if factor is not None:
        # Each input is multiplied by the factor rounded to the dtype, and the product
        # rounded: 2u of it, and a product among the subnormals is off by up to half their
        # spacing, whatever its size (the weights are below 2).
        scaled = 2.0 * u * scale + p * full * _tiny(dtype)
    allowed = gamma(max(p - 1, 0), u) * scale + scaled
    if op == "avg":
        want, scale = want / p, scale / p
        allowed = gamma(p, u) * scale + 2.0 * full * _tiny(dtype) + scaled / p
    # float64's own roundings: each dot product of b terms, p checksums summed
    with np.errstate(over="ignore", invalid="ignore"):
        rounding = gamma(b, _U64) * (scale + outputs[:, 1].max(axis=0)) \
            + gamma(p, _U64) * scale
        allowed = (allowed + rounding) * _SLACK
    bad = []
    ranks = list(range(outputs.shape[0])) if ranks is None else list(ranks)
    for row, r in zip(outputs, ranks):
        with np.errstate(invalid="ignore", over="ignore"):
            wrong = judged & ~(np.abs(row[0] - want) <= allowed)
        for j in np.flatnonzero(wrong)[:4].tolist():
            bad.append(BadBlock(r, j, b, b * j + int(full[j]), float(row[0, j]), float(want[j]),
                                float(allowed[j])))
    return bad


def block_elements(n: int, b: int) -> np.ndarray:
    """Return the elements of each block of ``b`` of ``n`` (the last may hold fewer)."""
    return np.minimum(b, n - b * np.arange(-(-n // b)))


def smallest_caught(p: int, dtype, mean: float = 1.0) -> float:
    """Return the error of one element that is caught for certain, in a block whose
    elements' ``Σ_q |x_q|`` average ``mean`` (a sum; 1.0: relative to that mean)."""
    b = block_size(p, dtype)
    # w <= 2: the block's scales are at most 2·b·mean, in and out; each checksum rounds.
    per_element = 2.0 * gamma(p, unit_roundoff(dtype)) + 2.0 * gamma(p, _U64) \
        + 4.0 * gamma(b, _U64)
    return b * per_element * mean * _SLACK


def _tiny(dtype) -> float:
    return float(finfo(np.dtype(dtype)).smallest_subnormal)


def _largest(dtype) -> float:
    return float(finfo(np.dtype(dtype)).max)
