"""The ``.npy`` format, read by refcoll itself: one plain array, its size checked first.

A rank file or a vector is NumPy's ``.npy`` (format 1.0, 2.0 or 3.0): the magic
``\\x93NUMPY``, a version, a header length, a Python dict literal of ``descr``,
``fortran_order`` and ``shape``, then the array's bytes. NumPy's own reader trusts the
header; :func:`read_npy` does not. It parses the header with bounded length and digits,
computes the array's bytes in Python's integers (no overflow, whatever the dimensions),
and refuses a file that does not hold exactly those bytes before it allocates anything,
so memory never exceeds what the file holds. Objects (pickles), structured and
zero-size dtypes are refused. Each refusal is one :class:`~refcoll.core.errors.UsageError`
naming the file.

:func:`stored_dtype` is how refcoll stores the dtypes ``.npy`` cannot name (bfloat16,
float8): as the unsigned integers of their width, their bits unchanged.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import math
import os
import re
import struct
import threading

import numpy as np

from ..core.errors import UsageError, reason, shown

__all__ = ["MAX_NPY_HEADER", "read_npy", "npy_header", "stored_dtype", "native_dtype", "NpyFile"]

#: Elements of a sample closer than this many bytes are read as one span (:meth:`NpyFile.take`).
_SPAN_GAP = 4096
#: The most bytes :meth:`NpyFile.take` reads as one span.
_SPAN_MAX = 1 << 20

#: The longest ``.npy`` header refcoll reads (NumPy writes a few hundred bytes, and its
#: own reader stops at this length too).
MAX_NPY_HEADER = 10_000


def stored_dtype(dtype) -> np.dtype:
    """Return how ``dtype`` is stored in ``.npy``: ml_dtypes' types as unsigned bits."""
    dtype = np.dtype(dtype)
    if dtype.kind == "V" or dtype.name.startswith(("bfloat16", "float8")):
        return np.dtype(f"uint{8 * dtype.itemsize}")
    return dtype


def _npy_preamble(fh, f) -> tuple[tuple[int, int], int, int]:
    """Return a ``.npy`` file's ``(version, header length, bytes read)``, checking its magic."""
    start = fh.read(10)
    if not start:
        raise UsageError(f"{f}: is empty (0 bytes), not a .npy file")
    if start.startswith(b"PK"):
        raise UsageError(f"{f}: is an .npz archive, not a .npy file; save each rank's "
                         "array alone with numpy.save")
    if not start.startswith(b"\x93NUMPY"):
        raise UsageError(f"{f}: not a .npy file (it does not start with NumPy's "
                         "\\x93NUMPY header); save each rank's array with numpy.save")
    if len(start) < 10:
        raise UsageError(f"{f}: truncated in its .npy header ({len(start)} bytes)")
    version = (start[6], start[7])
    if version == (1, 0):
        length, used = struct.unpack("<H", start[8:10])[0], 10
    elif version in ((2, 0), (3, 0)):
        more = fh.read(2)
        if len(more) < 2:
            raise UsageError(f"{f}: truncated in its .npy header ({10 + len(more)} bytes)")
        length, used = struct.unpack("<I", start[8:10] + more)[0], 12
    else:
        raise UsageError(f"{f}: its .npy format version {version[0]}.{version[1]} is not one "
                         "refcoll reads (1.0, 2.0 or 3.0)")
    if length > MAX_NPY_HEADER:
        raise UsageError(f"{f}: its .npy header claims {length} bytes, more than the "
                         f"{MAX_NPY_HEADER} refcoll reads (NumPy writes a few hundred)")
    return version, length, used


def _header_dict(raw: bytes, version: tuple[int, int], f) -> dict:
    """Parse a ``.npy`` header's text ``raw``: a dict of exactly descr, fortran_order and shape."""
    if re.search(rb"[0-9]{40}", raw):  # Python would parse it, slowly, beyond any array
        raise UsageError(f"{f}: its .npy header cannot be read (it holds a number of 40 digits "
                         "or more)")
    try:
        header = ast.literal_eval(raw.decode("utf-8" if version == (3, 0) else "latin1"))
    except (UnicodeDecodeError, SyntaxError, MemoryError, RecursionError) as exc:
        raise UsageError(f"{f}: its .npy header cannot be read ({reason(exc)})") from None
    except (ValueError, TypeError):  # a name, a call, an integer of thousands of digits
        raise UsageError(f"{f}: its .npy header cannot be read (it is not a dict of plain "
                         "values: a name, a call or an overlong number)") from None
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise UsageError(f"{f}: its .npy header cannot be read (it must be a dict of descr, "
                         f"fortran_order and shape, not {shown(header)})")
    return header


def npy_header(fh, f) -> tuple[tuple, bool, np.dtype, int]:
    """Parse a ``.npy`` header of any version; return ``(shape, fortran, dtype, its bytes)``."""
    version, length, used = _npy_preamble(fh, f)
    raw = fh.read(length)
    if len(raw) < length:
        raise UsageError(f"{f}: truncated in its .npy header ({len(raw)} of the {length} bytes "
                         "it claims)")
    header = _header_dict(raw, version, f)
    shape, fortran = header["shape"], header["fortran_order"]
    if type(shape) is not tuple or any(type(d) is not int or d < 0 for d in shape):
        raise UsageError(f"{f}: its .npy header cannot be read (shape {shown(shape)} is not "
                         "a tuple of whole numbers, 0 or more)")
    if type(fortran) is not bool:
        raise UsageError(f"{f}: its .npy header cannot be read (fortran_order "
                         f"{shown(fortran)} is not True or False)")
    try:
        dt = np.lib.format.descr_to_dtype(header["descr"])
    except (TypeError, ValueError, KeyError, IndexError, OverflowError, MemoryError,
            RecursionError) as exc:
        raise UsageError(f"{f}: its .npy header cannot be read (descr "
                         f"{shown(header['descr'])}: {reason(exc)})") from None
    return shape, fortran, dt, used + length


#: The most dimensions a rank file's array may have: every NumPy holds 32 (NumPy 2, 64).
MAX_DIMENSIONS = 32


def _checked_header(fh, f, size: int) -> tuple[tuple, bool, np.dtype, int]:
    """Parse a header and check that the file holds exactly its array: :func:`read_npy`'s rules."""
    shape, fortran, dt, used = npy_header(fh, f)
    if dt.hasobject:
        raise UsageError(f"{f}: holds Python objects (a pickled object array), "
                         "not numbers; save a numeric array")
    if dt.names is not None or dt.subdtype is not None:
        raise UsageError(f"{f}: holds a structured dtype {shown(dt.descr)}, not one type of "
                         "number")
    if dt.itemsize == 0:
        raise UsageError(f"{f}: holds elements of 0 bytes ({dt}), not numbers")
    if len(shape) > MAX_DIMENSIONS or (0 in shape and  # (else: more than any file holds)
                                       math.prod(d for d in shape if d) * dt.itemsize >= 2**63):
        raise UsageError(f"{f}: its header's shape ({len(shape)} dimensions, "
                         f"{shown(list(shape))}) is more than a NumPy array holds (at most "
                         f"{MAX_DIMENSIONS} dimensions, and fewer than 2**63 bytes even where "
                         "a dimension is 0)")
    need, held = math.prod(shape) * dt.itemsize, size - used
    if held < need:
        raise UsageError(f"{f}: truncated: its header promises {need} bytes "
                         f"({dt}{list(shape)}), the file holds {held}")
    if held > need:
        raise UsageError(f"{f}: holds {held - need} bytes after its array "
                         "(more than one array written into one file?)")
    return shape, fortran, dt, used


def _fill(fh, view: np.ndarray, f, start: int = 0) -> None:
    """Read ``view``'s bytes from ``fh`` (at its place), refusing a file that ends early."""
    got, need = 0, view.size
    while got < need:
        n = fh.readinto(view[got:])
        if not n:
            raise UsageError(f"{f}: truncated while it was read ({start + got} bytes read)")
        got += n


def native_dtype(dt: np.dtype) -> np.dtype:
    """Return ``dt`` in this machine's byte order (``>f4`` is ``float32`` here)."""
    return dt.newbyteorder("=") if dt.byteorder not in ("=", "|") else dt


def _native(arr: np.ndarray) -> np.ndarray:
    """Return ``arr`` in this machine's byte order (the same values)."""
    if arr.dtype.byteorder not in ("=", "|"):
        return arr.astype(native_dtype(arr.dtype))
    return arr


def read_npy(fh, f, *, size: int) -> np.ndarray:
    """Read one ``.npy`` array from ``fh`` (at its start), refusing what is not one plain array.

    The header may be of format 1.0, 2.0 or 3.0; the array's size is the product of its
    dimensions in Python's integers (no overflow) times the item size, and it must be
    exactly the ``size - header`` bytes the file holds, checked before any allocation,
    so memory never exceeds the file's own size. Objects, structured and subarray
    dtypes are refused; another byte order is converted to this machine's.

    Args:
        fh: a binary file object (a regular file, or a member of an archive).
        f: the file's name, for messages.
        size: the bytes ``fh`` holds from its start.

    Raises:
        UsageError: one line naming ``f`` and the reason.
    """
    shape, fortran, dt, _ = _checked_header(fh, f, size)
    try:
        arr = np.empty(math.prod(shape), dtype=dt)
        _fill(fh, arr.view(np.uint8), f)
        arr = arr.reshape(shape[::-1]).T if fortran else arr.reshape(shape)
    except (ValueError, MemoryError) as exc:
        raise UsageError(f"{f}: not a readable .npy file ({reason(exc)})") from None
    return _native(arr)


class NpyFile:
    """One ``.npy`` file's array, read block by block: its header checked, nothing else read.

    The header and the file's size are held to :func:`read_npy`'s rules when it is
    opened. :meth:`read` returns elements ``lo .. hi-1`` of the array in C order (the
    order of ``reshape(-1)``). The file stays open between blocks, the same file
    whatever is renamed over its name; at most :data:`OPEN_FILES` are open at once
    (a world has up to 4096 ranks), the least recently read closed first and opened
    again, by name, if read again, and refused if its size has changed. :meth:`close`
    closes it (:func:`~refcoll.verify.oracle.check_outputs` does when done, and
    :meth:`whole` after reading). ``dtype`` is how the elements are returned
    (:meth:`as_dtype` views stored bits as ml_dtypes' type); ``stored`` is the file's
    own.
    """

    #: The most rank files held open at once.
    OPEN_FILES = 256
    _open: "collections.OrderedDict[int, NpyFile]" = collections.OrderedDict()
    #: Guards ``_open`` and each file's ``_readers``: the check reads the inputs on one
    #: thread and the outputs on another, and a file one is reading is never closed.
    _lock = threading.Lock()

    def __init__(self, f, opener):
        self.name, self._opener = f, opener
        with opener(f) as fh:
            self._size = os.fstat(fh.fileno()).st_size
            self.shape, self._fortran, self.stored, self._offset = _checked_header(
                fh, f, self._size)
        self.dtype = native_dtype(self.stored)
        self.size = math.prod(self.shape)
        self.ndim = len(self.shape)
        self._fh = None
        self._readers = 0  # reads in progress (never closed meanwhile)

    @contextlib.contextmanager
    def _reading(self):
        """Yield the open file for one read, opening it (and closing the least recently read
        file that no thread is reading) if need be."""
        with NpyFile._lock:
            if self._fh is None:
                idle = [f for f in NpyFile._open.values() if not f._readers]
                for f in idle[:max(0, len(NpyFile._open) + 1 - NpyFile.OPEN_FILES)]:
                    f._close()
                fh = self._opener(self.name)
                if os.fstat(fh.fileno()).st_size != self._size:
                    fh.close()
                    raise UsageError(f"{self.name}: changed while it was read (it held "
                                     f"{self._size} bytes)")
                self._fh = fh
            NpyFile._open[id(self)] = self
            NpyFile._open.move_to_end(id(self))
            self._readers += 1
        try:
            yield self._fh
        finally:
            with NpyFile._lock:
                self._readers -= 1

    def close(self) -> None:
        """Close the file (it is opened again if read again)."""
        with NpyFile._lock:
            self._close()

    def _close(self) -> None:
        NpyFile._open.pop(id(self), None)
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def as_dtype(self, dtype: np.dtype) -> "NpyFile":
        """Return this file read as ``dtype``, which has its elements' width (bits kept)."""
        self.dtype = np.dtype(dtype)
        return self

    def read(self, lo: int = 0, hi: int | None = None, out: np.ndarray | None = None
             ) -> np.ndarray:
        """Return elements ``lo .. hi-1`` (C order, flat; all by default) as ``dtype``,
        read into ``out`` (``hi - lo`` elements of ``dtype``) when given."""
        hi = self.size if hi is None else hi
        if self._fortran and self.ndim > 1:  # C order is not the file's: the block's elements
            block = self.take(np.arange(lo, hi, dtype=np.int64))  # gathered, span by span
            if out is None:
                return block
            out[...] = block
            return out
        into = np.empty(hi - lo, dtype=self.stored) if out is None else out.view(self.stored)
        with self._reading() as fh:
            fh.seek(self._offset + lo * self.stored.itemsize)
            _fill(fh, into.view(np.uint8), self.name, lo * self.stored.itemsize)
        if into.dtype.byteorder not in ("=", "|"):
            native = _native(into).view(self.dtype)
            if out is None:
                return native
            out[...] = native
            return out
        return into.view(self.dtype)

    def take(self, indices: np.ndarray) -> np.ndarray:
        """Return the elements at ``indices`` (sorted places in C order, as :meth:`read`'s)
        as ``dtype``, each read alone: elements a page or more apart cost one seek and read
        each, closer ones are read as one span, so a sample of a file of any size costs
        about one read an element.

        Raises:
            UsageError: an index past the array's end, or a file that ends early.
        """
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and not 0 <= int(indices[0]) <= int(indices[-1]) < self.size:
            raise UsageError(f"{self.name}: holds {self.size} elements; element "
                             f"{int(indices[-1])} was asked for")
        places = indices
        if self._fortran and self.ndim > 1:  # the file holds the array in Fortran order
            places = np.ravel_multi_index(np.unravel_index(indices, self.shape), self.shape,
                                          order="F")
        order = np.argsort(places, kind="stable")
        ranked = places[order]
        width = self.stored.itemsize
        out = np.empty(indices.size, dtype=self.stored)
        with self._reading() as fh:
            for run in _runs(ranked, width):
                first, last = int(ranked[run.start]), int(ranked[run.stop - 1])
                span = np.empty((last - first + 1) * width, dtype=np.uint8)
                fh.seek(self._offset + first * width)
                _fill(fh, span, self.name, first * width)
                out[order[run]] = span.view(self.stored)[ranked[run] - first]
        return _native(out).view(self.dtype)

    def whole(self) -> np.ndarray:
        """Return the whole array in its shape, as ``dtype`` (the file is closed after)."""
        try:
            if self._fortran and self.ndim > 1:  # read in the file's order, in one pass
                with self._opener(self.name) as fh:
                    return read_npy(fh, self.name, size=self._size).view(self.dtype)
            return self.read().reshape(self.shape)
        finally:
            self.close()


def _runs(places: np.ndarray, width: int) -> list:
    """Split sorted ``places`` into runs read as one span each: a run ends where the next
    place is more than :data:`_SPAN_GAP` bytes on, or its span would pass
    :data:`_SPAN_MAX`. Returns each run's positions in ``places`` (a slice)."""
    places = np.asarray(places, dtype=np.int64)
    cuts = (np.flatnonzero(np.diff(places) * width > _SPAN_GAP) + 1).tolist()
    widest = _SPAN_MAX // width  # a run's last place is less than this past its first
    runs = []
    for a, b in zip([0, *cuts], [*cuts, places.size]):  # no gap within: split by span
        while a < b:
            stop = a + int(np.searchsorted(places[a:b], places[a] + widest, side="left"))
            runs.append(slice(a, stop))
            a = stop
    return runs
