"""Reduction operations and the data types they run on.

Every local reduction in refcoll goes through :func:`Op.apply`, a pure function
over arrays, so the simulator and the MPI run compute the same bits.

Ops:

* ``sum``, ``prod``, ``min``, ``max``: elementwise, with NumPy's semantics in the
  buffer's own dtype. Each combination rounds once (float16, bfloat16 and float8
  included: ml_dtypes rounds every operation to the type). Integers wrap around
  on overflow, as NumPy does. ``min``/``max`` propagate NaN (``np.minimum``).
* ``avg``: the **sum, in the algorithm's reduction order, then divided by p** on
  every rank.

  - floats: one rounded division ``sum / p`` in the dtype. NCCL instead
    pre-multiplies every input by ``1/p`` before summing (its ``PreMulSum``), so
    its bits can differ from refcoll's when ``p`` is not a power of two.
  - integers: the wrapped integer sum, then division **truncating toward zero**
    (C's ``/``, which is what NCCL's ``SumPostDiv`` computes for integers):
    ``-7`` averaged over 2 ranks is ``-3``, not ``-4``.

Wherever an op is asked for, mpi4py's ``MPI.SUM``, ``MPI.PROD``, ``MPI.MIN`` and
``MPI.MAX`` stand for ``sum``, ``prod``, ``min`` and ``max``; MPI's other ops
(``MPI.BAND``, ``MPI.MAXLOC``...) have no counterpart here and are refused.

IEEE's results whatever the caller's NumPy error state: an overflow gives ``inf``
and an ``inf - inf`` gives NaN on every rank, with no error and no warning, even
under ``np.seterr(all="raise")`` or ``python -W error``, either of which would
otherwise raise on the one rank whose partial overflowed while the others waited
for it (:func:`combine`, and the average's division).

Types: int8..uint64, float16, bfloat16, float32, float64 for every op; the two
OCP float8 formats (``float8_e4m3fn``, ``float8_e5m2``) for sum, min and max only,
since a product or average of 3-bit mantissas is rarely what anyone means.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .errors import UsageError

__all__ = [
    "Op",
    "combine",
    "by_ieee_rules",
    "OPS",
    "DTYPES",
    "DTYPE_NAMES",
    "OPS_ON_EVERY_DTYPE",
    "get_op",
    "MPI_OPS",
    "get_dtype",
    "dtype_name",
    "check_supported",
    "supports",
    "is_float",
    "is_integer",
    "unit_roundoff",
    "exact_integer_limit",
    "finfo",
    "ML_DTYPE_NAMES",
]


def _trunc_divide(buf: np.ndarray, p: int) -> None:
    """Divide an integer buffer by ``p > 0`` in place, truncating toward zero."""
    if buf.dtype.kind == "u":
        np.floor_divide(buf, p, out=buf)
        return
    # Floor division is one below truncation exactly where a negative value
    # does not divide evenly; fix those elements up afterwards.
    round_up = (buf < 0) & (np.remainder(buf, p) != 0)
    np.floor_divide(buf, p, out=buf)
    np.add(buf, round_up, out=buf, casting="unsafe")


try:  # NumPy 2's error state is a context variable; setting it directly costs 0.2 us where
    # np.errstate costs 1 us (a reduction of 8 bytes takes 0.4 us)
    from numpy._core._ufunc_config import _extobj_contextvar as _ERROR_STATE
    with np.errstate(all="ignore"):
        _IGNORE_ALL = _ERROR_STATE.get()
except ImportError:  # another layout: np.errstate itself
    _ERROR_STATE = _IGNORE_ALL = None


def combine(ufunc, a, b, out) -> None:
    """``ufunc(a, b, out=out)`` by IEEE's rules whatever the caller's NumPy error state.

    Every floating-point error is ignored: an overflow gives ``inf`` and ``inf - inf``
    NaN with no ``FloatingPointError`` (``np.seterr(all="raise")``) and no warning
    (which ``python -W error`` or pytest's ``filterwarnings = error`` would raise),
    so no rank leaves a collective half done while the others wait for it.
    """
    if _ERROR_STATE is None:
        with np.errstate(all="ignore"):
            ufunc(a, b, out=out)
        return
    token = _ERROR_STATE.set(_IGNORE_ALL)
    try:
        ufunc(a, b, out=out)
    finally:
        _ERROR_STATE.reset(token)


def by_ieee_rules(fn):
    """Run ``fn`` with every NumPy floating-point error ignored (:func:`combine`'s rule for
    a whole step of local arithmetic: a compressor's, a gradient's scaling)."""
    @functools.wraps(fn)
    def ruled(*args, **kwargs):
        with np.errstate(all="ignore"):
            return fn(*args, **kwargs)
    return ruled


@dataclass(frozen=True)
class Op:
    """A reduction operation: ``combine`` for two operands, ``finalize`` at the end.

    Attributes:
        name: the name users pass (``"sum"``...).
        ufunc: the NumPy ufunc that combines two operands elementwise.
        divides: whether the result is divided by the number of ranks (``avg``).
    """

    name: str
    ufunc: np.ufunc
    divides: bool = False

    def apply(self, a, b, out) -> None:
        """Compute ``out = a (op) b`` elementwise; ``out`` may be ``a`` or ``b``."""
        combine(self.ufunc, a, b, out)

    def finalize(self, buf, p: int) -> None:
        """Turn a complete reduction into the op's result, in place (``avg``: / p)."""
        if not self.divides or buf.size == 0:
            return
        with np.errstate(all="ignore"):  # (an underflow to 0 is IEEE's result: no raise)
            self._divide(buf, p)

    def _divide(self, buf, p: int) -> None:
        """Divide a complete sum by ``p`` in place (see :meth:`finalize`)."""
        if is_integer(buf.dtype):
            if p > np.iinfo(buf.dtype).max:  # p does not fit the type: divide in int64
                wide = buf.astype(np.int64)  # (|sum| <= p: 0, or -1 where a signed sum is
                buf[...] = np.sign(wide) * (np.abs(wide) // p)  # the least value, p = -min)
            else:
                _trunc_divide(buf, p)
        elif buf.dtype == np.float64:
            np.divide(buf, p, out=buf)
        else:
            # Divide in float64 and round once to the dtype: float64 has more than
            # 2m+2 bits for every smaller format's m, so this double rounding is
            # the correctly rounded quotient (and p itself is never rounded).
            buf[...] = (buf.astype(np.float64) / p).astype(buf.dtype)

    def __str__(self) -> str:
        return self.name


OPS: dict[str, Op] = {
    "sum": Op("sum", np.add),
    "prod": Op("prod", np.multiply),
    "min": Op("min", np.minimum),
    "max": Op("max", np.maximum),
    "avg": Op("avg", np.add, divides=True),
}

#: The types ml_dtypes adds to NumPy, by refcoll's name (which is NumPy's ``dtype.name``).
#: NumPy knows them only once ml_dtypes is imported, and that takes about half a
#: second (its extension registers every cast between its types), so refcoll imports
#: it on first need: a name asked for, or a value of one of these types (which only
#: exists once something imported ml_dtypes).
ML_DTYPE_NAMES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")

#: NumPy's own supported types, by name.
_NUMPY_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                 "float16", "float32", "float64")
}

#: Every supported type's name, in the order refcoll lists them.
_NAMES = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
          "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2")

_ML: dict[str, np.dtype] = {}  # ml_dtypes' types by name, once imported

#: Each supported dtype's name, by dtype: a plain dict (a look-up costs no call where a
#: call's arguments are checked), NumPy's types from the start and ml_dtypes' added when
#: it is imported (:func:`_ml_dtypes`; before, no value can have one of its types).
DTYPE_NAMES: dict[np.dtype, str] = {dt: name for name, dt in _NUMPY_DTYPES.items()}


def _ml_dtypes() -> dict[str, np.dtype]:
    """Return ml_dtypes' types by name, importing ml_dtypes the first time."""
    if not _ML:
        import ml_dtypes  # heavy: half a second, so only when one of its types is needed

        found = {name: np.dtype(getattr(ml_dtypes, name)) for name in ML_DTYPE_NAMES}
        DTYPE_NAMES.update({dt: name for name, dt in found.items()})
        _ML.update(found)
    return _ML


class _Dtypes(Mapping):
    """Every supported dtype by name (:data:`DTYPES`): ml_dtypes' made on first use."""

    def __getitem__(self, name: str) -> np.dtype:
        dt = _NUMPY_DTYPES.get(name)
        if dt is None:
            if name not in ML_DTYPE_NAMES:
                raise KeyError(name)
            dt = _ml_dtypes()[name]
        return dt

    def __contains__(self, name) -> bool:
        return name in _NAMES

    def __iter__(self):
        return iter(_NAMES)

    def __len__(self) -> int:
        return len(_NAMES)

    def __repr__(self) -> str:
        return f"DTYPES({', '.join(_NAMES)})"


#: Every supported dtype, by name (ml_dtypes' imported on first use of one of them).
DTYPES = _Dtypes()

_FLOAT8 = ("float8_e4m3fn", "float8_e5m2")
_FLOAT8_OPS = {"sum", "min", "max"}

#: The ops every supported dtype takes (:func:`check_supported` refuses the others on float8).
OPS_ON_EVERY_DTYPE = frozenset(_FLOAT8_OPS)

_FLOATS = ("float16", "bfloat16", "float32", "float64", *_FLOAT8)


def _as_dtype(dtype) -> np.dtype:
    """Return ``dtype`` (a dtype, a type or a name) as a NumPy dtype; ml_dtypes' names too."""
    if isinstance(dtype, str) and dtype in ML_DTYPE_NAMES:
        return _ml_dtypes()[dtype]
    return np.dtype(dtype)


def _name_of(dt: np.dtype) -> str | None:
    """Return refcoll's name of the supported dtype ``dt``, or None."""
    name = DTYPE_NAMES.get(dt)
    if name is None and not _ML and "ml_dtypes" in sys.modules:  # imported by someone else
        _ml_dtypes()
        name = DTYPE_NAMES.get(dt)
    return name


#: mpi4py's predefined reductions refcoll has, by their name in mpi4py.MPI.
MPI_OPS = {"SUM": "sum", "PROD": "prod", "MIN": "min", "MAX": "max"}

#: mpi4py's other predefined ops, named in the error that refuses them.
_OTHER_MPI_OPS = ("LAND", "LOR", "LXOR", "BAND", "BOR", "BXOR", "MAXLOC", "MINLOC",
                  "REPLACE", "NO_OP", "OP_NULL")


def _mpi_op_name(op) -> str | None:
    """Return ``"SUM"``, ``"BAND"``... for one of mpi4py's predefined ops, ``""`` for a
    user-defined ``MPI.Op``, and None for anything that is not an ``MPI.Op``.

    mpi4py is not imported here: an ``MPI.Op`` can only exist once it has been.
    """
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not isinstance(op, mpi.Op):
        return None
    for name in (*MPI_OPS, *_OTHER_MPI_OPS):
        predefined = getattr(mpi, name, None)
        if predefined is not None and op == predefined:
            return name
    return ""


def _type_name(value) -> str:
    kind = type(value)
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"


def get_op(op: "str | Op") -> Op:
    """Return the :class:`Op` for a name, an :class:`Op` or an mpi4py op.

    mpi4py's ops are ``MPI.SUM``, ``MPI.PROD``, ``MPI.MIN`` and ``MPI.MAX``.

    Raises:
        UsageError: an unknown name, another MPI op (``MPI.BAND``...), or any
            other object; the message names it and the ops refcoll takes.
    """
    if isinstance(op, Op):
        return op
    choices = ", ".join(OPS)
    if isinstance(op, str):
        try:
            return OPS[op.lower()]
        except KeyError:
            raise UsageError(f"unknown op {op!r}: choose one of {choices}") from None
    mpi_name = _mpi_op_name(op)
    if mpi_name in MPI_OPS:
        return OPS[MPI_OPS[mpi_name]]
    if mpi_name is not None:
        what = f"op MPI.{mpi_name}" if mpi_name else "a user-defined MPI.Op"
        raise UsageError(f"{what} is not an op refcoll reduces with: pass one of {choices} "
                         f"(or MPI.{', MPI.'.join(MPI_OPS)})")
    raise UsageError(f"op takes a name; got an object of type {_type_name(op)}: pass one of "
                     f"{choices} (or MPI.{', MPI.'.join(MPI_OPS)})")


def get_dtype(dtype) -> np.dtype:
    """Return the NumPy dtype for a name or dtype; raise :class:`UsageError` if unsupported."""
    if isinstance(dtype, str):
        key = dtype.lower()
        if key in DTYPES:
            return DTYPES[key]
        raise UsageError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise UsageError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}") from None
    native = dt.newbyteorder("=") if dt.byteorder not in ("=", "|") else dt
    if _name_of(native) is None:
        raise UsageError(f"unsupported dtype {dt}: choose one of {', '.join(DTYPES)}")
    return dt


def dtype_name(dtype) -> str:
    """Return refcoll's name for a supported dtype (``bfloat16``, ``float32``...)."""
    dt = _as_dtype(dtype)
    return _name_of(dt) or str(dt)


def is_float(dtype) -> bool:
    """Return whether ``dtype`` is one of the floating types (ml_dtypes' included)."""
    return _name_of(_as_dtype(dtype)) in _FLOATS


def is_integer(dtype) -> bool:
    """Return whether ``dtype`` is a signed or unsigned integer type."""
    return _as_dtype(dtype).kind in "iu"


def check_supported(op: Op, dtype) -> None:
    """Raise :class:`UsageError` when ``op`` is not defined on ``dtype``."""
    dt = _as_dtype(dtype)
    if _name_of(dt) in _FLOAT8 and op.name not in _FLOAT8_OPS:
        raise UsageError(
            f"op {op.name!r} is not supported on {dtype_name(dt)}: float8 supports "
            f"{', '.join(sorted(_FLOAT8_OPS))}"
        )


def supports(op, dtype) -> bool:
    """Return whether ``op`` (a name or :class:`Op`; ``None``: no op) is defined on ``dtype``."""
    if op is None:
        return True
    try:
        check_supported(get_op(op), get_dtype(dtype))
    except UsageError:
        return False
    return True


def finfo(dtype):
    """Return the machine limits of a float type: NumPy's ``finfo``, ml_dtypes' for its types."""
    return _finfo(_as_dtype(dtype))


@functools.lru_cache(maxsize=None)
def _finfo(dt: np.dtype):
    """:func:`finfo` of a dtype, kept: a judge asks for it several times a call."""
    if dt.name in ML_DTYPE_NAMES:
        _ml_dtypes()  # the one place that imports it (already imported: a value of it exists)
        return sys.modules["ml_dtypes"].finfo(dt)
    return np.finfo(dt)


def unit_roundoff(dtype) -> float:
    """Return the unit roundoff ``u = 2**-(mantissa bits + 1)`` of a float type."""
    return float(finfo(dtype).eps) / 2.0


def exact_integer_limit(dtype) -> int:
    """Return the largest ``M`` such that every integer in ``[-M, M]`` is exact in ``dtype``."""
    dt = _as_dtype(dtype)
    if is_integer(dt):
        return int(np.iinfo(dt).max)
    info = finfo(dt)
    return min(2 ** (info.nmant + 1), int(float(info.max)))
