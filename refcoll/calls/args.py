"""Argument handling every collective shares: flat views, ``out=`` checks, shared errors.

A collective turns its input into a flat contiguous view, checks a user's
``out=`` buffer, refuses overlapping buffers, and makes a bad argument on one
rank an error on every rank before any data moves (:func:`shared_errors`,
:func:`agree_arguments`).
"""

from __future__ import annotations

import contextlib
import math

import numpy as np

from ..core.errors import MismatchError, UsageError
from ..core.ops import dtype_name, get_dtype
from ..core.xp import array_namespace, check_device_dtype, is_device_array
from .agree import agree

__all__ = ["flat_input", "flat_out", "check_overlap", "shaped", "shared_errors",
           "agree_arguments", "argument_fields", "workers_of", "check_root"]


def flat_input(x, t) -> np.ndarray:
    """Return ``x`` as a flat, C-contiguous, native-byte-order array of a supported dtype."""
    xp = array_namespace(x)
    arr = xp.asarray(x)
    try:
        get_dtype(arr.dtype)
        check_device_dtype(arr.dtype, xp)
    except UsageError as exc:
        raise UsageError(f"rank {t.rank}: {exc}") from None
    if not arr.dtype.isnative:
        raise TypeError(
            f"rank {t.rank}: input has non-native byte order ({arr.dtype.str}); convert it "
            "with x.astype(x.dtype.newbyteorder('=')) so every rank sends the same bytes"
        )
    return xp.ascontiguousarray(arr).reshape(-1)


def flat_out(out, shape, dtype, t, what: str, xp=np) -> np.ndarray:
    """Check a user's ``out=`` buffer and return it as a flat view (new ones in ``xp``)."""
    count = math.prod(shape)
    if out is None:
        return xp.empty(count, dtype=dtype)
    if not isinstance(out, xp.ndarray):
        raise TypeError(f"rank {t.rank}: out= must be a {xp.__name__} array like the input, "
                        f"got {type(out).__name__}")
    if out.dtype != dtype:
        raise TypeError(f"rank {t.rank}: out= has dtype {out.dtype}, the {what} needs {dtype}")
    if out.size != count:
        raise ValueError(f"rank {t.rank}: out= has {out.size} elements, the {what} needs "
                         f"{count} (shape {tuple(shape)})")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"rank {t.rank}: out= must be a writeable C-contiguous array")
    return out.reshape(-1)


def _address(a) -> int:
    return a.data.ptr if is_device_array(a) else a.__array_interface__["data"][0]


def _same_buffer(a: np.ndarray, b: np.ndarray) -> bool:
    return _address(a) == _address(b) and a.nbytes == b.nbytes


def check_overlap(data: np.ndarray, out: np.ndarray, allowed: np.ndarray, t, what: str) -> None:
    """Refuse buffers that overlap other than in the one in-place layout ``allowed``.

    A partial overlap would let the algorithm overwrite input it has not read yet.
    """
    if (data.size and out.size and array_namespace(data).shares_memory(data, out)
            and not _same_buffer(*allowed)):
        raise ValueError(f"rank {t.rank}: the input and out= of {what} overlap; pass disjoint "
                         "buffers, or the in-place layout the documentation gives")


def shaped(flat: np.ndarray, out, shape) -> np.ndarray:
    return out if out is not None else flat.reshape(shape)


class _SharedErrors:
    """Make a bad argument on one rank an error on every rank, before any data moves.

    A rank whose arguments fail its local checks still takes part in the
    argument agreement, carrying its error, so the other ranks raise too instead
    of waiting for it; it then raises its own exception.
    """

    def __init__(self, t, collective: str):
        self.t, self.collective = t, collective

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, traceback) -> bool:
        if isinstance(exc, (TypeError, ValueError)) and not isinstance(exc, MismatchError):
            with self.t.call(self.collective):
                agree(self.t, collective=self.collective, error=f"{type(exc).__name__}: {exc}")
        return False


#: Without validation (or on one rank) an error is raised where it happens, alone.
_LOCAL_ERRORS = contextlib.nullcontext()


def shared_errors(t, validate: bool, collective: str):
    """Return the context in which a call checks its arguments (see :class:`_SharedErrors`)."""
    if validate and t.size > 1:
        return _SharedErrors(t, collective)
    return _LOCAL_ERRORS


def argument_fields(collective: str, algorithm: str, op, flat, options, root: int = 0) -> dict:
    """Return what every rank must agree on for one call: the fields of its record."""
    return dict(collective=collective, algorithm=algorithm, op=op.name if op else "-",
                dtype=dtype_name(flat.dtype), count=flat.size, root=root,
                options=sorted(options.items()))


def agree_arguments(t, validate: bool, collective: str, algorithm: str, op, flat, options,
           root: int = 0) -> None:
    if validate:
        agree(t, **argument_fields(collective, algorithm, op, flat, options, root))


def workers_of(algo, t, options) -> int:
    """Return how many of ``t``'s ranks hold data for ``algo`` (all, unless it has switches)."""
    if algo.workers is None:
        return t.size
    workers = algo.workers(t.size, **options)
    if workers < 1:
        raise UsageError(f"rank {t.rank}: {algo.name} needs worker and switch processes; "
                         f"{t.size} ranks are too few (try more ranks)")
    return workers


def check_root(root: int, t) -> None:
    if not isinstance(root, (int, np.integer)) or not 0 <= root < t.size:
        raise UsageError(f"rank {t.rank}: root {root!r} is not a rank of this communicator "
                         f"(0..{t.size - 1})")
