"""Block helpers shared by the block-wise compressors (sign, 1-bit, int8, TernGrad)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import Compressor

__all__ = ["Blockwise", "block_starts", "block_lengths", "block_sum", "block_max", "expand"]


@dataclass(frozen=True)
class Blockwise(Compressor):
    """A compressor with one scale per block of ``block`` elements (0: the whole tensor)."""

    block: int = 0

    def __post_init__(self):
        if self.block < 0:
            raise ValueError(f"block must be >= 0 (0: whole tensor), got {self.block}")


def block_starts(n: int, block: int) -> np.ndarray:
    """Return the first index of each block; ``block = 0`` means one block of ``n``."""
    return np.arange(0, n, block if block > 0 else max(n, 1))


def block_lengths(n: int, block: int) -> np.ndarray:
    """Return each block's length (the last may be shorter)."""
    starts = block_starts(n, block)
    return np.diff(np.append(starts, n))


def block_sum(values: np.ndarray, block: int) -> np.ndarray:
    """Return the sum over each block (an empty array when there are no elements)."""
    if values.size == 0:
        return values[:0].copy()
    return np.add.reduceat(values, block_starts(values.size, block))


def block_max(values: np.ndarray, block: int) -> np.ndarray:
    """Return the maximum over each block."""
    if values.size == 0:
        return values[:0].copy()
    return np.maximum.reduceat(values, block_starts(values.size, block))


def expand(per_block: np.ndarray, n: int, block: int) -> np.ndarray:
    """Return ``per_block`` repeated over each block's elements (length ``n``)."""
    return np.repeat(per_block, block_lengths(n, block))
