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
import math
import re
import struct

import numpy as np

from ..core.errors import UsageError, reason, shown

__all__ = ["MAX_NPY_HEADER", "read_npy", "npy_header", "stored_dtype"]

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
    shape, fortran, dt, used = npy_header(fh, f)
    if dt.hasobject:
        raise UsageError(f"{f}: holds Python objects (a pickled object array), "
                         "not numbers; save a numeric array")
    if dt.names is not None or dt.subdtype is not None:
        raise UsageError(f"{f}: holds a structured dtype {shown(dt.descr)}, not one type of "
                         "number")
    if dt.itemsize == 0:
        raise UsageError(f"{f}: holds elements of 0 bytes ({dt}), not numbers")
    count = math.prod(shape)
    need, held = count * dt.itemsize, size - used
    if held < need:
        raise UsageError(f"{f}: truncated: its header promises {need} bytes "
                         f"({dt}{list(shape)}), the file holds {held}")
    if held > need:
        raise UsageError(f"{f}: holds {held - need} bytes after its array "
                         "(more than one array written into one file?)")
    try:
        arr = np.empty(count, dtype=dt)
        view, got = arr.view(np.uint8), 0
        while got < need:
            n = fh.readinto(view[got:])
            if not n:
                raise UsageError(f"{f}: truncated while it was read ({got} of {need} bytes)")
            got += n
        arr = arr.reshape(shape[::-1]).T if fortran else arr.reshape(shape)
    except (ValueError, MemoryError) as exc:
        raise UsageError(f"{f}: not a readable .npy file ({reason(exc)})") from None
    if arr.dtype.byteorder not in ("=", "|"):
        arr = arr.astype(arr.dtype.newbyteorder("="))  # same values, this machine's order
    return arr
