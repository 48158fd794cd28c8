"""Block helpers shared by the block-wise compressors (sign, 1-bit, int8, TernGrad).

Each works on NumPy and CuPy arrays alike and returns an array of the input's
kind. NumPy reduces blocks with ``ufunc.reduceat``; on the device the full
blocks are reduced as the rows of a matrix and the short last block apart (a
row reduction is one kernel; ``reduceat`` is not in every CuPy). Maxima are
exact either way; sums may differ from NumPy's in the last bits, as the device
adds in another order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.xp import array_namespace
from .base import Compressor

__all__ = ["Blockwise", "block_starts", "block_lengths", "block_sum", "block_max", "expand"]


@dataclass(frozen=True)
class Blockwise(Compressor):
    """A compressor with one scale per block of ``block`` elements (0: the whole tensor)."""

    block: int = 0

    def __post_init__(self):
        if self.block < 0:
            raise ValueError(f"block must be >= 0 (0: whole tensor), got {self.block}")


def _width(n: int, block: int) -> int:
    """Return the elements in a full block (``block = 0``: the whole tensor)."""
    return block if block > 0 else max(n, 1)


def block_starts(n: int, block: int) -> np.ndarray:
    """Return the first index of each block; ``block = 0`` means one block of ``n``."""
    return np.arange(0, n, _width(n, block))


def block_lengths(n: int, block: int, xp=np):
    """Return each block's length (the last may be shorter), as an array of ``xp``."""
    if xp is np:
        starts = block_starts(n, block)
        return np.diff(np.append(starts, n))
    width = _width(n, block)
    count = -(-n // width)
    lengths = xp.full(count, width, dtype=np.int64)
    if count:
        lengths[-1] = n - (count - 1) * width
    return lengths


def _device_blocks(values, block: int, how: str):
    """Reduce each block on the device: full blocks as matrix rows, then the short last one."""
    xp = array_namespace(values)
    n = values.size
    width = _width(n, block)
    full = n // width * width
    parts = []
    if full:
        parts.append(getattr(values[:full].reshape(-1, width), how)(axis=1))
    if full < n:
        parts.append(getattr(values[full:], how)(keepdims=True))
    return parts[0] if len(parts) == 1 else xp.concatenate(parts)


def block_sum(values, block: int):
    """Return the sum over each block (an empty array when there are no elements)."""
    if values.size == 0:
        return values[:0].copy()
    if array_namespace(values) is np:
        return np.add.reduceat(values, block_starts(values.size, block))
    return _device_blocks(values, block, "sum")


def block_max(values, block: int):
    """Return the maximum over each block."""
    if values.size == 0:
        return values[:0].copy()
    if array_namespace(values) is np:
        return np.maximum.reduceat(values, block_starts(values.size, block))
    return _device_blocks(values, block, "max")


def expand(per_block, n: int, block: int):
    """Return ``per_block`` repeated over each block's elements (length ``n``)."""
    xp = array_namespace(per_block)
    if xp is np:
        return np.repeat(per_block, block_lengths(n, block))
    # Every block but the last is full: repeat by the full width and cut the tail.
    return xp.repeat(per_block, _width(n, block))[:n]
