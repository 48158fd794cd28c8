"""Compare arrays bit for bit: equality, the count of wrong elements, the first difference.

The one home of refcoll's bit comparisons: the benchmark's check of every result, the
conformance battery's verdicts and the golden vectors' check all read bits through here.
Elements are compared as they lie in memory, each as an unsigned integer of its own
width, so NaN payloads, signed zeros and ml_dtypes' types (bfloat16, float8) compare
like any other bits and no value is ever converted.

Two messages describe a difference, because two reports print one:

- :func:`first_difference` — the conformance battery's
  ``element 3 is 7.0, expected 8.0 (2 of 10 differ)``;
- :func:`first_bit_difference` — the golden vectors' check, which shows the bit patterns
  and names what the result is compared with:
  ``element 3 is 7.0 (0x40e00000), the simulator gives 8.0 (0x41000000); 2 elements differ``.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "complement",
    "count_wrong",
    "differing",
    "first_bit_difference",
    "first_difference",
    "same_bits",
]


def _words(a: np.ndarray) -> np.ndarray:
    """Return ``a``'s elements, flat, each as an unsigned integer of its width (a view)."""
    a = np.ascontiguousarray(a).reshape(-1)
    return a.view(f"u{a.dtype.itemsize}")


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Return whether ``a`` and ``b`` have the same dtype, shape and bytes (NaN payloads too)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = np.ascontiguousarray(a).reshape(-1), np.ascontiguousarray(b).reshape(-1)
    if a.dtype.hasobject:
        return a.tobytes() == b.tobytes()
    a, b = a.view(np.uint8), b.view(np.uint8)
    whole = a.size - a.size % 8  # compared 8 bytes at a time, the tail byte by byte
    return bool(np.array_equal(a[:whole].view(np.uint64), b[:whole].view(np.uint64))
                and np.array_equal(a[whole:], b[whole:]))


def count_wrong(got: np.ndarray, expected: np.ndarray) -> int:
    """Return how many elements of ``got`` differ bit for bit from ``expected``.

    A result of the wrong size or element width is wrong in every element.
    """
    want = np.ascontiguousarray(expected).reshape(-1)
    have = np.ascontiguousarray(got).reshape(-1)
    if have.size != want.size or have.dtype.itemsize != want.dtype.itemsize:
        return int(want.size)
    if want.size == 0:
        return 0
    return int(np.count_nonzero(_words(have) != _words(want)))


def complement(expected: np.ndarray) -> np.ndarray:
    """Return an array whose every element differs from ``expected`` in every bit."""
    return np.invert(_words(expected)).view(expected.dtype)


def differing(got: np.ndarray, want: np.ndarray, *, nans_alike: bool = False) -> np.ndarray:
    """Return the flat indices at which same-sized ``got`` and ``want`` differ in any bit.

    ``nans_alike``: a NaN matches any NaN. IEEE 754 leaves which operand's NaN an
    arithmetic operation returns, and its sign, to the machine (NumPy's vector and
    scalar loops may pick differently, by where an element falls), so the bits of a
    reduction's NaN are no part of its order.
    """
    found = np.flatnonzero(_words(got) != _words(want))
    if nans_alike and found.size:
        have, expected = got.reshape(-1)[found], want.reshape(-1)[found]
        try:
            found = found[~(np.isnan(have) & np.isnan(expected))]
        except TypeError:  # integers: no NaN
            pass
    return found


def first_difference(got: np.ndarray, want: np.ndarray) -> str:
    """Describe the first element of ``got`` whose bits differ from ``want``'s.

    The conformance battery's format: ``element i is G, expected W (k of n differ)``.
    ``got`` and ``want`` hold the same number of elements of one dtype.
    """
    differs = differing(got, want)
    if not len(differs):
        return f"no element differs ({got.size} compared)"
    i = int(differs[0])
    return (f"element {i} is {got.reshape(-1)[i]!r}, expected {want.reshape(-1)[i]!r} "
            f"({len(differs)} of {got.size} differ)")


def first_bit_difference(have: np.ndarray, want: np.ndarray, *,
                         reference: str = "the simulator") -> str:
    """Describe where two arrays' bits first differ, or their dtypes and shapes.

    The golden vectors' format, bit patterns in hex:
    ``element i is H (0x..), <reference> gives W (0x..); k elements differ``; arrays of
    different dtype or shape: ``holds float32[4], <reference> gives float32[5]``.
    """
    if have.shape != want.shape or have.dtype != want.dtype:
        return (f"holds {have.dtype}{list(have.shape)}, "
                f"{reference} gives {want.dtype}{list(want.shape)}")
    differs = differing(have, want)
    if not len(differs):
        return f"no element differs from what {reference} gives"
    i = int(differs[0])
    bits_have, bits_want = _words(have), _words(want)
    return (f"element {i} is {have.reshape(-1)[i]!r} (0x{int(bits_have[i]):x}), {reference} "
            f"gives {want.reshape(-1)[i]!r} (0x{int(bits_want[i]):x}); "
            f"{len(differs)} element{' differs' if len(differs) == 1 else 's differ'}")
