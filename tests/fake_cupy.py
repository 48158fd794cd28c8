"""A stand-in for the part of CuPy refcoll uses, built on NumPy, for machines without a GPU.

"Device" arrays are :class:`ndarray` objects wrapping a NumPy array that behave
as CuPy's do where it matters to refcoll:

* they refuse to mix with NumPy arrays: an operation, ufunc or NumPy function
  given one of each raises ``TypeError``, and ``np.asarray`` on one raises as
  CuPy's implicit conversion does, so a host copy that the code did not ask for
  fails a test instead of passing unnoticed;
* NumPy's functions and ufuncs dispatch to them (``np.add(a, b, out=c)``);
* every copy between host and device is counted in :data:`stats`, with whether
  the host side was pinned memory from :func:`cuda.alloc_pinned_memory`;
* functions differ from NumPy's where CuPy's do (``unpackbits`` has no
  ``count``, ``repeat`` takes no array of repeats) and bfloat16 exists only
  when ``stats.bfloat16`` says so (CuPy >= 14 with ml_dtypes); float8 never;
* ``shares_memory`` (also as ``np.shares_memory``, which CuPy dispatches to its
  own) counts in :data:`stats`: CuPy's exact test runs kernels over every
  element and synchronises, where ``may_share_memory`` compares bounds alone.

:func:`install` puts the module and its submodules (``cupy.cuda``,
``cupy.cuda.runtime``, ``cupy.cuda.nccl``, ``cupy.random``, ``cupy.linalg``)
into ``sys.modules``; :func:`reset` starts the counters again. Streams and
events keep no order (every copy happens at once) but count synchronisations.
The NCCL communicator records its calls and, on one rank, copies send to receive.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
import types
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

__version__ = "0.0+fake"


@dataclass
class Stats:
    """What the fake saw since the last :func:`reset`, and its settings."""

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    h2d_pinned_bytes: int = 0
    d2h_pinned_bytes: int = 0
    h2d_copies: int = 0
    d2h_copies: int = 0
    scalar_reads: int = 0
    pinned_allocations: int = 0
    stream_syncs: int = 0
    exact_overlap_checks: int = 0
    device_count: int = 1
    device_in_use: int | None = None
    bfloat16: bool = False
    nccl_calls: list = field(default_factory=list)


stats = Stats()
_pinned: list[tuple[int, int, bytearray]] = []


#: What CUDA keeps per host thread: the current device and stream.
_current = threading.local()


def reset(**settings) -> Stats:
    """Forget every count, pinned buffer and this thread's device and stream; apply
    ``settings`` (``device_count=0``...)."""
    global stats
    stats = Stats(**settings)
    _pinned.clear()
    _current.__dict__.clear()
    return stats


def _address(host: np.ndarray) -> int:
    return host.__array_interface__["data"][0]


def _is_pinned(host: np.ndarray) -> bool:
    start = _address(host)
    return any(lo <= start and start + host.nbytes <= hi for lo, hi, _ in _pinned)


def _count(direction: str, host: np.ndarray) -> None:
    nbytes = host.nbytes
    setattr(stats, f"{direction}_bytes", getattr(stats, f"{direction}_bytes") + nbytes)
    setattr(stats, f"{direction}_copies", getattr(stats, f"{direction}_copies") + 1)
    if _is_pinned(host):
        name = f"{direction}_pinned_bytes"
        setattr(stats, name, getattr(stats, name) + nbytes)


def _check_dtype(dtype: np.dtype) -> None:
    if dtype in (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)) or (
            dtype == np.dtype(ml_dtypes.bfloat16) and not stats.bfloat16):
        raise TypeError(f"Unsupported dtype {dtype}")


def _unwrap(obj, where: str):
    if isinstance(obj, ndarray):
        return obj._a
    if isinstance(obj, np.ndarray):
        raise TypeError(f"Unsupported type {type(obj)} in {where}: a NumPy array cannot be "
                        "mixed with device arrays")
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unwrap(o, where) for o in obj)
    return obj


def _unwrap_kwargs(kwargs: dict, where: str) -> dict:
    return {k: _unwrap(v, where) for k, v in kwargs.items()}


def _wrap(result):
    if isinstance(result, np.ndarray):
        _check_dtype(result.dtype)
        return ndarray(result)
    if isinstance(result, np.generic):  # CuPy's reductions give 0-d arrays, not scalars
        return ndarray(np.asarray(result))
    if isinstance(result, tuple):
        return tuple(_wrap(r) for r in result)
    return result


def _index(key):
    """Unwrap an index; a NumPy index array is copied to the device, as CuPy does."""
    if isinstance(key, ndarray):
        return key._a
    if isinstance(key, np.ndarray):
        _count("h2d", key)
        return key
    if isinstance(key, tuple):
        return tuple(_index(k) for k in key)
    return key


class MemoryPointer:
    """The ``data`` of a device array: its address."""

    def __init__(self, ptr: int):
        self.ptr = ptr


class ndarray:  # noqa: N801 - CuPy's name
    """A device array: a NumPy array that does not mix with host arrays."""

    __array_priority__ = 100
    __hash__ = None

    def __init__(self, array: np.ndarray):
        self._a = array

    dtype = property(lambda self: self._a.dtype)
    shape = property(lambda self: self._a.shape)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    ndim = property(lambda self: self._a.ndim)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: ndarray(self._a.T))
    data = property(lambda self: MemoryPointer(_address(self._a)))

    @property
    def __cuda_array_interface__(self) -> dict:
        face = self._a.__array_interface__
        return {"shape": face["shape"], "typestr": face["typestr"], "data": face["data"],
                "strides": face["strides"], "version": 2}

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use "
                        "`.get()` to construct a NumPy array explicitly.")

    def __repr__(self) -> str:
        return f"fake_cupy.ndarray({self._a!r})"

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self):
        return (_wrap(row) for row in self._a)

    def _scalar(self):
        stats.scalar_reads += 1
        return self._a

    def __bool__(self) -> bool:
        return bool(self._scalar())

    def __int__(self) -> int:
        return int(self._scalar())

    def __float__(self) -> float:
        return float(self._scalar())

    def item(self):
        """Return the one element as a Python scalar (a read from the device)."""
        return self._scalar().item()

    def get(self, stream=None, order="C", out=None, blocking=True) -> np.ndarray:
        """Copy to the host (into ``out`` when given); counted."""
        if out is None:
            out = np.empty_like(self._a)
        if out.shape != self._a.shape or out.dtype != self._a.dtype:
            raise ValueError(f"out= has shape {out.shape} and dtype {out.dtype}, the array "
                             f"{self._a.shape} and {self._a.dtype}")
        np.copyto(out, self._a)
        _count("d2h", out)
        return out

    def set(self, arr: np.ndarray, stream=None) -> None:
        """Copy a host array of the same shape and dtype in; counted."""
        if not isinstance(arr, np.ndarray) or isinstance(arr, ndarray):
            raise TypeError(f"set() takes a NumPy array, got {type(arr).__name__}")
        if arr.shape != self._a.shape or arr.dtype != self._a.dtype:
            raise ValueError("set() needs the same shape and dtype")
        np.copyto(self._a, arr)
        _count("h2d", arr)

    def tobytes(self) -> bytes:
        """Return the bytes on the host (a copy from the device, counted)."""
        _count("d2h", self._a)
        return self._a.tobytes()

    def __getitem__(self, key):
        return _wrap(self._a[_index(key)])

    def __setitem__(self, key, value) -> None:
        if isinstance(value, np.ndarray) and not isinstance(value, ndarray):
            _count("h2d", value)  # CuPy copies a host value in
        else:
            value = _unwrap(value, "__setitem__")
        self._a[_index(key)] = value

    def reshape(self, *shape, order="C"):
        """Return a reshaped view, as NumPy's."""
        return ndarray(self._a.reshape(*shape, order=order))

    def view(self, dtype=None):
        """Return a view, possibly as another dtype."""
        return _wrap(self._a.view() if dtype is None else self._a.view(dtype))

    def astype(self, dtype, copy=True):
        """Return the array converted to ``dtype`` on the device."""
        return _wrap(self._a.astype(dtype, copy=copy))

    def copy(self, order="C"):
        """Return a device copy."""
        return ndarray(self._a.copy(order=order))

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        where = f"{ufunc.__name__}.{method}"
        out = kwargs.get("out")
        raw = getattr(ufunc, method)(*_unwrap(inputs, where), **_unwrap_kwargs(kwargs, where))
        if out is not None:
            return out[0] if isinstance(out, tuple) and len(out) == 1 else out
        return _wrap(raw)

    def __array_function__(self, func, kinds, args, kwargs):
        if func is np.shares_memory:  # CuPy's own, with its cost
            return shares_memory(*args, **kwargs)
        where = func.__name__
        return _wrap(func(*_unwrap(args, where), **_unwrap_kwargs(kwargs, where)))


def _forward(name: str, inplace: bool = False):
    def method(self, *args, **kwargs):
        result = getattr(self._a, name)(*_unwrap(args, name), **_unwrap_kwargs(kwargs, name))
        return self if inplace else _wrap(result)

    method.__name__ = name
    return method


for _name in ("sum", "max", "min", "mean", "prod", "any", "all", "cumsum", "argmax", "argmin",
              "nonzero", "ravel", "flatten", "transpose", "squeeze", "clip", "round", "fill",
              "__neg__", "__pos__", "__abs__", "__invert__", "__matmul__", "__rmatmul__",
              "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__"):
    setattr(ndarray, _name, _forward(_name))
for _base in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor",
              "lshift", "rshift"):
    setattr(ndarray, f"__{_base}__", _forward(f"__{_base}__"))
    setattr(ndarray, f"__r{_base}__", _forward(f"__r{_base}__"))
    setattr(ndarray, f"__i{_base}__", _forward(f"__i{_base}__", inplace=True))


# ----------------------------------------------------------------- module functions

def _device_function(fn, name: str):
    def function(*args, **kwargs):
        return _wrap(fn(*_unwrap(args, name), **_unwrap_kwargs(kwargs, name)))

    function.__name__ = name
    return function


def __getattr__(name: str):
    """Everything else CuPy has that NumPy has: types as they are, functions on device arrays."""
    if name.startswith("__"):
        raise AttributeError(name)
    obj = getattr(np, name)
    if isinstance(obj, (type, np.dtype)) or not callable(obj):
        return obj
    return _device_function(obj, name)


def asarray(a, dtype=None, order=None, *, blocking=False):
    """Return ``a`` on the device: a device array as is, anything else copied in (counted)."""
    if isinstance(a, ndarray):
        return a if dtype is None or a.dtype == np.dtype(dtype) else a.astype(dtype)
    host = np.asarray(a, dtype=dtype)
    _count("h2d", host)
    return _wrap(host.copy())


def array(a, dtype=None, copy=True, order="K"):
    """Return a device copy of ``a`` (a host array is copied in, counted)."""
    if isinstance(a, ndarray):
        return a.astype(dtype or a.dtype, copy=True)
    return asarray(a, dtype)


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True) -> np.ndarray:
    """Return a host copy of a device array (counted); anything else through ``np.asarray``."""
    if isinstance(a, ndarray):
        return a.get(stream=stream, out=out, blocking=blocking)
    return np.asarray(a)


def get_array_module(*args):
    """Return this module when any argument is a device array, else NumPy."""
    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else np


def shares_memory(a, b, max_work=None) -> bool:
    """NumPy's exact answer, counted: CuPy's gathers every element's address on the device
    (some 32 bytes each), sorts them and synchronises."""
    stats.exact_overlap_checks += 1
    return bool(np.shares_memory(_unwrap(a, "shares_memory"), _unwrap(b, "shares_memory"),
                                 max_work=max_work))


def unpackbits(a, axis=None, bitorder="big"):
    """NumPy's ``unpackbits`` without ``count``, as CuPy's."""
    return _wrap(np.unpackbits(_unwrap(a, "unpackbits"), axis=axis, bitorder=bitorder))


def repeat(a, repeats, axis=None):
    """NumPy's ``repeat`` with ``repeats`` an int, list or tuple only, as CuPy's."""
    if isinstance(repeats, (ndarray, np.ndarray)):
        raise ValueError("cupy.repeat: repeats must be an int, a list or a tuple")
    return _wrap(np.repeat(_unwrap(a, "repeat"), repeats, axis=axis))


# -------------------------------------------------------------------------- cupy.cuda

class Stream:
    """A stream: work happens at once; synchronisations are counted. ``with`` makes it the
    thread's current stream, as CuPy's does."""

    def __init__(self, null=False, non_blocking=False, ptr=0):
        self.ptr = 0 if null else id(self)

    def __enter__(self) -> "Stream":
        self._previous = _get_current_stream()
        _current.stream = self
        return self

    def __exit__(self, *exc) -> None:
        _current.stream = self._previous

    def synchronize(self) -> None:
        stats.stream_syncs += 1

    def wait_event(self, event) -> None:
        event.waited = True


class Event:
    """An event: the time it was recorded."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.time = None
        self.waited = False

    def record(self, stream=None) -> None:
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        return None


_null_stream = Stream(null=True)


def _get_current_stream():
    return getattr(_current, "stream", _null_stream)


def _get_elapsed_time(start: Event, stop: Event) -> float:
    return (stop.time - start.time) * 1e3


def _alloc_pinned_memory(size: int) -> bytearray:
    memory = bytearray(size)
    start = _address(np.frombuffer(memory, np.uint8)) if size else 0
    _pinned.append((start, start + size, memory))  # kept: its range stays pinned
    stats.pinned_allocations += 1
    return memory


class Device:
    """A device number (``Device()``: the thread's current one); ``use`` makes it current
    for the calling thread, as does ``with``."""

    def __init__(self, device: int | None = None):
        self.id = getattr(_current, "device", 0) if device is None else device

    def use(self) -> None:
        _current.device = stats.device_in_use = self.id

    def __enter__(self) -> "Device":
        self._previous = Device()
        self.use()
        return self

    def __exit__(self, *exc) -> None:
        self._previous.use()


class CUDARuntimeError(RuntimeError):
    """What CuPy raises when the CUDA runtime fails."""


def _get_device_count() -> int:
    if stats.device_count < 1:
        raise CUDARuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
    return stats.device_count


_NCCL_ITEMSIZE = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2}


class NcclCommunicator:
    """An NCCL communicator that records its calls; on one rank it copies send to receive."""

    def __init__(self, ndev: int, commId, rank: int):  # noqa: N803 - CuPy's names
        self.ndev, self.comm_id, self.rank = ndev, commId, rank

    def allReduce(self, sendbuf: int, recvbuf: int, count: int,  # noqa: N802 - CuPy's name
                  datatype: int, op: int, stream: int) -> None:
        stats.nccl_calls.append(("allReduce", count, datatype, op, stream))
        if self.ndev == 1 and sendbuf != recvbuf:
            ctypes.memmove(recvbuf, sendbuf, count * _NCCL_ITEMSIZE[datatype])


def _module(name: str, **members) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(members)
    return module


runtime = _module("cupy.cuda.runtime", getDeviceCount=_get_device_count,
                  getDevice=lambda: stats.device_in_use or 0,
                  getDeviceProperties=lambda device: {"name": b"Fake GPU (NumPy)"},
                  CUDARuntimeError=CUDARuntimeError)
nccl = _module("cupy.cuda.nccl", available=True, get_version=lambda: 22304,
               get_unique_id=lambda: tuple(range(128)), NcclCommunicator=NcclCommunicator)
cuda = _module("cupy.cuda", Stream=Stream, Event=Event, Device=Device,
               get_current_stream=_get_current_stream, get_elapsed_time=_get_elapsed_time,
               alloc_pinned_memory=_alloc_pinned_memory, runtime=runtime, nccl=nccl)


class _Generator:
    """CuPy's ``Generator``: NumPy's drawing device arrays."""

    def __init__(self, seed):
        self._g = np.random.default_rng(seed)

    def random(self, size=None, dtype=np.float64):
        return _wrap(np.asarray(self._g.random(size, dtype=dtype)))

    def standard_normal(self, size=None, dtype=np.float64):
        return _wrap(np.asarray(self._g.standard_normal(size, dtype=dtype)))


random = _module("cupy.random", default_rng=_Generator)
linalg = _module("cupy.linalg", norm=_device_function(np.linalg.norm, "norm"))


def install(monkeypatch) -> types.ModuleType:
    """Put this fake and its submodules into ``sys.modules`` through pytest's ``monkeypatch``."""
    this = sys.modules[__name__]
    for name, module in [("cupy", this), ("cupy.cuda", cuda), ("cupy.cuda.runtime", runtime),
                         ("cupy.cuda.nccl", nccl), ("cupy.random", random),
                         ("cupy.linalg", linalg)]:
        monkeypatch.setitem(sys.modules, name, module)
    return this
