"""Small helpers every algorithm shares: workspaces, copies, chunk views."""

from __future__ import annotations

import numpy as np

from ..core.xp import array_namespace, is_device_array
from ..transport.base import transport_cache

__all__ = ["workspace", "copy_into", "same_memory", "overlaps", "view", "receive_into",
           "is_count"]


def workspace(t, count: int, dtype, slot: int = 0) -> np.ndarray:
    """Return a scratch buffer of ``count`` elements, reused across calls on ``t``.

    Receive buffers are allocated once per transport and slot and grown when a
    larger call comes, so a loop of all-reduces touches no fresh pages. ``slot``
    separates buffers one algorithm needs at the same time.
    """
    nbytes = count * np.dtype(dtype).itemsize
    cache = transport_cache(t, "workspace")
    buf = cache.get(slot)
    if buf is None or buf.nbytes < nbytes:
        # Where the transport's buffers live: a device transport names CuPy.
        buf = getattr(t, "array_module", np).empty(max(nbytes, 64), dtype=np.uint8)
        cache[slot] = buf
    return buf[:nbytes].view(dtype)


def same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Return whether two arrays are the same memory (an in-place call)."""
    return a.size == b.size and (a.size == 0 or overlaps(a, b))


def overlaps(a: np.ndarray, b: np.ndarray) -> bool:
    """Return whether two arrays share memory, at a cost that does not grow with their size.

    Host arrays: NumPy's exact answer. Device arrays: whether the byte ranges
    ``[start, end)`` they span meet (``may_share_memory``, bounds alone), as
    CuPy's exact ``shares_memory`` allocates some 32 bytes of device memory per
    element, sorts them and synchronises. The buffers the calls and algorithms
    compare are contiguous, where the two answers agree; of two interleaved
    strided views, the bounds would say they overlap.
    """
    if a.__class__ is np.ndarray or not is_device_array(a):
        return bool(np.shares_memory(a, b))
    return bool(array_namespace(a).may_share_memory(a, b))


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy ``src`` into ``dst`` unless they are already the same memory."""
    if not same_memory(dst, src):
        np.copyto(dst, src)


def view(buf: np.ndarray, bounds, idx: int) -> np.ndarray:
    """Return chunk ``idx`` of ``buf`` as a view: ``buf[start:stop]``."""
    start, stop = bounds[idx]
    return buf[start:stop]


def receive_into(target: np.ndarray, scratch: np.ndarray, *reading: np.ndarray) -> np.ndarray:
    """Return where a step should receive the partial it then reduces into ``target``.

    Straight into ``target`` when none of the buffers the step still reads
    (``reading``: what it sends, the operand it reduces with) overlaps it, as in
    an out-of-place call, whose result is written once per chunk: the incoming
    bytes are then reduced where they landed, in cache, and no scratch buffer is
    written and read again. Otherwise (in place, or a partial reused across
    steps) into ``scratch``. The reduction is the same either way: ``out`` may be
    either operand of an op.
    """
    for buf in reading:
        if np.may_share_memory(target, buf):
            return scratch
    return target


def is_count(value) -> bool:
    """Return whether an option's value is a whole number (a Python or NumPy int, no bool)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
