"""Argument handling every collective shares: flat views, ``out=`` checks, shared errors.

A collective turns its input into a flat contiguous view, checks a user's
``out=`` buffer, refuses overlapping buffers, and makes a bad argument on one
rank an error on every rank before any data moves (:func:`shared_errors`,
:func:`agree_arguments`).
"""

from __future__ import annotations

import contextlib
import functools
import math

import numpy as np

from .. import algorithms
from ..algorithms._util import overlaps
from ..algorithms.registry import REGISTRY
from ..core.chunking import chunk_sizes, chunk_slice
from ..core.errors import MismatchError, UsageError
from ..core.ops import (
    DTYPE_NAMES,
    OPS,
    OPS_ON_EVERY_DTYPE,
    check_supported,
    dtype_name,
    get_dtype,
    get_op,
)
from ..core.xp import address, array_namespace, check_device_dtype
from . import debug
from .agree import agree, agree_key
from .auto import resolve_with_options

__all__ = ["Call", "checked", "flat_input", "flat_out", "check_overlap", "shaped",
           "shared_errors", "argument_fields", "workers_of", "check_root"]


#: The collectives that reduce: ``op`` is theirs to give (``None`` is refused).
_REDUCING = frozenset({"allreduce", "reduce_scatter", "reduce"})


def checked(t, comm, collective: str, x, *, op, root, algorithm: str, out, validate: bool,
            options: dict) -> "Call":
    """Check one call's arguments on this rank and return them as a :class:`Call`.

    The root, op, algorithm and options, the input as a flat view, and
    ``out=`` (or a new result array) in the shape the collective returns,
    refusing buffers that overlap other than in its one in-place layout. A
    check that fails on one rank fails on every rank (:func:`shared_errors`).
    """
    xp = np if x.__class__ is np.ndarray else array_namespace(x)  # a NumPy array: no look-up
    with shared_errors(t, validate, collective):
        if debug.ON[0] is None:  # REFCOLL_DEBUG not read yet, or no level: every rank's error
            debug.check_level()
        if root is not None or collective in ("broadcast", "reduce"):  # root=None: no rank
            check_root(root, t)
        # The registry's and the ops' tables first; their functions name what is wrong.
        if op is None and collective in _REDUCING:
            raise UsageError(f"{collective} reduces: give op= one of {', '.join(OPS)} (or "
                             "mpi4py's MPI.SUM, MPI.PROD, MPI.MIN, MPI.MAX), not None")
        reduction = None if op is None else (OPS.get(op) if op.__class__ is str else None
                                             ) or get_op(op)
        algo = REGISTRY.get(algorithm) if algorithm.__class__ is str else None
        fn = None if algo is None else algo.implementations.get(collective)
        if fn is None:
            algo = algorithms.get(algorithm)
            fn = algorithms.implementation(algorithm, collective)
        if options:
            options = _plain(options)
            algorithms.check_options(algorithm, collective, options, rank=t.rank)
        flat = flat_input(x, t, xp)
        if reduction is not None and reduction.name not in OPS_ON_EVERY_DTYPE:
            check_supported(reduction, flat.dtype)
        arr = xp.asarray(x)
        rank, size, workers = t.rank, t.size, t.size
        if collective == "allreduce":
            workers = workers_of(algo, t, options)
            shape = arr.shape
        elif collective == "reduce_scatter":
            shape = (chunk_sizes(flat.size, size)[rank],)
        elif collective == "allgather":
            shape = (size, *arr.shape)
        else:
            shape = arr.shape
        if rank >= workers or (collective == "reduce" and rank != root):
            result = None  # a switch rank, a reduce's non-root: nothing comes back
        else:
            what = _WHAT.get(collective, collective)
            result = flat_out(out, shape, flat.dtype, t, what, xp)
            if out is not None and out is not arr:  # out=x: the one in-place layout
                check_overlap(flat, result, _in_place(collective, flat, result, rank, size), t,
                              what)
    return Call(t, comm, collective, algorithm, options, validate, reduction,
                0 if root is None else root, arr, flat, result, out, shape, workers, algo, fn)


def _plain(options: dict) -> dict:
    """Return ``options`` with NumPy scalars as the Python values they hold: ``radix=np.int64(3)``
    is ``radix=3`` to every algorithm, and to the agreement, which compares them as text."""
    if not any(isinstance(v, np.generic) for v in options.values()):
        return options
    return {k: v.item() if isinstance(v, np.generic) else v for k, v in options.items()}


#: The collectives as messages name them.
_WHAT = {"allreduce": "all-reduce", "reduce_scatter": "reduce-scatter"}


def _in_place(collective: str, flat, result, rank: int, size: int) -> tuple:
    """Return the two views that may be one buffer: the collective's in-place layout."""
    if collective == "reduce_scatter":  # out= a view of x at chunk r, as NCCL's
        return flat[chunk_slice(flat.size, size, rank)], result
    if collective == "allgather":  # x as row r of out=
        return flat, result[chunk_slice(result.size, size, rank)]
    return flat, result


def flat_input(x, t, xp=None) -> np.ndarray:
    """Return ``x`` as a flat, C-contiguous, native-byte-order array of a supported dtype."""
    if x is None:
        raise UsageError(f"rank {t.rank}: the input is None; pass an array")
    xp = xp or array_namespace(x)
    arr = xp.asarray(x)
    try:
        if arr.dtype not in DTYPE_NAMES:  # a supported native dtype needs no more checks
            get_dtype(arr.dtype)
        if xp is not np:
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
    if out.__class__ is not xp.ndarray:  # a subclass (np.matrix stays 2-D when flattened):
        out = out.view(xp.ndarray)  # the same memory as a plain array
    return out.reshape(-1)


def _same_buffer(a: np.ndarray, b: np.ndarray) -> bool:
    return address(a) == address(b) and a.nbytes == b.nbytes


def check_overlap(data: np.ndarray, out: np.ndarray, allowed: np.ndarray, t, what: str) -> None:
    """Refuse buffers that overlap other than in the one in-place layout ``allowed``.

    A partial overlap would let the algorithm overwrite input it has not read yet.
    ``data`` and ``out`` are contiguous, so on a device the bounds of their bytes
    answer (:func:`~refcoll.algorithms._util.overlaps`: no work on the device).
    """
    if (data.size and out.size and _overlap(data, out)
            and not _same_buffer(*allowed)):
        raise ValueError(f"rank {t.rank}: the input and out= of {what} overlap; pass disjoint "
                         "buffers, or the in-place layout the documentation gives")


def _overlap(a, b) -> bool:
    """Return whether two contiguous arrays share memory (NumPy's answer for host arrays, in
    place; on a device, the bounds of their bytes: :func:`~refcoll.algorithms._util.overlaps`)."""
    return np.shares_memory(a, b) if a.__class__ is np.ndarray else overlaps(a, b)


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
                dtype=DTYPE_NAMES.get(flat.dtype) or dtype_name(flat.dtype), count=flat.size,
                root=root,
                options=sorted(options.items()))


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
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) \
            or not 0 <= root < t.size:  # (root=True is no rank 1)
        raise UsageError(f"rank {t.rank}: root {root!r} is not a rank of this communicator "
                         f"(0..{t.size - 1})")


def _typed(value):
    """An option's value in a signature's key, with its type: ``2``, ``2.0`` and ``True``
    are equal keys of a dict, but not the same arguments (one may be refused)."""
    if isinstance(value, tuple):
        return tuple(_typed(item) for item in value)
    return type(value), value


class Call:
    """One collective call's arguments, checked on this rank: what a plan is made of.

    Built by the public calls (:mod:`refcoll.calls.collectives`) after their
    local checks; run once by :func:`refcoll.calls.collectives.run` or held in a
    :class:`~refcoll.calls.plans.Plan`. ``flat`` and ``result`` are the flat
    views the algorithm works on (``result`` is ``None`` where the call returns
    nothing: a ``reduce``'s non-roots, a switch rank); ``shape`` is the result's.
    ``algo`` and ``fn`` are the algorithm's record and its implementation of the
    collective, as the checks found them.
    """

    __slots__ = ("t", "comm", "collective", "algorithm", "options", "validate", "reduction",
                 "root", "x", "flat", "result", "out", "shape", "workers", "algo", "fn")

    def __init__(self, t, comm, collective: str, algorithm: str, options: dict, validate: bool,
                 reduction, root: int, x, flat, result, out, shape, workers: int, algo=None,
                 fn=None):
        self.t, self.comm, self.collective, self.algorithm = t, comm, collective, algorithm
        self.options, self.validate, self.reduction, self.root = options, validate, reduction, root
        self.x, self.flat, self.result, self.out, self.shape = x, flat, result, out, shape
        self.workers = workers
        self.algo = algo if algo is not None else algorithms.get(algorithm)
        self.fn = fn if fn is not None else algorithms.implementation(algorithm, collective)

    def fields(self) -> dict:
        """Return what every rank must agree on for this call (:func:`argument_fields`), and
        on device memory, the path its messages take (``memory``: the transports cut them
        differently)."""
        memory = getattr(self.t, "memory", None)
        options = self.options if memory is None else {**self.options, "memory": memory}
        return argument_fields(self.collective, self.algorithm, self.reduction, self.flat,
                               options, self.root)

    def agree(self) -> None:
        """Agree on this call with the other ranks (:func:`~refcoll.calls.agree.agree_key`)."""
        options = self.options
        key = (self.collective, self.algorithm,
               "-" if self.reduction is None else self.reduction.name, self.flat.dtype,
               self.flat.size, self.root,
               tuple((name, _typed(options[name])) for name in sorted(options)) if options
               else (), getattr(self.t, "memory", None))
        agree_key(self.t, key, self.fields)

    def chosen(self) -> tuple:
        """Return the algorithm the call runs, its implementation and options, ``auto`` resolved.

        ``auto`` runs what it chose with the options it chose (across nodes,
        hierarchical's ``inter`` and ``pipeline``).
        """
        if not self.algo.chooses:
            return self.algorithm, self.fn, self.options
        name, options = resolve_with_options(self.t, self.collective, self.flat.size,
                                             self.flat.itemsize)
        fn = algorithms.implementation(name, self.collective)
        if options:
            fn = functools.partial(fn, **options)
        return name, fn, options

    def arguments(self) -> tuple:
        """Return the algorithm's positional arguments after ``t`` (the registry's signatures)."""
        if self.collective == "allgather" or self.collective == "broadcast":
            return (self.result,)
        return (self.flat, self.result)

    def keywords(self) -> dict:
        """Return the algorithm's keyword arguments: its options, the op and the root."""
        keywords = dict(self.options) if self.options else {}
        if self.reduction is not None:
            keywords["op"] = self.reduction
        if self.collective == "broadcast" or self.collective == "reduce":
            keywords["root"] = self.root
        return keywords

    def prologue(self) -> None:
        """Put this rank's own data where an in-place algorithm reads it (allgather, broadcast)."""
        if self.collective == "allgather":
            flat, size = self.flat, self.flat.size
            own = self.result[self.t.rank * size:(self.t.rank + 1) * size]
        elif self.collective == "broadcast" and self.t.rank == self.root:
            flat, own = self.flat, self.result
        else:
            return
        if flat.size and not _overlap(own, flat):
            array_namespace(flat).copyto(own, flat)

    def finish(self) -> None:
        """Finish the op on the result (``avg``'s division), after the algorithm."""
        if self.result is not None and self.reduction is not None and self.reduction.divides:
            self.reduction.finalize(self.result, self.workers)

    def output(self):
        """Return what the call returns: ``out=``, or the result in its shape (or None)."""
        if self.result is None:
            return None
        return shaped(self.result, self.out, self.shape)

    def on(self, flat, result) -> "Call":
        """Return the same call on other buffers."""
        return Call(self.t, self.comm, self.collective, self.algorithm, self.options,
                    self.validate, self.reduction, self.root, flat, flat, result, None,
                    self.shape, self.workers, self.algo, self.fn)
